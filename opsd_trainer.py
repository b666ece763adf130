"""OPSDTrainer: on-policy self-distillation as a subclass of TRL's `SDFTTrainer` (docs/method.md §1).

    from opsd_trainer import OPSDTrainer
    from opsd.configuration.config import OPSDConfig
    trainer = OPSDTrainer(model, args=OPSDConfig(...), train_dataset=ds, processing_class=tok, peft_config=lora)

What differs from `SDFTTrainer` (vLLM colocate/server/sleep/TP rollouts, the teacher kinds and the buffered
generation over the accumulation window are TRL's): OPSD's prompts with their own thinking switches
(`opsd.method.prompts`), exact positions (`opsd.method.scoring`), the clipped divergence computed in chunks from hidden
states and normalised by the step's valid tokens (`opsd.method.loss`), per-row rollout seeds (`opsd.method.seeds`), the
EMA teacher started from the initial adapter and checkpointed (`opsd.method.ema_teacher`), eval-mode teacher
forwards, non-finite steps skipped (`opsd.run.callbacks.NonFiniteGuard`), and phase timing and OPSD metrics.
"""

from __future__ import annotations

import functools
import logging
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from peft import PeftModel
from trl.experimental.sdft import SDFTTrainer
from trl.experimental.sdft.teacher_sync import PEFTAdapterEMACallback

from opsd.configuration.config import OPSDConfig
from opsd.method.ema_teacher import InitialisedAdapterEMA
from opsd.method.loss import chunked_opsd_loss
from opsd.method.prompts import PromptBuilder
from opsd.method.scoring import completion_hidden, eval_mode, left_pad, lm_head_weight, loss_token_mask
from opsd.method.seeds import RolloutSeeds, SeededLLM, row_seed
from opsd.method.trl_compat import engine_max_num_seqs, restore_lora_dropout
from opsd.method.weights import merged_named_weights, push_weights
from opsd.run import completions
from opsd.run.callbacks import NonFiniteGuard, PhaseClock, StepTimer

logger = logging.getLogger(__name__)


class OPSDTrainer(SDFTTrainer):
    """Clipped-JSD on-policy self-distillation. One optimizer step, in the order the methods below run:

    1. `training_step` (one call per micro-batch; its time is the `train_micro` phase) gets its micro-batch
       from TRL's `_prepare_inputs`, which on the step's first micro-batch builds the whole step's batch:
       `_prepare_training_batch`
       a. `_tokenize_prompts`: the student prompt of each problem (`opsd.method.prompts`);
       b. `_generate` (phase `rollout`) -> `_generate_vllm`: `_sync_rollout_weights` when the weights changed
          (phase `weight_sync`: merged LoRA weights pushed into the colocated engine), then TRL's generate
          with one seed per row (`_rollout_seeds`); or `_generate_transformers` in eval mode;
       c. `TeacherRowBuilder.build` (TRL's teacher-context hook): `[teacher prompt ; completion]` rows;
       d. the step's valid-token count over all processes: the loss denominator.
    2. `compute_loss` (part `score_loss`): `score_completions` gives both roles' final hidden states of the
       completion tokens (the student with gradients, the teacher under
       `_get_teacher_context_for_self_distillation` in eval mode), `chunked_opsd_loss` their clipped
       divergence; then the `opsd/*` metrics and, every `completions_steps`, the completions log.
    3. TRL's backward; after the last micro-batch TRL's optimizer step, which `NonFiniteGuard` skips for a
       non-finite loss or gradient; `InitialisedAdapterEMA` updates an EMA teacher; `StepTimer` logs the
       step's phases (`time/<phase>_s`) and memory.
    4. On a checkpoint `_save` writes the student adapter at its root (and the EMA teacher its state); on
       resume `_load_optimizer_and_scheduler` restores the EMA teacher too.

    `sample_probe_rollouts`, `score_completions` and `record_metrics` are what `opsd.run.probe` uses.
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
        with engine_max_num_seqs(getattr(config, "vllm_max_num_seqs", 0)):
            super().__init__(*args, **kwargs)
        a: OPSDConfig = self.args
        self.prompt_builder = PromptBuilder(
            self.processing_class,
            student_template_file=a.student_prompt_file,
            teacher_template_file=a.teacher_prompt_file,
            student_thinking=a.student_thinking,
            teacher_thinking=a.teacher_thinking,
            max_teacher_prompt_tokens=a.max_teacher_prompt_length,
        )
        self.teacher_context_builder = TeacherRowBuilder(self)
        self.seeds = RolloutSeeds(a.seed, step_of=lambda: self.state.global_step)
        self.clock = PhaseClock()
        self.add_callback(StepTimer(self._metrics["train"], self.clock))
        self.nonfinite = NonFiniteGuard(self._metrics["train"], self.accelerator, a.max_nonfinite_steps)
        self.add_callback(self.nonfinite)
        # lora_dropout applies to the student's training forward, as in peft; rollouts and every teacher
        # forward run in eval mode (`_generate_transformers`, `_get_teacher_context_for_self_distillation`).
        restore_lora_dropout(self.accelerator.unwrap_model(self.model))
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
        self._metrics["train"]["prompts/teacher_truncated"].append(
            float(self.teacher_context_builder.num_truncated)
        )
        return batch

    def _tokenize_prompts(self, prompts):
        # The dataset's `prompt` is the bare problem; the student turn is rendered here with its own
        # thinking switch, and its ids go to the engine unchanged (chat-template tokens included).
        return [self.prompt_builder.student_ids(p) for p in prompts]

    def _generate(self, prompt_ids):
        with self.clock.phase("rollout") as timed:
            out = super()._generate(prompt_ids)
        n_tokens = sum(len(c) for c in out[1])
        self._metrics["train"]["rollout/tokens_per_s"].append(n_tokens / max(timed.seconds, 1e-9))
        return out

    def _generate_vllm(self, prompt_ids):
        if self.state.global_step != self._last_loaded_step:
            with self.clock.phase("weight_sync"):
                self._sync_rollout_weights()
            self._last_loaded_step = self.state.global_step
        gen = self.vllm_generation
        if gen.mode == "colocate":
            if not isinstance(gen.llm, SeededLLM):
                gen.llm = self.seeds.seeded(gen.llm, self._first_rollout_row)
        else:
            # The server samples the whole batch from one seed (its i-th sample of a prompt from seed + i).
            rank = self.accelerator.process_index // self.args.vllm_tensor_parallel_size
            gen.generation_kwargs = {
                **(gen.generation_kwargs or {}),
                "seed": row_seed(self.args.seed, self.seeds.step, rank),
            }
        return super()._generate_vllm(prompt_ids)

    def _first_rollout_row(self, num_rows: int) -> int:
        """Global position in the step's batch of the first of this process's `num_rows` colocated prompts.

        Each process generates its contiguous share of the step's global generation batch (TRL's sampler),
        and a tensor-parallel group generates the shares of its ranks in rank order, so the position is the
        group's first rank x rows per rank. Hence every row of a step has its own seed (repeated prompts get
        different samples), a resumed run draws the same rollouts, and the rollouts do not depend on how many
        processes share the step.
        """
        tp = self.args.vllm_tensor_parallel_size
        first = self.accelerator.process_index // tp * tp
        return first * (num_rows // tp)

    def _sync_rollout_weights(self) -> None:
        gen = self.vllm_generation
        if (
            gen.mode != "colocate"
            or self.is_deepspeed_enabled
            and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        ):
            gen.sync_weights()  # TRL's path: server mode, sharded parameters
            return
        # Merged weights are computed out of place: TRL's merge_adapter/unmerge_adapter round trip perturbs
        # the base weights by rounding error, which would slowly move the fixed teacher.
        weights = list(merged_named_weights(self.accelerator.unwrap_model(self.model)))
        llm = gen.llm
        if self.accelerator.device.type == "cpu":
            # vLLM's CPU backend packs float32 linear weights for oneDNN, so per-parameter `load_weights`
            # fails; reloading in checkpoint format re-runs that packing, and a tied lm_head is rebuilt.
            tied = self.model.config.get_text_config().tie_word_embeddings
            push_weights(llm, weights, tie_word_embeddings=tied)
        else:
            if gen.enable_sleep_mode:
                llm.wake_up(tags=["weights"])
                gen._llm_weights_sleeping = False
            llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)
            llm.reset_prefix_cache()

    def _generate_transformers(self, prompt_ids):
        # Rollouts come from the policy without dropout, as the vLLM engine's do.
        with eval_mode(self.accelerator.unwrap_model(self.model)):
            return super()._generate_transformers(prompt_ids)

    # -- 2. scoring and loss -----------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("OPSDTrainer does not return outputs")
        a: OPSDConfig = self.args
        with self.clock.part("score_loss"):
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            width = inputs["teacher_input_ids"].size(1) - completion_ids.size(1)
            scores = self.score_completions(
                model,
                inputs["prompt_ids"],
                inputs["prompt_mask"],
                inputs["teacher_input_ids"][:, :width],
                inputs["teacher_attention_mask"][:, :width],
                completion_ids,
                completion_mask,
            )
            # Hidden states come flattened over completion_mask; the loss counts the subset keep_N.
            keep_N = self._loss_mask(completion_ids, completion_mask)[completion_mask.bool()].bool()
            loss_sum, stats = chunked_opsd_loss(
                scores.student_hidden_NH[keep_N],
                scores.teacher_hidden_NH[keep_N],
                scores.student_weight_VH,
                scores.teacher_weight_VH,
                target_ids_N=completion_ids[completion_mask.bool()][keep_N],
                chunk_size=a.loss_chunk_size,
                beta=a.beta,
                temperature=a.effective_loss_temperature,
                clip=a.jsd_token_clip,
                clip_mode=a.clip_mode,
                top_k=a.top_k_loss,
                loss_type=a.loss_type,
            )
            # Gradients are averaged over processes by DDP/DeepSpeed, hence the factor num_processes.
            denom = inputs["num_loss_tokens"].clamp(min=1).to(loss_sum.dtype)
            loss = loss_sum / denom * self.accelerator.num_processes
            self._record_loss_stats(loss_sum.detach(), stats)
            if self._completions_due():
                self._log_completions(inputs, scores)
        return loss

    def score_completions(
        self, model, student_ids, student_mask, teacher_ids, teacher_mask, completion_ids, completion_mask
    ) -> CompletionScores:
        """Both roles' final hidden states of the valid completion tokens of a batch, and their lm_heads.

        The student goes through `model` (the wrapped model in training, so DDP/DeepSpeed see the forward),
        with gradients if they are enabled; the teacher through TRL's teacher context in eval mode, without
        gradients. Prompts are left-padded, completions right-padded (`opsd.method.scoring`).
        """
        student_hidden_NH = self._completion_hidden(
            model, student_ids, student_mask, completion_ids, completion_mask
        )
        with torch.no_grad(), self._get_teacher_context_for_self_distillation():
            teacher_hidden_NH = self._completion_hidden(
                self.teacher_model, teacher_ids, teacher_mask, completion_ids, completion_mask
            )
        unwrap = self.accelerator.unwrap_model
        return CompletionScores(
            student_hidden_NH=student_hidden_NH,
            teacher_hidden_NH=teacher_hidden_NH.detach(),
            student_weight_VH=lm_head_weight(unwrap(model)),
            teacher_weight_VH=lm_head_weight(unwrap(self.teacher_model)).detach(),
        )

    @contextmanager
    def _get_teacher_context_for_self_distillation(self):
        # The teacher must be a deterministic function of its weights: in training mode LoRA dropout would
        # make the EMA adapter and the dynamic teacher (the student itself) score the same tokens differently
        # on every call. So every teacher forward (loss, probe) runs in eval mode.
        with (
            eval_mode(self.accelerator.unwrap_model(self.teacher_model)),
            super()._get_teacher_context_for_self_distillation(),
        ):
            yield

    def _completion_hidden(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        return completion_hidden(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            fix_positions=self.args.fix_position_ids,
            pad_token_id=self.processing_class.pad_token_id,
        )

    def _loss_mask(self, completion_ids, completion_mask):
        a: OPSDConfig = self.args
        pad = None if a.fix_position_ids else self.processing_class.pad_token_id
        return loss_token_mask(
            completion_ids, completion_mask, skip=a.num_loss_tokens_to_skip, pad_token_id=pad
        )

    def _record_loss_stats(self, loss_sum: torch.Tensor, stats: dict) -> None:
        n = max(float(stats["num_tokens"]), 1.0)
        self.record_metrics(
            {
                "opsd/divergence": float(stats["divergence"]) / n,
                "opsd/clipped_frac": float(stats["clipped_frac"]) / n,
                "opsd/top1_agree": float(stats["top1_agree"]) / n,
                "opsd/loss_per_token": float(loss_sum) / n,
            }
        )

    def _completions_due(self) -> bool:
        """The first micro-batch of every `completions_steps`-th optimizer step, on the main process."""
        every = self.args.completions_steps
        return (
            every > 0
            and self.model.training
            and self.accelerator.is_main_process
            and self.state.global_step % every == 0
            and self._step % self.args.steps_per_generation == 0
        )

    def _log_completions(self, inputs, scores: CompletionScores) -> None:
        a: OPSDConfig = self.args
        problems, references = self.teacher_context_builder.texts
        rows = completions.completion_rows(
            step=self.state.global_step,
            problems=problems,
            references=references,
            completion_ids_BC=inputs["completion_ids"],
            completion_mask_BC=inputs["completion_mask"],
            student_hidden_NH=scores.student_hidden_NH.detach(),
            teacher_hidden_NH=scores.teacher_hidden_NH,
            student_weight_VH=scores.student_weight_VH.detach(),
            teacher_weight_VH=scores.teacher_weight_VH,
            tokenizer=self.processing_class,
            rows=a.completions_rows,
            beta=a.beta,
            temperature=a.effective_loss_temperature,
            top_k=a.top_k_loss,
        )
        completions.append(a.output_dir, rows)
        completions.to_trackers(a.report_to, rows)

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

    # -- for the probe -----------------------------------------------------------------------------------------
    def sample_probe_rollouts(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """One completion per prompt from the current student, for the probe (`opsd.run.probe`).

        Sampled like a training rollout but from seeds no training step uses, with the global random state
        restored afterwards (the transformers engine draws from it), and kept out of the step's timing and
        rollout metrics: a run with the probe draws the same training rollouts as one without.
        """
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with self.seeds.probe(), torch.random.fork_rng(devices=devices):
            _, completions_ = super()._generate(prompt_ids)
        return [list(c) for c in completions_]

    def record_metrics(self, metrics: dict[str, float]) -> None:
        """Adds values to the current logging window (averaged there like every metric)."""
        window = self._metrics["train" if self.model.training else "eval"]
        for key, value in metrics.items():
            window[key].append(value)


@dataclass
class CompletionScores:
    """What `OPSDTrainer.score_completions` returns: hidden states (N, H) of the valid completion tokens, flattened
    over the completion mask, and the lm_head weights (V, H) that turn them into each role's logits."""

    student_hidden_NH: torch.Tensor
    teacher_hidden_NH: torch.Tensor
    student_weight_VH: torch.Tensor
    teacher_weight_VH: torch.Tensor


class TeacherRowBuilder:
    """Builds the `[teacher prompt ; completion]` rows of a batch (SDFTTrainer's teacher-context hook)."""

    def __init__(self, trainer: OPSDTrainer):
        self.trainer = trainer
        self.num_truncated = 0

    def select_generation_prompts(self, prompts, privileged_contexts):
        return prompts

    def build(self, prompts, privileged_contexts, completion_ids, completion_mask):
        built = [
            self.trainer.prompt_builder.teacher_ids(p, c)
            for p, c in zip(prompts, privileged_contexts, strict=True)
        ]
        self.num_truncated = sum(t.truncated for t in built)
        self.texts = (list(prompts), list(privileged_contexts))  # for the completions log
        ids, mask = left_pad(
            [t.ids for t in built], self.trainer.processing_class.pad_token_id, completion_ids.device
        )
        return {
            "teacher_input_ids": torch.cat([ids, completion_ids], dim=1),
            "teacher_attention_mask": torch.cat([mask, completion_mask], dim=1),
        }
