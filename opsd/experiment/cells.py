"""Where each cell of an experiment stands, read from its files alone (so a report or a status works on any
directory, whoever ran it: this module, a cluster array running `--print-commands`, or a person by hand).

Disk. A capped run saves a checkpoint every 10 steps with the optimizer state it would resume from; a scored cell
never resumes, so `prune_cell` drops what only resuming reads (optimizer, scheduler and RNG state, DeepSpeed's
optimizer shards, an EMA teacher) from every checkpoint but the final one, and removes intermediate checkpoints
that have no evaluation unless `--every-checkpoint` keeps their adapters. The final checkpoint stays whole.
`disk_bytes` is what the status table shows per cell.

The files a report reads (each evaluation's summary.json and samples.jsonl, DIR/failed.json, DIR/jobs.jsonl) are
checked as they are read: one edited or cut by hand is a `UserError` naming the file, the line and what to delete.
Every value is checked for its type and its range where it is read (a sample count is a positive integer of at
most `MAX_SAMPLES`, a label one line of plain text, a key of failed.json a job key of a valid arm name), so that
nothing a disk can hold reaches the statistics, the figures or report.md unchecked. A run's compute ledger
(`cell_ledger`) is checked alike, but one that is damaged leaves that cell's compute columns n/a, with why, rather
than refusing the report: the verdict does not read it. `check_links` refuses a link
under the directory that leads out of it (the report reads there and the runner writes and prunes there), one that
would read another cell's files as its own, and a loop. A cut last line of DIR/jobs.jsonl (a stop mid-append) is
skipped and counted.

Benchmarks. When the experiment's evaluation flags name `--benchmarks` (`spec_benchmarks`), each evaluation
directory holds one evaluation per benchmark (DIR/NAME/summary.json, samples.jsonl) and benchmarks.json, written
once all of them are; such a directory counts as scored by that file (`evaluation_done`), and each benchmark's
evaluation is read and checked as a single one is (`read_evals`). The step reported is the one the flags declare
with `--step`, the final checkpoint otherwise (`declared_step`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from opsd.errors import UserError
from opsd.evaluation.benchmarks import BENCHMARKS_FILE, parse_benchmark_names
from opsd.evaluation.report import AGGREGATE_METRICS, MAX_SAMPLES, summary_problem
from opsd.evaluation.samples import SAMPLES_FILE, SUMMARY_FILE
from opsd.experiment import spec as S
from opsd.experiment.arms import BASE, check_name
from opsd.paths import GIB, MIB, FileKind, read_bytes, shown, write_atomically
from opsd.rundir import EMA_TEACHER_FILE, METRICS_FILE, checkpoint_step, checkpoints, is_complete

logger = logging.getLogger(__name__)

FAILED_FILE = "failed.json"  # DIR/failed.json: jobs that failed every attempt, with their logs
JOBS_FILE = "jobs.jsonl"  # DIR/jobs.jsonl: one line per finished attempt (job, devices, start, seconds, exit)


_KEY = re.compile(
    r"(?P<kind>train|eval)-(?P<arm>.+)-s(?P<seed>[0-9]{1,10})|(?P<base>base)-(?P<base_seed>[0-9]{1,10})"
)


@dataclass(frozen=True)
class JobKey:
    """What one job does to which cell: `train` or `eval` of the cell (arm, seed), or `base`, the base model's
    evaluation with training seed `seed`'s sampling seeds (arm None).

    Its string form, `str(key)`, names the job on disk: the keys of DIR/failed.json and the logs DIR/logs/KEY.log,
    e.g. `train-A-s42`, `eval-A-s42`, `base-42`; `JobKey.parse` reads it back.
    """

    kind: str  # base | train | eval
    seed: int
    arm: str | None = None

    KINDS = ("base", "train", "eval")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS or (self.arm is None) != (self.kind == "base"):
            raise ValueError(f"a job key is base with no arm, or train or eval of an arm; got {self!r}")

    def __str__(self) -> str:
        return f"base-{self.seed}" if self.arm is None else f"{self.kind}-{self.arm}-s{self.seed}"

    @classmethod
    def parse(cls, text: str) -> JobKey:
        """The key `str(key)` wrote; ValueError for any other text, and for a key whose arm is not an arm name
        or whose seed is out of range (a key names a log file, so `train-../x-s1` must not read as one)."""
        m = _KEY.fullmatch(text)
        seed = int(m["seed"] or m["base_seed"]) if m else -1
        bad_arm = m is not None and m["arm"] is not None and not _arm_name(m["arm"])
        if m is None or bad_arm or seed > S.MAX_SEED:
            raise ValueError(f"{shown(text)} is not a job key (train-ARM-sSEED, eval-ARM-sSEED or base-SEED)")
        if m["base"]:
            return cls("base", seed)
        return cls(m["kind"], seed, m["arm"])

    @property
    def name(self) -> str:
        """How the job reads in logs and DIR/jobs.jsonl: `train A/42`, `eval A/42`, `base 42`."""
        return f"base {self.seed}" if self.arm is None else f"{self.kind} {self.arm}/{self.seed}"


def _arm_name(text: str) -> bool:
    try:
        check_name(text, "job key")
    except UserError:
        return False
    return True


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
            step = S.parse_json(line).get("step")
        except (ValueError, AttributeError):
            continue
        if type(step) is int and 0 <= step <= MAX_STEP:
            return step
    return 0


# What a checkpoint holds only so that training can resume from it (HF Trainer, DeepSpeed, the EMA teacher).
TRAINING_STATE = ("optimizer.pt", "scheduler.pt", "rng_state*.pth", "global_step*", "latest", "zero_to_fp32.py",
                  EMA_TEACHER_FILE)  # fmt: skip


def disk_bytes(path: Path) -> int:
    """Bytes of the files under `path` (a file or a directory; links are not followed); 0 if it is absent."""
    if not path.exists():
        return 0
    if not path.is_dir():
        return path.lstat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except FileNotFoundError:  # removed while walking (a job writing beside us)
                continue
    return total


def cell_bytes(directory: Path, arm: str, seed: int) -> int:
    """What one cell holds on disk: its run directory and its evaluations."""
    return disk_bytes(S.run_dir(directory, arm, seed)) + disk_bytes(S.eval_dir(directory, arm, seed))


def prune_cell(directory: Path, arm: str, seed: int, *, keep_adapters: bool) -> int:
    """Once a cell is scored, drop from its run what only a resumed training run reads; the bytes freed.

    The final checkpoint is kept whole. Every other checkpoint-N loses its `TRAINING_STATE`, and goes entirely
    unless `keep_adapters` (`--every-checkpoint`) or an evaluation of it exists. Nothing is removed from a cell
    whose final checkpoint is not complete or not scored: it may still resume.
    """
    run = S.run_dir(directory, arm, seed)
    scored = scored_steps(S.eval_dir(directory, arm, seed))
    if not is_complete(S.final_checkpoint(directory, arm, seed)) or S.STEPS not in scored:
        return 0
    freed = 0
    for checkpoint in checkpoints(run):
        step = checkpoint_step(checkpoint)
        if step == S.STEPS:
            continue
        if keep_adapters or step in scored:
            doomed = [p for pattern in TRAINING_STATE for p in checkpoint.glob(pattern)]
        else:
            doomed = [checkpoint]
        for path in doomed:
            freed += disk_bytes(path)
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    return freed


def spec_benchmarks(spec: S.Spec) -> list[str]:
    """The benchmarks the experiment's evaluation flags name (`--benchmarks`), in order; [] for one table."""
    value = S.eval_flag_value(spec.eval_flags, "--benchmarks")
    return parse_benchmark_names(value) if value else []


def declared_step(spec: S.Spec) -> int:
    """The checkpoint step the verdict reports: `--step N` of the evaluation flags, else the final one (checked
    against the steps the experiment scores: `spec.check_step`)."""
    return S.check_step(spec.eval_flags)


def evaluation_done(path: Path) -> bool:
    """A finished evaluation: one table's summary.json, or the benchmarks.json of a --benchmarks evaluation
    (written once every benchmark's summary is)."""
    return (path / SUMMARY_FILE).is_file() or (path / BENCHMARKS_FILE).is_file()


def scored_steps(eval_dir: Path) -> dict[int, Path]:
    """step -> the checkpoint-N evaluation under a cell's sweep directory that is finished (`evaluation_done`)."""
    found = {}
    if eval_dir.is_dir():
        for sub in sorted(eval_dir.iterdir()):
            step = checkpoint_step(sub)
            if step is not None and evaluation_done(sub):
                found[step] = sub
    return found


def count_samples(eval_dir: Path) -> int:
    total = 0
    for pattern in (f"*/{SAMPLES_FILE}", f"*/*/{SAMPLES_FILE}"):  # one table, or one per benchmark
        for path in eval_dir.glob(pattern):
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


def base_scored(directory: Path, seed: int) -> bool:
    """The base model is scored with training seed `seed`'s sampling seeds."""
    return evaluation_done(S.base_eval_dir(directory, seed))


METRICS = AGGREGATE_METRICS  # what eval_aime.py aggregates over runs: avg, pass@k, maj, format rate (percent)
SCORED = ("correct", "has_box")  # the per-sample fields a report compares
# Bounds on what a report reads: far above what a run writes (a samples file of 30 problems x 64 samples of 32k
# tokens is ~300 MiB), so only a wrong or damaged file reaches them.
RESULT_FILE = FileKind(
    "result file", "result files", 64 * MIB, "rerun the experiment", "it was not written by a run"
)
SAMPLES_KIND = FileKind(
    "samples file", "samples files", 4 * GIB, "rerun the experiment", "it was not written by a run"
)
_FAILED_FIELDS = {"job": str, "exit": int, "attempts": int, "log": str}
# Caps on the numbers a report reads. A sample count is a positive integer of at most MAX_SAMPLES samples per
# problem and MAX_PROBLEMS problems (the protocol draws 12 for 30): a count far beyond them is a damaged file,
# and `range(n)` of one would exhaust the memory. eval_aime.py's --compare checks the same summaries alike
# (`opsd.evaluation.report.summary_problem`).
MAX_STEP = 10**9  # a logged optimizer step (a capped run logs 1 to 100)
MAX_ATTEMPTS = 1000  # a failed job's attempts (--retries is at most 10)
MAX_JOB_SECONDS = 10 * 365 * 86400.0  # a job's duration in jobs.jsonl: ten years
MAX_START = 100 * 365 * 86400.0  # its start, in seconds since 1970: before 2070


def _json_lines(path: Path, kind: FileKind, *, cut: list[int] | None = None) -> list[tuple[int, object]]:
    """(line number, parsed value) of every non-blank line; UserError naming the first line that is not JSON.
    With `cut` (an append-only log), a last line without its newline that is not JSON, a write cut short by a
    stop, is skipped with a warning instead and its number appended to `cut`, as `opsd.rundir.read_step_log`
    skips one of metrics.jsonl."""
    skip_cut = cut is not None
    data = read_bytes(path, kind)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        # A cut can split a character, and only in the last line.
        if not (skip_cut and err.start > data.rfind(b"\n")):
            raise UserError(f"{path} is not UTF-8 text (byte {err.start})") from None
        text = data[: data.rfind(b"\n") + 1].decode("utf-8") + "\ufffd"
    out = []
    lines = text.split("\n")
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            try:
                out.append((lineno, S.parse_json(line)))
            except ValueError as err:
                if skip_cut and lineno == len(lines):  # the last piece: no newline after it
                    logger.warning("%s line %d is cut short (a write stopped midway); skipped: %s", path, lineno,
                                   shown(line))  # fmt: skip
                    cut.append(lineno)
                    continue
                raise UserError(f"{path} line {lineno} is not JSON ({S.json_error(err)})") from None
    return out


def _finite(x: object) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


# -- a cell's compute ledger ------------------------------------------------------------------------------------

# A capped run's ledger.jsonl is 100 lines of a few hundred bytes; one far bigger is not a run's.
LEDGER_KIND = FileKind(
    "compute ledger", "compute ledgers", 64 * MIB, "rerun the cell's training", "it was not written by a run"
)
# One step's tokens or seconds beyond this are not a run's (100 steps of 32 problems x 16 rollouts x 32k tokens
# book ~2e9 generated tokens in all); bounded so that a report's sums stay numbers JSON can write.
MAX_LEDGER_VALUE = 1e12
NO_LEDGER = "no ledger.jsonl (a run from before the compute ledger)"


def cell_ledger(directory: Path, arm: str, seed: int) -> tuple[dict[str, float] | None, str]:
    """(totals, "") of a finished cell's compute ledger: `opsd.run.ledger.ledger_totals` over the rows of its
    run's ledger.jsonl (tokens of each kind, step seconds, GPU-seconds where every step has them, steps); or
    (None, why there are none): no ledger (`NO_LEDGER`: a run from before the ledger), or one that is not a
    finished run's (over `LEDGER_KIND`'s cap, not UTF-8 or not JSON, a row without its tokens and step seconds
    as numbers from 0 to `MAX_LEDGER_VALUE`, steps other than 1 to `spec.STEPS`). The last row of a step
    wins, as in the report's curves: a run started again from step 0 in the same directory (a cell's printed
    command run by hand once its intermediate checkpoints are pruned) appends its rows after the earlier run's.
    Never a UserError: the ledger adds the compute columns to a report, so a damaged one leaves them n/a, not
    the verdict unwritten."""
    from opsd.run.ledger import ledger_totals
    from opsd.run.step_watch import TOKEN_KINDS
    from opsd.rundir import LEDGER_FILE

    path = S.run_dir(directory, arm, seed) / LEDGER_FILE
    if not os.path.lexists(path):
        return None, NO_LEDGER
    try:
        lines = _json_lines(path, LEDGER_KIND)
    except UserError as err:
        return None, str(err)
    by_step: dict[int, dict] = {}
    for lineno, row in lines:
        numbers = (*TOKEN_KINDS, "step_s", *(("gpu_s",) if isinstance(row, dict) and "gpu_s" in row else ()))
        if not (isinstance(row, dict) and type(row.get("step")) is int and 0 <= row["step"] <= MAX_STEP
                and all(_finite(row.get(k)) and 0 <= row[k] <= MAX_LEDGER_VALUE for k in numbers)):  # fmt: skip
            return None, (
                f"{path} line {lineno} is not a ledger row (step, {', '.join(TOKEN_KINDS)}, step_s: numbers from 0 "
                f"to {MAX_LEDGER_VALUE:g})"
            )
        by_step[row["step"]] = row  # the last row of a step wins: a run restarted in the directory appends
    expected = set(range(1, S.STEPS + 1))
    missing, extra = sorted(expected - set(by_step)), sorted(set(by_step) - expected)
    if missing or extra:
        what = f"no row for step(s) {_few(missing)}" if missing else f"rows for step(s) {_few(extra)}"
        return None, f"{path} has {what}, not one for each step from 1 to {S.STEPS}"
    return ledger_totals(by_step.values()), ""


def _few(numbers: list[int], limit: int = 5) -> str:
    more = f" and {len(numbers) - limit} more" if len(numbers) > limit else ""
    return ", ".join(map(str, numbers[:limit])) + more


def read_eval(eval_dir: Path) -> tuple[dict, dict[str, dict[str, list[float]]]]:
    """(summary metrics, {field of SCORED: {problem id: values by sample index}}) of one finished evaluation.

    UserError, naming the file and what to do, when summary.json or samples.jsonl is not what eval_aime.py
    writes: not JSON, a missing or non-numeric metric, a sample without its fields, a sample index given twice
    or skipped, or fewer samples than the summary counts (a cut file).
    """
    redo = f"delete {eval_dir} and rerun the experiment to score it again"
    where = eval_dir / SUMMARY_FILE
    try:
        summary = S.parse_json(read_bytes(where, RESULT_FILE).decode("utf-8", errors="replace"))
        metrics = summary["metrics"]
        labels = metrics["labels"]
        ok = isinstance(metrics, dict) and isinstance(labels, dict)
    except UserError as err:  # over its cap, unreadable: before ValueError, which InvalidValue also is
        raise UserError(f"{err}; {redo}") from None
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise UserError(f"{where} is not an eval_aime.py summary; {redo}")
    problem = summary_problem(metrics)
    if problem:
        raise UserError(f"{where} is not an eval_aime.py summary: {problem}; {redo}")
    path = eval_dir / SAMPLES_FILE
    try:
        lines = _json_lines(path, SAMPLES_KIND)
    except UserError as err:
        raise UserError(f"{err}; {redo}") from None
    by_problem: dict[str, dict[int, dict[str, float]]] = {}
    for lineno, r in lines:
        good = isinstance(r, dict) and type(r.get("id")) in (str, int) and type(r.get("idx")) is int
        good = good and 0 <= r["idx"] < MAX_SAMPLES and all(type(r.get(k)) is bool for k in SCORED)
        if not good:
            raise UserError(f"{path} line {lineno} is not a sample (id, idx, correct, has_box); {redo}")
        seen = by_problem.setdefault(str(r["id"]), {})
        if r["idx"] in seen:
            raise UserError(
                f"{path} line {lineno}: sample {r['idx']} of problem {shown(r['id'])} is there twice; {redo}"
            )
        seen[r["idx"]] = {k: float(r[k]) for k in SCORED}
    n = metrics["n"]
    for pid, samples in by_problem.items():
        # Distinct indices >= 0 are exactly 0..n-1 when there are n of them and the largest is n-1.
        if len(samples) != n or max(samples) != n - 1:
            raise UserError(
                f"{path}: problem {shown(pid)} has {len(samples)} samples, the summary says {n}; {redo}"
            )
    if len(by_problem) != metrics["n_problems"]:
        raise UserError(
            f"{path} holds {len(by_problem)} problems, the summary says {metrics['n_problems']}; {redo}"
        )
    scores = {
        k: {pid: [samples[i][k] for i in range(n)] for pid, samples in by_problem.items()} for k in SCORED
    }
    return metrics, scores


def read_failed(directory: Path) -> dict[str, dict]:
    """DIR/failed.json: job key -> {job, exit, attempts, log}; {} when absent; UserError when damaged."""
    path = directory / FAILED_FILE
    if not path.is_file():
        return {}
    fix = f"it was edited or damaged: delete {path} (a rerun records failures again)"
    try:
        data = S.parse_json(read_bytes(path, RESULT_FILE).decode("utf-8", errors="replace"))
    except UserError as err:  # over its cap, unreadable: named as such, not as JSON
        raise UserError(f"{err}; {fix}") from None
    except ValueError as err:
        raise UserError(f"{path} is not valid JSON ({S.json_error(err)}); {fix}") from None
    good = isinstance(data, dict) and all(
        isinstance(v, dict) and set(v) == set(_FAILED_FIELDS) and all(type(v[k]) is t for k, t in _FAILED_FIELDS.items())
        for v in data.values()
    )  # fmt: skip
    if not good:
        raise UserError(f"{path} does not map jobs to {{job, exit, attempts, log}}; {fix}")
    for key, record in data.items():
        try:
            job = JobKey.parse(key)
        except ValueError as err:
            raise UserError(f"{path}: {err}; {fix}") from None
        problem = _failure_problem(job, record)
        if problem:
            raise UserError(f"{path}: job {key}'s {problem}; {fix}")
    return data


def _failure_problem(key: JobKey, record: dict) -> str | None:
    """What in one record of failed.json is not what the runner writes, in words; None when all is."""
    if record["job"] != key.name:
        return f"field job is {shown(record['job'])}, not {key.name!r}"
    if not -255 <= record["exit"] <= 255:
        return f"field exit is {record['exit']}, not an exit status (-255 to 255)"
    if not 1 <= record["attempts"] <= MAX_ATTEMPTS:
        return f"field attempts is {record['attempts']}, not a count from 1 to {MAX_ATTEMPTS}"
    if not S.plain_line(record["log"]):  # the report quotes it in a line of report.md
        return f"field log is {shown(record['log'])}, not one line of plain text"
    return None


def cell_failure(failed: dict[str, dict], arm: str, seed: int) -> tuple[JobKey, dict] | None:
    """The cell's job that failed every attempt, from `read_failed`'s map, with its record; None if neither did."""
    for kind in ("train", "eval"):
        key = JobKey(kind, seed, arm)
        if str(key) in failed:
            return key, failed[str(key)]
    return None


def read_jobs(directory: Path) -> tuple[list[dict], int]:
    """(DIR/jobs.jsonl's records (kind, start, seconds, ...), 1 when its last line was cut by a stop mid-append and
    is skipped, else 0); ([], 0) when absent; UserError when a line is damaged."""
    path = directory / JOBS_FILE
    if not path.is_file():
        return [], 0
    fix = f"it was edited or damaged: delete {path} (it only times the report)"
    cut: list[int] = []
    try:
        lines = _json_lines(path, RESULT_FILE, cut=cut)
    except UserError as err:
        raise UserError(f"{err}; {fix}") from None
    for lineno, r in lines:
        if not (isinstance(r, dict) and r.get("kind") in JobKey.KINDS and _finite(r.get("start"))
                and _finite(r.get("seconds"))):  # fmt: skip
            raise UserError(f"{path} line {lineno} is not a job record (kind, start, seconds); {fix}")
        # Bounded, so that the report's sums and spans stay finite numbers that JSON can write.
        if not (0 <= r["start"] <= MAX_START and 0 <= r["seconds"] <= MAX_JOB_SECONDS):
            raise UserError(
                f"{path} line {lineno} is not a job record: start {shown(r['start'])} or seconds "
                f"{shown(r['seconds'])} is out of range (a time since 1970, a duration of at most "
                f"{MAX_JOB_SECONDS:.0f} s); {fix}"
            )
    return [r for _, r in lines], len(cut)


def write_failed(directory: Path, failed: dict[str, dict]) -> None:
    # Replaced whole: a run stopped while writing it leaves the previous record, not half of one.
    write_atomically(directory / FAILED_FILE, (json.dumps(failed, indent=1) + "\n").encode())


def _read_and_written(directory: Path, spec: S.Spec) -> Iterator[Path]:
    """Every path under the directory that a report reads or a run writes, prunes or appends to, each directory
    before what it holds (so that a link is met where it leaves the directory, before anything under it)."""
    for name in (S.EXPERIMENT_FILE, FAILED_FILE, JOBS_FILE, S.RECIPES, S.RUNS, S.EVALS, S.LOGS):
        yield directory / name
    yield directory / S.EVALS / BASE
    benchmarks = spec_benchmarks(spec)
    for seed in spec.seeds:
        yield from _with_entries(S.base_eval_dir(directory, seed))
        for name in benchmarks:
            yield from _with_entries(S.base_eval_dir(directory, seed) / name)
        yield directory / S.LOGS / f"{JobKey('base', seed)}.log"
    for arm in spec.arm_names:
        yield from (S.recipe_path(directory, arm), directory / S.RUNS / arm, directory / S.EVALS / arm)
        for seed in spec.seeds:
            yield from _with_entries(S.run_dir(directory, arm, seed))
            for sweep in _with_entries(S.eval_dir(directory, arm, seed)):
                yield sweep
                if checkpoint_step(sweep) is not None:
                    yield from (sweep / SUMMARY_FILE, sweep / SAMPLES_FILE, sweep / BENCHMARKS_FILE)
                    for name in benchmarks:
                        yield from _with_entries(sweep / name)
            for kind in ("train", "eval"):
                yield directory / S.LOGS / f"{JobKey(kind, seed, arm)}.log"


def _with_entries(path: Path) -> Iterator[Path]:
    yield path
    if path.is_dir():
        yield from sorted(path.iterdir())


# The entries an experiment directory's layout holds: a link into any of them would make one path of the layout
# read another's files (a seed's evaluation paired with another seed's cells).
LAYOUT_NAMES = (S.EXPERIMENT_FILE, FAILED_FILE, JOBS_FILE, S.RECIPES, S.RUNS, S.EVALS, S.LOGS)


def check_links(directory: Path, spec: S.Spec) -> None:
    """Refuse a link under the experiment directory that could change which cell a file belongs to, in one line
    naming it: a link out of the directory (an evaluation directory replaced by a link to /etc: the report would
    read there, and a run would write, prune and append logs there); a link into the directory's own layout
    (`evals/a/seed1` to `evals/a/seed2` would pair seed 2's evaluation with seed 1's); two paths of the layout
    leading to one place; a loop (read as absent, it would drop a cell or a curve without a word). What is left
    is a link to a place inside the directory but outside its layout (a directory moved aside, `DIR/evals-B`, and
    linked back as `DIR/evals/B`): only that path leads there, so its files stay its cell's, and it is followed."""
    import errno

    root = Path(os.path.realpath(directory))
    seen: dict[Path, Path] = {}  # where a path of the layout leads -> that path
    for path in _read_and_written(directory, spec):
        if not os.path.lexists(path):
            continue
        try:
            os.stat(path)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise UserError(
                    f"{shown(path)} is a link that leads back to itself (a loop); delete it (a rerun makes what "
                    "belongs there again)"
                ) from None
        real = Path(os.path.realpath(path))
        if real != root and root not in real.parents:
            raise UserError(
                f"{shown(path)} is a link to {shown(real)}, outside the experiment {shown(directory)}; an "
                "experiment reads and writes only inside its directory: put what it links to in its place, or "
                "delete the link (a rerun makes it again)"
            )
        linked = real != Path(os.path.realpath(path.parent)) / path.name
        if linked and (real == root or real.relative_to(root).parts[0] in LAYOUT_NAMES):
            raise UserError(
                f"{shown(path)} is a link to {shown(real)}, inside the experiment's own layout: its files would be "
                "read as another cell's; put what belongs there in its place, or delete the link (a rerun makes it "
                "again)"
            )
        if seen.setdefault(real, path) != path:
            raise UserError(
                f"{shown(path)} and {shown(seen[real])} both lead to {shown(real)}: one place would be read as two "
                "cells'; keep one of them, and delete the other (a rerun makes it again)"
            )


def check_directory(directory: Path, spec: S.Spec) -> None:
    """Read every result a report will read (failed.json, jobs.jsonl, each finished evaluation) and check the
    links (`check_links`), so that a damaged one is refused before a run adds to the directory."""
    check_links(directory, spec)
    read_failed(directory)
    read_jobs(directory)  # a cut last line is skipped here as in the report
    benchmarks = spec_benchmarks(spec)
    for seed in spec.seeds:
        if base_scored(directory, seed):
            read_evals(S.base_eval_dir(directory, seed), benchmarks)
        for arm in spec.arm_names:
            for where in scored_steps(S.eval_dir(directory, arm, seed)).values():
                read_evals(where, benchmarks)


def read_evals(eval_dir: Path, benchmarks: list[str]) -> dict[str | None, tuple[dict, dict]]:
    """`read_eval` of one finished evaluation ({None: ...}), or of each benchmark's under it ({name: ...})."""
    if not benchmarks:
        return {None: read_eval(eval_dir)}
    return {name: read_eval(eval_dir / name) for name in benchmarks}
