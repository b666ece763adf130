"""The verdict of an experiment, from whatever has finished: the content of `summary.json` (`build`), which
`opsd.experiment.rendering` writes with `report.md` and the figures.

Per arm: avg@n, pass@k, maj@n and format rate of each seed's final checkpoint, their mean over seeds with the
between-seed SE, and the gain over the base model. Each arm against the baseline arm (`--baseline`, the first arm
by default): the difference in accuracy and in format rate with the seed-paired t interval (the reported one;
`opsd.experiment.stats` says why) and, beside it, the hierarchical bootstrap over seeds then problems; the variance
components of the per-seed difference; the minimum detectable difference at 80% power for the seeds run and the
seeds needed to detect `--target-diff` points (`opsd.experiment.power`). Seeds are paired by value (the same seed
in both arms) and samples by (problem, sample index): every evaluation of training seed s, the base model's
included, uses s's sampling seeds. A comparison uses the seeds both arms have scored and says so whenever that is
fewer than were planned. With `--benchmarks` in the evaluation flags, the same statistics on the macro average
over the benchmarks (`macro_table`, `compare_macro`, `macro_variance`), and each benchmark's own table.

The compute ledger, per arm (`ledger`): each finished training run's ledger.jsonl summed
(`opsd.run.ledger.ledger_totals`), the sums and means over seeds of generated, teacher and trained tokens, of
step seconds and (on a GPU) GPU-seconds, and the gain over the base model in accuracy and format rate per
million generated tokens with its interval; a run without a ledger (older) gives n/a. The verdict does not use it.

Take-off, per arm (`take_off`, `opsd.experiment.take_off`): the seeds whose training rollouts reached 50% correct
and the first step at which each did. An arm with seeds of both outcomes is bimodal: report.md shows its seeds
before its mean and before every interval over seeds of both kinds (`bimodal`, `bimodal_note` of a comparison),
and curves.png marks each seed's take-off on its lines.

The training curves (summary.json's `curves`): a point that cannot be drawn (not finite, or beyond `PLOT_LIMIT`,
which matplotlib's axes overflow on) is left out of the figure and of summary.json, and report.md says how many
were.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import numpy as np

from opsd.errors import UserError
from opsd.experiment import cells as C
from opsd.experiment import power, stats
from opsd.experiment import spec as S
from opsd.experiment import take_off as T
from opsd.paths import MIB, FileKind, check_file

logger = logging.getLogger(__name__)

METRICS = C.METRICS
# (per-sample field, name in the report)
COMPARED = (("correct", "accuracy"), ("has_box", "format rate"))
CURVE_KEYS = (("loss", "loss"), ("probe/divergence", "probe divergence (held out)"),
              ("rollout/correct", "training rollouts correct"),
              ("completions/mean_length", "completion length (tokens)"))  # fmt: skip
# What the compute ledger sums per arm (opsd.run.ledger.ledger_totals' keys but steps; gpu_s only on a GPU).
LEDGER_KEYS = ("generated_tokens", "teacher_tokens", "trained_tokens", "step_s", "gpu_s")
# A curve value beyond this is drawn by nothing: matplotlib's tick arithmetic overflows on values near 1e308,
# and no loss, divergence or length comes near it.
PLOT_LIMIT = 1e15
# A capped run's metrics.jsonl is ~100 lines of a few hundred bytes; one far bigger is not a run's log.
METRICS_KIND = FileKind(
    "training log", "training logs", 256 * MIB, "rerun the experiment", "it was not written by a run"
)


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
