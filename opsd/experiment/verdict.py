"""The verdict of an experiment, from whatever has finished: `report.md`, `summary.json`, `verdict.png`, `curves.png`.

Per arm: avg@n, pass@k, maj@n and format rate of each seed's final checkpoint, their mean over seeds with the
between-seed SE, and the gain over the base model. Each arm against the baseline arm (`--baseline`, the first arm
by default): the difference in accuracy and in format rate with the seed-paired t interval (the reported one;
`opsd.experiment.stats` says why) and, beside it, the hierarchical bootstrap over seeds then problems; the variance
components of the per-seed difference; the minimum detectable difference at 80% power for the seeds run and the
seeds needed to detect `--target-diff` points (`opsd.experiment.power`). Seeds are paired by value (the same seed in both arms) and samples
by (problem, sample index): every evaluation of training seed s, the base model's included, uses s's sampling
seeds. A comparison uses the seeds both arms
have scored and says so whenever that is fewer than were planned.

The compute ledger, per arm (`ledger`): each finished training run's ledger.jsonl summed
(`opsd.run.ledger.ledger_totals`), the sums and means over seeds of generated, teacher and trained tokens, of
step seconds and (on a GPU) GPU-seconds, and the gain over the base model in accuracy and format rate per
million generated tokens with its interval; a run without a ledger (older) gives n/a. The verdict does not use it.

Take-off, per arm (`take_off`, `opsd.experiment.take_off`): the seeds whose training rollouts reached 50% correct
and the first step at which each did. An arm with seeds of both outcomes is bimodal: report.md shows its seeds
before its mean and before every interval over seeds of both kinds (`bimodal`, `bimodal_note` of a comparison),
and curves.png marks each seed's take-off on its lines.

Writing (`write`). Every file a report reads is checked, every figure drawn and every output rendered before the
first is written; then each is written to a temporary file beside it and renamed over it, so a report that
fails (a damaged file, an output path that is a directory, a full disk) leaves the previous report as it was.
A curve point that cannot be drawn (not finite, or beyond `PLOT_LIMIT`, which matplotlib's axes overflow on) is
left out of the figure and of summary.json, and report.md says how many were.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from opsd.errors import UserError
from opsd.experiment import cells as C
from opsd.experiment import power, stats
from opsd.experiment import spec as S
from opsd.experiment import take_off as T
from opsd.paths import MIB, FileKind, cannot_create_in, check_file, shown, staged_write

logger = logging.getLogger(__name__)

REPORT_FILE, SUMMARY_JSON, VERDICT_PNG, CURVES_PNG = "report.md", "summary.json", "verdict.png", "curves.png"
METRICS = C.METRICS
# (per-sample field, name in the report)
COMPARED = (("correct", "accuracy"), ("has_box", "format rate"))
CURVE_KEYS = (("loss", "loss"), ("probe/divergence", "probe divergence (held out)"),
              ("rollout/correct", "training rollouts correct"),
              ("completions/mean_length", "completion length (tokens)"))  # fmt: skip
OUTPUTS = (REPORT_FILE, SUMMARY_JSON, VERDICT_PNG, CURVES_PNG)
# What the compute ledger sums per arm (opsd.run.ledger.ledger_totals' keys but steps; gpu_s only on a GPU).
LEDGER_KEYS = ("generated_tokens", "teacher_tokens", "trained_tokens", "step_s", "gpu_s")
# A curve value beyond this is drawn by nothing: matplotlib's tick arithmetic overflows on values near 1e308,
# and no loss, divergence or length comes near it.
PLOT_LIMIT = 1e15
# A capped run's metrics.jsonl is ~100 lines of a few hundred bytes; one far bigger is not a run's log.
METRICS_KIND = FileKind(
    "training log", "training logs", 256 * MIB, "rerun the experiment", "it was not written by a run"
)


def read_scores(eval_dir: Path) -> dict[str, dict[str, list[float]]]:
    """{per-sample field: {problem id: values by sample index}} of one evaluation directory (checked)."""
    return C.read_eval(eval_dir)[1]


def _interval(iv: stats.Interval | None) -> dict | None:
    if iv is None:
        return None
    return {"estimate": iv.estimate, "low": iv.low, "high": iv.high, "se": iv.se, "df": iv.df,
            "method": iv.method, "n_seeds": iv.n_seeds}  # fmt: skip


def compare(a: stats.CellScores, b: stats.CellScores, target: float, reps: int, what: str) -> dict[str, Any]:
    """b - a over the seeds both hold: the reported interval, the bootstrap, the variance and the power."""
    seeds = sorted(set(a) & set(b))
    a, b = {s: a[s] for s in seeds}, {s: b[s] for s in seeds}
    diffs = stats.paired_seed_diffs(a, b)
    if len(seeds) >= 2:
        reported = stats.seed_paired_t(list(diffs.values()))
    else:
        reported = stats.paired_over_problems(a[seeds[0]], b[seeds[0]])
    bootstrap = stats.hierarchical_bootstrap(a, b, reps=reps)
    return _comparison(seeds, diffs, {}, reported, bootstrap, stats.variance_components(a, b), target, what)


def _comparison(seeds, diffs, extra: dict, reported, bootstrap, var: dict, target: float, what: str) -> dict:
    """`compare`'s and `compare_macro`'s record: the seeds and their differences (then `extra`), the reported
    interval, the bootstrap, the variance and the power plan for `target`, and the verdict's sentence."""
    plan = power.plan(var["total_sd"], var["within_sd"], len(seeds), target)
    return {
        "seeds": seeds,
        "per_seed": {str(s): d for s, d in diffs.items()},
        **extra,
        "interval": _interval(reported),
        "bootstrap": _interval(bootstrap),
        "variance": var,
        "mde_80": plan["mde"],
        "target_diff": target,
        "seeds_needed": plan["seeds_needed"],
        "plan": plan,
        "planning": power.describe_plan(plan, len(seeds), target),
        "verdict": stats.describe(reported, what=what),
    }


def _at(where: Path, benchmark: str | None) -> Path:
    return where if benchmark is None else where / benchmark


def _read_table(
    directory: Path, spec: S.Spec, failed: dict, step: int, benchmark: str | None
) -> dict[str, Any]:
    """Every finished evaluation of one table (the experiment's single one, or one benchmark's): the base model's
    metrics and per-sample scores per seed, each arm's at the reported `step` per seed, and why a seed is missing."""
    base_metrics: dict[int, dict] = {}
    base_scores: dict[str, dict] = {key: {} for key, _ in COMPARED}
    for seed in spec.seeds:  # the base model, once per training seed with that seed's sampling seeds
        if C.base_scored(directory, seed):
            base_metrics[seed], values = C.read_eval(_at(S.base_eval_dir(directory, seed), benchmark))
            for key, by_problem in values.items():
                base_scores[key][seed] = by_problem
    table: dict[str, Any] = {"base_metrics": base_metrics, "base_scores": base_scores, "arm_metrics": {},
                             "arm_scores": {key: {} for key, _ in COMPARED}, "missing": {}, "trained": {},
                             "labels": None}  # fmt: skip
    for arm in spec.arm_names:
        per_seed, missing, trained = {}, {}, []
        for seed in spec.seeds:
            state = C.cell_state(directory, arm, seed)
            if state.trained:
                trained.append(seed)
            if step in state.scored:
                summary, values = C.read_eval(_at(state.scored[step], benchmark))
                table["labels"] = table["labels"] or summary["labels"]
                per_seed[seed] = summary
                for key, by_problem in values.items():
                    table["arm_scores"][key].setdefault(arm, {})[seed] = by_problem
            else:
                missing[seed] = _why_missing(failed, arm, seed, state)
                if state.final_scored and step != S.STEPS:
                    missing[seed] = f"step {step} not scored (its sweep needs --every-checkpoint)"
        table["arm_metrics"][arm], table["missing"][arm], table["trained"][arm] = per_seed, missing, trained
    return table


def _assemble(table: dict[str, Any], spec: S.Spec, baseline: str, target_diff: float, reps: int,
              cmp=None, var=None) -> dict[str, Any]:  # fmt: skip
    """A table's part of summary.json: the base model, each arm's seeds, mean and gain over the base, and each arm
    against the baseline (`cmp`: `compare`, or `compare_macro`; `var`: the matching variance split)."""
    cmp = cmp or compare
    var = var or stats.variance_components
    base = table["base_metrics"]
    out: dict[str, Any] = {
        "base": {k: _mean_se([m[k] for m in base.values()])["mean"] for k in METRICS} if base else None,
        "base_per_seed": {str(s): {k: m[k] for k in METRICS} for s, m in base.items()},
        "arms": {}, "comparisons": {},
    }  # fmt: skip
    scores = table["arm_scores"]
    for arm in spec.arm_names:
        per_seed = table["arm_metrics"][arm]
        entry: dict[str, Any] = {"per_seed": {str(s): {k: m[k] for k in METRICS} for s, m in per_seed.items()},
                                 "missing": {str(s): v for s, v in table["missing"][arm].items()}}  # fmt: skip
        if per_seed:
            entry["mean"] = {k: _mean_se([m[k] for m in per_seed.values()]) for k in METRICS}
            if set(per_seed) & set(base):  # each seed against the base scored with that seed's sampling seeds
                entry["vs_base"] = {
                    name: cmp(table["base_scores"][key], scores[key][arm], target_diff, reps, name)
                    for key, name in COMPARED
                }
            entry["variance"] = var(scores["correct"][arm])
        out["arms"][arm] = entry
    out["labels"] = table["labels"]
    for arm in spec.arm_names:
        if arm == baseline or not (scores["correct"].get(arm) and scores["correct"].get(baseline)):
            continue
        if not _common_seeds(scores["correct"][baseline], scores["correct"][arm]):
            continue
        out["comparisons"][arm] = {
            name: cmp(scores[key][baseline], scores[key][arm], target_diff, reps, name)
            for key, name in COMPARED
        }
    return out


def build(directory: Path, *, baseline: str | None = None, target_diff: float = 1.0,
          reps: int = 10000) -> dict[str, Any]:  # fmt: skip
    """summary.json's content: every finished evaluation of the experiment, compared. With `--benchmarks` in the
    evaluation flags, the top-level table is the macro average over the benchmarks (`macro_table`) and
    ``benchmarks`` holds each benchmark's own table, with the same statistics."""
    spec = S.load(directory)
    if spec is None:
        raise UserError(f"{directory} holds no {S.EXPERIMENT_FILE}: pass an experiment directory")
    arms = spec.arm_names
    baseline = baseline or arms[0]
    if baseline not in arms:
        raise UserError(f"--baseline {baseline!r} is not an arm of {directory}; its arms: {', '.join(arms)}")
    C.check_links(directory, spec)
    failed = C.read_failed(directory)
    step, benchmarks = C.declared_step(spec), C.spec_benchmarks(spec)
    result: dict[str, Any] = {
        "directory": str(directory), "baseline": baseline, "target_diff": target_diff,
        "settings": {k: getattr(spec, k) for k in S.Spec.SHARED}, "seeds_planned": spec.seeds,
    }  # fmt: skip
    if not benchmarks:
        table = _read_table(directory, spec, failed, step, None)
        result.update(_assemble(table, spec, baseline, target_diff, reps))
    else:
        tables = {name: _read_table(directory, spec, failed, step, name) for name in benchmarks}
        per_benchmark = {name: _assemble(t, spec, baseline, target_diff, reps) for name, t in tables.items()}
        table = macro_table(tables)
        result.update(_assemble(table, spec, baseline, target_diff, reps, compare_macro, macro_variance))
    for arm in arms:
        entry = result["arms"][arm]
        entry = {"recipe": spec.arms[arm]["recipe"], "source": spec.arms[arm]["source"], **entry}
        entry["ledger"] = ledger(
            directory, spec.arms[arm]["recipe"], arm, table["trained"][arm], entry.get("vs_base")
        )
        result["arms"][arm] = entry
    result["curves"], result["curve_points_skipped"] = _curves(directory, spec)
    records, result["jobs_lines_skipped"] = C.read_jobs(directory)
    result["timing"] = timing(records)
    result["step"] = step
    result["benchmarks"] = per_benchmark if benchmarks else None
    _add_take_off(result, spec, table["trained"])
    return result


def _add_take_off(result: dict[str, Any], spec: S.Spec, trained: dict[str, list[int]]) -> None:
    """Each arm's take-off (`take_off.arm_take_off`, from the curves) as `take_off`, and on every comparison
    (each arm against the baseline and against the base model, per benchmark too) `bimodal`, the arms bimodal
    over its seeds with their seeds of each outcome, and `bimodal_note`, the sentence saying so (None if none)."""
    result["take_off_rule"] = {"metric": T.TAKE_OFF_KEY, "threshold": T.TAKE_OFF_CORRECT}
    take_offs = {}
    for arm in spec.arm_names:
        by_seed = result["curves"].get(arm, {})
        take_offs[arm] = result["arms"][arm]["take_off"] = T.arm_take_off(by_seed, spec.seeds, trained[arm])
    for t in (result, *(result["benchmarks"] or {}).values()):
        for arm, comp in t["comparisons"].items():
            for c in comp.values():
                c["bimodal"] = T.spans_modes(take_offs, [result["baseline"], arm], c["seeds"])
                c["bimodal_note"] = T.bimodal_note(c["bimodal"])
        for arm, e in t["arms"].items():
            for c in e.get("vs_base", {}).values():
                c["bimodal"] = T.spans_modes(take_offs, [arm], c["seeds"])
                c["bimodal_note"] = T.bimodal_note(c["bimodal"])


def _common_seeds(a: Any, b: Any) -> list[int]:
    """The seeds both hold: of two `CellScores`, or of two {benchmark: CellScores} (seeds every benchmark holds)."""
    if a and isinstance(next(iter(a)), str):
        return sorted(set.intersection(*(set(a[n]) & set(b.get(n, {})) for n in a)))
    return sorted(set(a) & set(b))


# -- the macro average over benchmarks ---------------------------------------------------------------------------


def macro_table(tables: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The macro average of per-benchmark tables (`_read_table`), as a table of the same form: each seed's metrics
    are the mean over the benchmarks (each weighs alike; a seed counts where every benchmark has it), and the
    per-sample scores stay per benchmark ({benchmark: CellScores}) for `compare_macro`."""
    names = list(tables)
    first = tables[names[0]]

    def mean_of(per_benchmark: list[dict]) -> dict:
        return {k: math.fsum(m[k] for m in per_benchmark) / len(per_benchmark) for k in METRICS}

    base_seeds = set.intersection(*(set(t["base_metrics"]) for t in tables.values()))
    out: dict[str, Any] = {
        "base_metrics": {s: mean_of([t["base_metrics"][s] for t in tables.values()]) for s in sorted(base_seeds)},
        "base_scores": {key: {n: t["base_scores"][key] for n, t in tables.items()} for key, _ in COMPARED},
        "arm_metrics": {}, "arm_scores": {key: {} for key, _ in COMPARED},
        "missing": first["missing"], "trained": first["trained"],
        "labels": {"avg": "macro avg@n", "pass_at_k": "macro pass@k", "maj": "macro maj@n"},
    }  # fmt: skip
    for arm in first["arm_metrics"]:
        seeds = set.intersection(*(set(t["arm_metrics"][arm]) for t in tables.values()))
        out["arm_metrics"][arm] = {
            s: mean_of([t["arm_metrics"][arm][s] for t in tables.values()]) for s in sorted(seeds)
        }
        if seeds:
            for key, _ in COMPARED:
                out["arm_scores"][key][arm] = {n: t["arm_scores"][key][arm] for n, t in tables.items()}
    return out


def compare_macro(a: dict[str, stats.CellScores], b: dict[str, stats.CellScores], target: float, reps: int,
                  what: str) -> dict[str, Any]:  # fmt: skip
    """b - a of the macro average over benchmarks ({benchmark: CellScores} each), over the seeds every benchmark of
    both holds, with `compare`'s statistics: each seed's difference is the mean over benchmarks of its paired
    difference (`stats.paired_seed_diffs`), and the reported interval the seed-paired t over those; with one seed,
    the macro of the per-benchmark paired t intervals over problems (SE = sqrt(sum SE_b^2) / B, Welch-Satterthwaite
    df). The hierarchical bootstrap is per benchmark only (``bootstrap`` None here)."""
    names = list(a)
    seeds = _common_seeds(a, b)
    per_benchmark = {
        n: stats.paired_seed_diffs({s: a[n][s] for s in seeds}, {s: b[n][s] for s in seeds}) for n in names
    }
    diffs = {s: math.fsum(per_benchmark[n][s] for n in names) / len(names) for s in seeds}
    if len(seeds) >= 2:
        reported = stats.seed_paired_t(list(diffs.values()))
    else:
        reported = _macro_over_problems(
            [stats.paired_over_problems(a[n][seeds[0]], b[n][seeds[0]]) for n in names]
        )
    var = macro_variance(
        {n: {s: a[n][s] for s in seeds} for n in names}, {n: {s: b[n][s] for s in seeds} for n in names}
    )
    extra = {"per_benchmark": {n: {str(s): d for s, d in v.items()} for n, v in per_benchmark.items()}}
    return _comparison(seeds, diffs, extra, reported, None, var, target, f"macro {what}")


def _macro_over_problems(intervals: list[stats.Interval], level: float = 0.95) -> stats.Interval:
    """One seed: the macro average of B per-benchmark paired t intervals over problems. estimate = mean of the
    estimates, SE = sqrt(sum SE_b^2) / B, df = (sum SE_b^2)^2 / sum(SE_b^4 / df_b) (Welch-Satterthwaite); no
    bounds where a benchmark has none, or where every SE is 0 (identical differences: their spread is unknown)."""
    b = len(intervals)
    estimate = math.fsum(iv.estimate for iv in intervals) / b
    method = "macro of paired t over problems"
    if any(iv.se is None for iv in intervals):
        return stats.Interval(estimate, None, None, None, None, method, 1)
    variance = math.fsum(iv.se**2 for iv in intervals)
    if variance == 0:
        return stats.Interval(estimate, None, None, 0.0, None, method, 1)
    df = variance**2 / math.fsum(iv.se**4 / iv.df for iv in intervals if iv.se > 0)
    se = math.sqrt(variance) / b
    half = stats.t_critical(df, level) * se
    return stats.Interval(estimate, estimate - half, estimate + half, se, round(df), method, 1)


def macro_variance(a: dict[str, stats.CellScores], b: dict[str, stats.CellScores] | None = None) -> dict:
    """`stats.variance_components` of the macro average: the per-seed values are the mean over benchmarks of one
    arm's seed means (b None) or of the paired differences; the within-seed part is the mean over seeds of
    (1/B^2) * sum_b W_{b,s} (`stats.within_seed_variance`; the benchmarks' samples are independent)."""
    names = list(a)
    seeds = _common_seeds(a, a if b is None else b)
    if not seeds:
        raise ValueError("macro_variance: no seed common to every benchmark")
    if b is None:
        means = {n: stats.seed_means({s: a[n][s] for s in seeds}) for n in names}
    else:
        means = {
            n: stats.paired_seed_diffs({s: a[n][s] for s in seeds}, {s: b[n][s] for s in seeds})
            for n in names
        }
    values = np.array([math.fsum(means[n][s] for n in names) / len(names) for s in seeds])  # (S,)
    sides = [a] if b is None else [a, b]
    n_min = min(stats.min_samples({s: side[n][s] for s in seeds}) for side in sides for n in names)
    within = None
    if n_min >= 2:
        per_seed = [
            math.fsum(stats.within_seed_variance(a[n][s], None if b is None else b[n][s]) for n in names)
            / len(names) ** 2
            for s in seeds
        ]
        within = float(np.mean(per_seed))
    total = float(values.var(ddof=1)) if values.size >= 2 else None
    between = None if total is None or within is None else max(0.0, total - within)

    def sd(v: float | None) -> float | None:
        return None if v is None else math.sqrt(v)

    return {
        "n_seeds": int(values.size), "total_var": total, "within_var": within, "between_var": between,
        "between_floored": between is not None and total < within, "total_sd": sd(total), "within_sd": sd(within),
        "between_sd": sd(between), "min_samples": n_min,
    }  # fmt: skip


def ledger(directory: Path, recipe: dict[str, str], arm: str, trained: list[int],
           vs_base: dict[str, dict] | None) -> dict[str, Any]:  # fmt: skip
    """The arm's compute ledger: each finished training run's totals (`cells.cell_ledger`), their sum and mean
    over the seeds that have one, and the gain over the base model per million generated tokens.

    The gain per million is the arm-vs-base comparison's reported interval (`compare`: the seed-paired t interval,
    or with one seed the paired t over problems), its estimate and bounds divided by the arm's mean generated
    tokens per seed in millions over the seeds of that comparison: the token count is taken as fixed (its sd
    over those seeds is kept beside it, not carried into the interval). None, with why, where a seed of the
    comparison has no ledger, there is no comparison with the base, or no token was generated."""
    per_seed, unavailable = {}, {}
    for seed in trained:
        totals, why = C.cell_ledger(directory, arm, seed)
        if totals is None:
            unavailable[str(seed)] = why
        else:
            per_seed[seed] = totals
    out: dict[str, Any] = {
        "method": recipe.get("method", "opsd"), "seeds": sorted(per_seed),
        "per_seed": {str(s): t for s, t in per_seed.items()}, "unavailable": unavailable,
        "total": None, "mean": None, "sd": None, "per_million_generated": None, "per_million_why": None,
    }  # fmt: skip
    if per_seed:
        keys = [k for k in LEDGER_KEYS if all(k in t for t in per_seed.values())]
        out["total"] = {k: math.fsum(t[k] for t in per_seed.values()) for k in keys}
        out["mean"] = {k: out["total"][k] / len(per_seed) for k in keys}
        out["sd"] = {k: _sd([t[k] for t in per_seed.values()]) for k in keys}
    if not vs_base:
        out["per_million_why"] = "no evaluation against the base model yet"
        return out
    seeds = vs_base["accuracy"]["seeds"]  # every comparison with the base pairs the same seeds
    lacking = [s for s in seeds if s not in per_seed]
    if lacking:
        out["per_million_why"] = f"no ledger for seed(s) {', '.join(map(str, lacking))} of the comparison"
        return out
    tokens_m = [per_seed[s]["generated_tokens"] / 1e6 for s in seeds]
    divisor = math.fsum(tokens_m) / len(tokens_m)
    if divisor <= 0:
        out["per_million_why"] = "the ledger counts no generated token"
        return out
    out["per_million_generated"] = {}
    for name, c in vs_base.items():
        iv = c["interval"]
        scaled = {k: None if iv[k] is None else iv[k] / divisor for k in ("estimate", "low", "high")}
        out["per_million_generated"][name] = {**scaled, "method": iv["method"], "n_seeds": iv["n_seeds"],
                                              "seeds": seeds, "generated_m": divisor,
                                              "generated_m_sd": _sd(tokens_m)}  # fmt: skip
    return out


def _sd(values: list[float]) -> float | None:
    """The sample sd (ddof 1); None for fewer than 2 values."""
    if len(values) < 2:
        return None
    m = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - m) ** 2 for v in values) / (len(values) - 1))


def timing(records: list[dict]) -> dict[str, dict[str, float]]:
    """Per kind of job (base, train, eval): attempts, summed seconds and the wall-clock span from the first start
    to the last end, from DIR/jobs.jsonl's records (`cells.read_jobs`; jobs that ran side by side overlap, so the
    span is what you waited)."""
    out: dict[str, dict[str, float]] = {}
    for r in records:
        t = out.setdefault(
            r["kind"], {"attempts": 0, "job_s": 0.0, "first_start": r["start"], "last_end": 0.0}
        )
        t["attempts"] += 1
        t["job_s"] += r["seconds"]
        t["first_start"] = min(t["first_start"], r["start"])
        t["last_end"] = max(t["last_end"], r["start"] + r["seconds"])
    for t in out.values():
        t["span_s"] = t["last_end"] - t["first_start"]
    return out


def _why_missing(failed: dict, arm: str, seed: int, state: C.CellState) -> str:
    failure = C.cell_failure(failed, arm, seed)
    if failure:
        key, f = failure
        return f"{key.kind} failed ({f['attempts']} attempts, exit {f['exit']}; {f['log']})"
    if state.trained:
        return "trained, not scored yet"
    return f"training at step {state.step}/{S.STEPS}" if state.step else "not started"


def _mean_se(values: list[float]) -> dict[str, Any]:
    from opsd.evaluation.metrics import aggregate_runs

    agg = aggregate_runs(values)
    return {"mean": agg["mean"], "se": agg["se"], "n": agg["n"]}


def _curves(directory: Path, spec: S.Spec) -> tuple[dict[str, dict[str, dict[str, list]]], int]:
    """({arm: {seed: {metric: [[step, value], ...]}}} of the curves drawn in curves.png, the points left out).

    Each run's metrics.jsonl as `opsd.rundir.read_step_log` reads it (a line that is not a record is passed
    over with a warning), records without a step left aside as `opsd.run.curves.read_metrics` leaves them and
    the last record of a step winning, keeping only the points a figure can draw: a step that is a whole number
    from 0 to `cells.MAX_STEP` and a finite value within `PLOT_LIMIT`."""
    from opsd.rundir import METRICS_FILE, read_step_log

    out: dict[str, dict[str, dict[str, list]]] = {}
    skipped = 0
    for arm in spec.arm_names:
        for seed in spec.seeds:
            path = S.run_dir(directory, arm, seed) / METRICS_FILE
            if not path.is_file():
                continue
            check_file(path, METRICS_KIND)
            points: dict[str, dict[int, float]] = {k: {} for k, _ in CURVE_KEYS}
            for record in read_step_log(path):
                if "step" not in record:
                    continue
                step = record["step"]
                for key, _ in CURVE_KEYS:
                    if key not in record:
                        continue
                    value = record[key]
                    if _drawable(step, value):
                        points[key][step] = float(value)
                    else:
                        skipped += 1
            out.setdefault(arm, {})[str(seed)] = {
                k: [[s, v] for s, v in sorted(p.items())] for k, p in points.items()
            }
    return out, skipped


def _drawable(step: object, value: object) -> bool:
    number = type(value) in (int, float) and math.isfinite(value) and abs(value) <= PLOT_LIMIT
    return type(step) is int and 0 <= step <= C.MAX_STEP and number


# -- writing ----------------------------------------------------------------------------------------------------


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
    """verdict.md: the settings, the arms' table, each arm against the baseline, the benchmarks, the ledger and
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
