"""RLCSD's contrastive target, its RL modulation and the per-token weights against references written here from
the papers' formulas (docs/method.md §1.10, §1.12): naive float64 oracles through autograd that share no code with
opsd.method (probabilities, not log-space; loops over rows, not cumulative sums), every loss type, clip mode,
hint mask and chunking; the target's fixed point by gradient descent; hand-computed modulations.

Which property each oracle pins (broken on purpose while writing them, each made the named test fail):
- the tail bucket left out or renormalised away -> test_target_loss_and_gradient_match_a_float64_oracle;
- the tail as log(1 - top-k mass) (RLCSD's form, which rounding spoils near a mass of 1) ->
  test_the_tail_bucket_is_exact_when_the_top_k_holds_nearly_all_the_mass;
- hints averaged in log space instead of as probabilities -> the same, in its two-hint cases;
- the floor applied to p_c, or not at all -> test_the_floor_holds_the_wrong_hint_below;
- the KL weight from the floored p_w, or left out -> test_target_loss_and_gradient_match_a_float64_oracle;
- the mask tested on |e| instead of |r|, or the clamp not sign-preserving -> test_modulation_matches_the_hand_cases;
- each token weight's formula (IW-OPD's accumulation made inclusive, PW-OPSD's position 0-based, the entropy gate
  without its floor, positive_only keeping every token) -> test_token_weights_match_their_formulas_through_the_loss
  (and test_row_weights_by_hand for the two row-wise ones).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from opsd.method import contrast_target, token_weights
from opsd.method.loss import ContrastHidden, ContrastSettings, LossSettings, chunked_opsd_loss
from opsd.method.scoring import token_rows

CLIP_MODES = ("element", "token", "rescale", "none")


def settings(*, beta=0.0, tau=1.0, clip=0.05, clip_mode="element", loss_type="jsd", chunk=4, token_weight="none",
             alpha=0.5, top_k=4, floor=-5.0, kl_tau=1.0, contrast=True):  # fmt: skip
    c = ContrastSettings(alpha=alpha, top_k=top_k, floor=floor, kl_tau=kl_tau) if contrast else None
    return LossSettings(
        beta=beta, temperature=tau, clip=clip, clip_mode=clip_mode, teacher_support_k=0, loss_type=loss_type,
        chunk_size=chunk, contrast=c, token_weight=token_weight,
    )  # fmt: skip


def naive_buckets(p, idx):
    """Probabilities (k+1,) of the tokens idx and of the rest, from one full distribution p (V,)."""
    top = p[idx]
    return torch.cat([top, (1 - top.sum()).reshape(1)])


def divergence_terms(s, q, beta):
    """Per-bucket terms of D_beta between the student's probabilities s and the target's q."""
    if beta == 0.0:
        return q * (q.log() - s.log())
    if beta == 1.0:
        return s * (s.log() - q.log())
    m = beta * q + (1 - beta) * s
    return beta * q * (q.log() - m.log()) + (1 - beta) * s * (s.log() - m.log())


def clipped(terms, clip, clip_mode):
    if clip_mode == "element":
        return torch.minimum(terms, torch.full_like(terms, clip)).sum()
    total = terms.sum()
    if clip_mode == "token":
        return torch.minimum(total, torch.full_like(total, clip))
    if clip_mode == "rescale":
        return total * (clip / total).detach() if total > clip else total
    return total


def naive_target(p_c, wrong_ps, idx, alpha, floor):
    """(q, p_c buckets, p_w buckets): RLCSD's target in probability space."""
    c = naive_buckets(p_c, idx)
    w = naive_buckets(torch.stack(wrong_ps).mean(0), idx)
    unnorm = c ** (1 + alpha) / torch.maximum(w, torch.full_like(w, math.exp(floor))) ** alpha
    return unnorm / unnorm.sum(), c, w


def naive_loss(h_s, h_t, h_w, valid, w_s, w_t, ids, cfg, rows=None):
    """The loss summed over tokens, one token at a time, with the token weights by their formulas."""
    c = cfg.contrast
    p_s_all = F.softmax((h_s @ w_s.T) / cfg.temperature, -1)
    total = 0.0
    advantages, weights = [], []
    for n in range(h_s.shape[0]):
        p_c = F.softmax((h_t[n] @ w_t.T) / cfg.temperature, -1).detach()
        wrong = [
            F.softmax((h_w[j, n] @ w_t.T) / cfg.temperature, -1).detach()
            for j in range(len(h_w))
            if valid[j, n]
        ]
        idx = torch.topk(p_c, c.top_k).indices
        q, bc, bw = naive_target(p_c, wrong, idx, c.alpha, c.floor)
        kl = (bc * (bc / bw).log()).sum().clamp(min=0)
        weight = kl / (kl + c.kl_tau) if c.kl_tau else torch.tensor(1.0, dtype=kl.dtype)
        s = naive_buckets(p_s_all[n], idx)
        y = int(ids[n])
        b = int((idx == y).nonzero()[0, 0]) if bool((idx == y).any()) else c.top_k
        advantage = (q[b].log() - s[b].log()).detach()
        if cfg.loss_type == "jsd":
            token = clipped(divergence_terms(s, q, cfg.beta), cfg.clip, cfg.clip_mode)
        else:
            token = -advantage * s[b].log()
        advantages.append(float(advantage))
        weights.append(weight)
        total = total + token * weight * token_weight_of(
            cfg.token_weight, n, rows, advantages, p_c, ids, advantage
        )
    return total


def token_weight_of(mode, n, rows, advantages, p_c, ids, advantage):
    if mode == "none":
        return 1.0
    if mode == "positive_only":
        return float(advantage > 0)
    if mode == "entropy_gate":
        h = float(-(p_c * p_c.log()).sum())
        return 0.1 + 0.9 * math.exp(-h / 1.0)
    raise AssertionError(mode)  # the row-wise weights are checked by test_row_weights_by_hand


def tensors(n=13, h=6, v=11, hints=2, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).requires_grad_()

    valid = torch.ones(hints, n, dtype=torch.bool)
    valid[1, ::3] = False  # some tokens have one hint, the others two
    return (
        r(n, h),
        r(n, h),
        r(hints, n, h).detach(),
        valid,
        r(v, h, scale=1.5),
        r(v, h, scale=1.5),
        torch.randint(0, v, (n,), generator=g),
    )


ORACLE_CASES = [(b, m, "jsd") for b in (0.0, 0.5, 1.0) for m in CLIP_MODES] + [
    (0.0, m, "sampled_token") for m in ("element", "none")
]


@pytest.mark.parametrize(("beta", "clip_mode", "loss_type"), ORACLE_CASES)
@pytest.mark.parametrize("kl_tau", [1.0, 0.0])
def test_target_loss_and_gradient_match_a_float64_oracle(beta, clip_mode, loss_type, kl_tau):
    h_s, h_t, h_w, valid, w_s, w_t, ids = tensors()
    kw = dict(beta=beta, tau=0.8, loss_type="jsd", alpha=0.7)
    with (
        torch.no_grad()
    ):  # a clip between data points, so that some tokens (entries) are clipped and some not
        mean = float(
            naive_loss(h_s, h_t, h_w, valid, w_s, w_t, ids, settings(**kw, clip_mode="none", kl_tau=0))
        )
    clip = 0.02 if clip_mode == "element" else mean / len(ids)
    cfg = settings(**{**kw, "loss_type": loss_type}, clip_mode=clip_mode, kl_tau=kl_tau, clip=clip)
    want = naive_loss(h_s, h_t, h_w, valid, w_s, w_t, ids, cfg)
    want_h, want_w = torch.autograd.grad(want, (h_s, w_s))
    got, sums = chunked_opsd_loss(h_s, h_t, w_s, w_t, settings=cfg, target_ids_N=ids,
                                  contrast=ContrastHidden(h_w, valid, eos_token_id=3))  # fmt: skip
    got_h, got_w = torch.autograd.grad(got, (h_s, w_s))
    torch.testing.assert_close(got.double(), want.detach(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_h.double(), want_h, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_w.double(), want_w, atol=1e-5, rtol=1e-4)
    assert float(want_h.abs().sum()) > 1e-3  # a signal to match, not two zeros
    assert {"contrast_kl", "argmax_differs", "contrast_weight", "eos_target", "eos_student"} <= set(sums)
    if loss_type == "jsd" and clip_mode != "none":
        assert 0 < float(sums["clipped_frac"]) < len(ids)


def test_the_diagnostics_match_their_definitions():
    h_s, h_t, h_w, valid, w_s, w_t, ids = tensors(seed=2)
    cfg = settings(top_k=3)
    eos = 7
    _, sums = chunked_opsd_loss(h_s, h_t, w_s, w_t, settings=cfg, target_ids_N=ids,
                                contrast=ContrastHidden(h_w, valid, eos_token_id=eos))  # fmt: skip
    kl = differs = eos_q = eos_s = weight = 0.0
    for n in range(len(ids)):
        p_s = F.softmax(h_s[n] @ w_s.T, -1).detach()
        p_c = F.softmax(h_t[n] @ w_t.T, -1).detach()
        wrong = [F.softmax(h_w[j, n] @ w_t.T, -1) for j in range(2) if valid[j, n]]
        idx = torch.topk(p_c, 3).indices
        q, bc, bw = naive_target(p_c, wrong, idx, 0.5, -5.0)
        s = naive_buckets(p_s, idx)
        kl += float((q * (q / s).log()).sum().detach())
        differs += float(q.argmax() != s.argmax())
        in_top = bool((idx == eos).any())
        eos_q += float(
            (q[int((idx == eos).nonzero()[0, 0])] if in_top else q[-1] * p_c[eos] / bc[-1]).detach()
        )
        eos_s += float(p_s[eos])
        k = float((bc * (bc / bw).log()).sum().detach())
        weight += k / (k + 1.0)
    n = len(ids)
    for key, want in (("contrast_kl", kl), ("argmax_differs", differs), ("eos_target", eos_q),
                      ("eos_student", eos_s), ("contrast_weight", weight)):  # fmt: skip
        assert float(sums[key]) == pytest.approx(want, rel=1e-5, abs=1e-6), key
    assert 0 < differs < n and 0 < eos_q  # both cases of each diagnostic occur


def test_the_tail_bucket_is_exact_when_the_top_k_holds_nearly_all_the_mass():
    """At a teacher's top-k mass of 1 - 1e-7 the tail is 1e-7: in float32, log(1 - top-k mass) has lost it to rounding
    (off by up to ~50%), the logsumexp over the other tokens keeps it to ~1e-6. The student's, the wrong hints' and
    q's tails against the float64 oracle, in the loss's float32."""
    V, k = 11, 4
    g = torch.Generator().manual_seed(6)
    order = torch.randperm(V, generator=g)

    def confident(tail_mass, top=(0.6, 0.25, 0.1, 0.05)):
        rest = torch.rand(V - k, generator=g, dtype=torch.float64) + 0.5
        p = torch.cat(
            [torch.tensor(top, dtype=torch.float64) * (1 - tail_mass), rest / rest.sum() * tail_mass]
        )
        return p.log()[order].float()

    x_t, x_s = confident(1e-7), confident(3e-7, top=(0.4, 0.3, 0.2, 0.1))
    x_w = torch.stack([confident(2e-7, top=(0.1, 0.2, 0.3, 0.4)), confident(5e-7)])[:, None]
    valid = torch.ones(2, 1, dtype=torch.bool)
    sup = contrast_target.contrast_support(x_s[None], x_t[None], x_w, valid, alpha=0.5, top_k=k, floor=-30.0,
                                           kl_tau=1.0)  # fmt: skip
    p_c = F.softmax(x_t.double(), -1)
    idx = torch.topk(p_c, k).indices
    assert torch.equal(sup.idx_NK[0], idx)
    assert 1 - float(p_c[idx].sum()) == pytest.approx(1e-7, rel=1e-4)  # the mass of the case, in float64
    q, b_c, b_w = naive_target(p_c, [F.softmax(x_w[j, 0].double(), -1) for j in range(2)], idx, 0.5, -30.0)
    s = naive_buckets(F.softmax(x_s.double(), -1), idx)
    tight = dict(rtol=1e-5, atol=0.0)
    torch.testing.assert_close(sup.b_c_tail_N[0].double().exp(), b_c[-1], **tight)
    torch.testing.assert_close(sup.logp_s_NB[0].double().exp(), s, **tight)
    torch.testing.assert_close(sup.log_q_NB[0].double().exp(), q, **tight)
    b_w_got = contrast_target.mean_hint_buckets(F.log_softmax(x_w, -1), valid, sup.idx_NK)
    torch.testing.assert_close(b_w_got[0].double().exp(), b_w, **tight)


def test_the_gradient_is_finite_when_the_students_tail_is_below_float32s_range():
    """The student's exact tail may be e^-149, whose inverse overflows float32: the tail tokens' gradient p_u / P_tail
    is taken in log space. Against autograd in float64 through log-space buckets."""
    from opsd.method.loss import token_divergence_with_grad

    x = torch.tensor([[3.0, 2.0, -150.0, -151.0, -152.0, -150.5]])
    t = torch.tensor([[1.0, 0.5, -2.0, -3.0, -1.0, -4.0]])
    w = torch.tensor([[[0.0, 1.0, -1.0, -2.0, 0.5, -3.0]]])
    valid = torch.ones(1, 1, dtype=torch.bool)
    cfg = settings(alpha=0.5, top_k=2, floor=-30.0, kl_tau=0.0, clip_mode="none")
    loss, _, grad = token_divergence_with_grad(x, t, settings=cfg, target_ids_N=None, need_grad=True,
                                               contrast=(w, valid, None))  # fmt: skip
    assert torch.isfinite(grad).all() and torch.isfinite(loss).all()

    def log_buckets(logp):
        idx = torch.tensor([0, 1])
        rest = logp.clone()
        rest[idx] = -math.inf
        return torch.cat([logp[idx], rest.logsumexp(-1, keepdim=True)])

    x64 = x[0].double().requires_grad_()
    b_s = log_buckets(F.log_softmax(x64, -1))
    b_c, b_w = log_buckets(F.log_softmax(t[0].double(), -1)), log_buckets(F.log_softmax(w[0, 0].double(), -1))
    g = 1.5 * b_c - 0.5 * b_w
    log_q = g - g.logsumexp(-1)
    want = (log_q.exp() * (log_q - b_s)).sum()
    (want_grad,) = torch.autograd.grad(want, x64)
    assert float(b_s[-1]) < -140  # the case: a tail far below float32's smallest normal (e^-87)
    torch.testing.assert_close(loss[0].double(), want.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad[0].double(), want_grad, rtol=1e-4, atol=1e-7)


def test_the_floor_holds_the_wrong_hint_below():
    b_c = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    b_w = torch.log(torch.tensor([[1e-4, 0.5, 0.4999]], dtype=torch.float64))
    got = contrast_target.target_log_probs(b_c, b_w, 1.0, floor=math.log(0.01)).exp()
    unnorm = torch.tensor([0.5**2 / 0.01, 0.3**2 / 0.5, 0.2**2 / 0.4999], dtype=torch.float64)
    torch.testing.assert_close(got[0], unnorm / unnorm.sum())


def test_hints_are_averaged_as_probabilities():
    logp = torch.log(torch.tensor([[[0.7, 0.2, 0.1]], [[0.1, 0.1, 0.8]]], dtype=torch.float64))
    idx = torch.tensor([[0]])
    valid = torch.tensor([[True], [True]])
    got = contrast_target.mean_hint_buckets(logp, valid, idx).exp()
    torch.testing.assert_close(got, torch.tensor([[0.4, 0.6]], dtype=torch.float64))
    one = contrast_target.mean_hint_buckets(logp, torch.tensor([[False], [True]]), idx).exp()
    torch.testing.assert_close(one, torch.tensor([[0.1, 0.9]], dtype=torch.float64))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 2.0])
def test_gradient_steps_on_the_student_converge_to_the_target(alpha):
    """With every token but one bucketed (k = V - 1) the buckets are the vocabulary: forward KL against q, minimised
    by gradient steps on the student's logits, ends at normalise(p_c^(1+α) / p_w^α); α = 0 at p_c."""
    g = torch.Generator().manual_seed(3)
    V = 6
    t = torch.randn(1, V, generator=g, dtype=torch.float64)
    w = torch.randn(2, 1, V, generator=g, dtype=torch.float64)
    p_c = F.softmax(t[0], -1)
    p_w = F.softmax(w[:, 0], -1).mean(0)
    want = p_c ** (1 + alpha) / p_w**alpha
    want = want / want.sum()
    x = torch.zeros(1, V, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([x], lr=0.05)
    cfg = settings(alpha=alpha, top_k=V - 1, floor=-30.0, kl_tau=0.0, clip_mode="none")
    from opsd.method.loss import token_divergence_with_grad

    valid = torch.ones(2, 1, dtype=torch.bool)
    for _ in range(3000):  # Adam's steps: the small entries converge as fast as the large ones
        _, _, grad = token_divergence_with_grad(x, t, settings=cfg, target_ids_N=None, need_grad=True,
                                                contrast=(w, valid, None))  # fmt: skip
        x.grad = grad.double()
        opt.step()
    got = F.softmax(x.detach()[0], -1)
    assert float((got - want).abs().max()) < 1e-4
    if alpha == 0.0:
        assert float((got - p_c).abs().max()) < 1e-4
    else:
        assert float((got - p_c).abs().max()) > 1e-3  # the contrast moved the fixed point


def test_a_hint_that_is_the_hint_has_no_weight_and_no_gradient():
    h_s, h_t, _, _, w_s, w_t, ids = tensors(seed=4)
    same = h_t.detach()[None]
    valid = torch.ones(1, len(ids), dtype=torch.bool)
    got, sums = chunked_opsd_loss(h_s, h_t, w_s, w_t, settings=settings(), target_ids_N=ids,
                                  contrast=ContrastHidden(same, valid))  # fmt: skip
    got_h, got_w = torch.autograd.grad(got, (h_s, w_s))
    assert float(got) == 0.0 and float(sums["contrast_weight"]) == 0.0
    assert not got_h.any() and not got_w.any()


# -- the RL modulation ------------------------------------------------------------------------------------------
def hand_modulation(a, e, has, lam, tau, delta):
    r = max(-2.0, min(2.0, lam * math.tanh(e / tau)))
    if not has or abs(r) <= delta:
        r = 0.0
    raw = a + r
    return max(raw, 0.0) if a > 0 else (min(raw, 0.0) if a < 0 else 0.0)


def test_modulation_matches_the_hand_cases():
    a = torch.tensor([0.8, 0.8, -0.5, -0.5, 0.0, 0.3, 0.3], dtype=torch.float64)
    e = torch.tensor([[0.05, -3.0], [1e-5, -1e-5], [0.2, -0.2], [-2.0, 5e-4], [1.0, -1.0], [-1.0, 0.01], [0.5, -0.5]],
                     dtype=torch.float64)  # fmt: skip
    has = torch.ones_like(e, dtype=torch.bool)
    has[6] = False
    got, selected = contrast_target.modulated_advantages(a, e, has, weight=0.5, tau=0.02, delta=0.02)
    for b in range(len(a)):
        for t in range(2):
            want = hand_modulation(float(a[b]), float(e[b, t]), bool(has[b, t]), 0.5, 0.02, 0.02)
            assert float(got[b, t]) == pytest.approx(want, abs=1e-12), (b, t)
    assert float(got[0, 1]) == pytest.approx(
        0.3
    )  # 0.8 - 0.5: a wrong-looking token of a right answer is pushed down, not below 0
    assert float(got[5, 0]) == 0.0  # clamped at zero: the sign stays the outcome's
    assert not selected[1].any() and not selected[6].any()  # |r| <= δ; a row without a hint pair


def test_modulation_with_zero_weight_is_the_grpo_advantage():
    a = torch.tensor([0.8, -0.5, 0.0], dtype=torch.float64)
    e = torch.randn(3, 5, dtype=torch.float64)
    got, selected = contrast_target.modulated_advantages(a, e, torch.ones_like(e, dtype=torch.bool), weight=0.0,
                                                         tau=0.02, delta=0.02)  # fmt: skip
    assert torch.equal(got, a[:, None].expand(3, 5)) and not selected.any()


def test_sampled_log_ratio_averages_the_wrong_hints_as_probabilities():
    lp_c = torch.log(torch.tensor([0.5, 0.5], dtype=torch.float64))
    lp_w = torch.log(torch.tensor([[0.1, 0.2], [0.3, 0.9]], dtype=torch.float64))
    valid = torch.tensor([[True, False], [True, True]])
    got = contrast_target.sampled_log_ratio(lp_c, lp_w, valid)
    torch.testing.assert_close(
        got, torch.tensor([math.log(0.5 / 0.2), math.log(0.5 / 0.9)], dtype=torch.float64)
    )


# -- the token weights ------------------------------------------------------------------------------------------
def test_row_weights_by_hand():
    rows = torch.tensor([0, 0, 0, 2, 2, 5])
    adv = torch.tensor([1.0, -3.0, 0.0, 0.0, 0.0, -2.0], dtype=torch.float64)
    early = token_weights.position_early(adv, rows)
    # row 0: C = 4; before the tokens 0, 1, 4 -> 1 + 0.5 (1 - 0/4), 1 + 0.5 (1 - 1/4), 1 + 0.5 (1 - 4/4)
    # row 2: C = 0 -> the ε floor, every weight 1 + γ; row 5: one token, 1 + γ
    torch.testing.assert_close(early, torch.tensor([1.5, 1.375, 1.0, 1.5, 1.5, 1.5], dtype=torch.float64))
    late = token_weights.position_late(rows, dtype=torch.float64)

    def pw(k, length):
        return 0.25 + 0.75 / (1 + math.exp(-(((k - 0.5) / length) - 0.3) / 0.1))

    want = [pw(1, 3), pw(2, 3), pw(3, 3), pw(1, 2), pw(2, 2), pw(1, 1)]
    torch.testing.assert_close(late, torch.tensor(want, dtype=torch.float64))


@pytest.mark.parametrize("loss_type", ["jsd", "sampled_token"])
@pytest.mark.parametrize("mode", ["position_early", "position_late", "entropy_gate", "positive_only"])
@pytest.mark.parametrize("contrast", [False, True])
def test_token_weights_match_their_formulas_through_the_loss(mode, loss_type, contrast):
    """Each weight times the unweighted per-token loss (computed token by token here), with rows from a padded
    mask, chunking across rows, with OPSD's teacher and with the contrastive target."""
    h_s, h_t, h_w, valid, w_s, w_t, ids = tensors(seed=5)
    mask = torch.tensor([[1] * 5 + [0] * 2, [1] * 7, [1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert int(mask.sum()) == len(ids)
    rows = token_rows(mask)
    base = settings(loss_type=loss_type, contrast=contrast, clip_mode="none")
    kw = dict(target_ids_N=ids, contrast=ContrastHidden(h_w, valid) if contrast else None)
    per_token = []
    for n in range(len(ids)):
        one = dict(kw, target_ids_N=ids[n : n + 1])
        if contrast:
            one["contrast"] = ContrastHidden(h_w[:, n : n + 1], valid[:, n : n + 1])
        loss_n, _ = chunked_opsd_loss(h_s[n : n + 1], h_t[n : n + 1], w_s, w_t, settings=base, **one)
        per_token.append(loss_n)
    with torch.no_grad():
        plain = token_divergence_stats(h_s, h_t, w_s, w_t, ids, base, kw["contrast"])
    if mode == "position_early":
        weights = naive_position_early(plain["advantage"], rows)
    elif mode == "position_late":
        weights = [
            0.25 + 0.75 / (1 + math.exp(-((k - 0.5) / n_row - 0.3) / 0.1)) for k, n_row in positions(rows)
        ]
    elif mode == "entropy_gate":
        weights = []
        for n in range(len(ids)):
            p = F.softmax(h_t[n] @ w_t.T, -1).detach()
            weights.append(0.1 + 0.9 * math.exp(-float(-(p * p.log()).sum())))
    else:
        weights = [float(a > 0) for a in plain["advantage"]]
    want = sum(w * loss for w, loss in zip(weights, per_token, strict=True))
    want_h = torch.autograd.grad(want, h_s)[0]
    got, sums = chunked_opsd_loss(h_s, h_t, w_s, w_t, settings=settings(loss_type=loss_type, contrast=contrast,
                                  clip_mode="none", token_weight=mode), rows_N=rows, **kw)  # fmt: skip
    got_h = torch.autograd.grad(got, h_s)[0]
    torch.testing.assert_close(got.double(), want.detach().double(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_h.double(), want_h.double(), atol=1e-5, rtol=1e-4)
    assert float(sums["token_weight"]) == pytest.approx(sum(weights), rel=1e-5)
    assert len(set(round(w, 6) for w in weights)) > 1  # the weights differ between tokens


def token_divergence_stats(h_s, h_t, w_s, w_t, ids, cfg, contrast):
    from opsd.method.loss import token_divergence_with_grad

    c = (
        None
        if contrast is None
        else (torch.stack([h @ w_t.T for h in contrast.hidden_JNH]), contrast.valid_JN, None)
    )
    _, stats, _ = token_divergence_with_grad(h_s @ w_s.T, h_t @ w_t.T, settings=cfg, target_ids_N=ids,
                                             need_grad=False, contrast=c)  # fmt: skip
    return {"advantage": [float(a) for a in stats["advantage"]]}


def positions(rows):
    out, counts = [], {}
    for r in rows.tolist():
        counts[r] = counts.get(r, 0) + 1
    seen = {}
    for r in rows.tolist():
        seen[r] = seen.get(r, 0) + 1
        out.append((seen[r], counts[r]))
    return out


def naive_position_early(advantages, rows):
    out = []
    for n, r in enumerate(rows.tolist()):
        same = [i for i, rr in enumerate(rows.tolist()) if rr == r]
        total = max(sum(abs(advantages[i]) for i in same), 1e-8)
        before = sum(abs(advantages[i]) for i in same if i < n)
        out.append(1 + 0.5 * (1 - before / total))
    return out


# -- own_wrong: the hints from the sibling rollouts ---------------------------------------------------------------
def test_sibling_hints_by_hand():
    from opsd.method.contrast import sibling_hints

    texts = [
        "a \\boxed{5}",
        "b \\boxed{7}",
        "c \\boxed{8}",
        "d no box",
        "e \\boxed{3}",
        "f \\boxed{120}",
        "g",
        "h",
    ]
    rewards = [1.0, 0.0, 0.0, 0.0, 0.0, 1.0, None, 0.0]
    refs = ["ref one", "ref one", "ref one", "ref one", "ref two", "ref two", "ref two", ""]
    hints, wrongs, record = sibling_hints(texts, rewards, refs, 4, max_hints=4, seed="s")
    # group 1: the only correct rollout has no correct sibling: its hint is the reference; its wrong hints are the
    # boxed wrong siblings (not the unboxed one), in some order; the others get rollout 0 as their hint.
    assert hints[0] == "ref one" and sorted(wrongs[0]) == ["b \\boxed{7}", "c \\boxed{8}"]
    assert hints[1] == hints[2] == hints[3] == "a \\boxed{5}"
    assert wrongs[1] == ["c \\boxed{8}"] and wrongs[2] == ["b \\boxed{7}"]  # never itself
    assert sorted(wrongs[3]) == ["b \\boxed{7}", "c \\boxed{8}"]
    # group 2: rollout 4 is the only boxed wrong one: it has no wrong sibling; row 7 has an empty reference but a
    # correct sibling; the ungraded row 6 is neither right nor wrong.
    assert hints[4] is None and wrongs[4] == []
    assert hints[5] == "ref two" and wrongs[5] == ["e \\boxed{3}"]
    assert hints[6] == hints[7] == "f \\boxed{120}" and wrongs[6] == wrongs[7] == ["e \\boxed{3}"]
    assert record == {"rows": 8.0, "rows_with_pair": 7.0, "hint_from_reference": 2.0, "wrong_hints": 9.0}
    again = sibling_hints(texts, rewards, refs, 4, max_hints=4, seed="s")
    assert again[:2] == (hints, wrongs)  # the same seed draws the same hints
    capped = sibling_hints(texts, rewards, refs, 4, max_hints=1, seed="s")[1]
    assert [len(w) for w in capped] == [1, 1, 1, 1, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="groups of 3"):
        sibling_hints(texts, rewards, refs, 3, max_hints=4, seed="s")
