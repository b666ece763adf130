"""OPSDTrainer: on-policy self-distillation as a subclass of TRL's `SDFTTrainer` (docs/method.md §1).

    from opsd_trainer import OPSDTrainer
    from opsd.configuration.config import OPSDConfig
    trainer = OPSDTrainer(model, args=OPSDConfig(...), train_dataset=ds, processing_class=tok, peft_config=lora)

What differs from `SDFTTrainer` (vLLM colocate/server/sleep/TP rollouts, the teacher kinds and the buffered
generation over the accumulation window are TRL's): OPSD's prompts with their own thinking switches
(`opsd.method.prompts`), exact positions (`opsd.method.hidden`), the clipped divergence computed in chunks from hidden
states and normalised by the step's valid tokens (`opsd.method.loss`, `opsd.method.loss_step`), per-row rollout seeds
(`opsd.method.seeds`, `opsd.method.rollouts`), the
EMA teacher started from the initial adapter and checkpointed (`opsd.method.ema_teacher`), eval-mode teacher
forwards, non-finite steps skipped (`opsd.run.callbacks.NonFiniteGuard`), and phase timing and OPSD metrics.
For other families than Qwen3 (docs/families.md): the loss applies the model's own logit transform, checked
against its logits on each model's first forward (`opsd.method.logits`), and with a colocated engine the model's
classes are its own, out of reach of vLLM's in-place decoration (`opsd.method.engine_classes`).
"""

from __future__ import annotations

import functools
import logging
import textwrap

import torch
from peft import PeftModel
from trl.experimental.sdft import SDFTTrainer
from trl.experimental.sdft.teacher_sync import PEFTAdapterEMACallback

from opsd.configuration.config import OPSDConfig
from opsd.method.ema_teacher import InitialisedAdapterEMA
from opsd.method.engine_classes import engine_start_refusal, own_classes
from opsd.method.loss_step import LossHooks
from opsd.method.prompts import PromptBuilder
from opsd.method.rollouts import RolloutHooks, TeacherRowBuilder
from opsd.method.seeds import RolloutSeeds
from opsd.method.trl_compat import engine_max_num_seqs, restore_lora_dropout
from opsd.run.callbacks import NonFiniteGuard, PhaseClock, StepTimer
from opsd.speed.compiled_layers import compile_decoder_layers

logger = logging.getLogger(__name__)


class OPSDTrainer(RolloutHooks, LossHooks, SDFTTrainer):
    """Clipped-JSD on-policy self-distillation. One optimizer step, in the order its methods run (the rollout
    side in `opsd.method.rollouts.RolloutHooks`, the loss side in `opsd.method.loss_step.LossHooks`):

    1. `training_step` (one call per micro-batch; its time is the `train_micro` phase) gets its micro-batch
       from TRL's `_prepare_inputs`, which on the step's first micro-batch builds the whole step's batch:
       `_prepare_training_batch`
       a. `_tokenize_prompts`: the student prompt of each problem (`opsd.method.prompts`);
       b. `_generate` (phase `rollout`) -> `_generate_vllm`: `_sync_rollout_weights` when the weights changed
          (phase `weight_sync`: merged LoRA weights pushed into the colocated engine), then TRL's generate
          with one seed per row (`_first_rollout_row`); or `_generate_transformers` in eval mode;
       c. `TeacherRowBuilder.build` (TRL's teacher-context hook): `[teacher prompt ; completion]` rows;
       d. the step's valid-token count over all processes: the loss denominator; each row's problem and
          reference, for the completions log.
    2. `compute_loss` (part `score_loss`): `completion_hidden_states` gives both roles' final hidden states of the
       completion tokens (the student with gradients, the teacher under
       `_get_teacher_context_for_self_distillation` in eval mode), `chunked_opsd_loss` their clipped
       divergence; then the `opsd/*` metrics and, every `completions_steps`, the completions log.
    3. TRL's backward; after the last micro-batch TRL's optimizer step, which `NonFiniteGuard` skips for a
       non-finite loss or gradient; `InitialisedAdapterEMA` updates an EMA teacher; `StepTimer` logs the
       step's phases (`time/<phase>_s`) and memory.
    4. On a checkpoint `_save` writes the student adapter at its root (and the EMA teacher its state); on
       resume `_load_optimizer_and_scheduler` restores the EMA teacher too.

    `sample_probe_rollouts`, `completion_hidden_states` and `record_metrics` are what `opsd.run.probe` uses.
    """

    config_cls = OPSDConfig
    _name = "OPSD"
    _tag_names = ["trl", "opsd"]
    # The model card cites the method trained here (TRL's SDFTTrainer would cite SDFT).
    _paper = {
        "title": "Self-Distilled Reasoner: On-Policy Self-Distillation for Large Language Models",
        "id": "2601.18734",
        "citation": textwrap.dedent("""\
            @article{zhao2026selfdistilled,
                title        = {{Self-Distilled Reasoner: On-Policy Self-Distillation for Large Language Models}},
                author       = {Siyan Zhao and Zhihui Xie and Mengchen Liu and Jing Huang and Guan Pang and Feiyu Chen and Aditya Grover},
                year         = 2026,
                eprint       = {arXiv:2601.18734}
            }"""),
    }
    # The TRL methods overridden here; a test fails if TRL stops calling one of them by this name.
    TRL_HOOKS = (
        "_setup_teacher_model",
        "training_step",
        "_prepare_training_batch",
        "_tokenize_prompts",
        "_generate",
        "_generate_vllm",
        "_generate_transformers",
        "_get_teacher_context_for_self_distillation",
        "compute_loss",
        "_save",
        "_load_optimizer_and_scheduler",
    )

    # -- set-up -------------------------------------------------------------------------------------------------
    def __init__(self, *args, **kwargs):
        config = kwargs.get("args", args[1] if len(args) > 1 else None)
        colocated = getattr(config, "use_vllm", False) and getattr(config, "vllm_mode", "") == "colocate"
        model = kwargs.get("model", args[0] if args else None)
        if colocated and isinstance(model, torch.nn.Module):  # before the engine starts, which may decorate
            own_classes(model)  # the model's classes in place
        with (
            engine_max_num_seqs(getattr(config, "vllm_max_num_seqs", 0)),
            engine_start_refusal(colocated, model),
        ):
            super().__init__(*args, **kwargs)
        a: OPSDConfig = self.args
        if colocated and isinstance(self.teacher_model, torch.nn.Module):
            own_classes(self.teacher_model)
        self.prompt_builder = PromptBuilder(
            self.processing_class,
            student_template_file=a.student_prompt_file,
            teacher_template_file=a.teacher_prompt_file,
            student_thinking=a.student_thinking,
            teacher_thinking=a.teacher_thinking,
            thinking_switch=a.thinking_switch,
            max_teacher_prompt_tokens=a.max_teacher_prompt_length,
        )
        self.teacher_context_builder = TeacherRowBuilder(self)
        self.seeds = RolloutSeeds(a.seed, step_of=lambda: self.state.global_step)
        self.clock = PhaseClock()
        # The loss's logit transform (opsd.method.logits), picked and checked on each model's first forward.
        self.logit_transform = None
        self.logits_checked: set[int] = set()
        self.add_callback(StepTimer(self._metrics["train"], self.clock))
        self.nonfinite = NonFiniteGuard(self._metrics["train"], self.accelerator, a.max_nonfinite_steps)
        self.add_callback(self.nonfinite)
        # lora_dropout applies to the student's training forward, as in peft; rollouts and every teacher
        # forward run in eval mode (`_generate_transformers`, `_get_teacher_context_for_self_distillation`).
        restore_lora_dropout(self.accelerator.unwrap_model(self.model))
        if a.compile_layers:
            compile_decoder_layers(self.accelerator.unwrap_model(self.model))
        if self.use_vllm and self.vllm_generation.mode == "colocate":
            # Training reads token ids only; vLLM would otherwise detokenise every sequence at every decode
            # step in this process, between GPU steps (docs/performance.md).
            gen = self.vllm_generation
            gen.generation_kwargs = {"detokenize": False, **(gen.generation_kwargs or {})}

    def _setup_teacher_model(self) -> None:
        super()._setup_teacher_model()
        ema = [cb for cb in self.callback_handler.callbacks if type(cb) is PEFTAdapterEMACallback]
        for cb in ema:
            self.callback_handler.remove_callback(cb)
            self.add_callback(
                InitialisedAdapterEMA(
                    model=cb.model,
                    teacher_adapter_name=cb.teacher_adapter_name,
                    update_rate=cb.update_rate,
                    sync_steps=cb.sync_steps,
                    accelerator=cb.accelerator,
                    step_skipped=lambda: self.nonfinite.last_skipped,
                )
            )

    # -- 1. a micro-batch, and the step's batch on its first one -----------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        with self.clock.phase("train_micro"):
            out = super().training_step(model, inputs, num_items_in_batch)
        self.nonfinite.note_loss(out)
        return out

    def _prepare_training_batch(self, inputs):
        batch = super()._prepare_training_batch(inputs)
        # The whole accumulation window is generated here at once, so its valid-token count across all
        # processes is known before the first backward: that count is the loss denominator.
        local = self._loss_mask(batch["completion_ids"], batch["completion_mask"]).sum()
        batch["num_loss_tokens"] = self.accelerator.reduce(local.clone(), reduction="sum")
        # Lists are sliced into micro-batches with the tensors (TRL's split_tensor_dict).
        batch["problems"] = [row["prompt"] for row in inputs]
        batch["references"] = [row.get("privileged_context") for row in inputs]
        self._metrics["train"]["prompts/teacher_truncated"].append(
            float(self.teacher_context_builder.num_truncated)
        )
        return batch

    def _tokenize_prompts(self, prompts):
        # The dataset's `prompt` is the bare problem; the student turn is rendered here with its own
        # thinking switch, and its ids go to the engine unchanged (chat-template tokens included).
        return [self.prompt_builder.student_ids(p) for p in prompts]

    # -- 4. checkpoints ----------------------------------------------------------------------------------------
    def _save(self, output_dir=None, state_dict=None):
        # A checkpoint holds the student adapter only, at its root; the EMA teacher is saved in float32 by
        # InitialisedAdapterEMA. With a second adapter peft writes every adapter to a subfolder, and
        # transformers' resume then loads the subfolders only: the student would restart from its init.
        model = self.accelerator.unwrap_model(self.model)
        if not isinstance(model, PeftModel) or len(model.peft_config) == 1:
            return super()._save(output_dir, state_dict)
        model.save_pretrained = functools.partial(
            type(model).save_pretrained, model, selected_adapters=[model.active_adapter]
        )
        try:
            return super()._save(output_dir, state_dict)
        finally:
            del model.save_pretrained

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Called on every resume, on every backend (DeepSpeed included), before training begins.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            for cb in self.callback_handler.callbacks:
                if isinstance(cb, InitialisedAdapterEMA):
                    cb.restore(checkpoint)

    # -- for the probe and the loss side ---------------------------------------------------------------------
    def record_metrics(self, metrics: dict[str, float]) -> None:
        """Adds values to the current logging window (averaged there like every metric)."""
        window = self._metrics["train" if self.model.training else "eval"]
        for key, value in metrics.items():
            window[key].append(value)
