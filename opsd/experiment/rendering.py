"""The verdict rendered (`opsd.experiment.verdict.build`): `report.md`, `summary.json`, `verdict.png`,
`curves.png`, and the lines `python -m opsd.experiment` prints.

report.md (`markdown`): the settings, each arm's mean over its seeds (a bimodal arm's seeds first), each arm
against the baseline with its seeds, bootstrap, variance split and planning, each benchmark's own tables, the
compute ledger, and how to read the intervals. The figures (`figures`): each arm's seeds and mean with the base
model, each comparison's intervals (verdict.png), and the training curves with each seed's take-off marked
(`draw_curves`, curves.png).

Writing (`write`). Every file a report reads is checked, every figure drawn and every output rendered before the
first is written; then each is written to a temporary file beside it and renamed over it, so a report that
fails (a damaged file, an output path that is a directory, a full disk) leaves the previous report as it was.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from opsd.errors import UserError
from opsd.experiment import spec as S
from opsd.experiment import take_off as T
from opsd.experiment.verdict import CURVE_KEYS, METRICS, PLOT_LIMIT, build
from opsd.paths import cannot_create_in, shown, staged_write

REPORT_FILE, SUMMARY_JSON, VERDICT_PNG, CURVES_PNG = "report.md", "summary.json", "verdict.png", "curves.png"
OUTPUTS = (REPORT_FILE, SUMMARY_JSON, VERDICT_PNG, CURVES_PNG)


def _pm(x: dict | None, digits: int = 2) -> str:
    if not x:
        return "n/a"
    return f"{x['mean']:.{digits}f}" + ("" if x["se"] is None else f" ± {x['se']:.{digits}f}")


def _ci(iv: dict | None, number=lambda x: f"{x:+.2f}") -> str:
    """An interval as `estimate [low, high]`, each written by `number`; n/a without one."""
    if iv is None:
        return "n/a"
    if iv["low"] is None:
        return f"{number(iv['estimate'])} (no interval)"
    return f"{number(iv['estimate'])} [{number(iv['low'])}, {number(iv['high'])}]"


def _split(v: dict) -> str:
    """The variance split of the per-seed difference in words, saying what the seeds run cannot tell."""
    if v["total_sd"] is None:
        return "per-seed difference: one seed, no spread between seeds to split"
    head = f"per-seed difference: sd {v['total_sd']:.2f} points over {v['n_seeds']} seeds"
    if v["within_sd"] is None:
        return (f"{head}; the split into between seeds and within a seed needs n >= 2 samples per problem "
                f"(this evaluation drew {v['min_samples']})")  # fmt: skip
    if v["between_floored"]:
        return (f"{head}, below the within-seed (evaluation sampling) sd {v['within_sd']:.2f} alone: the between-seed "
                f"part cannot be told from 0 with {v['n_seeds']} seeds")  # fmt: skip
    return (f"{head} = between seeds {v['between_sd']:.2f} and within (evaluation sampling) {v['within_sd']:.2f} "
            "(in variance: between² + within² = sd²)")  # fmt: skip


def _code(text: str) -> str:
    """`text` as a markdown code span that nothing in it can end (a run of backticks gets a longer fence)."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    ticks = 1
    while "`" * ticks in text:
        ticks += 1
    fence = "`" * ticks
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _num(x: float | None, sign: bool = False) -> str:
    """A number of any size in a few characters: 12,345 / 12.35 / 0.0123 (`+` first with `sign`)."""
    if x is None:
        return "n/a"
    plus = "+" if sign else ""
    if x == 0 or abs(x) >= 100:
        return f"{x:{plus},.0f}"
    return f"{x:{plus}.2f}" if abs(x) >= 1 else f"{x:{plus}.3g}"


def _scaled(values: dict, key: str, scale: float) -> str:
    """values[key] / scale as `_num` writes it (tokens in millions, seconds in hours); n/a where it is absent."""
    return "n/a" if key not in values else _num(values[key] / scale)


def _per_million(iv: dict | None) -> str:
    return _ci(iv, lambda x: _num(x, sign=True))


def _ledger_lines(result: dict[str, Any], planned: int) -> list[str]:
    """report.md's compute ledger: one row per arm (`ledger`), then what each column is."""
    lines = ["## Compute ledger", "",
             "| arm | method | seeds with a ledger | generated tokens (M) per seed, mean ± sd | generated (M), sum | "
             "teacher tokens (M), sum | trained tokens (M), sum | training hours, sum | GPU-hours, sum | "
             "accuracy gain vs base per M generated tokens | format gain vs base per M generated tokens |",
             "|---" * 11 + "|"]  # fmt: skip
    notes = []
    for arm, e in result["arms"].items():
        led = e["ledger"]
        total, sd = led["total"] or {}, led["sd"] or {}
        per_seed = _scaled(led["mean"] or {}, "generated_tokens", 1e6)
        if sd.get("generated_tokens") is not None:
            per_seed += f" ± {_num(sd['generated_tokens'] / 1e6)}"
        sums = [_scaled(total, k, 1e6) for k in ("generated_tokens", "teacher_tokens", "trained_tokens")]
        if not led["seeds"]:
            gpu = "n/a"
        elif "gpu_s" in total:
            gpu = _scaled(total, "gpu_s", 3600)
        elif any("gpu_s" in t for t in led["per_seed"].values()):
            gpu = "n/a (not every run had a GPU)"
        else:
            gpu = "n/a (no GPU)"
        pm = led["per_million_generated"] or {}
        lines.append(
            f"| {arm} | {_code(led['method'])} | {len(led['seeds'])} of {planned} | {per_seed} | "
            f"{' | '.join(sums)} | {_scaled(total, 'step_s', 3600)} | {gpu} | "
            f"{_per_million(pm.get('accuracy'))} | {_per_million(pm.get('format rate'))} |"
        )
        for seed, why in led["unavailable"].items():
            notes.append(f"- **{arm}**, seed {seed}: no ledger totals: {why}")
        if led["per_million_why"] and led["seeds"]:
            notes.append(f"- **{arm}**: no gain per million generated tokens: {led['per_million_why']}")
    lines += ["", *notes, *([""] if notes else [])]
    lines += ["Each arm's finished training runs (checkpoint-100 complete), their `ledger.jsonl` rows summed "
              "(docs/training.md, The compute ledger): tokens in millions, summed over the seeds with a ledger "
              "and, for generated tokens, the mean per seed with its sd over seeds. Training hours are the "
              "ledger's step seconds (each optimizer step from its first micro-batch to its end; not start-up, "
              "checkpoint saving or evaluation); GPU-hours are those seconds times the run's GPUs, n/a where "
              "the runs had no GPU. The "
              "gain per million generated tokens is the arm's gain over the base model (the \"vs base\" "
              "comparison: the seed-paired t interval over the seeds both have scored, or with one seed the "
              "paired t interval over problems), its estimate and 95% bounds divided by the arm's mean generated "
              "tokens per seed (in millions) over those seeds: the token count is treated as fixed, so its "
              "spread over seeds (the sd beside it) is not in the interval. Points per million tokens; runs "
              "without a ledger (written before it) give n/a.", ""]  # fmt: skip
    return lines


def _benchmark_lines(result: dict[str, Any]) -> list[str]:
    """report.md's per-benchmark section: each benchmark's arms (mean ± between-seed SE, gain over the base) and
    each arm against the baseline, with the statistics of the macro verdict above."""
    if not result.get("benchmarks"):
        return []
    planned = len(result["seeds_planned"])
    take_offs = {arm: e["take_off"] for arm, e in result["arms"].items()}
    lines = ["## Per benchmark", ""]
    for name, t in result["benchmarks"].items():
        labels = t["labels"] or {"avg": "avg", "pass_at_k": "pass@k", "maj": "maj"}
        heads = [labels.get(k, "format") for k in METRICS]
        lines += [f"### {name}", "", "| arm | seeds | " + " | ".join(heads) + " | accuracy vs base |",
                  "|---" * (len(METRICS) + 3) + "|"]  # fmt: skip
        for arm, e in t["arms"].items():
            vs_base = _ci(e.get("vs_base", {}).get("accuracy", {}).get("interval"))
            means = " | ".join(_pm(e.get("mean", {}).get(k)) for k in METRICS)
            lines.append(f"| {arm} | {len(e['per_seed'])} of {planned} | {means} | {vs_base} |")
        lines.append("")
        for arm, comp in t["comparisons"].items():
            for what, c in comp.items():
                lines += _seeds_first(f"{arm} − {result['baseline']}, {what}", c, take_offs)
                lines.append(
                    f"- {arm} − {result['baseline']}: {c['verdict']}; bootstrap {_ci(c['bootstrap'])}"
                )
        lines.append("")
    return lines


def markdown(result: dict[str, Any]) -> str:
    """report.md: the settings, the arms' table, each arm against the baseline, the benchmarks, the ledger and
    how to read the intervals."""
    names = _metric_names(result)
    planned = result["seeds_planned"]
    lines = [f"# Experiment {_code(result['directory'])}", ""]
    lines += _setting_lines(result, names)
    lines += _arm_lines(result, names)
    lines += _comparison_lines(result)
    lines += _benchmark_lines(result)
    lines += _ledger_lines(result, len(planned))
    lines += _reading_lines()
    return "\n".join(lines)


def _metric_names(result: dict[str, Any]) -> dict[str, str]:
    """Each metric's name in the tables, as the evaluation labels it (avg@n, pass@k, maj@k)."""
    labels = result["labels"] or {"avg": "avg", "pass_at_k": "pass@k", "maj": "maj"}
    return {
        "avg": labels["avg"],
        "pass_at_k": labels["pass_at_k"],
        "maj": labels["maj"],
        "format_rate": "format",
    }


def _setting_lines(result: dict[str, Any], names: dict[str, str]) -> list[str]:
    """What was run: profile, model, data, evaluation flags and seeds; the base model, the benchmarks and the
    reported step where there are."""
    planned = result["seeds_planned"]
    s = result["settings"]
    lines = [f"Profile {_code(s['profile'])}, model {_code(s['model'] or '(embedded SmolLM2-135M)')}, training data "
             f"{_code(s['dataset'])}, evaluation flags {_code(' '.join(s['eval_flags']) or '(eval_aime.py defaults)')}; "
             f"seeds planned: {', '.join(map(str, planned))}. Points are percent; ± is the between-seed SE.", ""]  # fmt: skip
    if result["base"]:
        b = result["base"]
        n_base = len(result["base_per_seed"])
        lines += [f"Base model (mean over its {n_base} evaluation(s), one per seed's sampling seeds): "
                  + ", ".join(f"{names[k]} {b[k]:.2f}" for k in METRICS), ""]  # fmt: skip
    if result.get("benchmarks"):
        lines += [f"Benchmarks: {', '.join(result['benchmarks'])}. The tables and the verdict below are on their macro "
                  "average (each benchmark weighs alike; its SE combines the benchmarks' as independent); each "
                  "benchmark's own follow under Per benchmark.", ""]  # fmt: skip
    if result.get("step", S.STEPS) != S.STEPS:
        lines += [f"Reported step: {result['step']}, declared with --step in the evaluation flags.", ""]
    return lines


def _arm_lines(result: dict[str, Any], names: dict[str, str]) -> list[str]:
    """## Arms: each arm's mean over its seeds; the seeds missing and what the curves and timings leave out."""
    planned = result["seeds_planned"]
    lines = ["## Arms", "", *_bimodal_arm_lines(result, names),
             "| arm | seeds | " + " | ".join(names[k] for k in METRICS) + " | accuracy vs base |",
             "|---" * (len(METRICS) + 3) + "|"]  # fmt: skip
    for arm, e in result["arms"].items():
        got = len(e["per_seed"])
        vs_base = _ci(e.get("vs_base", {}).get("accuracy", {}).get("interval"))
        means = " | ".join(_pm(e.get("mean", {}).get(k)) for k in METRICS)
        lines.append(f"| {arm} | {got} of {len(planned)} | {means} | {vs_base} |")
    lines.append("")
    for arm, e in result["arms"].items():
        if e["missing"]:
            lines.append(f"- **{arm}** is missing seeds: "
                         + "; ".join(f"{seed}: {why}" for seed, why in e["missing"].items()))  # fmt: skip
    if result["curve_points_skipped"]:
        lines += ["", f"The training curves leave out {result['curve_points_skipped']} point(s) of metrics.jsonl that "
                  f"cannot be drawn (not a number, not finite, or beyond ±{PLOT_LIMIT:g}, or at a step that is not a "
                  "whole number)."]  # fmt: skip
    if result["jobs_lines_skipped"]:
        lines += ["", "The job timings leave out the last line of jobs.jsonl, cut short by a stop mid-write."]
    return lines + _take_off_lines(result)


def _bimodal_arm_lines(result: dict[str, Any], names: dict[str, str]) -> list[str]:
    """Before the arms' table, each bimodal arm's seeds one by one (their take-off and final score): its mean and
    its interval against the base model average two different outcomes."""
    lines = []
    for arm, e in result["arms"].items():
        t = e["take_off"]
        if not t["bimodal"]:
            continue
        first = t["first_step"]
        finals = ", ".join(
            f"{s}: {m['avg']:.2f} ({'never took off' if first.get(s) is None else f'took off at step {first[s]}'})"
            for s, m in e["per_seed"].items()
        )
        lines.append(f"- **{arm}** is bimodal, its seeds first: {T.take_off_text(t)}; {names['avg']} per seed: "
                     f"{finals or 'none scored yet'}. Its mean and its interval against the base model in the "
                     "table average two different outcomes; read the seeds.")  # fmt: skip
    return [*lines, ""] if lines else []


def _take_off_lines(result: dict[str, Any]) -> list[str]:
    """### Take-off: each arm's take-off rate and the step at which each seed took off."""
    rule = result["take_off_rule"]
    lines = ["", "### Take-off", "",
             f"A seed takes off when its training rollouts reach {rule['threshold']:.0%} correct "
             f"(`{rule['metric']}` >= {rule['threshold']:g} at a logged step); the step is the first such step.",
             ""]  # fmt: skip
    return lines + [f"- {T.describe_take_off(arm, e['take_off'])}" for arm, e in result["arms"].items()]


def _seeds_first(what: str, c: dict[str, Any], take_offs: dict[str, dict]) -> list[str]:
    """A comparison whose interval spans both outcomes of an arm: its per-seed differences, each with what the
    bimodal arms did in that seed, and the sentence saying so, to come before its interval; [] otherwise."""
    if not c["bimodal"]:
        return []
    seeds = ", ".join(
        f"{k}: {v:+.2f} ({T.outcome(c['bimodal'], take_offs, k)})" for k, v in c["per_seed"].items()
    )
    return [f"- {what}, per seed first (an arm's outcome is bimodal): {seeds}", f"  - {c['bimodal_note']}"]


def _comparison_lines(result: dict[str, Any]) -> list[str]:
    """## Against the baseline: each arm's verdict per comparison, with its seeds, bootstrap and planning."""
    planned = result["seeds_planned"]
    lines = ["", f"## Against the baseline `{result['baseline']}`", ""]
    if not result["comparisons"]:
        lines += ["No comparison yet: the baseline and another arm need at least one common scored seed.", ""]
    take_offs = {arm: e["take_off"] for arm, e in result["arms"].items()}
    for arm, comp in result["comparisons"].items():
        lines += [f"### {arm} − {result['baseline']}", ""]
        for what, c in comp.items():
            seeds = c["seeds"]
            lines += _seeds_first(what, c, take_offs)
            lines.append(f"- {c['verdict']}")
            if len(seeds) < len(planned):
                lines.append(
                    f"  - over {len(seeds)} of the {len(planned)} planned seeds ({', '.join(map(str, seeds))})"
                )
            if not c["bimodal"]:
                lines.append("  - per seed: " + ", ".join(f"{k}: {v:+.2f}" for k, v in c["per_seed"].items()))
            lines.append(f"  - hierarchical bootstrap over seeds then problems: {_ci(c['bootstrap'])}")
            lines.append(f"  - {_split(c['variance'])}")
            lines.append(f"  - {c['planning']}")
        lines.append("")
    return lines


def _reading_lines() -> list[str]:
    """## How to read this: what the intervals hold and leave out."""
    return ["## How to read this", "",
            "The interval reported is the seed-paired t interval: the mean over seeds of (arm − baseline), "
            "each seed's difference paired per (problem, sample), with Student's t over the seeds. Each seed's "
            "difference carries its own evaluation noise and the seed-to-seed spread of training, so the "
            "interval carries both: every training seed draws its own evaluation samples (the same in every "
            "arm and in the base model for that seed), so the evaluation noise averages out over seeds too. It "
            "holds the problem set fixed. The bootstrap beside it also resamples problems; with few seeds it is "
            "too narrow. With one seed the interval is over problems only and ignores the seed-to-seed spread. "
            "The detectable difference and the seeds needed are estimates from the seeds run: their 95% range "
            "says how far they can be off.", "",
            "An arm is bimodal when some of its seeds took off (their training rollouts reached "
            f"{T.TAKE_OFF_CORRECT:.0%} correct) and some never did: its mean, and any interval over seeds of both "
            "kinds, averages two different outcomes and describes neither, however wide it is. Its seeds are then "
            "shown first and the interval says so: read the seeds (how many took off, and what each scored).",
            ""]  # fmt: skip


def console_lines(result: dict[str, Any]) -> list[str]:
    """What the command prints of the verdict: each arm's take-off, then each arm against the baseline, its
    seeds first (with the sentence saying so) where an arm of the comparison is bimodal."""
    take_offs = {arm: e["take_off"] for arm, e in result["arms"].items()}
    lines = [T.describe_take_off(arm, t) for arm, t in take_offs.items()]
    for arm, comp in result["comparisons"].items():
        for what, c in comp.items():
            head = f"{arm} − {result['baseline']}"
            lines += [f"{head}: {line.removeprefix('- ')}" for line in _seeds_first(what, c, take_offs)[:1]]
            if c["bimodal_note"]:
                lines.append(f"{head}: {c['bimodal_note']}")
            lines.append(f"{head}: {c['verdict']}")
    return lines


def figures(result: dict[str, Any]) -> dict[str, bytes]:
    """{file name: PNG bytes} of verdict.png and (when a run has logged a step) curves.png, drawn in memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(result["arms"])
    colors = _colors(arms)
    drawn: dict[str, bytes] = {}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    for i, arm in enumerate(arms):
        e = result["arms"][arm]
        ys = [v["avg"] for v in e["per_seed"].values()]
        ax.scatter([i] * len(ys), ys, color=colors[arm], alpha=0.7)
        if e.get("mean"):
            m = e["mean"]["avg"]
            ax.errorbar(i + 0.15, m["mean"], yerr=0 if m["se"] is None else 1.96 * m["se"], fmt="s",
                        color=colors[arm], capsize=4)  # fmt: skip
    if result["base"]:
        ax.axhline(result["base"]["avg"], color="grey", ls="--", lw=1, label="base model")
        ax.legend(fontsize=8)
    ax.set_xticks(range(len(arms)), arms, rotation=20, fontsize=8)
    ax.set_ylabel(f"{(result['labels'] or {}).get('avg', 'avg')} (points; seeds, mean ± 1.96 SE)")
    ax = axes[1]
    ys = []
    for j, (arm, comp) in enumerate(result["comparisons"].items()):
        for k, (what, c) in enumerate(comp.items()):
            y = j * 3 + k
            for iv, off, marker in ((c["interval"], 0.0, "o"), (c["bootstrap"], 0.3, "^")):
                if iv and iv["low"] is not None:
                    ax.errorbar(iv["estimate"], y + off, xerr=[[iv["estimate"] - iv["low"]], [iv["high"] - iv["estimate"]]],
                                fmt=marker, color=colors[arm], capsize=3, mfc="white" if off else colors[arm])  # fmt: skip
            method = (c["interval"] or {}).get("method", "")
            ys.append((y, f"{arm}: {what} ({method}, {len(c['seeds'])} seed{'s' * (len(c['seeds']) > 1)})"))
    ax.axvline(0, color="grey", lw=1)
    if ys:
        ax.set_yticks([y for y, _ in ys], [t for _, t in ys], fontsize=8)
    ax.set_xlabel(f"arm − {result['baseline']}, points (95% CI: ● the reported interval, △ bootstrap)")
    fig.tight_layout()
    drawn[VERDICT_PNG] = _png(fig)

    fig = draw_curves(result)
    if fig is not None:
        drawn[CURVES_PNG] = _png(fig)
    return drawn


def _colors(arms: list[str]) -> dict[str, Any]:
    import matplotlib.pyplot as plt

    return {a: plt.cm.tab10(i % 10) for i, a in enumerate(arms)}


def draw_curves(result: dict[str, Any]):
    """curves.png's figure (None before any run has logged a step): one panel per `CURVE_KEYS`, one line per
    seed, and on each seed's line its take-off marked (a black-edged triangle at the line's first point at or
    after the seed's take-off step, its `gid` `take-off ARM SEED`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = result["curves"]
    if not curves:
        return None
    colors = _colors(list(result["arms"]))
    fig, axes = plt.subplots(1, len(CURVE_KEYS), figsize=(5 * len(CURVE_KEYS), 3.8))
    for ax, (key, title) in zip(axes, CURVE_KEYS, strict=True):
        for arm, by_seed in curves.items():
            first = result["arms"][arm]["take_off"]["first_step"]
            for i, (seed, points) in enumerate(by_seed.items()):
                if not points.get(key):
                    continue
                steps, values = zip(*points[key], strict=True)
                ax.plot(steps, values, color=colors.get(arm), alpha=0.75, lw=1.2, marker="." if len(steps) < 15 else None,
                        label=arm if i == 0 else None)  # fmt: skip
                mark = T.mark_point(points[key], first[seed]) if first.get(seed) is not None else None
                if mark:
                    ax.plot([mark[0]], [mark[1]], ls="none", marker="^", ms=8, mec="black", color=colors.get(arm),
                            gid=f"take-off {arm} {seed}")  # fmt: skip
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("optimizer step")
    axes[0].legend(fontsize=8)
    rule = result["take_off_rule"]
    fig.suptitle(f"Training curves, one line per seed; ▲ a seed's take-off ({rule['metric']} first >= "
                 f"{rule['threshold']:g})", fontsize=10)  # fmt: skip
    fig.tight_layout()
    return fig


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format="png", dpi=110)
    finally:
        plt.close(fig)
    return buffer.getvalue()


def check_outputs(directory: Path) -> None:
    """The report can replace its files: the directory takes a new entry, and no output's name is taken by a
    directory (a rename cannot replace one). UserError naming the path otherwise, before anything is read."""
    for name in OUTPUTS:
        path = directory / name
        if path.is_dir() and not path.is_symlink():
            raise UserError(
                f"{shown(path)} is a directory; the report writes its {name} there: move the directory away"
            )
    why = cannot_create_in(directory)
    if why:
        raise UserError(
            f"{shown(directory)} is not writable ({why}); the report writes {', '.join(OUTPUTS)} there: make it "
            "writable, or copy the experiment somewhere writable and report there"
        )


def write(directory: Path, **kwargs) -> tuple[dict[str, Any], list[Path]]:
    """Build the report, render every output, then replace each file whole (the module docstring says why);
    (summary.json's content, the paths written)."""
    check_outputs(directory)
    result = build(directory, **kwargs)
    rendered = {
        REPORT_FILE: markdown(result).encode(),
        SUMMARY_JSON: (json.dumps(result, indent=1, allow_nan=False) + "\n").encode(),
        **figures(result),
    }
    staged: dict[Path, Path] = {}
    replaced = 0
    try:
        for name, data in rendered.items():
            path = directory / name
            staged[path] = staged_write(path, data)
        for path, tmp in staged.items():
            os.replace(tmp, path)
            replaced += 1
    except OSError as err:
        left = (
            "the previous report is left as it was" if not replaced else f"{replaced} file(s) were replaced"
        )
        raise UserError(
            f"cannot write {shown(path)} ({err.strerror or type(err).__name__}); {left}: free space or make the "
            "directory writable, then report again"
        ) from None
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)
    return result, [directory / name for name in rendered]
