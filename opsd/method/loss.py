"""On-policy self-distillation (OPSD) losses.

One model plays student p_S(.|x) and teacher p_T(.|x, c) on the same completion tokens. At every completion
position the full next-token distributions, both log_softmax(logits / tau), are compared with the generalized
Jensen-Shannon divergence

    D_beta = beta * KL(p_T || M) + (1 - beta) * KL(p_S || M),    M = beta * p_T + (1 - beta) * p_S,

with beta = 0 defined as forward KL(p_T || p_S) and beta = 1 as reverse KL(p_S || p_T). These endpoints are a
convention, not limits: D_beta -> 0 as beta -> 0 or 1 (D_beta / beta -> forward KL), so the loss scale jumps
there. D_beta = sum_v term_v with

    term_v = beta * p_T(v) * (log p_T(v) - log M(v)) + (1 - beta) * p_S(v) * (log p_S(v) - log M(v)).

Reduction convention: the batch-level functions return the SUM of per-token losses over valid tokens; the
caller divides by the global number of valid tokens, which keeps gradient accumulation and data parallelism
exact. Teacher inputs are always detached.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from opsd.configuration.choices import CLIP_MODES, LOSS_TYPES

STAT_KEYS = ("divergence", "clipped_frac", "top1_agree")


def _check_args(
    *,
    beta: float,
    temperature: float = 1.0,
    clip: float = 0.05,
    clip_mode: str = "element",
    top_k: int = 0,
    loss_type: str = "jsd",
    target_ids_N: torch.Tensor | None = None,
) -> None:
    """Validate token_divergence's keyword arguments (same names and defaults)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if clip_mode not in CLIP_MODES:
        raise ValueError(f"clip_mode must be one of {CLIP_MODES}, got {clip_mode!r}")
    if clip_mode != "none" and clip <= 0:
        raise ValueError(f"clip must be > 0 when clipping, got {clip}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if loss_type == "sampled_token" and target_ids_N is None:
        raise ValueError("loss_type='sampled_token' needs the sampled token ids")


def pointwise_jsd_terms(logp_s_NV: torch.Tensor, logp_t_NV: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-vocabulary-entry terms of D_beta; ``terms_NV.sum(-1)`` is the per-token divergence.

    term_v = beta p_T (log p_T - log M) + (1 - beta) p_S (log p_S - log M). The endpoints are special-cased
    (beta = 0: p_T (log p_T - log p_S); beta = 1: p_S (log p_S - log p_T)) because log(0) * 0 would be NaN;
    for 0 < beta < 1, log M = logaddexp(log beta + log p_T, log(1 - beta) + log p_S) is computed in log space.
    Inputs are log-probabilities (N, V); output (N, V), no reduction.
    """
    if beta == 0.0:
        return logp_t_NV.exp() * (logp_t_NV - logp_s_NV)
    if beta == 1.0:
        return logp_s_NV.exp() * (logp_s_NV - logp_t_NV)
    log_m_NV = torch.logaddexp(logp_t_NV + math.log(beta), logp_s_NV + math.log1p(-beta))
    return beta * logp_t_NV.exp() * (logp_t_NV - log_m_NV) + (1.0 - beta) * logp_s_NV.exp() * (
        logp_s_NV - log_m_NV
    )


def _clip_terms(terms_NV: torch.Tensor, clip: float, clip_mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum terms over vocab with clipping; returns (loss_N, clipped_frac_N). Clipped parts get no gradient."""
    if clip_mode == "element":
        # Only large positive terms are capped; negative terms pass, so a token's loss may be negative.
        return terms_NV.clamp(max=clip).sum(-1), (terms_NV > clip).float().mean(-1)
    total_N = terms_NV.sum(-1)
    if clip_mode == "none":
        return total_N, torch.zeros_like(total_N).detach()
    over_N = total_N > clip
    if clip_mode == "token":
        return total_N.clamp(max=clip), over_N.float()
    # "rescale": value becomes clip, but the gradient keeps its direction (scaled by clip / s).
    scale_N = torch.where(over_N, clip / total_N, torch.ones_like(total_N)).detach()
    return total_N * scale_N, over_N.float()


def _teacher_support(
    s_NV: torch.Tensor, t_NV: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(student, teacher, indices) over the loss's support: the teacher's top-k entries when 0 < top_k < V
    (indices (N, K)), else the whole vocabulary (K = V, indices None)."""
    if 0 < top_k < s_NV.shape[-1]:
        idx_NK = t_NV.topk(top_k, dim=-1).indices
        return s_NV.gather(-1, idx_NK), t_NV.gather(-1, idx_NK), idx_NK
    return s_NV, t_NV, None


def _log_prob_at(
    scaled_logits_NV: torch.Tensor, support_NK: torch.Tensor, ids_N: torch.Tensor
) -> torch.Tensor:
    """log p(y) = logit_y / tau - logsumexp over the support (full vocab, or the teacher's top-k)."""
    return scaled_logits_NV.gather(-1, ids_N[:, None]).squeeze(-1) - support_NK.logsumexp(-1)


def token_divergence(
    student_logits_NV: torch.Tensor,
    teacher_logits_NV: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    clip: float = 0.05,
    clip_mode: str = "element",
    top_k: int = 0,
    loss_type: str = "jsd",
    target_ids_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token OPSD loss on flat tokens; math in float32 whatever the input dtype.

    Both distributions are log_softmax(logits / temperature). With ``top_k > 0`` both are restricted to the
    teacher's top-k entries and renormalised over them.

    loss_type="jsd": loss_N = clipped sum_v term_v (see module docstring), clip_mode:
      "element": min(term_v, clip) summed over v; "token": min(sum_v term_v, clip);
      "rescale": s * sg(clip / s) if s = sum_v term_v > clip else s; "none": s.
    loss_type="sampled_token": loss_N = -sg(A) * log p_S(y), A = log p_T(y) - log p_S(y), y = target_ids_N,
      log-probs normalised over the same support as the JSD path (full vocab or teacher top-k; a y outside
      the top-k gets logit_y / tau - logsumexp(top-k)). clip / clip_mode are ignored.

    Args: student_logits_NV (N, V) with grad; teacher_logits_NV (N, V), detached here; target_ids_N (N,) long.
    Returns: loss_N (N,) float32, no reduction; stats, detached float32 (N,) tensors:
      "divergence": unclipped D_beta (over the top-k support when top_k > 0),
      "clipped_frac": element mode: fraction of support entries clamped; token/rescale: 1.0 if the token was
        clipped else 0.0; 0.0 for "none" and for sampled_token,
      "top1_agree": 1.0 where full-vocab argmax of student == teacher.
    """
    _check_args(
        beta=beta,
        temperature=temperature,
        clip=clip,
        clip_mode=clip_mode,
        top_k=top_k,
        loss_type=loss_type,
        target_ids_N=target_ids_N,
    )
    s_NV = student_logits_NV.float() / temperature
    t_NV = teacher_logits_NV.detach().float() / temperature
    top1_agree_N = (s_NV.argmax(-1) == t_NV.argmax(-1)).float()
    s_NK, t_NK, _ = _teacher_support(s_NV, t_NV, top_k)

    if loss_type == "jsd":
        terms_NK = pointwise_jsd_terms(F.log_softmax(s_NK, -1), F.log_softmax(t_NK, -1), beta)
        divergence_N = terms_NK.sum(-1).detach()
        loss_N, clipped_frac_N = _clip_terms(terms_NK, clip, clip_mode)
    else:
        with torch.no_grad():  # divergence is only a statistic here; keep it off the graph
            divergence_N = pointwise_jsd_terms(F.log_softmax(s_NK, -1), F.log_softmax(t_NK, -1), beta).sum(-1)
        logp_s_N = _log_prob_at(s_NV, s_NK, target_ids_N)
        advantage_N = (_log_prob_at(t_NV, t_NK, target_ids_N) - logp_s_N).detach()
        loss_N = -advantage_N * logp_s_N
        clipped_frac_N = torch.zeros_like(divergence_N)
    stats = {"divergence": divergence_N, "clipped_frac": clipped_frac_N.detach(), "top1_agree": top1_agree_N}
    return loss_N, stats


def _sum_stats(
    stats: dict[str, torch.Tensor], num_tokens: int, device: torch.device
) -> dict[str, torch.Tensor]:
    sums = {k: stats[k].sum().detach() for k in STAT_KEYS}
    sums["num_tokens"] = torch.tensor(float(num_tokens), device=device)
    return sums


def opsd_loss_from_logits(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BTV: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    target_ids_BT: torch.Tensor | None = None,
    **loss_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed OPSD loss over a padded batch from full logits (simple path: holds (B, T, V) logits).

    loss_sum = sum over positions with mask_BT == 1 of token_divergence(...)'s loss_N (float32 scalar; divide
    by the global valid-token count outside). ``loss_kwargs`` are token_divergence's keyword arguments;
    target_ids_BT (B, T) is needed for loss_type="sampled_token". An all-masked batch gives a zero loss that
    is still attached to the graph.
    Returns (loss_sum, stats_sums): detached 0-dim float32 tensors "divergence", "clipped_frac",
    "top1_agree" (sums over valid tokens of the per-token stats) and "num_tokens".
    """
    valid_BT = mask_BT.bool()
    target_ids_N = None if target_ids_BT is None else target_ids_BT[valid_BT]
    loss_N, stats = token_divergence(
        student_logits_BTV[valid_BT], teacher_logits_BTV[valid_BT], target_ids_N=target_ids_N, **loss_kwargs
    )
    return loss_N.sum(), _sum_stats(stats, loss_N.shape[0], loss_N.device)


def token_divergence_with_grad(
    student_logits_NV: torch.Tensor,
    teacher_logits_NV: torch.Tensor,
    *,
    beta: float,
    temperature: float = 1.0,
    clip: float = 0.05,
    clip_mode: str = "element",
    top_k: int = 0,
    loss_type: str = "jsd",
    target_ids_N: torch.Tensor | None = None,
    need_grad: bool = True,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """token_divergence (same arguments, same loss_N and stats) plus d(loss_N.sum())/d(student logits) (N, V)
    in float32, written out in closed form instead of recorded by autograd (the chunked loss's inner step).

    With x = student logits / tau over the support (full vocab or the teacher's top-k) and logp = log_softmax(x),
    every mode's loss is a function of logp; a_v = dL/dlogp_v is
      jsd, beta = 0:      -p_T(v)                      (forward KL)
      jsd, beta = 1:       p_S(v) (log p_S(v) - log p_T(v) + 1)   (reverse KL)
      jsd, 0 < beta < 1:  (1 - beta) p_S(v) (log p_S(v) - log M(v))
    times the clip's weight: element: [term_v <= clip]; token: [sum_v term_v <= clip]; rescale: sg(clip / s) for
    s > clip else 1; none: 1 (the subgradients torch.clamp uses). Through log_softmax, dL/dx = a - softmax(x) sum(a);
    sampled_token: dL/dx = -A (onehot(y) - softmax(x) over the support). Then dL/dlogits = dL/dx / tau, scattered
    back to the vocabulary for top-k. No autograd graph is kept, so a chunk costs a few (N, V) float32 buffers.
    """
    _check_args(
        beta=beta,
        temperature=temperature,
        clip=clip,
        clip_mode=clip_mode,
        top_k=top_k,
        loss_type=loss_type,
        target_ids_N=target_ids_N,
    )
    with torch.no_grad():
        x_NV = student_logits_NV.detach().to(torch.float32, copy=True).div_(temperature)
        xt_NV = teacher_logits_NV.detach().to(torch.float32, copy=True).div_(temperature)
        top1_agree_N = (x_NV.argmax(-1) == xt_NV.argmax(-1)).float()
        x_NK, xt_NK, idx_NK = _teacher_support(x_NV, xt_NV, top_k)
        logp_s_NK = F.log_softmax(x_NK, -1)
        logp_t_NK = F.log_softmax(xt_NK, -1)
        if loss_type == "sampled_token":
            advantage_N = _log_prob_at(xt_NV, xt_NK, target_ids_N) - _log_prob_at(x_NV, x_NK, target_ids_N)
        del xt_NV, xt_NK
        terms_NK = pointwise_jsd_terms(logp_s_NK, logp_t_NK, beta)
        divergence_N = terms_NK.sum(-1)

        if loss_type == "jsd":
            if clip_mode == "element":
                kept_NK = terms_NK <= clip
                loss_N = terms_NK.clamp(max=clip).sum(-1)
                clipped_frac_N = (~kept_NK).float().mean(-1)
            else:
                loss_N = divergence_N.clone()
                clipped_frac_N = torch.zeros_like(divergence_N)
                weight_N = torch.ones_like(divergence_N)
                if clip_mode != "none":
                    over_N = divergence_N > clip
                    clipped_frac_N = over_N.float()
                    if clip_mode == "token":
                        loss_N = divergence_N.clamp(max=clip)
                        weight_N = (~over_N).float()
                    else:  # rescale
                        weight_N = torch.where(over_N, clip / divergence_N, weight_N)
                        loss_N = divergence_N * weight_N
            grad_NV = None
            if need_grad:
                if beta == 0.0:
                    a_NK = logp_t_NK.exp_().neg_()
                elif beta == 1.0:
                    a_NK = (logp_s_NK - logp_t_NK).add_(1.0).mul_(logp_s_NK.exp())
                else:
                    log_m_NK = torch.logaddexp(logp_t_NK + math.log(beta), logp_s_NK + math.log1p(-beta))
                    a_NK = (logp_s_NK - log_m_NK).mul_(logp_s_NK.exp()).mul_(1.0 - beta)
                    del log_m_NK
                if clip_mode == "element":
                    a_NK.mul_(kept_NK)
                else:
                    a_NK.mul_(weight_N[:, None])
                grad_NV = _through_log_softmax(a_NK, logp_s_NK, idx_NK, x_NV.shape, temperature)
        else:
            loss_N = -advantage_N * _log_prob_at(x_NV, x_NK, target_ids_N)
            clipped_frac_N = torch.zeros_like(divergence_N)
            grad_NV = None
            if need_grad:
                # d(-A log p(y))/dx = -A onehot(y) + A softmax(x) over the support
                grad_NV = _scatter_support(logp_s_NK.exp_().mul_(advantage_N[:, None]), idx_NK, x_NV.shape)
                grad_NV.scatter_add_(-1, target_ids_N[:, None], -advantage_N[:, None])
                grad_NV.div_(temperature)
    stats = {"divergence": divergence_N, "clipped_frac": clipped_frac_N, "top1_agree": top1_agree_N}
    return loss_N, stats, grad_NV


def _scatter_support(values_NK: torch.Tensor, idx_NK: torch.Tensor | None, shape) -> torch.Tensor:
    if idx_NK is None:
        return values_NK
    return values_NK.new_zeros(shape).scatter_(-1, idx_NK, values_NK)


def _through_log_softmax(a_NK, logp_NK, idx_NK, shape, temperature: float) -> torch.Tensor:
    """dL/dx from a = dL/dlogp for logp = log_softmax(x): a - softmax(x) * sum(a), divided by tau; in place."""
    total_N1 = a_NK.sum(-1, keepdim=True)
    grad_NK = logp_NK.exp_().mul_(total_N1).neg_().add_(a_NK).div_(temperature)
    return _scatter_support(grad_NK, idx_NK, shape)


class _ChunkedOPSDLoss(torch.autograd.Function):
    """Loss sum and its gradients computed chunk by chunk in forward; backward only rescales them."""

    @staticmethod
    def forward(
        ctx,
        student_hidden_NH,
        teacher_hidden_NH,
        student_weight_VH,
        teacher_weight_VH,
        target_ids_N,
        chunk_size,
        loss_kwargs,
        grad_enabled,
    ):
        # needs_input_grad ignores the caller's no_grad, so eval passes grad_enabled=False to skip grad work.
        need_h = grad_enabled and ctx.needs_input_grad[0]
        need_w = grad_enabled and ctx.needs_input_grad[2]
        w_s_VH, w_t_VH = student_weight_VH.detach(), teacher_weight_VH.detach()
        h_t_NH = teacher_hidden_NH.detach()
        loss_sum = student_hidden_NH.new_zeros((), dtype=torch.float32)
        stat_sums_3 = student_hidden_NH.new_zeros(len(STAT_KEYS), dtype=torch.float32)
        grad_h_NH = torch.zeros_like(student_hidden_NH) if need_h else None
        # float32 accumulator: summing many bf16 chunk products in bf16 would lose precision.
        grad_w_VH = torch.zeros_like(w_s_VH, dtype=torch.float32) if need_w else None

        for start in range(0, student_hidden_NH.shape[0], chunk_size):
            end = start + chunk_size
            # Hidden states may come out of a mixed-precision model in float32 while lm_head is bf16: the
            # logits are computed in the weight's dtype, as the model's own lm_head would.
            h_s_CH = student_hidden_NH[start:end].detach()
            s_logits_CV = h_s_CH.to(w_s_VH.dtype) @ w_s_VH.T
            t_logits_CV = h_t_NH[start:end].to(w_t_VH.dtype) @ w_t_VH.T
            ids_C = None if target_ids_N is None else target_ids_N[start:end]
            loss_C, stats, g_CV = token_divergence_with_grad(
                s_logits_CV, t_logits_CV, target_ids_N=ids_C, need_grad=need_h or need_w, **loss_kwargs
            )
            del s_logits_CV, t_logits_CV
            chunk_loss = loss_C.sum()
            if g_CV is not None:
                # d(chunk loss)/d(logits) in closed form; the lm_head matmul is then differentiated by hand.
                if need_h:
                    grad_h_NH[start:end] = g_CV.to(w_s_VH.dtype) @ w_s_VH
                if need_w:
                    grad_w_VH.addmm_(g_CV.T, h_s_CH.float())
                del g_CV
            loss_sum += chunk_loss.detach()
            stat_sums_3 += torch.stack([stats[k].sum() for k in STAT_KEYS])

        ctx.save_for_backward(grad_h_NH, grad_w_VH)
        ctx.weight_dtype = student_weight_VH.dtype
        ctx.mark_non_differentiable(stat_sums_3)
        return loss_sum, stat_sums_3

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        grad_h_NH, grad_w_VH = ctx.saved_tensors
        if grad_h_NH is not None:
            grad_h_NH = grad_h_NH * grad_loss.to(grad_h_NH.dtype)
        if grad_w_VH is not None:
            grad_w_VH = (grad_w_VH * grad_loss).to(ctx.weight_dtype)
        return grad_h_NH, None, grad_w_VH, None, None, None, None, None


def chunked_opsd_loss(
    student_hidden_NH: torch.Tensor,
    teacher_hidden_NH: torch.Tensor,
    student_weight_VH: torch.Tensor,
    teacher_weight_VH: torch.Tensor,
    *,
    target_ids_N: torch.Tensor | None = None,
    chunk_size: int = 1024,
    **loss_kwargs: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed OPSD loss from final hidden states without materialising all (N, V) logits (training path).

    Equal to opsd_loss_from_logits on logits h @ W.T (lm_head without bias), but only ``chunk_size`` tokens'
    logits exist at a time. For each chunk the forward pass computes the student and teacher logits, the
    per-token loss (token_divergence, ``loss_kwargs`` are its keyword arguments) and right away the gradient
    of the chunk's loss sum w.r.t. the student hidden chunk, and w.r.t. the student weight (accumulated in a
    float32 (V, H) buffer) only if student_weight_VH requires grad (full fine-tuning, tied embeddings; not
    with LoRA). Backward multiplies the stored gradients by the incoming scalar gradient.

    Args: hidden states (N, H) of valid tokens only (after the final norm), lm_head weights (V, H); the
    teacher weight may be the student's own tensor (fixed teacher) or another one (EMA teacher); teacher
    hidden and weight never get gradients. target_ids_N (N,) for loss_type="sampled_token".
    Returns (loss_sum, stats_sums) like opsd_loss_from_logits; N = 0 gives a zero loss attached to the graph.
    """
    _check_args(target_ids_N=target_ids_N, **loss_kwargs)  # here, since N = 0 never reaches token_divergence
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be > 0, got {chunk_size}")
    loss_sum, stat_sums_3 = _ChunkedOPSDLoss.apply(
        student_hidden_NH,
        teacher_hidden_NH,
        student_weight_VH,
        teacher_weight_VH,
        target_ids_N,
        chunk_size,
        loss_kwargs,
        torch.is_grad_enabled(),
    )
    stats_sums = dict(zip(STAT_KEYS, stat_sums_3.unbind(), strict=True))
    stats_sums["num_tokens"] = torch.tensor(float(student_hidden_NH.shape[0]), device=loss_sum.device)
    return loss_sum, stats_sums
