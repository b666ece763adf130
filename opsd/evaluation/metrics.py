"""Noise-aware evaluation metrics: avg@n, pass@k, maj@n with standard errors, paired comparisons.

Units. Summary-level rates (avg@n, pass@k, maj@n, format rate, truncation rate), their standard errors
and paired differences are in PERCENT (points), as in the literature ("54.22 avg@12"). Per-problem
values (the per-problem table, and the inputs of `paired_compare`) are FRACTIONS in [0, 1]. Lengths are
in tokens.

Standard errors treat problems as the sampling unit: SE = std(per-problem values, ddof=1) / sqrt(P).
For avg@n the per-problem value is the problem's mean accuracy over its n samples, so sampling noise
within a problem is folded into the spread across problems. With one problem (or one run) the SE is
undefined and reported as None.

Sample records are mappings with the keys of `SAMPLE_KEYS`: ``correct`` (bool), ``extracted``
(str | None), ``has_box`` (bool), ``n_tokens`` (int), ``truncated`` (bool), as produced by
`opsd.grading.grade` plus the generation's length and finish reason.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from opsd.grading import answer_keys, normalize_answer

logger = logging.getLogger(__name__)

SAMPLE_KEYS = ("correct", "extracted", "has_box", "n_tokens", "truncated")


def t_critical_975(df: float) -> float:
    """Two-sided 95% critical value t_{0.975, df} of Student's t (scipy; the experiment's intervals take any
    level through `opsd.experiment.stats.t_critical`, which sits above evaluation and is not imported here).
    `df` may be fractional (the Welch-Satterthwaite df of `macro_paired`)."""
    from scipy import stats

    if df < 1:
        raise ValueError(f"t critical value needs df >= 1, got {df}")
    return float(stats.t.ppf(0.975, df))


# --- basic statistics ----------------------------------------------------------------------------


def mean(values: Sequence[float]) -> float:
    """Arithmetic mean of a non-empty sequence."""
    if not values:
        raise ValueError("mean of an empty sequence")
    return math.fsum(values) / len(values)


def standard_error(values: Sequence[float]) -> float | None:
    """std(values, ddof=1) / sqrt(len): the SE of the mean; None for fewer than two values."""
    if len(values) < 2:
        return None
    m = mean(values)
    var = math.fsum((v - m) ** 2 for v in values) / (len(values) - 1)
    return math.sqrt(var / len(values))


# --- per-problem estimators ----------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i), which avoids huge binomials (Chen et al., 2021).
    """
    if n < 1:
        raise ValueError(f"pass@k needs n >= 1 samples, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        # Every k-subset contains a correct sample.
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_at_k_curve(correct_counts: Sequence[int], n: int) -> list[dict[str, Any]]:
    """The unbiased pass@k for every k = 1..n, in percent, each with its SE over problems.

    correct_counts[p] is c_p, the correct samples of problem p out of n. For each k:
    value_k = 100 * mean_p pass_at_k(n, c_p, k) and se_k = 100 * std_p(ddof=1) / sqrt(P) (None for one
    problem). pass@1 is avg@n; pass@n is the share of problems with any correct sample. Returns
    ``[{"k": 1, "value": ..., "se": ...}, ..., {"k": n, ...}]``.
    """
    if not correct_counts:
        raise ValueError("pass_at_k_curve needs at least one problem")
    curve = []
    for k in range(1, n + 1):
        value, se = _rate([pass_at_k(n, c, k) for c in correct_counts])
        curve.append({"k": k, "value": value, "se": se})
    return curve


def _field(sample: Mapping[str, Any], key: str) -> Any:
    """A sample record's field, with an error that names the missing key."""
    try:
        return sample[key]
    except KeyError:
        raise KeyError(f"sample record lacks {key!r}; expected keys {SAMPLE_KEYS}") from None


def majority_answer(samples: Sequence[Mapping[str, Any]]) -> tuple[str | None, list[int]]:
    """The most frequent answer by value and the indices of its samples; the answer is shown as the normalised
    text of its first sample (`normalize_answer`).

    Answers vote by value (`opsd.grading.answer_keys`: ``\\frac12``, ``0.5`` and ``1/2`` are one answer), so three
    spellings of one value beat two identical copies of another. Samples without an answer (None or blank) do
    not vote; ties go to the answer seen first (the value whose first sample comes first). Returns (None, [])
    when no sample has an answer.
    """
    answers = [_field(sample, "extracted") for sample in samples]
    groups: dict[Any, list[int]] = {}  # insertion order = first occurrence, which breaks ties
    for i, key in enumerate(answer_keys(answers)):
        if key is not None and normalize_answer(str(answers[i])):
            groups.setdefault(key, []).append(i)
    if not groups:
        return None, []
    best = max(groups, key=lambda a: len(groups[a]))  # max keeps the first of equal counts
    members = groups[best]
    return normalize_answer(str(answers[members[0]])), members


def majority_correct(samples: Sequence[Mapping[str, Any]]) -> bool:
    """maj@k: whether the majority answer is correct; False when no sample has an answer.

    The verdict is that of the answer's first sample. Samples in one group normally agree, since they share a
    value; a disagreement is logged, as it points at the grader, or at answers whose value agrees but whose
    form the grader tells apart (`opsd.grading.forms_differ`: ``x = 5`` and ``y = 5``, ``5 cm`` and
    ``5 inches``).
    """
    answer, members = majority_answer(samples)
    if answer is None:
        return False
    verdicts = {bool(_field(samples[i], "correct")) for i in members}
    if len(verdicts) > 1:
        logger.warning("samples with the same answer value %r were graded differently", answer)
    return bool(_field(samples[members[0]], "correct"))


# --- summaries -----------------------------------------------------------------------------------


def _check_samples(per_problem: Mapping[str, Sequence[Mapping[str, Any]]]) -> int:
    """The common number of samples per problem; ValueError if there are no problems, 0 or unequal n."""
    if not per_problem:
        raise ValueError("no problems to summarize")
    counts = {pid: len(samples) for pid, samples in per_problem.items()}
    sizes = set(counts.values())
    if len(sizes) > 1:
        by_size = {size: [pid for pid, c in counts.items() if c == size][:3] for size in sorted(sizes)}
        raise ValueError(f"problems have different numbers of samples (n -> example ids): {by_size}")
    n = sizes.pop()
    if n == 0:
        raise ValueError("problems have n == 0 samples")
    return n


def _rate(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and SE of per-problem fractions, in percent."""
    se = standard_error(values)
    return 100.0 * mean(values), None if se is None else 100.0 * se


def summarize(per_problem: Mapping[str, Sequence[Mapping[str, Any]]], k: int | None = None) -> dict[str, Any]:
    """Summary of an evaluation: rates in percent with SEs over problems, plus a per-problem table.

    Keys: ``n_problems``, ``n`` (samples per problem), ``k``; ``avg``, ``pass_at_k``, ``maj``,
    ``format_rate``, ``truncation_rate`` (percent) and ``mean_tokens`` (tokens), each with an ``_se``
    twin (None for one problem); ``pass_at_k_curve`` (`pass_at_k_curve`: pass@1 .. pass@n); ``labels`` (e.g. {"avg": "avg@12", "pass_at_k": "pass@12",
    "maj": "maj@12"}); ``problems``: one dict per problem with ``id``, ``n``, ``n_correct``,
    ``accuracy``, ``pass_at_k`` (fractions), ``maj`` (bool), ``format_rate``, ``truncation_rate``
    (fractions) and ``mean_tokens``.
    """
    n = _check_samples(per_problem)
    k = n if k is None else k
    if not 1 <= k <= n:
        raise ValueError(f"k must satisfy 1 <= k <= n={n}, got k={k}")

    rows = []
    for pid, samples in per_problem.items():
        n_correct = sum(bool(_field(s, "correct")) for s in samples)
        rows.append(
            {
                "id": pid,
                "n": n,
                "n_correct": n_correct,
                "accuracy": n_correct / n,
                "pass_at_k": pass_at_k(n, n_correct, k),
                "maj": majority_correct(samples),
                "format_rate": sum(bool(_field(s, "has_box")) for s in samples) / n,
                "truncation_rate": sum(bool(_field(s, "truncated")) for s in samples) / n,
                "mean_tokens": mean([float(_field(s, "n_tokens")) for s in samples]),
            }
        )

    summary: dict[str, Any] = {"n_problems": len(rows), "n": n, "k": k}
    for key in ("accuracy", "pass_at_k", "maj", "format_rate", "truncation_rate"):
        name = "avg" if key == "accuracy" else key
        summary[name], summary[f"{name}_se"] = _rate([float(r[key]) for r in rows])
    tokens = [r["mean_tokens"] for r in rows]
    summary["mean_tokens"], summary["mean_tokens_se"] = mean(tokens), standard_error(tokens)
    summary["pass_at_k_curve"] = pass_at_k_curve([r["n_correct"] for r in rows], n)
    summary["labels"] = {"avg": f"avg@{n}", "pass_at_k": f"pass@{k}", "maj": f"maj@{n}"}
    summary["problems"] = rows
    return summary


def per_problem_accuracy(summary: Mapping[str, Any]) -> dict[str, float]:
    """{problem id: accuracy fraction} from a `summarize` result, the input of `paired_compare`."""
    return {row["id"]: row["accuracy"] for row in summary["problems"]}


def per_problem_format_rate(summary: Mapping[str, Any]) -> dict[str, float]:
    """{problem id: share of its samples with a complete boxed answer}, for `paired_compare`."""
    return {row["id"]: row["format_rate"] for row in summary["problems"]}


def format_summary(summary: Mapping[str, Any]) -> str:
    """One line such as ``avg@12 54.22 ± 3.10 | pass@12 ... | format 98.9 | len 8123 | trunc 1.2``."""

    def pm(key: str, digits: int) -> str:
        se = summary[f"{key}_se"]
        return f"{summary[key]:.{digits}f}" + ("" if se is None else f" ± {se:.{digits}f}")

    labels = summary["labels"]
    return (
        f"{labels['avg']} {pm('avg', 2)} | {labels['pass_at_k']} {pm('pass_at_k', 2)} | "
        f"{labels['maj']} {pm('maj', 2)} | format {pm('format_rate', 1)} | "
        f"len {pm('mean_tokens', 0)} | trunc {pm('truncation_rate', 1)} | P={summary['n_problems']}"
    )


# --- comparisons across checkpoints and runs -----------------------------------------------------


def paired_compare(a: Mapping[str, float], b: Mapping[str, float]) -> dict[str, Any]:
    """Paired difference b - a over the problems both evaluated, in percentage points.

    Inputs map problem id -> accuracy fraction in [0, 1]. Pairing removes the between-problem spread
    (problem difficulty) from the noise, so the SE is that of the per-problem differences.
    Returns ``n_problems``, ``mean_a``, ``mean_b``, ``mean_diff``, ``se``, ``df``, ``t_crit``,
    ``ci_low``, ``ci_high`` (95% t interval; SE, t and interval are None with one common problem).
    """
    common = [pid for pid in a if pid in b]
    if not common:
        raise ValueError("paired_compare: the two evaluations share no problem ids")
    if len(common) != len(a) or len(common) != len(b):
        logger.warning(
            "paired_compare: problem sets differ (%d in a, %d in b); comparing the %d common ones",
            len(a),
            len(b),
            len(common),
        )
    for name, side in (("a", a), ("b", b)):
        bad = [pid for pid in common if not 0.0 <= side[pid] <= 1.0]
        if bad:
            raise ValueError(
                f"paired_compare: {name} holds values outside [0, 1] (fractions expected): {bad[:3]}"
            )

    diffs = [100.0 * (b[pid] - a[pid]) for pid in common]
    diff = mean(diffs)
    se = standard_error(diffs)
    df = len(common) - 1
    t_crit = t_critical_975(df) if se is not None else None
    return {
        "n_problems": len(common),
        "mean_a": 100.0 * mean([a[pid] for pid in common]),
        "mean_b": 100.0 * mean([b[pid] for pid in common]),
        "mean_diff": diff,
        "se": se,
        "df": df,
        "t_crit": t_crit,
        "ci_low": None if se is None else diff - t_crit * se,
        "ci_high": None if se is None else diff + t_crit * se,
    }


def aggregate_runs(values: Sequence[float]) -> dict[str, Any]:
    """Mean, SE across runs (std ddof=1 / sqrt(R)), min, max and count of a metric over R runs.

    ``note`` explains a missing SE (one run) and is None otherwise.
    """
    if not values:
        raise ValueError("aggregate_runs needs at least one value")
    values = [float(v) for v in values]
    se = standard_error(values)
    return {
        "mean": mean(values),
        "se": se,
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "note": "SE undefined for a single run" if se is None else None,
    }


# --- several benchmarks: the macro average -----------------------------------------------------------


def macro_average(rates: Sequence[tuple[float, float | None]]) -> dict[str, Any]:
    """Unweighted mean of B benchmarks' rates (percent), each given as (rate, SE), with its SE.

    The benchmarks are independent problem sets, so the variance of the mean is the sum of the variances over B^2:
    macro = (1/B) * sum_b r_b,  SE = sqrt(sum_b SE_b^2) / B. The SE is None when any benchmark's is (one
    problem). Every benchmark weighs alike, whatever its size (MATH-500's 500 problems count as much as
    AIME's 30). Returns ``n_benchmarks``, ``value``, ``se``.
    """
    if not rates:
        raise ValueError("macro_average needs at least one benchmark")
    b = len(rates)
    value = math.fsum(r for r, _ in rates) / b
    ses = [se for _, se in rates]
    se = None if any(x is None for x in ses) else math.sqrt(math.fsum(x * x for x in ses)) / b
    return {"n_benchmarks": b, "value": value, "se": se}


def macro_paired(diffs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The macro average of B per-benchmark paired differences (each a `paired_compare` result), in points.

    mean_diff = (1/B) * sum_b d_b and SE = sqrt(sum_b se_b^2) / B (independent benchmarks). The 95% interval
    is mean_diff ± t_{0.975, df} * SE with the Welch-Satterthwaite degrees of freedom of a sum of independent
    t-distributed terms, df = (sum_b se_b^2)^2 / sum_b (se_b^4 / df_b), df_b = P_b - 1; with one benchmark
    that is its own df. mean_a and mean_b are the macro averages of each side. SE, df and the interval are
    None when a benchmark has none (one problem); with SE 0 the interval is the point and df is None.
    Returns ``n_benchmarks``, ``mean_a``, ``mean_b``, ``mean_diff``, ``se``, ``df``, ``t_crit``,
    ``ci_low``, ``ci_high``.
    """
    if not diffs:
        raise ValueError("macro_paired needs at least one benchmark")
    b = len(diffs)
    out: dict[str, Any] = {
        "n_benchmarks": b,
        "mean_a": math.fsum(d["mean_a"] for d in diffs) / b,
        "mean_b": math.fsum(d["mean_b"] for d in diffs) / b,
        "mean_diff": math.fsum(d["mean_diff"] for d in diffs) / b,
        "se": None, "df": None, "t_crit": None, "ci_low": None, "ci_high": None,
    }  # fmt: skip
    if any(d["se"] is None for d in diffs):
        return out
    variance = math.fsum(d["se"] ** 2 for d in diffs)  # b^2 * Var(mean_diff)
    out["se"] = math.sqrt(variance) / b
    if variance == 0:
        out["ci_low"] = out["ci_high"] = out["mean_diff"]
        return out
    out["df"] = variance**2 / math.fsum(d["se"] ** 4 / d["df"] for d in diffs if d["se"] > 0)
    out["t_crit"] = t_critical_975(out["df"])
    out["ci_low"] = out["mean_diff"] - out["t_crit"] * out["se"]
    out["ci_high"] = out["mean_diff"] + out["t_crit"] * out["se"]
    return out
