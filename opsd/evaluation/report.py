"""Comparing and aggregating finished evaluation runs: --compare, --aggregate, --plot-steps."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from opsd.errors import UserError
from opsd.evaluation.eval_config import EvalConfig
from opsd.evaluation.samples import SUMMARY_FILE

logger = logging.getLogger(__name__)


def load_summary(path: str) -> dict[str, Any]:
    f = Path(path).expanduser() / SUMMARY_FILE
    if not f.is_file():
        raise UserError(
            f"{f} not found: pass result directories written by eval_aime.py (each holds {SUMMARY_FILE})"
        )
    summary = json.loads(f.read_text())
    if "metrics" not in summary or "problems" not in summary["metrics"]:
        raise UserError(f"{f} has no metrics.problems table; was it written by eval_aime.py?")
    return summary


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def run_compare(config: EvalConfig) -> list[str]:
    from opsd.evaluation.metrics import paired_compare, per_problem_accuracy, per_problem_format_rate

    a_dir, b_dir = config.compare
    a, b = load_summary(a_dir), load_summary(b_dir)
    for key in ("dataset_source", "n"):
        if a["config"].get(key) != b["config"].get(key):
            logger.warning(
                "the two results differ in %s (%r vs %r)", key, a["config"].get(key), b["config"].get(key)
            )
    acc_a, acc_b = per_problem_accuracy(a["metrics"]), per_problem_accuracy(b["metrics"])
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


AGGREGATE_METRICS = ("avg", "pass_at_k", "maj", "format_rate")


def run_aggregate(config: EvalConfig) -> list[str]:
    from opsd.evaluation.metrics import aggregate_runs

    summaries = [load_summary(d) for d in config.aggregate]
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
    points = [step_point(d, load_summary(d)) for d in config.plot_steps]
    png = write_step_plot(points, Path(config.out).expanduser())
    return [
        f"{p['step']:>6}  {p['avg']:.2f} ± {_fmt(p['avg_se'])}  {p['run']}"
        for p in sorted(points, key=lambda p: p["step"])
    ] + [f"plot: {png}"]
