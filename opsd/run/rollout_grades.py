"""Whether a run's rollouts are correct: `rollout/correct`, `rollout/boxed`, `rollout/length` at every generation.

Each rollout is graded against its problem's `answer` with the grader `eval_aime.py` scores samples with
(`opsd.grading.grade`: the last complete box of the answer region, math-verify then the string fallback), in
a background thread, so the step's GPU work goes on meanwhile: the grades are collected at the end of the
optimizer step whose generation produced them and reduced over processes there.

- `rollout/correct`: share of graded rollouts whose answer is correct (rows with an empty answer are not graded;
  without any graded row the metric is left out);
- `rollout/boxed`: share of rollouts with a complete, non-empty box in their answer region (the format criterion
  of the evaluation);
- `rollout/length`: mean completion length in tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from opsd.grading import extract_boxed, grade

ROLLOUT_KEYS = ("rollout/correct", "rollout/boxed", "rollout/length")
# Each math-verify call gets this long (the evaluation's default), in the grader's worker process.
GRADE_TIMEOUT_S = 5.0


def grade_sums(texts: Sequence[str], answers: Sequence[str], lengths: Sequence[int]) -> list[float]:
    """[correct, graded, boxed, rows, tokens]: the sums that `metrics` turns into the rollout metrics."""
    correct = graded = boxed = 0
    for text, answer in zip(texts, answers, strict=True):
        answer = (answer or "").strip()
        if not answer:
            boxed += extract_boxed(text) is not None
            continue
        result = grade(text, answer, timeout_s=GRADE_TIMEOUT_S)
        graded += 1
        correct += result["correct"]
        boxed += result["has_box"]
    return [float(correct), float(graded), float(boxed), float(len(texts)), float(sum(lengths))]


def metrics(sums: Sequence[float]) -> dict[str, float]:
    """The rollout metrics from (reduced) `grade_sums`."""
    correct, graded, boxed, rows, tokens = sums
    out = {"rollout/boxed": boxed / max(rows, 1.0), "rollout/length": tokens / max(rows, 1.0)}
    if graded:
        out["rollout/correct"] = correct / graded
    return out


class RolloutGrader:
    """Grades one generation's rollouts in a background thread (`submit`); `collect` waits for them, reduces the
    sums over processes with `reduce` (a collective: every process calls it at the same step) and returns the
    metrics."""

    def __init__(
        self, decode: Callable[[list[list[int]]], list[str]], reduce: Callable[[torch.Tensor], torch.Tensor]
    ):
        self.decode, self.reduce = decode, reduce
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="opsd-grade")
        self.pending: Future | None = None

    def submit(self, completion_ids: list[list[int]], answers: Sequence[str]) -> None:
        def work() -> list[float]:
            return grade_sums(self.decode(completion_ids), answers, [len(c) for c in completion_ids])

        self.pending = self.pool.submit(work)

    def collect(self, device: torch.device) -> dict[str, float] | None:
        """The pending generation's metrics over all processes, or None when none is pending."""
        if self.pending is None:
            return None
        sums = self.pending.result()
        self.pending = None
        return metrics(self.reduce(torch.tensor(sums, dtype=torch.float64, device=device)).tolist())
