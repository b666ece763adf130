"""The on-policy self-distillation (OPSD) loss: computed in chunks from final hidden states, its gradient in closed form.

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
exact. Teacher inputs are always detached. The same loss computed the reference code's way, from full
(B, T, V) logits through autograd, is opsd/testing/reference_loss.py: the benchmarks' baseline and the tests' check.

Two variants replace the teacher (docs/method.md §1.10-1.11):

- Contrastive target (`settings.contrast_weight` = lambda, a second teacher forward under a wrong hint c~):
  the teacher's distribution is replaced by q = softmax(sg(log p_S) + lambda (log p_T(.|c) - log p_T(.|c~))),
  and the divergence and its clip are computed against q exactly as against p_T. With sampled_token the
  advantage is A = lambda (log p_T(y|c) - log p_T(y|c~)).
- `loss_type="fixed_advantage"`: no teacher; loss_N = -a log p_S(y) with the constant a < 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from opsd.method.hidden import IDENTITY, LogitTransform

STAT_KEYS = ("divergence", "clipped_frac", "top1_agree", "abs_advantage")


@dataclass(frozen=True)
class LossSettings:
    """The loss's arguments, built in one place from a checked config (`loss_settings`).

    beta: the divergence's interpolation in [0, 1]; temperature > 0 of both distributions; clip > 0 and
    clip_mode (opsd.configuration.checks.choices.CLIP_MODES) the clip of the divergence; teacher_support_k:
    both distributions restricted to the teacher's top-k entries when 0 < k < V, else the full vocabulary;
    loss_type (LOSS_TYPES); chunk_size > 0: tokens whose (chunk, V) logits exist at a time;
    contrast_weight: None for OPSD's teacher, else lambda >= 0 of the contrastive target (a second teacher
    forward under a wrong hint, docs/method.md §1.10); fixed_advantage < 0: the constant advantage of
    loss_type="fixed_advantage" (no teacher). The config checks every value where it enters
    (opsd/configuration/checks/ranges.py, choices.py); nothing here does again.
    """

    beta: float
    temperature: float
    clip: float
    clip_mode: str
    teacher_support_k: int
    loss_type: str
    chunk_size: int
    contrast_weight: float | None = None
    fixed_advantage: float = -0.25

    @property
    def needs_teacher(self) -> bool:
        """Whether the loss reads a teacher at all (fixed_advantage reads none)."""
        return self.loss_type != "fixed_advantage"


def loss_settings(config) -> LossSettings:
    """The loss's arguments from an `OPSDConfig`, for every caller of the loss (trainer, probe, completions
    log, benchmarks). Here rather than on the config: the config sits a floor below the method (its fields
    checked there), and what the loss reads of them is the loss's business."""
    return LossSettings(
        beta=config.beta,
        temperature=config.loss_temperature or config.temperature,
        clip=config.divergence_clip,
        clip_mode=config.clip_mode,
        teacher_support_k=config.top_k_loss,
        loss_type=config.loss_type,
        chunk_size=config.loss_chunk_size,
        contrast_weight=None if config.teacher_contrast == "none" else config.contrast_weight,
        fixed_advantage=config.fixed_advantage,
    )


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


def clip_divergence(
    terms_NK: torch.Tensor, *, clip: float, clip_mode: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The clipped per-token loss from the divergence terms over the support: (loss_N, clipped_frac_N, weight).

    element: min(term_v, clip) summed over v (only large positive terms are capped; negative terms pass, so a
    token's loss may be negative); token: min(s, clip) with s = sum_v term_v; rescale: s * sg(clip / s) if
    s > clip else s (the value becomes clip, the gradient keeps its direction); none: s.
    clipped_frac_N: element: the share of support entries clamped; token/rescale: 1.0 if the token was
    clipped; none: 0.0. weight: d(loss_N)/d(term_v) as torch.clamp's subgradient has it, detached, (N, K) for
    element and (N, 1) otherwise. The loss is differentiable by autograd too when the terms carry a graph.
    """
    if clip_mode == "element":
        kept_NK = terms_NK <= clip
        return terms_NK.clamp(max=clip).sum(-1), (~kept_NK).float().mean(-1), kept_NK
    total_N = terms_NK.sum(-1)
    if clip_mode == "none":
        ones_N = torch.ones_like(total_N).detach()
        return total_N, torch.zeros_like(ones_N), ones_N[:, None]
    over_N = total_N > clip
    if clip_mode == "token":
        return total_N.clamp(max=clip), over_N.float(), (~over_N).float()[:, None]
    weight_N = torch.where(over_N, clip / total_N, torch.ones_like(total_N)).detach()  # rescale
    return total_N * weight_N, over_N.float(), weight_N[:, None]


def teacher_support(
    s_NV: torch.Tensor, t_NV: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(student, teacher, indices) over the loss's support: the teacher's top-k entries when 0 < k < V
    (indices (N, K)), else the whole vocabulary (K = V, indices None)."""
    if 0 < k < s_NV.shape[-1]:
        idx_NK = t_NV.topk(k, dim=-1).indices
        return s_NV.gather(-1, idx_NK), t_NV.gather(-1, idx_NK), idx_NK
    return s_NV, t_NV, None


def log_prob_at(
    scaled_logits_NV: torch.Tensor, support_NK: torch.Tensor, ids_N: torch.Tensor
) -> torch.Tensor:
    """log p(y) = logit_y / tau - logsumexp over the support (full vocab, or the teacher's top-k)."""
    return scaled_logits_NV.gather(-1, ids_N[:, None]).squeeze(-1) - support_NK.logsumexp(-1)


def contrastive_target(x_NV: torch.Tensor, log_ratio_NV: torch.Tensor, weight: float) -> torch.Tensor:
    """log q up to a constant per row, q = softmax(log p_S + lambda (log p_T(.|c) - log p_T(.|c~))), from the
    student's temperature-scaled logits x (N, V) and the teacher's log-ratio log p_T(.|c) - log p_T(.|c~) (N, V).
    The student's part is treated as a constant (q is a target; no gradient flows through it)."""
    return F.log_softmax(x_NV, -1).add_(log_ratio_NV, alpha=weight)


def token_divergence_with_grad(
    student_logits_NV: torch.Tensor,
    teacher_logits_NV: torch.Tensor | None,
    *,
    settings: LossSettings,
    target_ids_N: torch.Tensor | None,
    need_grad: bool,
    contrast_logits_NV: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """Per-token OPSD loss on flat tokens, and d(loss_N.sum())/d(student logits) (N, V) in float32 written out
    in closed form instead of recorded by autograd (the chunked loss's inner step); math in float32.

    Both distributions are log_softmax(logits / temperature), restricted to the teacher's top-k entries and
    renormalised over them when ``settings.teacher_support_k > 0``.
    loss_type="jsd": loss_N = the clipped sum_v term_v (`clip_divergence`, module docstring).
    loss_type="sampled_token": loss_N = -sg(A) * log p_S(y), A = log p_T(y) - log p_S(y), y = target_ids_N,
      log-probs normalised over the same support as the JSD path (a y outside the top-k gets
      logit_y / tau - logsumexp(top-k)); the clip is not applied.
    loss_type="fixed_advantage": loss_N = -a * log p_S(y) with a = settings.fixed_advantage (full vocabulary);
      no teacher is read (teacher_logits_NV may be None).
    With ``settings.contrast_weight`` = lambda (contrast_logits_NV: the teacher's logits under the wrong hint)
    the teacher is replaced by the target q (`contrastive_target`, over the full vocabulary) for jsd, and
    A = lambda (log p_T(y) - log p_T~(y)) for sampled_token.

    Gradient: with x = student logits / tau over the support and logp = log_softmax(x), every mode's loss is a
    function of logp; a_v = dL/dlogp_v is
      jsd, beta = 0:      -p_T(v)                      (forward KL)
      jsd, beta = 1:       p_S(v) (log p_S(v) - log p_T(v) + 1)   (reverse KL)
      jsd, 0 < beta < 1:  (1 - beta) p_S(v) (log p_S(v) - log M(v))
    times the clip's weight (`clip_divergence`). Through log_softmax, dL/dx = a - softmax(x) sum(a);
    sampled_token and fixed_advantage: dL/dx = -A (onehot(y) - softmax(x) over the support). Then
    dL/dlogits = dL/dx / tau, scattered back to the vocabulary for top-k. No autograd graph is kept, so a chunk
    costs a few (N, V) float32 buffers.

    Args: student_logits_NV (N, V); teacher_logits_NV (N, V); target_ids_N (N,) long, read by sampled_token and
    fixed_advantage (and by the abs_advantage statistic when given).
    Returns: loss_N (N,) float32, no reduction; stats, float32 (N,) tensors without a graph:
      "divergence": unclipped D_beta against the target (p_T, or q with a contrast; over the top-k support when
        teacher_support_k > 0); 0.0 for fixed_advantage,
      "clipped_frac": as `clip_divergence` says; 0.0 for sampled_token and fixed_advantage,
      "top1_agree": 1.0 where full-vocab argmax of student == teacher (under the reference); 0.0 without one,
      "abs_advantage": |A| of the sampled token (A as sampled_token would use it; |a| for fixed_advantage;
        0.0 without target ids);
    and the gradient (None unless need_grad).
    """
    beta, temperature = settings.beta, settings.temperature
    if settings.loss_type == "fixed_advantage":
        return _fixed_advantage(student_logits_NV, settings, target_ids_N, need_grad)
    with torch.no_grad():
        x_NV = student_logits_NV.detach().to(torch.float32, copy=True).div_(temperature)
        xt_NV = teacher_logits_NV.detach().to(torch.float32, copy=True).div_(temperature)
        top1_agree_N = (x_NV.argmax(-1) == xt_NV.argmax(-1)).float()
        advantage_N = None
        if settings.contrast_weight is not None:
            xw_NV = contrast_logits_NV.detach().to(torch.float32, copy=True).div_(temperature)
            # Each teacher's log-softmax once: the sampled-token advantage and the target both read the ratio.
            log_ratio_NV = F.log_softmax(xt_NV, -1).sub_(F.log_softmax(xw_NV, -1))
            del xw_NV
            if target_ids_N is not None:
                advantage_N = (
                    log_ratio_NV.gather(-1, target_ids_N[:, None]).squeeze(-1) * settings.contrast_weight
                )
            xt_NV = contrastive_target(x_NV, log_ratio_NV, settings.contrast_weight)
            del log_ratio_NV
        x_NK, xt_NK, idx_NK = teacher_support(x_NV, xt_NV, settings.teacher_support_k)
        logp_s_NK = F.log_softmax(x_NK, -1)
        logp_t_NK = F.log_softmax(xt_NK, -1)
        if advantage_N is None and target_ids_N is not None:
            advantage_N = log_prob_at(xt_NV, xt_NK, target_ids_N) - log_prob_at(x_NV, x_NK, target_ids_N)
        del xt_NV, xt_NK
        terms_NK = pointwise_jsd_terms(logp_s_NK, logp_t_NK, beta)
        divergence_N = terms_NK.sum(-1)
        abs_advantage_N = torch.zeros_like(divergence_N) if advantage_N is None else advantage_N.abs()

        grad_NV = None
        if settings.loss_type == "jsd":
            loss_N, clipped_frac_N, weight = clip_divergence(
                terms_NK, clip=settings.clip, clip_mode=settings.clip_mode
            )
            if need_grad:
                if beta == 0.0:
                    a_NK = logp_t_NK.exp_().neg_()
                elif beta == 1.0:
                    a_NK = (logp_s_NK - logp_t_NK).add_(1.0).mul_(logp_s_NK.exp())
                else:
                    log_m_NK = torch.logaddexp(logp_t_NK + math.log(beta), logp_s_NK + math.log1p(-beta))
                    a_NK = (logp_s_NK - log_m_NK).mul_(logp_s_NK.exp()).mul_(1.0 - beta)
                    del log_m_NK
                a_NK.mul_(weight)
                grad_NV = _through_log_softmax(a_NK, logp_s_NK, idx_NK, x_NV.shape, temperature)
        else:
            loss_N = -advantage_N * log_prob_at(x_NV, x_NK, target_ids_N)
            clipped_frac_N = torch.zeros_like(divergence_N)
            if need_grad:
                grad_NV = _policy_gradient(
                    logp_s_NK, advantage_N, idx_NK, x_NV.shape, target_ids_N, temperature
                )
    stats = {
        "divergence": divergence_N,
        "clipped_frac": clipped_frac_N,
        "top1_agree": top1_agree_N,
        "abs_advantage": abs_advantage_N,
    }
    return loss_N, stats, grad_NV


def _fixed_advantage(student_logits_NV, settings: LossSettings, target_ids_N, need_grad: bool):
    """loss_type="fixed_advantage": loss_N = -a log p_S(y) over the full vocabulary, no teacher."""
    if target_ids_N is None:
        raise ValueError("loss_type='fixed_advantage' needs the sampled token ids")
    with torch.no_grad():
        x_NV = student_logits_NV.detach().to(torch.float32, copy=True).div_(settings.temperature)
        logp_NV = F.log_softmax(x_NV, -1)  # once: the loss reads it at y, the gradient everywhere
        del x_NV
        advantage_N = torch.full_like(logp_NV[:, 0], settings.fixed_advantage)
        loss_N = -advantage_N * logp_NV.gather(-1, target_ids_N[:, None]).squeeze(-1)
        zeros_N = torch.zeros_like(loss_N)
        grad_NV = None
        if need_grad:
            grad_NV = _policy_gradient(logp_NV, advantage_N, None, None, target_ids_N, settings.temperature)
    stats = {
        "divergence": zeros_N,
        "clipped_frac": zeros_N,
        "top1_agree": zeros_N,
        "abs_advantage": advantage_N.abs(),
    }
    return loss_N, stats, grad_NV


def _policy_gradient(logp_NK, advantage_N, idx_NK, shape, target_ids_N, temperature: float) -> torch.Tensor:
    """d(-A log p(y))/dlogits = (A softmax(x) - A onehot(y)) / tau over the support, scattered to the vocabulary;
    consumes logp_NK."""
    grad_NV = _scatter_support(logp_NK.exp_().mul_(advantage_N[:, None]), idx_NK, shape)
    grad_NV.scatter_add_(-1, target_ids_N[:, None], -advantage_N[:, None])
    return grad_NV.div_(temperature)


def _scatter_support(values_NK: torch.Tensor, idx_NK: torch.Tensor | None, shape) -> torch.Tensor:
    if idx_NK is None:
        return values_NK
    return values_NK.new_zeros(shape).scatter_(-1, idx_NK, values_NK)


def _through_log_softmax(a_NK, logp_NK, idx_NK, shape, temperature: float) -> torch.Tensor:
    """dL/dx from a = dL/dlogp for logp = log_softmax(x): a - softmax(x) * sum(a), divided by tau; in place."""
    total_N1 = a_NK.sum(-1, keepdim=True)
    grad_NK = logp_NK.exp_().mul_(total_N1).neg_().add_(a_NK).div_(temperature)
    return _scatter_support(grad_NK, idx_NK, shape)


def _chunk_logits(h_CH: torch.Tensor, w_VH: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    """A chunk's logits in the weight's dtype, as the model's own lm_head computes them (hidden states may come
    out of a mixed-precision model in float32 while lm_head is bf16); the model's transform after it (a scale,
    a soft-cap) in float32."""
    logits_CV = h_CH.to(w_VH.dtype) @ w_VH.T
    return logits_CV if transform.identity else transform(logits_CV.float())


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
        settings,
        transform,
        grad_enabled,
        contrast_hidden_NH,
    ):
        # needs_input_grad ignores the caller's no_grad, so eval passes grad_enabled=False to skip grad work.
        need_h = grad_enabled and ctx.needs_input_grad[0]
        need_w = grad_enabled and ctx.needs_input_grad[2]
        w_s_VH = student_weight_VH.detach()
        teacher = settings.needs_teacher
        w_t_VH = teacher_weight_VH.detach() if teacher else None
        h_t_NH = teacher_hidden_NH.detach() if teacher else None
        h_w_NH = None if contrast_hidden_NH is None else contrast_hidden_NH.detach()
        loss_sum = student_hidden_NH.new_zeros((), dtype=torch.float32)
        stat_sums_K = student_hidden_NH.new_zeros(len(STAT_KEYS), dtype=torch.float32)
        grad_h_NH = torch.zeros_like(student_hidden_NH) if need_h else None
        # float32 accumulator: summing many bf16 chunk products in bf16 would lose precision.
        grad_w_VH = torch.zeros_like(w_s_VH, dtype=torch.float32) if need_w else None

        for start in range(0, student_hidden_NH.shape[0], settings.chunk_size):
            end = start + settings.chunk_size
            h_s_CH = student_hidden_NH[start:end].detach()
            s_logits_CV = _chunk_logits(h_s_CH, w_s_VH, transform)
            # The teacher's logits (under the reference, and under the wrong hint for a contrast) exist for
            # this chunk only, like the student's: never a (N, V) tensor of any of the three distributions.
            t_logits_CV = None if h_t_NH is None else _chunk_logits(h_t_NH[start:end], w_t_VH, transform)
            w_logits_CV = None if h_w_NH is None else _chunk_logits(h_w_NH[start:end], w_t_VH, transform)
            ids_C = None if target_ids_N is None else target_ids_N[start:end]
            loss_C, stats, g_CV = token_divergence_with_grad(
                s_logits_CV, t_logits_CV, settings=settings, target_ids_N=ids_C, need_grad=need_h or need_w,
                contrast_logits_NV=w_logits_CV,
            )  # fmt: skip
            if g_CV is not None and not transform.identity:
                g_CV = transform.backward_(g_CV, s_logits_CV)  # through the transform, to h @ W.T
            del s_logits_CV, t_logits_CV, w_logits_CV
            chunk_loss = loss_C.sum()
            if g_CV is not None:
                # d(chunk loss)/d(logits) in closed form; the lm_head matmul is then differentiated by hand.
                if need_h:
                    grad_h_NH[start:end] = g_CV.to(w_s_VH.dtype) @ w_s_VH
                if need_w:
                    grad_w_VH.addmm_(g_CV.T, h_s_CH.float())
                del g_CV
            loss_sum += chunk_loss.detach()
            stat_sums_K += torch.stack([stats[k].sum() for k in STAT_KEYS])

        ctx.save_for_backward(grad_h_NH, grad_w_VH)
        ctx.weight_dtype = student_weight_VH.dtype
        ctx.mark_non_differentiable(stat_sums_K)
        return loss_sum, stat_sums_K

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        grad_h_NH, grad_w_VH = ctx.saved_tensors
        if grad_h_NH is not None:
            grad_h_NH = grad_h_NH * grad_loss.to(grad_h_NH.dtype)
        if grad_w_VH is not None:
            grad_w_VH = (grad_w_VH * grad_loss).to(ctx.weight_dtype)
        return grad_h_NH, None, grad_w_VH, None, None, None, None, None, None


def chunked_opsd_loss(
    student_hidden_NH: torch.Tensor,
    teacher_hidden_NH: torch.Tensor | None,
    student_weight_VH: torch.Tensor,
    teacher_weight_VH: torch.Tensor | None,
    *,
    settings: LossSettings,
    target_ids_N: torch.Tensor | None,
    transform: LogitTransform = IDENTITY,
    contrast_hidden_NH: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed OPSD loss from final hidden states without materialising all (N, V) logits (the training path).

    loss_sum = sum over the N tokens of the per-token loss on logits transform(h @ W.T) (lm_head without bias;
    `transform` is what the model applies after it, `opsd.method.hidden`: identity for most families), but only
    ``settings.chunk_size`` tokens' logits exist at a time. For each chunk the forward pass computes the
    student and teacher logits, the per-token loss and right away (`token_divergence_with_grad`) the gradient
    of the chunk's loss sum w.r.t. the student hidden chunk, and w.r.t. the student weight (accumulated in a
    float32 (V, H) buffer) only if student_weight_VH requires grad (full fine-tuning, tied embeddings; not
    with LoRA). Backward multiplies the stored gradients by the incoming scalar gradient. The caller divides
    by the global number of valid tokens.

    Args: hidden states (N, H) of valid tokens only (after the final norm), lm_head weights (V, H); the
    teacher weight may be the student's own tensor (fixed teacher) or another one (EMA teacher); teacher
    hidden and weight never get gradients. target_ids_N (N,): the sampled tokens, which loss_type
    "sampled_token" and "fixed_advantage" need. contrast_hidden_NH (N, H): the teacher's hidden states under the
    wrong hint, required when settings.contrast_weight is set (scored with the teacher's weight); the teacher's
    hidden states and weight may be None for "fixed_advantage", which reads no teacher.
    Returns (loss_sum, stats_sums): a float32 scalar; detached 0-dim float32 tensors "divergence",
    "clipped_frac", "top1_agree", "abs_advantage" (sums over tokens of the per-token stats) and "num_tokens".
    N = 0 gives a zero loss attached to the graph.
    """
    if settings.loss_type != "jsd" and target_ids_N is None:
        raise ValueError(f"loss_type={settings.loss_type!r} needs the sampled token ids")
    if (settings.contrast_weight is None) != (contrast_hidden_NH is None):
        raise ValueError("a contrastive target needs the wrong-hint teacher's hidden states, and only it")
    loss_sum, stat_sums_K = _ChunkedOPSDLoss.apply(
        student_hidden_NH,
        teacher_hidden_NH,
        student_weight_VH,
        teacher_weight_VH,
        target_ids_N,
        settings,
        transform,
        torch.is_grad_enabled(),
        contrast_hidden_NH,
    )
    stats_sums = dict(zip(STAT_KEYS, stat_sums_K.unbind(), strict=True))
    stats_sums["num_tokens"] = torch.tensor(float(student_hidden_NH.shape[0]), device=loss_sum.device)
    return loss_sum, stats_sums


def loss_metrics(loss_sum: torch.Tensor, stats: dict, *, teacher: bool = True) -> dict[str, float]:
    """The `opsd/*` metrics of one micro-batch: `chunked_opsd_loss`'s sums per valid token (without the
    teacher's statistics when the loss read no teacher)."""
    n = max(float(stats["num_tokens"]), 1.0)
    keys = STAT_KEYS if teacher else ("abs_advantage",)
    return {**{f"opsd/{k}": float(stats[k]) / n for k in keys}, "opsd/loss_per_token": float(loss_sum) / n}
