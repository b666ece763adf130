"""The wrong hint c~ of the contrastive teacher: `teacher_contrast` (docs/method.md §1.10).

The contrastive target compares the teacher under its reference c with the same teacher under a wrong hint c~ in
the identical template, so that what both hints change alike (the style of a hinted model) cancels. c~ is one
column of the trainer's table (`contrast_context`), made at load time beside `privileged_context`:

- `shuffled`: another problem's reference, by a fixed derangement of the table drawn from the run's `seed` (its own
  stream, not the one of `teacher_ref_pairing=shuffled`) that never pairs two rows with the same `Answer`.
- `wrong_answer`: the problem's own reference with its final answer replaced by another value of the same kind
  (`wrong_reference`). Rows whose answer cannot be replaced keep c~ = c, which gives them no signal; they are
  counted and logged, and a table where no row can be replaced is refused.

The column is built from each row's own reference and answer, before the teacher pairing: a shuffled pairing
then moves c and c~ together, so a teacher reading another problem's reference is contrasted with that
reference's wrong version.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Sequence
from typing import Any

from opsd.errors import InvalidValue
from opsd.grading import box_spans
from opsd.method.pairing import answer_groups, derangement

logger = logging.getLogger(__name__)

_INTEGER = re.compile(r"-?\d+")
_DECIMAL = re.compile(r"-?\d+\.\d+")
_SLASH_FRACTION = re.compile(r"(-?)(\d+)/(\d+)")
_TEX_FRACTION = re.compile(r"(-?)\\([dt]?frac)\{(\d+)\}\{(\d+)\}")
# A number inside other digits, a decimal point or a fraction bar is not a standalone occurrence of it.
_NOT_BEFORE = r"(?<![\d.\w/])"
_NOT_AFTER = r"(?![\d\w/]|\.\d)"


def _offset(rng: random.Random) -> int:
    return rng.choice((-1, 1)) * rng.randint(1, 9)


def wrong_value(answer: str, rng: random.Random) -> str | None:
    """Another value of the same kind as `answer` (an integer, a decimal, a fraction a/b or \\frac{a}{b}), drawn
    from `rng`; None for any other kind (an expression, a tuple, text), which cannot be replaced in kind."""
    text = answer.strip()
    if _INTEGER.fullmatch(text):
        n = int(text)
        other = n + _offset(rng)
        if n >= 0 and other < 0:  # a count stays a count
            other = n + abs(other - n)
        return str(other)
    if _DECIMAL.fullmatch(text):
        places = len(text.split(".")[1])
        return f"{float(text) + _offset(rng):.{places}f}"
    for pattern, numerator in ((_SLASH_FRACTION, 2), (_TEX_FRACTION, 3)):
        m = pattern.fullmatch(text)
        if m:
            a = int(m.group(numerator))
            other = a + _offset(rng)
            if other <= 0:
                other = a + abs(other - a)
            return text[: m.start(numerator)] + str(other) + text[m.end(numerator) :]
    return None


def wrong_reference(reference: str, answer: str, rng: random.Random) -> str | None:
    """`reference` with its final answer replaced by another value of the same kind (`wrong_value`), or None.

    The final answer is where the reference states it: every complete box whose content is the answer; in a
    reference without such a box, the last standalone occurrence of the answer (not inside a longer number).
    The rest of the text is left as it is, so c and c~ differ only there. None when the answer cannot be
    replaced in kind or does not occur."""
    gold = str(answer).strip()
    other = wrong_value(gold, rng) if gold else None
    if other is None:
        return None
    spans = [s for s in box_spans(reference) if s is not None and reference[slice(*s)] == gold]
    if not spans:
        pattern = re.compile(_NOT_BEFORE + re.escape(gold) + _NOT_AFTER)
        found = list(pattern.finditer(reference))
        if not found:
            return None
        spans = [found[-1].span()]
    out, last = [], 0
    for start, end in spans:
        out += [reference[last:start], other]
        last = end
    return "".join(out) + reference[last:]


def contrast_references(
    references: Sequence[str], answers: Sequence[Any], mode: str, *, seed: int
) -> tuple[list[str], dict[str, Any]]:
    """The wrong hint of each row (from its own reference and answer) and a summary to log: (c~ per row, record).

    Raises InvalidValue when `wrong_answer` can replace no row's answer, or `shuffled` cannot pair rows."""
    n = len(references)
    if mode == "shuffled":
        perm = derangement(n, seed, answer_groups(answers), switch="teacher_contrast")
        return [references[j] for j in perm], {"teacher_contrast": mode, "rows": n}
    wrong, unreplaced = [], []
    for i, (ref, ans) in enumerate(zip(references, answers, strict=True)):
        rng = random.Random(f"wrong_answer:{seed}:{i}")
        w = wrong_reference(ref, "" if ans is None else str(ans), rng)
        if w is None:
            unreplaced.append(i)
        wrong.append(ref if w is None else w)
    if len(unreplaced) == n:
        shown = str(answers[0])[:40] if n else ""
        raise InvalidValue(
            f"teacher_contrast=wrong_answer could replace the final answer in none of the {n} references (an "
            f"integer, a decimal or a fraction stated in the reference is needed; e.g. Answer {shown!r}); use "
            "teacher_contrast=shuffled, or data whose Answer column holds such values"
        )
    record = {"teacher_contrast": mode, "rows": n, "unreplaced_rows": len(unreplaced)}
    if unreplaced:
        logger.warning(
            "teacher_contrast=wrong_answer: %d of %d rows keep their own reference as the wrong hint (their "
            "answer is not a number or fraction stated in the reference), so they add no contrastive signal",
            len(unreplaced),
            n,
        )
    first = next(i for i in range(n) if i not in set(unreplaced))
    logger.info(
        "teacher_contrast=wrong_answer: e.g. answer %r -> reference ending %r",
        str(answers[first]),
        wrong[first][-120:],
    )
    return wrong, record
