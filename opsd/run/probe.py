"""The probe: is the student moving towards its teacher on problems it never trains on?

The training loss is a poor guide to that: with the published element clip the loss can fall below zero
while the student drifts away from the teacher. So at step 0 a probe set is frozen: `probe_size` problems held
out of the training data, their references, and one rollout each sampled from the initial student. Every
`probe_steps` optimizer steps the current student and teacher score those same tokens, exactly as the loss
scores a training batch (same prompts, positions and teacher weights), and three numbers are logged:

- `probe/divergence`: mean unclipped per-token D_beta at the loss's beta and temperature, full vocabulary;
- `probe/top1_agree`: share of tokens where the student's argmax is the teacher's;
- `probe/teacher_token_logp`: the student's mean log-probability (at the loss temperature) of the teacher's
  argmax token;
- `probe/abs_advantage`: the mean |e(t)| = |log p_T(y_t) - log p_S(y_t)| of the frozen rollout's own tokens, the
  size of the sampled-token signal (what `fixed_advantage` is compared with, docs/method.md §1.11).

The completions never change, so the curves move only with the weights: a rising divergence means the
student is moving away from its teacher. The set is saved as `<output_dir>/probe_set.json` and reloaded on
resume. Its rollouts are booked in the compute ledger's `probe_tokens` column (step 1's row; none when reloaded).
Under several processes each process scores its share and the sums are reduced.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import TrainerCallback

from opsd.method.hidden import IDENTITY, LogitTransform, eval_mode, head_logits, left_pad, right_pad
from opsd.method.loss import LossSettings, loss_settings, pointwise_jsd_terms
from opsd.rundir import PROBE_FILE

if TYPE_CHECKING:
    from datasets import Dataset

logger = logging.getLogger(__name__)

PROBE_KEYS = ("probe/divergence", "probe/top1_agree", "probe/teacher_token_logp", "probe/abs_advantage")
# Warn when the probe divergence is this much above its step-0 value.
RISE_WARN_RATIO = 1.1
NEGATIVE_LOSS_WARN_STEPS = 10


def split_probe(ds: Dataset, size: int, seed: int) -> tuple[Dataset, list[dict[str, Any]]]:
    """(training rows, probe rows): `size` rows drawn with `seed` are held out of training (0 = none)."""
    if size <= 0:
        return ds, []
    if size >= len(ds):
        raise ValueError(
            f"probe_size={size} would hold out all {len(ds)} training rows; use a smaller probe_size "
            "(or 0 to turn the probe off)"
        )
    held = sorted(random.Random(seed).sample(range(len(ds)), size))
    held_set = set(held)
    rest = [i for i in range(len(ds)) if i not in held_set]
    return ds.select(rest), [ds[i] for i in held]


def probe_token_sums(
    student_hidden_NH: torch.Tensor,
    teacher_hidden_NH: torch.Tensor,
    student_weight_VH: torch.Tensor,
    teacher_weight_VH: torch.Tensor,
    *,
    settings: LossSettings,
    target_ids_N: torch.Tensor,
    transform: LogitTransform = IDENTITY,
) -> torch.Tensor:
    """Sums over N tokens of (D_beta, top-1 agreement, student log-prob of the teacher's argmax, |log p_T(y) -
    log p_S(y)| of the tokens y = target_ids_N), float32 (4,).

    Logits are transform(h @ W.T) (lm_head without bias, then the model's own transform) computed `settings.chunk_size` tokens at a time in the weight's
    dtype; both distributions are log_softmax(logits / settings.temperature) over the full vocabulary (the
    loss's teacher support and clip do not apply); D_beta, at settings.beta, is unclipped.
    """
    beta, temperature, chunk_size = settings.beta, settings.temperature, settings.chunk_size
    sums_4 = torch.zeros(4, dtype=torch.float32, device=student_hidden_NH.device)
    with torch.no_grad():
        for start in range(0, student_hidden_NH.shape[0], chunk_size):
            h_s = student_hidden_NH[start : start + chunk_size]
            h_t = teacher_hidden_NH[start : start + chunk_size]
            s_CV = head_logits(h_s, student_weight_VH, transform) / temperature
            t_CV = head_logits(h_t, teacher_weight_VH, transform) / temperature
            logp_s_CV, logp_t_CV = F.log_softmax(s_CV, -1), F.log_softmax(t_CV, -1)
            teacher_top_C = t_CV.argmax(-1)
            y_C1 = target_ids_N[start : start + chunk_size, None]
            sums_4 += torch.stack(
                [
                    pointwise_jsd_terms(logp_s_CV, logp_t_CV, beta).sum(),
                    (s_CV.argmax(-1) == teacher_top_C).float().sum(),
                    logp_s_CV.gather(-1, teacher_top_C[:, None]).sum(),
                    (logp_t_CV.gather(-1, y_C1) - logp_s_CV.gather(-1, y_C1)).abs().sum(),
                ]
            )
    return sums_4


class Probe(TrainerCallback):
    """Freezes the probe set at the start of training and scores it every `every` optimizer steps.

    Step 0 is logged right away (before the first update); later scores are added to the trainer's metrics
    and logged with the step's other metrics. Also warns once when the probe divergence has risen by
    `RISE_WARN_RATIO` over its step-0 value, and once when the training loss has stayed negative for
    `NEGATIVE_LOSS_WARN_STEPS` consecutive logged steps.
    """

    def __init__(self, trainer, rows: list[dict[str, Any]], every: int):
        self.trainer = trainer
        self.every = every
        acc = trainer.accelerator
        # Every process scores the same number of rows (a collective rollout needs equal shares).
        keep = max(len(rows) // acc.num_processes, 1) * acc.num_processes
        if keep != len(rows):
            logger.info(
                "probe: %d rows, %d kept (a multiple of %d processes)", len(rows), keep, acc.num_processes
            )
        self.rows = rows[:keep]
        self.frozen: list[dict[str, Any]] = []
        self.first: float | None = None
        self.warned_rise = self.warned_negative = False
        self.negative_since: int | None = None

    @property
    def path(self) -> Path:
        return Path(self.trainer.args.output_dir) / PROBE_FILE

    # -- the frozen set -------------------------------------------------------------------------------------
    def freeze(self) -> None:
        """Load the saved probe set, or sample one rollout per probe row with the current student and save it."""
        t, acc = self.trainer, self.trainer.accelerator
        if self.path.is_file():
            saved = json.loads(self.path.read_text(encoding="utf-8"))
            self.frozen = saved["rows"]
            self.first = saved.get("step0_divergence")
            logger.info("probe: %d frozen rows loaded from %s", len(self.frozen), self.path)
            return
        builder = t.prompt_builder
        # Contiguous shares: a row's rollout seed follows its position in the whole set, as in a training
        # batch, so the frozen set is the same on any number of processes.
        share = len(self.rows) // acc.num_processes
        mine = list(range(acc.process_index * share, (acc.process_index + 1) * share))
        student_ids = [builder.student_ids(self.rows[i]["prompt"]) for i in mine]
        completions = t.sample_probe_rollouts(student_ids)
        t.ledger.add(probe=sum(len(c) for c in completions))  # in step 1's row (`opsd.run.ledger`)
        from accelerate.utils import gather_object

        local = [
            {
                "index": i,
                "problem": self.rows[i]["prompt"],
                "reference": self.rows[i]["privileged_context"],
                "student_ids": s,
                "teacher_ids": builder.teacher_ids(
                    self.rows[i]["prompt"], self.rows[i]["privileged_context"]
                ).ids,
                "completion_ids": list(c),
            }
            for i, s, c in zip(mine, student_ids, completions, strict=True)
        ]
        gathered = gather_object(local) if acc.num_processes > 1 else local
        self.frozen = sorted(gathered, key=lambda r: r["index"])
        if acc.is_main_process:
            self._save()
        acc.wait_for_everyone()

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.partial")
        body = {"step0_divergence": self.first, "rows": self.frozen}
        tmp.write_text(json.dumps(body), encoding="utf-8")
        tmp.replace(self.path)

    # -- scoring --------------------------------------------------------------------------------------------
    def score(self) -> dict[str, float]:
        """The probe metrics of the current weights (a collective call: every process scores its share)."""
        t, acc = self.trainer, self.trainer.accelerator
        a = t.args
        share = len(self.frozen) // acc.num_processes
        rows = self.frozen[acc.process_index * share : (acc.process_index + 1) * share]
        device = acc.device
        pad = t.processing_class.pad_token_id
        unwrapped = acc.unwrap_model(t.model)
        sums_5 = torch.zeros(5, dtype=torch.float32, device=device)
        settings = loss_settings(a)
        batch = a.per_device_train_batch_size
        with torch.no_grad(), eval_mode(unwrapped):
            for start in range(0, len(rows), batch):
                part = [r for r in rows[start : start + batch] if r["completion_ids"]]
                if not part:
                    continue
                c_ids, c_mask = right_pad([r["completion_ids"] for r in part], pad, device)
                s_ids, s_mask = left_pad([r["student_ids"] for r in part], pad, device)
                t_ids, t_mask = left_pad([r["teacher_ids"] for r in part], pad, device)
                scored = dict(prompt_ids=s_ids, prompt_mask=s_mask, completion_ids=c_ids, completion_mask=c_mask,
                              teacher_input_ids=torch.cat([t_ids, c_ids], 1),
                              teacher_attention_mask=torch.cat([t_mask, c_mask], 1))  # fmt: skip
                hidden, _ = t.completion_hidden_states(t.model_wrapped, scored, teacher=True)
                sums_5[:4] += probe_token_sums(
                    hidden.student_hidden_NH, hidden.teacher_hidden_NH, hidden.student_weight_VH,
                    hidden.teacher_weight_VH, settings=settings, target_ids_N=c_ids[c_mask.bool()],
                    transform=hidden.logit_transform,
                )  # fmt: skip
                sums_5[4] += hidden.student_hidden_NH.shape[0]
        sums_5 = acc.reduce(sums_5, reduction="sum")
        n = max(float(sums_5[4]), 1.0)
        return dict(zip(PROBE_KEYS, (float(sums_5[i]) / n for i in range(4)), strict=True))

    def _check(self, step: int, metrics: dict[str, float]) -> None:
        div = metrics["probe/divergence"]
        if self.first is None:
            self.first = div
            if self.trainer.accelerator.is_main_process:
                self._save()
            return
        if not self.warned_rise and div > RISE_WARN_RATIO * self.first:
            self.warned_rise = True
            if self.trainer.accelerator.is_main_process:
                logger.warning(
                    "probe/divergence rose from %.4f at step 0 to %.4f at step %d: on held-out problems the "
                    "student is moving AWAY from its teacher. With clip_mode=%s at learning rate %g this is "
                    "expected for clip_mode=element on a model far from its teacher (clamped entries get no "
                    "gradient, and the rest push the teacher's tokens down); clip_mode=none or rescale, or a "
                    "lower learning rate, move it towards the teacher (docs/results.md).",
                    self.first, div, step, self.trainer.args.clip_mode, self.trainer.args.learning_rate,
                )  # fmt: skip

    # -- callback events ------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        self.freeze()
        if state.global_step == 0:
            self.trainer.log(self._timed_score(0))

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            # Runs after StepTimer: the probe's time is not in time/step_s but in its own time/probe_s.
            self.trainer.record_metrics(self._timed_score(state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        loss = (logs or {}).get("loss")
        if loss is None:
            return
        if loss >= 0:
            self.negative_since = None
            return
        if self.negative_since is None:
            self.negative_since = state.global_step
        span = state.global_step - self.negative_since + 1
        if span >= NEGATIVE_LOSS_WARN_STEPS and not self.warned_negative:
            self.warned_negative = True
            if state.is_world_process_zero:
                logger.warning(
                    "the training loss has been negative for %d steps (steps %d-%d). With clip_mode=element "
                    "only the positive per-entry terms are clamped, so the loss can sink below zero while the "
                    "student moves away from its teacher: check probe/divergence.",
                    span, self.negative_since, state.global_step,
                )  # fmt: skip

    def _timed_score(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.score()
        self._check(step, metrics)
        return {**metrics, "time/probe_s": time.perf_counter() - t0}
