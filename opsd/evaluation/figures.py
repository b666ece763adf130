"""Evaluation plots (PNG, matplotlib's Agg backend, so no display is needed).

Both take plain numbers: per-problem accuracies are fractions in [0, 1] and are drawn in percent;
run-level accuracies (avg@n) and their SEs are already in percent, as `opsd.evaluation.metrics` reports them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

logger = logging.getLogger(__name__)


def per_problem_accuracy_plot(
    ids: Sequence[str], accuracy: Sequence[float], se: Sequence[float], path: str | Path, title: str = ""
) -> Path:
    """Bar per problem (accuracy in %) with its binomial SE as error bar and the mean as a dashed line."""
    values = [100.0 * a for a in accuracy]
    errors = [100.0 * e for e in se]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(ids) + 2), 4))
    ax.bar(range(len(ids)), values, yerr=errors, capsize=2, color="tab:blue", ecolor="0.3")
    if values:
        ax.axhline(sum(values) / len(values), color="tab:red", linestyle="--", linewidth=1, label="mean")
        ax.legend(loc="upper right")
    ax.set_xticks(range(len(ids)), [str(i) for i in ids], rotation=90, fontsize=7)
    return _save_panel(fig, ax, path, "problem", "accuracy (%) ± binomial SE", title, ylim=(0, 105))


def accuracy_vs_step(points: Sequence[Mapping[str, Any]], path: str | Path, title: str = "") -> Path:
    """avg@n against training step: each run a point with its SE error bar, a line through the step means.

    `points` are mappings with ``step``, ``avg`` (percent), ``avg_se`` (percent or None) and ``label``.
    """
    fig, ax = plt.subplots(figsize=(6, 4))
    _errorbar_by_step(ax, points, fmt="o", color="tab:blue", label="run ± SE over problems")
    by_step: dict[int, list[float]] = {}
    for p in points:
        by_step.setdefault(p["step"], []).append(p["avg"])
    xs = sorted(by_step)
    ax.plot(
        xs,
        [sum(by_step[x]) / len(by_step[x]) for x in xs],
        color="tab:blue",
        alpha=0.5,
        label="mean per step",
    )
    labels = sorted({p.get("label", "avg") for p in points})
    ylabel = f"{' / '.join(labels)} (%)"
    return _save_panel(fig, ax, path, "training step", ylabel, title, legend={"loc": "best"})


def pass_at_k_curves(
    curves: Mapping[str, Sequence[Mapping[str, Any]]],
    path: str | Path,
    title: str = "",
    reference: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
) -> Path:
    """pass@k against k (log2 axis), one line per benchmark with its SE band; `reference` (the base model's
    curves) dashed in the same colour. Each curve is `opsd.evaluation.metrics.pass_at_k_curve`'s list of
    {k, value, se} in percent. A flat curve over a rising pass@1 is the narrowing that self-distillation can bring."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, (name, curve) in enumerate(curves.items()):
        color = plt.cm.tab10(i % 10)
        ks = [p["k"] for p in curve]
        values = [p["value"] for p in curve]
        se = [p["se"] or 0.0 for p in curve]
        ax.plot(ks, values, marker="o", markersize=3, color=color, label=name)
        ax.fill_between(ks, [v - e for v, e in zip(values, se, strict=True)],
                        [v + e for v, e in zip(values, se, strict=True)], color=color, alpha=0.15)  # fmt: skip
        if reference and name in reference:
            ref = reference[name]
            ax.plot([p["k"] for p in ref], [p["value"] for p in ref], linestyle="--", color=color, alpha=0.8,
                    label=f"{name} (base)")  # fmt: skip
    ax.set_xscale("log", base=2)
    return _save_panel(fig, ax, path, "k", "pass@k (%) ± SE over problems", title, ylim=(0, 105),
                       legend={"loc": "lower right", "fontsize": 8})  # fmt: skip


def benchmark_steps(
    series: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path, title: str = ""
) -> Path:
    """avg@n against training step, one line per benchmark and one for the macro average, each point with its SE;
    `series` maps a name to points {step, avg, avg_se} (percent)."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, (name, points) in enumerate(series.items()):
        pts = sorted(points, key=lambda p: p["step"])
        macro = name.startswith("macro")
        color = "black" if macro else plt.cm.tab10(i % 10)
        _errorbar_by_step(ax, pts, marker="o", color=color, linewidth=2 if macro else 1, label=name)
    return _save_panel(fig, ax, path, "training step", "avg@n (%) ± SE", title,
                       legend={"loc": "best", "fontsize": 8})  # fmt: skip


def _errorbar_by_step(ax, points: Sequence[Mapping[str, Any]], **style: Any) -> None:
    """Each point's avg (percent) at its step with its SE as error bar (none: 0), in `style`."""
    ax.errorbar(
        [p["step"] for p in points],
        [p["avg"] for p in points],
        yerr=[p["avg_se"] or 0.0 for p in points],
        capsize=3,
        **style,
    )


def _save_panel(
    fig,
    ax,
    path: str | Path,
    xlabel: str,
    ylabel: str,
    title: str,
    *,
    ylim: tuple[float, float] | None = None,
    legend: dict[str, Any] | None = None,
) -> Path:
    """The panel's axis labels, y range, title and legend (None: drawn by the caller, or none), saved to
    `path` at 100 dpi and the figure closed (a sweep draws many)."""
    path = Path(path)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title)
    if legend is not None:
        ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    logger.info("wrote %s", path)
    return path
