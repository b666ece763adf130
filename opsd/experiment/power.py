"""Planning an experiment: the power of the seed-paired t test, the smallest difference it detects, and the
seeds a difference needs. Pure functions; like `opsd.experiment.stats`, nothing from opsd is imported.

With sigma_d the true sd of one per-seed difference d_s (the notation of `opsd.experiment.stats`; estimated by
`stats.variance_components(a, b)["total_sd"]`), the
two-sided t test on S differences rejects with probability given by the noncentral t with
nc = delta * sqrt(S) / sigma_d (`power_paired_t`). `min_detectable_diff` solves it for delta at a given
power. At 80% power and alpha 5% it approaches (z_{0.975} + z_{0.8}) * sigma_d / sqrt(S) = 2.80 sigma_d /
sqrt(S) for many seeds, but t_{S-1}'s heavy tails make it 1.68 sigma_d at 5 seeds (normal: 1.25), 3.26
sigma_d at 3 seeds (1.62) and 11.5 sigma_d at 2 seeds (1.98). `seeds_needed` solves the same equation for S.

Every one of these takes sigma_d as known, but the report has only its estimate from the seeds run, which at 2-3
seeds is loose (its 95% interval at 3 seeds spans a factor of 12). `plan` therefore reports each number with the
range the chi-square interval of sigma_d gives it, floored at the evaluation noise alone, and says in words when
the seeds run cannot pin the answer down.
"""

from __future__ import annotations

import math

from scipy import stats as sps
from scipy.optimize import brentq


def _check_alpha(alpha: float) -> None:
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")


def power_paired_t(diff: float, sd: float, n_seeds: int, alpha: float = 0.05) -> float:
    """Power of the two-sided one-sample t test on n_seeds normal differences with mean `diff` and sd `sd`.

    P(|T| > t_{1-alpha/2, n-1}) with T noncentral t, df = n-1, nc = diff * sqrt(n) / sd. sd = 0 gives the
    limit: 1 for diff != 0, alpha for diff = 0.
    """
    if n_seeds < 2:
        raise ValueError(f"power of a t test needs n_seeds >= 2 (df >= 1), got {n_seeds}")
    if sd < 0 or not math.isfinite(sd):
        raise ValueError(f"sd must be finite and >= 0, got {sd}")
    _check_alpha(alpha)
    if sd == 0:
        return alpha if diff == 0 else 1.0
    df = n_seeds - 1
    t_crit = float(sps.t.ppf(1.0 - alpha / 2.0, df))
    nc = abs(diff) * math.sqrt(n_seeds) / sd  # power is symmetric in the sign of diff
    upper = float(sps.nct.sf(t_crit, df, nc))
    # The wrong-side tail P(T < -t_crit) < P(T < 0) = Phi(-nc), below 1e-15 for nc > 8, where scipy's nct
    # can return NaN; it is dropped there.
    lower = float(sps.nct.cdf(-t_crit, df, nc)) if nc < 8.0 else 0.0
    return min(1.0, upper + lower)


def min_detectable_diff(
    sd: float | None, n_seeds: int, power: float = 0.8, alpha: float = 0.05
) -> float | None:
    """Smallest |diff| (points) with `power_paired_t`(diff, sd, n_seeds, alpha) >= power.

    Found with brentq and nudged up to the side where the power is reached. None for n_seeds < 2 or sd None
    (nothing to plan from); 0.0 for sd = 0.
    """
    if sd is None or n_seeds < 2:
        return None
    if sd < 0 or not math.isfinite(sd):
        raise ValueError(f"sd must be finite and >= 0, got {sd}")
    _check_alpha(alpha)
    if not alpha < power < 1.0:
        raise ValueError(f"power must be in (alpha={alpha}, 1), got {power}")
    if sd == 0:
        return 0.0

    def gap(d: float) -> float:
        return power_paired_t(d, sd, n_seeds, alpha) - power

    high = 4.0 * sd / math.sqrt(n_seeds)
    while gap(high) < 0:  # power rises to 1 as diff grows: doubling finds a bracket
        high *= 2.0
    root = float(brentq(gap, 0.0, high, xtol=1e-12 * sd, rtol=1e-12))
    while gap(root) < 0:
        root += 1e-12 * sd + 4e-16 * root
    return root


def seeds_needed(
    diff: float, sd: float, power: float = 0.8, alpha: float = 0.05, max_seeds: int = 10000
) -> int | None:
    """Smallest n >= 2 with `power_paired_t`(diff, sd, n, alpha) >= power; None if none up to max_seeds.

    diff = 0 gives None (the power stays at alpha). Power rises with n, so n is found by bisection.
    """
    _check_alpha(alpha)
    if not alpha < power < 1.0:
        raise ValueError(f"power must be in (alpha={alpha}, 1), got {power}")
    if max_seeds < 2:
        raise ValueError(f"max_seeds must be >= 2, got {max_seeds}")
    if diff == 0:
        return None

    def enough(n: int) -> bool:
        return power_paired_t(diff, sd, n, alpha) >= power

    if not enough(max_seeds):
        return None
    low, high = 2, max_seeds  # invariant: enough(high); every n < low is not enough
    while low < high:
        mid = (low + high) // 2
        if enough(mid):
            high = mid
        else:
            low = mid + 1
    return high


def sd_interval(sd: float, n_seeds: int, level: float = 0.95) -> tuple[float, float]:
    """The chi-square interval of a normal sd from its ddof=1 estimate `sd` over n_seeds values.

    (n-1) s^2 / sigma^2 ~ chi2_{n-1}, so sigma lies in [s sqrt((n-1) / chi2_{(1+level)/2}), s sqrt((n-1) /
    chi2_{(1-level)/2})] with probability `level`. At 3 seeds and 95% that is [0.52 s, 6.28 s]: two or three
    seeds say little about the sd, and everything planned from it inherits that.
    """
    if n_seeds < 2:
        raise ValueError(f"an sd interval needs n_seeds >= 2, got {n_seeds}")
    if sd < 0 or not math.isfinite(sd):
        raise ValueError(f"sd must be finite and >= 0, got {sd}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    df = n_seeds - 1
    low = sd * math.sqrt(df / float(sps.chi2.ppf(0.5 + level / 2.0, df)))
    high = sd * math.sqrt(df / float(sps.chi2.ppf(0.5 - level / 2.0, df)))
    return low, high


def plan(total_sd: float | None, within_sd: float | None, n_seeds: int, target: float, *,
         power: float = 0.8, alpha: float = 0.05, level: float = 0.95) -> dict:  # fmt: skip
    """What the seeds run say about planning, with how sure it is.

    sigma_d is estimated by `total_sd` (the ddof=1 sd of the n_seeds per-seed differences) and bounded by its
    chi-square interval (`sd_interval`); none of them is taken below `within_sd`, the sd the evaluation's
    sampling noise alone gives one seed's difference (every seed's difference carries it). From the estimate and
    the two bounds: ``mde`` and ``mde_range`` (`min_detectable_diff` at the seeds run), ``seeds_needed`` and
    ``seeds_range`` (`seeds_needed` for `target`; a None upper end: more than 10000). ``sd``/``sd_range`` are the
    sds used. With fewer than 2 seeds, or identical per-seed differences (total_sd 0: their spread is unknown,
    not zero), every number is None and ``why`` says so; ``pinned`` is False when the seeds range spans more
    than a factor of 2 (or has no upper end).
    """
    empty = {"sd": None, "sd_range": None, "mde": None, "mde_range": None, "seeds_needed": None,
             "seeds_range": None, "pinned": False}  # fmt: skip
    if total_sd is None or n_seeds < 2:
        return {**empty, "why": "planning needs at least 2 seeds"}
    if total_sd == 0:
        return {**empty, "why": f"the {n_seeds} per-seed differences are identical: their spread is unknown"}
    floor = within_sd or 0.0
    low, high = sd_interval(total_sd, n_seeds, level)
    sds = (max(total_sd, floor), max(low, floor), max(high, floor))
    mdes = [min_detectable_diff(sd, n_seeds, power, alpha) for sd in sds]
    seeds = [seeds_needed(target, sd, power, alpha) if target else None for sd in sds]
    pinned = bool(target) and seeds[2] is not None and seeds[2] <= 2 * seeds[1]
    return {"sd": sds[0], "sd_range": [sds[1], sds[2]], "mde": mdes[0], "mde_range": [mdes[1], mdes[2]],
            "seeds_needed": seeds[0], "seeds_range": [seeds[1], seeds[2]] if target else None, "pinned": pinned,
            "why": None}  # fmt: skip


def describe_plan(p: dict, n_seeds: int, target: float) -> str:
    """One plain line of `plan`'s result, e.g. ``detectable at 80% power with 3 seeds: 2.1 points (95%: 1.1 to
    13); seeds needed for a 1-point difference: 5 as estimated, but 3 seeds cannot pin this down: anywhere from 3
    to 112 (95%); run more seeds to narrow it``."""
    if p["why"]:
        return f"planning: cannot tell ({p['why']})"
    lo, hi = p["mde_range"]
    line = f"detectable at 80% power with {n_seeds} seeds: {p['mde']:.2f} points (95%: {lo:.2f} to {hi:.2f})"
    if not target:
        return line
    s_lo, s_hi = p["seeds_range"]
    upper = "more than 10000" if s_hi is None else str(s_hi)
    point = "more than 10000" if p["seeds_needed"] is None else str(p["seeds_needed"])
    if s_lo is None:  # even the smallest sd in the range needs more seeds than are searched: no range to give
        return (f"{line}; seeds needed for a {target:g}-point difference: more than 10000, even at the smallest sd "
                f"the {n_seeds} seeds allow (95%)")  # fmt: skip
    if p["pinned"]:
        return f"{line}; seeds needed for a {target:g}-point difference: {point} (95%: {s_lo} to {upper})"
    return (f"{line}; seeds needed for a {target:g}-point difference: {point} as estimated, but {n_seeds} seeds cannot pin "
            f"this down: anywhere from {s_lo} to {upper} (95%); run more seeds to narrow it")  # fmt: skip
