"""The built-in problem sets, which need no hub access: integer-answer problems generated deterministically from a seed,
each a training table and a held-out table, chosen by name through `BUILTIN_SETS` (name -> (training-rows
function, evaluation-rows function); an empty name is `builtin`, an unknown `builtin:<x>` is an error that
lists the names). A training row's `solution` is its worked steps ending in `The answer is $\boxed{N}$.`

* `builtin`: arithmetic word problems of one to three steps (add/subtract, boxes, sharing, linear
  equations, rectangles, sums of ranges); 2,000 training rows per seed and 30 held-out problems
  (`builtin-000`, ...). The held-out set is drawn from a disjoint seed stream and shares no problem text
  with the seed-0 training set; every seed's training set skips it.
* `builtin:easy`: a ladder of one-step arithmetic for the embedded SmolLM2-135M-Instruct (one-digit sums,
  a two-digit number plus a digit, differences with a positive result, one-digit products), worded like
  competition problems (`Evaluate $3+4$.`, `Find $3+4$. Express your answer as a whole number.`): plain
  wordings (`What is 3 + 4?`) almost never get a `\boxed{}` answer from that model, these get one in a few
  percent of samples. 40 held-out problems (`easy-000`, ...) and 1,438 training rows: the rest of the
  ladder, in an order set by the seed. Held out means unseen text: 36 of the 40 held-out expressions are
  training rows under the other wording.
* `builtin:easy-disjoint`: the same training rows as `builtin:easy`, and 100 held-out problems
  (`easy-disjoint-000`, ...) held out by arithmetic: in the ladder's wordings, but no operation and
  operands of theirs occur anywhere in the ladder (sums past 60 or of two two-digit terms, differences
  from numbers past 20, a digit times 11 to 15; a + b and b + a count as the same arithmetic).
"""

from __future__ import annotations

import random
from typing import Any

BUILTIN = "builtin"
EASY = "builtin:easy"
EASY_DISJOINT = "builtin:easy-disjoint"

# ---------------------------------------------------------------------------------------------------------
# Built-in problems. Each template returns (problem, worked steps, answer); the steps double as the
# reference solution and, in a longer wording, as the reasoning trace (`COT_Reason`).

_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jon", "Kira", "Liam"]
_ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cards", "shells"]


def _t_add_sub(rng: random.Random) -> tuple[str, list[str], int]:
    n, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(5, 40), rng.randint(2, 30), rng.randint(1, 20)
    c = min(c, a + b)
    return (
        f"{n} has {a} {item}, gets {b} more, then gives away {c}. How many {item} does {n} have now?",
        [f"{a} + {b} = {a + b}", f"{a + b} - {c} = {a + b - c}"],
        a + b - c,
    )


def _t_mul(rng: random.Random) -> tuple[str, list[str], int]:
    n, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    boxes, per, extra = rng.randint(2, 9), rng.randint(2, 12), rng.randint(0, 9)
    return (
        f"{n} fills {boxes} boxes with {per} {item} each and has {extra} {item} left over. "
        f"How many {item} did {n} start with?",
        [f"{boxes} * {per} = {boxes * per}", f"{boxes * per} + {extra} = {boxes * per + extra}"],
        boxes * per + extra,
    )


def _t_div(rng: random.Random) -> tuple[str, list[str], int]:
    kids, each = rng.randint(2, 8), rng.randint(2, 15)
    item = rng.choice(_ITEMS)
    total = kids * each
    return (
        f"{total} {item} are shared equally among {kids} children. How many {item} does each child get?",
        [f"{total} / {kids} = {each}"],
        each,
    )


def _t_linear(rng: random.Random) -> tuple[str, list[str], int]:
    x, a, b = rng.randint(1, 20), rng.randint(2, 9), rng.randint(1, 30)
    return (
        f"If {a}x + {b} = {a * x + b}, what is x?",
        [f"{a}x = {a * x + b} - {b} = {a * x}", f"x = {a * x} / {a} = {x}"],
        x,
    )


def _t_rect(rng: random.Random) -> tuple[str, list[str], int]:
    w, h = rng.randint(2, 25), rng.randint(2, 25)
    return (
        f"A rectangle is {w} units wide and {h} units tall. What is its perimeter plus its area?",
        [
            f"perimeter = 2 * ({w} + {h}) = {2 * (w + h)}",
            f"area = {w} * {h} = {w * h}",
            f"{2 * (w + h)} + {w * h} = {2 * (w + h) + w * h}",
        ],
        2 * (w + h) + w * h,
    )


def _t_sum_range(rng: random.Random) -> tuple[str, list[str], int]:
    n = rng.randint(3, 30)
    return (
        f"What is the sum of the integers from 1 to {n}?",
        [f"1 + 2 + ... + {n} = {n} * {n + 1} / 2 = {n * (n + 1) // 2}"],
        n * (n + 1) // 2,
    )


_TEMPLATES = (_t_add_sub, _t_mul, _t_div, _t_linear, _t_rect, _t_sum_range)


def _problem_stream(seed: int, templates: tuple = _TEMPLATES):
    """(problem, worked steps, answer) drawn forever from `templates`, deterministic in `seed`."""
    rng = random.Random(seed)
    while True:
        yield rng.choice(templates)(rng)


def _training_row(problem: str, steps: list[str], answer: int, index: int) -> dict[str, Any]:
    """A row in the training schema; the steps are the solution and, reworded, the reasoning trace."""
    return {
        "problem": problem,
        "solution": " ".join(steps) + f". The answer is $\\boxed{{{answer}}}$.",
        "Answer": str(answer),
        "COT_Reason": "Let me work through this carefully. "
        + " Then ".join(f"I compute {s}." for s in steps)
        + f" Checking the arithmetic again confirms it, so the final answer is {answer}.",
        "generated_token_count": 900 * len(steps) + 37 * (index % 11),
    }


def builtin_train_rows(n: int = 2000, seed: int = 0, exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """`n` distinct training problems in the training schema, deterministic in `seed`.

    Problems in `exclude` (by default the built-in evaluation set, whatever the seed) are skipped.
    `generated_token_count` grows with the number of steps so that `hard_numeric` keeps the harder part.
    """
    if exclude is None:
        exclude = {r["problem"] for r in builtin_eval_rows()}
    rows, seen = [], set(exclude)
    for problem, steps, answer in _problem_stream(seed):
        if problem in seen:
            continue
        seen.add(problem)
        rows.append(_training_row(problem, steps, answer, len(rows)))
        if len(rows) == n:
            return rows


def builtin_eval_rows(n: int = 30, seed: int = 2024) -> list[dict[str, str]]:
    """`n` held-out problems in the AIME schema, none of whose texts occur in the default training set."""
    # The seed-0 set without exclusions; it shares nothing with these rows, so excluding them from it
    # (the default) changes nothing, and every other seed's training set skips them too.
    train = {r["problem"] for r in builtin_train_rows(exclude=set())}
    rows = []
    for problem, _, answer in _problem_stream(seed):
        if problem in train or any(r["problem"] == problem for r in rows):
            continue
        rows.append({"id": f"builtin-{len(rows):03d}", "problem": problem, "answer": str(answer)})
        if len(rows) == n:
            return rows


# ---------------------------------------------------------------------------------------------------------
# `builtin:easy`: a ladder of one-step arithmetic that the embedded SmolLM2-135M-Instruct partly solves.
# Its wording follows what that model answers best (math-style `$a+b$`, "Express your answer as a whole
# number."); the base model writes a complete \boxed{} in a few percent of samples, so the format and the
# answer both have room to move. Levels: one-digit sums, sums with a two-digit term, differences, products.


def _e_sum(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    wording = rng.choice(("Evaluate ${a}+{b}$.", "Find ${a}+{b}$. Express your answer as a whole number."))
    return wording.format(a=a, b=b), [f"{a} + {b} = {a + b}"], a + b


def _e_sum_tens(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(10, 60), rng.randint(1, 9)
    wording = rng.choice(("Evaluate ${a}+{b}$.", "Find ${a}+{b}$. Express your answer as a whole number."))
    return wording.format(a=a, b=b), [f"{a} + {b} = {a + b}"], a + b


def _e_diff(rng: random.Random) -> tuple[str, list[str], int]:
    b = rng.randint(1, 9)
    a = rng.randint(b + 1, 20)
    wording = rng.choice(("Evaluate ${a}-{b}$.", "Find ${a}-{b}$. Express your answer as a whole number."))
    return wording.format(a=a, b=b), [f"{a} - {b} = {a - b}"], a - b


def _e_prod(rng: random.Random) -> tuple[str, list[str], int]:
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    wording = rng.choice(
        ("Evaluate ${a} \\times {b}$.", "Find ${a} \\times {b}$. Express your answer as a whole number.")
    )
    return wording.format(a=a, b=b), [f"{a} * {b} = {a * b}"], a * b


_EASY_TEMPLATES = (_e_sum, _e_sum, _e_sum_tens, _e_diff, _e_prod)
EASY_EVAL_SIZE = 40


def easy_eval_rows(n: int = EASY_EVAL_SIZE, seed: int = 7) -> list[dict[str, str]]:
    """`n` held-out `builtin:easy` problems in the AIME schema (ids `easy-000`, ...)."""
    rows, seen = [], set()
    for problem, _, answer in _problem_stream(seed, _EASY_TEMPLATES):
        if problem in seen:
            continue
        seen.add(problem)
        rows.append({"id": f"easy-{len(rows):03d}", "problem": problem, "answer": str(answer)})
        if len(rows) == n:
            return rows


def easy_train_rows(n: int = 2000, seed: int = 0, exclude: set[str] | None = None) -> list[dict[str, Any]]:
    """Up to `n` distinct `builtin:easy` training problems (the ladder holds fewer: about 1,000), never a
    held-out one; deterministic in `seed`."""
    if exclude is None:
        exclude = {r["problem"] for r in easy_eval_rows()}
    rows, seen, misses = [], set(exclude), 0
    for problem, steps, answer in _problem_stream(seed + 1_000, _EASY_TEMPLATES):
        if problem in seen:
            misses += 1
            if misses > 20_000:  # every problem of the ladder has been drawn
                return rows
            continue
        misses = 0
        seen.add(problem)
        rows.append(_training_row(problem, steps, answer, len(rows)))
        if len(rows) == n:
            return rows


# ---------------------------------------------------------------------------------------------------------
# `builtin:easy-disjoint`: held-out problems whose arithmetic is outside the `builtin:easy` ladder, in the
# ladder's two wordings. The ladder adds one- or two-digit numbers up to 60 to a digit, subtracts a digit
# from at most 20, and multiplies two digits; these go past each range, one level each.


def _x_sum_high(rng: random.Random) -> tuple[int, str, int]:
    return rng.randint(61, 99), "+", rng.randint(1, 9)  # a digit added to a number above 60


def _x_sum_teens(rng: random.Random) -> tuple[int, str, int]:
    return rng.randint(10, 19), "+", rng.randint(10, 19)  # two two-digit terms


def _x_diff_high(rng: random.Random) -> tuple[int, str, int]:
    return rng.randint(21, 50), "-", rng.randint(1, 9)  # a digit taken from a number above 20


def _x_prod_teens(rng: random.Random) -> tuple[int, str, int]:
    return rng.randint(2, 9), "*", rng.randint(11, 15)  # a digit times a number from 11 to 15


_DISJOINT_LEVELS = (_x_sum_high, _x_sum_teens, _x_diff_high, _x_prod_teens)
_EASY_WORDINGS = ("Evaluate ${e}$.", "Find ${e}$. Express your answer as a whole number.")
EASY_DISJOINT_SIZE = 100


def easy_disjoint_eval_rows(n: int = EASY_DISJOINT_SIZE, seed: int = 11) -> list[dict[str, str]]:
    """`n` held-out problems (ids `easy-disjoint-000`, ...) whose operation and operands never occur in the
    `builtin:easy` ladder, training or held-out (nor twice here: a + b and b + a count as one)."""
    rows, seen = [], set()
    rng = random.Random(seed)
    while len(rows) < n:
        a, op, b = rng.choice(_DISJOINT_LEVELS)(rng)
        wording = rng.choice(_EASY_WORDINGS)
        key = (op, min(a, b), max(a, b)) if op in "+*" else (op, a, b)
        if key in seen:
            continue
        seen.add(key)
        shown = {"+": f"{a}+{b}", "-": f"{a}-{b}", "*": f"{a} \\times {b}"}[op]
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        problem = wording.format(e=shown)
        rows.append({"id": f"easy-disjoint-{len(rows):03d}", "problem": problem, "answer": str(answer)})
    return rows


# Built-in sets by name: (training rows, called with `seed=`; evaluation rows, called with no argument).
BUILTIN_SETS = {
    BUILTIN: (builtin_train_rows, builtin_eval_rows),
    EASY: (easy_train_rows, easy_eval_rows),
    EASY_DISJOINT: (easy_train_rows, easy_disjoint_eval_rows),
}
