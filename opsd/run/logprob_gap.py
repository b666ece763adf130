"""`rollout/logprob_gap`: how far the rollout engine's distribution is from the one the loss scores.

The engine samples from its own copy of the student, pushed into it before each generation. Every sampled token
y_t comes with the engine's log-prob of it, and the trainer computes its own from the student's final hidden
states, both as the sampler saw them: log_softmax(z / T) over the tokens top-k and top-p keep (vLLM's
`processed_logprobs`, which TRL's engine returns; `sampling_logprobs` is the same processing of the trainer's
logits z). Over a step's sampled tokens (the engine's log-prob present),

    gap_t = |log p_engine(y_t) - log p_trainer(y_t)|,

logged as `rollout/logprob_gap/mean`, `/p99` and `/max` (`logprob_gap_stats`). The same check every large RL
framework logs: the trainer learns from samples it assumes are its own. In float32 on the CPU the two agree to
~1e-6; in bfloat16 the two kernels' rounding gives a mean of 0.02-0.04 (docs/families.md, the H200 table).

A sampled token outside the trainer's top-k or top-p set has an infinite gap: the share of those is logged as
`rollout/logprob_gap/outside`, and the other three are over the rest. A mean, or a share outside, above
`GAP_WARNING` (1e-3 for float32 weights, 0.05 for 16-bit ones) warns once per run: the engine samples from another
model than the trainer's. The likely causes: another dtype in the engine than in the trainer, a layer the engine
computes otherwise (Cohere2's sliding window is one key wider in vLLM 0.32 than in transformers: docs/families.md),
or stale weights (a push that did not reach the engine, or steps taken since the rollout: `steps_per_rollout` > 1).
"""

from __future__ import annotations

import logging
import math

import torch

from opsd.method.hidden import head_logits
from opsd.method.sampler import sampler_support

logger = logging.getLogger(__name__)

METRIC = "rollout/logprob_gap"
# The mean gap (nats) above which the warning fires, by the dtype of the trainer's weights.
GAP_WARNING = {torch.float32: 1e-3, torch.float64: 1e-3, torch.bfloat16: 0.05, torch.float16: 0.05}


def engine_logprobs(logprobs: list[list[list[float | None]]], device=None) -> torch.Tensor:
    """The engine's log-prob of each sampled token as a right-padded (B, C) float32 tensor, NaN where there is
    none (padding, a NaN the engine reported as None), from TRL's generate output: per row, per token, the list
    whose first entry is the sampled token's log-prob."""
    width = max((len(row) for row in logprobs), default=0)
    out_BC = torch.full((len(logprobs), width), math.nan, dtype=torch.float32)
    for b, row in enumerate(logprobs):
        values = [math.nan if lp is None or lp[0] is None else lp[0] for lp in row]
        out_BC[b, : len(values)] = torch.tensor(values, dtype=torch.float32)
    return out_BC.to(device) if device is not None else out_BC


def sampling_logprobs(
    logits_NV: torch.Tensor, token_ids_N: torch.Tensor, *, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """log p(token) (N,) under the distribution vLLM's sampler draws from, from raw logits (N, V): the logits
    divided by `temperature`, then top-k (`top_k` > 0: the tokens at least as likely as the k-th, ties kept),
    then top-p (`top_p` < 1: from the least likely up, the tokens whose cumulative probability is at most
    1 - top_p are dropped, the most likely always kept), renormalised. A token outside the kept set gets -inf."""
    x_NV = logits_NV.float() / temperature
    keep_NV = sampler_support(x_NV, top_k=top_k, top_p=top_p)
    if keep_NV is not None:
        x_NV = x_NV.masked_fill(~keep_NV, -math.inf)
    return x_NV.log_softmax(dim=-1).gather(-1, token_ids_N[:, None]).squeeze(-1)


@torch.no_grad()
def trainer_logprobs(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    transform,
    token_ids_N: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """The trainer's `sampling_logprobs` (N,) of the sampled tokens from the student's final hidden states (N, H)
    at their positions, its lm_head weight (V, H) and logit transform (`opsd.method.hidden.LogitTransform`), in
    chunks of `chunk_size` tokens (memory-flat in V); no gradient."""
    out = []
    for start in range(0, hidden_NH.size(0), chunk_size):
        h_CH = hidden_NH[start : start + chunk_size]
        logits_CV = head_logits(h_CH, weight_VH, transform)
        out.append(
            sampling_logprobs(
                logits_CV,
                token_ids_N[start : start + chunk_size],
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
            )
        )
    return torch.cat(out) if out else hidden_NH.new_zeros(0, dtype=torch.float32)


def logprob_gap_stats(
    engine_logps: torch.Tensor, trainer_logps: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """{"mean", "p99", "max"} of |engine_logps - trainer_logps| over the sampled tokens (`mask` true, the
    engine's log-prob finite; any equal shapes, e.g. (B, C) or (N,)) that the trainer's sampler could draw too, and
    "outside": the share of the sampled tokens it could not (its log-prob -inf: outside its top-k or top-p set, so
    the gap is infinite). p99 interpolates linearly between ranks (numpy's default). {} when no token counts (an
    empty mask, or no log-prob from the engine); no mean, p99 and max when none is inside."""
    sampled = mask.bool() & torch.isfinite(engine_logps)
    if not bool(sampled.any()):
        return {}
    inside = sampled & torch.isfinite(trainer_logps)
    stats = {"outside": 1.0 - inside.sum().item() / sampled.sum().item()}
    gap = (engine_logps[inside].double() - trainer_logps[inside].double()).abs()
    if gap.numel():
        stats.update(mean=gap.mean().item(), p99=torch.quantile(gap, 0.99).item(), max=gap.max().item())
    return stats


class LogprobGap:
    """The run's `rollout/logprob_gap/*` metrics, with the warning (module docstring) the first time a step's mean
    passes the threshold for the trainer's weights' `dtype`."""

    def __init__(self, dtype: torch.dtype):
        self.threshold = GAP_WARNING.get(dtype, GAP_WARNING[torch.bfloat16])
        self.warned = False

    def from_hidden(
        self,
        engine_logps_BC: torch.Tensor,
        completion_ids_BC: torch.Tensor,
        completion_mask_BC: torch.Tensor,
        hidden,
        *,
        temperature: float,
        top_k: int,
        top_p: float,
    ) -> dict[str, float]:
        """`metrics` of a batch's sampled tokens: the engine's log-probs (B, C) against the trainer's from the
        student's final hidden states of the completion tokens (`hidden`, an `opsd.method.hidden`
        `CompletionHiddenStates`, flattened over `completion_mask_BC`), at the rollout's sampling settings."""
        valid_BC = completion_mask_BC.bool()
        trainer_N = trainer_logprobs(
            hidden.student_hidden_NH.detach(),
            hidden.student_weight_VH.detach(),
            hidden.logit_transform,
            completion_ids_BC[valid_BC],
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        )
        engine_N = engine_logps_BC[:, : valid_BC.size(1)].to(trainer_N.device)[valid_BC]
        return self.metrics(engine_N, trainer_N, torch.ones_like(valid_BC)[valid_BC])

    def metrics(self, engine_logps, trainer_logps, mask) -> dict[str, float]:
        """`logprob_gap_stats` as `rollout/logprob_gap/{mean,p99,max}`, warning the first time the mean passes
        the threshold."""
        stats = logprob_gap_stats(engine_logps, trainer_logps, mask)
        off = stats and max(stats.get("mean", math.inf), stats["outside"]) > self.threshold
        if off and not self.warned:
            self.warned = True
            logger.warning(
                "rollout/logprob_gap: the rollout engine's log-probs of its sampled tokens differ from the "
                "trainer's by %.3g on average (max %.3g; above %g), and %.1f%% of them the trainer would never "
                "sample: the rollouts come from another model than the one the loss scores. Likely causes: "
                "another dtype in the engine than in the trainer, a layer the engine computes otherwise (a "
                "sliding window one key wider: Cohere2 in vLLM 0.32, docs/families.md), or stale weights in the "
                "engine (a push that did not arrive, or steps_per_rollout > 1)",
                stats.get("mean", math.inf),
                stats.get("max", math.inf),
                self.threshold,
                100 * stats["outside"],
            )
        return {f"{METRIC}/{key}": value for key, value in stats.items()}
