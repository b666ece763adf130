"""Where each cell of an experiment stands, read from its files alone (so a report or a status works on any
directory, whoever ran it: this module, a cluster array running `--print-commands`, or a person by hand)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from opsd.evaluation.samples import SAMPLES_FILE, SUMMARY_FILE
from opsd.experiment import spec as S
from opsd.rundir import METRICS_FILE, checkpoint_step, checkpoints, is_complete

FAILED_FILE = "failed.json"  # DIR/failed.json: jobs that failed every attempt, with their logs
JOBS_FILE = "jobs.jsonl"  # DIR/jobs.jsonl: one line per finished attempt (job, devices, start, seconds, exit)


@dataclass(frozen=True)
class CellState:
    arm: str
    seed: int
    step: int  # last logged optimizer step (0 before the first)
    trained: bool  # checkpoint-100 complete
    scored: dict[int, Path]  # step -> evaluation directory with a summary.json
    samples: int  # samples on disk in the cell's evaluations (progress while scoring)

    @property
    def final_scored(self) -> bool:
        return S.STEPS in self.scored


def last_step(run_dir: Path) -> int:
    """The last step in metrics.jsonl (read from its end; a cut or unreadable line is passed over)."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return 0
    with path.open("rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 65536))
        tail = f.read().decode("utf-8", errors="replace").splitlines()
    for line in reversed(tail):
        try:
            step = json.loads(line).get("step")
        except (json.JSONDecodeError, AttributeError):
            continue
        if isinstance(step, int):
            return step
    return 0


def scored_steps(eval_dir: Path) -> dict[int, Path]:
    """step -> the checkpoint-N evaluation under a cell's sweep directory that has its summary."""
    found = {}
    if eval_dir.is_dir():
        for sub in sorted(eval_dir.iterdir()):
            step = checkpoint_step(sub)
            if step is not None and (sub / SUMMARY_FILE).is_file():
                found[step] = sub
    return found


def count_samples(eval_dir: Path) -> int:
    total = 0
    for path in eval_dir.glob(f"*/{SAMPLES_FILE}"):
        with path.open("rb") as f:
            total += sum(1 for _ in f)
    return total


def cell_state(directory: Path, arm: str, seed: int) -> CellState:
    run = S.run_dir(directory, arm, seed)
    ev = S.eval_dir(directory, arm, seed)
    return CellState(
        arm=arm, seed=seed, step=last_step(run), trained=is_complete(S.final_checkpoint(directory, arm, seed)),
        scored=scored_steps(ev), samples=count_samples(ev) if ev.is_dir() else 0,
    )  # fmt: skip


def all_scored(directory: Path, arm: str, seed: int) -> bool:
    """Every complete checkpoint of the cell has its evaluation (the `--every-checkpoint` goal)."""
    have = scored_steps(S.eval_dir(directory, arm, seed))
    steps = [checkpoint_step(c) for c in checkpoints(S.run_dir(directory, arm, seed)) if is_complete(c)]
    return bool(steps) and all(s in have for s in steps)


def base_scored(directory: Path) -> bool:
    return (S.base_eval_dir(directory) / SUMMARY_FILE).is_file()


def read_failed(directory: Path) -> dict[str, dict]:
    path = directory / FAILED_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}


def write_failed(directory: Path, failed: dict[str, dict]) -> None:
    (directory / FAILED_FILE).write_text(json.dumps(failed, indent=1) + "\n")
