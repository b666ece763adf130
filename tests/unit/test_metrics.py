"""Tests for opsd.evaluation.metrics, with expected numbers worked out by hand in the comments."""

from __future__ import annotations

import itertools
import logging
import math
from math import comb

import pytest

from opsd.evaluation.metrics import (
    aggregate_runs,
    format_summary,
    macro_average,
    macro_paired,
    majority_answer,
    majority_correct,
    pass_at_k,
    pass_at_k_curve,
    per_problem_accuracy,
    standard_error,
    summarize,
    t_critical_975,
)


def sample(correct: bool, extracted: str | None, n_tokens: int = 10, truncated: bool = False) -> dict:
    return {
        "correct": correct,
        "extracted": extracted,
        "has_box": extracted is not None,
        "n_tokens": n_tokens,
        "truncated": truncated,
    }


# --- pass@k --------------------------------------------------------------------------------------


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of all k-subsets of n samples (the first c correct) that hold a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_pass_at_k_matches_enumeration(n: int) -> None:
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)
            assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)


def test_pass_at_k_edges() -> None:
    assert pass_at_k(12, 0, 12) == 0.0
    assert pass_at_k(12, 1, 12) == 1.0
    assert pass_at_k(12, 3, 1) == pytest.approx(0.25)
    # Large n stays finite and in range (binomials would overflow floats here).
    assert 0.0 < pass_at_k(2000, 1, 1000) <= 1.0
    assert pass_at_k(2000, 1, 1000) == pytest.approx(0.5)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 2, 5), (4, 2, 0), (0, 0, 1), (4, 5, 1), (4, -1, 1)])
def test_pass_at_k_rejects_bad_arguments(n: int, c: int, k: int) -> None:
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


# --- majority vote -------------------------------------------------------------------------------


def test_majority_plain() -> None:
    samples = [sample(False, "4"), sample(True, "5"), sample(True, "5"), sample(False, None)]
    assert majority_answer(samples) == ("5", [1, 2])
    assert majority_correct(samples) is True


def test_majority_tie_goes_to_first_occurrence() -> None:
    samples = [sample(False, "7"), sample(True, "12"), sample(False, "7"), sample(True, "12")]
    assert majority_answer(samples) == ("7", [0, 2])
    assert majority_correct(samples) is False
    samples = [sample(True, "12"), sample(False, "7"), sample(False, "7"), sample(True, "12")]
    assert majority_correct(samples) is True


def test_majority_groups_by_normalized_answer() -> None:
    # "012", "12" and "$12$" are one answer (3 votes) and beat "7" (2 votes) despite coming later.
    samples = [
        sample(False, "7"),
        sample(False, "7"),
        sample(True, "012"),
        sample(True, "12"),
        sample(True, "$12$"),
    ]
    assert majority_answer(samples) == ("12", [2, 3, 4])
    assert majority_correct(samples) is True


def test_majority_votes_by_value_not_by_text() -> None:
    # Three spellings of 1/2 are one answer (3 votes) and beat two identical copies of a wrong 7 (2 votes).
    samples = [
        sample(False, "7"),
        sample(False, "7"),
        sample(True, r"\frac12"),
        sample(True, "0.5"),
        sample(True, "1/2"),
    ]
    assert majority_answer(samples) == (r"\frac{1}{2}", [2, 3, 4])
    assert majority_correct(samples) is True


def test_majority_tie_between_values_goes_to_first_occurrence() -> None:
    # Two votes each, by value: the value whose first sample comes first wins, as for identical texts.
    samples = [sample(True, "1/2"), sample(False, "7"), sample(False, "7"), sample(True, "0.5")]
    assert majority_answer(samples) == ("1/2", [0, 3])
    assert majority_correct(samples) is True
    samples = [sample(False, "7"), sample(True, "0.5"), sample(True, r"\dfrac{1}{2}"), sample(False, "07")]
    assert majority_answer(samples) == ("7", [0, 3])
    assert majority_correct(samples) is False


def test_majority_ignores_missing_answers() -> None:
    # Three samples without an answer do not outvote the single answered one.
    samples = [sample(False, None), sample(False, None), sample(False, ""), sample(True, "3")]
    assert majority_answer(samples) == ("3", [3])
    assert majority_correct(samples) is True
    assert majority_answer([sample(False, None)] * 3) == (None, [])
    assert majority_correct([sample(False, None)] * 3) is False
    assert majority_correct([]) is False


def test_majority_warns_when_group_disagrees(caplog: pytest.LogCaptureFixture) -> None:
    samples = [sample(True, "5"), sample(False, "05")]
    with caplog.at_level(logging.WARNING, logger="opsd.evaluation.metrics"):
        assert majority_correct(samples) is True
    assert "graded differently" in caplog.text


# --- summarize -----------------------------------------------------------------------------------


def tiny_eval() -> dict[str, list[dict]]:
    """3 problems x 4 samples.

    p1: 3/4 correct, answers 5,5,5,6 -> maj "5" correct; tokens 100..400 (mean 250); all boxed.
    p2: 0/4 correct, answers None,3,4,None -> tie 3 vs 4, "3" first, wrong; 2/4 boxed; 2/4 truncated;
        tokens 1000 each.
    p3: 2/4 correct, answers 7,12,7,012 -> tie 7 vs 12 (012 == 12), "7" first, wrong; tokens 50 each.
    """
    return {
        "p1": [
            sample(True, "5", 100),
            sample(True, "5", 200),
            sample(True, "5", 300),
            sample(False, "6", 400),
        ],
        "p2": [
            sample(False, None, 1000, truncated=True),
            sample(False, "3", 1000),
            sample(False, "4", 1000),
            sample(False, None, 1000, truncated=True),
        ],
        "p3": [
            sample(False, "7", 50),
            sample(True, "12", 50),
            sample(False, "7", 50),
            sample(True, "012", 50),
        ],
    }


def test_summarize_hand_computed() -> None:
    s = summarize(tiny_eval())
    assert (s["n_problems"], s["n"], s["k"]) == (3, 4, 4)
    assert s["labels"] == {"avg": "avg@4", "pass_at_k": "pass@4", "maj": "maj@4"}

    # Each metric's mean over the problems and its standard error, by hand.
    expected = {
        # avg@4: per-problem 75, 0, 50 (%) -> mean 41.667. Deviations 33.333, -41.667, 8.333;
        # squares 1111.111 + 1736.111 + 69.444 = 2916.667; /2 = 1458.333 (variance); SE = sqrt(1458.333/3) = 22.048.
        "avg": (41.6667, 22.0479),
        # pass@4: 100, 0, 100 -> 66.667; deviations 33.3, -66.7, 33.3 -> variance 3333.33; SE = sqrt(1111.11) = 33.333.
        "pass_at_k": (66.6667, 33.3333),
        # maj@4: 100, 0, 0 -> 33.333; same spread as pass@4 -> SE 33.333.
        "maj": (33.3333, 33.3333),
        # format: 100, 50, 100 -> 83.333; deviations 16.7, -33.3, 16.7 -> variance 833.33; SE = sqrt(277.78) = 16.667.
        "format_rate": (83.3333, 16.6667),
        # truncation: 0, 50, 0 -> 16.667; same spread -> SE 16.667.
        "truncation_rate": (16.6667, 16.6667),
        # tokens: 250, 1000, 50 -> 433.333; deviations -183.3, 566.7, -383.3; squares sum 501666.7;
        # variance 250833.3; SE = sqrt(83611.1) = 289.156.
        "mean_tokens": (433.3333, 289.156),
    }
    for key, (mean, se) in expected.items():
        assert s[key] == pytest.approx(mean, abs=1e-3), key
        assert s[f"{key}_se"] == pytest.approx(se, abs=1e-3), key

    rows = {r["id"]: r for r in s["problems"]}
    assert [rows[p]["n_correct"] for p in ("p1", "p2", "p3")] == [3, 0, 2]
    assert [rows[p]["accuracy"] for p in ("p1", "p2", "p3")] == [0.75, 0.0, 0.5]
    assert [rows[p]["pass_at_k"] for p in ("p1", "p2", "p3")] == [1.0, 0.0, 1.0]
    assert [rows[p]["maj"] for p in ("p1", "p2", "p3")] == [True, False, False]
    assert all(r["n"] == 4 for r in s["problems"])
    assert per_problem_accuracy(s) == {"p1": 0.75, "p2": 0.0, "p3": 0.5}
    line = format_summary(s)
    assert line.startswith("avg@4 41.67 ± 22.05 | pass@4 66.67 ± 33.33 | maj@4 33.33 ± 33.33")


def test_summarize_pass_at_2() -> None:
    # pass@2 per problem: p1 (c=3): 1; p2: 0; p3 (c=2): 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6.
    # Mean = (1 + 0 + 5/6)/3 = 11/18 -> 61.111%. Values 100, 0, 83.333 -> deviations 38.889, -61.111, 22.222;
    # squares 1512.35 + 3734.57 + 493.83 = 5740.74; variance 2870.37; SE = sqrt(956.79) = 30.932.
    s = summarize(tiny_eval(), k=2)
    assert s["labels"]["pass_at_k"] == "pass@2"
    assert s["pass_at_k"] == pytest.approx(61.1111, abs=1e-3)
    assert s["pass_at_k_se"] == pytest.approx(30.932, abs=1e-3)
    # avg and maj do not depend on k.
    assert s["avg"] == pytest.approx(41.6667, abs=1e-3)


def test_summarize_single_problem_has_no_se() -> None:
    s = summarize({"only": [sample(True, "1"), sample(False, "2")]})
    assert s["avg"] == 50.0
    assert s["avg_se"] is None and s["mean_tokens_se"] is None
    assert "±" not in format_summary(s).split("|")[0]


def test_summarize_errors() -> None:
    with pytest.raises(ValueError, match="different numbers of samples"):
        summarize({"a": [sample(True, "1")] * 4, "b": [sample(True, "1")] * 3})
    with pytest.raises(ValueError, match="n == 0"):
        summarize({"a": [], "b": []})
    with pytest.raises(ValueError, match="no problems"):
        summarize({})
    with pytest.raises(ValueError, match="k must satisfy"):
        summarize(tiny_eval(), k=5)
    with pytest.raises(ValueError, match="k must satisfy"):
        summarize(tiny_eval(), k=0)
    with pytest.raises(KeyError, match="n_tokens"):
        summarize({"a": [{"correct": True, "extracted": "1", "has_box": True, "truncated": False}]})


# --- paired comparison ---------------------------------------------------------------------------


def test_paired_compare_hand_computed(caplog: pytest.LogCaptureFixture) -> None:
    from opsd.evaluation.metrics import paired_compare

    a = {"p1": 0.5, "p2": 0.25, "p3": 1.0, "p4": 0.0}
    b = {"p1": 0.75, "p2": 0.25, "p3": 0.75, "p4": 0.5, "p5": 1.0}  # p5 only in b: warned, ignored
    with caplog.at_level(logging.WARNING, logger="opsd.evaluation.metrics"):
        r = paired_compare(a, b)
    assert "problem sets differ" in caplog.text
    # Differences (points): 25, 0, -25, 50 -> mean 12.5. Deviations 12.5, -12.5, -37.5, 37.5;
    # squares 156.25 + 156.25 + 1406.25 + 1406.25 = 3125; variance 3125/3 = 1041.667;
    # SE = sqrt(1041.667/4) = 16.1374. t_{0.975,3} = 3.182446 -> half-width 51.356.
    assert r["n_problems"] == 4
    assert r["df"] == 3
    assert r["mean_a"] == pytest.approx(43.75)
    assert r["mean_b"] == pytest.approx(56.25)
    assert r["mean_diff"] == pytest.approx(12.5)
    assert r["se"] == pytest.approx(16.1374, abs=1e-4)
    assert r["t_crit"] == pytest.approx(3.182446, abs=1e-5)
    assert r["ci_low"] == pytest.approx(12.5 - 51.3559, abs=1e-3)
    assert r["ci_high"] == pytest.approx(12.5 + 51.3559, abs=1e-3)


def test_paired_compare_errors_and_single_problem() -> None:
    from opsd.evaluation.metrics import paired_compare

    with pytest.raises(ValueError, match="share no problem"):
        paired_compare({"a": 0.5}, {"b": 0.5})
    with pytest.raises(ValueError, match="outside"):
        paired_compare({"a": 50.0}, {"a": 0.5})  # percent passed where fractions are expected
    r = paired_compare({"a": 0.25}, {"a": 0.75})
    assert r["mean_diff"] == pytest.approx(50.0)
    assert r["se"] is None and r["ci_low"] is None and r["t_crit"] is None


def test_t_critical_values() -> None:
    # Reference values of t_{0.975, df} to 6 decimals (computed with mpmath, typed in by hand).
    reference = {1: 12.706205, 2: 4.302653, 3: 3.182446, 10: 2.228139, 11: 2.200985, 29: 2.045230,
                 30: 2.042272, 40: 2.021075, 100: 1.983972, 1000: 1.962339}  # fmt: skip
    for df, t in reference.items():
        assert t_critical_975(df) == pytest.approx(t, abs=2e-6)
    with pytest.raises(ValueError, match="df >= 1"):
        t_critical_975(0)


# --- across runs ---------------------------------------------------------------------------------


def test_aggregate_runs_hand_computed() -> None:
    # Mean (56.94 + 53.06 + 56.11)/3 = 166.11/3 = 55.37. Deviations 1.57, -2.31, 0.74;
    # squares 2.4649 + 5.3361 + 0.5476 = 8.3486; variance 4.1743; SE = sqrt(4.1743/3) = 1.17959.
    r = aggregate_runs([56.94, 53.06, 56.11])
    assert r["mean"] == pytest.approx(55.37)
    assert r["se"] == pytest.approx(1.17959, abs=1e-5)
    assert (r["min"], r["max"], r["n"]) == (53.06, 56.94, 3)
    assert r["note"] is None


def test_aggregate_single_run_and_empty() -> None:
    r = aggregate_runs([54.22])
    assert r["mean"] == 54.22 and r["se"] is None and r["n"] == 1
    assert "single run" in r["note"]
    with pytest.raises(ValueError):
        aggregate_runs([])


def test_standard_error_matches_formula() -> None:
    values = [0.75, 0.0, 0.5]
    m = sum(values) / 3
    expected = math.sqrt(sum((v - m) ** 2 for v in values) / 2) / math.sqrt(3)
    assert standard_error(values) == pytest.approx(expected)
    assert standard_error([1.0]) is None


# --- pass@k curves and the macro average over benchmarks ---------------------------------------------------------


def test_pass_at_k_curve_hand_computed() -> None:
    # Three problems with 4 samples: c = 0, 2, 4 correct. Per problem, pass@k = 1 - C(4-c, k) / C(4, k):
    #   c = 0: 0 for every k (no correct sample);  c = 4: 1 for every k;
    #   c = 2: k=1 2/4 = 0.5, k=2 1 - 1/6 = 5/6, k=3 and k=4 1 (fewer than k wrong samples).
    curve = pass_at_k_curve([0, 2, 4], 4)
    assert [p["k"] for p in curve] == [1, 2, 3, 4]
    expected = [(0 + 0.5 + 1) / 3, (0 + 5 / 6 + 1) / 3, 2 / 3, 2 / 3]
    assert [p["value"] for p in curve] == pytest.approx([100 * v for v in expected])
    # SE over problems: k=1 values 0, 0.5, 1: sd 0.5, SE 0.5 / sqrt(3); k = n values 0, 1, 1: sd sqrt(1/3), SE 1/3.
    assert curve[0]["se"] == pytest.approx(100 * 0.5 / math.sqrt(3))
    assert curve[3]["se"] == pytest.approx(100 / 3)
    # k = n is the share of problems with any correct sample; pass@1 is avg@n.
    assert curve[-1]["value"] == pytest.approx(100 * 2 / 3)
    rows = {f"p{c}": [sample(i < c, "1" if i < c else "2") for i in range(4)] for c in (0, 2, 4)}
    summary = summarize(rows)
    assert summary["pass_at_k_curve"] == curve and summary["avg"] == pytest.approx(curve[0]["value"])


def test_pass_at_k_curve_with_no_correct_sample_and_one_problem() -> None:
    assert [p["value"] for p in pass_at_k_curve([0, 0], 3)] == [0.0, 0.0, 0.0]
    one = pass_at_k_curve([1], 2)
    assert [p["value"] for p in one] == pytest.approx([50.0, 100.0]) and [p["se"] for p in one] == [
        None,
        None,
    ]
    with pytest.raises(ValueError):
        pass_at_k_curve([], 4)


def test_macro_average_se_hand_computed() -> None:
    # Two independent benchmarks: 50 ± 3 and 20 ± 4. Mean 35; Var = (9 + 16) / 2^2, SE = 5 / 2 = 2.5.
    assert macro_average([(50.0, 3.0), (20.0, 4.0)]) == {"n_benchmarks": 2, "value": 35.0, "se": 2.5}
    # Three: 60 ± 1, 30 ± 2, 0 ± 2: mean 30, SE sqrt(1 + 4 + 4) / 3 = 1.
    assert macro_average([(60.0, 1.0), (30.0, 2.0), (0.0, 2.0)])["se"] == pytest.approx(1.0)
    assert macro_average([(50.0, 3.0), (20.0, None)])["se"] is None  # a benchmark of one problem
    assert macro_average([(42.0, 1.5)]) == {"n_benchmarks": 1, "value": 42.0, "se": 1.5}
    with pytest.raises(ValueError):
        macro_average([])


def test_macro_paired_difference_hand_computed() -> None:
    a = {"mean_a": 30.0, "mean_b": 40.0, "mean_diff": 10.0, "se": 2.0, "df": 9}
    b = {"mean_a": 50.0, "mean_b": 48.0, "mean_diff": -2.0, "se": 2.0, "df": 9}
    m = macro_paired([a, b])
    # Mean difference (10 - 2) / 2 = 4; SE sqrt(4 + 4) / 2 = sqrt(2). Welch-Satterthwaite:
    # df = (4 + 4)^2 / (16/9 + 16/9) = 64 / (32/9) = 18; t_{0.975, 18} = 2.100922 (a t table).
    assert (m["mean_a"], m["mean_b"], m["mean_diff"]) == (40.0, 44.0, 4.0)
    assert m["se"] == pytest.approx(math.sqrt(2)) and m["df"] == pytest.approx(18.0)
    assert m["t_crit"] == pytest.approx(2.100922, abs=1e-6)
    assert (m["ci_low"], m["ci_high"]) == pytest.approx(
        (4 - 2.100922 * math.sqrt(2), 4 + 2.100922 * math.sqrt(2))
    )
    # One benchmark: its own difference, df and interval.
    one = macro_paired([a])
    assert (one["mean_diff"], one["se"], one["df"]) == pytest.approx((10.0, 2.0, 9.0))
    assert one["ci_low"] == pytest.approx(10 - 2.262157 * 2, abs=1e-5)  # t_{0.975, 9} = 2.262157
    # No SE where a benchmark has none; SE 0 gives the point as its interval.
    assert macro_paired([a, {**b, "se": None}])["ci_low"] is None
    zero = macro_paired([{**a, "se": 0.0}, {**b, "se": 0.0}])
    assert zero["se"] == 0.0 and zero["ci_low"] == zero["ci_high"] == 4.0 and zero["df"] is None
