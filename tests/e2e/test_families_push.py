"""Weights pushed into a running vLLM engine (the CPU build, in this process) are what it samples from, on the
held-out families of `opsd.testing.families` this vLLM runs: `push_weights` as the trainer's sync calls it, then
the log-probs of the engine's samples against transformers' for the same weights. Tied heads (qwen3's lm_head
shares the embedding's weight; gemma2's and cohere's vLLM classes have none and take their logits from the
embedding), MoE experts (which vLLM 0.32 leaves unpacked for its CPU kernel after a reload) and MLA attention
(deepseek_v3) all take the push. The two-step runs through opsd_train.py: tests/e2e/test_families_vllm.py."""

from __future__ import annotations

import gc

import pytest
import torch

from opsd.testing.families import build_family
from opsd.testing.tiny import build_tokenizer

pytest.importorskip("vllm")

# The held-out families this vLLM runs, and qwen3 (tied, with an lm_head that shares the embedding's weight).
PUSHED = ("llama", "granite", "cohere", "cohere2", "gemma2", "falcon_h1", "phi3", "deepseek_v3", "qwen3_moe",
          "qwen3")  # fmt: skip


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pushed-families")
    tok = build_tokenizer(root / "tokenizer")
    return {name: build_family(name, root / name, tokenizer=tok) for name in PUSHED}


def _engine_gap(engine, model, prompts) -> float:
    """max |log p| difference between the engine's sampled tokens' log-probs and transformers' for `model`."""
    from opsd.evaluation.sampling import SamplingConfig

    out = engine.generate(prompts, SamplingConfig(max_tokens=6, temperature=1.0, seed=3, logprobs=True))
    gap = 0.0
    for prompt, (sample,) in zip(prompts, out, strict=True):
        with torch.no_grad():
            logp = model(torch.tensor([prompt + sample.token_ids])).logits[0].float().log_softmax(-1)
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(sample.token_ids))
        ref = logp[at, torch.tensor(sample.token_ids)]
        gap = max(gap, (torch.tensor(sample.logprobs) - ref).abs().max().item())
    return gap


def measure(family: str, model_dir: str) -> dict[str, float]:
    """A running engine (the CPU backend, in this process) takes new weights through `push_weights`, as the
    trainer's sync does: the gaps of its samples' log-probs to transformers' for the old weights before the push,
    and for the new and the old weights after it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.evaluation.sampling import VLLMEngine
    from opsd.method.engine import merged_named_weights, push_weights

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(text)["input_ids"] for text in ("What is 2 + 3? Say it twice.", "Add 5 and 9, then 7.")]
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():  # every weight moves: embedding, tied or untied head, experts, norms
            p.add_(torch.randn_like(p) * 0.05)
        new.get_input_embeddings().weight.mul_(4.0)  # sharper logits, which a stale head would miss
    if family == "cohere2":
        # vLLM's Cohere2 attends to sliding_window + 1 keys (its reading of Cohere's training convention),
        # transformers' to sliding_window: the reference is transformers at the engine's window
        for m in (old, new):
            m.config.sliding_window += 1
            for attention in m.model.layers:
                if attention.self_attn.sliding_window is not None:
                    attention.self_attn.sliding_window = m.config.sliding_window
    engine = VLLMEngine(str(model_dir), max_model_len=256, dtype="float32")
    try:
        before = _engine_gap(engine, old, prompts)
        push_weights(
            engine.llm,
            merged_named_weights(new),
            tie_word_embeddings=new.config.get_text_config().tie_word_embeddings,
        )
        return {
            "before": before,
            "new": _engine_gap(engine, new, prompts),
            "old": _engine_gap(engine, old, prompts),
        }
    finally:
        del engine
        gc.collect()


@pytest.fixture(scope="module")
def gaps(family_dirs) -> dict[str, dict[str, float]]:
    """`measure` of every family, in a process of its own: tearing an in-process engine down destroys vLLM's
    distributed state, which the session's other in-process engines (tests/conftest.py's `vllm_tiny`) need."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import ENV

    root = Path(__file__).resolve().parents[2]
    code = (
        "import json, sys\n"
        "from tests.e2e.test_families_push import measure\n"
        "dirs = json.loads(sys.argv[1])\n"
        "print('GAPS ' + json.dumps({f: measure(f, d) for f, d in dirs.items()}))\n"
    )
    dirs = json.dumps({f: str(d) for f, d in family_dirs.items()})
    import os

    proc = subprocess.run([sys.executable, "-c", code, dirs], cwd=root, env={**os.environ, **ENV},
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("GAPS "))
    return json.loads(line.removeprefix("GAPS "))


@pytest.mark.parametrize("family", PUSHED)
def test_pushed_weights_are_what_the_engine_samples_from(family, gaps):
    """After `push_weights` the engine's samples' log-probs are transformers' for the new weights (and far from
    those of the old); before it, the engine runs the family as transformers does. Tied heads (qwen3's lm_head
    shares the embedding; gemma2 and cohere have none in vLLM), MoE experts (packed again for the CPU kernel)
    and MLA (deepseek_v3) all take the push."""
    got = gaps[family]
    assert got["before"] <= 1e-4  # the engine runs the family as transformers does
    assert got["new"] <= 1e-4
    assert got["old"] > 1e-2  # the push changed what it samples from
