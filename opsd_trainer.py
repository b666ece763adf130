"""OPSDTrainer: on-policy self-distillation as a subclass of TRL's `SDFTTrainer` (docs/method.md §1).

    from opsd_trainer import OPSDTrainer
    from opsd import PAPER
from opsd.configuration.config import OPSDConfig
    from opsd.method.rollouts import build_rollout_engine
    trainer = OPSDTrainer(model, args=cfg, train_dataset=ds, processing_class=tok, peft_config=lora,
                          engine=build_rollout_engine(cfg))   # optional: a trainer given no engine builds this one

Every TRL method OPSD overrides is in this file, in the order one optimizer step calls them; what they compute is in
pure functions of `opsd.method`. The trainer builds each generation's batch itself (prompts, rollouts, teacher rows,
its split into micro-batches); TRL's trainer runs the steps around it. The rollout engine is one object handed to the
trainer (`self.engine`: `opsd.method.rollouts`: `TransformersRolloutEngine`, or `opsd.method.engine_vllm.VLLMRolloutEngine`): per-row
seeds, merged weights pushed out of place, sleep and wake. What differs from `SDFTTrainer`: OPSD's prompts with their
own thinking switches (`opsd.method.prompts`), exact positions (`opsd.method.hidden`), the clipped divergence
computed in chunks from hidden states and normalised by each step's valid tokens (`opsd.method.loss`), the EMA teacher
started from the initial adapter and checkpointed (`opsd.method.ema_teacher`), eval-mode teacher forwards, non-finite
steps skipped (`opsd.run.step_watch`), several steps per generation (`steps_per_rollout`, docs/method.md §1.9), and
phase timing and OPSD metrics. For other families than Qwen3 (docs/families.md): the loss applies the model's own
logit transform, checked against its logits on each model's first forward (`opsd.method.hidden`), and with a
colocated engine the model's classes are its own, out of reach of vLLM's in-place decoration
(`opsd.method.engine_classes`). The private TRL names it touches are listed, with reasons, in
`opsd.method.trl_compat.PRIVATE_LIBRARY_NAMES`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import torch
from accelerate.utils import is_peft_model
from peft import PeftModel
from trl.experimental.sdft import SDFTTrainer

from opsd import PAPER
from opsd.configuration.config import OPSDConfig
from opsd.method import completions
from opsd.method.ema_teacher import InitialisedAdapterEMA, own_ema_teacher, save_student_adapter
from opsd.method.engine import weights_dtype
from opsd.method.hidden import CheckedForwards, CompletionHiddenStates, left_pad, lm_head_weight, right_pad
from opsd.method.pairing import CONTRAST_COLUMN
from opsd.method.prompts import PromptBuilder, teacher_rows
from opsd.method.rollouts import build_rollout_engine
from opsd.method.scoring import SelfDistillation, TeacherHidden, TeacherWeights, prompt_part
from opsd.method.trl_compat import restore_lora_dropout
from opsd.run.logprob_gap import LogprobGap, engine_logprobs
from opsd.run.step_watch import (
    ComputeLedger,
    MetricsWindow,
    NonFiniteGuard,
    PhaseClock,
    RolloutGrader,
    StepTimer,
    WindowLogging,
    completion_metrics,
)
from opsd.rundir import COMPLETIONS_FILE
from opsd.speed.compiled_layers import compile_decoder_layers, compiled_graphs

logger = logging.getLogger(__name__)


class OPSDTrainer(WindowLogging, SDFTTrainer):
    """Clipped-JSD on-policy self-distillation. One optimizer step, in the order its methods run below:

    1. `training_step` (one call per micro-batch; phase `train_micro`) gets its micro-batch from
       `_prepare_inputs`, which at the start of a generation window (every step, or every `steps_per_rollout`
       steps) builds the window's batch, `rollout_batch`:
       a. the student prompt of each problem (`opsd.method.prompts`);
       b. `generate_rollouts` (phase `rollout`): the engine's rollouts, one seed per row, with the current
          weights pushed into it first when they changed (phase `weight_sync`);
       c. the `[teacher prompt ; completion]` rows (`opsd.method.prompts.teacher_rows`), and the rollouts handed
          to the grader (`opsd.run.step_watch.RolloutGrader`);
       d. each optimizer step's valid-token count over all processes: its loss denominator.
    2. `compute_loss` (part `score_loss`): `completion_hidden_states` gives both roles' final hidden states of
       the completion tokens (the teacher under `teacher_context`, in eval mode),
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
    _paper = PAPER  # the model card cites the method trained here (TRL's SDFTTrainer would cite SDFT)
    # The TRL methods overridden here that TRL calls; tests/integration/test_trl_hooks.py fails if TRL stops
    # calling one of them by this name.
    TRL_HOOKS = (
        "_load_optimizer_and_scheduler", "training_step", "_prepare_inputs", "compute_loss", "log", "_save",
    )  # fmt: skip
    # The private names of TRL and transformers the repository uses (these hooks, the model card's declarations
    # above) are listed once, with their reasons, in `opsd.method.trl_compat.PRIVATE_LIBRARY_NAMES`.

    # SDFT builds a vLLM engine of its own in `__init__`, and samples from it in its `_generate`, where this is true.
    # OPSD samples from `self.engine` (started in `bind`) and never calls `_generate`: to SDFT's code it is false,
    # whatever the config says (SDFT's `__init__` assigns it from the config; the assignment is dropped).
    use_vllm = property(lambda self: False, lambda self, value: None)

    # -- set-up -------------------------------------------------------------------------------------------------
    def __init__(self, *args, prompt_builder: PromptBuilder | None = None, engine=None, **kwargs):
        config: OPSDConfig = kwargs.get("args", args[1] if len(args) > 1 else None)
        self.clock = PhaseClock()
        self.logged = MetricsWindow()  # OPSD's metrics of the logging period, averaged into TRL's `log`
        # The rollout engine (`opsd.method.rollouts`): the entry point's, or one built from the config. SDFT builds
        # none (`use_vllm`); a vLLM engine starts in `bind`, once SDFT's __init__ has built what it serves.
        self.engine = engine or build_rollout_engine(config)
        if (self.engine.name == "vllm") != config.use_vllm:
            raise ValueError(
                f"a {self.engine.name} engine was given to a run with use_vllm={config.use_vllm}"
            )
        super().__init__(*args, **kwargs)
        self.engine.bind(self)
        a: OPSDConfig = self.args
        # Before the EMA teacher's callback, which reads it: a skipped optimizer step moves no EMA teacher.
        self.nonfinite = NonFiniteGuard(self.train_record, self.accelerator, a.max_nonfinite_steps)
        # The teacher's weights in its forwards, TRL's routing decided once: an EMA teacher kept as a second adapter
        # is that adapter (its callback replaced by OPSD's); a LoRA student's fixed teacher is its base (adapters
        # off); any other teacher (a model of its own, or the student itself) runs as it is.
        self.teacher_adapter = own_ema_teacher(self, step_skipped=lambda: self.nonfinite.last_skipped)
        self.teacher_base = a.teacher_model_kind == "base" and is_peft_model(self.model)
        # The run's builder when opsd_train.py passes it (thinking_switch resolved once per run).
        self.prompt_builder = prompt_builder or PromptBuilder.from_config(self.processing_class, a)
        # The engine's log-probs of the sampled tokens (`_sample`) against the trainer's: rollout/logprob_gap.
        self.logprob_gap = LogprobGap(weights_dtype(self.accelerator.unwrap_model(self.model)))
        self.sampled_logprobs = None
        tok = self.processing_class
        self.rollout_grader = RolloutGrader(
            decode=functools.partial(tok.batch_decode, skip_special_tokens=True),
            reduce=functools.partial(self.accelerator.reduce, reduction="sum"),
        )
        # The trainer's two counters: the micro-batch about to run, over the whole run (None until the first
        # micro-batch of a `train()` call, fresh or resumed), and the global step whose weights generated the
        # current window's rollouts.
        self.micro_batch: int | None = None
        self.rollout_step = 0
        # Completion hidden states, the loss's logit transform checked on each model's first forward.
        self.forwards = CheckedForwards(
            self.accelerator.unwrap_model, fix_positions=a.fix_position_ids, pad_token_id=tok.pad_token_id,
            mixed_precision=self.accelerator.mixed_precision,
        )  # fmt: skip
        self.window: list[dict] | None = None  # the current window's micro-batches (`_prepare_inputs`)
        # The scoring core every self-distilling method shares (`opsd.method.scoring`): the loss, its masks, the
        # teacher's forwards under its weights, the diagnostics and the teacher's ledger tokens.
        route = "base" if self.teacher_base else "adapter" if self.teacher_adapter is not None else "as_is"
        teacher = TeacherWeights(
            self.teacher_model, self.accelerator.unwrap_model, route, self.teacher_adapter
        )
        self.core = SelfDistillation(a, self.forwards, teacher, tok.eos_token_id)
        # Tokens and seconds per step, as every method books them (opsd.run.ledger); the step timer closes each row.
        self.ledger = ComputeLedger(self.train_record, self.accelerator)
        self.step_timer = StepTimer(self.train_record, self.clock, self.ledger)
        self.add_callback(self.step_timer)
        self.add_callback(self.nonfinite)
        # lora_dropout applies to the student's training forward, as in peft; rollouts and every teacher
        # forward run in eval mode (`opsd.method.rollouts.TransformersRolloutEngine`, `teacher_context`).
        restore_lora_dropout(self.accelerator.unwrap_model(self.model))
        if a.compile_layers:
            compile_decoder_layers(self.accelerator.unwrap_model(self.model))

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
            return self.rollout_batch(generation_batch)
        per_window = self.args.steps_per_generation
        if self.micro_batch % (per_window * self.num_iterations) == 0 or self.window is None:
            self.window = split_rows(self.rollout_batch(generation_batch), per_window)
        return self.window[self.micro_batch % per_window]

    def rollout_batch(self, inputs):
        """The batch of one generation: in training, a window of `steps_per_rollout` optimizer steps' rows, in
        order. Student prompts, their rollouts, the teacher's (and a contrastive teacher's) rows and each step's
        loss denominator. (SDFTTrainer's self-distillation callback events are not sent: no TRL callback listens.)"""
        training = self.model.training
        problems = [row["prompt"] for row in inputs]
        references = [row.get("privileged_context") for row in inputs]
        pad_id = self.processing_class.pad_token_id
        device = self.accelerator.device
        # 1a. The dataset's `prompt` is the bare problem; the student turn is rendered here with its own
        # thinking switch, and its ids go to the engine unchanged (chat-template tokens included).
        student_ids = [self.prompt_builder.student_ids(p) for p in problems]
        # 1b. One rollout per prompt; prompts are left-padded, completions right-padded.
        _, rollouts = self.generate_rollouts(student_ids)
        rollouts = [list(r) for r in rollouts]
        if training:
            self.ledger.add(generated=sum(len(r) for r in rollouts))
        prompt_ids, prompt_mask = left_pad(student_ids, pad_id, device)
        completion_ids, completion_mask = right_pad(rollouts, pad_id, device)
        batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                     completion_mask=completion_mask)  # fmt: skip
        stop, gather = [*self.eos_token_ids, pad_id], self.accelerator.gather
        self.record_metrics(completion_metrics(rollouts, stop_ids=stop, gather=gather, device=device))
        # 1c. A loss without a teacher (fixed_advantage) renders no teacher prompt and runs no teacher forward.
        settings = self.core.settings
        teacher, truncated = teacher_rows(
            self.prompt_builder if settings.needs_teacher else None,
            problems, references, completion_ids, completion_mask, pad_id,
        )  # fmt: skip
        batch.update(teacher)
        self.record_metrics({"prompts/teacher_truncated": float(truncated)})
        if settings.contrast is not None:
            # The contrastive teacher's prompt: the problem after the wrong hint (opsd.method.contrast), one per row.
            contrast, _ = teacher_rows(
                self.prompt_builder, problems, [row[CONTRAST_COLUMN] for row in inputs],
                completion_ids, completion_mask, pad_id,
            )  # fmt: skip
            ids, mask = prompt_part({**contrast, "completion_ids": completion_ids}, "teacher")
            batch.update(contrast_input_ids=ids[:, None], contrast_attention_mask=mask[:, None],
                         contrast_valid=torch.ones_like(ids[:, :1], dtype=torch.bool))  # fmt: skip
        if training:
            self.rollout_grader.submit(rollouts, [row.get("answer", "") for row in inputs])
        batch["num_loss_tokens"] = self._loss_denominators(completion_ids, completion_mask)
        if training and self.sampled_logprobs is not None:
            batch["sampled_logprobs"] = self.sampled_logprobs  # (B, C), cut with the rest by `split_rows`
        # Lists are cut into micro-batches with the tensors (`split_rows`).
        batch["problems"] = problems
        batch["references"] = references
        self.rollout_step = self.state.global_step
        return batch

    def _loss_denominators(self, completion_ids, completion_mask) -> torch.Tensor:
        """1d. Each optimizer step's valid-token count over all processes, known before its first backward: that
        step's loss denominator, one per row of the window (a step's rows carry its count)."""
        steps = self.args.steps_per_rollout if self.model.training else 1
        local_S = self.core.token_mask(completion_ids, completion_mask).sum(1).view(steps, -1).sum(1)
        total_S = self.accelerator.reduce(local_S.clone(), reduction="sum")
        return total_S.repeat_interleave(len(completion_ids) // steps)

    def generate_rollouts(self, prompt_ids):
        """(prompt ids, completion ids): one rollout per prompt (phase `rollout`, and `rollout/tokens_per_s`)."""
        with self.clock.phase("rollout") as timed:
            out = self._sample(prompt_ids)
        n_tokens = sum(len(c) for c in out[1])
        self.record_metrics({"rollout/tokens_per_s": n_tokens / max(timed.seconds, 1e-9)})
        return out

    def _sample(self, prompt_ids):
        """The engine's rollouts (`opsd.method.rollouts`), seeded by the current step. The engine's log-probs of the
        sampled tokens are kept as `sampled_logprobs` ((B, C), NaN-padded; None from transformers' generate), for
        `rollout/logprob_gap` (`opsd.run.logprob_gap`)."""
        per_prompt = self.num_generations if self.model.training else self.num_generations_eval
        completion_ids, logprobs = self.engine.generate(
            prompt_ids, step=self.state.global_step, num_generations=per_prompt
        )
        self.sampled_logprobs = (
            None if logprobs is None else engine_logprobs(logprobs, self.accelerator.device)
        )
        return prompt_ids, completion_ids

    # -- 2. the loss of a micro-batch --------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss of a micro-batch (`opsd.method.scoring`): its clipped divergence summed over its valid tokens,
        divided by its optimizer step's valid tokens over all processes (`num_loss_tokens`, carried by every row)."""
        if return_outputs:
            raise ValueError("OPSDTrainer does not return outputs")
        with self.clock.part("score_loss"):
            hidden, teacher = self.completion_hidden_states(model, inputs)
            scored = self.core.loss(
                hidden.student_hidden_NH, hidden.student_weight_VH, teacher, inputs,
                denominator=inputs["num_loss_tokens"][0], num_processes=self.accelerator.num_processes,
            )  # fmt: skip
            self.record_metrics(scored.metrics)
            if self.model.training:
                self.ledger.add(teacher=self.core.teacher_tokens(inputs), trained=scored.trained_tokens)
                self.record_metrics(
                    {"rollout/staleness_steps": float(self.state.global_step - self.rollout_step)}
                )
            if self.model.training and "sampled_logprobs" in inputs:
                a = self.args  # the engine's log-probs come after the rollout's temperature, top-k and top-p
                gap = self.logprob_gap.from_hidden(
                    inputs["sampled_logprobs"], inputs["completion_ids"], inputs["completion_mask"], hidden,
                    temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                )  # fmt: skip
                self.record_metrics(gap)
            if self._completions_due():
                self._log_completions(inputs, hidden)
        return scored.loss

    def completion_hidden_states(
        self, model, batch: dict, *, teacher: bool | None = None
    ) -> tuple[CompletionHiddenStates, TeacherHidden | None]:
        """Both roles' final hidden states of the valid completion tokens of `batch` (the keys of
        `opsd.method.scoring`, with the student's `prompt_ids` and `prompt_mask`), and their lm_heads; the
        teacher's with its wrong hints' (`teacher`: whether to run the teacher; None: when the loss reads it).

        The student goes through `model` (the wrapped model in training, so DDP/DeepSpeed see the forward),
        with gradients if they are enabled; the teacher through `teacher_context`, without gradients. Prompts are
        left-padded, completions right-padded (`opsd.method.hidden`)."""
        student_NH = self.core.student_hidden(model, batch)
        student_weight_VH = lm_head_weight(self.accelerator.unwrap_model(model))
        if teacher is None:
            teacher = self.core.needs_teacher
        scored = self.core.teacher_hidden(batch) if teacher else None
        hidden = CompletionHiddenStates(
            student_NH, None if scored is None else scored.hidden_NH, student_weight_VH,
            None if scored is None else scored.weight_VH, self.logit_transform,
        )  # fmt: skip
        return hidden, scored

    @property
    def logit_transform(self):
        """The loss's logit transform after the lm_head, picked and checked on each model's first forward."""
        return self.forwards.transform

    def teacher_context(self):
        """Every teacher forward (loss, probe): the teacher's weights, in eval mode (`TeacherWeights.active`)."""
        return self.core.teacher.active()

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
            settings=dataclasses.replace(self.core.settings, contrast=None, token_weight="none"),
        )
        completions.append(Path(a.output_dir) / COMPLETIONS_FILE, rows)
        completions.to_trackers(a.report_to, rows)

    # -- 4. checkpoints ----------------------------------------------------------------------------------------
    def _save(self, output_dir=None, state_dict=None):
        # A checkpoint holds the student adapter only, at its root (`save_student_adapter`); the EMA teacher is
        # saved in float32 by InitialisedAdapterEMA.
        model = self.accelerator.unwrap_model(self.model)
        if not isinstance(model, PeftModel) or len(model.peft_config) == 1:
            return super()._save(output_dir, state_dict)
        save_student_adapter(
            model, output_dir or self.args.output_dir, self.args, self.processing_class, state_dict
        )

    # -- for the probe -----------------------------------------------------------------------------------------
    def sample_probe_rollouts(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """One completion per prompt from the current student, for the probe (`opsd.run.probe`).

        Sampled like a training rollout but from seeds no training step uses, with the global random state
        restored afterwards (the transformers engine draws from it), and kept out of the step's timing and
        rollout metrics: a run with the probe draws the same training rollouts as one without.
        """
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with self.engine.probe(), torch.random.fork_rng(devices=devices):
            _, completions_ = self._sample(prompt_ids)
        return [list(c) for c in completions_]


def split_rows(batch: dict, parts: int) -> list[dict]:
    """`batch` (tensors and lists of one row per entry, in order) cut into `parts` consecutive micro-batches."""
    size = len(batch["completion_ids"]) // parts
    return [{key: value[i * size : (i + 1) * size] for key, value in batch.items()} for i in range(parts)]
