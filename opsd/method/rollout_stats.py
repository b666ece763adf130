"""The `completions/*` metrics of a generation (TRL's names and values: mean, min and max length over all
processes, the share of rollouts cut at the length limit, and the lengths of those that ended)."""

from __future__ import annotations

import torch


def completion_metrics(rollouts: list[list[int]], *, stop_ids: list[int], gather, device) -> dict[str, float]:
    """`rollouts` (this process's completion ids) summarised over all processes (`gather`: the accelerator's).

    A rollout is cut (`clipped_ratio`) when its last token is none of `stop_ids` (end-of-sequence ids and the pad
    id); an empty one is not cut. Terminated lengths are 0 when every rollout was cut."""
    lengths = gather(torch.tensor([len(r) for r in rollouts], device=device))
    if lengths.numel() == 0:
        raise RuntimeError("the rollout engine returned no completions: see its log above")
    cut = gather(torch.tensor([bool(r) and r[-1] not in stop_ids for r in rollouts], device=device))
    ended = lengths[~cut]
    if len(ended) == 0:
        ended = torch.zeros(1, device=device)
    return {
        "completions/mean_length": lengths.float().mean().item(),
        "completions/min_length": lengths.float().min().item(),
        "completions/max_length": lengths.float().max().item(),
        "completions/clipped_ratio": cut.float().mean().item(),
        "completions/mean_terminated_length": ended.float().mean().item(),
        "completions/min_terminated_length": ended.float().min().item(),
        "completions/max_terminated_length": ended.float().max().item(),
    }
