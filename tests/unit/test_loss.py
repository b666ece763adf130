"""Tests for opsd.method.loss (the training loss) and opsd/testing/reference_loss.py (the same loss from
materialised logits, through autograd) against a naive float64 oracle written independently below."""

from __future__ import annotations

import math

import pytest
import torch

from opsd.configuration.config import OPSDConfig
from opsd.method import loss
from opsd.method.loss import LossSettings
from opsd.testing import reference_loss

ATOL = RTOL = 1e-5
BETAS = (0.0, 0.3, 0.5, 1.0)  # 0.3: asymmetric, so swapped mixture weights are caught
CLIP_MODES = ("element", "token", "rescale", "none")


# --------------------------------------------------------------------------------------------------------------
# Naive oracle: straight from the formulas, float64, no helpers shared with opsd.method.loss.
# --------------------------------------------------------------------------------------------------------------
def oracle(
    student_logits,
    teacher_logits,
    *,
    beta,
    tau=1.0,
    clip=0.05,
    clip_mode="none",
    top_k=0,
    loss_type="jsd",
    target_ids=None,
):
    """Returns dict of float64 tensors: loss (N,), divergence (N,), terms (N, K), clipped (bool, N or N x K)."""
    s = student_logits.double() / tau
    t = teacher_logits.detach().double() / tau
    s_sup, t_sup = s, t
    if top_k:
        idx = torch.argsort(t, dim=-1, descending=True)[:, :top_k]
        s_sup, t_sup = torch.gather(s, 1, idx), torch.gather(t, 1, idx)
    p_s = torch.exp(s_sup) / torch.exp(s_sup).sum(-1, keepdim=True)
    p_t = torch.exp(t_sup) / torch.exp(t_sup).sum(-1, keepdim=True)
    m = beta * p_t + (1 - beta) * p_s
    if beta == 0:
        terms = p_t * (torch.log(p_t) - torch.log(p_s))
    elif beta == 1:
        terms = p_s * (torch.log(p_s) - torch.log(p_t))
    else:
        terms = beta * p_t * (torch.log(p_t) - torch.log(m)) + (1 - beta) * p_s * (
            torch.log(p_s) - torch.log(m)
        )
    div = terms.sum(-1)

    if loss_type == "sampled_token":
        rows = torch.arange(s.shape[0])
        logp_s_y = s[rows, target_ids] - torch.log(torch.exp(s_sup).sum(-1))
        logp_t_y = t[rows, target_ids] - torch.log(torch.exp(t_sup).sum(-1))
        adv = (logp_t_y - logp_s_y).detach()
        return {
            "loss": -adv * logp_s_y,
            "divergence": div,
            "terms": terms,
            "clipped": torch.zeros_like(div) > 0,
        }
    if clip_mode == "element":
        clipped = terms > clip
        loss = torch.where(clipped, torch.tensor(clip, dtype=terms.dtype), terms).sum(-1)
    elif clip_mode == "token":
        clipped = div > clip
        loss = torch.where(clipped, torch.tensor(clip, dtype=div.dtype), div)
    elif clip_mode == "rescale":
        clipped = div > clip
        loss = torch.where(clipped, div * (clip / div.detach()), div)
    else:
        clipped = torch.zeros_like(div) > 0
        loss = div
    return {"loss": loss, "divergence": div, "terms": terms, "clipped": clipped}


# --------------------------------------------------------------------------------------------------------------
# The code under test, called with the loss's settings (opsd.method.loss.loss_settings builds them in training; here a
# test names the values it needs and the rest keep the published recipe's). top_k is the teacher support.
# --------------------------------------------------------------------------------------------------------------
def settings(
    *, beta, temperature=1.0, clip=0.05, clip_mode="element", top_k=0, loss_type="jsd", chunk_size=1024
) -> LossSettings:
    return LossSettings(
        beta=beta, temperature=temperature, clip=clip, clip_mode=clip_mode, teacher_support_k=top_k,
        loss_type=loss_type, chunk_size=chunk_size,
    )  # fmt: skip


def token_divergence(s, t, *, target_ids_N=None, **kw):
    return reference_loss.token_divergence(s, t, settings=settings(**kw), target_ids_N=target_ids_N)


def opsd_loss_from_logits(s, t, mask, *, target_ids_BT=None, **kw):
    return reference_loss.opsd_loss_from_logits(
        s, t, mask, settings=settings(**kw), target_ids_BT=target_ids_BT
    )


def token_divergence_with_grad(s, t, *, target_ids_N=None, need_grad=True, **kw):
    return loss.token_divergence_with_grad(
        s, t, settings=settings(**kw), target_ids_N=target_ids_N, need_grad=need_grad
    )


def chunked_opsd_loss(h_s, h_t, w_s, w_t, *, target_ids_N=None, **kw):
    return loss.chunked_opsd_loss(h_s, h_t, w_s, w_t, settings=settings(**kw), target_ids_N=target_ids_N)


def midpoint_threshold(values: torch.Tensor, q: float) -> float:
    """A clip value strictly between two sorted data points (no ties), so a fraction ~(1-q) is clipped."""
    v = values.detach().flatten().sort().values
    i = min(int(q * len(v)), len(v) - 2)
    return float((v[i] + v[i + 1]) / 2)


def pick_clip(s, t, *, beta, tau, clip_mode, top_k):
    """Choose a clip from the data so that clipping happens for some but not all entries/tokens."""
    unclipped = oracle(s, t, beta=beta, tau=tau, top_k=top_k)
    if clip_mode == "element":
        return midpoint_threshold(unclipped["terms"], 0.9)
    return midpoint_threshold(unclipped["divergence"], 0.5)


def assert_some_clipped(out, clip_mode):
    frac = out["clipped"].double().mean().item()
    if clip_mode == "none":
        assert frac == 0.0
    else:
        assert 0.0 < frac < 1.0, f"test data must clip some but not all (frac={frac})"


def close(a, b, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol)


def make_logits(n, v, seed, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(n, v, generator=g) * scale).requires_grad_()
    t = (torch.randn(n, v, generator=g) * scale + 0.5 * s.detach()).requires_grad_()  # correlated, like OPSD
    return s, t


# --------------------------------------------------------------------------------------------------------------
# token_divergence
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("clip_mode", CLIP_MODES)
@pytest.mark.parametrize("beta", BETAS)
def test_token_divergence_matches_oracle(beta, clip_mode, top_k, tau):
    s, t = make_logits(40, 11, seed=0)
    clip = pick_clip(s, t, beta=beta, tau=tau, clip_mode=clip_mode, top_k=top_k)
    kw = dict(beta=beta, tau=tau, clip=clip, clip_mode=clip_mode, top_k=top_k)
    s64 = s.detach().double().requires_grad_()
    ref = oracle(s64, t, **kw)
    assert_some_clipped(ref, clip_mode)

    loss_N, stats = token_divergence(
        s, t, beta=beta, temperature=tau, clip=clip, clip_mode=clip_mode, top_k=top_k
    )
    assert loss_N.dtype == torch.float32 and loss_N.shape == (40,)
    close(loss_N, ref["loss"])
    close(stats["divergence"], ref["divergence"])
    clipped_frac = ref["clipped"].double().mean(-1) if clip_mode == "element" else ref["clipped"].double()
    close(stats["clipped_frac"], clipped_frac)
    close(stats["top1_agree"], (s.argmax(-1) == t.argmax(-1)).double())
    assert all(not v.requires_grad and v.shape == (40,) for v in stats.values())

    w = torch.rand(40, dtype=torch.float64)  # random weights so per-token gradients are checked separately
    (g,) = torch.autograd.grad((loss_N * w.float()).sum(), s, retain_graph=True)
    (g_ref,) = torch.autograd.grad((ref["loss"] * w).sum(), s64)
    close(g, g_ref)
    (loss_N.sum()).backward()
    assert t.grad is None


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("top_k", [0, 5])
def test_sampled_token_matches_oracle(top_k, tau):
    s, t = make_logits(40, 11, seed=1)
    ids = torch.randint(0, 11, (40,), generator=torch.Generator().manual_seed(2))
    s64 = s.detach().double().requires_grad_()
    ref = oracle(s64, t, beta=0.5, tau=tau, top_k=top_k, loss_type="sampled_token", target_ids=ids)
    loss_N, stats = token_divergence(
        s, t, beta=0.5, temperature=tau, top_k=top_k, loss_type="sampled_token", target_ids_N=ids
    )
    close(loss_N, ref["loss"])
    close(stats["divergence"], ref["divergence"])
    assert stats["clipped_frac"].abs().sum() == 0
    close(torch.autograd.grad(loss_N.sum(), s)[0], torch.autograd.grad(ref["loss"].sum(), s64)[0])
    if top_k:  # some sampled tokens lie outside the teacher's top-k; they must still be finite
        in_topk = (t.topk(top_k, -1).indices == ids[:, None]).any(-1)
        assert not in_topk.all() and torch.isfinite(loss_N).all()


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize(
    ("loss_type", "clip_mode"), [("jsd", m) for m in CLIP_MODES] + [("sampled_token", "none")]
)
@pytest.mark.parametrize("beta", BETAS)
def test_closed_form_gradient_matches_oracle(beta, clip_mode, loss_type, top_k, tau):
    """The chunked loss's hand-written gradient against autograd through the float64 oracle."""
    s, t = make_logits(40, 11, seed=4)
    ids = torch.randint(0, 11, (40,), generator=torch.Generator().manual_seed(5))
    clip = pick_clip(s, t, beta=beta, tau=tau, clip_mode=clip_mode, top_k=top_k)
    kw = dict(beta=beta, clip=clip, clip_mode=clip_mode, top_k=top_k, loss_type=loss_type)
    s64 = s.detach().double().requires_grad_()
    ref = oracle(s64, t, tau=tau, target_ids=ids, **kw)
    if loss_type == "jsd":
        assert_some_clipped(ref, clip_mode)
    s_in = s.detach().clone()
    loss_N, stats, grad_NV = token_divergence_with_grad(s_in, t, temperature=tau, target_ids_N=ids, **kw)
    assert torch.equal(s_in, s.detach())  # the caller's logits are left as they were
    close(loss_N, ref["loss"])
    close(stats["divergence"], ref["divergence"])
    (g_ref,) = torch.autograd.grad(ref["loss"].sum(), s64)
    close(grad_NV, g_ref)
    plain_N, plain_stats = token_divergence(s, t, temperature=tau, target_ids_N=ids, **kw)
    close(loss_N, plain_N)
    for k in plain_stats:
        close(stats[k], plain_stats[k])
    _, _, none = token_divergence_with_grad(s, t, temperature=tau, target_ids_N=ids, need_grad=False, **kw)
    assert none is None


# --------------------------------------------------------------------------------------------------------------
# Closed-form properties
# --------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
def test_identical_distributions_have_zero_divergence(beta):
    s, _ = make_logits(16, 23, seed=3)
    loss_N, stats = token_divergence(s, s.detach().clone(), beta=beta, clip_mode="none")
    close(stats["divergence"], torch.zeros(16), atol=1e-6, rtol=0)
    close(loss_N, torch.zeros(16), atol=1e-6, rtol=0)
    assert stats["top1_agree"].all()


def test_beta_endpoints_are_forward_and_reverse_kl():
    s, t = make_logits(16, 23, seed=4)
    logp_s, logp_t = torch.log_softmax(s.detach().double(), -1), torch.log_softmax(t.detach().double(), -1)
    forward_kl = (logp_t.exp() * (logp_t - logp_s)).sum(-1)
    reverse_kl = (logp_s.exp() * (logp_s - logp_t)).sum(-1)
    close(token_divergence(s, t, beta=0.0, clip_mode="none")[0], forward_kl)
    close(token_divergence(s, t, beta=1.0, clip_mode="none")[0], reverse_kl)
    # The endpoints are a convention, not a limit: D_beta -> 0 as beta -> 0 or 1, with D_beta / beta -> forward
    # KL and D_beta / (1 - beta) -> reverse KL (error O(beta)), so the mixture branch is consistent with them.
    eps = 1e-4
    close(token_divergence(s, t, beta=eps, clip_mode="none")[0] / eps, forward_kl, atol=0, rtol=2e-2)
    close(token_divergence(s, t, beta=1 - eps, clip_mode="none")[0] / eps, reverse_kl, atol=0, rtol=2e-2)


def test_hand_computed_v3():
    # p_T = (1/2, 1/4, 1/4), p_S = (1/4, 1/2, 1/4):
    #   KL(p_T||p_S) = 1/2 ln 2 + 1/4 ln(1/2) + 0 = 1/4 ln 2 = 0.1732868;  KL(p_S||p_T) = 1/4 ln 2 by symmetry.
    #   beta=1/2: M = (3/8, 3/8, 1/4); KL(p_T||M) = KL(p_S||M) = 1/2 ln(4/3) + 1/4 ln(2/3) = 0.0424748 = D_0.5.
    #   beta=0, element clip 0.05: terms (0.3465736, -0.1732868, 0) -> 0.05 - 0.1732868 + 0 = -0.1232868 (< 0).
    #   beta=0, token or rescale clip 0.05: min(0.1732868, 0.05) = 0.05.
    s = torch.tensor([[0.25, 0.5, 0.25]]).log().requires_grad_()
    t = torch.tensor([[0.5, 0.25, 0.25]]).log()
    ln2 = math.log(2)
    cases = [
        (dict(beta=0.0, clip_mode="none"), 0.25 * ln2),
        (dict(beta=1.0, clip_mode="none"), 0.25 * ln2),
        (dict(beta=0.5, clip_mode="none"), 0.5 * math.log(4 / 3) + 0.25 * math.log(2 / 3)),
        (dict(beta=0.0, clip_mode="element", clip=0.05), 0.05 - 0.25 * ln2),
        (dict(beta=0.0, clip_mode="token", clip=0.05), 0.05),
        (dict(beta=0.0, clip_mode="rescale", clip=0.05), 0.05),
    ]
    for kw, expected in cases:
        assert token_divergence(s, t, **kw)[0].item() == pytest.approx(expected, abs=1e-6), kw
    assert token_divergence(s, t, beta=0.5, clip_mode="none")[0].item() == pytest.approx(0.0424748, abs=1e-7)
    # rescale keeps the gradient direction: gradient = (clip / s) * unclipped gradient.
    (g_un,) = torch.autograd.grad(token_divergence(s, t, beta=0.0, clip_mode="none")[0].sum(), s)
    (g_rs,) = torch.autograd.grad(
        token_divergence(s, t, beta=0.0, clip_mode="rescale", clip=0.05)[0].sum(), s
    )
    close(g_rs, g_un * 0.05 / (0.25 * ln2))
    (g_tok,) = torch.autograd.grad(token_divergence(s, t, beta=0.0, clip_mode="token", clip=0.05)[0].sum(), s)
    assert g_tok.abs().sum() == 0


def test_invalid_arguments(tmp_path):
    # The loss's settings are checked once, where they enter: the config (the ranges and choices the switches
    # declare, opsd/configuration/switches.py, checked by opsd/configuration/checks.py).
    with pytest.raises(ValueError):
        OPSDConfig(output_dir=str(tmp_path), report_to="none", beta=1.5)
    with pytest.raises(ValueError):
        OPSDConfig(output_dir=str(tmp_path), report_to="none", beta=0.5, clip_mode="bogus")
    h, w = torch.zeros(2, 3), torch.zeros(5, 3)
    with pytest.raises(ValueError):
        chunked_opsd_loss(h, h, w, w, beta=0.5, loss_type="sampled_token")
    with pytest.raises(TypeError):
        loss.chunked_opsd_loss(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(5, 3), torch.zeros(5, 3))


# --------------------------------------------------------------------------------------------------------------
# Padded batches
# --------------------------------------------------------------------------------------------------------------
def make_batch(b, t_len, v, seed):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(b, t_len, v, generator=g) * 2).requires_grad_()
    t = (torch.randn(b, t_len, v, generator=g) * 2).requires_grad_()
    ids = torch.randint(0, v, (b, t_len), generator=g)
    return s, t, ids


MASK_3x6 = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])  # middle row empty


@pytest.mark.parametrize("loss_type", ["jsd", "sampled_token"])
@pytest.mark.parametrize("clip_mode", CLIP_MODES)
@pytest.mark.parametrize("beta", BETAS)
def test_opsd_loss_from_logits_masked(beta, clip_mode, loss_type):
    s, t, ids = make_batch(3, 6, 13, seed=6)
    valid = MASK_3x6.bool()
    clip = pick_clip(s[valid], t[valid], beta=beta, tau=0.7, clip_mode=clip_mode, top_k=5)
    s64 = s.detach().double().requires_grad_()
    kw = dict(beta=beta, clip=clip, clip_mode=clip_mode, top_k=5, loss_type=loss_type)
    ref = oracle(s64[valid], t[valid], tau=0.7, target_ids=ids[valid], **kw)
    if loss_type == "jsd":
        assert_some_clipped(ref, clip_mode)
    loss, sums = opsd_loss_from_logits(s, t, MASK_3x6, temperature=0.7, target_ids_BT=ids, **kw)
    close(loss, ref["loss"].sum())
    close(sums["divergence"], ref["divergence"].sum())
    assert sums["num_tokens"].item() == 10
    assert set(sums) == {"divergence", "clipped_frac", "top1_agree", "abs_advantage", "num_tokens"}
    assert all(v.ndim == 0 and not v.requires_grad for v in sums.values())
    loss.backward()
    ref["loss"].sum().backward()
    close(s.grad, s64.grad)
    assert s.grad[~valid].abs().sum() == 0
    assert t.grad is None


def test_all_masked_batch_is_zero_and_connected():
    s, t, _ = make_batch(2, 4, 7, seed=7)
    loss, sums = opsd_loss_from_logits(s, t, torch.zeros(2, 4), beta=0.5)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.isfinite(s.grad).all() and s.grad.abs().sum() == 0
    assert sums["num_tokens"].item() == 0 and sums["divergence"].item() == 0

    h = torch.randn(0, 4, requires_grad=True)
    w = torch.randn(7, 4, requires_grad=True)
    loss, sums = chunked_opsd_loss(h, torch.randn(0, 4), w, w, beta=0.5, chunk_size=8)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert h.grad is not None and h.grad.shape == (0, 4)
    assert torch.isfinite(w.grad).all() and w.grad.abs().sum() == 0
    assert sums["num_tokens"].item() == 0


# --------------------------------------------------------------------------------------------------------------
# Chunked hidden-state path
# --------------------------------------------------------------------------------------------------------------
def make_hidden(n, h, v, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h_s = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    h_t = (h_s.detach() + 0.7 * torch.randn(n, h, generator=g).to(dtype)).requires_grad_()
    w_s = (torch.randn(v, h, generator=g) * 0.6).to(dtype).requires_grad_()
    w_t = (w_s.detach() + 0.1 * torch.randn(v, h, generator=g).to(dtype)).requires_grad_()  # "EMA" teacher
    ids = torch.randint(0, v, (n,), generator=g)
    return h_s, h_t, w_s, w_t, ids


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("top_k", [0, 5])
@pytest.mark.parametrize("clip_mode", CLIP_MODES)
@pytest.mark.parametrize("beta", BETAS)
def test_chunked_matches_oracle(beta, clip_mode, top_k, tau):
    h_s, h_t, w_s, w_t, _ = make_hidden(37, 6, 19, seed=8)
    t_logits = h_t.detach().double() @ w_t.detach().double().T
    h64, w64 = h_s.detach().double().requires_grad_(), w_s.detach().double().requires_grad_()
    clip = pick_clip(h64 @ w64.T, t_logits, beta=beta, tau=tau, clip_mode=clip_mode, top_k=top_k)
    kw = dict(beta=beta, clip=clip, clip_mode=clip_mode, top_k=top_k)
    ref = oracle(h64 @ w64.T, t_logits, tau=tau, **kw)
    assert_some_clipped(ref, clip_mode)
    ref["loss"].sum().backward()

    loss, sums = chunked_opsd_loss(h_s, h_t, w_s, w_t, chunk_size=8, temperature=tau, **kw)
    (2.5 * loss).backward()  # a non-unit upstream gradient must scale the stored grads
    close(loss, ref["loss"].sum())
    close(h_s.grad, 2.5 * h64.grad)
    close(w_s.grad, 2.5 * w64.grad)
    assert h_t.grad is None and w_t.grad is None

    logits_loss, logits_sums = opsd_loss_from_logits(
        (h_s @ w_s.T)[None], (h_t @ w_t.T)[None], torch.ones(1, 37), temperature=tau, **kw
    )
    for k in logits_sums:
        close(sums[k], logits_sums[k])


def test_chunked_under_no_grad_gives_same_loss():
    h_s, h_t, w_s, w_t, _ = make_hidden(37, 6, 19, seed=16)
    loss, sums = chunked_opsd_loss(h_s, h_t, w_s, w_t, chunk_size=8, beta=0.5)
    with torch.no_grad():
        loss_eval, sums_eval = chunked_opsd_loss(h_s, h_t, w_s, w_t, chunk_size=8, beta=0.5)
    with torch.inference_mode():
        loss_inf, _ = chunked_opsd_loss(h_s, h_t, w_s, w_t, chunk_size=8, beta=0.5)
    assert not loss_eval.requires_grad
    close(loss_eval, loss)
    close(loss_inf, loss)
    for k in sums:
        close(sums_eval[k], sums[k])


@pytest.mark.parametrize("top_k", [0, 5])
def test_chunked_sampled_token(top_k):
    h_s, h_t, w_s, w_t, ids = make_hidden(37, 6, 19, seed=9)
    h64, w64 = h_s.detach().double().requires_grad_(), w_s.detach().double().requires_grad_()
    kw = dict(beta=0.5, top_k=top_k, loss_type="sampled_token")
    ref = oracle(h64 @ w64.T, h_t.detach().double() @ w_t.detach().double().T, tau=0.7, target_ids=ids, **kw)
    ref["loss"].sum().backward()
    loss, _ = chunked_opsd_loss(h_s, h_t, w_s, w_t, target_ids_N=ids, chunk_size=8, temperature=0.7, **kw)
    loss.backward()
    close(loss, ref["loss"].sum())
    close(h_s.grad, h64.grad)
    close(w_s.grad, w64.grad)


def test_chunked_lora_style_frozen_shared_weight():
    # Fixed teacher with LoRA: one frozen lm_head for both roles -> no weight grad, hidden grad still exact.
    h_s, h_t, w, _, _ = make_hidden(37, 6, 19, seed=10)
    w = w.detach()
    h64 = h_s.detach().double().requires_grad_()
    ref = oracle(
        h64 @ w.double().T, h_t.detach().double() @ w.double().T, beta=0.5, clip_mode="token", clip=0.1
    )
    ref["loss"].sum().backward()
    loss, _ = chunked_opsd_loss(h_s, h_t, w, w, chunk_size=8, beta=0.5, clip_mode="token", clip=0.1)
    loss.backward()
    close(h_s.grad, h64.grad)
    assert w.grad is None and h_t.grad is None


def test_chunked_trainable_shared_weight_gets_student_grad_only():
    # Tied / fully fine-tuned lm_head shared with the fixed teacher: only the student side contributes.
    h_s, h_t, w, _, _ = make_hidden(37, 6, 19, seed=11)
    h64, w64 = h_s.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = oracle(h64 @ w64.T, h_t.detach().double() @ w64.detach().T, beta=1.0, clip_mode="none")
    ref["loss"].sum().backward()
    loss, _ = chunked_opsd_loss(h_s, h_t, w, w, chunk_size=8, beta=1.0, clip_mode="none")
    loss.backward()
    close(w.grad, w64.grad)
    close(h_s.grad, h64.grad)


def test_chunked_large_vocab_equals_naive():
    h_s, h_t, w_s, w_t, _ = make_hidden(256, 16, 50_000, seed=12)
    kw = dict(beta=0.5, temperature=0.7, clip=0.001, clip_mode="element")
    loss_N, stats = token_divergence(h_s @ w_s.T, h_t @ w_t.T, **kw)
    assert stats["clipped_frac"].sum() > 0
    g_h, g_w = torch.autograd.grad(loss_N.sum(), (h_s, w_s))
    loss, _ = chunked_opsd_loss(h_s, h_t, w_s, w_t, chunk_size=32, **kw)
    loss.backward()
    close(loss, loss_N.sum())
    close(h_s.grad, g_h)
    close(w_s.grad, g_w)


def test_chunked_bf16_matches_naive_bf16():
    h_s, h_t, w_s, w_t, _ = make_hidden(37, 16, 64, seed=13, dtype=torch.bfloat16)
    loss_N, _ = token_divergence(h_s @ w_s.T, h_t @ w_t.T, beta=0.5)
    g_h, g_w = torch.autograd.grad(loss_N.sum(), (h_s, w_s))
    loss, _ = chunked_opsd_loss(h_s, h_t, w_s, w_t, chunk_size=8, beta=0.5)
    loss.backward()
    assert loss.dtype == torch.float32 and h_s.grad.dtype == w_s.grad.dtype == torch.bfloat16
    close(loss, loss_N.sum())
    close(h_s.grad, g_h, atol=1e-2, rtol=1e-2)
    close(w_s.grad, g_w, atol=1e-2, rtol=1e-2)


# --------------------------------------------------------------------------------------------------------------
# Normalisation: micro-batches scaled by the global valid-token count reproduce the full batch
# --------------------------------------------------------------------------------------------------------------
MASK_4x5 = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 0]])  # 7 + 4 valid


def test_grad_accumulation_logits_path():
    s, t, _ = make_batch(4, 5, 13, seed=14)
    kw = dict(beta=0.5, clip_mode="element", clip=0.05)
    n_global = int(MASK_4x5.sum())
    (loss_full, _) = opsd_loss_from_logits(s, t, MASK_4x5, **kw)
    (g_full,) = torch.autograd.grad(loss_full / n_global, s)
    for mb in (slice(0, 2), slice(2, 4)):
        loss_mb, _ = opsd_loss_from_logits(s[mb], t[mb], MASK_4x5[mb], **kw)
        (loss_mb / n_global).backward()
    close(s.grad, g_full, atol=1e-6, rtol=0)


def test_grad_accumulation_chunked_path():
    h_s, h_t, w_s, w_t, _ = make_hidden(4 * 5, 6, 19, seed=15)
    valid = MASK_4x5.flatten().bool()
    h_s3, h_t3 = h_s.view(4, 5, 6), h_t.view(4, 5, 6)
    kw = dict(beta=0.0, clip_mode="rescale", clip=0.3, chunk_size=3)
    n_global = int(valid.sum())
    loss_full, _ = chunked_opsd_loss(h_s[valid], h_t[valid], w_s, w_t, **kw)
    g_h, g_w = torch.autograd.grad(loss_full / n_global, (h_s, w_s))
    for mb in (slice(0, 2), slice(2, 4)):
        m = MASK_4x5[mb].bool()
        loss_mb, _ = chunked_opsd_loss(h_s3[mb][m], h_t3[mb][m], w_s, w_t, **kw)
        (loss_mb / n_global).backward()
    close(h_s.grad, g_h, atol=1e-6, rtol=0)
    close(w_s.grad, g_w, atol=1e-6, rtol=0)


def test_chunked_mixed_dtypes_compute_logits_in_weight_dtype():
    """float32 hidden states (autocast output) with a bf16 lm_head: same as casting the hidden states first."""
    torch.manual_seed(0)
    h_s = torch.randn(9, 16, requires_grad=True)
    h_t = torch.randn(9, 16)
    w = torch.randn(40, 16).to(torch.bfloat16)
    kw = dict(beta=0.5, temperature=1.0, clip=0.05, clip_mode="element")
    loss, _ = chunked_opsd_loss(h_s, h_t, w, w, chunk_size=4, **kw)
    loss.backward()
    h_s_bf = h_s.detach().to(torch.bfloat16).requires_grad_(True)
    ref, _ = chunked_opsd_loss(h_s_bf, h_t.to(torch.bfloat16), w, w, chunk_size=4, **kw)
    ref.backward()
    assert h_s.grad.dtype == torch.float32
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(h_s.grad, h_s_bf.grad.float(), atol=1e-2, rtol=1e-2)
