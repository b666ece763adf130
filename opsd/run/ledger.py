"""The compute ledger: what each optimizer step spent, in tokens and seconds, the same way for every method, so that
methods are compared per generated token and per GPU-hour, not per step (docs/training.md, The compute ledger).

Per optimizer step, summed over all processes:
- `generated_tokens`: completion tokens the rollout engine sampled (a step that reuses an earlier generation,
  `steps_per_rollout` > 1, books none);
- `teacher_tokens`: real tokens through a teacher forward (teacher prompt + completion; a contrastive teacher's
  second forward too); 0 for GRPO;
- `trained_tokens`: completion tokens the loss is computed on (its denominator);
- `probe_tokens`: completion tokens the probe sampled for its frozen set (`opsd.run.probe`, OPSD only): once, before
  step 1, so in step 1's row, and none on a resume that reloads the set; apart from `generated_tokens`, which the
  per-million-token comparisons read (totalled where the run's rows have the column: a run from before it has none);
- `step_s`: the step's wall seconds (`StepTimer`: from its first micro-batch to its end) and each phase's
  (`rollout_s`, `weight_sync_s`, `train_micro_s`, ...);
- `gpu_s`: `step_s` x the run's GPUs (one per process), where there is a GPU; absent on a CPU.

The trainers book tokens on `opsd.run.step_watch.ComputeLedger`, which the step's `StepTimer` closes at the step's
end (no callback of its own: the step's path through the libraries stays as it was). Each step is a row of
`ledger.jsonl` in the run directory (trimmed to the checkpoint on resume, like metrics.jsonl) and `ledger/*`
metrics in metrics.jsonl and the trackers. The experiment's report reads each cell's rows
(`opsd.experiment.cells.cell_ledger`) and sums them here (`ledger_totals`).
"""

from __future__ import annotations

from collections.abc import Iterable

from opsd.run.step_watch import LEDGER_TOKENS, PROBE_TOKENS, TOKEN_KINDS


def ledger_totals(rows: Iterable[dict]) -> dict[str, float]:
    """A run's totals: tokens of each kind (the probe's where a row has the column: 0 in a row without it), wall
    seconds, GPU-seconds (only when every step has them), steps."""
    rows = list(rows)
    kinds = LEDGER_TOKENS if any(PROBE_TOKENS in r for r in rows) else TOKEN_KINDS
    out: dict[str, float] = {k: float(sum(r.get(k, 0) for r in rows)) for k in kinds}
    out["step_s"] = float(sum(r.get("step_s", 0.0) for r in rows))
    if rows and all("gpu_s" in r for r in rows):
        out["gpu_s"] = float(sum(r["gpu_s"] for r in rows))
    out["steps"] = float(len(rows))
    return out
