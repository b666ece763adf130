r"""Paired verdicts between training recipes ("arms") that carry both noise sources: seeds and sampling.

Data. A cell (arm, training seed) trains a model whose final checkpoint is scored on P problems x n samples.
`Scores` maps problem id -> the per-sample values of one cell, index = sample index; a value is a FRACTION
in [0, 1] (1/0 for correct, or for "has a boxed answer" when the format rate is compared). Sample i of
problem p is drawn with the same sampling seed in every arm of a training seed, so it is paired across arms;
each training seed has its own sampling seeds. `CellScores` maps training seed -> the `Scores` of that seed's
cell. Every estimate, bound and SE returned is in PERCENTAGE
POINTS (fraction x 100) and every variance in points^2, as in `opsd.evaluation.metrics`.

Notation. For arm X and seed s, m_{X,s} = 100 * mean_p mean_i x_{X,s,p,i}: the mean over problems of the
per-problem mean (`seed_means`). The per-seed paired difference is d_s = m_{B,s} - m_{A,s}, over the
problems both cells of seed s hold (`paired_seed_diffs`); the verdict is about delta = E[d_s], the
difference the two recipes make on THESE problems, in expectation over training seeds and sampling.

Two noise sources. d_s = delta + (training noise: where seed s's trajectories ended in the two arms)
+ (evaluation noise: which samples the two checkpoints happened to draw). Given the two checkpoints, the
evaluation noise of d_s has variance (`within_seed_variance`)

    W_s = (100^2 / P^2) * sum_p s2_p / n_p,   s2_p = var_i(b_{p,i} - a_{p,i}) with ddof=1,

(for one cell's mean alone, s2_p is the variance of a_{p,i}); the per-sample pairing keeps it small where
the two checkpoints tend to agree on a sample. Over seeds,

    Var(d_s) = between + within,   between = Var(training part of d_s),   within = E[W_s],

and `variance_components` estimates the parts by the method of moments: total = the ddof=1 variance of the
d_s, within = the mean of the W_s, between = max(0, total - within). More samples per problem shrink only
the within part; only more seeds shrink the between part.

Intervals, and what each assumes.

* `seed_paired_t` (the reported verdict): mean of d_1..d_S ± t_{S-1} * sd(ddof=1) / sqrt(S). It assumes the
  d_s independent and normal with one mean and one variance; independent needs each training seed's own
  sampling seeds (one set shared by every seed repeats the same evaluation noise in every d_s). It needs no model of the two noise sources,
  because each d_s already holds its own evaluation noise plus its seed's training noise: the spread of
  the d_s is the total variance above. Under normality it is exact at any S >= 2, which matters at the
  2-5 seeds researchers run (t_{2} = 4.30, not 1.96); each d_s averages P * n paired samples and a smooth
  training perturbation, so normality is close. The problem set is held fixed: the question answered is
  "is B better than A on this benchmark", not on problems at large.
* `hierarchical_bootstrap` (reported beside, as a check): resamples seeds, then problems within each drawn
  seed (one draw of problems for both arms, so the pairing is kept), and takes the percentile interval.
  Resampling problems adds the problem-to-problem spread of the differences: it asks whether B is better
  on problems like these. The percentile bootstrap assumes the resampled spread mimics the sampling
  spread, which needs many top-level units: with S seeds there are only C(2S-1, S) distinct seed multisets
  (10 at S = 3), the seed-level variance comes out shrunk by (S-1)/S, and nothing widens the interval the
  way t_{S-1} does, so at 2-5 seeds it undercovers: about 85% for a nominal 95% at 3 seeds in the one simulated
  setting of tests/unit/test_experiment_stats.py, where the t interval covers 95%.
* `paired_over_problems` (one seed only): t interval over the P per-problem differences, df = P-1. It
  carries the evaluation's noise and the problems' spread but none of the seed-to-seed spread: it says
  whether these two checkpoints differ, not whether the recipes do.

Planning (power, the smallest detectable difference, the seeds needed): `opsd.experiment.power`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as sps

Scores = Mapping[str, Sequence[float]]  # problem id -> per-sample values in [0, 1], index = sample index
CellScores = Mapping[int, Scores]  # training seed -> Scores of that cell

# Bootstrap draws are made in chunks of replicates holding at most this many problem draws (about 16 MiB
# per int64 or float64 array), so memory stays bounded for many replicates, seeds or problems.
_CHUNK_DRAWS = 1 << 21


class UnpairedCells(ValueError):
    """Two cells whose samples cannot be paired: no problem id in common, or a common problem with another
    sample count in each. Bad data, not a bug, when the cells were read from files: the caller that read
    them names the files (`opsd.experiment.commands`)."""


@dataclass(frozen=True)
class Interval:
    """A difference (or rate) in points with its interval at the requested level.

    ``low``/``high``/``se`` are None where undefined (one seed for `seed_paired_t`, one problem for
    `paired_over_problems`); ``df`` is the t distribution's degrees of freedom where one is used, else None.
    """

    estimate: float
    low: float | None
    high: float | None
    se: float | None
    df: int | None
    method: str
    n_seeds: int


# --- validation ----------------------------------------------------------------------------------


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")


def _samples(values: Sequence[float], where: str) -> np.ndarray:
    """Per-sample values of one problem, shape (n,); ValueError unless n >= 1 and all lie in [0, 1]."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"{where}: needs a non-empty list of per-sample values, got shape {x.shape}")
    if not np.all((x >= 0.0) & (x <= 1.0)):  # also rejects NaN
        bad = x[~((x >= 0.0) & (x <= 1.0))][:3].tolist()
        raise ValueError(f"{where}: per-sample values must be fractions in [0, 1], got {bad}")
    return x


def _cell_means(scores: Scores, where: str) -> np.ndarray:
    """Per-problem mean of one cell, shape (P,), fractions; ValueError for a cell without problems."""
    if not scores:
        raise ValueError(f"{where}: the cell holds no problems")
    return np.array([_samples(v, f"{where}, problem {pid!r}").mean() for pid, v in scores.items()])


def _paired_samples(a: Scores, b: Scores, where: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(a, b) per-sample arrays, each of shape (n_p,), for the problems both hold, in a's order.

    `UnpairedCells` (a ValueError) if they share no problem or a common problem has different sample counts in
    a and b.
    """
    common = [pid for pid in a if pid in b]
    if not common:
        raise UnpairedCells(f"{where}: the two cells share no problem id ({len(a)} in a, {len(b)} in b)")
    pairs = []
    for pid in common:
        xa = _samples(a[pid], f"{where}, problem {pid!r} of a")
        xb = _samples(b[pid], f"{where}, problem {pid!r} of b")
        if xa.size != xb.size:
            raise UnpairedCells(
                f"{where}, problem {pid!r}: a has {xa.size} samples and b has {xb.size}; "
                "pairing sample i across arms needs equal counts"
            )
        pairs.append((xa, xb))
    return pairs


def _problem_diffs(a: Scores, b: Scores, where: str) -> np.ndarray:
    """Per-problem mean difference b - a over the common problems, shape (P,), fractions."""
    return np.array([xb.mean() - xa.mean() for xa, xb in _paired_samples(a, b, where)])


def _common_seeds(a: CellScores, b: CellScores) -> list[int]:
    common = sorted(s for s in a if s in b)
    if not common:
        raise ValueError(f"the two arms share no training seed (a: {sorted(a)}, b: {sorted(b)})")
    return common


# --- point estimates -----------------------------------------------------------------------------


def t_critical(df: int, level: float = 0.95) -> float:
    """Two-sided critical value t_{(1+level)/2, df} of Student's t (scipy.stats.t.ppf)."""
    if df < 1:
        raise ValueError(f"t critical value needs df >= 1, got {df}")
    _check_level(level)
    return float(sps.t.ppf(0.5 + level / 2.0, df))


def seed_means(cells: CellScores) -> dict[int, float]:
    """seed -> m_s = 100 * mean over problems of the per-problem mean, in points (problems weigh alike)."""
    return {seed: 100.0 * float(_cell_means(scores, f"seed {seed}").mean()) for seed, scores in cells.items()}


def paired_seed_diffs(a: CellScores, b: CellScores) -> dict[int, float]:
    """seed -> d_s = m_{b,s} - m_{a,s} in points, over the seeds both arms hold (ascending).

    Within seed s, only the problems both cells hold count. ValueError, naming the seed, if the arms share no
    seed, if a common seed shares no problem, or if a common problem has different sample counts.
    """
    return {
        seed: 100.0 * float(_problem_diffs(a[seed], b[seed], f"seed {seed}").mean())
        for seed in _common_seeds(a, b)
    }


# --- intervals -----------------------------------------------------------------------------------


def _t_interval(values: np.ndarray, level: float, method: str, n_seeds: int) -> Interval:
    """mean ± t_{k-1} * sd(ddof=1) / sqrt(k) over k values (points); estimate only for k = 1 or k equal values."""
    _check_level(level)
    k = values.size
    if k == 0:
        raise ValueError(f"{method}: needs at least one value, got none")
    if not np.all(np.isfinite(values)):
        raise ValueError(f"{method}: values must be finite, got {values.tolist()[:5]}")
    estimate = float(values.mean())
    if k == 1:
        return Interval(estimate, None, None, None, None, method, n_seeds)
    if np.ptp(values) <= 1e-9 * max(1.0, abs(estimate)):
        # Identical values (coarse scores at few seeds; equal up to rounding): their spread is unknown, not
        # zero, so no bounds.
        return Interval(estimate, None, None, 0.0, k - 1, method, n_seeds)
    se = float(values.std(ddof=1)) / math.sqrt(k)
    half = t_critical(k - 1, level) * se
    return Interval(estimate, estimate - half, estimate + half, se, k - 1, method, n_seeds)


def seed_paired_t(diffs: Sequence[float], level: float = 0.95) -> Interval:
    """The verdict: t interval over S per-seed differences d_s (points), df = S-1.

    estimate = mean(d), se = sd(d, ddof=1) / sqrt(S), bounds estimate ± t_{S-1} * se. With S = 1 only the
    estimate is defined (low, high, se and df are None).
    """
    d = np.asarray(diffs, dtype=float)
    return _t_interval(d, level, "seed-paired t", n_seeds=int(d.size))


def paired_over_problems(a: Scores, b: Scores, level: float = 0.95) -> Interval:
    """One seed: t interval over the P per-problem differences 100 * (mean_b - mean_a), df = P-1.

    Carries the evaluation's noise and the problems' spread, not the seed-to-seed spread (n_seeds = 1).
    With one common problem only the estimate is defined.
    """
    d = 100.0 * _problem_diffs(a, b, "paired_over_problems")  # (P,)
    return _t_interval(d, level, "paired t over problems", n_seeds=1)


def _bootstrap_replicates(per_seed: Sequence[np.ndarray], reps: int, rng: np.random.Generator) -> np.ndarray:
    """Replicates of the hierarchical bootstrap statistic, shape (reps,), in the units of `per_seed`.

    per_seed[s] holds seed s's per-problem differences, shape (P_s,). Each replicate draws S seeds with
    replacement, then for each drawn seed P_s of its problems with replacement, and averages: the mean over
    drawn seeds of the mean over that seed's drawn problems.
    """
    n_seeds = len(per_seed)
    sizes = np.array([d.size for d in per_seed])  # (S,)
    p_max = int(sizes.max())
    table = np.zeros((n_seeds, p_max))  # (S, P_max), zero-padded where P_s < P_max
    for s, d in enumerate(per_seed):
        table[s, : d.size] = d
    equal_sizes = bool(np.all(sizes == p_max))
    chunk = max(1, _CHUNK_DRAWS // (n_seeds * p_max))
    out = np.empty(reps)
    for start in range(0, reps, chunk):
        r = min(chunk, reps - start)
        drawn = rng.integers(0, n_seeds, size=(r, n_seeds))  # (r, S): the seed drawn at each position
        if equal_sizes:
            picks = rng.integers(0, p_max, size=(r, n_seeds, p_max))  # (r, S, P): drawn problem indices
            means = table[drawn[..., None], picks].mean(axis=-1)  # (r, S)
        else:
            n_drawn = sizes[drawn]  # (r, S): problem count of each drawn seed
            picks = rng.integers(0, n_drawn[..., None], size=(r, n_seeds, p_max))  # index < P_{drawn seed}
            used = np.arange(p_max) < n_drawn[..., None]  # (r, S, P_max): the first P_{drawn seed} draws
            means = np.where(used, table[drawn[..., None], picks], 0.0).sum(axis=-1) / n_drawn  # (r, S)
        out[start : start + r] = means.mean(axis=-1)
    return out


def hierarchical_bootstrap(
    a: CellScores, b: CellScores, *, reps: int = 10000, seed: int = 0, level: float = 0.95
) -> Interval:
    """Percentile interval of the two-level (seeds, then problems) paired bootstrap, in points.

    Over the common seeds S and, per seed, the common problems: each replicate draws S seeds with
    replacement and, for each drawn seed, that seed's P_s problems with replacement (one draw for both arms);
    its statistic is the mean over drawn seeds of the mean over drawn problems of 100 * (mean_b - mean_a).
    low/high are the (1-level)/2 and (1+level)/2 quantiles of the replicates, se their std (ddof=1);
    estimate is the plain point estimate, the mean of `paired_seed_diffs`. Deterministic for a given `seed`.
    """
    _check_level(level)
    if reps < 2:
        raise ValueError(f"hierarchical_bootstrap needs reps >= 2, got {reps}")
    per_seed = [
        100.0 * _problem_diffs(a[s], b[s], f"seed {s}") for s in _common_seeds(a, b)
    ]  # S arrays, shape (P_s,)
    estimate = float(np.mean([d.mean() for d in per_seed]))
    replicates = _bootstrap_replicates(per_seed, reps, np.random.default_rng(seed))  # (reps,)
    low, high = np.quantile(replicates, [0.5 - level / 2.0, 0.5 + level / 2.0])
    return Interval(
        estimate=estimate,
        low=float(low),
        high=float(high),
        se=float(replicates.std(ddof=1)),
        df=None,
        method="hierarchical bootstrap",
        n_seeds=len(per_seed),
    )


# --- variance decomposition ----------------------------------------------------------------------


def within_seed_variance(a: Scores, b: Scores | None = None) -> float:
    """Evaluation-sampling variance (points^2) of one cell's mean (b None) or of one seed's d = m_b - m_a.

    (100^2 / P^2) * sum_p s2_p / n_p, with s2_p the ddof=1 variance over sample index i of a_{p,i} (b None)
    or of b_{p,i} - a_{p,i} (over the common problems), and n_p the problem's sample count (>= 2).
    """
    if b is None:
        per_problem = [_samples(v, f"within_seed_variance, problem {pid!r}") for pid, v in a.items()]
        if not per_problem:
            raise ValueError("within_seed_variance: the cell holds no problems")
    else:
        per_problem = [xb - xa for xa, xb in _paired_samples(a, b, "within_seed_variance")]
    total = 0.0
    for x in per_problem:  # x: shape (n_p,)
        if x.size < 2:
            raise ValueError(
                "within_seed_variance needs n >= 2 samples per problem to estimate their variance, "
                f"got n={x.size}"
            )
        total += float(x.var(ddof=1)) / x.size
    return 100.0**2 * total / len(per_problem) ** 2


def min_samples(cells: CellScores) -> int:
    """The fewest samples any problem of any seed holds (the within-seed variance needs 2)."""
    return min(len(v) for scores in cells.values() for v in scores.values())


def variance_components(a: CellScores, b: CellScores | None = None) -> dict:
    """Method-of-moments split of the per-seed variance into between-seed and within-seed parts.

    Per-seed values: one arm's seed means (b None) or the paired per-seed differences d_s. Returns
    ``n_seeds``; ``total_var`` (ddof=1 variance of the per-seed values, None for one seed); ``within_var``
    (mean over seeds of `within_seed_variance`; None when a problem has a single sample, n = 1, which leaves
    the sampling variance unestimated); ``between_var`` = max(0, total_var - within_var) (None where either
    is); ``between_floored`` (True where total_var < within_var: the seeds run cannot tell the between part
    from 0); and ``total_sd``, ``within_sd``, ``between_sd`` (square roots, None where the variance is).
    Variances in points^2, sds in points.
    """
    if b is None:
        if not a:
            raise ValueError("variance_components: no seeds")
        values = np.array(list(seed_means(a).values()))  # (S,)
        seeds, n_min = list(a), min_samples(a)
        parts = [(a[s], None) for s in seeds]
    else:
        diffs = paired_seed_diffs(a, b)
        values = np.array(list(diffs.values()))  # (S,)
        seeds = list(diffs)
        n_min = min(min_samples({s: a[s] for s in seeds}), min_samples({s: b[s] for s in seeds}))
        parts = [(a[s], b[s]) for s in seeds]
    within = float(np.mean([within_seed_variance(x, y) for x, y in parts])) if n_min >= 2 else None
    n_seeds = int(values.size)
    total = float(values.var(ddof=1)) if n_seeds >= 2 else None
    between = None if total is None or within is None else max(0.0, total - within)

    def sd(var: float | None) -> float | None:
        return None if var is None else math.sqrt(var)

    return {
        "n_seeds": n_seeds,
        "total_var": total,
        "within_var": within,
        "between_var": between,
        "between_floored": between is not None and total < within,
        "total_sd": sd(total),
        "within_sd": sd(within),
        "between_sd": sd(between),
        "min_samples": n_min,
    }


# --- reporting -----------------------------------------------------------------------------------


def describe(interval: Interval, *, what: str = "avg accuracy") -> str:
    """One plain-language line for an interval of B - A, e.g.

    ``avg accuracy: +1.20 points [-0.85, +3.25] (seed-paired t, 3 seeds): not distinguishable at 3 seeds``.
    Verdicts: "better than the baseline" / "worse than the baseline" when the interval excludes 0, "not
    distinguishable" otherwise, "cannot tell" when the differences it is built from are all equal (their
    spread is unknown); with one seed the line says the interval carries only the evaluation's noise.
    """
    seeds = f"{interval.n_seeds} seed" + ("" if interval.n_seeds == 1 else "s")
    head = f"{what}: {interval.estimate:+.2f} points"
    if interval.low is None or interval.high is None:
        head += f", no interval ({interval.method}, {seeds})"
    else:
        head += f" [{interval.low:+.2f}, {interval.high:+.2f}] ({interval.method}, {seeds})"
    if interval.se == 0.0 and interval.df is not None:
        units = "per-problem" if interval.n_seeds == 1 else "per-seed"
        return (f"{head}: cannot tell: the {interval.df + 1} {units} differences are identical, so their spread "
                "is unknown; run more seeds")  # fmt: skip
    if interval.n_seeds == 1:
        if interval.low is None or interval.high is None:
            return f"{head}: one seed: no seed-to-seed spread to build an interval from"
        return (
            f"{head}: one seed: the interval carries only the evaluation's noise, not the seed-to-seed spread"
        )
    if interval.low is None or interval.high is None:
        return f"{head}: no verdict"
    if interval.low > 0:
        return f"{head}: better than the baseline at {seeds}"
    if interval.high < 0:
        return f"{head}: worse than the baseline at {seeds}"
    return f"{head}: not distinguishable at {seeds}"
