"""`rollout/logprob_gap` (opsd.run.logprob_gap): the sampler's processing of logits against a per-row reference
written from vLLM's rules, the statistics against numpy, the warning, and the curves' panel. The same functions
against vLLM's own sampled log-probs, family by family: tests/e2e/test_families_push.py."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
import torch

from opsd.method.hidden import LogitTransform
from opsd.run.logprob_gap import (
    GAP_WARNING,
    LogprobGap,
    engine_logprobs,
    logprob_gap_stats,
    sampling_logprobs,
    trainer_logprobs,
)


def _reference_logprob(
    logits: list[float], token: int, temperature: float, top_k: int, top_p: float
) -> float:
    """One row as vLLM's sampler draws it, in plain Python: logits / T; top-k keeps every token at least as large
    as the k-th largest; top-p, over the kept tokens' renormalised probabilities sorted from the least likely up,
    drops each token while the running sum is <= 1 - p, never the most likely; log of the renormalised rest."""
    x = [v / temperature for v in logits]
    kept = set(range(len(x)))
    if 0 < top_k < len(x):
        kth = sorted(x, reverse=True)[top_k - 1]
        kept = {i for i in kept if x[i] >= kth}
    if top_p < 1.0:
        total = sum(math.exp(x[i]) for i in kept)
        ascending = sorted(kept, key=lambda i: x[i])
        running = 0.0
        for i in ascending[:-1]:
            running += math.exp(x[i]) / total
            if running <= 1 - top_p:
                kept.discard(i)
    if token not in kept:
        return -math.inf
    return x[token] - math.log(sum(math.exp(x[i]) for i in kept))


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (1.1, 20, 0.95), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 3, 0.5), (1.0, 50, 1.0)],
)
def test_sampling_logprobs_follow_the_sampler(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits_NV = torch.randn(12, 40) * 3
    logits_NV[0, :4] = 2.0  # ties at the k-th value are kept
    tokens_N = torch.randint(0, 40, (12,))
    tokens_N[1] = logits_NV[1].argmax()  # the most likely token is never dropped
    got = sampling_logprobs(logits_NV, tokens_N, temperature=temperature, top_k=top_k, top_p=top_p)
    want = torch.tensor(
        [
            _reference_logprob(row.tolist(), int(t), temperature, top_k, top_p)
            for row, t in zip(logits_NV.double(), tokens_N, strict=True)
        ],
        dtype=torch.float64,
    )
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite].double(), want[finite], atol=1e-5, rtol=1e-5)
    if top_k == 0 and top_p == 1.0:  # no truncation: the tempered log-softmax
        ref = (logits_NV / temperature).log_softmax(-1).gather(-1, tokens_N[:, None]).squeeze(-1)
        torch.testing.assert_close(got, ref)


def test_trainer_logprobs_from_hidden_states_in_chunks():
    torch.manual_seed(1)
    hidden_NH, weight_VH = torch.randn(7, 8), torch.randn(30, 8)
    tokens_N = torch.randint(0, 30, (7,))
    softcap = LogitTransform(scale=0.5, softcap=5.0)
    logits_NV = 5.0 * torch.tanh(0.5 * (hidden_NH @ weight_VH.T) / 5.0)
    want = sampling_logprobs(logits_NV, tokens_N, temperature=1.1, top_k=10, top_p=0.9)
    for chunk in (1, 3, 100):
        got = trainer_logprobs(
            hidden_NH, weight_VH, softcap, tokens_N, temperature=1.1, top_k=10, top_p=0.9, chunk_size=chunk
        )
        torch.testing.assert_close(got, want)
    empty = trainer_logprobs(
        hidden_NH[:0], weight_VH, softcap, tokens_N[:0], temperature=1.0, top_k=0, top_p=1.0
    )
    assert empty.shape == (0,)


def test_gap_statistics_against_numpy():
    rng = np.random.default_rng(0)
    engine = torch.tensor(rng.normal(-2, 1, (4, 9)), dtype=torch.float32)
    trainer = engine + torch.tensor(rng.normal(0, 0.01, (4, 9)), dtype=torch.float32)
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[3, 5:] = False  # padding
    engine[0, 0] = math.nan  # a log-prob the engine did not give
    trainer[1, 2] = -math.inf  # a token outside the trainer's top-k / top-p set
    got = logprob_gap_stats(engine, trainer, mask)
    sampled = mask.numpy() & np.isfinite(engine.numpy())
    inside = sampled & np.isfinite(trainer.numpy())
    gap = np.abs(engine.numpy()[inside].astype(np.float64) - trainer.numpy()[inside])
    assert got["outside"] == pytest.approx(1 - inside.sum() / sampled.sum())
    assert got["mean"] == pytest.approx(gap.mean())
    assert got["p99"] == pytest.approx(np.percentile(gap, 99))
    assert got["max"] == pytest.approx(gap.max())
    # identical log-probs: no gap; nothing sampled: no statistics; all outside: only the share
    assert logprob_gap_stats(engine, engine, mask) == {"outside": 0.0, "mean": 0.0, "p99": 0.0, "max": 0.0}
    assert logprob_gap_stats(engine, trainer, torch.zeros_like(mask)) == {}
    assert logprob_gap_stats(engine, torch.full_like(trainer, -math.inf), mask) == {"outside": 1.0}


def test_engine_logprobs_are_padded_with_nan():
    rows = [[[-0.5], [-1.0], [None]], [[-2.0]], []]
    got = engine_logprobs(rows)
    assert got.shape == (3, 3) and got.dtype == torch.float32
    assert got[0, :2].tolist() == [-0.5, -1.0] and got[1, 0].item() == -2.0
    assert torch.isnan(got[0, 2]) and torch.isnan(got[1, 1:]).all() and torch.isnan(got[2]).all()


def test_the_warning_fires_once_above_the_dtype_threshold(caplog):
    engine = torch.zeros(2, 5)
    close, far = torch.full((2, 5), -1e-4), torch.full((2, 5), -0.01)
    mask = torch.ones(2, 5, dtype=torch.bool)
    with caplog.at_level(logging.WARNING, logger="opsd.run.logprob_gap"):
        half = LogprobGap(torch.bfloat16)
        assert half.threshold == GAP_WARNING[torch.bfloat16]
        assert half.metrics(engine, far, mask)["rollout/logprob_gap/mean"] == pytest.approx(0.01)
        assert not caplog.records  # 0.01 is the rounding of two bfloat16 kernels
        full = LogprobGap(torch.float32)
        metrics = full.metrics(engine, close, mask)
        assert set(metrics) == {f"rollout/logprob_gap/{k}" for k in ("outside", "mean", "p99", "max")}
        assert not caplog.records
        full.metrics(engine, far, mask)
        full.metrics(engine, far, mask)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "differ from the trainer's by 0.01 on average" in message
    assert "dtype" in message and "sliding window" in message and "stale weights" in message
    outside = LogprobGap(torch.float32)  # tokens the trainer would never sample warn too
    with caplog.at_level(logging.WARNING, logger="opsd.run.logprob_gap"):
        outside.metrics(engine, torch.tensor([[0.0] * 4 + [-math.inf]] * 2), mask)
    assert len(caplog.records) == 2 and "20.0% of them the trainer would never sample" in caplog.text


def test_the_curves_draw_the_gap(tmp_path):
    from opsd.run.curves import training_curves

    metrics = {f"rollout/logprob_gap/{k}": [(1, 1e-6), (2, 2e-6)] for k in ("mean", "p99", "max")}
    assert training_curves({"run": metrics}, tmp_path / "c.png") == [
        "|log p engine - log p trainer|, sampled tokens"
    ]


def test_from_hidden_flattens_the_batch_as_the_trainer_does():
    """A batch's engine log-probs (B, C, NaN-padded) against the trainer's from hidden states flattened over the
    completion mask: equal log-probs give no gap, one perturbed token gives its own."""
    from opsd.method.hidden import CompletionHiddenStates

    torch.manual_seed(2)
    mask_BC = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    ids_BC = torch.randint(0, 20, (2, 4))
    hidden_NH, weight_VH = torch.randn(5, 6), torch.randn(20, 6)
    hidden = CompletionHiddenStates(hidden_NH, None, weight_VH, None, LogitTransform(scale=2.0))
    settings = dict(temperature=1.1, top_k=0, top_p=1.0)
    trainer_N = sampling_logprobs(2.0 * hidden_NH @ weight_VH.T, ids_BC[mask_BC.bool()], **settings)
    engine_BC = torch.full((2, 4), math.nan)
    engine_BC[mask_BC.bool()] = trainer_N
    gap = LogprobGap(torch.float32)
    got = gap.from_hidden(engine_BC, ids_BC, mask_BC, hidden, **settings)
    assert got["rollout/logprob_gap/max"] < 1e-6 and got["rollout/logprob_gap/outside"] == 0.0
    engine_BC[1, 1] += 0.5
    got = gap.from_hidden(engine_BC, ids_BC, mask_BC, hidden, **settings)
    assert got["rollout/logprob_gap/max"] == pytest.approx(0.5, abs=1e-5)
    assert got["rollout/logprob_gap/mean"] == pytest.approx(0.1, abs=1e-5)
