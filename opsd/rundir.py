"""A run directory's layout, in one place: what training writes into `output_dir`, and how resume, the
evaluation sweep and the plots find it.

    <output_dir>/
      opsd_config.json       the resolved settings of the latest segment and their history (opsd.resume)
      metrics.jsonl          one JSON line per logging step, append-only (cut back to the checkpoint on resume)
      completions.jsonl      the completions log (opsd.completions), cut back like metrics.jsonl
      probe_set.json         the probe's frozen problems and rollouts (opsd.probe)
      teacher_pairing.json   which problem's reference each teacher reads, teacher_ref_pairing=shuffled
                             only (opsd.pairing)
      checkpoint-N/          the trainer's checkpoint at step N; `.complete` once it is fully written,
                             `ema_teacher.pt` with an EMA teacher
      checkpoint-N-wavgK/    the tail weight average over the last K steps (opsd.callbacks)

Only checkpoints with the `.complete` mark are resumed from or swept; a save cut by a kill has none.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

CONFIG_FILE = "opsd_config.json"
METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
PROBE_FILE = "probe_set.json"
PAIRING_FILE = "teacher_pairing.json"
EMA_TEACHER_FILE = "ema_teacher.pt"
COMPLETE_MARK = ".complete"
# Append-only logs that a resume cuts back to the checkpoint's step.
STEP_LOGS = (METRICS_FILE, COMPLETIONS_FILE)
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def checkpoint_step(path: str | Path) -> int | None:
    """N of a directory named exactly `checkpoint-N`, else None."""
    m = _CHECKPOINT.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def step_in_path(path: str | Path) -> int | None:
    """N of the innermost `checkpoint-N` component of `path` (an adapter inside a run directory), else None."""
    steps = [checkpoint_step(part) for part in Path(path).parts]
    return next((s for s in reversed(steps) if s is not None), None)


def checkpoints(output_dir: str | Path) -> list[Path]:
    """Every `checkpoint-N` directory of a run, by N (complete or not)."""
    found = [
        p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and checkpoint_step(p) is not None
    ]
    return sorted(found, key=checkpoint_step)


def is_complete(checkpoint: str | Path) -> bool:
    return (Path(checkpoint) / COMPLETE_MARK).is_file()


def mark_complete(checkpoint: str | Path) -> None:
    (Path(checkpoint) / COMPLETE_MARK).touch()


def latest_complete_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest `checkpoint-N` that was fully written (a run killed while saving leaves no mark)."""
    done = [p for p in checkpoints(output_dir) if is_complete(p)]
    return done[-1] if done else None


def wavg_dir(output_dir: str | Path, step: int, last_n: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}-wavg{last_n}"


def trim_step_log(path: Path, last_step: int) -> None:
    """Drop records past the checkpoint being resumed (and a line cut by a kill), so steps stay continuous."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= last_step:
            kept.append(line)
    path.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
