"""Trainer callbacks: the append-only metrics log, optimizer timing, tail weight averaging, non-finite steps."""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType
from transformers import TrainerCallback

from opsd.rundir import METRICS_FILE, checkpoint_dir, latest_complete_checkpoint, mark_complete, wavg_dir

logger = logging.getLogger(__name__)


class CompleteMark(TrainerCallback):
    """Marks a checkpoint complete once the trainer has finished writing it (added last, so it runs last)."""

    def on_save(self, args, state, control, **kwargs):
        ckpt = checkpoint_dir(args.output_dir, state.global_step)
        if state.is_world_process_zero and ckpt.is_dir():
            mark_complete(ckpt)


class MetricsJSONL(TrainerCallback):
    """Appends every log record, with its step, to `<output_dir>/metrics.jsonl` (main process only)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        path = Path(args.output_dir) / METRICS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"step": state.global_step, **logs}) + "\n")


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
    """Per optimizer step: wall time, optimizer time, and the trainer's phase totals (rollout, sync, loss).

    The trainer times its phases on a `PhaseClock`; each step's totals become the metrics `time/<phase>_s`, so
    a step's split adds up across its accumulation micro-batches.
    """

    def __init__(self, metrics: dict, clock: PhaseClock):
        self.metrics = metrics
        self.clock = clock
        self._t_step = self._t_opt = None

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._allocated_gib = torch.cuda.memory_allocated() / 2**30
        self._t_step = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._t_opt = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        if self._t_opt is not None:
            self.metrics["time/optimizer_s"].append(now - self._t_opt)
        if self._t_step is not None:
            self.metrics["time/step_s"].append(now - self._t_step)
        if torch.cuda.is_available():
            # Everything this process holds at its peak (colocated vLLM included), and the part the step added.
            peak = torch.cuda.max_memory_allocated() / 2**30
            self.metrics["memory/peak_gib"].append(peak)
            self.metrics["memory/step_extra_gib"].append(peak - self._allocated_gib)
        for phase, seconds in self.clock.take().items():
            self.metrics[f"time/{phase}_s"].append(seconds)
        self._t_step = self._t_opt = None
        self._allocated_gib = 0.0


class TailWeightAverage(TrainerCallback):
    """Averages the trainable weights over the last `last_n` optimizer steps and saves the average.

    After each of the steps max_steps-last_n+1 .. max_steps the trainable tensors are added to a float32 sum;
    at the end the mean is loaded into the model, saved to `checkpoint-<max_steps>-wavg<last_n>`, and the
    final weights are restored. The running sum is saved with every checkpoint so that a resumed run averages
    exactly the same steps.
    """

    def __init__(self, model, last_n: int):
        self.model = model
        self.last_n = last_n
        self.sum: dict[str, torch.Tensor] = {}
        self.count = 0

    def _trainable(self):
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step <= state.max_steps - self.last_n:
            return
        for name, p in self._trainable().items():
            acc = self.sum.setdefault(name, torch.zeros_like(p, dtype=torch.float32, device="cpu"))
            acc += p.detach().float().cpu()
        self.count += 1

    def on_save(self, args, state, control, **kwargs):
        ckpt = checkpoint_dir(args.output_dir, state.global_step)
        if state.is_world_process_zero and ckpt.is_dir() and self.count:
            torch.save({"sum": self.sum, "count": self.count}, ckpt / "wavg_state.pt")

    def restore(self, checkpoint_dir: str | Path) -> None:
        path = Path(checkpoint_dir) / "wavg_state.pt"
        if path.is_file():
            state = torch.load(path, map_location="cpu")
            self.sum, self.count = state["sum"], state["count"]

    def averaged_state(self) -> dict[str, torch.Tensor]:
        return {name: acc / self.count for name, acc in self.sum.items()}

    def save_average(self, trainer, max_steps: int) -> Path | None:
        if self.count == 0:
            return None
        if self.count != self.last_n:
            logger.warning("weight average covers %d steps, not %d", self.count, self.last_n)
        params = self._trainable()
        final = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for name, avg in self.averaged_state().items():
                params[name].copy_(avg.to(params[name].dtype))
        out = wavg_dir(trainer.args.output_dir, max_steps, self.last_n)
        trainer.save_model(str(out))
        with torch.no_grad():
            for name, value in final.items():
                params[name].copy_(value)
        logger.info("saved the average of the last %d steps' weights to %s", self.count, out)
        return out


class NonFiniteGuard(TrainerCallback):
    """Skips every optimizer step whose loss or gradient is not finite, and stops after `max_consecutive`.

    A skipped step changes nothing: its gradients are dropped before `optimizer.step()` (torch optimizers
    leave a parameter without a gradient untouched: no moment update, no step count, no weight decay) and
    the optimizer reports the step as skipped, so the LR schedule does not advance either (as DeepSpeed and
    AMP loss scaling do). It still counts as an optimizer step: `global_step` and the data move on. Each step
    logs `train/nonfinite_skipped` (1 if skipped, else 0). Under DeepSpeed the engine has already stepped
    during backward and skips non-finite gradients itself (`check_grad_overflow`); there this guard only
    counts the skipped steps and stops the run.
    """

    def __init__(self, metrics: dict, accelerator, max_consecutive: int):
        self.metrics = metrics
        self.accelerator = accelerator
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        self.last_skipped = False
        self._loss_bad = None  # tensor flag over the current step's micro-batches; no sync per micro-batch

    def note_loss(self, loss: torch.Tensor) -> None:
        bad = ~torch.isfinite(loss.detach()).all()
        self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
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
        if isinstance(optimizer, AcceleratedOptimizer):
            # Read back by the trainer (`optimizer_step_was_skipped`) to hold the LR scheduler.
            optimizer._is_overflow = skipped
        self.last_skipped = skipped
        self.metrics["train/nonfinite_skipped"].append(float(skipped))
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
