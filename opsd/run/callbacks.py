"""A run's callbacks: the append-only metrics log, checkpoint marks, tail weight averaging (what runs around each
optimizer step, its timing, non-finite guard and rollout grades, is `opsd.run.step_watch`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import TrainerCallback

from opsd.rundir import METRICS_FILE, checkpoint_dir, mark_complete, wavg_dir

logger = logging.getLogger(__name__)


class FinalCheckpoint(TrainerCallback):
    """Saves the last step's checkpoint whatever `save_strategy` says: a run's result is its final checkpoint
    (`checkpoint-<max_steps>`, the path the harness prints), and transformers saves the last step only under a
    save strategy. The save is transformers' own (weights, optimizer, scheduler, RNG, trainer state), followed by
    every callback's `on_save` (the EMA teacher's and the tail average's state, the complete mark)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= state.max_steps or control.should_training_stop:
            control.should_save = True


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
