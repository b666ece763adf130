"""OPSDTrainer: on-policy self-distillation as a subclass of TRL's `SDFTTrainer` (docs/method.md §1).

    from opsd_trainer import OPSDTrainer
    from opsd.config import OPSDConfig
    trainer = OPSDTrainer(model, args=OPSDConfig(...), train_dataset=ds, processing_class=tok, peft_config=lora)

What differs from `SDFTTrainer` (everything else — vLLM colocate/server/sleep/TP rollouts, LoRA merge for
the weight sync, teacher kinds, buffered generation over the accumulation window — is TRL's):
- prompts: the student prompt and the teacher prompt (with the privileged reference) come from
  `opsd.prompts`, each with its own thinking switch; over-long teacher prompts are cut inside the reference;
- positions: every real token's position is its index in its own unpadded sequence, as in the rollout
  engine (`fix_position_ids=False` reproduces the reference code's shift by the prompt pad count);
- loss: the clipped generalized JSD of `opsd.loss`, computed in chunks from final hidden states so the
  `[batch, completion, vocab]` logits never exist, normalised by the number of valid completion tokens
  of the whole optimizer step across accumulation and processes;
- rollouts: each row of a step's global batch is sampled with its own seed (`PerRowSeeds`), so resumed runs
  and runs on any number of processes draw the same rollouts;
- weight sync on CPU vLLM goes through `reload_weights` (per-parameter `load_weights` fails there);
- teacher: every teacher forward runs in eval mode (no dropout); the LoRA EMA teacher starts from the initial
  adapter, is averaged in float32 and saved with every checkpoint; `lora_dropout` reaches the student;
- non-finite steps: skipped without any update, and the run stops after `max_nonfinite_steps` in a row;
- metrics: divergence, clipped share, top-1 agreement, rollout tokens/s and step time by phase; the probe
  (`opsd.probe`, added by opsd_train.py) scores held-out problems with the current student and teacher.
"""

from __future__ import annotations

import functools
import logging
import textwrap
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from peft import PeftModel
from trl.experimental.sdft import SDFTTrainer
from trl.experimental.sdft.teacher_sync import PEFTAdapterEMACallback

from opsd import completions
from opsd.callbacks import NonFiniteGuard, StepTimer
from opsd.config import OPSDConfig
from opsd.loss import chunked_opsd_loss
from opsd.prompts import PromptBuilder
from opsd.scoring import completion_hidden, eval_mode, left_pad, lm_head_weight, loss_token_mask
from opsd.weights import merged_named_weights, push_weights

logger = logging.getLogger(__name__)


class InitialisedAdapterEMA(PEFTAdapterEMACallback):
    """TRL's LoRA EMA teacher, but starting from the student's initial adapter instead of zeros, kept in
    float32, saved with every checkpoint and restored on resume.

    So the EMA teacher is the initial policy at step 0 and afterwards the exponential moving average of the
    trainable weights, teacher_t = decay * teacher_{t-1} + (1 - decay) * student_t (docs/method.md §1).
    The average lives in a float32 copy (`shadow_weights`) that is cast into the teacher adapter after each
    update: in bf16, 0.999 * x rounds back to x, so a bf16 average would barely move. A resumed run reloads
    that copy from `STATE_FILE` in the checkpoint instead of restarting the teacher from the student. A step
    for which `step_skipped()` is true (non-finite, no update) leaves the teacher as it is.
    """

    STATE_FILE = "ema_teacher.pt"

    def __init__(self, *args, step_skipped=lambda: False, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_skipped = step_skipped
        self._resumed: dict[str, torch.Tensor] | None = None

    def _unwrapped(self):
        return self.accelerator.unwrap_model(self.model) if self.accelerator is not None else self.model

    def _initialize_teacher_adapter(self):
        if self._initialized:
            return
        super()._initialize_teacher_adapter()
        start = self._resumed if self._resumed is not None else self._get_student_state_dict()
        device = next(iter(self._get_student_state_dict().values())).device
        self.shadow_weights = {k: v.detach().to(device, torch.float32, copy=True) for k, v in start.items()}
        self._copy_to_teacher()

    def _copy_to_teacher(self) -> None:
        from peft import set_peft_model_state_dict

        # load_state_dict copies into the existing parameters, casting to their dtype.
        set_peft_model_state_dict(
            self._unwrapped(), self.shadow_weights, adapter_name=self.teacher_adapter_name
        )

    @torch.no_grad()
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.sync_steps != 0 or self.step_skipped():
            return
        if not self._initialized:
            self._initialize_teacher_adapter()
        for key, student in self._get_student_state_dict().items():
            self.shadow_weights[key].mul_(1 - self.update_rate).add_(student.float(), alpha=self.update_rate)
        self._copy_to_teacher()

    def on_save(self, args, state, control, **kwargs):
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if state.is_world_process_zero and ckpt.is_dir() and self._initialized:
            shadow = {k: v.cpu() for k, v in self.shadow_weights.items()}
            torch.save({"shadow": shadow, "update_rate": self.update_rate}, ckpt / self.STATE_FILE)

    def restore(self, checkpoint_dir: str | Path) -> None:
        """Continue the average saved in `checkpoint_dir` (call before or after the teacher adapter exists)."""
        path = Path(checkpoint_dir) / self.STATE_FILE
        if not path.is_file():
            logger.warning(
                "%s has no %s (written before the EMA teacher was checkpointed): the EMA teacher restarts "
                "from the resumed student",
                checkpoint_dir,
                self.STATE_FILE,
            )
            return
        shadow = torch.load(path, map_location="cpu")["shadow"]
        expected = self._get_student_state_dict().keys()
        if shadow.keys() != expected:
            raise ValueError(
                f"{path} holds an EMA teacher for other LoRA weights ({len(shadow)} tensors, {len(expected)} "
                "expected): resume with the LoRA settings (lora_r, lora_target_modules) the run started with"
            )
        self._resumed = shadow
        if self._initialized:
            device = next(iter(self.shadow_weights.values())).device
            self.shadow_weights = {k: v.to(device, torch.float32) for k, v in shadow.items()}
            self._copy_to_teacher()


def restore_lora_dropout(model) -> None:
    """Gives every LoRA dropout of a peft model its adapter's configured `lora_dropout` back.

    TRL's `disable_dropout` (on by default) zeroes every `nn.Dropout` of the student, LoRA's included, which
    would make `lora_dropout` a dead switch; the base model's own dropout stays off.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return
    for name, module in model.named_modules():
        parent, _, adapter = name.rpartition(".")
        if not isinstance(module, torch.nn.Dropout) or not parent.endswith("lora_dropout"):
            continue
        if adapter in model.peft_config:
            module.p = model.peft_config[adapter].lora_dropout


@contextmanager
def engine_max_num_seqs(limit: int):
    """While active, TRL's colocated vLLM engine is built with `max_num_seqs=limit` (if limit > 0).

    TRL sizes it from the batch (per-device batch x TP x steps per generation) inside SDFTTrainer.__init__,
    with no setting of its own. On vLLM's CPU backend the numerics of a decode step depend on how many
    sequences it holds, so a seeded rollout may differ between 1 and 2 processes; one sequence at a time
    makes rollouts independent of how the batch is split.
    """
    if limit <= 0:
        yield
        return
    from trl.generation import vllm_generation

    original = vllm_generation.VLLMGeneration

    class Limited(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "max_num_seqs": limit})

    vllm_generation.VLLMGeneration = Limited
    try:
        yield
    finally:
        vllm_generation.VLLMGeneration = original


def rollout_seed(seed: int, step: int, position: int) -> int:
    """Seed of the training rollout at `position` of optimizer step `step`'s global batch (< 2**20 rows)."""
    return ((seed * 1_000_003 + step) * (1 << 20) + position) % (1 << 62)


# The probe's frozen rollouts are seeded as if from this step, which no training step uses.
PROBE_SEED_STEP = -1


class PerRowSeeds:
    """The colocated `vllm.LLM`, except that `generate` seeds each prompt of a call with its own seed.

    TRL passes one `SamplingParams` for the whole batch; with a seed in it every request would draw the
    same random numbers (identical samples for a repeated prompt). Everything else is the wrapped engine's.
    """

    def __init__(self, llm, seeds_for):
        self.llm = llm
        self.seeds_for = seeds_for  # number of prompts -> one seed per prompt

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def generate(self, prompts, sampling_params=None, **kwargs):
        if sampling_params is not None and not isinstance(sampling_params, list | tuple):
            per_row = []
            for seed in self.seeds_for(len(prompts)):
                sp = sampling_params.clone()
                sp.seed = seed
                per_row.append(sp)
            sampling_params = per_row
        return self.llm.generate(prompts, sampling_params=sampling_params, **kwargs)


class OPSDTeacherBuilder:
    """Builds `[teacher prompt ; completion]` rows for SDFTTrainer (its teacher-context hook)."""

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


class OPSDTrainer(SDFTTrainer):
    """Clipped-JSD on-policy self-distillation; see the module docstring for what it changes in SDFTTrainer."""

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
        self.teacher_context_builder = OPSDTeacherBuilder(self)
        # Seconds per phase in the current optimizer step; StepTimer turns them into time/<phase>_s metrics.
        self.phase_s: dict[str, float] = defaultdict(float)
        self.add_callback(StepTimer(self._metrics["train"], self.phase_s))
        self._seed_step: int | None = None  # overrides the step that rollout seeds derive from
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

    @property
    def _rollout_step(self) -> int:
        return self.state.global_step if self._seed_step is None else self._seed_step

    def sample_probe_rollouts(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """One completion per prompt from the current student, for the probe (`opsd.probe`).

        Sampled like a training rollout but from seeds no training step uses, with the global random state
        restored afterwards (the transformers engine draws from it), and kept out of the step's timing and
        rollout metrics: a run with the probe draws the same training rollouts as one without.
        """
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        self._seed_step = PROBE_SEED_STEP
        try:
            with torch.random.fork_rng(devices=devices):
                _, completions = super()._generate(prompt_ids)
        finally:
            self._seed_step = None
        return [list(c) for c in completions]

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

    def training_step(self, model, inputs, num_items_in_batch=None):
        # Everything a micro-batch costs except the rollouts and weight sync that may run inside it
        # (prompt building, scoring, loss, backward) is booked as "train_micro".
        t0 = time.perf_counter()
        before = self.phase_s["rollout"] + self.phase_s["weight_sync"]
        out = super().training_step(model, inputs, num_items_in_batch)
        self.nonfinite.note_loss(out)
        inside = self.phase_s["rollout"] + self.phase_s["weight_sync"] - before
        self.phase_s["train_micro"] += time.perf_counter() - t0 - inside
        return out

    # -- prompts and rollouts ----------------------------------------------------------------------------------
    def _tokenize_prompts(self, prompts):
        # The dataset's `prompt` is the bare problem; the student turn is rendered here with its own
        # thinking switch, and its ids go to the engine unchanged (chat-template tokens included).
        return [self.prompt_builder.student_ids(p) for p in prompts]

    def _generate(self, prompt_ids):
        t0 = time.perf_counter()
        synced = self.phase_s["weight_sync"]
        out = super()._generate(prompt_ids)
        # The weight push that may open the call is booked as weight_sync, not as rollout.
        elapsed = time.perf_counter() - t0 - (self.phase_s["weight_sync"] - synced)
        n_tokens = sum(len(c) for c in out[1])
        self.phase_s["rollout"] += elapsed
        self._metrics["train"]["rollout/tokens_per_s"].append(n_tokens / max(elapsed, 1e-9))
        return out

    def _generate_transformers(self, prompt_ids):
        # Rollouts come from the policy without dropout, as the vLLM engine's do.
        with eval_mode(self.accelerator.unwrap_model(self.model)):
            return super()._generate_transformers(prompt_ids)

    def _generate_vllm(self, prompt_ids):
        if self.state.global_step != self._last_loaded_step:
            t0 = time.perf_counter()
            self._sync_rollout_weights()
            self._last_loaded_step = self.state.global_step
            self.phase_s["weight_sync"] += time.perf_counter() - t0
        gen = self.vllm_generation
        if gen.mode == "colocate":
            if not isinstance(gen.llm, PerRowSeeds):
                gen.llm = PerRowSeeds(gen.llm, self._rollout_seeds)
        else:
            # The server samples the whole batch from one seed (its i-th sample of a prompt from seed + i).
            rank = self.accelerator.process_index // self.args.vllm_tensor_parallel_size
            gen.generation_kwargs = {
                **(gen.generation_kwargs or {}),
                "seed": rollout_seed(self.args.seed, self._rollout_step, rank),
            }
        return super()._generate_vllm(prompt_ids)

    def _rollout_seeds(self, num_rows: int) -> list[int]:
        """Seeds of one colocated generate call: one per row, from (seed, step, the row's global position).

        Each process generates its contiguous share of the step's global generation batch (TRL's sampler),
        and a tensor-parallel group generates the shares of its ranks in rank order, so position =
        first rank of the group x rows per rank + row. Hence every row of a step has its own seed (repeated
        prompts of num_generations > 1 get different samples), a resumed run draws the same rollouts, and
        the rollouts do not depend on how many processes share the step.
        """
        tp = self.args.vllm_tensor_parallel_size
        first = self.accelerator.process_index // tp * tp
        offset = first * (num_rows // tp)
        return [rollout_seed(self.args.seed, self._rollout_step, offset + j) for j in range(num_rows)]

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

    # -- scoring and loss --------------------------------------------------------------------------------------
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

    @staticmethod
    def _lm_head_weight(model) -> torch.Tensor:
        return lm_head_weight(model)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("OPSDTrainer does not return outputs")
        a: OPSDConfig = self.args
        t0 = time.perf_counter()
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        student_hidden_NH = self._completion_hidden(
            model, inputs["prompt_ids"], inputs["prompt_mask"], completion_ids, completion_mask
        )
        teacher_prompt_width = inputs["teacher_input_ids"].size(1) - completion_ids.size(1)
        with torch.no_grad(), self._get_teacher_context_for_self_distillation():
            teacher_hidden_NH = self._completion_hidden(
                self.teacher_model,
                inputs["teacher_input_ids"][:, :teacher_prompt_width],
                inputs["teacher_attention_mask"][:, :teacher_prompt_width],
                completion_ids,
                completion_mask,
            )
        # Hidden states come flattened over completion_mask; the loss counts the subset keep_N.
        keep_N = self._loss_mask(completion_ids, completion_mask)[completion_mask.bool()].bool()
        student_w = self._lm_head_weight(self.accelerator.unwrap_model(model))
        teacher_w = self._lm_head_weight(self.accelerator.unwrap_model(self.teacher_model))
        loss_sum, stats = chunked_opsd_loss(
            student_hidden_NH[keep_N],
            teacher_hidden_NH[keep_N].detach(),
            student_w,
            teacher_w.detach(),
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
            self._log_completions(inputs, student_hidden_NH, teacher_hidden_NH, student_w, teacher_w)
        self.phase_s["score_loss"] += time.perf_counter() - t0
        return loss

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

    def _log_completions(self, inputs, student_hidden_NH, teacher_hidden_NH, student_w, teacher_w) -> None:
        a: OPSDConfig = self.args
        problems, references = self.teacher_context_builder.texts
        rows = completions.completion_rows(
            step=self.state.global_step,
            problems=problems,
            references=references,
            completion_ids_BC=inputs["completion_ids"],
            completion_mask_BC=inputs["completion_mask"],
            student_hidden_NH=student_hidden_NH.detach(),
            teacher_hidden_NH=teacher_hidden_NH.detach(),
            student_weight_VH=student_w.detach(),
            teacher_weight_VH=teacher_w.detach(),
            tokenizer=self.processing_class,
            rows=a.completions_rows,
            beta=a.beta,
            temperature=a.effective_loss_temperature,
            top_k=a.top_k_loss,
        )
        completions.append(a.output_dir, rows)
        completions.to_trackers(a.report_to, rows)

    def _record_loss_stats(self, loss_sum: torch.Tensor, stats: dict) -> None:
        n = max(float(stats["num_tokens"]), 1.0)
        m = self._metrics["train" if self.model.training else "eval"]
        m["opsd/divergence"].append(float(stats["divergence"]) / n)
        m["opsd/clipped_frac"].append(float(stats["clipped_frac"]) / n)
        m["opsd/top1_agree"].append(float(stats["top1_agree"]) / n)
        m["opsd/loss_per_token"].append(float(loss_sum) / n)
