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

- The contrastive target (`settings.contrast`, teacher forwards under wrong hints c~): RLCSD's q ∝
  p_T(.|c)^(1+α) / max(p_w, e^floor)^α on the teacher's top-k plus a tail bucket, each token weighted by
  KL(p_T(.|c) ‖ p_w) / (KL + τ) (`opsd.method.contrast_target`); the divergence, its clip and the sampled-token
  advantage are computed against q on those buckets exactly as against p_T.
- `loss_type="fixed_advantage"`: no teacher; loss_N = -a log p_S(y) with the constant a < 0.

`settings.token_weight` multiplies each token's loss by a detached weight (`opsd.method.token_weights`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from opsd.method import token_weights
from opsd.method.contrast_target import ContrastSupport, bucket_index, contrast_support
from opsd.method.hidden import IDENTITY, LogitTransform

STAT_KEYS = ("divergence", "clipped_frac", "top1_agree", "abs_advantage")
# Logged with a contrastive target (`ContrastSupport.stats`), and with a token weight its mean.
CONTRAST_STAT_KEYS = ("contrast_kl", "argmax_differs", "contrast_weight", "eos_target", "eos_student")


@dataclass(frozen=True)
class ContrastSettings:
    """RLCSD's target (`opsd.method.contrast_target`): alpha >= 0 (`contrast_weight`), the teacher's top_k >= 1
    tokens bucketed beside the tail (`contrast_top_k`), the floor <= 0 on log p_w (`contrast_log_floor`) and the
    KL weight's tau >= 0 (`contrast_kl_tau`; 0 = no weight)."""

    alpha: float = 0.5
    top_k: int = 100
    floor: float = -5.0
    kl_tau: float = 1.0


@dataclass(frozen=True)
class LossSettings:
    """The loss's arguments, built in one place from a checked config (`loss_settings`).

    beta: the divergence's interpolation in [0, 1]; temperature > 0 of both distributions; clip > 0 and
    clip_mode (opsd.configuration.switches.CHOICES) the clip of the divergence; teacher_support_k:
    both distributions restricted to the teacher's top-k entries when 0 < k < V, else the full vocabulary;
    loss_type (LOSS_TYPES); chunk_size > 0: tokens whose (chunk, V) logits exist at a time;
    contrast: None for OPSD's teacher, else RLCSD's target (`ContrastSettings`; teacher forwards under wrong
    hints, docs/method.md §1.10); fixed_advantage < 0: the constant advantage of loss_type="fixed_advantage" (no
    teacher); token_weight: the per-token weight (`opsd.method.token_weights.TOKEN_WEIGHTS`). The config checks
    every value where it enters (opsd/configuration/checks.py); nothing here does again.
    """

    beta: float
    temperature: float
    clip: float
    clip_mode: str
    teacher_support_k: int
    loss_type: str
    chunk_size: int
    contrast: ContrastSettings | None = None
    fixed_advantage: float = -0.25
    token_weight: str = "none"

    @property
    def needs_teacher(self) -> bool:
        """Whether the loss reads a teacher at all (fixed_advantage reads none)."""
        return self.loss_type != "fixed_advantage"

    def stat_keys(self) -> tuple[str, ...]:
        """The per-token statistics the loss sums (`opsd/<key>` metrics, per token)."""
        contrast = CONTRAST_STAT_KEYS if self.contrast is not None else ()
        return STAT_KEYS + contrast + (("token_weight",) if self.token_weight != "none" else ())


def loss_settings(config) -> LossSettings:
    """The loss's arguments from an `OPSDConfig`, for every caller of the loss (trainer, probe, completions
    log, benchmarks). Here rather than on the config: the config sits a floor below the method (its fields
    checked there), and what the loss reads of them is the loss's business."""
    contrast = None
    if config.contrast_on:
        contrast = ContrastSettings(
            alpha=config.contrast_weight,
            top_k=config.contrast_top_k,
            floor=config.contrast_log_floor,
            kl_tau=config.contrast_kl_tau,
        )
    return LossSettings(
        beta=config.beta,
        temperature=config.loss_temperature or config.temperature,
        clip=config.divergence_clip,
        clip_mode=config.clip_mode,
        teacher_support_k=config.top_k_loss,
        loss_type=config.loss_type,
        chunk_size=config.loss_chunk_size,
        contrast=contrast,
        fixed_advantage=config.fixed_advantage,
        token_weight=config.token_weight,
    )


# ------------------------------------------------------------------------------------------------------------
# The divergence D_beta, one class per case: `terms` (its value per vocabulary entry; the sum over v is the
# per-token divergence) and `dlogp` (its gradient d D_beta / d log p_S over a support, unclipped), side by side.
# The endpoints are classes of their own because log(0) * 0 would be NaN in the mixture's formula. Inputs are
# log-probabilities (N, K); outputs (N, K), no reduction.
# ------------------------------------------------------------------------------------------------------------
class ForwardKL:
    """beta = 0: KL(p_T || p_S). term_v = p_T (log p_T - log p_S); d/dlog p_S = -p_T."""

    @staticmethod
    def terms(logp_s_NK: torch.Tensor, logp_t_NK: torch.Tensor) -> torch.Tensor:
        return logp_t_NK.exp() * (logp_t_NK - logp_s_NK)

    @staticmethod
    def dlogp(logp_s_NK: torch.Tensor, logp_t_NK: torch.Tensor) -> torch.Tensor:
        return logp_t_NK.exp().neg_()


class ReverseKL:
    """beta = 1: KL(p_S || p_T). term_v = p_S (log p_S - log p_T); d/dlog p_S = p_S (log p_S - log p_T + 1)."""

    @staticmethod
    def terms(logp_s_NK: torch.Tensor, logp_t_NK: torch.Tensor) -> torch.Tensor:
        return logp_s_NK.exp() * (logp_s_NK - logp_t_NK)

    @staticmethod
    def dlogp(logp_s_NK: torch.Tensor, logp_t_NK: torch.Tensor) -> torch.Tensor:
        return (logp_s_NK - logp_t_NK).add_(1.0).mul_(logp_s_NK.exp())


@dataclass(frozen=True)
class GeneralizedJSD:
    """0 < beta < 1: beta KL(p_T || M) + (1 - beta) KL(p_S || M), M = beta p_T + (1 - beta) p_S.
    term_v = beta p_T (log p_T - log M) + (1 - beta) p_S (log p_S - log M); d/dlog p_S = (1 - beta) p_S (log p_S -
    log M) (the terms through M cancel)."""

    beta: float

    def log_mixture(self, logp_s_NK: torch.Tensor, logp_t_NK: torch.Tensor) -> torch.Tensor:
        """log M in log space: logaddexp(log beta + log p_T, log(1 - beta) + log p_S)."""
        return torch.logaddexp(logp_t_NK + math.log(self.beta), logp_s_NK + math.log1p(-self.beta))

    def terms(self, logp_s_NK: torch.Tensor, logp_t_NK: torch.Tensor) -> torch.Tensor:
        log_m_NK = self.log_mixture(logp_s_NK, logp_t_NK)
        return self.beta * logp_t_NK.exp() * (logp_t_NK - log_m_NK) + (1.0 - self.beta) * logp_s_NK.exp() * (
            logp_s_NK - log_m_NK
        )

    def dlogp(self, logp_s_NK: torch.Tensor, logp_t_NK: torch.Tensor) -> torch.Tensor:
        log_m_NK = self.log_mixture(logp_s_NK, logp_t_NK)
        return (logp_s_NK - log_m_NK).mul_(logp_s_NK.exp()).mul_(1.0 - self.beta)


def divergence(beta: float) -> ForwardKL | ReverseKL | GeneralizedJSD:
    """D_beta's class: forward KL at beta = 0, reverse KL at beta = 1, the generalized JSD in between."""
    if beta == 0.0:
        return ForwardKL()
    if beta == 1.0:
        return ReverseKL()
    return GeneralizedJSD(beta)


def pointwise_jsd_terms(logp_s_NV: torch.Tensor, logp_t_NV: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-vocabulary-entry terms of D_beta (`divergence(beta).terms`); ``terms_NV.sum(-1)`` is the per-token
    divergence. Inputs are log-probabilities (N, V); output (N, V), no reduction."""
    return divergence(beta).terms(logp_s_NV, logp_t_NV)


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


@dataclass(frozen=True)
class ContrastHidden:
    """The teacher's final hidden states under each wrong hint (J, N, H), which hints each token has (J, N) bool
    (a row may have fewer than J), and the end-of-sequence token id for the EOS diagnostics (None: not logged)."""

    hidden_JNH: torch.Tensor
    valid_JN: torch.Tensor
    eos_token_id: int | None = None

    def kept(self, keep_N: torch.Tensor) -> ContrastHidden:
        return ContrastHidden(self.hidden_JNH[:, keep_N], self.valid_JN[:, keep_N], self.eos_token_id)


def _scaled(logits_NV: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits_NV.detach().to(torch.float32, copy=True).div_(temperature)


def token_divergence_with_grad(
    student_logits_NV: torch.Tensor,
    teacher_logits_NV: torch.Tensor | None,
    *,
    settings: LossSettings,
    target_ids_N: torch.Tensor | None,
    need_grad: bool,
    contrast: tuple | None = None,
    weights_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
    """Per-token OPSD loss on flat tokens, and d(loss_N.sum())/d(student logits) (N, V) in float32 written out
    in closed form instead of recorded by autograd (the chunked loss's inner step); math in float32.

    The loss's target is the teacher (`_TeacherTarget`: both distributions log_softmax(logits / temperature), over
    the teacher's top-k when ``settings.teacher_support_k > 0``), RLCSD's q with ``settings.contrast`` (`contrast`:
    the wrong hints' logits (J, N, V), valid (J, N), eos id; `_ContrastTarget`), or none (`_fixed_advantage_loss`).
    Each loss type has one function with its value and its gradient: loss_type="jsd" (`_divergence_loss`): the
    clipped sum_v term_v (`clip_divergence`) of D_beta (`divergence`: `ForwardKL`, `ReverseKL`, `GeneralizedJSD`);
    "sampled_token" (`_sampled_token_loss`): -sg(A) log p_S(y) with A = log p_target(y) - log p_S(y),
    y = target_ids_N, unclipped; "fixed_advantage" (`_fixed_advantage_loss`): -a log p_S(y). A token weight
    (`settings.token_weight`) multiplies loss and gradient; the row-wise ones come as `weights_N`.

    Gradient: with x = student logits / tau and a = dL/dlogp over the support (the divergence's `dlogp` times the
    clip's weight), dL/dx = a - softmax(x) sum(a) through log_softmax (`bucket_gradient` through the buckets);
    sampled_token and fixed_advantage: dL/dx = -A (onehot(y) - softmax(x) over the support); dL/dlogits =
    dL/dx / tau. No autograd graph is kept, so a chunk costs a few (N, V) float32 buffers.

    Returns: loss_N (N,) float32, no reduction; stats (N,) without a graph: "divergence" (unclipped D_beta against
    the target; 0 for fixed_advantage), "clipped_frac", "top1_agree" (argmax of student == teacher's under the
    reference), "advantage" and "abs_advantage" (A of the sampled token; a for fixed_advantage; 0 without ids),
    with a contrast `ContrastSupport.stats`, with a token weight "token_weight"; the gradient (None unless
    need_grad).
    """
    if settings.loss_type == "fixed_advantage":
        return _fixed_advantage_loss(student_logits_NV, settings, target_ids_N, need_grad)
    with torch.no_grad():
        x_NV = _scaled(student_logits_NV, settings.temperature)
        xt_NV = _scaled(teacher_logits_NV, settings.temperature)
        top1_agree_N = (x_NV.argmax(-1) == xt_NV.argmax(-1)).float()
        loss_N, stats, grad_NV = _target_loss(x_NV, xt_NV, contrast, settings, target_ids_N, need_grad)
        stats["top1_agree"] = top1_agree_N
        advantage_N = stats["advantage"]
        if advantage_N is None:
            stats["advantage"] = advantage_N = torch.zeros_like(loss_N)
        stats["abs_advantage"] = advantage_N.abs()
        w_N = _token_weights(settings.token_weight, xt_NV, advantage_N, weights_N)
        if w_N is not None:
            loss_N = loss_N * w_N
            grad_NV = None if grad_NV is None else grad_NV.mul_(w_N[:, None])
            stats["token_weight"] = w_N
    return loss_N, stats, grad_NV


def _target_loss(x_NV, xt_NV, contrast: tuple | None, settings: LossSettings, ids_N, need_grad: bool):
    """The loss against a teacher's target, the one place that picks the target and the loss type: (loss_N, stats,
    dL/dlogits). The target lives only inside this call, so its (N, K) buffers are gone before the token weight."""
    if settings.contrast is None:
        target = _TeacherTarget.from_logits(x_NV, xt_NV, settings, ids_N)
    else:
        target = _ContrastTarget.from_logits(x_NV, xt_NV, contrast, settings, ids_N)
    loss_of_type = _divergence_loss if settings.loss_type == "jsd" else _sampled_token_loss
    loss_N, clipped_frac_N, grad_NV = loss_of_type(target, settings, need_grad)
    return target.weighted(loss_N), {**target.stats, "clipped_frac": clipped_frac_N}, grad_NV


# ------------------------------------------------------------------------------------------------------------
# The targets: the student and the target over the loss's support, and the chain rule from a gradient over that
# support to the logits. Both offer the same fields and methods to the loss types below.
# ------------------------------------------------------------------------------------------------------------
@dataclass
class _TeacherTarget:
    """OPSD's teacher p_T over the full vocabulary or the teacher's top-k (`idx_NK`; None: full): the student's and
    the teacher's log-probabilities there (logp_s_NK, logp_t_NK), D_beta's terms and the stats "divergence" and
    "advantage" (log p_T(y) - log p_S(y) of the sampled tokens; None without them)."""

    x_NV: torch.Tensor
    x_NK: torch.Tensor
    idx_NK: torch.Tensor | None
    logp_s_NK: torch.Tensor
    logp_t_NK: torch.Tensor
    terms_NK: torch.Tensor
    advantage_N: torch.Tensor | None
    ids_N: torch.Tensor | None
    temperature: float
    stats: dict

    @classmethod
    def from_logits(cls, x_NV, xt_NV, settings: LossSettings, ids_N) -> _TeacherTarget:
        x_NK, xt_NK, idx_NK = teacher_support(x_NV, xt_NV, settings.teacher_support_k)
        logp_s_NK = F.log_softmax(x_NK, -1)
        logp_t_NK = F.log_softmax(xt_NK, -1)
        advantage_N = None
        if ids_N is not None:
            advantage_N = log_prob_at(xt_NV, xt_NK, ids_N) - log_prob_at(x_NV, x_NK, ids_N)
        terms_NK = pointwise_jsd_terms(logp_s_NK, logp_t_NK, settings.beta)
        stats = {"divergence": terms_NK.sum(-1), "advantage": advantage_N}
        tau = settings.temperature
        return cls(x_NV, x_NK, idx_NK, logp_s_NK, logp_t_NK, terms_NK, advantage_N, ids_N, tau, stats)

    def log_p_sampled(self) -> torch.Tensor:
        """log p_S(y) over the support."""
        return log_prob_at(self.x_NV, self.x_NK, self.ids_N)

    def through_support(self, a_NK: torch.Tensor) -> torch.Tensor:
        """dL/dlogits from a = dL/dlog p_S over the support, through log_softmax; consumes logp_s_NK."""
        return _through_log_softmax(a_NK, self.logp_s_NK, self.idx_NK, self.x_NV.shape, self.temperature)

    def policy_gradient(self, advantage_N: torch.Tensor) -> torch.Tensor:
        """d(-A log p_S(y))/dlogits in closed form; consumes logp_s_NK."""
        shape = self.x_NV.shape
        return _policy_gradient(self.logp_s_NK, advantage_N, self.idx_NK, shape, self.ids_N, self.temperature)

    def weighted(self, loss_N: torch.Tensor) -> torch.Tensor:
        return loss_N


@dataclass
class _ContrastTarget:
    """RLCSD's q on the buckets (`opsd.method.contrast_target`): the student's and q's bucket log-probabilities
    (logp_s_NK, logp_t_NK, K = k + 1), D_beta's terms against q, the stats "divergence", the contrast's and
    "advantage" (log q(y) - log p_S(y) of the sampled tokens' buckets; None without them). Every token's loss and
    gradient is multiplied by the KL weight (`sup.weight_N`)."""

    sup: ContrastSupport
    terms_NK: torch.Tensor
    bucket_N1: torch.Tensor | None
    logp_y_N: torch.Tensor | None
    advantage_N: torch.Tensor | None
    temperature: float
    stats: dict

    @property
    def logp_s_NK(self) -> torch.Tensor:
        return self.sup.logp_s_NB

    @property
    def logp_t_NK(self) -> torch.Tensor:
        return self.sup.log_q_NB

    @classmethod
    def from_logits(cls, x_NV, xt_NV, contrast: tuple, settings: LossSettings, ids_N) -> _ContrastTarget:
        logits_JNV, valid_JN, eos_token_id = contrast
        c = settings.contrast
        xw_JNV = _scaled(logits_JNV, settings.temperature)
        sup = contrast_support(
            x_NV, xt_NV, xw_JNV, valid_JN, alpha=c.alpha, top_k=c.top_k, floor=c.floor, kl_tau=c.kl_tau
        )
        del xw_JNV
        terms_NB = pointwise_jsd_terms(sup.logp_s_NB, sup.log_q_NB, settings.beta)
        stats = {"divergence": terms_NB.sum(-1), **sup.stats(eos_token_id), "advantage": None}
        bucket_N1 = logp_y_N = None
        if ids_N is not None:
            bucket_N1 = bucket_index(sup.idx_NK, ids_N)[:, None]
            logp_y_N = sup.logp_s_NB.gather(-1, bucket_N1)[:, 0]
            stats["advantage"] = sup.log_q_NB.gather(-1, bucket_N1)[:, 0] - logp_y_N
        return cls(sup, terms_NB, bucket_N1, logp_y_N, stats["advantage"], settings.temperature, stats)

    def log_p_sampled(self) -> torch.Tensor:
        """log p_S of the sampled tokens' buckets."""
        return self.logp_y_N

    def through_support(self, a_NB: torch.Tensor) -> torch.Tensor:
        """dL/dlogits from a = dL/dlog p_S over the buckets, times the KL weight (`bucket_gradient`); consumes
        a_NB."""
        return self.sup.gradient(a_NB.mul_(self.sup.weight_N[:, None])).div_(self.temperature)

    def policy_gradient(self, advantage_N: torch.Tensor) -> torch.Tensor:
        """d(-A log p_S(y))/dlogits: a = -A at the sampled token's bucket, through the buckets."""
        a_NB = torch.zeros_like(self.sup.logp_s_NB).scatter_(-1, self.bucket_N1, -advantage_N[:, None])
        return self.through_support(a_NB)

    def weighted(self, loss_N: torch.Tensor) -> torch.Tensor:
        return loss_N * self.sup.weight_N


# ------------------------------------------------------------------------------------------------------------
# The loss types, each its value and its closed-form gradient: (loss_N, clipped_frac_N, dL/dlogits or None).
# ------------------------------------------------------------------------------------------------------------
def _divergence_loss(target: _TeacherTarget | _ContrastTarget, settings: LossSettings, need_grad: bool):
    """loss_type="jsd": the clipped sum_v term_v of D_beta (`clip_divergence`). Gradient: a = D_beta's `dlogp` times
    the clip's weight (d loss / d term_v), then through the target's support to the logits."""
    loss_N, clipped_frac_N, weight = clip_divergence(
        target.terms_NK, clip=settings.clip, clip_mode=settings.clip_mode
    )
    grad_NV = None
    if need_grad:
        a_NK = divergence(settings.beta).dlogp(target.logp_s_NK, target.logp_t_NK).mul_(weight)
        grad_NV = target.through_support(a_NK)
    return loss_N, clipped_frac_N, grad_NV


def _sampled_token_loss(target: _TeacherTarget | _ContrastTarget, settings: LossSettings, need_grad: bool):
    """loss_type="sampled_token": -sg(A) log p_S(y) with A = log p_target(y) - log p_S(y), unclipped. Gradient:
    -A (onehot(y) - p_S) over the support (the target's `policy_gradient`)."""
    advantage_N = target.advantage_N
    loss_N = -advantage_N * target.log_p_sampled()
    clipped_frac_N = torch.zeros_like(loss_N)
    grad_NV = target.policy_gradient(advantage_N) if need_grad else None
    return loss_N, clipped_frac_N, grad_NV


def _token_weights(mode: str, xt_NV, advantage_N, given_N):
    """The token weight (N,) of `mode` (`opsd.method.token_weights`), or None for none. The row-wise weights
    are computed by the caller, who knows the rows (`given_N`)."""
    if mode == "none":
        return None
    if mode in token_weights.ROW_WEIGHTS:
        if given_N is None:
            raise ValueError(f"token_weight={mode} weighs tokens by their place in their row: pass rows_N")
        return given_N
    if mode == "entropy_gate":
        return token_weights.entropy_gate(F.log_softmax(xt_NV, -1))
    return token_weights.positive_only(advantage_N)


def _fixed_advantage_loss(student_logits_NV, settings: LossSettings, target_ids_N, need_grad: bool):
    """loss_type="fixed_advantage": loss_N = -a log p_S(y) over the full vocabulary, no teacher. Gradient:
    -a (onehot(y) - p_S) (`_policy_gradient`)."""
    if target_ids_N is None:
        raise ValueError("loss_type='fixed_advantage' needs the sampled token ids")
    with torch.no_grad():
        x_NV = _scaled(student_logits_NV, settings.temperature)
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
        "advantage": advantage_N,
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
    def forward(ctx, student_hidden_NH, student_weight_VH, inputs, grad_enabled):
        # needs_input_grad ignores the caller's no_grad, so eval passes grad_enabled=False to skip grad work.
        need_h = grad_enabled and ctx.needs_input_grad[0]
        need_w = grad_enabled and ctx.needs_input_grad[1]
        w_s_VH = student_weight_VH.detach()
        keys = inputs.stat_keys()
        loss_sum = student_hidden_NH.new_zeros((), dtype=torch.float32)
        stat_sums_K = student_hidden_NH.new_zeros(len(keys), dtype=torch.float32)
        grad_h_NH = torch.zeros_like(student_hidden_NH) if need_h else None
        # float32 accumulator: summing many bf16 chunk products in bf16 would lose precision.
        grad_w_VH = torch.zeros_like(w_s_VH, dtype=torch.float32) if need_w else None

        for start in range(0, student_hidden_NH.shape[0], inputs.settings.chunk_size):
            end = start + inputs.settings.chunk_size
            h_s_CH = student_hidden_NH[start:end].detach()
            s_logits_CV = _chunk_logits(h_s_CH, w_s_VH, inputs.transform)
            loss_C, stats, g_CV = inputs.chunk(start, end, s_logits_CV, need_grad=need_h or need_w)
            if g_CV is not None and not inputs.transform.identity:
                g_CV = inputs.transform.backward_(g_CV, s_logits_CV)  # through the transform, to h @ W.T
            del s_logits_CV
            if g_CV is not None:
                # d(chunk loss)/d(logits) in closed form; the lm_head matmul is then differentiated by hand.
                if need_h:
                    grad_h_NH[start:end] = g_CV.to(w_s_VH.dtype) @ w_s_VH
                if need_w:
                    grad_w_VH.addmm_(g_CV.T, h_s_CH.float())
                del g_CV
            loss_sum += loss_C.sum().detach()
            stat_sums_K += torch.stack([stats[k].sum() for k in keys])

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
        return grad_h_NH, grad_w_VH, None, None


@dataclass
class _TeacherSide:
    """What every chunk of the loss reads besides the student: the teachers' hidden states and weight, the
    sampled tokens, the settings, the logit transform and the row-wise token weights."""

    settings: LossSettings
    transform: LogitTransform
    teacher_hidden_NH: torch.Tensor | None
    teacher_weight_VH: torch.Tensor | None
    target_ids_N: torch.Tensor | None
    contrast: ContrastHidden | None
    weights_N: torch.Tensor | None = None

    def stat_keys(self) -> tuple[str, ...]:
        """The settings' statistics, without the EOS diagnostics where no end-of-sequence token was given."""
        keys = self.settings.stat_keys()
        if self.contrast is None or self.contrast.eos_token_id is None:
            keys = tuple(k for k in keys if not k.startswith("eos_"))
        return keys

    def chunk(self, start: int, end: int, s_logits_CV: torch.Tensor, *, need_grad: bool):
        """The loss, stats and gradient of tokens [start, end): the teacher's logits (under the reference, and
        under each wrong hint for a contrast) exist for this chunk only, like the student's."""
        w_t_VH = None if self.teacher_weight_VH is None else self.teacher_weight_VH.detach()
        t_logits_CV = None
        if self.settings.needs_teacher:
            t_logits_CV = _chunk_logits(self.teacher_hidden_NH[start:end].detach(), w_t_VH, self.transform)
        contrast = None
        if self.contrast is not None:
            h_JCH = self.contrast.hidden_JNH[:, start:end].detach()
            logits_JCV = torch.stack([_chunk_logits(h_CH, w_t_VH, self.transform) for h_CH in h_JCH])
            contrast = (logits_JCV, self.contrast.valid_JN[:, start:end], self.contrast.eos_token_id)
        return token_divergence_with_grad(
            s_logits_CV,
            t_logits_CV,
            settings=self.settings,
            target_ids_N=None if self.target_ids_N is None else self.target_ids_N[start:end],
            need_grad=need_grad,
            contrast=contrast,
            weights_N=None if self.weights_N is None else self.weights_N[start:end],
        )


def chunked_opsd_loss(
    student_hidden_NH: torch.Tensor,
    teacher_hidden_NH: torch.Tensor | None,
    student_weight_VH: torch.Tensor,
    teacher_weight_VH: torch.Tensor | None,
    *,
    settings: LossSettings,
    target_ids_N: torch.Tensor | None,
    transform: LogitTransform = IDENTITY,
    contrast: ContrastHidden | None = None,
    rows_N: torch.Tensor | None = None,
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
    "sampled_token" and "fixed_advantage" need. contrast: the teacher's hidden states under the wrong hints,
    required when settings.contrast is set (scored with the teacher's weight); the teacher's hidden states and
    weight may be None for "fixed_advantage", which reads no teacher. rows_N (N,): each token's row (tokens in
    order, rows contiguous), which the row-wise token weights need (`position_early` runs a first pass without
    gradients for the advantages its weights accumulate).
    Returns (loss_sum, stats_sums): a float32 scalar; detached 0-dim float32 tensors, the sums over tokens of
    the per-token stats `settings.stat_keys()`, and "num_tokens". N = 0 gives a zero loss attached to the graph.
    """
    if settings.loss_type != "jsd" and target_ids_N is None:
        raise ValueError(f"loss_type={settings.loss_type!r} needs the sampled token ids")
    if (settings.contrast is None) != (contrast is None):
        raise ValueError("a contrastive target needs the wrong hints' hidden states, and only it")
    side = _TeacherSide(settings, transform, teacher_hidden_NH, teacher_weight_VH, target_ids_N, contrast)
    side.weights_N = _row_weights(side, student_hidden_NH, student_weight_VH, rows_N)
    loss_sum, stat_sums_K = _ChunkedOPSDLoss.apply(
        student_hidden_NH, student_weight_VH, side, torch.is_grad_enabled()
    )
    stats_sums = dict(zip(side.stat_keys(), stat_sums_K.unbind(), strict=True))
    stats_sums["num_tokens"] = torch.tensor(float(student_hidden_NH.shape[0]), device=loss_sum.device)
    return loss_sum, stats_sums


def _row_weights(side: _TeacherSide, student_hidden_NH, student_weight_VH, rows_N):
    """The row-wise token weights (N,) of `side.settings.token_weight`, or None."""
    mode = side.settings.token_weight
    if mode not in token_weights.ROW_WEIGHTS:
        return None
    if rows_N is None:
        raise ValueError(f"token_weight={mode} weighs tokens by their place in their row: pass rows_N")
    if mode == "position_late":
        return token_weights.position_late(rows_N)
    # position_early: the advantages first, without gradients and without the weight they make.
    plain = dataclasses.replace(side, settings=dataclasses.replace(side.settings, token_weight="none"))
    advantage_N = student_hidden_NH.new_zeros(student_hidden_NH.shape[0], dtype=torch.float32)
    w_s_VH = student_weight_VH.detach()
    for start in range(0, student_hidden_NH.shape[0], side.settings.chunk_size):
        end = start + side.settings.chunk_size
        s_logits_CV = _chunk_logits(student_hidden_NH[start:end].detach(), w_s_VH, side.transform)
        advantage_N[start:end] = plain.chunk(start, end, s_logits_CV, need_grad=False)[1]["advantage"]
    return token_weights.position_early(advantage_N, rows_N)


def token_log_probs(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, ids_N: torch.Tensor, *, transform: LogitTransform,
    temperature: float, chunk_size: int,
) -> torch.Tensor:  # fmt: skip
    """(N,) float32 log p(y) of the tokens `ids_N` over the full vocabulary at `temperature`, from final hidden
    states (N, H), `chunk_size` tokens' logits at a time; no gradient."""
    out_N = hidden_NH.new_empty(hidden_NH.shape[0], dtype=torch.float32)
    with torch.no_grad():
        for start in range(0, hidden_NH.shape[0], chunk_size):
            end = start + chunk_size
            x_CV = _scaled(
                _chunk_logits(hidden_NH[start:end].detach(), weight_VH.detach(), transform), temperature
            )
            out_N[start:end] = F.log_softmax(x_CV, -1).gather(-1, ids_N[start:end, None])[:, 0]
    return out_N
