"""What watches each optimizer step: the time of its phases (`PhaseClock`, `StepTimer`), its tokens and seconds
(`ComputeLedger`, docs in `opsd.run.ledger`), its non-finite loss or gradients (`NonFiniteGuard`), whether its
rollouts are correct (`RolloutGrader`) and how long they are (`completion_metrics`); and the window each of them
and the trainers log into (`MetricsWindow`), which TRL's public `log` logs.

Rollout correctness: `rollout/correct`, `rollout/boxed`, `rollout/length` at every generation. Each rollout is
graded against its problem's `answer` with the grader `eval_aime.py` scores samples with (`opsd.grading.grade`:
the last complete box of the answer region, math-verify then the string fallback), in a background thread, so the
step's GPU work goes on meanwhile: the grades are collected at the end of the optimizer step whose generation
produced them and reduced over processes there.

- `rollout/correct`: share of graded rollouts whose answer is correct (rows with an empty answer are not graded;
  without any graded row the metric is left out);
- `rollout/boxed`: share of rollouts with a complete, non-empty box in their answer region (the format criterion
  of the evaluation);
- `rollout/length`: mean completion length in tokens.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from transformers import TrainerCallback

from opsd.grading import extract_boxed, grade
from opsd.rundir import LEDGER_FILE, latest_complete_checkpoint

logger = logging.getLogger(__name__)

# How a watcher logs: a trainer's `MetricsWindow.add` for one mode (metric -> value).
Record = Callable[[dict[str, float]], None]


class MetricsWindow:
    """The repository's metrics of the current logging period, per mode (train, eval): each value added as it is
    measured (`add`), and at each of TRL's logs averaged over the period and handed to TRL's public `log` with
    TRL's own metrics (`take`), the trainer's `log` override. TRL keeps its own window private (`_metrics`);
    this one is the trainer's, so no helper of the repository holds TRL's.

    `skip_nan`: a value that is NaN is left out of its key's mean (TRL's GRPOTrainer does so; its SDFTTrainer
    averages every value, so a non-finite step's loss shows)."""

    def __init__(self, *, skip_nan: bool = False):
        self.skip_nan = skip_nan
        self.modes: dict[str, defaultdict[str, list[float]]] = {
            "train": defaultdict(list),
            "eval": defaultdict(list),
        }

    def add(self, metrics: Mapping[str, float], mode: str) -> None:
        window = self.modes[mode]
        for key, value in metrics.items():
            window[key].append(value)

    def take(self, mode: str) -> dict[str, float | None]:
        """The mean of each key of `mode` over the period (eval keys prefixed `eval_`, as TRL logs them), the
        period then emptied. A key whose values were all NaN (with `skip_nan`) is None."""
        means = {}
        for key, values in self.modes[mode].items():
            kept = [v for v in values if not math.isnan(v)] if self.skip_nan else values
            if values:
                means[key] = sum(kept) / len(kept) if kept else None
        self.modes[mode].clear()
        return {f"eval_{k}" if mode == "eval" else k: v for k, v in means.items()}


class WindowLogging:
    """What a TRL trainer of the repository adds to log through its own `MetricsWindow` (`self.logged`): values
    for the current mode (`record_metrics`) or for training whatever the mode (`train_record`, what the step's
    watchers are handed), averaged into TRL's public `log`. Placed before the TRL base, so `log` wraps TRL's."""

    logged: MetricsWindow

    def record_metrics(self, metrics: dict[str, float]) -> None:
        """Adds values to the current mode's logging period (averaged at the next log, like every metric)."""
        self.logged.add(metrics, "train" if self.model.training else "eval")

    def train_record(self, metrics: dict[str, float]) -> None:
        """Adds values to the training period, whatever the mode (the step's watchers log through it)."""
        self.logged.add(metrics, "train")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, with the trainer's metrics of the period averaged in."""
        logs.update(self.logged.take("train" if self.model.training else "eval"))
        super().log(logs, start_time)


def completion_metrics(rollouts: list[list[int]], *, stop_ids: list[int], gather, device) -> dict[str, float]:
    """The `completions/*` metrics of a generation (TRL's names and values): `rollouts` (this process's completion
    ids) summarised over all processes (`gather`: the accelerator's).

    A rollout is cut (`clipped_ratio`) when its last token is none of `stop_ids` (end-of-sequence ids and the pad
    id); an empty one is not cut. Terminated lengths are 0 when every rollout was cut."""
    lengths = gather(torch.tensor([len(r) for r in rollouts], device=device))
    if lengths.numel() == 0:
        raise RuntimeError("the rollout engine returned no completions: see its log above")
    cut = gather(torch.tensor([bool(r) and r[-1] not in stop_ids for r in rollouts], device=device))
    ended = lengths[~cut]
    if len(ended) == 0:
        ended = torch.zeros(1, device=device)
    return {
        "completions/mean_length": lengths.float().mean().item(),
        "completions/min_length": lengths.float().min().item(),
        "completions/max_length": lengths.float().max().item(),
        "completions/clipped_ratio": cut.float().mean().item(),
        "completions/mean_terminated_length": ended.float().mean().item(),
        "completions/min_terminated_length": ended.float().min().item(),
        "completions/max_terminated_length": ended.float().max().item(),
    }


# -- the time of a step's phases ---------------------------------------------------------------------------
class _Timed:
    seconds = 0.0


class PhaseClock:
    """Seconds per phase of the current optimizer step, for `StepTimer`.

    `phase(name)` times a block exclusively: a phase opened inside it is booked under its own name and left out
    of the outer one (the rollout inside a micro-batch, the weight push that opens a rollout). `part(name)`
    times a block inside a phase without taking it out (scoring + loss inside a micro-batch).
    """

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self._inner: list[float] = []  # per open phase: seconds of the phases opened inside it

    @contextmanager
    def phase(self, name: str):
        """Yields a record whose `seconds` is the block's own time once it has ended."""
        timed = _Timed()
        t0 = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield timed
        finally:
            elapsed = time.perf_counter() - t0
            timed.seconds = elapsed - self._inner.pop()
            self.seconds[name] += timed.seconds
            if self._inner:
                self._inner[-1] += elapsed

    @contextmanager
    def part(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def take(self) -> dict[str, float]:
        """The step's totals, clearing them for the next step."""
        out = dict(self.seconds)
        self.seconds.clear()
        return out


class StepTimer(TrainerCallback):
    """Per optimizer step: wall time, optimizer time, memory, and the trainer's phase totals (rollout, sync, loss).

    The trainer marks the step's start (`step_begins`, before its first micro-batch) and the end of its last
    micro-batch (`optimizer_begins`); the step ends at `on_step_end`. So `time/step_s` runs from the first
    micro-batch to the step's end and `time/optimizer_s` from the last backward to it (gradient clipping, the
    non-finite check, the optimizer and scheduler step). The trainer times its phases on a `PhaseClock`; each
    step's totals become the metrics `time/<phase>_s`, so a step's split adds up across its micro-batches.
    """

    def __init__(self, record: Record, clock: PhaseClock, ledger: ComputeLedger | None = None):
        self.record = record
        self.clock = clock
        self.ledger = ledger
        self._t_step = self._t_opt = None
        self._allocated_gib = 0.0

    def step_begins(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._allocated_gib = torch.cuda.memory_allocated() / 2**30
        self._t_step = time.perf_counter()

    def optimizer_begins(self) -> None:
        self._t_opt = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        logged = {}
        if self._t_opt is not None:
            logged["time/optimizer_s"] = now - self._t_opt
        if self._t_step is not None:
            logged["time/step_s"] = now - self._t_step
        if torch.cuda.is_available():
            # Everything this process holds at its peak (colocated vLLM included), and the part the step added.
            peak = torch.cuda.max_memory_allocated() / 2**30
            logged["memory/peak_gib"] = peak
            logged["memory/step_extra_gib"] = peak - self._allocated_gib
        seconds = {"step_s": now - self._t_step} if self._t_step is not None else {}
        for phase, phase_s in self.clock.take().items():
            logged[f"time/{phase}_s"] = phase_s
            seconds[f"{phase}_s"] = phase_s
        self.record(logged)
        if self.ledger is not None:
            self.ledger.close(args, state, seconds)
        self._t_step = self._t_opt = None
        self._allocated_gib = 0.0


# -- the compute ledger -----------------------------------------------------------------------------------------
TOKEN_KINDS = ("generated_tokens", "teacher_tokens", "trained_tokens")
# The probe's rollouts (`opsd.run.probe`: its frozen set, sampled once before step 1), in a column of their own: a
# row of an older run lacks it, so TOKEN_KINDS, which every row must hold, leaves it out.
PROBE_TOKENS = "probe_tokens"
LEDGER_TOKENS = (*TOKEN_KINDS, PROBE_TOKENS)


class ComputeLedger:
    """The compute ledger of a run (opsd.run.ledger): this process's tokens as the trainer books them (`add`),
    summed over processes at each step's end (`close`, a collective that `StepTimer.on_step_end` calls on every
    process) into the step's row of ledger.jsonl and its `ledger/*` metrics."""

    def __init__(self, record: Record, accelerator):
        self.record = record
        self.accelerator = accelerator
        self.counts = dict.fromkeys(LEDGER_TOKENS, 0)

    def add(self, *, generated: int = 0, teacher: int = 0, trained: int = 0, probe: int = 0) -> None:
        """Tokens this process spent towards the current step (`probe`: the probe's rollouts, booked before step 1
        and so in its row)."""
        self.counts["generated_tokens"] += int(generated)
        self.counts["teacher_tokens"] += int(teacher)
        self.counts["trained_tokens"] += int(trained)
        self.counts[PROBE_TOKENS] += int(probe)

    def close(self, args, state, seconds: dict[str, float]) -> None:
        """The step's row: its tokens over all processes and `seconds` (step_s and each phase's)."""
        local = torch.tensor([self.counts[k] for k in LEDGER_TOKENS], dtype=torch.float64)
        totals = self.accelerator.reduce(local.to(self.accelerator.device), reduction="sum").tolist()
        self.counts = dict.fromkeys(LEDGER_TOKENS, 0)
        row = {"step": state.global_step, **{k: int(v) for k, v in zip(LEDGER_TOKENS, totals, strict=True)}}
        row.update(seconds)
        if torch.cuda.is_available() and "step_s" in row:
            row["gpu_s"] = row["step_s"] * self.accelerator.num_processes
        self.record({f"ledger/{key}": float(row[key]) for key in (*LEDGER_TOKENS, "gpu_s") if key in row})
        if state.is_world_process_zero:
            path = Path(args.output_dir) / LEDGER_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")


# -- non-finite steps ----------------------------------------------------------------------------------
class NonFiniteGuard(TrainerCallback):
    """Skips every optimizer step whose loss or gradient is not finite, and stops after `max_consecutive`.

    A skipped step changes nothing: its gradients are dropped before `optimizer.step()` (torch optimizers
    leave a parameter without a gradient untouched: no moment update, no step count, no weight decay), and
    the LR schedule does not advance either (as under DeepSpeed's and AMP's overflow skips): the trainer
    steps its scheduler after the optimizer, and `on_step_end` puts the scheduler and the optimizer's
    hyperparameters back as they were before the step (`HeldSchedule`, through their public `state_dict` /
    `load_state_dict`), before the step is logged or saved. It still counts as an optimizer step:
    `global_step` and the data move on. Each step logs `train/nonfinite_skipped` (1 if skipped, else 0).
    Under DeepSpeed the engine has already stepped during backward and skips non-finite gradients itself
    (`check_grad_overflow`), its scheduler with it; there this guard only counts the skipped steps and stops
    the run.
    """

    def __init__(self, record: Record, accelerator, max_consecutive: int):
        self.record = record
        self.accelerator = accelerator
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.last_skipped = False
        self._loss_bad = None  # tensor flag over the current step's micro-batches; no sync per micro-batch
        self._held: HeldSchedule | None = None  # a skipped step's schedule, put back at its end

    def note_loss(self, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def on_pre_optimizer_step(
        self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs
    ):
        bad = torch.zeros((), device=self.accelerator.device)
        if self._loss_bad is not None:
            bad = bad + self._loss_bad.float()
        self._loss_bad = None
        if self.accelerator.distributed_type == DistributedType.DEEPSPEED:
            bad = bad + float(bool(optimizer.step_was_skipped))
        else:
            # Gradients are already reduced across processes here, but a non-finite loss may be local.
            for p in model.parameters():
                if p.grad is not None:
                    bad = bad + (~torch.isfinite(p.grad).all()).float()
        skipped = bool(self.accelerator.reduce(bad, reduction="sum") > 0)
        if skipped and self.accelerator.distributed_type != DistributedType.DEEPSPEED:
            model.zero_grad(set_to_none=True)
            self._held = HeldSchedule(lr_scheduler, optimizer)
        self.last_skipped = skipped
        self.record({"train/nonfinite_skipped": float(skipped)})
        if not skipped:
            self.consecutive = 0
            return
        self.consecutive += 1
        step = state.global_step + 1
        logger.warning("step %d: loss or gradient not finite; step skipped without an update", step)
        if self.consecutive >= self.max_consecutive:
            last = latest_complete_checkpoint(args.output_dir)
            raise RuntimeError(
                f"step {step}: the loss or gradient was not finite on {self.consecutive} consecutive optimizer "
                f"steps ({step - self.consecutive + 1}-{step}), which were skipped without an update; stopping "
                f"(max_nonfinite_steps={self.max_consecutive}). Last complete checkpoint: "
                f"{last or 'none yet'}; rerunning the same command resumes from it. Fix the cause first: a lower "
                "learning_rate, float32 instead of float16/bf16 overflow, or the data of these steps; or raise "
                "max_nonfinite_steps to tolerate longer runs of bad steps."
            )

    def on_step_end(self, args, state, control, **kwargs):
        if self._held is not None:
            self._held.restore()
            self._held = None


class HeldSchedule:
    """The LR schedule of a skipped optimizer step, held: taken before the step, `restore` puts the scheduler's
    state and the optimizer's hyperparameters (each param group's but its parameters: the learning rate the
    scheduler set) back as they were, so the next step runs at this one's rate and the schedule resumes where
    it stood, as if the scheduler had not stepped. Either may be None (a callback handler that holds none)."""

    def __init__(self, scheduler, optimizer):
        self.scheduler, self.optimizer = scheduler, optimizer
        self.schedule = copy.deepcopy(scheduler.state_dict()) if scheduler is not None else None
        groups = optimizer.param_groups if optimizer is not None else []
        self.groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in groups])

    def restore(self) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(copy.deepcopy(self.schedule))
        if self.optimizer is not None:
            for group, held in zip(self.optimizer.param_groups, self.groups, strict=True):
                for key, value in held.items():
                    if isinstance(group.get(key), torch.Tensor):
                        group[key].copy_(value)  # in place, as torch's schedulers set a tensor rate
                    else:
                        group[key] = value


# -- rollout correctness -------------------------------------------------------------------------------
# Each math-verify call gets this long (the evaluation's default), in the grader's worker process.
GRADE_TIMEOUT_S = 5.0
GRADER_THREAD = "opsd-grade"  # the name of the grader's thread (its prefix: the pool numbers it)


def grade_sums(texts: Sequence[str], answers: Sequence[str], lengths: Sequence[int]) -> list[float]:
    """[correct, graded, boxed, rows, tokens]: the sums that `metrics` turns into the rollout metrics."""
    correct = graded = boxed = 0
    for text, answer in zip(texts, answers, strict=True):
        answer = (answer or "").strip()
        if not answer:
            boxed += extract_boxed(text) is not None
            continue
        result = grade(text, answer, timeout_s=GRADE_TIMEOUT_S)
        graded += 1
        correct += result["correct"]
        boxed += result["has_box"]
    return [float(correct), float(graded), float(boxed), float(len(texts)), float(sum(lengths))]


def metrics(sums: Sequence[float]) -> dict[str, float]:
    """The rollout metrics from (reduced) `grade_sums`."""
    correct, graded, boxed, rows, tokens = sums
    out = {"rollout/boxed": boxed / max(rows, 1.0), "rollout/length": tokens / max(rows, 1.0)}
    if graded:
        out["rollout/correct"] = correct / graded
    return out


class RolloutGrader:
    """Grades one generation's rollouts in a background thread (`submit`); `collect` waits for them, reduces the
    sums over processes with `reduce` (a collective: every process calls it at the same step) and returns the
    metrics."""

    def __init__(
        self, decode: Callable[[list[list[int]]], list[str]], reduce: Callable[[torch.Tensor], torch.Tensor]
    ):
        self.decode, self.reduce = decode, reduce
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=GRADER_THREAD)
        self.pending: Future | None = None

    def submit(self, completion_ids: list[list[int]], answers: Sequence[str]) -> None:
        def work() -> list[float]:
            return grade_sums(self.decode(completion_ids), answers, [len(c) for c in completion_ids])

        self.pending = self.pool.submit(work)

    def collect(self, device: torch.device) -> dict[str, float] | None:
        """The pending generation's metrics over all processes, or None when none is pending."""
        if self.pending is None:
            return None
        sums = self.pending.result()
        self.pending = None
        return metrics(self.reduce(torch.tensor(sums, dtype=torch.float64, device=device)).tolist())
