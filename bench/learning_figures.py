"""Figures of bench/learning.py, drawn from the rows of its result JSON (this version's or the earlier one's).

`plot` draws, for the `learning` preset, the probe divergence of every run (`learning_probe_divergence.png`)
and each cell's held-out gain over the base model in accuracy and format (`learning_gains.png`); for a JSON
whose `config.figure` is `controls`, one figure (`controls.png`): the gains against the base model (filled)
and against the matched arm (open), the probe divergence, and the gains against step of the horizon runs
where the JSON has them. matplotlib is imported on the first call, with the Agg backend.
"""

from __future__ import annotations

from pathlib import Path

from opsd.configuration.switches import CHOICES

TEACHER_REF_PAIRINGS = CHOICES["teacher_ref_pairing"]


def plot(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    if result.get("config", {}).get("figure") == "controls":
        return [plot_controls(result, out_dir, plt)]
    rows = result["rows"]
    labels = list(dict.fromkeys(_label(r) for r in rows))
    colors = {lab: plt.cm.tab10(i % 10) for i, lab in enumerate(labels)}

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for lab in labels:
        for i, r in enumerate(x for x in rows if _label(x) == lab and x["probe_divergence"]):
            steps, vals = zip(*r["probe_divergence"], strict=True)
            ax.plot(steps, vals, color=colors[lab], alpha=0.85, lw=1.5, label=lab if i == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("probe/divergence (held-out, unclipped)")
    ax.set_title("Student-teacher divergence on held-out problems (one line per seed)")
    ax.legend(fontsize=8)
    curve = _save(fig, out_dir / "learning_probe_divergence.png", plt)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    cells = [(f"{lab}, seed {r['seed']}", colors[lab], r) for lab in labels for r in rows if _label(r) == lab]
    for ax, key, title in ((axes[0], "diff", "accuracy"), (axes[1], "diff_format", "format rate")):
        _gains(ax, cells, key, f"trained - base, {title} (points, 95% CI)")
    fig.suptitle("Held-out gain after 100 steps, paired over problems")
    return [curve, _save(fig, out_dir / "learning_gains.png", plt)]


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _gains(ax, cells: list[tuple], key: str, xlabel: str) -> None:
    """One line per (name, color, evaluation): its difference with the base model (filled) and, where it has
    one, with the matched arm (open)."""
    ys, names = [], []
    for name, color, e in (c for c in cells if key in c[2]):
        _interval(ax, e[key], len(ys), color, "o")
        if key in e.get("vs_matched", {}):
            _interval(ax, e["vs_matched"][key], len(ys) + 0.3, color, "s", filled=False)
        ys.append(len(ys))
        names.append(name)
    ax.axvline(0, color="grey", lw=1)
    ax.set_yticks(ys, names, fontsize=7)
    ax.set_xlabel(xlabel)


def _interval(ax, d: dict, y: float, color, marker: str, filled: bool = True) -> None:
    lo, hi = d["ci_low"], d["ci_high"]
    err = [[d["mean"] - lo if lo is not None else 0], [hi - d["mean"] if hi is not None else 0]]
    ax.errorbar(d["mean"], y, xerr=err, fmt=marker, color=color, capsize=3,
                markerfacecolor=color if filled else "white")  # fmt: skip


def plot_controls(result: dict, out_dir: Path, plt) -> Path:
    """docs/controls.png: gains in accuracy and format at the main step (against the base, filled; against the
    matched arm, open), probe divergence of every run, and, where the JSON has horizon runs (the committed one),
    their gains against step."""
    rows, main_step = result["rows"], result["config"]["steps"]
    colors = {p: plt.cm.tab10(i) for i, p in enumerate(TEACHER_REF_PAIRINGS)}
    styles = {"rescale": "-", "element": "--", "token": ":", "none": "-."}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    main = [r for r in rows if "main" in r.get("parts", ["main"])]
    cells = [(f"{r['clip_mode']} {r['teacher_ref_pairing']}, seed {r['seed']}", colors[r["teacher_ref_pairing"]], e)
             for r in main for e in r.get("evals", []) if e["step"] == main_step]  # fmt: skip
    for ax, key, title in ((axes[0][0], "diff", "accuracy"), (axes[0][1], "diff_format", "format rate")):
        _gains(ax, cells, key, f"{title} at step {main_step}, points (95% CI)")
    ax = axes[1][0]
    for r in rows:
        if r["probe_divergence"]:
            steps, vals = zip(*r["probe_divergence"], strict=True)
            ax.plot(steps, vals, color=colors[r["teacher_ref_pairing"]], ls=styles.get(r["clip_mode"], "-"),
                    lw=1.3, alpha=0.85, label=f"{r['clip_mode']} {r['teacher_ref_pairing']} s{r['seed']}")  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("probe/divergence (to the run's own teacher)")
    ax.legend(fontsize=6, ncol=2)
    ax = axes[1][1]
    horizon = [x for x in rows if "horizon" in x.get("parts", [])]
    for i, r in enumerate(horizon):
        for key, marker, what in (("diff", "o", "accuracy"), ("diff_format", "s", "format")):
            points = [(0, 0.0, 0.0, 0.0)] + [
                (e["step"], d["mean"], *(d["mean"] if v is None else v for v in (d["ci_low"], d["ci_high"])))
                for e in r.get("evals", []) if key in e for d in [e[key]]
            ]  # fmt: skip
            s, m, lo, hi = zip(*points, strict=True)
            color = plt.cm.Dark2(2 * i + (key == "diff_format"))
            ax.plot(s, m, marker=marker, color=color, ls=styles.get(r["clip_mode"], "-"),
                    label=f"{r['clip_mode']} s{r['seed']}, {what}")  # fmt: skip
            ax.fill_between(s, lo, hi, color=color, alpha=0.12)
    if horizon:
        ax.axhline(0, color="grey", lw=1)
        ax.set_xlabel("optimizer step (matched reference; 0 = base)")
        ax.set_ylabel("trained - base, points (95% CI)")
        ax.legend(fontsize=8)
    else:
        ax.axis("off")
    dataset = result["config"].get("eval_dataset") or result["config"].get("dataset")
    fig.suptitle(f"Reference controls, held-out {dataset}, paired over problems; "
                 "top: trained − base (filled), − matched arm (open)")  # fmt: skip
    return _save(fig, out_dir / "controls.png", plt)


def _label(row: dict) -> str:
    label = f"{row['clip_mode']}, β={row['beta']:g}, lr={row['learning_rate']:g}"
    # The default pairing goes unnamed in the label (the committed learning JSON's rows lack the field).
    matched = TEACHER_REF_PAIRINGS[0]
    pairing = row.get("teacher_ref_pairing", matched)
    return label if pairing == matched else f"{label}, {pairing}"
