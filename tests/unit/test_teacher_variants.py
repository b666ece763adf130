"""The teacher variants of docs/method.md §1.10-1.11 against references written here (the contrastive target
itself: tests/unit/test_contrast_target.py): the teacher-free fixed advantage (its closed form by hand), the answer-only reference, the token-boundary cut of the reference, the
wrong hint of `wrong_answer` and `shuffled`, and the refusals of switches that cannot work together."""

import math
import random
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from opsd.configuration.config import OPSDConfig
from opsd.errors import InvalidValue
from opsd.method import loss
from opsd.method.contrast import answer_mentions, contrast_references, wrong_reference, wrong_value
from opsd.method.loss import ContrastSettings, LossSettings, loss_settings
from opsd.method.prompts import TRUNCATION_MARK, PromptBuilder, reference_text
from opsd.method.scoring import loss_metrics

CLIP_MODES = ("element", "token", "rescale", "none")


def settings(
    *, beta=0.0, tau=1.0, clip=0.05, clip_mode="element", loss_type="jsd", weight=None, a=-0.5, chunk=5
):
    return LossSettings(
        beta=beta, temperature=tau, clip=clip, clip_mode=clip_mode, teacher_support_k=0, loss_type=loss_type,
        chunk_size=chunk, contrast=None if weight is None else ContrastSettings(alpha=weight), fixed_advantage=a,
    )  # fmt: skip


def tensors(n=13, h=6, v=11, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()

    return (
        r(n, h),
        r(n, h),
        r(n, h),
        r(v, h, scale=1.5),
        r(v, h, scale=1.5),
        torch.randint(0, v, (n,), generator=g),
    )


def test_contrast_needs_its_hidden_states():
    h_s, h_t, h_w, w_s, w_t, ids = tensors()
    with pytest.raises(ValueError, match="wrong hints"):
        loss.chunked_opsd_loss(h_s, h_t, w_s, w_t, settings=settings(weight=1.0), target_ids_N=ids)


@pytest.mark.parametrize("tau", [1.0, 0.6])
def test_fixed_advantage_gradient_is_the_closed_form_and_needs_no_teacher(tau):
    h_s, _, _, w_s, _, ids = tensors(seed=3)
    a = -0.37
    got, sums = loss.chunked_opsd_loss(h_s, None, w_s, None, settings=settings(loss_type="fixed_advantage", tau=tau,
                                       a=a), target_ids_N=ids)  # fmt: skip
    got_h, got_w = torch.autograd.grad(got, (h_s, w_s))
    with torch.no_grad():  # by hand: L = -a sum_t log p(y_t); dL/dz = -a (onehot(y) - p) / tau, z = h W^T
        z = h_s @ w_s.T
        p = torch.softmax(z / tau, -1)
        want = -a * (z.gather(-1, ids[:, None]).squeeze(-1) / tau - torch.logsumexp(z / tau, -1)).sum()
        dz = -a * (F.one_hot(ids, z.shape[-1]).double() - p) / tau
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_h.double(), dz @ w_s.detach(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got_w.double(), dz.T @ h_s.detach(), atol=1e-6, rtol=1e-5)
    assert float(sums["abs_advantage"]) == pytest.approx(abs(a) * len(ids))
    metrics = loss_metrics(got.detach(), sums, teacher=False)
    assert set(metrics) == {"opsd/abs_advantage", "opsd/loss_per_token"}


# -- the references the teacher reads ---------------------------------------------------------------------------


def test_answer_only_reference_is_the_answer_column_in_the_same_template(tiny_tokenizer):
    row = {
        "problem": "What is 3 + 4?",
        "solution": "3 + 4 = 7, so \\boxed{7}.",
        "Answer": " 7 ",
        "COT_Reason": "x",
    }
    ref = reference_text(row, "answer", 8000)
    assert ref == "7"
    builder = PromptBuilder(tiny_tokenizer)
    text = builder.teacher_template.replace("{problem}", row["problem"]).replace("{reference}", "7")
    chat = tiny_tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=True)  # fmt: skip
    assert (
        builder.teacher_ids(row["problem"], ref).ids
        == tiny_tokenizer(chat, add_special_tokens=False)["input_ids"]
    )
    assert reference_text({**row, "Answer": 12}, "answer", 8000) == "12"  # a numeric column


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.77, 1.0])
def test_reference_fraction_cuts_on_token_boundaries(tiny_tokenizer, fraction):
    reference = (
        "We compute 2x = 37 - 9 = 28, then x = 28 / 2 = 14. The answer is $\\boxed{14}$, as checked twice."
    )
    ids = tiny_tokenizer(reference, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(reference)  # multi-character tokens: a character cut would differ
    builder = PromptBuilder(tiny_tokenizer, reference_fraction=fraction)
    cut = builder.reference_prefix(reference)
    keep = math.ceil(round(fraction * len(ids), 9))
    assert tiny_tokenizer(cut, add_special_tokens=False)["input_ids"] == ids[:keep]
    assert reference.startswith(cut)
    assert (cut == reference) == (fraction == 1.0)
    chars = reference[: math.ceil(fraction * len(reference))]
    if fraction < 1:
        assert cut != chars
    # The teacher prompt carries the cut reference.
    whole = PromptBuilder(tiny_tokenizer).teacher_ids("p", cut).ids
    assert builder.teacher_ids("p", reference).ids == whole


@pytest.mark.parametrize(
    "reference", ["日本語の参考解答。答えは 14。", "\U0001f642 the answer is 14", "\u00e9 then 14"]
)
@pytest.mark.parametrize("fraction", [0.01, 1e-9, 1e-12])
def test_reference_fraction_keeps_at_least_one_whole_character(tiny_tokenizer, reference, fraction):
    """A character of several byte tokens first (CJK, an emoji, an accent): the first ceil(f x n) tokens decode to
    part of it, and the cut takes the tokens that complete it instead of leaving an empty reference. (1e-12 is
    refused by the config's range; the builder still keeps a character.)"""
    ids = tiny_tokenizer(reference, add_special_tokens=False)["input_ids"]
    assert len(ids) <= 100 and tiny_tokenizer.decode(ids[:1]).rstrip("\ufffd") == ""  # the case of the defect
    cut = PromptBuilder(tiny_tokenizer, reference_fraction=fraction).reference_prefix(reference)
    assert cut == reference[0]


def test_reference_fraction_logs_its_cut_once(tiny_tokenizer, caplog):
    builder = PromptBuilder(tiny_tokenizer, reference_fraction=0.5)
    with caplog.at_level("INFO", logger="opsd.method.prompts"):
        builder.teacher_ids("p", "a reference of several tokens")
        builder.teacher_ids("q", "another reference")
    lines = [r.getMessage() for r in caplog.records if "teacher_ref_fraction" in r.getMessage()]
    assert len(lines) == 1 and "e.g." in lines[0]


# -- the wrong hint ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reference", "answer", "kept", "changed"),
    [
        # A result stated as the answer's value (`x = 14`) is replaced with it (it would give the answer away).
        ("2x = 28, x = 14. The answer is $\\boxed{14}$.", "14", "2x = 28, x = ", "}$."),
        ("so the final answer is 14, not 141 or 1.14", "14", "so the final answer is ", ", not 141 or 1.14"),
        ("we get 3/4 of it: \\boxed{3/4}", "3/4", "we get 3/4 of it: \\boxed{", "/4}"),
        ("half: \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "half: \\boxed{\\frac{", "}{2}}"),
        ("about 2.50 m, \\boxed{2.50}", "2.50", "about 2.50 m, \\boxed{", "}"),
        ("it is -7. \\boxed{-7} and \\boxed{-7}", "-7", "it is -7. \\boxed{", "}"),
    ],
)
def test_wrong_reference_replaces_only_the_stated_final_answer(reference, answer, kept, changed):
    wrong = wrong_reference(reference, answer, random.Random(0))
    assert wrong is not None and wrong != reference
    assert wrong.startswith(kept) and wrong.endswith(changed)
    new = wrong[len(kept) : len(wrong) - len(changed)].split("}")[0].split("{")[-1]
    assert new not in (answer, "") and new != answer.split("{")[-1].split("}")[0]
    assert answer_mentions(wrong, answer, results_only=True) == []  # no `= answer` left


def test_wrong_value_keeps_the_kind_and_refuses_other_kinds():
    rng = random.Random(1)
    for _ in range(200):
        assert wrong_value("0", rng).isdigit()  # a count stays a count
        assert wrong_value("-3", rng).lstrip("-").isdigit() and wrong_value("-3", rng) != "-3"
        d = wrong_value("2.50", rng)
        assert len(d.split(".")[1]) == 2 and d != "2.50"
    for other in ("x + 1", "(1, 2)", "\\sqrt{2}", "yes", ""):
        assert wrong_value(other, rng) is None
    assert wrong_reference("the answer is 7", "x+1", rng) is None
    assert wrong_reference("no such number here", "7", rng) is None


def test_decimal_wrong_values_keep_a_non_negative_sign_as_integers_do():
    rng = random.Random(2)
    for _ in range(300):
        for d in ("0.5", "2.50", "0.05", "3.0"):
            w = wrong_value(d, rng)
            assert not w.startswith("-") and w != d and len(w.split(".")[1]) == len(d.split(".")[1]), (d, w)
        assert wrong_value("-0.5", rng) != "-0.5"


def test_the_wrong_hint_replaces_results_equal_to_the_answer_and_counts_other_mentions():
    ref = "15 + 16 = 31, and 31 - 0 = 31 too; so $x = 31$, not 310 or 3.1. The answer is \\boxed{31}."
    wrong = wrong_reference(ref, "31", random.Random(0))
    other = wrong.split("\\boxed{")[1].split("}")[0]
    assert other != "31"
    assert wrong == ref.replace("= 31", f"= {other}").replace("\\boxed{31}", f"\\boxed{{{other}}}")
    # The operand `31 - 0` is left (an unrelated number may equal the answer), and it is what still carries it.
    start = ref.index("31 - 0")
    assert answer_mentions(wrong, "31") == [(start, start + 2)]
    # Other written forms of the value are found by value; an `a >= b` bound is not a stated result.
    assert answer_mentions(
        "a = 1,000, b = 1000.0, c >= 1000, \\frac{2000}{2}", "1000", results_only=True
    ) == [
        (4, 9),
        (15, 21),
    ]
    refs = [ref, "we get a = 1,000. \\boxed{1000}", "7 + 5 = 12. \\boxed{12}"]
    wrong_hints, record = contrast_references(refs, ["31", "1000", "12"], "wrong_answer", seed=0)
    assert "1,000" not in wrong_hints[1] and "12" not in wrong_hints[2]
    assert record["hints_mentioning_answer"] == 1 and record["unreplaced_rows"] == 0


def test_a_reference_cut_before_its_boxed_answer_is_unreplaceable():
    """teacher_ref_max_chars can cut the final box off: the 24 left in mid-text is not the final answer."""
    row = {
        "solution": "Each of the 24 boxes holds 2 balls; 24 boxes times 2 is 48 balls. The answer is \\boxed{24}."
    }
    cut = reference_text(row, "solution", 30)
    assert cut.endswith(TRUNCATION_MARK) and "\\boxed" not in cut and "24" in cut
    assert wrong_reference(cut, "24", random.Random(0)) is None
    whole = reference_text(row, "solution", 8000)
    wrong, record = contrast_references([cut, whole], ["24", "24"], "wrong_answer", seed=0)
    assert wrong[0] == cut and wrong[1] != whole
    assert (record["unreplaced_rows"], record["answer_cut_off_rows"]) == (1, 1)
    # A cut after the box keeps the final answer: it is replaced.
    kept = reference_text({"solution": "So \\boxed{24}. " + "Check: " * 20}, "solution", 30)
    assert kept.endswith(TRUNCATION_MARK) and wrong_reference(kept, "24", random.Random(0)) != kept
    with pytest.raises(InvalidValue, match="larger teacher_ref_max_chars"):
        contrast_references([cut], ["24"], "wrong_answer", seed=0)


def test_contrast_references_shuffled_never_own_nor_same_answer_and_wrong_answer_counts():
    refs = [f"reference {i}: \\boxed{{{i % 5}}}" for i in range(40)]
    answers = [str(i % 5) for i in range(40)]
    shuffled, _ = contrast_references(refs, answers, "shuffled", seed=3)
    assert all(w != r for w, r in zip(shuffled, refs, strict=True))
    assert all(w.split("{")[-1] != r.split("{")[-1] for w, r in zip(shuffled, refs, strict=True))
    assert sorted(shuffled) == sorted(refs)
    again, _ = contrast_references(refs, answers, "shuffled", seed=3)
    assert again == shuffled
    mixed = refs[:3] + ["no number"]
    wrong, record = contrast_references(mixed, answers[:3] + ["x+y"], "wrong_answer", seed=0)
    assert record["unreplaced_rows"] == 1 and wrong[3] == "no number" and wrong[0] != refs[0]
    with pytest.raises(
        InvalidValue, match="teacher_contrast=wrong_answer could replace the final answer in none"
    ):
        contrast_references(["a", "b"], ["x", "y"], "wrong_answer", seed=0)


# -- switches that cannot work together, and their ranges ---------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(teacher_contrast="shuffled", teacher_ref_pairing="empty"), "teacher_ref_pairing=empty gives"),
        (dict(teacher_contrast="wrong_answer", loss_type="fixed_advantage"), "reads none"),
        (dict(teacher_contrast="shuffled", top_k_loss=8), "top_k_loss=8"),
        (dict(loss_type="fixed_advantage", top_k_loss=8), "reads no teacher"),
        (dict(loss_type="fixed_advantage", fixed_advantage=0.2), "fixed_advantage=0.2 is out of range"),
        (dict(loss_type="fixed_advantage", fixed_advantage=0.0), "fixed_advantage=0.0 is out of range"),
        (dict(teacher_ref_fraction=0.0), "teacher_ref_fraction=0.0 is out of range"),
        (dict(teacher_ref_fraction=1.5), "must be in \\[1e-09, 1\\]"),
        # f x n rounds to no token below 1e-9 (the cut rounds to 9 decimals): refused, not an empty reference.
        (
            dict(teacher_ref_fraction=1e-12),
            "teacher_ref_fraction=1e-12 is out of range: must be in \\[1e-09, 1\\]",
        ),
        # A fraction cuts c and c~ alike, mostly before the final answer that tells them apart.
        (
            dict(teacher_contrast="wrong_answer", teacher_ref_fraction=0.5),
            "teacher_ref_fraction=0.5 cuts both hints to the same first share",
        ),
        (dict(contrast_weight=-1.0), "contrast_weight=-1.0 is out of range"),
        (dict(teacher_contrast="wrong"), "teacher_contrast='wrong' is not allowed"),
        (dict(teacher_contrast="own_wrong"), "own_wrong takes its wrong hints from the other rollouts"),
        (dict(contrast_rl_weight=0.1), "contrast_rl_weight=0.1 is read by method=hybrid only"),
        (dict(token_weight="entropy_gate", loss_type="fixed_advantage"), "token_weight=entropy_gate weighs"),
        (dict(token_weight="late"), "token_weight='late' is not allowed"),
        (
            dict(method="grpo", token_weight="positive_only"),
            "token_weight='positive_only' is read by method=opsd and",
        ),
        (
            dict(method="grpo", teacher_contrast="own_wrong"),
            "teacher_contrast='own_wrong' is read by method=opsd and",
        ),
        (dict(contrast_hints=0), "contrast_hints=0 is out of range"),
        (dict(contrast_rl_tau=0.0, method="hybrid"), "contrast_rl_tau=0.0 is out of range"),
    ],
)
def test_switches_that_cannot_work_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as err:
        OPSDConfig(report_to="none", **overrides)
    assert "\n" not in str(err.value)


def test_a_fraction_is_allowed_with_the_whole_reference_or_another_hint():
    """What the wrong_answer refusal leaves allowed: a fraction with a shuffled wrong hint (another reference, cut
    like c), wrong_answer on the whole reference, and the smallest fraction that keeps a token."""
    OPSDConfig(report_to="none", teacher_contrast="shuffled", teacher_ref_fraction=0.5)
    OPSDConfig(report_to="none", teacher_contrast="wrong_answer", teacher_ref_fraction=1.0)
    OPSDConfig(report_to="none", teacher_ref_fraction=1e-9)


def test_wrong_answer_with_a_fraction_would_leave_most_hints_equal(tiny_tokenizer):
    """Why the pair is refused: at f = 0.5 the prefix of c and of c~ are the same text for most built-in rows."""
    from opsd.data.builtin import builtin_train_rows

    rows = builtin_train_rows(40)
    refs = [r["solution"] for r in rows]
    wrong, _ = contrast_references(refs, [r["Answer"] for r in rows], "wrong_answer", seed=0)
    builder = PromptBuilder(tiny_tokenizer, reference_fraction=0.5)
    same = sum(
        builder.reference_prefix(c) == builder.reference_prefix(w) for c, w in zip(refs, wrong, strict=True)
    )
    assert same > len(rows) // 2


def test_the_published_defaults_are_unchanged_and_the_settings_carry_the_switches():
    c = OPSDConfig(report_to="none")
    assert (c.teacher_ref, c.teacher_ref_fraction, c.teacher_contrast, c.loss_type) == (
        "solution",
        1.0,
        "none",
        "jsd",
    )
    assert loss_settings(c).contrast is None and loss_settings(c).needs_teacher
    assert loss_settings(c).token_weight == "none"
    c = OPSDConfig(report_to="none", teacher_contrast="wrong_answer", contrast_weight=0.25, contrast_top_k=20,
                   contrast_log_floor=-7.0, contrast_kl_tau=0.5, token_weight="entropy_gate")  # fmt: skip
    assert loss_settings(c).contrast == ContrastSettings(alpha=0.25, top_k=20, floor=-7.0, kl_tau=0.5)
    assert loss_settings(c).token_weight == "entropy_gate"
    # RLCSD's shipped opsd_ectr values are the defaults
    assert loss_settings(
        OPSDConfig(report_to="none", teacher_contrast="shuffled")
    ).contrast == ContrastSettings(alpha=0.5, top_k=100, floor=-5.0, kl_tau=1.0)
    assert not loss_settings(OPSDConfig(report_to="none", loss_type="fixed_advantage")).needs_teacher


def test_docs_cite_each_paper_under_one_name():
    """docs/method.md named arXiv 2608.31046 "OPSA" in §1.8 and Ding and Zhang in §1.11."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "method.md").read_text(encoding="utf-8")
    cited = [m.start() for m in re.finditer(r"\[arXiv 2608\.31046\]", text)]
    assert len(cited) >= 2 and "OPSA" not in text
    assert all("Ding and Zhang" in text[max(i - 120, 0) : i] for i in cited)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_rows_with_contrast_compare_real_tokens_whatever_the_padding():
    import torch

    from opsd.method.contrast import rows_with_contrast
    from opsd.method.hidden import left_pad

    hints = [[5, 6, 7], [1, 2], [3, 0, 3]]  # 0 is also the pad id: told apart by the mask
    ti, tm = left_pad(hints, 0, "cpu")
    ci, cm = left_pad([[5, 6, 7], [1, 2, 9], [3, 0, 3]], 0, "cpu")
    assert rows_with_contrast(ti, tm, ci, cm).tolist() == [False, True, False]
    wider_i, wider_m = (torch.cat([torch.zeros(3, 2, dtype=torch.long), x], 1) for x in (ti, tm))
    assert rows_with_contrast(ti, tm, wider_i, wider_m).tolist() == [False, False, False]
    longer_i, longer_m = left_pad(
        [[4, 5, 6, 7], [1, 2], [0, 3, 0, 3]], 0, "cpu"
    )  # a real token more in front
    assert rows_with_contrast(ti, tm, longer_i, longer_m).tolist() == [True, False, True]
