"""RLCSD's contrastive teacher (Pan et al., arXiv 2606.11709, as its published code computes it): the OPSD target
anchored on the teacher, and the bounded modulation of the GRPO advantage (docs/method.md §1.10).

Notation: p_c = p_T(.|x, c, y<t), the teacher under the hint c (the reference, or a correct sibling rollout);
p_w = (1/K) sum_k p_T(.|x, c~_k, y<t), the teacher under K wrong hints in the identical template, averaged as
probabilities; p_S the student. All at the loss temperature.

**The target (`teacher_contrast`, the OPSD plug-in).** On the buckets B = the k tokens p_c ranks highest
(`contrast_top_k`) plus one tail bucket holding the rest of the vocabulary (each distribution's own tail,
1 - its mass on those k tokens; nothing renormalised; summed over the other tokens, `tail_log_mass`, not taken
as RLCSD's code takes it, log(1 - exp(logsumexp(top-k))) with the mass capped at 1 - 1e-7, which float32 rounding
spoils once the mass passes 1 - 1e-6),

    q ∝ p_c^(1 + α) / max(p_w, e^floor)^α          α = `contrast_weight`, floor = `contrast_log_floor`,

and the student's divergence from q over B replaces its divergence from p_c (the loss's beta, clip and loss type,
as for OPSD's teacher). Each token's loss is weighted by KL(p_c ‖ p_w) / (KL(p_c ‖ p_w) + τ) over B
(`contrast_kl_tau` = τ; 0: no weight), from the unfloored p_w. The target reads no student: for a frozen teacher it
is fixed, and α = 0 is OPSD's teacher on B. (A target built on the student instead, q ∝ p_S (p_c/p_w)^λ, re-tilts
the updated student by the same ratio after every step, has no fixed point, and collapsed training: §1.10.)

**The modulation (`method=hybrid`, the RL form).** With e_t = log p_c(y_t) - log p_w(y_t) on the sampled token
(full vocabulary), r_t = clip(λ tanh(e_t / τ_r), -2, 2) (λ = `contrast_rl_weight`, τ_r = `contrast_rl_tau`), kept
where |r_t| > δ (`contrast_rl_delta`) and added to the rollout's GRPO advantage A under a sign-preserving clamp:
Â_t = max(A + r_t, 0) for A > 0, min(A + r_t, 0) for A < 0, 0 for A = 0. The outcome decides the sign; the teacher
only reweights tokens inside it.

Shapes: N tokens, V vocabulary, K' = k + 1 buckets, J wrong hints. Every function here is dtype-agnostic (the loss calls
them in float32, the tests in float64) and runs without a graph: the target and every weight are constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The shipped configs' residual clip of the modulation (±2.0); with λ <= 2 it never binds.
RESIDUAL_CLIP = 2.0


def tail_log_mass(logp_NV: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
    """(N, 1) log of the mass outside the tokens `idx_NK`: a logsumexp over every other token's log-probability, as
    precise at a top-k mass of 1 - 1e-9 as at 0.5. (log(1 - top-k mass), RLCSD's form, cancels: in float32 its
    tail is off by up to ~50% once the mass passes 1 - 1e-6.) One (N, V) copy, reused for the sum."""
    rest_NV = logp_NV.scatter(-1, idx_NK, -math.inf)
    max_N1 = rest_NV.amax(-1, keepdim=True).clamp(min=torch.finfo(rest_NV.dtype).min)
    return rest_NV.sub_(max_N1).exp_().sum(-1, keepdim=True).log_().add_(max_N1)


def buckets(logp_NV: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
    """(N, k+1) log-probabilities of the k tokens `idx_NK` (full-vocabulary normalised) and of the tail, the rest of
    the vocabulary (`tail_log_mass`)."""
    return torch.cat([logp_NV.gather(-1, idx_NK), tail_log_mass(logp_NV, idx_NK)], -1)


def mean_hint_buckets(logp_JNV: torch.Tensor, valid_JN: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
    """(N, k+1) buckets of p_w = the mean of p_T(.|c~_h) over each token's valid hints (probabilities averaged:
    logsumexp over hints - log of their number). A token needs at least one valid hint."""
    per_hint_JNB = torch.stack([buckets(logp_JNV[j], idx_NK) for j in range(logp_JNV.shape[0])])
    per_hint_JNB = per_hint_JNB.masked_fill(~valid_JN[..., None], -math.inf)
    count_N1 = valid_JN.sum(0).clamp(min=1).to(per_hint_JNB.dtype)[:, None]
    return per_hint_JNB.logsumexp(0) - count_N1.log()


def target_log_probs(b_c_NB: torch.Tensor, b_w_NB: torch.Tensor, alpha: float, floor: float) -> torch.Tensor:
    """log q over the buckets, q ∝ p_c^(1+α) / max(p_w, e^floor)^α, normalised."""
    g_NB = b_c_NB * (1.0 + alpha) - b_w_NB.clamp(min=floor) * alpha
    return g_NB - g_NB.logsumexp(-1, keepdim=True)


def kl_weight(b_c_NB: torch.Tensor, b_w_NB: torch.Tensor, tau: float) -> torch.Tensor:
    """(N,) KL(p_c ‖ p_w) / (KL + τ) over the buckets (KL clamped at 0 against rounding); ones for τ = 0."""
    if tau == 0:
        return torch.ones_like(b_c_NB[:, 0])
    kl_N = (b_c_NB.exp() * (b_c_NB - b_w_NB)).sum(-1).clamp(min=0.0)
    return kl_N / (kl_N + tau)


def bucket_gradient(a_NB: torch.Tensor, logp_NV: torch.Tensor, idx_NK: torch.Tensor, tail_N: torch.Tensor):
    """dL/dx (N, V) for a loss of the student's buckets b = buckets(log_softmax(x), idx), given a = dL/db.

    For a top-k token u: a_u - p_u Σa. For any other u, through the tail log(1 - Σ_top p):
    a_tail p_u / P_tail - p_u Σa. `tail_N` is the student's tail bucket (log P_tail); p_u / P_tail <= 1 for every
    tail token, taken in log space (P_tail may be far below float32's smallest normal)."""
    p_NV = logp_NV.exp()
    grad_NV = (logp_NV - tail_N[:, None]).clamp_(max=0.0).exp_().mul_(a_NB[:, -1:])
    grad_NV.scatter_(-1, idx_NK, a_NB[:, :-1])
    return grad_NV.sub_(p_NV * a_NB.sum(-1, keepdim=True))


def bucket_index(idx_NK: torch.Tensor, ids_N: torch.Tensor) -> torch.Tensor:
    """(N,) each token's bucket: its place among the top-k `idx_NK`, or k (the tail)."""
    hit_NK = idx_NK == ids_N[:, None]
    return torch.where(hit_NK.any(-1), hit_NK.int().argmax(-1), torch.full_like(ids_N, idx_NK.shape[1]))


@dataclass
class ContrastSupport:
    """The student and the target on the buckets of a chunk (`contrast_support`).

    logp_s_NB, log_q_NB: (N, k+1) log-probabilities; idx_NK: the bucketed tokens; weight_N: the KL weight;
    logp_s_NV, logp_c_NV: the student's and the hinted teacher's full log-probabilities."""

    logp_s_NB: torch.Tensor
    log_q_NB: torch.Tensor
    idx_NK: torch.Tensor
    weight_N: torch.Tensor
    logp_s_NV: torch.Tensor
    logp_c_NV: torch.Tensor
    b_c_tail_N: torch.Tensor

    def gradient(self, a_NB: torch.Tensor) -> torch.Tensor:
        return bucket_gradient(a_NB, self.logp_s_NV, self.idx_NK, self.logp_s_NB[:, -1])

    def stats(self, eos_token_id: int | None) -> dict[str, torch.Tensor]:
        """Per-token diagnostics (N,): `contrast_kl` KL(q ‖ p_S) over the buckets; `argmax_differs` whether q's
        likeliest bucket is not the student's; `contrast_weight` the KL weight; with an end-of-sequence token,
        `eos_target` and `eos_student`, the probability q and p_S give it (where p_c ranks it outside the top-k, q's
        tail shared in proportion to p_c)."""
        q_NB = self.log_q_NB.exp()
        out = {
            "contrast_kl": (q_NB * (self.log_q_NB - self.logp_s_NB)).sum(-1),
            "argmax_differs": (self.log_q_NB.argmax(-1) != self.logp_s_NB.argmax(-1)).to(q_NB.dtype),
            "contrast_weight": self.weight_N,
        }
        if eos_token_id is not None:
            eos_N = torch.full_like(self.idx_NK[:, 0], eos_token_id)
            bucket_N = bucket_index(self.idx_NK, eos_N)
            tail_share_N = (self.logp_c_NV[:, eos_token_id] - self.b_c_tail_N).exp().clamp(max=1.0)
            share_N = torch.where(
                bucket_N == self.idx_NK.shape[1], tail_share_N, torch.ones_like(tail_share_N)
            )
            out["eos_target"] = q_NB.gather(-1, bucket_N[:, None])[:, 0] * share_N
            out["eos_student"] = self.logp_s_NV[:, eos_token_id].exp()
        return out


def contrast_support(
    x_NV: torch.Tensor,
    xt_NV: torch.Tensor,
    xw_JNV: torch.Tensor,
    valid_JN: torch.Tensor,
    *,
    alpha: float,
    top_k: int,
    floor: float,
    kl_tau: float,
) -> ContrastSupport:
    """The target q of a chunk from temperature-scaled logits: the student's x (N, V), the teacher's under the
    hint xt (N, V) and under each wrong hint xw (J, N, V), `valid_JN` marking the hints each token has."""
    logp_c_NV = F.log_softmax(xt_NV, -1)
    idx_NK = logp_c_NV.topk(min(top_k, x_NV.shape[-1] - 1), dim=-1).indices
    b_c_NB = buckets(logp_c_NV, idx_NK)
    b_w_NB = mean_hint_buckets(F.log_softmax(xw_JNV, -1), valid_JN, idx_NK)
    logp_s_NV = F.log_softmax(x_NV, -1)
    return ContrastSupport(
        logp_s_NB=buckets(logp_s_NV, idx_NK),
        log_q_NB=target_log_probs(b_c_NB, b_w_NB, alpha, floor),
        idx_NK=idx_NK,
        weight_N=kl_weight(b_c_NB, b_w_NB, kl_tau),
        logp_s_NV=logp_s_NV,
        logp_c_NV=logp_c_NV,
        b_c_tail_N=b_c_NB[:, -1],
    )


def sampled_log_ratio(
    logp_c_N: torch.Tensor, logp_w_JN: torch.Tensor, valid_JN: torch.Tensor
) -> torch.Tensor:
    """e (N,) = log p_c(y) - log mean over each token's valid hints of p_T(y|c~_h), from the sampled token's
    log-probabilities under the hint (N,) and under each wrong hint (J, N)."""
    masked_JN = logp_w_JN.masked_fill(~valid_JN, -math.inf)
    count_N = valid_JN.sum(0).clamp(min=1).to(logp_c_N.dtype)
    return logp_c_N - (masked_JN.logsumexp(0) - count_N.log())


def modulated_advantages(
    advantages_B: torch.Tensor, e_BT: torch.Tensor, has_contrast_BT: torch.Tensor, *, weight: float, tau: float,
    delta: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """RLCSD's per-token advantage (B, T) from the rollouts' GRPO advantages (B,) and the contrastive log-ratio e of
    each sampled token (B, T); `has_contrast_BT` marks the tokens of rows with a hint pair (the others keep A).
    Returns (Â, selected): selected marks the tokens whose residual passed |r| > δ."""
    residual_BT = (torch.tanh(e_BT / tau) * weight).clamp(-RESIDUAL_CLIP, RESIDUAL_CLIP)
    selected_BT = (residual_BT.abs() > delta) & has_contrast_BT
    a_BT = advantages_B[:, None].expand_as(e_BT)
    raw_BT = a_BT + selected_BT.to(e_BT.dtype) * residual_BT
    zero_BT = torch.zeros_like(raw_BT)
    out_BT = torch.where(
        a_BT > 0, raw_BT.clamp(min=0.0), torch.where(a_BT < 0, raw_BT.clamp(max=0.0), zero_BT)
    )
    return out_BT, selected_BT
