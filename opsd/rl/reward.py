"""The reward of a GRPO rollout: the grader `eval_aime.py` scores samples with (`opsd.grading.grade`: the last
complete box of the answer region, math-verify then the string fallback), 1.0 for a correct answer, else 0.0.

A row whose problem has no answer gets `None`, which TRL reads as unscorable (no advantage, left out of its group's
baseline). The reward also keeps the sums of its last call, from which the trainer logs `rollout/correct`,
`rollout/boxed` and `rollout/length` as OPSD's rollout grader does (`opsd.run.step_watch.metrics`).
"""

from __future__ import annotations

from collections.abc import Sequence

from opsd.grading import extract_boxed, grade
from opsd.run.step_watch import GRADE_TIMEOUT_S


def correct_answer_rewards(texts: Sequence[str], answers: Sequence[str]) -> list[float | None]:
    """1.0 / 0.0 per completion by the evaluation's grader; None where the answer is empty."""
    out: list[float | None] = []
    for text, answer in zip(texts, answers, strict=True):
        answer = str(answer or "").strip()
        out.append(float(grade(text, answer, timeout_s=GRADE_TIMEOUT_S)["correct"]) if answer else None)
    return out


class CorrectAnswer:
    """TRL reward function (`reward_funcs=[CorrectAnswer()]`, logged by TRL as `rewards/correct/*`)."""

    __name__ = "correct"

    def __init__(self):
        # [correct, graded, boxed, rows, tokens] of the last call: opsd.run.step_watch.metrics' sums
        self.sums: list[float] | None = None
        # The last call's completions and rewards, in order (`teacher_contrast=own_wrong` picks hints from them).
        self.last: tuple[list[str], list[float | None]] | None = None

    def __call__(self, prompts, completions, completion_ids, answer=None, **kwargs) -> list[float | None]:
        answers = answer if answer is not None else [""] * len(completions)
        rewards = correct_answer_rewards(completions, answers)
        graded = [r for r in rewards if r is not None]
        boxed = sum(extract_boxed(text) is not None for text in completions)
        tokens = sum(len(ids) for ids in completion_ids)
        self.sums = [
            float(sum(graded)),
            float(len(graded)),
            float(boxed),
            float(len(completions)),
            float(tokens),
        ]
        self.last = (list(completions), rewards)
        return rewards
