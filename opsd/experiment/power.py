"""Planning an experiment: the power of the seed-paired t test, the smallest difference it detects, and the
seeds a difference needs. Pure functions; like `opsd.experiment.stats`, nothing from opsd is imported.

With sigma_d the true sd of one per-seed difference d_s (the notation of `opsd.experiment.stats`; estimated by
`stats.variance_components(a, b)["total_sd"]`), the
two-sided t test on S differences rejects with probability given by the noncentral t with
nc = delta * sqrt(S) / sigma_d (`power_paired_t`). `min_detectable_diff` solves it for delta at a given
power. At 80% power and alpha 5% it approaches (z_{0.975} + z_{0.8}) * sigma_d / sqrt(S) = 2.80 sigma_d /
sqrt(S) for many seeds, but t_{S-1}'s heavy tails make it 1.68 sigma_d at 5 seeds (normal: 1.25), 3.26
sigma_d at 3 seeds (1.62) and 11.5 sigma_d at 2 seeds (1.98). `seeds_needed` solves the same equation for S.
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
