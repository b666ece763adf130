"""The OPSD loss the reference code's way: full (B, T, V) logits, differentiated by autograd.

Not the training path (that is `opsd.method.loss.chunked_opsd_loss`, which never holds all the logits and
writes its gradient out in closed form): the baseline of the benchmarks (bench/reference_step.py,
bench/loss_path.py, bench/first_token.py) and, in the tests, the materialised path the chunked loss must
equal. It shares the divergence terms and the clip (`clip_divergence`) with the training path; the tests'
float64 oracle (tests/unit/test_loss.py) shares nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from opsd.method.loss import (
    STAT_KEYS,
    LossSettings,
    clip_divergence,
    log_prob_at,
    pointwise_jsd_terms,
    teacher_support,
)


def token_divergence(
    student_logits_NV: torch.Tensor,
    teacher_logits_NV: torch.Tensor,
    *,
    settings: LossSettings,
    target_ids_N: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token OPSD loss on flat tokens through autograd; math in float32 whatever the input dtype.

    Same loss_N and stats as `opsd.method.loss.token_divergence_with_grad` (see there), with the gradient
    left to autograd. Args: student_logits_NV (N, V) with grad; teacher_logits_NV (N, V), detached here;
    target_ids_N (N,) long, for loss_type="sampled_token". Returns loss_N (N,) and detached (N,) stats.
    """
    if settings.loss_type == "fixed_advantage" or settings.contrast is not None:
        raise ValueError("the reference code's loss has one teacher: no contrast, no fixed advantage")
    s_NV = student_logits_NV.float() / settings.temperature
    t_NV = teacher_logits_NV.detach().float() / settings.temperature
    top1_agree_N = (s_NV.argmax(-1) == t_NV.argmax(-1)).float()
    s_NK, t_NK, _ = teacher_support(s_NV, t_NV, settings.teacher_support_k)

    if settings.loss_type == "jsd":
        terms_NK = pointwise_jsd_terms(F.log_softmax(s_NK, -1), F.log_softmax(t_NK, -1), settings.beta)
        divergence_N = terms_NK.sum(-1).detach()
        loss_N, clipped_frac_N, _ = clip_divergence(
            terms_NK, clip=settings.clip, clip_mode=settings.clip_mode
        )
    else:
        with torch.no_grad():  # divergence is only a statistic here; keep it off the graph
            divergence_N = pointwise_jsd_terms(
                F.log_softmax(s_NK, -1), F.log_softmax(t_NK, -1), settings.beta
            ).sum(-1)
        logp_s_N = log_prob_at(s_NV, s_NK, target_ids_N)
        advantage_N = (log_prob_at(t_NV, t_NK, target_ids_N) - logp_s_N).detach()
        loss_N = -advantage_N * logp_s_N
        clipped_frac_N = torch.zeros_like(divergence_N)
    abs_advantage_N = torch.zeros_like(divergence_N)
    if target_ids_N is not None:
        with torch.no_grad():
            abs_advantage_N = (
                log_prob_at(t_NV, t_NK, target_ids_N) - log_prob_at(s_NV, s_NK, target_ids_N)
            ).abs()
    stats = {
        "divergence": divergence_N,
        "clipped_frac": clipped_frac_N.detach(),
        "top1_agree": top1_agree_N,
        "abs_advantage": abs_advantage_N,
    }
    return loss_N, stats


def opsd_loss_from_logits(
    student_logits_BTV: torch.Tensor,
    teacher_logits_BTV: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    settings: LossSettings,
    target_ids_BT: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Summed OPSD loss over a padded batch from full logits (holds (B, T, V) logits).

    loss_sum = sum over positions with mask_BT == 1 of `token_divergence`'s loss_N (float32 scalar; divide by
    the global valid-token count outside); target_ids_BT (B, T) is needed for loss_type="sampled_token". An
    all-masked batch gives a zero loss that is still attached to the graph.
    Returns (loss_sum, stats_sums) as `opsd.method.loss.chunked_opsd_loss` does.
    """
    valid_BT = mask_BT.bool()
    target_ids_N = None if target_ids_BT is None else target_ids_BT[valid_BT]
    loss_N, stats = token_divergence(
        student_logits_BTV[valid_BT],
        teacher_logits_BTV[valid_BT],
        settings=settings,
        target_ids_N=target_ids_N,
    )
    sums = {k: stats[k].sum().detach() for k in STAT_KEYS}
    sums["num_tokens"] = torch.tensor(float(loss_N.shape[0]), device=loss_N.device)
    return loss_N.sum(), sums
