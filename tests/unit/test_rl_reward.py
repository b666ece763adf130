"""The GRPO reward is the evaluation's grader: hand-graded completions in each answer style, and the sums the
trainer's rollout metrics come from."""

import pytest

from opsd.grading import grade
from opsd.rl.reward import CorrectAnswer, correct_answer_rewards

pytestmark = pytest.mark.unit

# (completion, gold answer, correct by hand)
CASES = [
    ("So the sum is \\boxed{7}.", "7", True),
    ("So the sum is \\boxed{8}.", "7", False),
    ("The answer is 7.", "7", False),  # no box: not an answer under the protocol
    ("First \\boxed{3}, then correcting: \\boxed{7}", "7", True),  # the last box counts
    ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{x = 5}", "5", True),
    ("\\boxed{120 \\text{ km}}", "120", True),
    ("\\boxed{(1, 2)}", "(2, 1)", False),
    ("\\boxed{}", "0", False),
    ("\\boxed{-12}", "-12", True),
]


@pytest.mark.parametrize(("text", "gold", "expected"), CASES)
def test_reward_is_the_graders_verdict(text, gold, expected):
    assert correct_answer_rewards([text], [gold]) == [float(expected)]
    assert grade(text, gold)["correct"] == expected


def test_rows_without_an_answer_are_unscorable_and_the_sums_match():
    reward = CorrectAnswer()
    completions = ["\\boxed{7}", "no box here", "\\boxed{1}"]
    out = reward(
        prompts=["p"] * 3,
        completions=completions,
        completion_ids=[[1, 2], [3], [4, 5, 6]],
        answer=["7", "7", ""],
    )
    assert out == [1.0, 0.0, None]
    assert reward.sums == [1.0, 2.0, 2.0, 3.0, 6.0]  # correct, graded, boxed, rows, tokens
    assert reward.__name__ == "correct"
