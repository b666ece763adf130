"""Comparing and aggregating finished evaluation runs: --compare, --aggregate, --plot-steps."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

from opsd.errors import UserError, cut, shown
from opsd.evaluation.eval_config import EvalConfig
from opsd.evaluation.samples import SUMMARY_FILE
from opsd.paths import MIB, FileKind, json_error, parse_json, read_bytes

logger = logging.getLogger(__name__)

# What --compare, --aggregate and --plot-steps read, checked as the experiment's report checks the same files
# (opsd.experiment.cells): a file far bigger than eval_aime.py writes (a summary of 30 problems is ~20 kB), a
# count beyond these caps or a value of another type is a wrong or damaged file, refused in one line naming it.
RESULT_KIND = FileKind(
    "result file", "result files", 64 * MIB, "pass result directories written by eval_aime.py",
    "it was not written by eval_aime.py",
)  # fmt: skip
MAX_SAMPLES = 100_000  # samples per problem (the protocol draws 12)
MAX_PROBLEMS = 1_000_000
MAX_STEP = 10**9  # an optimizer step of a checkpoint
AGGREGATE_METRICS = ("avg", "pass_at_k", "maj", "format_rate")
# A label of summary.json (`avg@12`, `pass@12`, `maj@12`) is a table heading: one short line of plain text.
_LABEL = re.compile(r"[A-Za-z0-9@%.+_-]{1,40}")


def read_result(path: Path) -> dict[str, Any]:
    """A JSON object eval_aime.py wrote (summary.json, benchmarks.json): UserError naming the file when it is
    over `RESULT_KIND`'s cap, not UTF-8, not JSON or not an object."""
    data = read_bytes(path, RESULT_KIND)
    try:
        value = parse_json(data.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"{shown(path)} is not UTF-8 text (byte {err.start}); {RESULT_KIND.fix}") from None
    except ValueError as err:
        raise UserError(f"{shown(path)} is not JSON ({json_error(err)}); {RESULT_KIND.fix}") from None
    if not isinstance(value, dict):
        raise UserError(
            f"{shown(path)} holds a JSON {type(value).__name__}, not an object; {RESULT_KIND.fix}"
        )
    return value


def _count(x: object, cap: int) -> bool:
    """A positive integer of at most `cap` (not 4.0, not True)."""
    return type(x) is int and 1 <= x <= cap


def _number(x: object, low: float, high: float) -> bool:
    return type(x) in (int, float) and math.isfinite(x) and low <= x <= high


def summary_problem(metrics: dict) -> str | None:
    """What in summary.json's metrics a report reads is not what eval_aime.py writes, in words; None when all is:
    the counts, the rates in percent and their labels."""
    for key in ("n", "n_problems"):
        cap = MAX_SAMPLES if key == "n" else MAX_PROBLEMS
        if not _count(metrics.get(key), cap):
            return f"field metrics.{key} is {shown(metrics.get(key))}, not a whole number from 1 to {cap:,}"
    for key in AGGREGATE_METRICS:
        if not _number(metrics.get(key), 0, 100):
            return f"field metrics.{key} is {shown(metrics.get(key))}, not a percentage from 0 to 100"
    labels = metrics.get("labels")
    for key in ("avg", "pass_at_k", "maj"):
        label = labels.get(key) if isinstance(labels, dict) else None
        if not (isinstance(label, str) and _LABEL.fullmatch(label)):
            return (
                f"field metrics.labels.{key} is {shown(label)}, not a label such as 'avg@12' (one line of at most 40 "
                "letters, digits and @%.+_-)"
            )
    return None


def rows_problem(summary: dict) -> str | None:
    """What in summary.json's config and per-problem table (what --compare pairs) is not what eval_aime.py
    writes; None when all is."""
    config, metrics = summary.get("config", {}), summary["metrics"]
    if not isinstance(config, dict):
        return f"field config is {shown(config)}, not an object"
    rows, count = metrics.get("problems"), metrics.get("n_problems")
    if not (isinstance(rows, list) and _count(count, MAX_PROBLEMS) and len(rows) == count):
        return f"field metrics.problems is not a list of metrics.n_problems = {shown(count)} rows"
    ids = set()
    for i, r in enumerate(rows):
        good = isinstance(r, dict) and type(r.get("id")) in (str, int) and str(r["id"]) not in ids
        if not (good and all(_number(r.get(k), 0, 1) for k in ("accuracy", "format_rate"))):
            return f"metrics.problems[{i}] is not a problem's row (a distinct id, accuracy and format_rate from 0 to 1)"
        ids.add(str(r["id"]))
    return None


def table_problem(summary: dict) -> str | None:
    """What a benchmark table (`opsd.evaluation.suite.benchmark_row`) reads beyond `summary_problem` and
    `rows_problem`: the other rates and their SEs, the mean length, each problem's correct count; None when all is."""
    metrics = summary["metrics"]
    for key in ("avg", "maj", "format_rate", "truncation_rate", "mean_tokens"):
        value, se = metrics.get(key), metrics.get(f"{key}_se")
        if not (_number(value, 0, math.inf) and (se is None or _number(se, 0, math.inf))):
            return f"field metrics.{key} or {key}_se is not a number >= 0 ({shown(value)}, {shown(se)})"
    n = metrics["n"]
    for i, r in enumerate(metrics["problems"]):
        if not (type(r.get("n_correct")) is int and 0 <= r["n_correct"] <= n):
            return f"metrics.problems[{i}].n_correct is {shown(r.get('n_correct'))}, not a count from 0 to n = {n}"
    return None


def curve_problem(summary: dict) -> str | None:
    """What --plot-steps reads beyond `summary_problem`: the step (none: the base model) and avg's SE."""
    step, se = summary.get("step"), summary["metrics"].get("avg_se")
    if not (step is None or (type(step) is int and 0 <= step <= MAX_STEP)):
        return f"field step is {shown(step)}, not a checkpoint step from 0 to {MAX_STEP:,}"
    if not (se is None or _number(se, 0, 100)):
        return f"field metrics.avg_se is {shown(se)}, not a percentage from 0 to 100"
    return None


def _metrics_problem(summary: dict) -> str | None:
    return summary_problem(summary["metrics"])


# What each mode reads of a summary, checked before it reads it.
COMPARE_READS = (rows_problem,)
AGGREGATE_READS = (_metrics_problem,)
CURVE_READS = (_metrics_problem, curve_problem)
TABLE_READS = (rows_problem, _metrics_problem, table_problem)


def check_summary(summary: dict, where: Path, reads: tuple = COMPARE_READS) -> dict[str, Any]:
    """`summary` (read from `where`) when every check of `reads` passes; one UserError line naming it otherwise."""
    problem = None if isinstance(summary.get("metrics"), dict) else "it has no metrics object"
    for check in reads:
        problem = problem or check(summary)
    if problem:
        raise UserError(f"{shown(where)} is not an eval_aime.py summary: {problem}; {RESULT_KIND.fix}")
    return summary


def load_summary(path: str | Path, reads: tuple = COMPARE_READS) -> dict[str, Any]:
    """DIR/summary.json of a finished evaluation, read within `RESULT_KIND`'s cap and checked for what the mode
    reads (`reads`: `COMPARE_READS` by default); one UserError line naming the file otherwise."""
    f = Path(path).expanduser() / SUMMARY_FILE
    if not f.is_file():
        raise UserError(
            f"{cut(str(f))} not found: pass result directories written by eval_aime.py (each holds {SUMMARY_FILE})"
        )
    return check_summary(read_result(f), f, reads)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def run_compare(config: EvalConfig) -> list[str]:
    from opsd.evaluation.benchmarks import check_same_problems
    from opsd.evaluation.metrics import paired_compare, per_problem_accuracy, per_problem_format_rate

    a_dir, b_dir = config.compare
    a, b = load_summary(a_dir), load_summary(b_dir)
    ca, cb = a.get("config", {}), b.get("config", {})
    for key in ("dataset_source", "n"):
        if ca.get(key) != cb.get(key):
            logger.warning(
                "the two results differ in %s (%s vs %s)", key, shown(ca.get(key)), shown(cb.get(key))
            )
    acc_a, acc_b = per_problem_accuracy(a["metrics"]), per_problem_accuracy(b["metrics"])
    check_same_problems(a, b, a_dir, b_dir)  # a benchmark's runs pair over one problem set, or not at all
    if not set(acc_a) & set(acc_b):
        raise UserError(
            f"{a_dir} and {b_dir} share no problem ids: a paired comparison needs the same problems"
        )
    # Accuracy at the top level; the format rate (share of samples with a complete box) paired the same way.
    fmt_a, fmt_b = per_problem_format_rate(a["metrics"]), per_problem_format_rate(b["metrics"])
    result = {
        "a": a_dir,
        "b": b_dir,
        **paired_compare(acc_a, acc_b),
        "format_rate": paired_compare(fmt_a, fmt_b),
    }
    lines = []
    for label, r in (("avg accuracy", result), ("format rate", result["format_rate"])):
        lines += [
            f"{label}: a = {a_dir}: {_fmt(r['mean_a'])}   b = {b_dir}: {_fmt(r['mean_b'])}   (%)",
            f"  b - a = {r['mean_diff']:+.2f} points, SE {_fmt(r['se'])}, 95% CI "
            f"[{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}], paired over {r['n_problems']} problems",
        ]
    _save_result(config, "compare.json", result, lines)
    return lines


def _save_result(config: EvalConfig, filename: str, result: dict[str, Any], lines: list[str]) -> None:
    """Write `result` as JSON under --out, when one was given, and say where."""
    if not config.out:
        return
    out = Path(config.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    (out / filename).write_text(json.dumps(result, indent=2) + "\n")
    lines.append(f"written: {out / filename}")


def run_aggregate(config: EvalConfig) -> list[str]:
    from opsd.evaluation.metrics import aggregate_runs

    summaries = [load_summary(d, AGGREGATE_READS) for d in config.aggregate]
    labels = {json.dumps(s["metrics"]["labels"], sort_keys=True) for s in summaries}
    if len(labels) > 1:
        raise UserError(f"the runs use different n or k ({sorted(labels)}); aggregate runs of one protocol")
    label = summaries[0]["metrics"]["labels"]
    result: dict[str, Any] = {"runs": list(config.aggregate)}
    lines = [f"{len(summaries)} run(s): {', '.join(config.aggregate)}"]
    for key in AGGREGATE_METRICS:
        values = [float(s["metrics"][key]) for s in summaries]
        agg = aggregate_runs(values)
        result[key] = {**agg, "values": values}
        name = label.get(key, key)
        runs = ", ".join(f"{v:.2f}" for v in values)
        lines.append(f"{name:>12} {agg['mean']:.2f} ± {_fmt(agg['se'])} (runs: {runs})")
    _save_result(config, "aggregate.json", result, lines)
    return lines


def step_point(run: str, summary: dict[str, Any]) -> dict[str, Any]:
    """One point of the accuracy-vs-step curve: a run's step (none = 0, the base model) and avg@n ± SE."""
    step = summary.get("step")
    if step is None:
        logger.info("%s names no checkpoint-N; plotted at step 0 (the base model)", run)
        step = 0
    metrics = summary["metrics"]
    return {"run": run, "step": int(step), "avg": metrics["avg"], "avg_se": metrics["avg_se"],
            "label": metrics["labels"]["avg"]}  # fmt: skip


def write_step_plot(points: list[dict[str, Any]], out: Path) -> Path:
    """accuracy_vs_step.png and .json under `out`."""
    from opsd.evaluation.figures import accuracy_vs_step

    out.mkdir(parents=True, exist_ok=True)
    png = accuracy_vs_step(points, out / "accuracy_vs_step.png")
    (out / "accuracy_vs_step.json").write_text(json.dumps(points, indent=2) + "\n")
    return png


def run_plot_steps(config: EvalConfig) -> list[str]:
    points = [step_point(d, load_summary(d, CURVE_READS)) for d in config.plot_steps]
    png = write_step_plot(points, Path(config.out).expanduser())
    return [
        f"{p['step']:>6}  {p['avg']:.2f} ± {_fmt(p['avg_se'])}  {p['run']}"
        for p in sorted(points, key=lambda p: p["step"])
    ] + [f"plot: {png}"]
