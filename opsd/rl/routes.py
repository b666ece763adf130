"""Which rollouts of a GRPO batch the hybrid's self-distillation term trains on (`hybrid_route`, docs/method.md §6).

Rollouts come in groups of G consecutive rows (one problem's G samples). GRPO's advantage is a rollout's reward
against its group's, so a group whose rewards are all equal (all right or all wrong) carries no GRPO signal: its
advantages are 0. The routes:

* `mix`: every rollout gets both terms, GRPO's and sd_weight x OPSD's (SDPG-style; the fixed mix);
* `group`: the OPSD term only on the rollouts of groups with no GRPO signal, GRPO's on the rest (SKALD, I-SDPO);
* `sample`: a rollout graded correct gets the GRPO term, any other (wrong, or without a grade) the OPSD term and no
  GRPO term: its advantage is set to 0 (SRPO).

A rollout without a grade (a problem without an answer: reward None) is left out of its group's signal, as TRL
leaves it out of its group's baseline. Pure functions of the rewards, so the float64 oracles test them directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from opsd.configuration.switches import CHOICES

ROUTES = CHOICES["hybrid_route"]


def groups_without_signal(rewards: Sequence[float | None], G: int) -> list[bool]:
    """Per group of G consecutive rewards: whether its graded rewards are all equal (no GRPO signal); a group
    with fewer than two graded rollouts has none either."""
    if G < 1 or len(rewards) % G:
        raise ValueError(
            f"{len(rewards)} rollouts do not split into groups of {G}: each problem's rollouts must sit side by "
            "side in a process's batch; report this with the run's configuration"
        )
    out = []
    for start in range(0, len(rewards), G):
        graded = {r for r in rewards[start : start + G] if r is not None}
        out.append(len(graded) <= 1)
    return out


def sd_rows(rewards: Sequence[float | None], G: int, route: str) -> list[bool]:
    """Per rollout: whether the self-distillation term trains on it under `route` (module docstring). Under
    `group` and `sample` these rollouts get no GRPO term; under `mix` every rollout gets both."""
    if route == "mix":
        return [True] * len(rewards)
    if route == "group":
        return [empty for empty in groups_without_signal(rewards, G) for _ in range(G)]
    if route == "sample":
        return [r is None or r <= 0 for r in rewards]
    raise ValueError(f"hybrid_route={route!r} is not one of {', '.join(ROUTES)}")


def route_metrics(
    rewards: Sequence[float | None], G: int, sd_rows_B: Sequence[bool], tokens_B: Sequence[float]
) -> list[float]:
    """Sums for the `rl/*` metrics of one process's batch, to be added over processes: [groups with no signal,
    groups, rollouts graded correct, rollouts, loss tokens under the OPSD term, loss tokens]."""
    empty = groups_without_signal(rewards, G)
    positive = sum(1 for r in rewards if r is not None and r > 0)
    sd_tokens = sum(t for t, sd in zip(tokens_B, sd_rows_B, strict=True) if sd)
    return [
        float(sum(empty)),
        float(len(empty)),
        float(positive),
        float(len(rewards)),
        float(sd_tokens),
        float(sum(tokens_B)),
    ]
