"""Tests for opsd.method.prompts: chat rendering, thinking switches, template files, teacher truncation."""

from __future__ import annotations

import logging

import pytest

from opsd.errors import UnsupportedModel
from opsd.method.prompts import PromptBuilder, reference_text, template_variables
from opsd.testing import tiny
from opsd.testing.tiny import build_tokenizer

MARK = "\n[... reference truncated ...]"
BEGIN = "=== BEGIN REFERENCE ==="
END = "=== END REFERENCE ==="
THINK_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
THINK_ON = "<|im_start|>assistant\n"
PROBLEM = "What is the sum of the integers from 1 to 10?"
REFERENCE = "1 + 2 + ... + 10 = 10 * 11 / 2 = 55. The answer is $\\boxed{55}$."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("prompts_tok"))


def chat_ids(tok, text: str, thinking: bool) -> list[int]:
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": text}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=thinking,
    )
    return tok(rendered, add_special_tokens=False)["input_ids"]


def decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------------------------------------
# Default templates


def test_default_student_text():
    text = PromptBuilder().student_text(PROBLEM)
    assert text.endswith("\n\n" + PROBLEM)
    assert "\\boxed{}" in text
    assert "step by step" in text
    assert "{problem}" not in text


def test_default_teacher_text_order():
    text = PromptBuilder().teacher_text(PROBLEM, REFERENCE)
    i_problem, i_begin = text.index(PROBLEM), text.index(BEGIN + "\n")
    i_ref, i_end = text.index(REFERENCE), text.index("\n" + END)
    assert i_problem < i_begin < i_ref < i_end
    assert i_ref == i_begin + len(BEGIN) + 1
    assert i_end == i_ref + len(REFERENCE)
    # The independence instruction follows the reference.
    assert "independently" in text[i_end:]
    assert "\\boxed{}" in text[:i_problem]


def test_student_ids_thinking_off(tok):
    pb = PromptBuilder(tok)
    ids = pb.student_ids(PROBLEM)
    expected = "<|im_start|>user\n" + pb.student_text(PROBLEM) + "<|im_end|>\n" + THINK_OFF
    assert decode(tok, ids) == expected
    assert decode(tok, ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ids == chat_ids(tok, pb.student_text(PROBLEM), thinking=False)
    # No extra BOS: the ids start with the template's own <|im_start|>.
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2


def test_student_ids_thinking_on(tok):
    pb = PromptBuilder(tok, student_thinking=True)
    ids = pb.student_ids(PROBLEM)
    text = decode(tok, ids)
    assert text == "<|im_start|>user\n" + pb.student_text(PROBLEM) + "<|im_end|>\n<|im_start|>assistant\n"
    assert "<think>" not in text and "</think>" not in text
    assert ids == chat_ids(tok, pb.student_text(PROBLEM), thinking=True)


@pytest.mark.parametrize(
    "student_thinking,teacher_thinking", [(False, True), (True, False), (False, False), (True, True)]
)
def test_thinking_switches_are_independent(tok, student_thinking, teacher_thinking):
    pb = PromptBuilder(tok, student_thinking=student_thinking, teacher_thinking=teacher_thinking)
    s = decode(tok, pb.student_ids(PROBLEM))
    t = decode(tok, pb.teacher_ids(PROBLEM, REFERENCE).ids)
    assert s.endswith(THINK_ON if student_thinking else THINK_OFF)
    assert t.endswith(THINK_ON if teacher_thinking else THINK_OFF)
    assert ("<think>" in s) is (not student_thinking)
    assert ("<think>" in t) is (not teacher_thinking)


def test_defaults_student_off_teacher_on(tok):
    pb = PromptBuilder(tok)
    assert decode(tok, pb.student_ids(PROBLEM)).endswith(THINK_OFF)
    t = decode(tok, pb.teacher_ids(PROBLEM, REFERENCE).ids)
    assert t.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert "<think>" not in t


def test_teacher_ids_full_string(tok):
    pb = PromptBuilder(tok)
    tp = pb.teacher_ids(PROBLEM, REFERENCE)
    assert tp.truncated is False
    text = pb.teacher_text(PROBLEM, REFERENCE)
    assert decode(tok, tp.ids) == "<|im_start|>user\n" + text + "<|im_end|>\n<|im_start|>assistant\n"
    assert tp.ids == chat_ids(tok, text, thinking=True)
    full = decode(tok, tp.ids)
    assert full.index(PROBLEM) < full.index(BEGIN) < full.index(REFERENCE) < full.index(END)


# ---------------------------------------------------------------------------------------------------------
# Template files


def test_custom_template_files_used_literally(tok, tmp_path):
    sfile = tmp_path / "student.txt"
    tfile = tmp_path / "teacher.txt"
    sfile.write_text("Q: {problem}\nAnswer in \\boxed{} please. {x} {0}", encoding="utf-8")
    tfile.write_text(
        "Problem: {problem}\nRef <<{reference}>>\nUse \\boxed{}; {problem} again.", encoding="utf-8"
    )
    pb = PromptBuilder(tok, student_template_file=str(sfile), teacher_template_file=str(tfile))
    problem = "Find x if 2x + 3 = 7."
    reference = "Keep {problem} and {reference} literal: 2x = 4, so $\\boxed{2}$."

    assert pb.student_text(problem) == "Q: Find x if 2x + 3 = 7.\nAnswer in \\boxed{} please. {x} {0}"
    assert pb.teacher_text(problem, reference) == (
        "Problem: Find x if 2x + 3 = 7.\n"
        "Ref <<Keep {problem} and {reference} literal: 2x = 4, so $\\boxed{2}$.>>\n"
        "Use \\boxed{}; Find x if 2x + 3 = 7. again."
    )
    assert decode(tok, pb.student_ids(problem)) == (
        "<|im_start|>user\nQ: Find x if 2x + 3 = 7.\nAnswer in \\boxed{} please. {x} {0}<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert decode(tok, pb.teacher_ids(problem, reference).ids) == (
        "<|im_start|>user\nProblem: Find x if 2x + 3 = 7.\n"
        "Ref <<Keep {problem} and {reference} literal: 2x = 4, so $\\boxed{2}$.>>\n"
        "Use \\boxed{}; Find x if 2x + 3 = 7. again.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_file_missing_placeholder(tmp_path):
    tfile = tmp_path / "teacher.txt"
    tfile.write_text("Problem: {problem}\nno reference here", encoding="utf-8")
    with pytest.raises(ValueError) as e:
        PromptBuilder(teacher_template_file=str(tfile))
    assert "{reference}" in str(e.value) and str(tfile) in str(e.value)

    sfile = tmp_path / "student.txt"
    sfile.write_text("Solve: {problm}", encoding="utf-8")
    with pytest.raises(ValueError) as e:
        PromptBuilder(student_template_file=str(sfile))
    assert "{problem}" in str(e.value) and str(sfile) in str(e.value)

    # The student template needs no {reference}.
    sfile.write_text("Solve: {problem}", encoding="utf-8")
    assert PromptBuilder(student_template_file=str(sfile)).student_text("1+1") == "Solve: 1+1"


def test_template_file_missing(tmp_path):
    missing = tmp_path / "nope" / "teacher.txt"
    with pytest.raises(FileNotFoundError) as e:
        PromptBuilder(teacher_template_file=str(missing))
    assert str(missing) in str(e.value)
    with pytest.raises(FileNotFoundError):
        PromptBuilder(student_template_file=str(tmp_path / "student.txt"))


# ---------------------------------------------------------------------------------------------------------
# reference_text

ROW = {
    "solution": "Short solution: 55.",
    "COT_Reason": "Let me think. 1 + 2 = 3. Then ... the final answer is 55.",
}


def test_reference_text_picks_column():
    assert reference_text(ROW, "solution", 8000) == "Short solution: 55."
    assert reference_text(ROW, "cot", 8000) == "Let me think. 1 + 2 = 3. Then ... the final answer is 55."


def test_reference_text_cap():
    assert reference_text(ROW, "solution", 5) == "Short\n[... reference truncated ...]"
    assert reference_text(ROW, "cot", 13) == "Let me think.\n[... reference truncated ...]"
    # Exactly at the cap, under it, or no cap: untouched.
    assert reference_text(ROW, "solution", 19) == "Short solution: 55."
    assert reference_text(ROW, "solution", 18) == "Short solution: 55\n[... reference truncated ...]"
    assert reference_text(ROW, "solution", 1000) == "Short solution: 55."
    assert reference_text(ROW, "cot", 0) == ROW["COT_Reason"]


def test_reference_text_none_is_empty():
    assert reference_text({"solution": None, "COT_Reason": "x"}, "solution", 10) == ""


@pytest.mark.parametrize("bad", ["COT_Reason", "reasoning", "", "Solution"])
def test_reference_text_unknown(bad):
    with pytest.raises(ValueError) as e:
        reference_text(ROW, bad, 100)
    assert "solution" in str(e.value) and "cot" in str(e.value)


# ---------------------------------------------------------------------------------------------------------
# Teacher truncation

LONG_PROBLEM = "Compute the sum 1 + 2 + ... + 79, then add the perimeter of a 3 by 4 rectangle."
LONG_REF = " ".join(f"Step {i}: add {i} to the total, giving {i * (i + 1) // 2}." for i in range(1, 80))


def _cut_reference(text: str) -> str:
    start = text.index(BEGIN + "\n") + len(BEGIN) + 1
    return text[start : text.index(MARK)]


def test_teacher_fits_untouched(tok):
    full = PromptBuilder(tok).teacher_ids(LONG_PROBLEM, LONG_REF)
    assert full.truncated is False
    n = len(full.ids)
    for limit in (n, n + 1, 10 * n):
        tp = PromptBuilder(tok, max_teacher_prompt_tokens=limit).teacher_ids(LONG_PROBLEM, LONG_REF)
        assert tp.truncated is False
        assert tp.ids == full.ids


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("drop", [1, 17, 150, 600])
def test_teacher_truncated_inside_reference(tok, thinking, drop):
    full = PromptBuilder(tok, teacher_thinking=thinking).teacher_ids(LONG_PROBLEM, LONG_REF)
    full_text = decode(tok, full.ids)
    assert len(full.ids) > 800
    limit = len(full.ids) - drop
    tp = PromptBuilder(tok, teacher_thinking=thinking, max_teacher_prompt_tokens=limit).teacher_ids(
        LONG_PROBLEM, LONG_REF
    )
    assert tp.truncated is True
    assert len(tp.ids) <= limit
    # Not cut far more than needed: within a handful of tokens plus the mark.
    assert len(tp.ids) >= limit - 20
    text = decode(tok, tp.ids)
    assert text.startswith("<|im_start|>user\n")
    assert LONG_PROBLEM in text
    assert text.index(LONG_PROBLEM) < text.index(BEGIN) < text.index(MARK) < text.index(END)
    assert text.index(MARK) + len(MARK) + 1 == text.index(END)
    cut = _cut_reference(text)
    assert cut and LONG_REF.startswith(cut) and len(cut) < len(LONG_REF)
    # Everything from the END marker on (instruction, turn end, assistant header) is unchanged.
    assert text[text.index(END) :] == full_text[full_text.index(END) :]
    assert text[: text.index(BEGIN)] == full_text[: full_text.index(BEGIN)]
    assert text.endswith(THINK_ON if thinking else THINK_OFF)


def test_teacher_truncation_is_consistent_with_chat_template(tok):
    limit = len(PromptBuilder(tok).teacher_ids(LONG_PROBLEM, LONG_REF).ids) - 100
    pb = PromptBuilder(tok, max_teacher_prompt_tokens=limit)
    tp = pb.teacher_ids(LONG_PROBLEM, LONG_REF)
    cut = _cut_reference(decode(tok, tp.ids))
    assert tp.ids == chat_ids(tok, pb.teacher_text(LONG_PROBLEM, cut + MARK), thinking=True)


def test_teacher_truncation_never_splits_characters(tok):
    # Cutting a byte-level token sequence inside a multi-byte character must not leave U+FFFD behind.
    ref = "∑∫ üñ 漢字 " * 40
    n = len(PromptBuilder(tok).teacher_ids(PROBLEM, ref).ids)
    for limit in range(n - 120, n):
        tp = PromptBuilder(tok, max_teacher_prompt_tokens=limit).teacher_ids(PROBLEM, ref)
        assert tp.truncated and len(tp.ids) <= limit
        text = decode(tok, tp.ids)
        assert "\ufffd" not in text
        assert ref.startswith(_cut_reference(text)), limit


def test_teacher_limit_below_prompt_without_reference(tok, caplog):
    caplog.set_level(logging.WARNING, logger="opsd.method.prompts")
    tp = PromptBuilder(tok, max_teacher_prompt_tokens=20).teacher_ids(LONG_PROBLEM, LONG_REF)
    assert tp.truncated is True
    text = decode(tok, tp.ids)
    # The problem is never cut: the prompt keeps it whole, with an emptied reference, and says so.
    assert LONG_PROBLEM in text
    assert BEGIN + "\n\n[... reference truncated ...]\n" + END in text
    assert len(tp.ids) > 20
    assert "kept whole" in caplog.text


# -- which template variable the thinking flags drive ------------------------------------------------------------
OWN_SWITCH_TEMPLATE = tiny.QWEN3_CHAT_TEMPLATE.replace("enable_thinking", "reasoning")
# Mentions enable_thinking only in a comment and a string: a substring match would take it for the switch.
NO_SWITCH_TEMPLATE = (
    "{#- enable_thinking is not supported -#}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{{ 'enable_thinking' if false }}{%- endif %}"
)


@pytest.fixture
def own_switch_tok(tok):
    import copy

    other = copy.deepcopy(tok)
    other.chat_template = OWN_SWITCH_TEMPLATE
    return other


def test_template_variables_are_parsed_not_matched_as_text():
    assert "enable_thinking" not in template_variables(NO_SWITCH_TEMPLATE)
    assert {"messages", "add_generation_prompt", "reasoning"} <= template_variables(OWN_SWITCH_TEMPLATE)
    assert "enable_thinking" in template_variables(tiny.QWEN3_CHAT_TEMPLATE)


def test_a_named_switch_drives_the_templates_own_variable(own_switch_tok):
    b = PromptBuilder(
        own_switch_tok, student_thinking=False, teacher_thinking=True, thinking_switch="reasoning"
    )
    student = own_switch_tok.decode(b.student_ids("p"))
    teacher = own_switch_tok.decode(b.teacher_ids("p", "r").ids)
    assert student.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert teacher.endswith("<|im_start|>assistant\n")


def test_auto_without_the_switch_warns_and_renders_alike(own_switch_tok, caplog):
    with caplog.at_level(logging.WARNING):
        b = PromptBuilder(own_switch_tok, student_thinking=False, teacher_thinking=True)
    assert "reads no enable_thinking variable" in caplog.text
    assert b.switch is None
    # `reasoning` is undefined, so the template renders its thinking-on form for both roles
    assert own_switch_tok.decode(b.student_ids("p")).endswith("<|im_start|>assistant\n")


def test_a_switch_the_template_does_not_read_is_refused_in_one_line(tok):
    import copy

    other = copy.deepcopy(tok)
    other.chat_template = NO_SWITCH_TEMPLATE
    with pytest.raises(
        UnsupportedModel, match="thinking_switch='enable_thinking', but the chat template reads"
    ):
        PromptBuilder(other, thinking_switch="enable_thinking")
    assert PromptBuilder(other, thinking_switch="none").switch is None
