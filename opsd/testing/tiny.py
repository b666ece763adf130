"""Small models built locally, for tests and benchmarks on machines with no hub access.

`build_tokenizer` trains a byte-level BPE tokenizer on the built-in problems and gives it a chat template
that mirrors Qwen3's: one user turn between `<|im_start|>`/`<|im_end|>`, and `enable_thinking=False`
appends the empty `<think>\\n\\n</think>\\n\\n` block after the assistant header.
`build_qwen3` writes a randomly initialised Qwen3 of any shape next to that tokenizer; with
`qwen3_1p7b_shape()` it is the Qwen3-1.7B architecture used by the GPU benchmarks.
"""

from __future__ import annotations

from pathlib import Path

QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def _corpus() -> list[str]:
    from opsd.data.builtin import builtin_train_rows
    from opsd.method.prompts import PromptBuilder

    rows = builtin_train_rows(n=400, seed=1)
    prompts = PromptBuilder()
    texts = []
    for r in rows:
        texts += [r["problem"], r["solution"], r["COT_Reason"], prompts.student_text(r["problem"])]
    return texts + ["\\boxed{} \\frac{1}{2} x^2 + y = z. 0123456789 The answer is"] * 20


def build_tokenizer(out_dir: str | Path, vocab_size: int = 512, pad_vocab_to: int = 0):
    """Train a byte-level BPE tokenizer with a Qwen3-style chat template and save it to `out_dir`.

    `pad_vocab_to` appends unreachable placeholder tokens up to that size, so that a model with a real
    vocabulary size (151,936 for Qwen3) can decode every id it samples.
    """
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=CONTROL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    if pad_vocab_to:
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        for i in range(len(vocab), pad_vocab_to):
            vocab[f"<unused_{i}>"] = i
        tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=QWEN3_CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out_dir))
    return fast


def qwen3_1p7b_shape() -> dict:
    """The Qwen3-1.7B architecture (random weights are enough for speed and memory measurements)."""
    return dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    )


# The size every tiny model shares: hidden 64, MLP 128, 2 query heads over 1 key/value head, 2048 positions; the
# attention heads are of dim 32 (vLLM's CPU attention rejects 16).
TINY_SIZE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=2048,
)
TINY_HEAD_DIM = 32


def tiny_qwen3_shape() -> dict:
    return dict(TINY_SIZE, num_hidden_layers=2, head_dim=TINY_HEAD_DIM, tie_word_embeddings=True)


def with_token_ids(shape: dict, tokenizer) -> dict:
    """`shape` with `tokenizer`'s special-token ids (bos is the pad token), and its vocabulary size unless `shape`
    sets one."""
    return {
        "vocab_size": len(tokenizer),
        **shape,
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def save_random(
    model_cls, config, out_dir: str | Path, *, tokenizer=None, seed: int = 0, dtype: str = "float32"
):
    """Save a `model_cls(config)` initialised under `seed` and cast to `dtype` (and `tokenizer`, if given) to
    `out_dir`; returns the path."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(str(out_dir))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out_dir))
    return Path(out_dir)


def build_qwen3(out_dir: str | Path, *, tokenizer=None, seed: int = 0, dtype: str = "float32", **shape):
    """Save a randomly initialised Qwen3 (and `tokenizer`, if given) to `out_dir`; returns the path."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = shape or tiny_qwen3_shape()
    if tokenizer is not None:
        shape = with_token_ids(shape, tokenizer)
    config = Qwen3Config(**shape, dtype=dtype)
    return save_random(Qwen3ForCausalLM, config, out_dir, tokenizer=tokenizer, seed=seed, dtype=dtype)


def build_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """A tiny Qwen3 with its locally trained tokenizer, ready for transformers and vLLM."""
    tok = build_tokenizer(out_dir)
    return build_qwen3(out_dir, tokenizer=tok, seed=seed)
