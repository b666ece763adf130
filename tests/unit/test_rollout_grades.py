"""Rollout correctness (`opsd.run.step_watch`) against rows graded by hand, and the curves that draw it."""

import pytest
import torch

from opsd.run.step_watch import RolloutGrader, grade_sums, metrics

# (completion text, gold answer, correct, boxed), each verdict decided by hand.
HAND_GRADED = [
    ("so 3 + 4 = 7. \\boxed{7}", "7", True, True),
    ("the answer is \\boxed{8}", "7", False, True),
    ("I think it is 7", "7", False, False),
    ("\\boxed{\\frac{1}{2}}", "0.5", True, True),
    ("<think>maybe \\boxed{3}</think> The answer is \\boxed{4}.", "4", True, True),
    ("<think>cut off while thinking \\boxed{4}", "4", False, False),
    ("\\boxed{12} and later \\boxed{13", "12", True, True),
    ("x = \\boxed{1,000}", "1000", True, True),
    ("\\boxed{5}", "", None, True),  # no gold answer: not graded, still counted for the format
]


def test_grade_sums_match_hand_graded_rows():
    texts, answers = [r[0] for r in HAND_GRADED], [r[1] for r in HAND_GRADED]
    lengths = list(range(3, 3 + len(texts)))
    correct, graded, boxed, rows, tokens = grade_sums(texts, answers, lengths)
    assert correct == sum(r[2] is True for r in HAND_GRADED) == 5
    assert graded == sum(r[2] is not None for r in HAND_GRADED) == 8
    assert boxed == sum(r[3] for r in HAND_GRADED) == 7
    assert (rows, tokens) == (len(texts), sum(lengths))
    got = metrics([correct, graded, boxed, rows, tokens])
    assert got == pytest.approx(
        {"rollout/correct": 5 / 8, "rollout/boxed": 7 / 9, "rollout/length": tokens / 9}
    )


def test_each_hand_graded_row_alone():
    for text, gold, correct, boxed in HAND_GRADED:
        got = metrics(grade_sums([text], [gold], [1]))
        assert got["rollout/boxed"] == float(boxed), text
        if correct is None:
            assert "rollout/correct" not in got  # nothing to grade against: left out, not counted as wrong
        else:
            assert got["rollout/correct"] == float(correct), text


def test_grader_runs_in_the_background_and_reduces_over_processes():
    reduced = []

    def reduce(t):
        reduced.append(t.clone())
        return t * 2  # as if a second process had the same rows

    grader = RolloutGrader(
        decode=lambda ids: ["\\boxed{" + "".join(map(str, x)) + "}" for x in ids], reduce=reduce
    )
    assert grader.collect(torch.device("cpu")) is None  # nothing pending
    grader.submit([[4, 2], [7]], ["42", "8"])
    got = grader.collect(torch.device("cpu"))
    assert reduced[0].tolist() == [1.0, 2.0, 2.0, 2.0, 3.0]
    assert got == pytest.approx({"rollout/correct": 0.5, "rollout/boxed": 1.0, "rollout/length": 1.5})
    assert grader.collect(torch.device("cpu")) is None  # collected once


def test_the_run_curves_draw_rollout_correctness(tmp_path):
    from opsd.run.curves import training_curves

    metrics_by_key = {"loss": [(1, 0.5), (2, 0.4)], "rollout/correct": [(1, 0.1), (2, 0.3)]}
    titles = training_curves({"run": metrics_by_key}, tmp_path / "c.png")
    assert titles == ["loss", "rollout correctness (graded like the evaluation)"]


def test_the_curves_draw_the_compute_ledger(tmp_path):
    """A run's ledger/* metrics (every method logs them) get their own panel, one line per token kind."""
    from opsd.run.curves import training_curves

    metrics = {
        "loss": [(1, 0.5), (2, 0.4)],
        "ledger/generated_tokens": [(1, 3178.0), (2, 3201.0)],
        "ledger/teacher_tokens": [(1, 0.0), (2, 0.0)],
    }
    titles = training_curves({"run": metrics}, tmp_path / "c.png")
    assert titles == ["loss", "tokens per step (compute ledger)"] and (tmp_path / "c.png").stat().st_size > 0
