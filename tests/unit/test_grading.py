"""Tests for opsd.grading: box extraction, think-block rule, normalisation and correctness."""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import pytest

from opsd import grading
from opsd.grading import (
    answer_region,
    extract_boxed,
    fallback_equal,
    find_boxes,
    grade,
    is_correct,
    normalize_answer,
)

# (completion text, gold, expected correct, expected extracted)
CASES = [
    # leading zeros and spacing
    (r"So the answer is $\boxed{033}$.", "33", True, "033"),
    (r"\boxed{007}", "7", True, "007"),
    (r"\boxed{0}", "0", True, "0"),
    (r"\boxed{ 12 }", "12", True, "12"),
    (r"\boxed {8}", "8", True, "8"),
    # fractions and decimals
    (r"\boxed{\dfrac{1}{2}}", "0.5", True, r"\dfrac{1}{2}"),
    (r"\boxed{\frac12}", r"\frac{1}{2}", True, r"\frac12"),
    (r"\boxed{0.5}", r"\tfrac{1}{2}", True, "0.5"),
    (r"\boxed{5.0}", "5", True, "5.0"),
    (r"\boxed{33.0000001}", "33", False, "33.0000001"),
    # nested braces, nested boxes, escaped braces
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", True, r"\frac{\sqrt{3}}{2}"),
    (r"\boxed{\boxed{42}}", "42", True, "42"),
    (r"\boxed{\{1, 2\}}", r"\{1,2\}", True, r"\{1, 2\}"),
    # several boxes: the last complete one wins
    (r"First \boxed{3}, then \boxed{4}.", "4", True, "4"),
    (r"First \boxed{3}, then \boxed{4}.", "3", False, "4"),
    (r"\boxed{5} is the answer. Wait... \boxed{7}", "7", True, "7"),
    (r"\boxed{5} is the answer. Wait... \boxed{7}", "5", False, "7"),
    # truncated box: skipped, an earlier complete box counts, else no answer
    (r"The answer is \boxed{12", "12", False, None),
    (r"\boxed{5} hmm, actually \boxed{12", "5", True, "5"),
    (r"\boxed{5} hmm, actually \boxed{12", "12", False, "5"),
    # no box / empty box
    ("The answer is 5.", "5", False, None),
    (r"\boxed{}", "5", False, None),
    (r"\boxed{9} and then \boxed{ }", "9", True, "9"),
    # think block
    (r"<think>maybe \boxed{5}</think> I am not sure.", "5", False, None),
    (r"<think>maybe \boxed{4}</think>The answer is \boxed{5}.", "5", True, "5"),
    (r"<think>maybe \boxed{4}</think>The answer is \boxed{5}.", "4", False, "5"),
    (r"<think>still thinking \boxed{5} and", "5", False, None),
    (r"<think>a</think> b <think>c \boxed{1}</think> \boxed{9}", "9", True, "9"),
    ("<think>\n\n</think>\n\nSo $\\boxed{13}$.", "13", True, "13"),
    (r"reasoning \boxed{2} (template opened the think block)</think>\boxed{3}", "3", True, "3"),
    # text around the number, assignments, units, choices
    (r"\boxed{x = 5}", "5", True, "x = 5"),
    (r"\boxed{n=33}", "33", True, "n=33"),
    (r"\boxed{5 \text{ cm}}", "5", True, r"5 \text{ cm}"),
    (r"\boxed{\text{(A)}}", "A", True, r"\text{(A)}"),
    (r"\boxed{\text{(A)}}", "B", False, r"\text{(A)}"),
    (r"\boxed{3, 4}", "3", False, "3, 4"),
    # thousands separators, degrees, dollars, percent
    (r"\boxed{1,000}", "1000", True, "1,000"),
    (r"\boxed{1{,}000}", "1000", True, "1{,}000"),
    (r"\boxed{100^\circ}", "100", True, r"100^\circ"),
    (r"\boxed{\$25}", "25", True, r"\$25"),
    (r"\boxed{50\%}", "50", True, r"50\%"),
    # signs and near misses
    (r"\boxed{-3}", "-3", True, "-3"),
    (r"\boxed{-3}", "3", False, "-3"),
    ("\\boxed{\u22123}", "-3", True, "\u22123"),
    (r"\boxed{6}", "60", False, "6"),
    (r"\boxed{204}", "240", False, "204"),
    (r"\boxed{025}", "250", False, "025"),
    # radicals
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", True, r"2\sqrt{2}"),
    (r"\boxed{2\sqrt{3}}", r"\sqrt{8}", False, r"2\sqrt{3}"),
    # other box forms
    (r"\fbox{5}", "5", True, "5"),
    (r"The answer is $\boxed 5$.", "5", True, "5"),
    (r"\boxed 17.", "17", True, "17"),
    (r"\boxed5", "5", True, "5"),
    (r"\boxedanswer{5}", "5", False, None),
    # fallback-only: math-verify rejects "12." but the normalised strings match
    (r"\boxed{12.}", "12", True, "12."),
]


@pytest.mark.parametrize(("text", "gold", "correct", "extracted"), CASES)
def test_grade_table(text: str, gold: str, correct: bool, extracted: str | None) -> None:
    result = grade(text, gold)
    assert result["extracted"] == extracted
    assert result["has_box"] is (extracted is not None)
    assert result["correct"] is correct


def test_table_is_large_and_has_negatives() -> None:
    assert len(CASES) >= 35
    assert sum(not c for _, _, c, _ in CASES) >= 10


@pytest.mark.parametrize(
    ("text", "region"),
    [
        ("plain answer", "plain answer"),
        ("<think>x</think>tail", "tail"),
        ("<think>x</think>a</think>b", "b"),
        ("<think>never closed", None),
        ("implicit open</think>tail", "tail"),
    ],
)
def test_answer_region(text: str, region: str | None) -> None:
    assert answer_region(text) == region


def test_find_boxes_marks_truncated() -> None:
    assert find_boxes(r"\boxed{1} \fbox{2} \boxed{3") == ["1", "2", None]
    assert find_boxes(r"\boxed{a\}b} \boxed{c}") == [r"a\}b", "c"]
    assert find_boxes("no boxes") == []


def test_extract_boxed_last_complete_box() -> None:
    assert extract_boxed(r"\boxed{1}\boxed{2}") == "2"
    assert extract_boxed(r"\boxed{1}\boxed{}") == "1"
    assert extract_boxed(r"\boxed{1}\boxed{2") == "1"
    assert extract_boxed(r"\boxed") is None
    assert extract_boxed(r"\boxed ") is None


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("007", "7"),
        ("0", "0"),
        ("-0", "0"),
        ("+5", "5"),
        (" 1,000 ", "1000"),
        ("1,234,567", "1234567"),
        ("3,4", "3,4"),
        ("$12$", "12"),
        (r"\$25", "25"),
        (r"\text{(A)}", "A"),
        (r"\textbf{\text{7}}", "7"),
        (r"\left(1, 2\right)", "(1,2)"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac12", r"\frac{1}{2}"),
        ("12.", "12"),
        (r"100^\circ", "100"),
        (r"100^{\circ}", "100"),
        (r"50\%", "50"),
        ("x = 5", "5"),
        ("x=y=5", "x=y=5"),
        ("\u22123", "-3"),
        (r"1\,000", "1000"),
    ],
)
def test_normalize_answer(raw: str, normal: str) -> None:
    assert normalize_answer(raw) == normal


@pytest.mark.parametrize(
    ("pred", "gold", "equal"),
    [
        ("5.0", "5", True),
        ("1/2", r"\frac{1}{2}", True),
        (r"\dfrac{2}{4}", "0.5", True),
        ("007", "7", True),
        ("6", "60", False),
        ("-3", "3", False),
        ("", "0", False),
        ("abc", "abd", False),
    ],
)
def test_fallback_equal(pred: str, gold: str, equal: bool) -> None:
    assert fallback_equal(pred, gold) is equal


def test_an_integer_of_thousands_of_digits_is_graded_not_raised() -> None:
    """Python's int() refuses a string of over 4300 digits; the normalisation strips leading zeros as text."""
    huge = "1" + "0" * 5000
    assert normalize_answer("00" + huge) == huge and normalize_answer("-0" + huge) == "-" + huge
    assert is_correct(huge, huge) and not is_correct(huge, "5")
    assert grading.answer_key("+" + huge) == grading.answer_key(huge) != grading.answer_key("5")


def test_none_and_blank_predictions_are_wrong() -> None:
    assert is_correct(None, "5") is False
    assert is_correct("   ", "5") is False


def test_fallback_used_when_math_verify_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import math_verify
    from math_verify.errors import TimeoutException

    def boom(*args: object, **kwargs: object) -> list:
        raise RuntimeError("parser exploded")

    monkeypatch.setattr(math_verify, "parse", boom)
    assert is_correct("007", "7") is True
    assert is_correct("6", "60") is False

    def slow(*args: object, **kwargs: object) -> list:
        raise TimeoutException("too slow")

    monkeypatch.setattr(math_verify, "parse", slow)
    assert is_correct("1,000", "1000") is True
    assert is_correct("999", "1000") is False


def test_signal_timeout_only_in_main_thread() -> None:
    assert grading._signal_timeout(2.5) == 3
    assert grading._signal_timeout(0.2) == 1
    assert grading._signal_timeout(0) is None
    seen: dict[str, object] = {}
    thread = threading.Thread(target=lambda: seen.update(t=grading._signal_timeout(5.0)))
    thread.start()
    thread.join()
    assert seen["t"] is None


def test_is_correct_in_worker_thread() -> None:
    # signal-based timeouts would raise off the main thread; grading must still work there.
    results: dict[str, bool] = {}

    def work() -> None:
        results["half"] = is_correct(r"\dfrac{1}{2}", "0.5")
        results["wrong"] = is_correct("6", "60")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert results == {"half": True, "wrong": False}


# --- degenerate answers: bounded, quiet, and timed out on any thread --------------------------------------------


def test_long_answer_is_graded_by_the_string_fallback_quickly(monkeypatch: pytest.MonkeyPatch) -> None:
    answer = "1+" * 100_000 + "1"  # 200k characters, as a degenerate completion writes it

    def no_math_verify(*args, **kwargs):  # math-verify took 5-6 s per such sample
        raise AssertionError("a long answer reached math-verify")

    with monkeypatch.context() as m:
        m.setattr(grading, "math_verify_equal", no_math_verify)
        result = grade(rf"The answer is \boxed{{{answer}}}.", "7")
    assert result == {"extracted": answer, "has_box": True, "correct": False, "grader": grading.GRADER_LONG}
    # The fallback still grades it: the same long string is equal to itself.
    assert is_correct(answer, answer) is True
    limit = "1" * grading.MAX_VERIFY_CHARS
    assert grade(rf"\boxed{{{limit}}}", limit)["grader"] == grading.GRADER_VERIFY
    assert grade(rf"\boxed{{{limit}1}}", "1")["grader"] == grading.GRADER_LONG
    assert grade("no box", "1")["grader"] == grading.GRADER_VERIFY


def test_math_verify_logs_no_expression(caplog: pytest.LogCaptureFixture) -> None:
    tower = "9^{9^{9^{9}}}"  # math-verify times out on it and used to log it
    with caplog.at_level(logging.DEBUG):
        assert grading.math_verify_equal(tower, "1", timeout_s=1) is False
    assert not [r for r in caplog.records if r.name.startswith(("math_verify", "latex2sympy"))]


def test_timeout_holds_off_the_main_thread() -> None:
    # SIGALRM cannot be armed off the main thread; the grade must still end (in a worker process).
    results: dict[str, bool] = {}

    def work() -> None:
        results["tower"] = grading.math_verify_equal("9^{9^{9^{9}}}", "1", timeout_s=1)
        results["half"] = grading.math_verify_equal(r"\dfrac{1}{2}", "0.5", timeout_s=2)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout=120)  # a hang guard, not a speed bound: the two grades take about 2 s
    assert not thread.is_alive(), "math-verify hung in a thread"
    assert results == {"tower": False, "half": True}


def test_summary_counts_long_answers() -> None:
    from opsd.evaluation.summary import grading_counts

    rows = {"a": [{"grader": grading.GRADER_LONG}, {"grader": grading.GRADER_VERIFY}], "b": [{}]}
    assert grading_counts(rows) == {
        "max_verify_chars": grading.MAX_VERIFY_CHARS,
        "string_fallback_long_answers": 1,
    }


# --- extraction is linear: adversarial completions against the quadratic reference it replaced ---------------


def _old_match_braces(text: str, open_pos: int) -> int | None:
    depth, i = 0, open_pos
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _old_read_box(text: str, name_end: int) -> tuple[str | None, int]:
    i = name_end
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text):
        return None, len(text)
    if text[i] == "{":
        end = _old_match_braces(text, i)
        return (None, i + 1) if end is None else (text[i + 1 : end - 1], end)
    if i == name_end and text[i] not in "0123456789-":
        return None, i
    j, depth = i, 0
    while j < len(text) and text[j] not in " \t\r\n$":
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            if depth == 0:
                break
            depth -= 1
        j += 1
    return text[i:j].rstrip(".,;"), j


def _old_find_boxes(text: str) -> list[str | None]:
    """The rescanning extraction that grading.py used before: the naive reference."""
    boxes, pos = [], 0
    while (m := grading._BOX_START.search(text, pos)) is not None:
        content, pos = _old_read_box(text, m.end())
        boxes.append(None if content is None else content.strip())
    return boxes


def _old_extract_boxed(text: str) -> str | None:
    region = answer_region(text)
    for content in reversed(_old_find_boxes(region) if region is not None else []):
        if content:
            while (m := grading._BOX_START.match(content)) is not None:
                inner, end = _old_read_box(content, m.end())
                if inner is None or content[end:].strip():
                    break
                content = inner.strip()
            return content
    return None


_PIECES = [
    "\\boxed", "\\fbox", "\\boxedx", "{", "}", "{", "}", "\\{", "\\}", "\\\\", "\\", " ", "\n", "\u00a0", "1",
    "-", "7.", ",", ";", "$", "a", "</think>", "<think>", "\\frac",
]  # fmt: skip


def test_extraction_matches_the_naive_reference_on_random_texts() -> None:
    import random

    rng = random.Random(0)
    for _ in range(10_000):
        text = "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 60)))
        assert find_boxes(text) == _old_find_boxes(text), text
        assert extract_boxed(text) == _old_extract_boxed(text), text


# shape -> (its text of k repeats, the k of its full size): each at least 190k characters at full size.
ADVERSARIAL: dict[str, tuple[Callable[[int], str], int]] = {
    "unclosed boxes": (lambda k: "</think>" + "\\boxed{1" * k, 25_000),
    "open braces": (lambda k: "</think>\\boxed" + "{" * k, 200_000),
    "nested unclosed boxes": (lambda k: "</think>" + "\\boxed{" * k, 28_000),
    "nested closed boxes": (lambda k: "</think>" + "\\boxed{" * k + "5" + "}" * k, 25_000),
    "many closed boxes": (lambda k: "</think>" + "\\boxed{12} " * k, 18_000),
    "spaced boxes": (lambda k: "</think>" + "\\boxed  " * k + "\\boxed{3", 25_000),
}


@dataclass
class Work:
    """What one extraction did: Python lines run and characters the module's regexes passed over."""

    lines: int = 0
    chars: int = 0

    @property
    def total(self) -> int:
        return self.lines + self.chars


class _CountedPattern:
    """A compiled pattern of opsd.grading that adds the characters each call passes over to `work`: the C-level
    scanning a count of Python lines does not see. A method extraction starts to use must be added here."""

    def __init__(self, pattern: re.Pattern, work: Work) -> None:
        self.pattern, self.work = pattern, work

    def search(self, text: str, pos: int = 0, endpos: int = sys.maxsize):
        m = self.pattern.search(text, pos, endpos)
        self.work.chars += (m.end() if m else min(len(text), endpos)) - pos
        return m

    def match(self, text: str, pos: int = 0, endpos: int = sys.maxsize):
        m = self.pattern.match(text, pos, endpos)
        self.work.chars += m.end() - pos if m else 1
        return m

    def finditer(self, text: str, pos: int = 0, endpos: int = sys.maxsize):
        self.work.chars += max(0, min(len(text), endpos) - pos)
        return self.pattern.finditer(text, pos, endpos)


def work_of(extract: Callable[[str], object], text: str) -> Work:
    """The work `extract(text)` does, counted, not timed: every Python line it runs (`sys.settrace`) and every
    character a regex of opsd.grading scans. The same on any machine, however loaded."""
    work = Work()

    def count_line(frame, event, arg):
        if event == "line":
            work.lines += 1
        return count_line

    with pytest.MonkeyPatch.context() as patch:
        for name, value in list(vars(grading).items()):
            if isinstance(value, re.Pattern):
                patch.setattr(grading, name, _CountedPattern(value, work))
        previous = sys.gettrace()  # a coverage tracer, if any, is put back
        sys.settrace(lambda frame, event, arg: count_line)
        try:
            extract(text)
        finally:
            sys.settrace(previous)
    return work


# Linear work doubles with the text (2.00 measured on every shape); quadratic work quadruples (3.99 for the
# reference below). n log n would reach ~2.2.
LINEAR_RATIO = 2.1


@pytest.mark.parametrize("shape", sorted(ADVERSARIAL))
def test_extraction_is_linear_on_adversarial_completions(shape: str) -> None:
    make, full = ADVERSARIAL[shape]
    text = make(full)
    assert len(text) >= 190_000
    got = extract_boxed(text)
    # A spaced `\boxed` reads the next `\boxed` as its brace-less one-token answer, as before.
    expected = {"nested closed boxes": "5", "many closed boxes": "12", "spaced boxes": "\\boxed"}.get(shape)
    assert got == expected
    small = text[:4000]  # the reference is quadratic: compare on a prefix
    assert extract_boxed(small) == _old_extract_boxed(small)
    # Twice the text, twice the work: counted at a tenth of the full size and twice that (no clock, so a busy
    # machine cannot fail it; the quadratic scan took ~7 s at 32k characters).
    once, twice = work_of(extract_boxed, make(full // 10)), work_of(extract_boxed, make(full // 5))
    assert once.lines > 0 and once.chars > 0
    assert twice.total / once.total < LINEAR_RATIO, f"{shape}: {once} -> {twice}"


def test_the_work_count_sees_quadratic_extraction() -> None:
    """The count is not blind: the rescanning reference this module keeps does quadruple its work."""
    for shape in ("unclosed boxes", "nested unclosed boxes", "nested closed boxes"):
        make, _ = ADVERSARIAL[shape]
        once, twice = work_of(_old_extract_boxed, make(100)), work_of(_old_extract_boxed, make(200))
        assert twice.total / once.total > 3.5, f"{shape}: {once} -> {twice}"


# --- answer_key: one key per answer, equal where the grader calls answers equal -------------------------------

KEY_PAIRS = [
    ("3.5", "3.50", True),
    ("0.5", "1/2", True),
    ("0.5", "\\frac{1}{2}", True),
    ("-0.5", "-\\dfrac{1}{2}", True),
    ("1000", "1,000", True),
    ("x = 5", "5", True),
    ("50\\%", "50", True),
    ("2^{10}", "1024", True),
    ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}", True),
    ("\\pi/2", "\\frac{\\pi}{2}", True),
    ("x+1", "1+x", True),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("3", "4", False),
    ("1234567890123", "1234567890124", False),
    ("\\sqrt{2}", "\\sqrt{3}", False),
    ("3.14159", "\\pi", False),
    ("\\infty", "-\\infty", False),
    ("x+1", "x+2", False),
    ("\\binom{10}{3}", "120", True),
    ("\\sin 60", "\\sin 60^\\circ", False),  # radians against degrees (forms_differ)
    ("\\sin(60^\\circ)", "\\sin 60^{\\circ}", True),
    ("5 \\text{ cm}", "5 centimeters", True),
    ("5 inches", "5 in", True),
]


@pytest.mark.parametrize(("a", "b", "equal"), KEY_PAIRS)
def test_answer_key_is_equal_exactly_where_the_grader_says_equal(a: str, b: str, equal: bool) -> None:
    assert is_correct(a, b) == equal
    assert (grading.answer_key(a) == grading.answer_key(b)) == equal
    assert grading.answer_keys([a, b, a]) == [
        grading.answer_key(a),
        grading.answer_key(b),
        grading.answer_key(a),
    ]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("9^{9^{9^{9}}}", "9^{9^{9^{8}}}"),  # a tower is keyed by its parse, never evaluated
        ("\\binom{1000000}{500000}", "\\binom{1000000}{499999}"),  # not parsed: the parse would compute it
        ("1000000!", "999999!"),
    ],
)
def test_answer_key_of_a_huge_value_is_quick_and_distinct(a: str, b: str) -> None:
    """math-verify's grader times these out (`is_correct` takes its timeout); the key must not hang."""
    assert grading.answer_key(a) != grading.answer_key(b)


def test_answer_keys_of_plain_numbers_need_no_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table of 29k numeric answers is keyed by exact arithmetic alone; math-verify parses each other distinct
    answer once."""

    def refuse(text: str) -> tuple:
        raise AssertionError(f"parsed {text!r}")

    monkeypatch.setattr(grading, "_parsed_key", refuse)
    answers = [str(i % 997) for i in range(29000)] + ["1,000", "2.50", "\\frac{3}{4}", "", None]
    keys = grading.answer_keys(answers)
    assert keys[-2:] == [None, None] and keys[-5] == ("value", Fraction(1000))
    assert keys[-4] == ("value", Fraction(5, 2)) and keys[-3] == ("value", Fraction(3, 4))
    assert len(set(keys[:29000])) == 997


# --- the answer styles of the benchmarks (opsd.evaluation.benchmarks), graded by hand ----------------------------

# (benchmark style, predicted, gold, correct): each gold answer written as the dataset writes it, each prediction
# as a model might box it. The verdicts are a mathematician's, not the grader's output copied back.
BENCHMARK_STYLE_CASES = [
    # AIME: integers 0-999, HuggingFaceH4/aime_2024 zero-pads them as text
    ("aime", "25", "025", True),
    ("aime", "025", "25", True),
    ("aime", "250", "025", False),
    ("aime", "x = 204", "204", True),
    # AMC 2023: the answer column holds floats
    ("amc", "27", "27.0", True),
    ("amc", "27.5", "27.0", False),
    # HMMT and MATH-500: radicals, fractions, powers, factorials
    ("hmmt", r"\frac{9\sqrt{23}}{23}", r"\frac{9\sqrt{23}}{23}", True),
    ("hmmt", r"\frac{9}{\sqrt{23}}", r"\frac{9\sqrt{23}}{23}", True),  # rationalised the other way
    ("hmmt", r"9\sqrt{23}/23", r"\frac{9\sqrt{23}}{23}", True),
    ("hmmt", r"-\sqrt{2}+\sqrt{6}", r"\sqrt{6}-\sqrt{2}", True),  # terms reordered
    ("hmmt", r"\sqrt{6}+\sqrt{2}", r"\sqrt{6}-\sqrt{2}", False),
    ("hmmt", r"4\sqrt{2}", r"\sqrt{32}", True),
    ("hmmt", r"2^{1/3}", r"\sqrt[3]{2}", True),
    ("hmmt", r"2^{25} \cdot 26!", r"2^{25} \cdot 26!", True),
    ("hmmt", r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}", True),
    # pi: symbolic, never a decimal approximation
    ("math500", r"2\pi", r"2\pi", True),
    ("math500", r"\pi \cdot 2", r"2\pi", True),
    ("math500", "6.2832", r"2\pi", False),
    ("math500", r"\pi^2/6", r"\frac{\pi^2}{6}", True),
    ("math500", r"12\sqrt{2}\pi", r"12\pi\sqrt{2}", True),
    # intervals: the ends and their brackets both count
    ("math500", "[-2, 7]", "[-2,7]", True),
    ("math500", r"x \in [-2, 7]", "[-2,7]", True),
    ("math500", "(-2, 7]", "[-2,7]", False),
    ("math500", r"(-\infty, 0) \cup (0, \infty)", r"(-\infty,0)\cup(0,\infty)", True),
    # tuples are ordered, sets and lists of solutions are not
    ("math500", r"(3, \pi/2)", r"\left( 3, \frac{\pi}{2} \right)", True),
    ("math500", r"(\frac{\pi}{2}, 3)", r"\left( 3, \frac{\pi}{2} \right)", False),
    ("math500", "(3, 1.5708)", r"\left( 3, \frac{\pi}{2} \right)", False),
    ("math500", r"\{1,2,3\}", r"\{3,2,1\}", True),
    ("math500", "3, 5", "5, 3", True),
    ("math500", r"1 \pm \sqrt{2}", r"1+\sqrt2, 1-\sqrt2", True),
    ("math500", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", True),
    ("math500", r"\begin{pmatrix} 2 \\ 1 \end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", False),
    # units, degrees, money, percent
    ("math500", r"5\text{ cm}", "5", True),
    ("math500", r"\text{5 cm}", "5", True),
    ("math500", "6 cm", r"5\text{ cm}", False),
    ("math500", r"12 \text{ square units}", "12", True),
    ("math500", "90", r"90^\circ", True),
    ("math500", "90°", r"90^\circ", True),
    ("math500", r"\frac{\pi}{2}", r"90^\circ", False),
    ("math500", r"\$18.90", "18.90", True),
    ("math500", "18.9", r"\$18.90", True),
    ("math500", r"\$1,000", "1000", True),
    ("math500", r"10\%", "10", True),
    # text answers: a name, a day, a choice
    ("math500", r"\text{Evelyn}", r"\text{Evelyn}", True),
    ("math500", "Evelyn", r"\text{Evelyn}", True),
    ("math500", r"\text{Devin}", r"\text{Evelyn}", False),
    ("math500", r"\text{June 20}", r"\text{June 20}", True),
    ("math500", r"\textbf{(A)}", r"\text{(A)}", True),
    ("math500", "C", r"\text{(C)}", True),
    ("math500", "(D)", r"\text{(C)}", False),
    # equal values written differently
    ("math500", "0.5", r"\frac{1}{2}", True),
    ("math500", "1/2", r"\dfrac12", True),
    ("math500", r"1\frac{1}{2}", r"\frac{3}{2}", True),
    ("math500", "y = 2x + 3", "2x+3", True),
    ("math500", "x^2+1", "1+x^2", True),
]


@pytest.mark.parametrize(("style", "predicted", "gold", "correct"), BENCHMARK_STYLE_CASES)
def test_benchmark_answer_styles_graded_by_hand(style: str, predicted: str, gold: str, correct: bool) -> None:
    assert is_correct(predicted, gold) is correct
    boxed = grading.grade(f"So the answer is $\\boxed{{{predicted}}}$.", gold)
    assert boxed["extracted"] == predicted and boxed["correct"] is correct


@pytest.mark.parametrize(
    ("answer", "stripped"),
    [
        ("5cm", "5"), ("12squareunits", "12"), ("3inches^2", "3"), ("\\frac{1}{2}m", "\\frac{1}{2}"),
        ("90degrees", "90"),
        ("cm", "cm"),  # a unit alone
        ("Evelyn", "Evelyn"),  # text that ends in a unit's letters
        ("x+5in", "x+5in"),  # an expression, not a number and a unit
        ("2min", "2min"),  # not a unit of the list
    ],
)  # fmt: skip
def test_strip_unit_drops_a_unit_word_after_a_number_only(answer: str, stripped: str) -> None:
    assert grading.strip_unit(answer) == stripped


# (predicted, gold, correct): the forms both graders looked past (`grading.forms_differ`), graded by hand. Angles in
# degrees inside an expression, the variable of an assignment and unit words on both sides count; a bare number
# against an assignment, a unit or a lone degree mark does not (MATH's grader ignores units).
NEAR_MISS_CASES = [
    # degrees inside an expression are not radians
    (r"\sin 60", r"\sin 60^\circ", False),
    (r"\sin 60^\circ", r"\sin 60", False),
    (r"\cos(30^{\circ})", r"\cos 30", False),
    (r"\sin(60^\circ)", r"\sin 60^\circ", True),
    (r"\sin 60^\circ", r"\sin(2 \cdot 30^\circ)", True),
    # math-verify's call, pinned as it stands: it reads `60^\circ` as 60, so the gold is the sine of 60 radians
    (r"\frac{\sqrt{3}}{2}", r"\sin 60^\circ", False),
    (r"\frac{\sqrt3}{2}", r"\sin 60^\circ", False),
    # a degree mark on a number standing alone is a unit, ignored
    ("60", r"60^\circ", True),
    (r"60^\circ", "60", True),
    (r"30^\circ, 150^\circ", "30, 150", True),
    (r"x = 60^\circ", "60", True),
    ("60 degrees", r"60^\circ", True),
    # assignments to different variables differ; to one variable, or against a bare value, they do not
    ("y = 5", "x = 5", False),
    ("y=5", "x=5", False),
    ("c = 2b+1", "a = 2b+1", False),
    ("x = 5", "x=5", True),
    ("x_1 = 5", "x_{1}=5", True),
    ("5", "x = 5", True),
    ("x = 5", "5", True),
    ("y = 5", "5", True),
    # two different unit words differ; one unit word against none, or two spellings of one unit, do not
    ("5 cm", "5 inches", False),
    (r"5\text{ cm}", r"5\text{ inches}", False),
    ("12 hours", "12 minutes", False),
    (r"12\text{ hours}", r"12 \text{ minutes}", False),
    ("50 cents", "50 dollars", False),
    ("5 cm^2", "5 cm", False),
    (r"5\sqrt{2}\text{ cm}", r"5\sqrt{2}\text{ inches}", False),
    ("5 cm", "5", True),
    ("5", r"5\text{ cm}", True),
    (r"5\sqrt{2}\text{ cm}", r"5\sqrt{2}", True),
    (r"5\text{ cm}", "5 centimeters", True),
    ("5 inches", "5 in", True),
    ("12 square units", r"12\text{ units}^2", True),
    (r"\$18.90", "18.90 dollars", True),
]


@pytest.mark.parametrize(("predicted", "gold", "correct"), NEAR_MISS_CASES)
def test_near_misses_graded_by_hand(predicted: str, gold: str, correct: bool) -> None:
    assert is_correct(predicted, gold) is correct
    boxed = grading.grade(f"So the answer is $\\boxed{{{predicted}}}$.", gold)
    assert boxed["extracted"] == predicted and boxed["correct"] is correct


def test_forms_that_differ_share_a_key_when_their_values_agree() -> None:
    """A key is the value alone, as against a bare gold number (`answer_key`): ``x = 5`` and ``y = 5`` both match
    ``5``, so they cannot key apart, though the grader tells them apart; likewise for unit words."""
    assert grading.answer_key("x = 5") == grading.answer_key("y = 5") == grading.answer_key("5")
    assert grading.answer_key("5 cm") == grading.answer_key("5 inches") == grading.answer_key("5")
    assert not is_correct("y = 5", "x = 5") and not is_correct("5 inches", "5 cm")


@pytest.mark.parametrize(
    ("answer", "unit"),
    [
        ("5 cm", ("cm", 1)), (r"5\text{ centimeters}", ("cm", 1)), ("12 square units", ("unit", 2)),
        (r"12\text{ units}^2", ("unit", 2)), ("3 cubic feet", ("ft", 3)), ("5", None), (r"90^\circ", None),
        (r"\$18.90", None), ("x+5 in", None), (r"\text{Evelyn}", None),
    ],
)  # fmt: skip
def test_answer_unit(answer: str, unit: tuple | None) -> None:
    assert grading.answer_unit(answer) == unit
