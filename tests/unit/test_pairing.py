"""Tests for opsd.method.pairing: the derangement against an enumeration of all permutations, the rewritten
reference column, the saved record and the resume check; `empty` and truncation through opsd.method.prompts."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging

import pytest
from datasets import Dataset

from opsd.errors import InvalidValue
from opsd.grading import is_correct
from opsd.method.contrast import contrast_references
from opsd.method.pairing import answer_groups, apply_pairing, derangement
from opsd.method.prompts import TEACHER_TEMPLATE, TRUNCATION_MARK, PromptBuilder
from opsd.run.resume import ALLOW_FLAG
from opsd.run.resume import check_saved_pairing as check_saved
from opsd.run.resume import save_pairing as save
from opsd.rundir import PAIRING_FILE
from opsd.testing.tiny import build_tokenizer

BEGIN, END = "=== BEGIN REFERENCE ===", "=== END REFERENCE ==="


def all_valid(groups) -> set[tuple[int, ...]]:
    """Every permutation p with groups[p[i]] != groups[i] for all i, by brute force."""
    n = len(groups)
    return {p for p in itertools.permutations(range(n)) if all(groups[p[i]] != groups[i] for i in range(n))}


# ---------------------------------------------------------------------------------------------------------
# The derangement


def test_two_and_three_rows_have_no_fixed_point():
    assert {tuple(derangement(2, seed)) for seed in range(20)} == {(1, 0)}
    three = {tuple(derangement(3, seed)) for seed in range(60)}
    assert three == {(1, 2, 0), (2, 0, 1)}  # the two 3-cycles, and both are drawn


def test_four_rows_draw_only_and_every_derangement():
    drawn = {tuple(derangement(4, seed)) for seed in range(400)}
    assert len(all_valid(range(4))) == 9  # !4
    assert drawn == all_valid(range(4))


@pytest.mark.parametrize("n", [0, 1])
def test_fewer_than_two_rows_are_refused(n):
    with pytest.raises(InvalidValue) as info:
        derangement(n, seed=0)
    message = str(info.value)
    assert "\n" not in message and "at least 2 training rows" in message and f"(got {n})" in message
    assert "teacher_ref_pairing=empty" in message


def test_groups_are_never_paired_with_themselves():
    groups = ["a", "a", "b", "b", "c", "c", "c"]
    drawn = {tuple(derangement(len(groups), seed, groups)) for seed in range(300)}
    assert drawn <= all_valid(groups) and len(drawn) > 10
    # Exactly half the rows in one group is still possible: they must all swap with the others.
    assert {tuple(derangement(4, s, "xxyy")) for s in range(50)} <= all_valid("xxyy")


def test_a_group_over_half_the_rows_is_refused():
    with pytest.raises(InvalidValue) as info:
        apply_pairing(table().select(range(5)), "shuffled", seed=0, answers=["7", "7 ", "7", "3", "4"])
    message = str(info.value)
    assert "\n" not in message and "answer '7' is shared by 3 of 5 training rows" in message
    assert "teacher_ref_pairing=empty" in message


# Answers that differ as text and are one value for the grader (opsd.grading.is_correct).
SAME_VALUE = ["3.5", "3.50", "0.5", "1/2", "1000", "1,000", "\\sqrt{8}", "2\\sqrt{2}", "x+1", "1+x"]


def test_answers_of_one_value_are_never_paired():
    """Raw strings called `3.5` and `3.50` different answers: a row could read the reference of its own answer."""
    groups = answer_groups(SAME_VALUE)
    assert len(set(groups)) == 5
    for seed in range(60):
        perm = derangement(len(SAME_VALUE), seed, groups)
        assert not any(is_correct(SAME_VALUE[perm[i]], SAME_VALUE[i]) for i in range(len(perm))), seed
    refs = [f"reference {i}: \\boxed{{{a}}}" for i, a in enumerate(SAME_VALUE)]
    ds = Dataset.from_dict({"prompt": [f"p{i}" for i in range(len(refs))], "privileged_context": refs})
    for seed in range(20):
        _, record = apply_pairing(ds, "shuffled", seed=seed, answers=SAME_VALUE)
        hints, _ = contrast_references(refs, SAME_VALUE, "shuffled", seed=seed)
        for i, j in enumerate(record["reference_of"]):
            assert not is_correct(SAME_VALUE[j], SAME_VALUE[i])
            assert not is_correct(hints[i].split("{")[-1].rstrip("}"), SAME_VALUE[i])


def test_a_value_over_half_the_rows_is_refused_whatever_its_spelling():
    with pytest.raises(InvalidValue) as info:
        apply_pairing(table().select(range(5)), "shuffled", seed=0, answers=["7", "7.0", "7.00", "3", "4"])
    assert "answer '7' is shared by 3 of 5 training rows" in str(info.value)


def test_large_tables_are_valid_and_depend_on_the_seed_only():
    groups = [i % 37 for i in range(5000)]
    p = derangement(5000, 42, groups)
    assert sorted(p) == list(range(5000))
    assert all(groups[p[i]] != groups[i] for i in range(5000))
    assert derangement(5000, 42, groups) == p
    assert derangement(5000, 43, groups) != p


# ---------------------------------------------------------------------------------------------------------
# The trainer's table

PROBLEMS = [f"Evaluate ${a}+{b}$." for a, b in [(1, 2), (2, 2), (3, 1), (5, 5), (6, 1), (7, 8)]]
ANSWERS = ["3", "4", "4", "10", "7", "15"]  # rows 1 and 2 share an answer


def table() -> Dataset:
    refs = [f"solution {i}: the answer is {a}" for i, a in enumerate(ANSWERS)]
    return Dataset.from_dict({"prompt": PROBLEMS, "privileged_context": refs})


def test_matched_is_the_table_itself():
    ds = table()
    paired, record = apply_pairing(ds, "matched", seed=0, answers=ANSWERS)
    assert paired is ds and record is None


def test_shuffled_gives_each_row_another_rows_reference():
    ds = table()
    paired, record = apply_pairing(ds, "shuffled", seed=5, answers=ANSWERS)
    perm = record["reference_of"]
    assert paired.column_names == ["prompt", "privileged_context"]
    assert paired["prompt"] == PROBLEMS
    assert paired["privileged_context"] == [ds["privileged_context"][j] for j in perm]
    assert all(ANSWERS[perm[i]] != ANSWERS[i] for i in range(len(PROBLEMS)))
    assert perm == derangement(len(PROBLEMS), 5, ANSWERS)
    sha = lambda value: hashlib.sha256(json.dumps(value).encode()).hexdigest()  # noqa: E731
    assert record["problems_sha256"] == sha(PROBLEMS) and record["reference_of_sha256"] == sha(perm)
    assert (record["seed"], record["rows"], record["teacher_ref_pairing"]) == (5, 6, "shuffled")


def test_rows_without_an_answer_are_only_kept_from_their_own_reference():
    answers = ["", "", "", None]  # no answer to avoid: any other row will do
    paired, record = apply_pairing(table().select(range(4)), "shuffled", seed=1, answers=answers)
    assert all(j != i for i, j in enumerate(record["reference_of"]))


def test_empty_blanks_every_reference():
    paired, record = apply_pairing(table(), "empty", seed=0, answers=ANSWERS)
    assert record is None and paired["prompt"] == PROBLEMS and paired["privileged_context"] == [""] * 6


def test_an_unknown_pairing_is_refused():
    with pytest.raises(ValueError, match=r"teacher_ref_pairing='random' is not allowed; choose one of"):
        apply_pairing(table(), "random", seed=0, answers=ANSWERS)


# ---------------------------------------------------------------------------------------------------------
# Saved with the run, checked on resume


def test_saved_pairing_is_checked_only_when_resuming(tmp_path):
    _, record = apply_pairing(table(), "shuffled", seed=5, answers=ANSWERS)
    save(tmp_path, record)
    saved = json.loads((tmp_path / PAIRING_FILE).read_text())
    assert saved == record
    _, other = apply_pairing(table(), "shuffled", seed=6, answers=ANSWERS)
    assert other["reference_of"] != record["reference_of"]
    check_saved(tmp_path, other, allow=False)  # no complete checkpoint: a fresh start
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / ".complete").touch()
    check_saved(tmp_path, record, allow=False)  # the same pairing resumes
    with pytest.raises(InvalidValue) as info:
        check_saved(tmp_path, other, allow=False)
    message = str(info.value)
    assert "\n" not in message and PAIRING_FILE in message and "new --output_dir" in message
    assert ALLOW_FLAG in message
    check_saved(tmp_path, other, allow=True)
    save(tmp_path, None)  # a run without a pairing leaves no stale file
    assert not (tmp_path / PAIRING_FILE).exists()


# ---------------------------------------------------------------------------------------------------------
# What the teacher sees


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("pairing_tok"))


def rendered(tok, text: str) -> list[int]:
    chat = [{"role": "user", "content": text}]
    return tok(tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, enable_thinking=True),
               add_special_tokens=False)["input_ids"]  # fmt: skip


def test_empty_renders_the_teacher_template_with_an_empty_block(tok):
    problem = PROBLEMS[0]
    head, tail = TEACHER_TEMPLATE.split("{reference}")
    by_hand = head.split("{problem}")[0] + problem + head.split("{problem}")[1] + tail
    assert f"{BEGIN}\n\n{END}" in by_hand
    builder = PromptBuilder(tok)
    assert builder.teacher_text(problem, "") == by_hand
    assert builder.teacher_ids(problem, "").ids == rendered(tok, by_hand)
    # The student prompt is where it starts: the frame is all that the teacher has more.
    assert by_hand.startswith(builder.student_text(problem))


def long_table(n: int = 6) -> tuple[Dataset, list[str]]:
    problems = [f"Find the sum of the integers from 1 to {10 + i}, then add {i}." for i in range(n)]
    refs = [" ".join(f"Step {k}: row {i} adds {k}." for k in range(60)) for i in range(n)]
    return Dataset.from_dict({"prompt": problems, "privileged_context": refs}), [str(i) for i in range(n)]


@pytest.mark.parametrize("pairing", ["shuffled", "empty"])
def test_truncation_never_cuts_the_problem(tok, pairing, caplog):
    caplog.set_level(logging.WARNING, logger="opsd.method.prompts")
    ds, answers = long_table()
    paired, _ = apply_pairing(ds, pairing, seed=3, answers=answers)
    full = PromptBuilder(tok)
    for problem, reference in zip(paired["prompt"], paired["privileged_context"], strict=True):
        whole = full.teacher_ids(problem, reference).ids
        for limit in (len(whole) - 40, 30):  # inside the reference, and below the prompt without it
            tp = PromptBuilder(tok, max_teacher_prompt_tokens=limit).teacher_ids(problem, reference)
            text = tok.decode(tp.ids)
            assert problem in text and text.index(problem) < text.index(BEGIN) < text.index(END)
            block = text[text.index(BEGIN) + len(BEGIN) + 1 : text.index(END) - 1]
            if reference:  # cut inside the paired reference: a prefix of it and the mark
                assert tp.truncated and block.endswith(TRUNCATION_MARK.strip())
                assert reference.startswith(block[: -len(TRUNCATION_MARK)].rstrip("\n"))
            else:  # nothing to cut: the prompt as rendered, without a mark
                assert not tp.truncated and tp.ids == whole and block == ""
    if pairing == "empty":
        assert "with an empty reference" in caplog.text and "kept whole" in caplog.text
