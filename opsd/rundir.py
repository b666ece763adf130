"""A run directory's layout, in one place: what training writes into `output_dir`, and how resume, the
evaluation sweep and the plots find it.

    <output_dir>/
      opsd_config.json       the resolved settings of the latest segment and their history (opsd.run.resume)
      metrics.jsonl          one JSON line per logging step, append-only (cut back to the checkpoint on resume)
      completions.jsonl      the completions log (opsd.method.completions), cut back like metrics.jsonl
      <log>.rejected         lines a resume dropped from one of those logs as unreadable (trim_step_log)
      probe_set.json         the probe's frozen problems and rollouts (opsd.run.probe)
      teacher_pairing.json   which problem's reference each teacher reads, teacher_ref_pairing=shuffled
                             only (opsd.method.pairing)
      checkpoint-N/          the trainer's checkpoint at step N; `.complete` once it is fully written,
                             `ema_teacher.pt` with an EMA teacher
      checkpoint-N-wavgK/    the tail weight average over the last K steps (opsd.run.callbacks)

Only checkpoints with the `.complete` mark are resumed from or swept; a save cut by a kill has none. The
step logs are read through `read_step_log`, which skips (and names, in a warning) any line that is not a
JSON object.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

CONFIG_FILE = "opsd_config.json"
METRICS_FILE = "metrics.jsonl"
COMPLETIONS_FILE = "completions.jsonl"
# One row per optimizer step: its tokens and seconds (opsd.run.ledger), for every method.
LEDGER_FILE = "ledger.jsonl"
PROBE_FILE = "probe_set.json"
PAIRING_FILE = "teacher_pairing.json"
EMA_TEACHER_FILE = "ema_teacher.pt"
COMPLETE_MARK = ".complete"
# The flag that lets a rerun resume a run directory whose configuration changed (opsd.run.resume).
ALLOW_FLAG = "--allow-config-change"
# Append-only logs that a resume cuts back to the checkpoint's step.
STEP_LOGS = (METRICS_FILE, COMPLETIONS_FILE, LEDGER_FILE)
# `<log>.rejected`: the lines a resume dropped from a step log because no reader could parse them.
REJECTED_SUFFIX = ".rejected"
EXCERPT_CHARS = 60
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


@dataclass(frozen=True)
class _LogLine:
    """One non-blank line of a step log: its JSON object, or why it is not one."""

    lineno: int  # 1-based
    raw: bytes  # as written, without its newline
    record: dict | None
    why: str  # "" for a record


def _json_kind(value: object) -> str:
    """`a JSON array`, `a JSON string`, ...: what a parsed JSON value is, in words."""
    if value is None:
        return "JSON null"
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", dict: "object"}
    return f"a JSON {kinds.get(type(value), type(value).__name__)}"


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _step_log_lines(data: bytes) -> Iterator[_LogLine]:
    """The non-blank lines of a step log, each parsed. A line is a record when it is UTF-8, valid JSON, a
    JSON object, and its `step` (if any) is a number; a last line without its newline is a write cut short
    unless it is a whole record all the same."""
    lines = data.split(b"\n")
    partial = not data.endswith(b"\n")
    if not partial:
        lines.pop()  # the empty piece after the final newline
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        record, why = None, ""
        try:
            value = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            why = "not UTF-8 text"
        except json.JSONDecodeError as err:
            why = f"not valid JSON ({err.msg})"
        else:
            if not isinstance(value, dict):
                why = f"{_json_kind(value)}, not an object"
            elif "step" in value and not _is_number(value["step"]):
                why = f"a JSON object whose step is {_json_kind(value['step'])}, not a number"
            else:
                record = value
        if why and partial and lineno == len(lines):
            why = f"a partial last line (no newline at the end: a write cut short), {why}"
        yield _LogLine(lineno, raw, record, why)


def _excerpt(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    return repr(text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "...")


def read_step_log(path: str | Path) -> list[dict]:
    """The JSON objects of a step log (metrics.jsonl, completions.jsonl) in file order; [] for a missing file.

    A line that is not a JSON object (garbage, a line cut short, not UTF-8, a JSON array or number, an
    object whose `step` is not a number) is skipped with a WARNING naming the file, its line number (from 1)
    and an excerpt; blank lines are skipped silently."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in _step_log_lines(path.read_bytes()):
        if line.record is None:
            logger.warning("%s line %d is %s; skipped: %s", path, line.lineno, line.why, _excerpt(line.raw))
        else:
            records.append(line.record)
    return records


def rejected_log(path: str | Path) -> Path:
    """Where `trim_step_log` keeps the lines it drops as unreadable: `<log>.rejected` beside the log."""
    path = Path(path)
    return path.with_name(path.name + REJECTED_SUFFIX)


def trim_step_log(path: Path, last_step: int) -> None:
    """Cut a step log back to the checkpoint being resumed, so that its steps stay continuous.

    Records past `last_step` are dropped (the resumed run writes them again). A line that is not a record
    (`read_step_log`: garbage, a write cut short by a kill, a JSON non-object) is dropped too, with a WARNING
    naming it, and appended as it was to `<log>.rejected` beside the log (`rejected_log`), so nothing is
    lost. The log is rewritten through a temporary file, so a kill during the trim leaves it whole."""
    path = Path(path)
    if not path.is_file():
        return
    data = path.read_bytes()
    kept: list[bytes] = []
    rejected: list[bytes] = []
    past = 0
    for line in _step_log_lines(data):
        if line.record is None:
            logger.warning(
                "%s line %d is %s; dropped from the log on resume and kept in %s: %s",
                path, line.lineno, line.why, rejected_log(path), _excerpt(line.raw),
            )  # fmt: skip
            rejected.append(line.raw)
        elif line.record.get("step", 0) <= last_step:
            kept.append(line.raw)
        else:
            past += 1
    if rejected:
        with rejected_log(path).open("ab") as f:
            f.write(b"".join(raw + b"\n" for raw in rejected))
    trimmed = b"".join(raw + b"\n" for raw in kept)
    if trimmed != data:
        tmp = path.with_name(path.name + ".trim")
        tmp.write_bytes(trimmed)
        os.replace(tmp, path)
    if past:
        logger.info("%s: dropped %d record(s) past step %d, the checkpoint resumed", path, past, last_step)
