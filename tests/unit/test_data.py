"""Tests for opsd.data: built-in problems, docs/method.md §2 filters, and loading local JSON/JSONL/Parquet tables."""

from __future__ import annotations

import hashlib
import json
import logging
import re

import pytest
from datasets import Dataset

from opsd.data import loading
from opsd.data.builtin import (
    BUILTIN_SETS,
    EASY_DISJOINT_SIZE,
    builtin_eval_rows,
    builtin_train_rows,
    easy_disjoint_eval_rows,
    easy_eval_rows,
    easy_train_rows,
)
from opsd.data.loading import (
    TRAIN_COLUMNS,
    DataError,
    filter_rows,
    is_numeric_answer,
    load_eval_dataset,
    load_table,
    load_train_dataset,
)

TRAIN_COLS = ["problem", "solution", "Answer", "COT_Reason", "generated_token_count"]


# ---------------------------------------------------------------------------------------------------------
# An independent solver for the built-in templates: it reads the numbers back out of the problem text.


def _div(total: int, kids: int) -> int:
    assert total % kids == 0, f"{total} is not divisible by {kids}"
    return total // kids


def _linear(a: int, b: int, rhs: int) -> int:
    assert (rhs - b) % a == 0, f"{a}x + {b} = {rhs} has no integer solution"
    return (rhs - b) // a


SOLVERS = {
    "add_sub": (
        re.compile(
            r"(\w+) has (\d+) (\w+), gets (\d+) more, then gives away (\d+)\. How many \3 does \1 have now\?"
        ),
        lambda m: int(m[2]) + int(m[4]) - int(m[5]),
    ),
    "mul": (
        re.compile(
            r"(\w+) fills (\d+) boxes with (\d+) (\w+) each and has (\d+) \4 left over\. "
            r"How many \4 did \1 start with\?"
        ),
        lambda m: int(m[2]) * int(m[3]) + int(m[5]),
    ),
    "div": (
        re.compile(
            r"(\d+) (\w+) are shared equally among (\d+) children\. How many \2 does each child get\?"
        ),
        lambda m: _div(int(m[1]), int(m[3])),
    ),
    "linear": (
        re.compile(r"If (\d+)x \+ (\d+) = (\d+), what is x\?"),
        lambda m: _linear(int(m[1]), int(m[2]), int(m[3])),
    ),
    "rect": (
        re.compile(
            r"A rectangle is (\d+) units wide and (\d+) units tall\. What is its perimeter plus its area\?"
        ),
        lambda m: 2 * int(m[1]) + 2 * int(m[2]) + int(m[1]) * int(m[2]),
    ),
    "sum_range": (
        re.compile(r"What is the sum of the integers from 1 to (\d+)\?"),
        lambda m: sum(range(1, int(m[1]) + 1)),
    ),
}


def solve(problem: str) -> tuple[str, int]:
    hits = [(name, fn(m)) for name, (rx, fn) in SOLVERS.items() if (m := rx.fullmatch(problem))]
    assert len(hits) == 1, f"problem matches {len(hits)} templates: {problem!r}"
    return hits[0]


def test_solver_on_hand_written_problems():
    assert solve("Ava has 10 apples, gets 5 more, then gives away 3. How many apples does Ava have now?") == (
        "add_sub",
        12,
    )
    assert solve("If 3x + 4 = 19, what is x?") == ("linear", 5)
    assert solve("What is the sum of the integers from 1 to 4?") == ("sum_range", 10)
    with pytest.raises(AssertionError):
        solve("What is the product of 2 and 3?")


# ---------------------------------------------------------------------------------------------------------
# Built-in rows


def test_builtin_train_rows_deterministic_and_seed_dependent():
    a = builtin_train_rows(n=100, seed=3)
    b = builtin_train_rows(n=100, seed=3)
    c = builtin_train_rows(n=100, seed=4)
    assert a == b
    assert len(a) == len(c) == 100
    pa, pc = [r["problem"] for r in a], [r["problem"] for r in c]
    assert pa != pc
    assert len(set(pa) & set(pc)) < 50


def test_builtin_train_rows_schema_and_types():
    rows = builtin_train_rows()
    assert len(rows) == 2000
    assert len({r["problem"] for r in rows}) == 2000
    for r in rows:
        assert list(r) == TRAIN_COLS
        assert all(isinstance(r[k], str) and r[k] for k in ("problem", "solution", "Answer", "COT_Reason"))
        assert isinstance(r["generated_token_count"], int) and r["generated_token_count"] > 0


def test_builtin_answers_are_correct():
    rows = builtin_train_rows() + builtin_train_rows(n=500, seed=42)
    templates_seen = set()
    for r in rows:
        name, answer = solve(r["problem"])
        templates_seen.add(name)
        assert r["Answer"] == str(answer), r["problem"]
        assert r["solution"].endswith(f"The answer is $\\boxed{{{answer}}}$.")
        assert r["COT_Reason"].endswith(f"so the final answer is {answer}.")
        assert is_numeric_answer(r["Answer"])
    assert templates_seen == set(SOLVERS)


def test_builtin_eval_rows_schema_answers_and_ids():
    rows = builtin_eval_rows()
    assert len(rows) == 30
    assert [r["id"] for r in rows] == [f"builtin-{i:03d}" for i in range(30)]
    assert len({r["problem"] for r in rows}) == 30
    for r in rows:
        assert set(r) == {"id", "problem", "answer"}
        assert r["answer"] == str(solve(r["problem"])[1])
    assert builtin_eval_rows() == rows


@pytest.mark.parametrize("seed", [0, 1, 7, 42])
def test_builtin_eval_disjoint_from_train(seed):
    # Seed 42 is the capped run's seed; the training set must never contain an evaluation problem.
    eval_problems = {r["problem"] for r in builtin_eval_rows()}
    train = builtin_train_rows(seed=seed)
    assert len(train) == 2000
    assert not eval_problems & {r["problem"] for r in train}
    ds = load_train_dataset("builtin", seed=seed)
    assert not eval_problems & set(ds["problem"])


def test_load_builtin_names():
    assert load_train_dataset("builtin", seed=5).to_list() == builtin_train_rows(seed=5)
    assert load_train_dataset("", seed=5).to_list() == builtin_train_rows(seed=5)
    assert load_eval_dataset("builtin") == builtin_eval_rows()
    assert load_eval_dataset("") == builtin_eval_rows()


def _digest(rows) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def test_builtin_set_is_unchanged():
    # `builtin` predates `builtin:easy`; runs and results depend on these exact rows.
    rows = builtin_eval_rows()
    assert len(rows) == 30
    assert rows[0] == {"id": "builtin-000", "problem": "If 6x + 7 = 43, what is x?", "answer": "6"}
    assert _digest(rows) == "69216d05d13b32eba162ac26bdb4eb3b4ff5b714cfcae267384f4daf16133af3"
    train = builtin_train_rows()
    assert train[0]["problem"] == "If 2x + 9 = 37, what is x?"
    assert _digest(train) == "d5dd5bf8702593ea3488100d58be98db6d6d3c91f51f523ab903068c91f6c569"
    assert (
        _digest(builtin_train_rows(seed=42))
        == "434f2a7890f27b899720d124823165ea1e096094d870a6eda9e61cb5ee1b2f94"
    )


# ---------------------------------------------------------------------------------------------------------
# `builtin:easy`: an independent solver reads the operation back out of the problem text.

EASY_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "\\times": lambda a, b: a * b}
EASY_RX = re.compile(
    r"(?:Evaluate \$(?P<a>\d+) ?(?P<op>\+|-|\\times) ?(?P<b>\d+)\$\."
    r"|Find \$(?P<a2>\d+) ?(?P<op2>\+|-|\\times) ?(?P<b2>\d+)\$\. Express your answer as a whole number\.)"
)
EASY_STEP = re.compile(r"(\d+) ([+*-]) (\d+) = (\d+)")


def easy_level(problem: str) -> tuple[str, int]:
    """(level, answer) of a `builtin:easy` problem, from its text alone."""
    m = EASY_RX.fullmatch(problem)
    assert m, f"not a builtin:easy problem: {problem!r}"
    a, op, b = (int(m["a"] or m["a2"]), m["op"] or m["op2"], int(m["b"] or m["b2"]))
    answer = EASY_OPS[op](a, b)
    if op == "\\times":
        assert 2 <= a <= 9 and 2 <= b <= 9, problem
        return "product", answer
    if op == "-":
        assert 1 <= b < a <= 20, problem  # a positive result
        return "difference", answer
    assert 1 <= b <= 9, problem
    assert 1 <= a <= 9 or 10 <= a <= 60, problem
    return ("sum" if a <= 9 else "sum_tens"), answer


def test_easy_solver_on_hand_written_problems():
    assert easy_level("Evaluate $3+4$.") == ("sum", 7)
    assert easy_level("Find $12-5$. Express your answer as a whole number.") == ("difference", 7)
    assert easy_level("Evaluate $6 \\times 7$.") == ("product", 42)
    assert easy_level("Evaluate $40+2$.") == ("sum_tens", 42)
    with pytest.raises(AssertionError):
        easy_level("What is 3 + 4?")


def test_easy_train_rows_schema_levels_and_answers():
    rows = easy_train_rows()
    # The ladder holds 1,478 problems (two wordings each); the 40 held-out ones are left out.
    assert len(rows) == 1438
    assert len({r["problem"] for r in rows}) == len(rows)
    levels = set()
    for r in rows:
        assert list(r) == TRAIN_COLS
        assert all(isinstance(r[k], str) and r[k] for k in ("problem", "solution", "Answer", "COT_Reason"))
        assert isinstance(r["generated_token_count"], int) and r["generated_token_count"] > 0
        level, answer = easy_level(r["problem"])
        levels.add(level)
        assert r["Answer"] == str(answer) and is_numeric_answer(r["Answer"]) and answer >= 0
        assert r["solution"].endswith(f"The answer is $\\boxed{{{answer}}}$.")
        assert r["COT_Reason"].endswith(f"so the final answer is {answer}.")
        # The worked step is right and ends at the answer.
        steps = EASY_STEP.findall(r["solution"])
        assert steps, r["solution"]
        for a, op, b, result in steps:
            assert EASY_OPS[{"*": "\\times"}.get(op, op)](int(a), int(b)) == int(result), r["solution"]
        assert int(steps[-1][3]) == answer
    assert levels == {"sum", "sum_tens", "difference", "product"}
    assert {r["problem"].split()[0] for r in rows} == {"Evaluate", "Find"}


def test_easy_train_rows_deterministic_and_seed_dependent():
    a, b, c = easy_train_rows(seed=3), easy_train_rows(seed=3), easy_train_rows(seed=4)
    assert a == b
    pa, pc = [r["problem"] for r in a], [r["problem"] for r in c]
    # The seed sets the order (what a run sees first); the whole ladder is used, so the set is the same.
    assert pa != pc and set(pa) == set(pc)
    assert [r["problem"] for r in easy_train_rows(n=100, seed=3)] == pa[:100]
    assert load_train_dataset("builtin:easy", seed=4).to_list() == c


def test_easy_eval_rows_schema_answers_and_ids():
    rows = easy_eval_rows()
    assert len(rows) == 40
    assert [r["id"] for r in rows] == [f"easy-{i:03d}" for i in range(40)]
    assert len({r["problem"] for r in rows}) == 40
    levels = set()
    for r in rows:
        assert set(r) == {"id", "problem", "answer"}
        level, answer = easy_level(r["problem"])
        levels.add(level)
        assert r["answer"] == str(answer)
    assert levels == {"sum", "sum_tens", "difference", "product"}
    assert easy_eval_rows() == rows
    # Pinned: the learning benchmark's held-out results (docs/results.md, Does training make the model
    # better?) are on exactly these problems.
    assert rows[0] == {"id": "easy-000", "problem": "Evaluate $19+7$.", "answer": "26"}
    assert _digest(rows) == "9e8f4d4ba0e4fa537c78c42767d672bf330b77889aa5653692dd4092a6f50620"


@pytest.mark.parametrize("seed", [0, 1, 7, 42])
def test_easy_eval_disjoint_from_train(seed):
    eval_problems = {r["problem"] for r in easy_eval_rows()}
    assert not eval_problems & {r["problem"] for r in easy_train_rows(seed=seed)}
    assert not eval_problems & set(load_train_dataset("builtin:easy", seed=seed)["problem"])


# ---------------------------------------------------------------------------------------------------------
# `builtin:easy-disjoint`: held out by arithmetic. An independent parser reads the operation and operands
# back out of every text, of these rows and of the whole `builtin:easy` ladder.


def arithmetic(problem: str) -> tuple[str, int, int]:
    """(operation, operands) of a problem in the ladder's wordings; a + b is b + a, a x b is b x a."""
    m = EASY_RX.fullmatch(problem)
    assert m, f"not in the ladder's wording: {problem!r}"
    a, op, b = (int(m["a"] or m["a2"]), m["op"] or m["op2"], int(m["b"] or m["b2"]))
    return (op, *sorted((a, b))) if op in ("+", "\\times") else (op, a, b)


def disjoint_level(op: str, a: int, b: int) -> str:
    if op == "-":
        assert 21 <= a <= 50 and 1 <= b <= 9
        return "difference past 20"
    if op == "\\times":
        assert 2 <= a <= 9 and 11 <= b <= 15
        return "digit times 11-15"
    if a >= 10:
        assert 10 <= a <= b <= 19
        return "two two-digit terms"
    assert 1 <= a <= 9 and 61 <= b <= 99
    return "sum past 60"


def test_easy_disjoint_rows_schema_answers_ids_and_digest():
    rows = easy_disjoint_eval_rows()
    assert len(rows) == EASY_DISJOINT_SIZE == 100
    assert [r["id"] for r in rows] == [f"easy-disjoint-{i:03d}" for i in range(100)]
    keys = [arithmetic(r["problem"]) for r in rows]
    assert len(set(keys)) == 100  # no arithmetic twice, in either wording or order
    for r, (op, a, b) in zip(rows, keys, strict=True):
        assert set(r) == {"id", "problem", "answer"}
        assert r["answer"] == str(EASY_OPS[op](a, b))
    levels = {disjoint_level(*k) for k in keys}
    assert levels == {"difference past 20", "digit times 11-15", "two two-digit terms", "sum past 60"}
    assert {r["problem"].split()[0] for r in rows} == {"Evaluate", "Find"}
    assert easy_disjoint_eval_rows() == rows
    # Pinned, as the other built-in sets: results on it are on exactly these problems.
    assert rows[0] == {"id": "easy-disjoint-000", "problem": "Evaluate $9 \\times 14$.", "answer": "126"}
    assert _digest(rows) == "b722fc1356bc15e9d011dc44808ad3684859ece484139fb7f4c962ef82f54da4"


@pytest.mark.parametrize("seed", [0, 42, 43])
def test_easy_disjoint_shares_no_arithmetic_with_the_ladder(seed):
    ladder = [r["problem"] for r in easy_train_rows(seed=seed)] + [r["problem"] for r in easy_eval_rows()]
    seen = {arithmetic(p) for p in ladder}
    # The whole ladder, orders merged: 45 one-digit sums, 459 with a two-digit term, 135 differences, 36 products.
    assert len(seen) == 45 + 459 + 135 + 36
    assert not {arithmetic(r["problem"]) for r in load_eval_dataset("builtin:easy-disjoint")} & seen
    # The check has teeth: `builtin:easy`'s own held-out set is held out by wording only (36 of its 40
    # expressions are training rows under the other wording, and 2 more, 2 x 5, as 5 x 2).
    train = {arithmetic(r["problem"]) for r in easy_train_rows(seed=seed)}
    assert sum(arithmetic(r["problem"]) in train for r in easy_eval_rows()) == 38
    # Training under this name is training on `builtin:easy`.
    assert load_train_dataset("builtin:easy-disjoint", seed=seed).to_list() == easy_train_rows(seed=seed)


def test_builtin_sets_table_selects_by_name():
    assert list(BUILTIN_SETS) == ["builtin", "builtin:easy", "builtin:easy-disjoint"]
    assert load_eval_dataset("builtin:easy") == easy_eval_rows()
    assert load_eval_dataset("builtin:easy-disjoint") == easy_disjoint_eval_rows()
    assert load_train_dataset("builtin:easy", seed=5).to_list() == easy_train_rows(seed=5)
    assert not {r["problem"] for r in easy_eval_rows()} & {r["problem"] for r in builtin_eval_rows()}
    # Filters apply as to any other table: one-step rows are never `hard_numeric`.
    assert len(load_train_dataset("builtin:easy", data_filter="numeric")) == 1438
    with pytest.raises(ValueError, match="removed every row"):
        load_train_dataset("builtin:easy", data_filter="hard_numeric")


def test_builtin_sets_table_takes_a_new_set_in_one_entry(monkeypatch):
    train = [_row("2", 900)]
    held_out = [{"id": "tiny-000", "problem": "What is 2+2?", "answer": "4"}]
    monkeypatch.setitem(BUILTIN_SETS, "builtin:tiny", (lambda seed=0: train, lambda: held_out))
    assert load_train_dataset("builtin:tiny").to_list() == train
    assert load_eval_dataset("builtin:tiny") == held_out


@pytest.mark.parametrize("name", ["builtin:hard", "builtin:", "builtin:Easy", "builtin:easy "])
def test_unknown_builtin_name_lists_the_valid_ones(name):
    for load in (load_train_dataset, load_eval_dataset):
        with pytest.raises(ValueError) as e:
            load(name)
        msg = str(e.value)
        assert repr(name) in msg
        assert "'builtin'" in msg and "'builtin:easy'" in msg


def test_names_that_only_look_builtin_are_files(tmp_path):
    # Only `builtin` and `builtin:<x>` are built-in names; a file called builtin.jsonl is a file.
    path = _write(tmp_path / "builtin.jsonl", TRAIN_ROWS)
    assert load_train_dataset(str(path))["Answer"] == ["12", "1.5", "-3", "8"]


def test_builtin_hard_numeric_keeps_long_rows():
    rows = builtin_train_rows()
    expected = [r["problem"] for r in rows if r["generated_token_count"] >= 2000]
    assert 0 < len(expected) < len(rows)
    ds = load_train_dataset("builtin", data_filter="hard_numeric")
    assert ds["problem"] == expected
    assert len(load_train_dataset("builtin", data_filter="numeric")) == 2000


# ---------------------------------------------------------------------------------------------------------
# Filters


@pytest.mark.parametrize("answer", ["12", "-7", "999999", "0", "-999999", "007", " 12 ", "12\n"])
def test_numeric_accepts(answer):
    # Surrounding whitespace is stripped before the check.
    assert is_numeric_answer(answer)


@pytest.mark.parametrize(
    "answer",
    [
        "1234567",
        "-1234567",
        "1.5",
        "\\frac{1}{2}",
        "",
        " ",
        "+12",
        "1 2",
        "12a",
        "--3",
        "1,000",
        "\\boxed{12}",
        "None",
    ],
)
def test_numeric_rejects(answer):
    assert not is_numeric_answer(answer)


def test_numeric_accepts_int_values():
    assert is_numeric_answer(12)
    assert not is_numeric_answer(1234567)
    assert not is_numeric_answer(1.5)


def _row(answer: str, tokens: int | None, i: int = 0) -> dict:
    return {
        "problem": f"problem {i}",
        "solution": f"solution {i}",
        "Answer": answer,
        "COT_Reason": f"cot {i}",
        "generated_token_count": tokens,
    }


MIXED = [
    ("12", 2500),
    ("-7", 1999),
    ("999999", 2000),
    ("1234567", 5000),
    ("1.5", 3000),
    ("\\frac{1}{2}", 4000),
    ("", 2500),
    ("42", None),
    ("5", 100),
]


def _mixed_ds() -> Dataset:
    return Dataset.from_list([_row(a, t, i) for i, (a, t) in enumerate(MIXED)])


def test_filter_none_keeps_everything(caplog):
    caplog.set_level(logging.INFO, logger="opsd.data.loading")
    ds = filter_rows(_mixed_ds(), "none")
    assert len(ds) == 9
    assert "9 -> 9" in caplog.text


def test_filter_numeric(caplog):
    caplog.set_level(logging.INFO, logger="opsd.data.loading")
    ds = filter_rows(_mixed_ds(), "numeric")
    assert ds["Answer"] == ["12", "-7", "999999", "42", "5"]
    assert ds["problem"] == ["problem 0", "problem 1", "problem 2", "problem 7", "problem 8"]
    assert "numeric" in caplog.text and "9 -> 5" in caplog.text


def test_filter_hard_numeric(caplog):
    caplog.set_level(logging.INFO, logger="opsd.data.loading")
    ds = filter_rows(_mixed_ds(), "hard_numeric")
    assert ds["Answer"] == ["12", "999999"]
    assert ds["generated_token_count"] == [2500, 2000]
    assert "hard_numeric" in caplog.text and "9 -> 2" in caplog.text


def test_filter_unknown_names_allowed_values():
    with pytest.raises(ValueError) as e:
        filter_rows(_mixed_ds(), "hard")
    msg = str(e.value)
    assert "'hard'" in msg
    for allowed in ("none", "numeric", "hard_numeric"):
        assert f"'{allowed}'" in msg


def test_filter_removing_everything_is_an_error():
    ds = Dataset.from_list([_row("1.5", 3000, 0), _row("7", 10, 1)])
    with pytest.raises(ValueError, match="removed every row"):
        filter_rows(ds, "hard_numeric")
    assert len(filter_rows(ds, "numeric")) == 1


# ---------------------------------------------------------------------------------------------------------
# Local files

TRAIN_ROWS = [
    _row("12", 2500, 0),
    _row("1.5", 3000, 1),
    _row("-3", 2100, 2),
    _row("8", 50, 3),
]


def _write(path, rows):
    if path.suffix == ".json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif path.suffix == ".parquet":
        Dataset.from_list(rows).to_parquet(str(path))
    else:
        raise AssertionError(path)
    return path


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_load_table_local_formats(tmp_path, suffix):
    path = _write(tmp_path / f"train{suffix}", TRAIN_ROWS)
    ds = load_table(str(path), required=tuple(TRAIN_COLS))
    assert len(ds) == 4
    assert ds.to_list() == TRAIN_ROWS


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_load_train_dataset_from_file_with_filters(tmp_path, suffix):
    path = _write(tmp_path / f"train{suffix}", TRAIN_ROWS)
    assert load_train_dataset(str(path))["Answer"] == ["12", "1.5", "-3", "8"]
    assert load_train_dataset(str(path), data_filter="numeric")["Answer"] == ["12", "-3", "8"]
    hard = load_train_dataset(str(path), data_filter="hard_numeric")
    assert hard["problem"] == ["problem 0", "problem 2"]


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_missing_columns_named_with_file(tmp_path, suffix):
    rows = [{"problem": "p", "solution": "s", "Answer": "1"}]
    path = _write(tmp_path / f"partial{suffix}", rows)
    with pytest.raises(ValueError) as e:
        load_train_dataset(str(path))
    msg = str(e.value)
    assert str(path) in msg
    assert "COT_Reason" in msg and "generated_token_count" in msg
    # Present columns are not reported as missing.
    assert "lacks column(s) ['COT_Reason', 'generated_token_count']" in msg


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_missing_file(tmp_path, suffix):
    path = tmp_path / "sub" / f"nope{suffix}"
    with pytest.raises(FileNotFoundError) as e:
        load_train_dataset(str(path))
    assert str(path) in str(e.value)
    with pytest.raises(FileNotFoundError) as e:
        load_eval_dataset(str(path))
    assert str(path) in str(e.value)


@pytest.mark.parametrize("name", ["train.tsv", "train.txt", "train"])
def test_wrong_suffix(tmp_path, name):
    path = tmp_path / name
    path.write_text("problem,answer\n1+1,2\n", encoding="utf-8")
    with pytest.raises(ValueError) as e:
        load_table(str(path), required=("problem",))
    msg = str(e.value)
    assert str(path) in msg
    assert ".json" in msg and ".jsonl" in msg and ".csv" in msg and ".parquet" in msg


def test_suffix_is_case_insensitive(tmp_path):
    path = _write(tmp_path / "t.jsonl", TRAIN_ROWS)
    upper = path.rename(tmp_path / "T.JSONL")
    assert len(load_table(str(upper), required=("problem",))) == 4


def test_directory_without_data_files(tmp_path):
    d = tmp_path / "data.json"
    d.mkdir()
    (d / "notes.txt").write_text("not data")
    with pytest.raises(FileNotFoundError, match=r"holds no \.json, \.jsonl, \.csv or \.parquet files"):
        load_table(str(d), required=("problem",))


AIME_ROWS = [
    {"problem": "Find the remainder when 2^10 is divided by 7.", "answer": 2},
    {"problem": "How many primes are less than 20?", "answer": "8"},
    {"problem": "Compute 10 + 23.", "answer": "033"},
]


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_eval_file_without_id_gets_positions(tmp_path, suffix):
    rows = [{"problem": r["problem"], "answer": str(r["answer"])} for r in AIME_ROWS]
    path = _write(tmp_path / f"aime{suffix}", rows)
    assert load_eval_dataset(str(path)) == [
        {"id": "0", "problem": "Find the remainder when 2^10 is divided by 7.", "answer": "2"},
        {"id": "1", "problem": "How many primes are less than 20?", "answer": "8"},
        {"id": "2", "problem": "Compute 10 + 23.", "answer": "033"},
    ]


def test_eval_file_keeps_ids_and_stringifies(tmp_path):
    rows = [
        {"id": 60, "problem": "P one", "solution": "s", "answer": 33, "url": "u"},
        {"id": 61, "problem": "P two", "solution": "s", "answer": 204, "url": "u"},
    ]
    path = _write(tmp_path / "aime.jsonl", rows)
    assert load_eval_dataset(str(path)) == [
        {"id": "60", "problem": "P one", "answer": "33"},
        {"id": "61", "problem": "P two", "answer": "204"},
    ]


def test_eval_file_missing_answer(tmp_path):
    path = _write(tmp_path / "aime.json", [{"id": 1, "problem": "P"}])
    with pytest.raises(ValueError) as e:
        load_eval_dataset(str(path))
    assert str(path) in str(e.value) and "'answer'" in str(e.value)


# --- one row over the size cap, refused while streaming -------------------------------------------------------


def test_a_50_mb_json_line_is_refused_without_holding_it(tmp_path):
    import tracemalloc

    path = tmp_path / "train.jsonl"
    row = {"problem": "1+1?", "solution": "2", "Answer": "2", "COT_Reason": "x", "generated_token_count": 1}
    with path.open("w") as f:
        f.write(json.dumps(row) + "\n")
        f.write('{"problem": "' + "y" * (50 * 2**20) + '"}\n')
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"line 2 is longer than 16 MiB, the limit of one row"):
            loading.load_table(str(path), required=TRAIN_COLUMNS)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * loading.MAX_ROW_BYTES  # the first 16 MiB + 1 of the line, not its 50 MB


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_a_row_at_the_cap_passes_and_one_byte_more_is_refused(tmp_path, monkeypatch, suffix):
    monkeypatch.setattr(loading, "MAX_ROW_BYTES", 120)
    if suffix == ".csv":
        head, make = "problem,answer\n", lambda n: "q" * (n - 2) + ",7\n"
    else:
        head, make = "", lambda n: '{"problem": "' + "q" * (n - 30) + '", "answer": "7"}\n'
    for n, refused in ((120, False), (121, True)):
        path = tmp_path / f"eval{n}{suffix}"
        line = make(n)
        assert len(line.rstrip("\n")) == n
        path.write_text(head + line + make(40))
        if refused:
            with pytest.raises(
                DataError, match=rf"{path.name}'?: line {2 if head else 1} is longer than 120 bytes"
            ):
                loading.load_eval_dataset(str(path))
        else:
            assert loading.load_eval_dataset(str(path))[0]["answer"] == "7"


def test_a_json_line_that_is_not_utf8_names_its_line(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_bytes(b'{"problem": "a", "answer": "1"}\n{"problem": "\xff", "answer": "1"}\n')
    with pytest.raises(DataError, match="line 2 is not UTF-8 text"):
        loading.load_eval_dataset(str(path))
