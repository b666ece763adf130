r"""Answer extraction and grading for boxed final answers (AIME-style scoring).

Extraction rules (`extract_boxed`):

* Think block. When the completion contains ``</think>``, only the text after the LAST ``</think>``
  is searched, so a ``\boxed{}`` written while thinking does not count. When it contains an opening
  ``<think>`` but no ``</think>``, the model was cut off while thinking and there is no answer (None).
  A completion with neither tag (thinking disabled, or tags stripped) is searched whole. A completion
  that starts inside an implicit think block (template-opened ``<think>``) and is cut off before
  ``</think>`` cannot be told apart from a tag-free answer; callers that know this should pass the
  truncation flag on and score it separately.
* Boxes. ``\boxed{...}`` and ``\fbox{...}`` with balanced braces (nesting and escaped ``\{``/``\}``
  are fine), and the brace-less TeX form ``\boxed 5`` (one token: a run of characters up to white
  space or ``$``, trailing ``.,;`` dropped). The text is scanned left to right; a box nested in
  an earlier complete box is part of that box's content, not a box of its own.
* Which box. The LAST COMPLETE, NON-EMPTY box counts. A truncated box (``\boxed{12`` with the text
  ending before its brace closes) is skipped, so ``\boxed{5} ... \boxed{12`` gives ``5``; an empty box
  ``\boxed{}`` is skipped the same way. If no box qualifies, there is no answer (None).

Correctness (`is_correct`): math-verify first (symbolic and numeric equivalence, so ``\dfrac{1}{2}``,
``0.5``, ``x = 5`` against ``5``, ``2\sqrt{2}`` against ``\sqrt{8}`` and ``50\%`` against ``50`` all
match), then a string/number fallback on `normalize_answer` for what math-verify cannot parse or
times out on. Assignments such as ``x = 5`` therefore count as the value on the right-hand side, and a unit
word or a degree mark after a number is ignored (``5 cm`` and ``90^\circ`` against ``5`` and ``90``), as MATH's
grader ignores units. Three differences both would look past are kept (`forms_differ`): assignments to different
variables (``y = 5`` is not ``x = 5``), two different unit words (``5 cm`` is not ``5 inches``, ``12 hours`` not
``12 minutes``) and degrees inside an expression against none (``\sin 60`` is not ``\sin 60^\circ``: math-verify
reads the degree mark as nothing, so ``\sin 60^\circ`` is the sine of 60 radians to it, and
``\frac{\sqrt{3}}{2}`` does not match it).

Grouping by value (`answer_key`, `answer_keys`): one hashable key per answer, equal where `is_correct` calls
two answers equal in the usual forms, so a table of answers is grouped in one pass instead of comparing pairs
(the teacher pairing's derangement, opsd.method.pairing). Plain numbers are keyed by exact arithmetic; other
answers by math-verify's parse, without a timeout, so every process computes the same keys.

Degenerate answers stay cheap and quiet. An answer longer than `MAX_VERIFY_CHARS` (no AIME answer is;
math-verify is slow on a huge expression and logs it whole: docs/decisions.md) is graded by the string
fallback only, and `grade` says so (`grader: "string (long answer)"`; `summary.json` counts them).
math-verify's own log lines, which quote the expression, are silenced. Its timeout uses SIGALRM, which
only the main thread can arm: elsewhere (a grading thread) math-verify runs in a worker process with the
same timeout, killed if it overruns, so a nested power such as ``9^{9^{9^{9}}}`` cannot hang a thread.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import threading
import time
from fractions import Fraction
from typing import Any

logger = logging.getLogger(__name__)

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_BOX_START = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_TOKEN_STOP = set(" \t\r\n$")
_ESCAPE_OR_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)


def answer_region(text: str) -> str | None:
    """The part of a completion that may hold the final answer, or None if cut off while thinking."""
    if THINK_CLOSE in text:
        return text.rsplit(THINK_CLOSE, 1)[1]
    if THINK_OPEN in text:
        return None
    return text


def _closing_braces(text: str) -> dict[int, int]:
    r"""For each `{` of `text` that is closed, the index just past its closing `}`: one pass with a stack.

    A backslash escapes the next character (``\{``, ``\}``, ``\\``), which then never opens or closes a
    group. The pass starts at the beginning of the text and agrees with a scan started at any box's `{`:
    that brace follows a letter or white space, never an escaping backslash. Matching once keeps
    extraction linear: a run of unclosed boxes (``\boxed{1\boxed{1...``) is not rescanned per box.
    """
    closes: dict[int, int] = {}
    stack: list[int] = []
    for m in _ESCAPE_OR_BRACE.finditer(text):
        ch = text[m.start()]
        if ch == "{":
            stack.append(m.start())
        elif ch == "}" and stack:
            closes[stack.pop()] = m.end()
    return closes


def _strip_span(text: str, start: int, end: int) -> tuple[int, int]:
    """`(start, end)` narrowed as `text[start:end].strip()` would narrow it, without copying."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _read_box(
    text: str, name_end: int, end: int, closes: dict[int, int]
) -> tuple[tuple[int, int] | None, int]:
    """Read one box whose command ends at `name_end`, within `text[:end]`.

    Returns (span of its content, or None if truncated; scan resume index). `closes` is
    `_closing_braces(text)`; a brace closed only after `end` counts as unclosed.
    """
    i = name_end
    while i < end and text[i].isspace():
        i += 1
    if i >= end:
        return None, end
    if text[i] == "{":
        close = closes.get(i)
        if close is None or close > end:
            # Truncated: keep scanning after the opening brace so later complete boxes are still seen.
            return None, i + 1
        return (i + 1, close - 1), close
    if i == name_end and text[i] not in "0123456789-":
        # `\boxed(` or `\boxed\frac`: not the brace-less single-token form we accept.
        return None, i
    # One token: up to white space or `$`, or a `}` that closes a group opened before the box.
    j, depth = i, 0
    while j < end and text[j] not in _TOKEN_STOP:
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            if depth == 0:
                break
            depth -= 1
        j += 1
    stop = j
    while stop > i and text[stop - 1] in ".,;":
        stop -= 1
    return (i, stop), j


def box_spans(text: str) -> list[tuple[int, int] | None]:
    r"""The (start, end) of each top-level box's stripped content in `text`, in order; None for a truncated box.

    A ``\boxed`` inside an earlier complete box is part of that box's content. Linear in `len(text)`.
    """
    closes = _closing_braces(text)
    spans: list[tuple[int, int] | None] = []
    pos = 0
    while True:
        m = _BOX_START.search(text, pos)
        if m is None:
            return spans
        span, pos = _read_box(text, m.end(), len(text), closes)
        spans.append(None if span is None else _strip_span(text, *span))


def find_boxes(text: str) -> list[str | None]:
    r"""All top-level boxes in `text` in order; each is its stripped content, or None if truncated (`box_spans`)."""
    return [None if span is None else text[slice(*span)] for span in box_spans(text)]


def _unwrap_box(content: str) -> str:
    r"""Strip redundant wrappers such as ``\boxed{\boxed{5}}`` down to ``5``.

    Works on index spans of `content`, so deep nesting costs one pass, not one copy per level.
    """
    start, end = 0, len(content)
    closes = None
    while True:
        m = _BOX_START.match(content, start, end)
        if m is None:
            break
        if closes is None:
            closes = _closing_braces(content)
        span, resume = _read_box(content, m.end(), end, closes)
        if span is None or _strip_span(content, resume, end)[0] < end:
            break
        start, end = _strip_span(content, *span)
    return content[start:end]


def extract_boxed(text: str) -> str | None:
    """The final boxed answer of a completion under the module's think-block and box rules, or None."""
    region = answer_region(text)
    if region is None:
        return None
    for content in reversed(find_boxes(region)):
        if content:
            return _unwrap_box(content)
    return None


# --- normalisation (string fallback) -------------------------------------------------------------

_TEXT_LIKE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_INTEGER = re.compile(r"[+-]?\d+")
_ASSIGNMENT = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?=(?!=)")
_SINGLE_CHOICE = re.compile(r"^\(([A-Za-z])\)$")
_FRAC_NUM = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$")


def normalize_answer(s: str) -> str:
    r"""Canonical string form of an answer for exact comparison when symbolic grading fails.

    Drops spacing, ``$``, ``\text{}``-like wrappers, ``\left``/``\right``, degree and percent marks and
    a trailing period; maps ``\dfrac``/``\tfrac`` to ``\frac``, Unicode minus to ``-``; removes comma
    thousands separators from numbers and leading zeros from integers; drops a one-variable
    assignment prefix (``x=5`` -> ``5``) and the parentheses of a single-letter choice (``(A)``).
    """
    s = s.strip()
    s = s.replace("\u2212", "-").replace("\u2013", "-")
    s = s.replace("\\$", "").replace("$", "")
    # Unwrap repeatedly so that nested wrappers such as \text{\textbf{A}} are fully removed.
    prev = None
    while prev != s:
        prev = s
        s = _TEXT_LIKE.sub(r"\1", s)
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    for mark in ("^{\\circ}", "^\\circ", "\\circ", "\u00b0", "\\%", "%", "\\degree"):
        s = s.replace(mark, "")
    for space in ("\\!", "\\,", "\\;", "\\:", "\\ ", "~", "\\quad", "\\qquad"):
        s = s.replace(space, "")
    s = s.replace("{,}", ",")
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    if s.count("=") == 1:
        s = _ASSIGNMENT.sub("", s)
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if _INTEGER.fullmatch(s):  # leading zeros and `+` dropped as text: int() refuses over 4300 digits
        digits = s.lstrip("+-").lstrip("0")
        s = ("-" if s[0] == "-" and digits else "") + (digits or "0")
    m = _SINGLE_CHOICE.match(s)
    if m:
        s = m.group(1)
    return s


def _as_number(s: str) -> Fraction | None:
    r"""Exact value of a normalised plain number, ``a/b`` or ``\frac{a}{b}``, else None."""
    m = _FRAC_NUM.match(s)
    if m:
        sign, num, den = m.groups()
        s = f"{sign}{num}/{den}"
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def exact_value(answer: str) -> Fraction | None:
    r"""The exact value of an answer that is a plain number, ``a/b`` or ``\frac{a}{b}`` after `normalize_answer`
    (``1,000``, ``3.50``, ``x = 5``, ``50\%`` too), else None."""
    return _as_number(normalize_answer(answer))


# Units a competition answer may carry after its number (MATH-500 writes `5\\text{ cm}`, `\\$18.90`, `90^\\circ`).
_UNITS = (
    "mm", "cm", "km", "m", "meters", "meter", "centimeters", "centimeter", "kilometers", "inches", "inch", "in",
    "feet", "foot", "ft", "yards", "yard", "miles", "mile", "units", "unit", "degrees", "degree", "dollars",
    "dollar", "cents", "cent", "seconds", "second", "minutes", "minute", "hours", "hour", "days", "day",
    "grams", "gram", "kg", "pounds", "pound", "mph", "sq", "square", "cubic",
)  # fmt: skip
_UNIT_SUFFIX = re.compile(
    r"^(.*?\d\}?)((?:square|cubic|sq)?(?:"
    + "|".join(sorted(_UNITS, key=len, reverse=True))
    + r")(?:\^\{?[23]\}?)?)$"
)


def strip_unit(normalized: str) -> str:
    r"""A normalised answer without a trailing unit word after a number: ``5cm`` -> ``5``,
    ``12squareunits`` -> ``12``, ``3inches^2`` -> ``3`` (`normalize_answer` has removed spacing and
    ``\text{}``, so ``\text{5 cm}`` arrives as ``5cm``). Anything else is returned unchanged; so is a unit
    alone (``cm``) or text that merely ends in a unit's letters after a non-digit (``\text{Evelyn}``)."""
    m = _UNIT_SUFFIX.match(normalized)
    return m.group(1) if m and _as_number(m.group(1)) is not None else normalized


_ALIAS = {
    "centimeters": "cm", "centimeter": "cm", "kilometers": "km", "meters": "m", "meter": "m",
    "inches": "in", "inch": "in", "feet": "ft", "foot": "ft", "yards": "yard", "miles": "mile",
    "units": "unit", "degrees": "degree", "dollars": "dollar", "cents": "cent", "seconds": "second",
    "minutes": "minute", "hours": "hour", "days": "day", "grams": "gram", "pounds": "pound",
}  # fmt: skip
_UNIT_POWER = re.compile(r"^(square|sq|cubic)?(.+?)(?:\^\{?([23])\}?)?$")
_COMMAND = re.compile(r"\\[A-Za-z]+")


def answer_unit(answer: str) -> tuple[str, int] | None:
    r"""The unit an answer names after a number, as (word, power): ``5\text{ cm}``, ``5 centimeters`` ->
    ``("cm", 1)``, ``12 square units`` and ``12 units^2`` -> ``("unit", 2)``; None without a unit (``5``,
    ``90^\circ``, ``\$18.90``: degree and dollar marks are not unit words). The number may be any expression
    without a letter of its own (``5\sqrt{2}\text{ cm}``), so ``x+5in`` names no unit."""
    m = _UNIT_SUFFIX.match(normalize_answer(answer))
    if m is None or re.search(r"[A-Za-z]", _COMMAND.sub("", m.group(1))):
        return None
    prefix, word, suffix = _UNIT_POWER.match(m.group(2)).groups()
    power = 3 if prefix == "cubic" else 2 if prefix else int(suffix or 1)
    return _ALIAS.get(word, word), power


_DEGREE_MARK = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\u00b0|\\degree(?![A-Za-z])")
_BLANK = re.compile(r"\s+|\$|\\left|\\right|\\[,;:! ]|\{\}")
# A degree mark that closes a number standing alone: the answer, an item of a list or tuple, a right-hand side.
_LONE_ANGLE = re.compile(r"(?<=[,;=])([(\[{]?[+-]?\d+(?:\.\d+)?)\u00b0(?=[)\]}]?[,;])")


def degrees_in_expression(answer: str) -> bool:
    r"""Whether an answer has an angle in degrees inside an expression (``\sin 60^\circ``, ``\cos(30^\circ)``),
    not only as the unit of a number standing alone (``60^\circ``, ``30^\circ, 150^\circ``, ``x = 60^\circ``)."""
    s = "," + _DEGREE_MARK.sub("\u00b0", _BLANK.sub("", answer)) + ","
    return "\u00b0" in _LONE_ANGLE.sub(r"\1", s)


def _assigned_variable(answer: str) -> str | None:
    """The variable of a one-variable assignment (``x = 5``, ``x_{1}=5``), braces dropped; else None."""
    s = re.sub(r"\s+|\$", "", answer)
    m = _ASSIGNMENT.match(s) if s.count("=") == 1 else None
    return None if m is None else m.group(0)[:-1].replace("{", "").replace("}", "")


def forms_differ(predicted: str, gold: str) -> bool:
    r"""Whether two answers differ in what the value comparison ignores: an angle in degrees inside an expression
    on one side only (``\sin 60`` against ``\sin 60^\circ``: radians against degrees), assignments to different
    variables (``y = 5`` against ``x = 5``), or two different unit words (``5 cm`` against ``5 inches``). A bare
    number against an assignment or a number with a unit is not told apart (``5`` against ``x = 5``, ``5 cm``)."""
    if degrees_in_expression(predicted) != degrees_in_expression(gold):
        return True
    variables = (_assigned_variable(predicted), _assigned_variable(gold))
    if None not in variables and variables[0] != variables[1]:
        return True
    units = (answer_unit(predicted), answer_unit(gold))
    return None not in units and units[0] != units[1]


def fallback_equal(predicted: str, gold: str) -> bool:
    """Equality of normalised strings, or of their exact numeric values when both are numbers (a trailing unit
    word dropped first: `strip_unit`)."""
    p, g = normalize_answer(predicted), normalize_answer(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    pn, gn = _as_number(strip_unit(p)), _as_number(strip_unit(g))
    return pn is not None and gn is not None and pn == gn


# --- math-verify ---------------------------------------------------------------------------------


# No AIME answer (an integer 0-999) or competition answer comes near this; longer ones skip math-verify.
MAX_VERIFY_CHARS = 1000
GRADER_VERIFY = "math-verify"
GRADER_LONG = "string (long answer)"
# A worker process that grades off the main thread needs a moment to start (spawn, import sympy).
WORKER_START_S = 60.0
_worker = None
_worker_lock = threading.Lock()


def _quiet_math_verify() -> None:
    """math-verify logs each failed or timed-out parse with the whole expression (200 KB lines): keep its
    loggers to errors of its own."""
    for name in ("math_verify", "math_verify.parser", "math_verify.grader", "latex2sympy2_extended"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _verify_in_process(predicted: str, gold: str, timeout_s: float | None) -> bool:
    """math_verify_equal on the main thread of a worker process, with its signal timeout; the process is
    killed (and restarted for the next call) if it overruns by far."""
    global _worker
    import multiprocessing

    with _worker_lock:
        if _worker is None:
            _worker = multiprocessing.get_context("spawn").Pool(1)
        result = _worker.apply_async(math_verify_equal, (predicted, gold, timeout_s))
        try:
            return bool(result.get(3 * (timeout_s or 5.0) + WORKER_START_S))
        except multiprocessing.TimeoutError:
            logger.warning(
                "math-verify overran its timeout in the grading worker; graded by the string fallback"
            )
            _worker.terminate()
            _worker = None
            return False


def _signal_timeout(timeout_s: float | None) -> int | None:
    """math-verify's timeout argument: whole seconds for signal.alarm, None (no timeout) off the main thread.

    math-verify times out with SIGALRM, which can only be armed from the main thread; elsewhere it
    would raise, so there we run without a timeout.
    """
    if timeout_s is None or timeout_s <= 0:
        return None
    if threading.current_thread() is not threading.main_thread():
        return None
    return max(1, math.ceil(timeout_s))


def math_verify_equal(predicted: str, gold: str, timeout_s: float | None = 5.0) -> bool:
    """math-verify's verdict on a bare predicted answer against a bare gold answer; False on any error."""
    try:
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException
    except ImportError:  # pragma: no cover - math-verify is a core dependency
        logger.warning("math-verify is not installed; grading with the string fallback only")
        return False
    if timeout_s is not None and timeout_s > 0 and threading.current_thread() is not threading.main_thread():
        return _verify_in_process(predicted, gold, timeout_s)
    _quiet_math_verify()
    timeout = _signal_timeout(timeout_s)
    try:
        # Both sides are bare answers; boxing them makes math-verify read the whole string as one answer.
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
        pred_parsed = parse(f"\\boxed{{{predicted}}}", parsing_timeout=timeout)
        if not gold_parsed or not pred_parsed:
            return False
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))
    except (Exception, TimeoutException):
        # TimeoutException derives from BaseException, so it needs naming; any failure means "no verdict".
        logger.debug("math-verify failed on %r vs %r", predicted, gold, exc_info=True)
        return False


def grader_for(predicted: str | None) -> str:
    """Which grader `is_correct` uses for `predicted`: math-verify, or the string fallback for a long answer."""
    return GRADER_LONG if predicted is not None and len(predicted) > MAX_VERIFY_CHARS else GRADER_VERIFY


def is_correct(predicted: str | None, gold: str, timeout_s: float = 5.0) -> bool:
    """Whether a predicted answer matches the gold answer (math-verify, then the normalised fallback).

    An answer over `MAX_VERIFY_CHARS` characters goes to the string fallback only (see the module notes). Answers
    whose forms differ where both graders look past them (`forms_differ`: degrees inside an expression, the
    variable of an assignment, unit words) are not equal."""
    if predicted is None or not predicted.strip() or forms_differ(predicted, gold):
        return False
    if grader_for(predicted) == GRADER_VERIFY and math_verify_equal(predicted, gold, timeout_s):
        return True
    return fallback_equal(predicted, gold)


# --- one canonical key per answer (grouping by value without comparing pairs) --------------------------------

# Answers longer than this are keyed by their normalised text alone (math-verify is not asked to parse them).
MAX_KEY_PARSE_CHARS = 200
# A power's exponent in an answer evaluated for its key is at most this (in magnitude) and holds no other power.
_MAX_KEY_EXPONENT = 1000
# A numeric value this close to a fraction with a denominator up to `_KEY_DENOMINATOR` is that fraction.
_KEY_DENOMINATOR = 10**6
_KEY_PRECISION = 30
_KEY_MAX_DIGITS = 1000
_NEEDS_PARSE = "parse"
# Parsing evaluates a binomial or a factorial of integers exactly: with a 5-digit integer that can take minutes.
_COMBINATORIAL = re.compile(r"!|binom|choose")
_LONG_NUMBER = re.compile(r"\d{5}")


def answer_key(answer: Any) -> tuple | None:
    r"""A hashable key of an answer's value, equal for answers the grader (`is_correct`) calls equal in the usual
    forms; None for an empty answer. Keying each answer once groups a table by value without comparing pairs.

    1. The grader's fallback: `normalize_answer`, then the exact value of a plain number, ``a/b`` or
       ``\frac{a}{b}``, a unit word after it dropped (``("value", Fraction)``): ``3.5``/``3.50``/``7/2``,
       ``0.5``/``\frac{1}{2}``, ``1000``/``1,000`` and ``5 cm``/``5`` share a key, as `fallback_equal` says.
       Microseconds per answer.
    2. Any other answer (up to `MAX_KEY_PARSE_CHARS` characters) is parsed by math-verify, the grader's parser,
       without a timeout (so the key is the same on every process and every run): a number is evaluated to 30
       digits, unless a power tower or a huge exponent makes that unsafe, and keyed by its exact value when it is
       a fraction (``2^{10}`` is ``1024``) or by 12 significant digits otherwise (``\sqrt{8}`` and ``2\sqrt{2}``);
       anything else (an expression, a set, an interval) by sympy's printing of the parse (``x+1`` and ``1+x``).
       A few milliseconds per answer (math-verify's LaTeX parser).
    3. What math-verify cannot parse keeps its normalised text (``("text", ...)``).

    A key is the value alone, as the grader sees it against a bare number: ``x = 5``, ``y = 5``, ``5 cm`` and
    ``5 inches`` all key as ``5``, though the grader tells ``x = 5`` from ``y = 5`` and ``5 cm`` from ``5 inches``
    (`forms_differ`; no key can do both, since ``5`` matches each of them). An angle in degrees inside an
    expression is marked (``\sin 60^\circ`` keys apart from ``\sin 60``), as the grader tells those apart.
    """
    first = _plain_key(answer)
    return _parsed_key(first[1]) if first[0] == _NEEDS_PARSE else first[1]


def answer_keys(answers: Any) -> list[tuple | None]:
    """`answer_key` of each answer, each distinct text keyed once (and math-verify's parse of one text cached for
    the process). Plain numbers cost microseconds; each distinct other answer a few milliseconds of math-verify's
    LaTeX parser (about 6 ms on one CPU core), which is logged when it adds up to over a second."""
    start = time.perf_counter()
    first: dict[str, tuple] = {}
    for answer in answers:
        text = "" if answer is None else str(answer).strip()
        if text not in first:
            first[text] = _plain_key(text)
    keys = {text: _parsed_key(key) if kind == _NEEDS_PARSE else key for text, (kind, key) in first.items()}
    seconds = time.perf_counter() - start
    if seconds > 1:
        parsed = sum(kind == _NEEDS_PARSE for kind, _ in first.values())
        logger.info(
            "answers keyed by value in %.1f s: %d distinct, %d of them parsed by math-verify",
            seconds,
            len(first),
            parsed,
        )
    return [keys["" if answer is None else str(answer).strip()] for answer in answers]


def _plain_key(answer: Any) -> tuple[str, Any]:
    """Step 1 of `answer_key`: ("key", the key) when it decides, else (`_NEEDS_PARSE`, the answer's text)."""
    text = "" if answer is None else str(answer).strip()
    if not text:
        return ("key", None)
    normalized = normalize_answer(text)
    value = _as_number(normalized)
    value = _as_number(strip_unit(normalized)) if value is None else value
    if value is not None:
        return ("key", ("value", value))
    if len(text) > MAX_KEY_PARSE_CHARS:
        return ("key", ("text", normalize_answer(text) or text))
    return (_NEEDS_PARSE, text)


@functools.lru_cache(maxsize=1 << 16)
def _parsed_key(text: str) -> tuple:
    """Steps 2 and 3 of `answer_key` for a stripped, non-empty answer that is not a plain number."""
    fallback = ("text", normalize_answer(text) or text)
    if _COMBINATORIAL.search(text) and _LONG_NUMBER.search(text):
        return fallback  # the parse itself would compute \binom{10^6}{5 \cdot 10^5} exactly (a minute)
    try:
        import sympy
        from math_verify import parse
    except ImportError:  # pragma: no cover - math-verify is a core dependency
        return fallback
    _quiet_math_verify()
    try:
        parsed = parse(f"\\boxed{{{text}}}", parsing_timeout=None)
    except Exception:
        return fallback
    expr = parsed[0] if parsed else None
    if not isinstance(expr, sympy.Basic):
        return fallback
    if isinstance(expr, sympy.Eq) and isinstance(expr.lhs, sympy.Symbol):  # `x = ...` is its right-hand side
        expr = expr.rhs
    try:
        key = None
        if expr.is_number and _safe_to_evaluate(expr, sympy):
            key = _numeric_key(expr, sympy)
        key = key or ("expr", str(expr))
        # math-verify reads `\sin 60^\circ` as `\sin 60`; the grader tells them apart (`forms_differ`).
        return ("degrees", *key) if degrees_in_expression(text) else key
    except (
        Exception
    ):  # e.g. an integer too long to print (\binom{10^6}{5 \cdot 10^5} is computed by the parse)
        return fallback


def _safe_to_evaluate(expr, sympy) -> bool:
    """Whether evaluating `expr` numerically is quick: every power's exponent is small and holds no power of
    its own (``9^{9^{9^9}}`` would be evaluated exactly, without end)."""
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow):
            exponent = node.exp
            if exponent.is_Rational:
                if abs(exponent) > _MAX_KEY_EXPONENT:
                    return False
            elif any(
                isinstance(inner, sympy.Pow) and inner.exp != -1 or isinstance(inner, sympy.Function)
                for inner in sympy.preorder_traversal(exponent)
            ):
                return False
            elif any(
                n.is_Rational and abs(n) > _MAX_KEY_EXPONENT for n in sympy.preorder_traversal(exponent)
            ):
                return False
    return True


def _numeric_key(expr, sympy) -> tuple | None:
    """A number's key: its exact value when it is a fraction (to 20 decimals, evaluated with as many digits as its
    integer part needs), else its real and imaginary parts to 12 significant digits (so for any number of more
    than `_KEY_MAX_DIGITS` digits); None when it is not finite."""
    try:
        parts = [sympy.Float(part) for part in expr.evalf(_KEY_PRECISION).as_real_imag()]
        if not all(part.is_finite for part in parts):
            return None
        magnitude = max(abs(part) for part in parts)
        if magnitude >= sympy.Float(10) ** (_KEY_MAX_DIGITS - 25):
            return ("number", *(str(sympy.Float(part, 12)) for part in parts))
        precision = len(str(int(magnitude))) + 25  # 20 decimals and a margin
        if precision > _KEY_PRECISION:
            parts = [sympy.Float(part) for part in expr.evalf(precision).as_real_imag()]
    except (TypeError, ValueError, ArithmeticError):
        return None
    keys: list[Any] = []
    for part in parts:
        value = Fraction(str(part))
        exact = value.limit_denominator(_KEY_DENOMINATOR)
        keys.append(exact if abs(value - exact) <= Fraction(1, 10**20) else str(sympy.Float(part, 12)))
    if keys[1] == 0 and isinstance(keys[0], Fraction):
        return ("value", keys[0])
    return ("number", *(str(k) for k in keys))


def grade(text: str, gold: str, timeout_s: float = 5.0) -> dict[str, Any]:
    """Grade one completion: {"extracted": str | None, "has_box": bool, "correct": bool, "grader": str}.

    `has_box` means a complete, non-empty box was found in the answer region (the format criterion);
    `grader` is `GRADER_VERIFY` or `GRADER_LONG` (an answer over `MAX_VERIFY_CHARS`: string fallback only).
    """
    extracted = extract_boxed(text)
    return {
        "extracted": extracted,
        "has_box": extracted is not None,
        "correct": is_correct(extracted, str(gold), timeout_s),
        "grader": grader_for(extracted),
    }
