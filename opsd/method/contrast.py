"""The wrong hint c~ of the contrastive teacher: `teacher_contrast` (docs/method.md §1.10).

The contrastive target compares the teacher under its reference c with the same teacher under a wrong hint c~ in
the identical template, so that what both hints change alike (the style of a hinted model) cancels. c~ is one
column of the trainer's table (`contrast_context`), made at load time beside `privileged_context`:

- `shuffled`: another problem's reference, by a fixed derangement of the table drawn from the run's `seed` (its own
  stream, not the one of `teacher_ref_pairing=shuffled`) that never pairs two rows whose `Answer` has the same
  value by the grader's equivalence (`opsd.method.pairing.answer_groups`: `3.5` is `3.50`, `0.5` is `1/2`).
- `wrong_answer`: the problem's own reference with its final answer replaced by another value of the same kind
  (`wrong_reference`). Rows whose answer cannot be replaced keep c~ = c, which gives them no signal; they are
  counted and logged, and a table where no row can be replaced is refused. A reference cut by
  `teacher_ref_max_chars` before its boxed answer is such a row. Results stated as the answer's value (`= 14`)
  are replaced with it; wrong hints that still mention that value elsewhere are counted and logged. It is
  refused with `teacher_ref_fraction` < 1 (the cut would most often remove the answer from both hints:
  opsd.configuration.checks.check_teacher_variants).

The column is built from each row's own reference and answer, before the teacher pairing: a shuffled pairing
then moves c and c~ together, so a teacher reading another problem's reference is contrasted with that
reference's wrong version.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from typing import Any

from opsd.errors import InvalidValue
from opsd.grading import box_spans, exact_value
from opsd.method.pairing import answer_groups, derangement
from opsd.method.prompts import TRUNCATION_MARK

logger = logging.getLogger(__name__)

_INTEGER = re.compile(r"-?\d+")
_DECIMAL = re.compile(r"-?\d+\.\d+")
_SLASH_FRACTION = re.compile(r"(-?)(\d+)/(\d+)")
_TEX_FRACTION = re.compile(r"(-?)\\([dt]?frac)\{(\d+)\}\{(\d+)\}")
# A number inside other digits, a decimal point or a fraction bar is not a standalone occurrence of it.
_NOT_BEFORE = r"(?<![\d.\w/])"
_NOT_AFTER = r"(?![\d\w/]|\.\d)"
# What precedes a number stated as a result: an equals sign, then spaces or a `$`.
_RESULT = re.compile(r"(?<![<>!=])=[\s$]*\Z")
# A standalone number as a reference writes it: `\frac{a}{b}`, `a/b`, a decimal, an integer (`1,000` too).
_MENTION = re.compile(
    _NOT_BEFORE + r"(?P<sign>-)?(?:\\[dt]?frac\{(?P<num>\d+)\}\{(?P<den>\d+)\}"
    r"|(?P<int>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<dec>\d+))?(?:/(?P<bar>\d+))?)" + _NOT_AFTER
)


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
        d = Decimal(text)
        other = d + _offset(rng)
        if d >= 0 and other < 0:  # a non-negative value stays non-negative, as an integer does
            other = d + abs(other - d)
        return f"{other:.{places}f}"
    for pattern, numerator in ((_SLASH_FRACTION, 2), (_TEX_FRACTION, 3)):
        m = pattern.fullmatch(text)
        if m:
            a = int(m.group(numerator))
            other = a + _offset(rng)
            if other <= 0:
                other = a + abs(other - a)
            return text[: m.start(numerator)] + str(other) + text[m.end(numerator) :]
    return None


def lost_final_answer(reference: str, answer: str) -> bool:
    """Whether `reference` was cut to `teacher_ref_max_chars` (it ends with the truncation mark) before any complete
    box stating `answer`: the final answer is then gone, whatever numbers remain in the text."""
    if not reference.endswith(TRUNCATION_MARK):
        return False
    gold = str(answer).strip()
    return not any(s is not None and reference[slice(*s)] == gold for s in box_spans(reference))


def answer_mentions(text: str, answer: str, *, results_only: bool = False) -> list[tuple[int, int]]:
    """The spans of the standalone numbers in `text` (integers, with or without thousands separators, decimals,
    `a/b`, `\\frac{a}{b}`) whose value is `answer`'s (none for an answer that is no such number). With
    `results_only`, only those stated as a result: right after an `=` (`x = 28 / 2 = 14`)."""
    gold = exact_value(str(answer))
    if gold is None:
        return []
    found = []
    for m in _MENTION.finditer(text):
        if _mention_value(m) == gold and (
            not results_only or _RESULT.search(text, max(m.start() - 16, 0), m.start())
        ):
            found.append(m.span())
    return found


def _mention_value(m: re.Match) -> Fraction:
    sign = -1 if m.group("sign") else 1
    if m.group("num") is not None:
        return sign * Fraction(int(m.group("num")), max(int(m.group("den")), 1))
    value = Fraction(m.group("int").replace(",", "") + (f".{m.group('dec')}" if m.group("dec") else ""))
    if m.group("bar") is not None:
        value /= max(int(m.group("bar")), 1)
    return sign * value


def wrong_reference(reference: str, answer: str, rng: random.Random) -> str | None:
    """`reference` with its final answer replaced by another value of the same kind (`wrong_value`), or None.

    The final answer is where the reference states it: every complete box whose content is the answer; in a
    reference without such a box, the last standalone occurrence of the answer (not inside a longer number).
    Every result stated as the answer's value (`= 14`, `= 14.0`: `answer_mentions`) is replaced too, so the wrong
    hint does not give the true answer one line above its box. Other occurrences of the value (an operand, a
    count in prose) are left as they are: they may be unrelated numbers that happen to be equal, and they are
    counted by `contrast_references`. None when the answer cannot be replaced in kind or does not occur, and
    when the reference was cut (`teacher_ref_max_chars`: it ends with the truncation mark) before any box
    stating it: its last occurrence is then a number in mid-text, not the final answer, which was cut off."""
    gold = str(answer).strip()
    other = wrong_value(gold, rng) if gold else None
    if other is None:
        return None
    spans = [s for s in box_spans(reference) if s is not None and reference[slice(*s)] == gold]
    if not spans:
        if lost_final_answer(reference, gold):
            return None
        pattern = re.compile(_NOT_BEFORE + re.escape(gold) + _NOT_AFTER)
        found = list(pattern.finditer(reference))
        if not found:
            return None
        spans = [found[-1].span()]
    out, last = [], 0
    for start, end in sorted(set(spans) | set(answer_mentions(reference, gold, results_only=True))):
        if start < last:  # inside a span already replaced
            continue
        out += [reference[last:start], other]
        last = end
    return "".join(out) + reference[last:]


def contrast_references(
    references: Sequence[str], answers: Sequence[Any], mode: str, *, seed: int
) -> tuple[list[str], dict[str, Any]]:
    """The wrong hint of each row (from its own reference and answer) and a summary to log: (c~ per row, record).

    For `wrong_answer` the record counts the rows left without a wrong hint (`unreplaced_rows`; of them,
    `answer_cut_off_rows` lost their final answer to `teacher_ref_max_chars`) and the wrong hints that still
    mention the true answer's value elsewhere in the text (`hints_mentioning_answer`: the edit replaces the
    final answer and the results equal to it, not an operand or a number in prose that equals it), each logged
    as a warning when not zero.

    Raises InvalidValue when `wrong_answer` can replace no row's answer, or `shuffled` cannot pair rows."""
    if mode not in ("shuffled", "wrong_answer"):
        raise ValueError(f"contrast_references makes the hints of shuffled and wrong_answer, not {mode!r}")
    n = len(references)
    if mode == "shuffled":
        perm = derangement(n, seed, answer_groups(answers), switch="teacher_contrast")
        return [references[j] for j in perm], {"teacher_contrast": mode, "rows": n}
    wrong, unreplaced, cut_off, mentioning = [], [], 0, 0
    for i, (ref, ans) in enumerate(zip(references, answers, strict=True)):
        rng = random.Random(f"wrong_answer:{seed}:{i}")
        gold = "" if ans is None else str(ans)
        w = wrong_reference(ref, gold, rng)
        if w is None:
            unreplaced.append(i)
            cut_off += bool(gold.strip()) and lost_final_answer(ref, gold)
        elif answer_mentions(w, gold):
            mentioning += 1
        wrong.append(ref if w is None else w)
    record = {
        "teacher_contrast": mode,
        "rows": n,
        "unreplaced_rows": len(unreplaced),
        "answer_cut_off_rows": cut_off,
        "hints_mentioning_answer": mentioning,
    }
    _report_wrong_answers(record, answers)
    skipped = set(unreplaced)
    first = next(i for i in range(n) if i not in skipped)
    logger.info(
        "teacher_contrast=wrong_answer: e.g. answer %r -> reference ending %r",
        str(answers[first]),
        wrong[first][-120:],
    )
    return wrong, record


def _report_wrong_answers(record: dict, answers: Sequence[Any]) -> None:
    """Refuse a table where no answer could be replaced; warn about the rows left without a wrong hint and the
    hints that still mention the answer."""
    n, unreplaced, mentioning = record["rows"], record["unreplaced_rows"], record["hints_mentioning_answer"]
    if unreplaced == n:
        shown = str(answers[0])[:40] if n else ""
        raise InvalidValue(
            f"teacher_contrast=wrong_answer could replace the final answer in none of the {n} references (an "
            f"integer, a decimal or a fraction stated in the reference is needed, and a reference cut by "
            f"teacher_ref_max_chars must keep its boxed answer; e.g. Answer {shown!r}); use "
            "teacher_contrast=shuffled, a larger teacher_ref_max_chars, or data whose Answer column holds such values"
        )
    if unreplaced:
        logger.warning(
            "teacher_contrast=wrong_answer: %d of %d rows keep their own reference as the wrong hint (%d lost their "
            "final answer to teacher_ref_max_chars; the others' answer is not a number or fraction stated in the "
            "reference), so they add no contrastive signal",
            unreplaced,
            n,
            record["answer_cut_off_rows"],
        )
    if mentioning:
        logger.warning(
            "teacher_contrast=wrong_answer: %d of %d wrong hints still mention the true answer's value outside the "
            "replaced answer and results (an operand or a number in prose equal to it), so c~ does not hide it "
            "entirely",
            mentioning,
            n - unreplaced,
        )


def rows_with_contrast(teacher_ids_BP, teacher_mask_BP, contrast_ids_BQ, contrast_mask_BQ):
    """(B,) bool: which rows of a micro-batch carry a contrastive signal: the wrong hint's left-padded prompt
    differs from the teacher's in its real tokens, whatever the padding. A row without one has p_w = p_c, so its KL
    weight is 0 in exact arithmetic, but float rounding leaves ~1e-7 per logit, which Adam normalises into a full
    step (and without the KL weight, `contrast_kl_tau=0`, the row would train as plain OPSD); so such rows are left
    out of the loss (their tokens add exactly 0 and no gradient)."""
    # Left padding right-aligns the real tokens: compare the last W columns, and the rest must be padding.
    W = min(teacher_ids_BP.size(1), contrast_ids_BQ.size(1))
    t_ids, t_mask = teacher_ids_BP[:, -W:], teacher_mask_BP[:, -W:]
    c_ids, c_mask = contrast_ids_BQ[:, -W:], contrast_mask_BQ[:, -W:]
    same = (t_mask == c_mask).all(1) & (t_ids * t_mask == c_ids * c_mask).all(1)
    same &= teacher_mask_BP[:, : teacher_ids_BP.size(1) - W].sum(1) == 0
    same &= contrast_mask_BQ[:, : contrast_ids_BQ.size(1) - W].sum(1) == 0
    return ~same


def sibling_hints(
    texts: Sequence[str],
    rewards: Sequence[float | None],
    references: Sequence[str | None],
    group_size: int,
    *,
    max_hints: int,
    seed: str,
) -> tuple[list[str | None], list[list[str]], dict[str, float]]:
    """`teacher_contrast=own_wrong`: each rollout's hints from the other rollouts of its problem (RLCSD's choice).

    The rollouts come in groups of `group_size` consecutive rows, one group per problem, graded by `rewards` (1.0
    correct, 0.0 wrong, None ungraded). For rollout i, among the other rollouts of its group:
    - the hint c: a correct one drawn at random; where there is none, the problem's reference (None if it has none);
    - the wrong hints c~: the wrong ones that state a boxed answer (`extract_boxed`), up to `max_hints` (K), one drawn
      at random and then the others in a random order. The rollout itself is never its own hint.
    A rollout without both (no wrong sibling with an answer; no correct sibling and no reference) has no pair: it
    gets no contrast (RLCSD drops it from the update; here its GRPO term stays, and its OPSD term is left out).
    Draws come from `seed` and the row index, so a resumed step draws the same hints.

    Returns (hint per row, wrong hints per row, record): the record counts `rows`, `rows_with_pair`,
    `hint_from_reference` (rows whose c is the reference) and `wrong_hints` (their total over the paired rows)."""
    from opsd.grading import extract_boxed

    n = len(texts)
    if n % group_size:
        raise ValueError(f"{n} rollouts do not split into groups of {group_size} (num_generations)")
    boxed = [extract_boxed(t) is not None for t in texts]
    hints: list[str | None] = []
    wrongs: list[list[str]] = []
    record = {"rows": float(n), "rows_with_pair": 0.0, "hint_from_reference": 0.0, "wrong_hints": 0.0}
    for i in range(n):
        rng = random.Random(f"own_wrong:{seed}:{i}")
        start = i - i % group_size
        others = [j for j in range(start, start + group_size) if j != i]
        right = [j for j in others if rewards[j] == 1.0]
        wrong = [j for j in others if rewards[j] == 0.0 and boxed[j]]
        reference = references[i] if references[i] else None
        hint = texts[rng.choice(right)] if right else reference
        chosen: list[str] = []
        if wrong:
            first = rng.choice(wrong)
            rest = [j for j in wrong if j != first]
            rng.shuffle(rest)
            chosen = [texts[j] for j in [first, *rest][:max_hints]]
        if hint is None or not chosen:
            hints.append(None)
            wrongs.append([])
            continue
        hints.append(hint)
        wrongs.append(chosen)
        record["rows_with_pair"] += 1
        record["hint_from_reference"] += not right
        record["wrong_hints"] += len(chosen)
    return hints, wrongs, record
