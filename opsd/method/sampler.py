"""Log-probabilities of sampled tokens under the distribution the rollout engine draws them from.

vLLM's sampler divides the logits by the temperature, keeps the top-k tokens (every token at least as likely as
the k-th: ties kept), then the top-p nucleus of those (from the least likely up, a token is dropped while the
cumulative probability up to and including it is <= 1 - p; the most likely is always kept), and samples from the
renormalised rest. The log-probs it returns (`logprobs_mode="processed_logprobs"`, what TRL asks for) are of that
distribution. A trainer that scores the same token with the temperature only puts it under a wider distribution, so
its log-prob is lower at every token and a ratio of the two is <= 1 everywhere (docs/method.md §6, docs/decisions.md).

`sampler_support` is the kept set (computed without gradient: which tokens are kept is a selection, not a function
to differentiate); `sampled_token_logps` is log p(y) under the kept, renormalised distribution, and its entropy,
chunked over the tokens with a gradient through the kept logits, so that the policy gradient is that of the policy
the rollouts really come from. The sampled token is always counted in the kept set: where the trainer's logits
put it just outside (a tie or a rounding at the top-k or top-p boundary), its log-prob stays finite and close to the
engine's instead of -inf.
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint

from opsd.method.hidden import LogitTransform, head_logits


def sampler_support(x_NV: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor | None:
    """(N, V) bool: the tokens vLLM's sampler keeps, from temperature-scaled logits `x_NV`; None when it keeps the
    whole vocabulary (top-k off or >= V, top-p 1). With top-k on, the nucleus is computed over the k (plus tied)
    largest logits only, which is what it is over the whole sorted vocabulary once top-k has masked the rest."""
    V = x_NV.size(-1)
    use_k, use_p = 0 < top_k < V, top_p < 1.0
    if not (use_k or use_p):
        return None
    with torch.no_grad():
        x_NV = x_NV.detach().float()
        if use_k:
            kth_N1 = x_NV.topk(top_k, dim=-1).values[:, -1:]
            keep_NV = x_NV >= kth_N1
            if not use_p:
                return keep_NV
            width = int(keep_NV.sum(-1).max())  # k, or more where tokens tie with the k-th
            values_NW, index_NW = x_NV.topk(width, dim=-1)  # descending
            values_NW = values_NW.masked_fill(values_NW < kth_N1, -math.inf)
        else:
            keep_NV = torch.ones_like(x_NV, dtype=torch.bool)
            values_NW, index_NW = x_NV.sort(dim=-1, descending=True)
        # From the least likely up: the cumulative probability of the kept, renormalised tokens.
        ascending_NW = values_NW.flip(-1)
        cumulative_NW = ascending_NW.softmax(-1).cumsum(-1)
        dropped_NW = cumulative_NW <= 1 - top_p
        dropped_NW[:, -1] = False
        return keep_NV.scatter(-1, index_NW.flip(-1), keep_NV.gather(-1, index_NW.flip(-1)) & ~dropped_NW)


def _chunk_logps(h_CH, w_VH, ids_C, transform: LogitTransform, temperature: float, top_k: int, top_p: float):
    """(log p(y) (C,), entropy (C,)) of one chunk under the sampler's distribution, float32, with gradient."""
    x_CV = head_logits(h_CH, w_VH, transform) / temperature
    keep_CV = sampler_support(x_CV, top_k=top_k, top_p=top_p)
    if keep_CV is not None:
        keep_CV = keep_CV.scatter(-1, ids_C[:, None], True)
        x_CV = x_CV.masked_fill(~keep_CV, -math.inf)
    logp_CV = x_CV.log_softmax(-1)
    logp_C = logp_CV.gather(-1, ids_C[:, None]).squeeze(-1)
    finite_CV = logp_CV if keep_CV is None else logp_CV.masked_fill(~keep_CV, 0.0)
    entropy_C = -(logp_CV.exp() * finite_CV).sum(-1)
    return logp_C, entropy_C


def sampled_token_logps(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    ids_N: torch.Tensor,
    *,
    transform: LogitTransform,
    temperature: float,
    top_k: int,
    top_p: float,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(y) (N,), entropy (N,)) in float32 of the tokens `ids_N` under the sampler's distribution (module
    docstring), from final hidden states (N, H) and the lm_head weight (V, H) with the model's logit `transform`.

    `chunk_size` tokens' logits at a time. With gradient enabled, each chunk is recomputed in the backward pass
    (activation checkpointing), so memory stays at one chunk's (chunk, V) logits whatever N is."""
    logps, entropies = [], []
    grad = torch.is_grad_enabled() and (hidden_NH.requires_grad or weight_VH.requires_grad)
    for start in range(0, hidden_NH.size(0), chunk_size):
        args = (hidden_NH[start : start + chunk_size], weight_VH, ids_N[start : start + chunk_size])
        settings = (transform, temperature, top_k, top_p)
        if grad:
            logp_C, entropy_C = checkpoint(_chunk_logps, *args, *settings, use_reentrant=False)
        else:
            logp_C, entropy_C = _chunk_logps(*args, *settings)
        logps.append(logp_C)
        entropies.append(entropy_C)
    if not logps:
        empty = hidden_NH.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)
