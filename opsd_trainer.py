"""OPSDTrainer: on-policy self-distillation as a subclass of TRL's `SDFTTrainer` (docs/method.md §1).

    from opsd_trainer import OPSDTrainer
    from opsd.configuration.config import OPSDConfig
    trainer = OPSDTrainer(model, args=OPSDConfig(...), train_dataset=ds, processing_class=tok, peft_config=lora)

Every TRL method OPSD overrides is in this file, in the order one optimizer step calls them; what they compute is in
pure functions of `opsd.method` that take what they need as arguments. The trainer builds each generation's batch
itself (prompts, rollouts, teacher rows, its split into micro-batches); TRL's trainer runs the steps around it, and
TRL's engine (vLLM colocate/server/sleep/TP) and teacher kinds are used as they are. What differs from
`SDFTTrainer`: OPSD's prompts
with their own thinking switches (`opsd.method.prompts`), exact positions (`opsd.method.hidden`), the clipped
divergence computed in chunks from hidden states and normalised by each step's valid tokens (`opsd.method.loss`),
per-row rollout seeds and merged weights pushed into the engine out of place (`opsd.method.engine`, whose
engine TRL creates),
the EMA teacher started from the initial adapter and checkpointed
(`opsd.method.ema_teacher`), eval-mode teacher forwards, non-finite steps skipped (`opsd.run.step_watch`), several
steps per generation (`steps_per_rollout`, docs/method.md §1.9), and phase timing and OPSD metrics. For other
families than Qwen3 (docs/families.md): the loss applies the model's own logit transform, checked against its logits
on each model's first forward (`opsd.method.hidden`), and with a colocated engine the model's classes are its own,
out of reach of vLLM's in-place decoration (`opsd.method.engine_classes`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import textwrap
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from peft import PeftModel
from transformers.trainer import TRAINING_ARGS_NAME
from trl.experimental.sdft import SDFTTrainer
from trl.experimental.sdft.teacher_sync import PEFTAdapterEMACallback

from opsd.configuration.config import OPSDConfig
from opsd.method import completions
from opsd.method.contrast import rows_with_contrast
from opsd.method.ema_teacher import InitialisedAdapterEMA
from opsd.method.engine import RolloutSeeds, trainer_engine, weights_dtype
from opsd.method.engine_classes import own_classes
from opsd.method.hidden import (
    CompletionHiddenStates,
    completion_hidden,
    eval_mode,
    left_pad,
    lm_head_weight,
    loss_token_mask,
    one_transform,
    resolve_logit_transform,
    right_pad,
)
from opsd.method.loss import chunked_opsd_loss, loss_metrics, loss_settings, one_hint, token_rows
from opsd.method.pairing import CONTRAST_COLUMN
from opsd.method.prompts import PromptBuilder, teacher_rows
from opsd.method.trl_compat import restore_lora_dropout
from opsd.run.logprob_gap import LogprobGap
from opsd.run.step_watch import ComputeLedger, NonFiniteGuard, PhaseClock, RolloutGrader, StepTimer
from opsd.rundir import COMPLETIONS_FILE, EMA_TEACHER_FILE
from opsd.speed.compiled_layers import compile_decoder_layers, compiled_graphs

logger = logging.getLogger(__name__)


class OPSDTrainer(SDFTTrainer):
    """Clipped-JSD on-policy self-distillation. One optimizer step, in the order its methods run below:

    1. `training_step` (one call per micro-batch; phase `train_micro`) gets its micro-batch from
       `_prepare_inputs`, which at the start of a generation window (every step, or every `steps_per_rollout`
       steps) builds the window's batch, `_prepare_training_batch`:
       a. the student prompt of each problem (`opsd.method.prompts`);
       b. `_generate` (phase `rollout`): TRL's engine, OPSD's (`opsd.method.engine.opsd_engine`), with the
          merged weights pushed into it when they changed (`sync_weights`: phase `weight_sync`) and one seed per
          row; or transformers' `generate` in eval mode (`_generate_transformers`);
       c. the `[teacher prompt ; completion]` rows (`opsd.method.prompts.teacher_rows`), and the rollouts handed
          to the grader (`opsd.run.step_watch.RolloutGrader`);
       d. each optimizer step's valid-token count over all processes: its loss denominator.
    2. `compute_loss` (part `score_loss`): `completion_hidden_states` gives both roles' final hidden states of
       the completion tokens (the teacher under `_get_teacher_context_for_self_distillation`, in eval mode),
       `chunked_opsd_loss` their clipped divergence; then the `opsd/*` metrics and the completions log.
    3. TRL's backward; after the last micro-batch TRL's optimizer step, which `NonFiniteGuard` skips for a
       non-finite loss or gradient; `InitialisedAdapterEMA` updates an EMA teacher; `StepTimer` logs the
       step's phases (`time/<phase>_s`) and memory.
    4. On a checkpoint `_save` writes the student adapter at its root (and the EMA teacher its state); on
       resume `_load_optimizer_and_scheduler` (first, before any step: it follows `__init__` below) restores
       the EMA teacher too.

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
    # The TRL methods overridden here that TRL calls; tests/integration/test_trl_hooks.py fails if TRL stops
    # calling one of them by this name.
    TRL_HOOKS = ("_load_optimizer_and_scheduler", "training_step", "_prepare_inputs", "compute_loss", "_save")

    # TRL methods overridden here that this file calls. They replace TRL's, so that a TRL path that still
    # called one would get OPSD's batch, rollouts and teacher weights, never SDFT's.
    OWN_CALLS = (
        "_prepare_training_batch",
        "_generate",
        "_generate_transformers",
        "_get_teacher_context_for_self_distillation",
    )

    # -- set-up -------------------------------------------------------------------------------------------------
    def __init__(self, *args, prompt_builder: PromptBuilder | None = None, **kwargs):
        config: OPSDConfig = kwargs.get("args", args[1] if len(args) > 1 else None)
        colocated = config.use_vllm and config.vllm_mode == "colocate"
        model = kwargs.get("model", args[0] if args else None)
        # Read by the engine TRL creates inside super().__init__.
        self.seeds = RolloutSeeds(config.seed, step_of=lambda: self.state.global_step)
        self.clock = PhaseClock()
        with trainer_engine(config, model, self.seeds, self.clock):
            super().__init__(*args, **kwargs)
        a: OPSDConfig = self.args
        # Before the EMA teacher's callback, which reads it: a skipped optimizer step moves no EMA teacher.
        self.nonfinite = NonFiniteGuard(self._metrics["train"], self.accelerator, a.max_nonfinite_steps)
        # The teacher's weights in its forwards, TRL's routing decided once: an EMA teacher kept as a second adapter
        # is that adapter (its callback replaced by OPSD's); a LoRA student's fixed teacher is its base (adapters
        # off); any other teacher (a model of its own, or the student itself) runs as it is.
        self.teacher_adapter = self._own_ema_teacher()
        self.teacher_base = a.teacher_model_kind == "base" and is_peft_model(self.model)
        if colocated and isinstance(self.teacher_model, torch.nn.Module):
            own_classes(self.teacher_model)
        # The run's builder when opsd_train.py passes it (thinking_switch resolved once per run).
        self.prompt_builder = prompt_builder or PromptBuilder.from_config(self.processing_class, a)
        self.loss_settings = loss_settings(a)
        # The engine's log-probs of the sampled tokens (`_sample`) against the trainer's: rollout/logprob_gap.
        self.logprob_gap = LogprobGap(weights_dtype(self.accelerator.unwrap_model(self.model)))
        self.sampled_logprobs = None
        tok = self.processing_class
        self.rollout_grader = RolloutGrader(
            decode=functools.partial(tok.batch_decode, skip_special_tokens=True),
            reduce=functools.partial(self.accelerator.reduce, reduction="sum"),
        )
        self.rollout_step = 0  # the global step whose weights generated the current window's rollouts
        # The global step whose weights the vLLM engine holds (-1: the model as loaded, pushed before the first
        # generation, as TRL does).
        self.engine_step = -1
        # The loss's logit transform (opsd.method.hidden), picked and checked on each model's first forward.
        self.logit_transform = None
        self.logits_checked: set[int] = set()
        # The window's micro-batches and the index of the next one over the run (`_prepare_inputs`); None until
        # the first micro-batch of a `train()` call, fresh or resumed.
        self.window: list[dict] | None = None
        self.micro_batch: int | None = None
        # Tokens and seconds per step, as every method books them (opsd.run.ledger); the step timer closes each row.
        self.ledger = ComputeLedger(self._metrics["train"], self.accelerator)
        self.step_timer = StepTimer(self._metrics["train"], self.clock, self.ledger)
        self.add_callback(self.step_timer)
        self.add_callback(self.nonfinite)
        # lora_dropout applies to the student's training forward, as in peft; rollouts and every teacher
        # forward run in eval mode (`_generate_transformers`, `_get_teacher_context_for_self_distillation`).
        restore_lora_dropout(self.accelerator.unwrap_model(self.model))
        if a.compile_layers:
            compile_decoder_layers(self.accelerator.unwrap_model(self.model))

    def _own_ema_teacher(self) -> str | None:
        """TRL's EMA teacher callback (the last one its `__init__` adds, in `_setup_teacher_model`) replaced, at
        the same place, by OPSD's (`InitialisedAdapterEMA`: starts from the student, saves and restores its state, and
        skips an optimizer step `NonFiniteGuard` skipped). Here rather than in an override of TRL's
        `_setup_teacher_model`, which runs inside `super().__init__`, before this trainer's state exists.
        Returns the EMA teacher's adapter name (None without one)."""
        ema = [cb for cb in self.callback_handler.callbacks if type(cb) is PEFTAdapterEMACallback]
        nonfinite = self.nonfinite
        for cb in ema:
            self.callback_handler.remove_callback(cb)
            self.add_callback(
                InitialisedAdapterEMA(
                    model=cb.model,
                    teacher_adapter_name=cb.teacher_adapter_name,
                    update_rate=cb.update_rate,
                    sync_steps=cb.sync_steps,
                    accelerator=cb.accelerator,
                    step_skipped=lambda: nonfinite.last_skipped,
                    state_file=EMA_TEACHER_FILE,
                )
            )
        return ema[0].teacher_adapter_name if ema else None

    def _load_optimizer_and_scheduler(self, checkpoint):
        # Called on every resume, on every backend (DeepSpeed included), before training begins.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            for cb in self.callback_handler.callbacks:
                if isinstance(cb, InitialisedAdapterEMA):
                    cb.restore(checkpoint)

    # -- 1. a micro-batch, and the window's batch at its start ------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        per_step = self.args.gradient_accumulation_steps
        # A run resumed inside a window of steps_per_rollout steps takes its step's share of the window.
        if self.micro_batch is None:
            self.micro_batch = self.state.global_step * per_step
        if self.micro_batch % per_step == 0:  # the optimizer step's first micro-batch
            self.step_timer.step_begins()
        with self.clock.phase("train_micro"):
            out = super().training_step(model, inputs, num_items_in_batch)
        self.micro_batch += 1
        self.nonfinite.note_loss(out)
        if self.args.compile_layers:
            self.record_metrics({"compile/graphs": compiled_graphs()})
        if self.micro_batch % per_step == 0:  # the optimizer step's last micro-batch
            # The rollouts of this step's generation were graded meanwhile (opsd.run.step_watch); what the
            # step still waits for them is time/grade_wait_s.
            with self.clock.phase("grade_wait"):
                grades = self.rollout_grader.collect(self.accelerator.device)
            if grades:
                self.record_metrics(grades)
            self.step_timer.optimizer_begins()
        return out

    def _prepare_inputs(self, generation_batch):
        """The micro-batch `micro_batch` of the current window, whose batch is built at the window's start (TRL's
        own counter starts at 0 in every process, so a run resumed inside a window would take the window's first
        share, not its step's). In evaluation, the batch of the rows given."""
        if not self.model.training:
            return self._prepare_training_batch(generation_batch)
        per_window = self.args.steps_per_generation
        if self.micro_batch % (per_window * self.num_iterations) == 0 or self.window is None:
            self.window = split_rows(self._prepare_training_batch(generation_batch), per_window)
        return self.window[self.micro_batch % per_window]

    def _prepare_training_batch(self, inputs):
        """The batch of one generation: in training, a window of `steps_per_rollout` optimizer steps' rows, in
        order. Student prompts, their rollouts, the teacher's (and a contrastive teacher's) rows and each step's
        loss denominator; TRL's self-distillation callback events are sent as TRL sends them."""
        a: OPSDConfig = self.args
        training = self.model.training
        problems = [row["prompt"] for row in inputs]
        references = [row.get("privileged_context") for row in inputs]
        pad_id = self.processing_class.pad_token_id
        device = self.accelerator.device
        # 1a. The dataset's `prompt` is the bare problem; the student turn is rendered here with its own
        # thinking switch, and its ids go to the engine unchanged (chat-template tokens included).
        student_ids = [self.prompt_builder.student_ids(p) for p in problems]
        self._dispatch_self_distillation_callback(
            "on_generation_prompts_selected", generation_prompts=problems, generation_prompt_text=None
        )
        # 1b. One rollout per prompt; prompts are left-padded, completions right-padded.
        _, rollouts = self._generate(student_ids)
        rollouts = [list(r) for r in rollouts]
        if training:
            self.ledger.add(generated=sum(len(r) for r in rollouts))
        prompt_ids, prompt_mask = left_pad(student_ids, pad_id, device)
        completion_ids, completion_mask = right_pad(rollouts, pad_id, device)
        batch = {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "completion_ids": completion_ids,
            "completion_mask": completion_mask,
            "raw_completion_lengths": torch.tensor([len(r) for r in rollouts], device=device),
        }
        self._record_completion_metrics("train" if training else "eval", batch)  # TRL's completions/* metrics
        # 1c. A loss without a teacher (fixed_advantage) renders no teacher prompt and runs no teacher forward.
        teacher, truncated = teacher_rows(
            self.prompt_builder if self.loss_settings.needs_teacher else None,
            problems, references, completion_ids, completion_mask, pad_id,
        )  # fmt: skip
        batch.update(teacher)
        self.record_metrics({"prompts/teacher_truncated": float(truncated)})
        if self.loss_settings.contrast is not None:
            # The contrastive teacher's rows: the same completions after the wrong hint (opsd.method.contrast).
            contrast, _ = teacher_rows(
                self.prompt_builder, problems, [row[CONTRAST_COLUMN] for row in inputs],
                completion_ids, completion_mask, pad_id,
            )  # fmt: skip
            batch["contrast_input_ids"] = contrast["teacher_input_ids"]
            batch["contrast_attention_mask"] = contrast["teacher_attention_mask"]
        if training:
            self.rollout_grader.submit(rollouts, [row.get("answer", "") for row in inputs])
        self._dispatch_self_distillation_callback(
            "on_self_distillation_batch_prepared",
            old_per_token_logps=None,  # OPSD's loss takes no importance ratio
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            teacher_input_ids=batch["teacher_input_ids"],
            teacher_attention_mask=batch["teacher_attention_mask"],
        )
        # 1d. Each optimizer step's valid-token count over all processes is known before its first backward: it
        # is that step's loss denominator, carried by each of its rows.
        steps = a.steps_per_rollout if training else 1
        local_S = self._loss_mask(completion_ids, completion_mask).sum(1).view(steps, -1).sum(1)
        total_S = self.accelerator.reduce(local_S.clone(), reduction="sum")
        batch["num_loss_tokens"] = total_S.repeat_interleave(len(inputs) // steps)
        if training and self.sampled_logprobs is not None:
            batch["sampled_logprobs"] = self.sampled_logprobs  # (B, C), cut with the rest by `split_rows`
        # Lists are cut into micro-batches with the tensors (`split_rows`).
        batch["problems"] = problems
        batch["references"] = references
        self.rollout_step = self.state.global_step
        if training:
            self._dispatch_self_distillation_callback(
                "on_generation_batch_built",
                generate_every=a.steps_per_generation * self.num_iterations,
                steps_per_generation=a.steps_per_generation,
            )
        return batch

    def _generate(self, prompt_ids):
        """(prompt ids, completion ids): one rollout per prompt (phase `rollout`, and `rollout/tokens_per_s`)."""
        with self.clock.phase("rollout") as timed:
            out = self._sample(prompt_ids)
        n_tokens = sum(len(c) for c in out[1])
        self.record_metrics({"rollout/tokens_per_s": n_tokens / max(timed.seconds, 1e-9)})
        return out

    def _sample(self, prompt_ids):
        """TRL's vLLM engine (OPSD's, `opsd.method.engine`), given the current weights first when they changed
        since its last generation; or transformers' generate. The engine's log-probs of the sampled tokens are
        kept as `sampled_logprobs` ((B, C), NaN-padded; None from transformers' generate), for
        `rollout/logprob_gap` (`opsd.run.logprob_gap`)."""
        self.sampled_logprobs = None
        if not self.use_vllm:
            return self._generate_transformers(prompt_ids)
        if self.engine_step != self.state.global_step:
            self.vllm_generation.sync_weights()
            self.engine_step = self.state.global_step
        per_prompt = self.num_generations if self.model.training else self.num_generations_eval
        prompt_ids, completion_ids, logprobs, _ = self.vllm_generation.generate(
            prompts=prompt_ids, images=None, num_generations=per_prompt
        )
        if logprobs is not None:
            from opsd.run.logprob_gap import engine_logprobs

            self.sampled_logprobs = engine_logprobs(logprobs, self.accelerator.device)
        return prompt_ids, completion_ids

    def _generate_transformers(self, prompt_ids):
        # Rollouts come from the policy without dropout, as the vLLM engine's do.
        with eval_mode(self.accelerator.unwrap_model(self.model)):
            return super()._generate_transformers(prompt_ids)

    def _loss_mask(self, completion_ids, completion_mask):
        a: OPSDConfig = self.args
        pad = None if a.fix_position_ids else self.processing_class.pad_token_id
        return loss_token_mask(
            completion_ids, completion_mask, skip=a.num_loss_tokens_to_skip, pad_token_id=pad
        )

    # -- 2. the loss of a micro-batch --------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss of a micro-batch: its clipped divergence summed over its valid tokens, divided by its
        optimizer step's valid tokens over all processes (`num_loss_tokens`, carried by every row)."""
        if return_outputs:
            raise ValueError("OPSDTrainer does not return outputs")
        settings = self.loss_settings
        with self.clock.part("score_loss"):
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            teacher = self._prompt_part(inputs, "teacher") if settings.needs_teacher else (None, None)
            contrast = self._prompt_part(inputs, "contrast") if settings.contrast is not None else None
            hidden = self.completion_hidden_states(
                model, inputs["prompt_ids"], inputs["prompt_mask"], *teacher, completion_ids, completion_mask,
                contrast=contrast,
            )  # fmt: skip
            # Hidden states come flattened over completion_mask; the loss counts the subset keep_N.
            keep_BC = self._loss_mask(completion_ids, completion_mask)
            if (
                contrast is not None
            ):  # a row whose wrong hint is its hint adds exactly 0 (opsd.method.contrast)
                keep_BC = keep_BC * rows_with_contrast(*teacher, *contrast)[:, None]
            keep_N = keep_BC[completion_mask.bool()].bool()
            loss_sum, stats = chunked_opsd_loss(
                *[
                    None if h is None else h[keep_N]
                    for h in (hidden.student_hidden_NH, hidden.teacher_hidden_NH)
                ],
                hidden.student_weight_VH,
                hidden.teacher_weight_VH,
                settings=settings,
                target_ids_N=completion_ids[completion_mask.bool()][keep_N],
                transform=hidden.logit_transform,
                contrast=one_hint(hidden.contrast_hidden_NH, keep_N, self.processing_class.eos_token_id),
                rows_N=token_rows(keep_BC),
            )
            # Gradients are averaged over processes by DDP/DeepSpeed, hence the factor num_processes.
            denom = inputs["num_loss_tokens"][0].clamp(min=1).to(loss_sum.dtype)
            loss = loss_sum / denom * self.accelerator.num_processes
            self.record_metrics(loss_metrics(loss_sum.detach(), stats, teacher=settings.needs_teacher))
            if self.model.training:
                # Each teacher forward reads its prompt and the completion (a contrastive teacher: two forwards).
                masks = [mask for _, mask in (teacher, contrast or (None, None)) if mask is not None]
                completion_tokens = int(completion_mask.sum())
                self.ledger.add(
                    teacher=sum(int(m.sum()) + completion_tokens for m in masks), trained=int(keep_N.sum())
                )
                self.record_metrics(
                    {"rollout/staleness_steps": float(self.state.global_step - self.rollout_step)}
                )
            if self.model.training and "sampled_logprobs" in inputs:
                a = self.args  # the engine's log-probs come after the rollout's temperature, top-k and top-p
                gap = self.logprob_gap.from_hidden(
                    inputs["sampled_logprobs"], completion_ids, completion_mask, hidden,
                    temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                )  # fmt: skip
                self.record_metrics(gap)
            if self._completions_due():
                self._log_completions(inputs, hidden)
        return loss

    @staticmethod
    def _prompt_part(inputs, role: str):
        """(ids, mask) of the prompt part of a role's `[prompt ; completion]` rows (role: teacher or contrast)."""
        ids, mask = inputs[f"{role}_input_ids"], inputs[f"{role}_attention_mask"]
        width = ids.size(1) - inputs["completion_ids"].size(1)
        return ids[:, :width], mask[:, :width]

    def completion_hidden_states(
        self, model, student_ids, student_mask, teacher_ids, teacher_mask, completion_ids, completion_mask, *,
        contrast=None,
    ) -> CompletionHiddenStates:  # fmt: skip
        """Both roles' final hidden states of the valid completion tokens of a batch, and their lm_heads.

        The student goes through `model` (the wrapped model in training, so DDP/DeepSpeed see the forward),
        with gradients if they are enabled; the teacher through TRL's teacher context in eval mode, without
        gradients, once after its prompt (`teacher_ids`; None: no teacher forward) and, given `contrast`
        (ids, mask of the wrong hint's prompt), once more after that. Prompts are left-padded, completions
        right-padded (`opsd.method.hidden`).
        """
        student_NH = self._completion_hidden(
            model, student_ids, student_mask, completion_ids, completion_mask
        )
        unwrap = self.accelerator.unwrap_model
        student_weight_VH = lm_head_weight(unwrap(model))
        if teacher_ids is None:
            return CompletionHiddenStates(student_NH, None, student_weight_VH, None, self.logit_transform)
        with torch.no_grad(), self._get_teacher_context_for_self_distillation():
            teacher_NH = self._completion_hidden(
                self.teacher_model, teacher_ids, teacher_mask, completion_ids, completion_mask
            )
            contrast_NH = None
            if contrast is not None:
                contrast_NH = self._completion_hidden(
                    self.teacher_model, *contrast, completion_ids, completion_mask
                )
        return CompletionHiddenStates(
            student_hidden_NH=student_NH,
            teacher_hidden_NH=teacher_NH.detach(),
            student_weight_VH=student_weight_VH,
            teacher_weight_VH=lm_head_weight(unwrap(self.teacher_model)).detach(),
            logit_transform=self.logit_transform,
            contrast_hidden_NH=None if contrast_NH is None else contrast_NH.detach(),
        )

    def _completion_hidden(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        return completion_hidden(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            fix_positions=self.args.fix_position_ids,
            pad_token_id=self.processing_class.pad_token_id,
            on_last_logits=None if id(model) in self.logits_checked else self._logits_check(model),
        )

    def _logits_check(self, model):
        """For a model's first forward: the loss's logit transform must reproduce its own logits
        (`opsd.method.hidden`); the first model's picks it, and every other model must share it."""

        def check(hidden_BH, logits_BV):
            unwrapped = self.accelerator.unwrap_model(model)
            found = resolve_logit_transform(unwrapped.config, hidden_BH, lm_head_weight(unwrapped), logits_BV)
            if self.logit_transform is None:
                logger.info("logit transform after the lm_head, checked against the model's logits: %s",
                            found.describe())  # fmt: skip
            self.logit_transform = one_transform(self.logit_transform, found)
            self.logits_checked.add(id(model))

        return check

    @contextmanager
    def _get_teacher_context_for_self_distillation(self):
        """Every teacher forward (loss, probe): the teacher's weights (`teacher_base`: the adapters off;
        `teacher_adapter`: that adapter active), in eval mode. The teacher must be a deterministic function of its
        weights: in training mode LoRA dropout would make the EMA adapter and the dynamic teacher (the student
        itself) score the same tokens differently on every call."""
        teacher = self.accelerator.unwrap_model(self.teacher_model)
        with eval_mode(teacher):
            if self.teacher_base:
                with teacher.disable_adapter():
                    yield
            elif self.teacher_adapter is not None:
                student_adapter = teacher.active_adapter
                teacher.set_adapter(self.teacher_adapter)
                try:
                    yield
                finally:
                    teacher.set_adapter(student_adapter)
            else:
                yield

    def _completions_due(self) -> bool:
        """The first micro-batch of every `completions_steps`-th optimizer step, on the main process."""
        every = self.args.completions_steps
        return (
            every > 0
            and self.model.training
            and self.accelerator.is_main_process
            and self.state.global_step % every == 0
            # a step's first micro-batch; a loss computed outside `training_step` (probe, tests) counts as one
            and (self.micro_batch or 0) % self.args.gradient_accumulation_steps == 0
        )

    def _log_completions(self, inputs, hidden: CompletionHiddenStates) -> None:
        a: OPSDConfig = self.args
        rows = completions.completion_rows(
            step=self.state.global_step,
            problems=inputs["problems"],
            references=inputs["references"],
            completion_ids_BC=inputs["completion_ids"],
            completion_mask_BC=inputs["completion_mask"],
            student_hidden_NH=hidden.student_hidden_NH.detach(),
            teacher_hidden_NH=hidden.teacher_hidden_NH,
            student_weight_VH=hidden.student_weight_VH.detach(),
            teacher_weight_VH=hidden.teacher_weight_VH,
            transform=hidden.logit_transform,
            tokenizer=self.processing_class,
            rows=a.completions_rows,
            # The divergence shown is the one from the teacher under its reference, also with a contrast.
            settings=dataclasses.replace(self.loss_settings, contrast=None, token_weight="none"),
        )
        completions.append(Path(a.output_dir) / COMPLETIONS_FILE, rows)
        completions.to_trackers(a.report_to, rows)

    # -- 4. checkpoints ----------------------------------------------------------------------------------------
    def _save(self, output_dir=None, state_dict=None):
        # A checkpoint holds the student adapter only, at its root; the EMA teacher is saved in float32 by
        # InitialisedAdapterEMA. With a second adapter peft writes every adapter to a subfolder, and
        # transformers' resume then loads the subfolders only: the student would restart from its init.
        model = self.accelerator.unwrap_model(self.model)
        if not isinstance(model, PeftModel) or len(model.peft_config) == 1:
            return super()._save(output_dir, state_dict)
        # transformers' `_save` for a peft model, with the active adapter alone: it has no setting for the
        # adapters it saves.
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        model.save_pretrained(output_dir, state_dict=state_dict, selected_adapters=[model.active_adapter])
        if self.args.should_save:
            self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    # -- for the probe -----------------------------------------------------------------------------------------
    def sample_probe_rollouts(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """One completion per prompt from the current student, for the probe (`opsd.run.probe`).

        Sampled like a training rollout but from seeds no training step uses, with the global random state
        restored afterwards (the transformers engine draws from it), and kept out of the step's timing and
        rollout metrics: a run with the probe draws the same training rollouts as one without.
        """
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with self.seeds.probe(), torch.random.fork_rng(devices=devices):
            _, completions_ = self._sample(prompt_ids)
        return [list(c) for c in completions_]

    def record_metrics(self, metrics: dict[str, float]) -> None:
        """Adds values to the current logging window (averaged there like every metric)."""
        window = self._metrics["train" if self.model.training else "eval"]
        for key, value in metrics.items():
            window[key].append(value)


def split_rows(batch: dict, parts: int) -> list[dict]:
    """`batch` (tensors and lists of one row per entry, in order) cut into `parts` consecutive micro-batches."""
    size = len(batch["completion_ids"]) // parts
    return [{key: value[i * size : (i + 1) * size] for key, value in batch.items()} for i in range(parts)]
