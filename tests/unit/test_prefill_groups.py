"""`prefill_groups` (opsd.method.engine, read by opsd.method.engine_vllm's `SeededLLM`): on vLLM's CPU backend a training generation runs as consecutive calls
whose prompts prefill together in one scheduler step (a split prefill of a seeded request crashes the CPU engine:
"CPU Generator does not use offset"). Hand-computed groups."""

from opsd.method.engine import prefill_groups


def _sizes(groups):
    return [(g.start, g.stop) for g in groups]


def test_prompts_that_fit_the_budget_stay_one_call():
    assert _sizes(prefill_groups([100] * 40, 4096, 64)) == [(0, 40)]


def test_the_budget_and_the_batch_cap_split_the_call_between_prompts():
    # 64 prompts of 100 tokens in a 4096-token budget: 40, then 24 (never a prompt cut in two)
    assert _sizes(prefill_groups([100] * 64, 4096, 64)) == [(0, 40), (40, 64)]
    assert _sizes(prefill_groups([10, 20, 30, 5], 50, 2)) == [(0, 2), (2, 4)]
    assert _sizes(prefill_groups([10, 20, 30, 5], 1000, 3)) == [(0, 3), (3, 4)]


def test_a_prompt_longer_than_the_budget_goes_alone_and_nothing_is_lost():
    lengths = [5000, 10, 4090, 7, 1]
    groups = prefill_groups(lengths, 4096, 8)
    assert _sizes(groups) == [(0, 1), (1, 2), (2, 3), (3, 5)]
    assert [i for g in groups for i in range(len(lengths))[g]] == list(range(len(lengths)))
    assert prefill_groups([], 4096, 8) == []
