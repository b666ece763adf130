"""Tests for opsd/testing/tiny.py: the locally trained tokenizer, its Qwen3-style chat template, and the tiny
Qwen3."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from opsd.testing.tiny import build_qwen3, build_tiny_model, build_tokenizer, tiny_qwen3_shape

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tiny_tok"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three tiny models: seed 0 twice and seed 1, each in its own folder."""
    return {
        name: build_tiny_model(tmp_path_factory.mktemp(name), seed=seed)
        for name, seed in (("a", 0), ("a_again", 0), ("b", 1))
    }


@pytest.mark.parametrize(
    "text",
    [
        "So the answer is $\\boxed{12}$.",
        "\\frac{1}{2} + x^2 = y_{n+1}, \\sqrt{3} \\le 2",
        "If 3x + 4 = 19, what is x?\n\nx = 5",
        "  leading and  double  spaces , before . punctuation !\n\t tab",
        "unicode: π ≈ 3.14, ∑ 漢字 üñ, emoji 🙂",
        "-7 and 999999 and 0123456789",
        "",
    ],
)
def test_roundtrip(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert all(0 <= i < len(tok) for i in ids)


def test_vocab_size_and_merges(tok):
    assert len(tok) == 512
    # Training learned merges: common text takes far fewer tokens than bytes.
    text = "What is the sum of the integers from 1 to 10? The answer is \\boxed{55}."
    assert len(tok(text, add_special_tokens=False)["input_ids"]) < len(text.encode()) / 2


def test_special_tokens_are_single_ids(tok):
    ids = [tok.convert_tokens_to_ids(s) for s in CONTROL_TOKENS]
    assert len(set(ids)) == len(CONTROL_TOKENS)
    for s, i in zip(CONTROL_TOKENS, ids, strict=True):
        assert tok(s, add_special_tokens=False)["input_ids"] == [i]
        assert tok.decode([i]) == s
    # Inside text as well.
    got = tok("a<|im_end|>\nb<think>c</think>", add_special_tokens=False)["input_ids"]
    assert ids[2] in got and ids[3] in got and ids[4] in got
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == ids[2]
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == ids[0]


def test_no_bos_added(tok):
    assert tok("hi", add_special_tokens=True)["input_ids"] == tok("hi", add_special_tokens=False)["input_ids"]


def test_chat_template_matches_qwen3_format(tok):
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    default = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert off == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert on == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    # Like Qwen3, thinking is on unless switched off.
    assert default == on
    assert no_gen == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
    ids = tok(off, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == off
    start, end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids("<|im_end|>")
    assert ids[0] == start and ids.count(start) == 2 and ids.count(end) == 1


def test_saved_tokenizer_reloads(tok, tmp_path):
    saved = build_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    assert loaded.get_vocab() == saved.get_vocab() == tok.get_vocab()
    text = "Ava has 10 apples. \\boxed{12}"
    assert (
        loaded(text, add_special_tokens=False)["input_ids"]
        == tok(text, add_special_tokens=False)["input_ids"]
    )
    msgs = [{"role": "user", "content": "x"}]
    assert loaded.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False
    ) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"


def test_tiny_model_loads_and_runs(models):
    path = models["a"]
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    cfg = model.config
    assert cfg.model_type == "qwen3"
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert cfg.vocab_size == len(tok) == 512
    assert cfg.head_dim >= 32
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert next(model.parameters()).dtype == torch.float32

    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.isfinite(logits).all()
    # Random weights give a non-degenerate distribution.
    assert logits[0, -1].std() > 0


def _state(path):
    return AutoModelForCausalLM.from_pretrained(str(path)).state_dict()


def test_same_seed_same_weights_different_seed_different(models):
    a, a2, b = _state(models["a"]), _state(models["a_again"]), _state(models["b"])
    assert a.keys() == a2.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], a2[k]), k
    # Every randomly initialised matrix differs under another seed (norm weights start at one either way).
    random_keys = [k for k in a if a[k].dim() == 2]
    assert random_keys
    for k in random_keys:
        assert not torch.equal(a[k], b[k]), k


def test_build_qwen3_custom_shape(tok, tmp_path):
    path = build_qwen3(
        tmp_path,
        tokenizer=tok,
        seed=3,
        **dict(
            tiny_qwen3_shape(),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=1,
        ),
    )
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert model.config.hidden_size == 32 and model.config.num_hidden_layers == 1
    assert model.config.vocab_size == len(tok)
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 5, 9]])).logits.shape == (1, 3, len(tok))
