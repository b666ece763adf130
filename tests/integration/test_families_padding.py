"""Padding exactness of completion scoring on every architecture family of `opsd.testing.families`.

A batch's rows are `[left-padded prompt ; right-padded completion]` with position ids from the masks
(`completion_hidden(fix_positions=True)`). For each family, each completion token's log-probs from the padded
batch must equal those of that row's own unpadded forward, in float32. Both roles are checked: the student's
rows (the bare problem) and the teacher's rows (the problem with its reference solution), i.e. two prompt sets
of different lengths scored on the same completions. The prompt lengths differ by far more than the sliding
windows (4 tokens), the conv kernels (3-4) and the Mamba2 scan chunks (16) of the tiny models, so padding that
leaked into any of them would show.

The comparison can fail, and the tests after the first show where: the reference rows (pads between prompt and
completion), completions numbered from the padded width, a batch without its attention mask, and raw head
logits without the family's logit transform all miss. Numbering left-padded rows 0..T-1 does not: it shifts a
whole row, which RoPE cancels, so that test pins the equality instead.
"""

from __future__ import annotations

import pytest
import torch

from opsd.method.hidden import completion_hidden, left_pad, positions, right_pad
from opsd.method.prompts import PromptBuilder
from opsd.testing.families import FAMILIES, build_family
from opsd.testing.tiny import build_tokenizer

# Families whose attention rotates queries and keys by position (granitemoehybrid and nemotron_h have none).
ROPE_FAMILIES = (
    "qwen3", "qwen3_5", "olmo3", "smollm3", "gemma3", "lfm2", "llama", "granite", "cohere", "cohere2", "gemma2",
    "falcon_h1", "phi3", "deepseek_v3", "qwen3_moe", "bamba",
)  # fmt: skip
# What each family applies after its lm_head, as its modeling code does it (the config field and the operation).
LOGIT_TRANSFORMS = {
    "granitemoehybrid": ("logits_scaling", "divide"),
    "granite": ("logits_scaling", "divide"),
    "cohere": ("logit_scale", "multiply"),
    "cohere2": ("logit_scale", "multiply"),
    "falcon_h1": ("lm_head_multiplier", "multiply"),
    "gemma3": ("final_logit_softcapping", "soft-cap"),
    "gemma2": ("final_logit_softcapping", "soft-cap"),
}
PROBLEMS = [
    ("What is 2 + 3?", "5"),
    (
        "A rectangle is 4 units wide and 7 units tall. A square has the same perimeter as the rectangle. "
        "What is the area of the square, and by how much does it exceed the area of the rectangle?",
        "The perimeter is 2 * (4 + 7) = 22, so the side of the square is 5.5 and its area is 30.25; "
        "the rectangle's area is 28, so the square's is larger by 2.25.",
    ),
    ("Add 5 and 9.", "Adding 5 and 9 gives 14."),
]
COMPLETIONS = ["I add them: 5.", "The answer is \\boxed{30.25}, which is 2.25 more than 28.", "14"]


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Every family's tiny model (eval mode) and the tokenizer they share, built once for the module."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("families")
    tok = build_tokenizer(root / "tokenizer")
    models = {}
    for name in FAMILIES:
        path = build_family(name, root / name, tokenizer=tok)
        models[name] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        models[name].family = name
    return models, tok


def _rows(tok, role: str) -> tuple[list[list[int]], list[list[int]]]:
    builder = PromptBuilder(tok)
    if role == "student":
        prompts = [builder.student_ids(problem) for problem, _ in PROBLEMS]
    else:
        prompts = [builder.teacher_ids(problem, reference).ids for problem, reference in PROBLEMS]
    completions = [
        tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for text in COMPLETIONS
    ]
    return prompts, completions


def _logit_transform(model, logits_NV: torch.Tensor) -> torch.Tensor:
    """What the family's forward applies after its lm_head (LOGIT_TRANSFORMS): Granite divides, Cohere and
    Falcon-H1 multiply, Gemma soft-caps."""
    if model.family not in LOGIT_TRANSFORMS:
        return logits_NV
    field, operation = LOGIT_TRANSFORMS[model.family]
    value = getattr(model.config, field)
    if operation == "divide":
        return logits_NV / value
    if operation == "multiply":
        return logits_NV * value
    return value * torch.tanh(logits_NV / value)


def _batched_logprobs(
    model, prompts, completions, pad, *, fix_positions=True, transform=True
) -> torch.Tensor:
    """(N, V) log-probs of every completion token, from the padded batch's completion hidden states
    (`fix_positions=False`: the reference code's rows; `transform=False`: the head's raw logits)."""
    p_ids, p_mask = left_pad(prompts, pad, "cpu")
    c_ids, c_mask = right_pad(completions, pad, "cpu")
    with torch.no_grad():
        hidden_NH = completion_hidden(
            model, p_ids, p_mask, c_ids, c_mask, fix_positions=fix_positions, pad_token_id=pad
        )
        logits_NV = model.get_output_embeddings()(hidden_NH)
        if transform:
            logits_NV = _logit_transform(model, logits_NV)
    return logits_NV.log_softmax(-1)


def _padded_forward_logprobs(model, prompts, completions, pad, *, layout: str) -> torch.Tensor:
    """(N, V) log-probs from the model's own logits on the padded batch, with one part of the layout changed:
    `naive` lets the model number positions 0..T-1; `completion_from_width` numbers completion token j
    P + j (P the padded prompt width) instead of Lp + j; `unmasked` attends to the padding."""
    p_ids, p_mask = left_pad(prompts, pad, "cpu")
    c_ids, c_mask = right_pad(completions, pad, "cpu")
    width, c_width = p_ids.size(1), c_ids.size(1)
    mask = torch.cat([p_mask, c_mask], dim=1)
    position_ids = positions(p_mask, c_width)
    if layout == "naive":
        position_ids = None
    elif layout == "completion_from_width":
        position_ids[:, width:] = width + torch.arange(c_width)
    elif layout == "unmasked":
        mask = torch.ones_like(mask)
    else:
        raise ValueError(f"layout={layout!r} is not one of naive, completion_from_width, unmasked")
    with torch.no_grad():
        logits_BTV = model(
            input_ids=torch.cat([p_ids, c_ids], dim=1), attention_mask=mask, position_ids=position_ids
        ).logits
    return logits_BTV[:, width - 1 : width - 1 + c_width][c_mask.bool()].log_softmax(-1)


def _unpadded_logprobs(model, prompts, completions) -> torch.Tensor:
    """(N, V) log-probs of every completion token, each row run alone with no padding at all."""
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions, strict=True):
            logits_TV = model(input_ids=torch.tensor([p + c])).logits[0]
            out.append(logits_TV[len(p) - 1 : len(p) + len(c) - 1].log_softmax(-1))
    return torch.cat(out)


def _gap_to_unpadded(families, family, forward=_batched_logprobs, **layout) -> float:
    """max |log p diff| between `forward` on the padded student rows of `family` (with `layout`) and the same
    rows run alone."""
    models, tok = families
    prompts, completions = _rows(tok, "student")
    got_NV = forward(models[family], prompts, completions, tok.pad_token_id, **layout)
    return (got_NV - _unpadded_logprobs(models[family], prompts, completions)).abs().max().item()


@pytest.mark.parametrize("role", ["student", "teacher"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_completion_logprobs_equal_unpadded_rows(families, family, role):
    models, tok = families
    model = models[family]
    prompts, completions = _rows(tok, role)
    lengths = sorted(map(len, prompts))
    assert lengths[-1] - lengths[0] > 16, "the padding must reach past every window, kernel and scan chunk"
    assert len({len(c) for c in completions}) == len(completions)

    got_NV = _batched_logprobs(model, prompts, completions, tok.pad_token_id)
    want_NV = _unpadded_logprobs(model, prompts, completions)
    assert got_NV.shape == (sum(map(len, completions)), len(tok))
    diff = (got_NV - want_NV).abs().max().item()
    assert diff <= 1e-5, f"{family} {role}: max |log p diff| = {diff:.2e}"


@pytest.mark.parametrize("family", sorted(LOGIT_TRANSFORMS))
def test_the_logit_transform_is_part_of_the_comparison(families, family):
    """Without Gemma's soft cap, Granite's division or Cohere's and Falcon-H1's multiplier, the head's raw logits
    miss the model's own."""
    assert _gap_to_unpadded(families, family, transform=False) > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_rows_differ_from_unpadded_rows(families, family):
    """The reference layout (prompt padded on the right, so pads sit between prompt and completion) is not
    the unpadded sequence: the comparison above fails on it, for every family."""
    assert _gap_to_unpadded(families, family, fix_positions=False) > 1e-3


@pytest.mark.parametrize("family", list(FAMILIES))
def test_completion_positions_counted_from_the_padded_width_shift_the_rope_families(families, family):
    """Numbering completions from the padded prompt width instead of each row's own prompt length moves them
    away from their prompt: every RoPE family notices. Families without RoPE (Mamba2 + NoPE attention) read
    no positions, so for them it stays exact."""
    diff = _gap_to_unpadded(families, family, _padded_forward_logprobs, layout="completion_from_width")
    if family in ROPE_FAMILIES:
        assert diff > 1e-4, f"{family}: shifted positions changed the log-probs by only {diff:.2e}"
    else:
        assert diff <= 1e-5, f"{family}: shifted positions changed the log-probs by {diff:.2e}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_naive_positions_on_left_padded_rows_are_a_shift_rope_cancels(families, family):
    """Positions 0..T-1 on left-padded rows add the row's pad count to every one of its tokens. RoPE only sees
    differences of positions, so this is exact up to rounding (here in float32): left padding alone is not
    what `fix_positions` repairs; the reference layout's pads between prompt and completion are."""
    assert _gap_to_unpadded(families, family, _padded_forward_logprobs, layout="naive") <= 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unmasked_padding_leaks_into_every_family(families, family):
    assert _gap_to_unpadded(families, family, _padded_forward_logprobs, layout="unmasked") > 1e-3
