"""Take-off: whether a seed's training rollouts reached `TAKE_OFF_CORRECT` correct, and at which step.

RL on a model that rarely solves its problems is often bimodal: a seed either "takes off" (its training rollouts
go from ~0% to ~100% correct within a few dozen steps) or stays at its base rate for the whole budget. The
seed-paired interval of an arm with both kinds of seed averages two different outcomes (a real run: GRPO took off
in 2 of 3 seeds, and grpo − opsd was +60.1 [−74.2, +194.4]), so the report gives each arm's take-off rate, shows
the seeds first where an arm is bimodal, and says so beside every interval that spans both modes.

Read from the training curves the report draws (`verdict._curves`: each run's metrics.jsonl, the last record of a
step winning, points that are not finite numbers at whole-number steps left out), so a NaN or a missing step is
never a take-off. Pure functions of that data.
"""

from __future__ import annotations

from typing import Any

# The metric read: the share of a step's training rollouts graded correct (opsd.run.step_watch).
TAKE_OFF_KEY = "rollout/correct"
# Half the step's rollouts correct. A run that has not learned the task stays near its base rate (0% in the
# bimodal GRPO run) and one that has climbs to near 100%; the midpoint separates the two modes whatever the
# step of the jump, and at a low base rate a step of 32 rollouts reaches it by luck with negligible probability.
TAKE_OFF_CORRECT = 0.5


def first_take_off(points: list[list]) -> int | None:
    """The first step of `points` ([[step, value], ...], steps ascending) whose value is at least
    `TAKE_OFF_CORRECT`; None if none is."""
    return next((step for step, value in points if value >= TAKE_OFF_CORRECT), None)


def arm_take_off(by_seed: dict[str, dict[str, list]], seeds: list[int], trained: list[int]) -> dict[str, Any]:
    """An arm's take-off, from its curves ({seed: {metric: points}}, seeds as strings) for the seeds planned.

    `first_step`: {seed: the first step reaching the threshold, or None for a finished run (in `trained`) that
    never did}: the seeds whose outcome is known. `pending`: {seed: last step logged} of runs still training
    that have not reached it yet. `unlogged`: seeds without a `TAKE_OFF_KEY` point (not started, or no log).
    `took_off` of `of` known seeds; `bimodal`: some known seeds took off and some never did."""
    first: dict[str, int | None] = {}
    pending: dict[str, int] = {}
    unlogged: list[int] = []
    for seed in seeds:
        points = by_seed.get(str(seed), {}).get(TAKE_OFF_KEY) or []
        step = first_take_off(points)
        if step is not None or (points and seed in trained):
            first[str(seed)] = step
        elif points:
            pending[str(seed)] = points[-1][0]
        else:
            unlogged.append(seed)
    took_off = sum(step is not None for step in first.values())
    return {"first_step": first, "pending": pending, "unlogged": unlogged, "took_off": took_off,
            "of": len(first), "bimodal": 0 < took_off < len(first)}  # fmt: skip


def modes(take_off: dict[str, Any], seeds: list[int]) -> dict[str, list[int]] | None:
    """{"took_off": seeds, "never": seeds} of `seeds` where both are non-empty (the arm is bimodal over these
    seeds), else None."""
    first = take_off["first_step"]
    up = [s for s in seeds if first.get(str(s)) is not None]
    down = [s for s in seeds if str(s) in first and first[str(s)] is None]
    return {"took_off": up, "never": down} if up and down else None


def spans_modes(take_offs: dict[str, dict], arms: list[str], seeds: list[int]) -> dict[str, dict]:
    """{arm: its `modes`} of each of `arms` bimodal over `seeds` (a comparison's seeds)."""
    found = {arm: modes(take_offs[arm], seeds) for arm in arms if arm in take_offs}
    return {arm: m for arm, m in found.items() if m}


def _seeds(seeds: list[int]) -> str:
    return ", ".join(map(str, seeds))


def bimodal_note(split: dict[str, dict]) -> str | None:
    """The one sentence beside an interval that spans both modes of an arm (`spans_modes`); None if none."""
    if not split:
        return None
    parts = "; ".join(f"{arm} took off in seed(s) {_seeds(m['took_off'])} and never in {_seeds(m['never'])}"
                      for arm, m in split.items())  # fmt: skip
    return f"This interval spans both outcomes ({parts}): it averages two different outcomes; read the seeds."


def describe_take_off(arm: str, take_off: dict[str, Any]) -> str:
    """One line, e.g. `grpo: took off in 2 of 3 seeds (42 at step 27, 43 at step 35; 44 never)`."""
    return f"{arm}: {take_off_text(take_off)}"


def take_off_text(take_off: dict[str, Any]) -> str:
    """`describe_take_off`'s line without the arm's name."""
    first = take_off["first_step"]
    up = [f"{s} at step {step}" for s, step in first.items() if step is not None]
    down = [s for s, step in first.items() if step is None]
    if first:
        inner = "; ".join(filter(None, [", ".join(up), f"{', '.join(down)} never" if down else ""]))
        text = f"took off in {take_off['took_off']} of {take_off['of']} seeds ({inner})"
    else:
        text = "no finished run, and none has taken off yet"
    if take_off["pending"]:
        text += "; still training, not yet: " + ", ".join(
            f"{s} (step {step})" for s, step in take_off["pending"].items()
        )
    if take_off["unlogged"]:
        text += f"; no {TAKE_OFF_KEY} logged: {_seeds(take_off['unlogged'])}"
    return text


def outcome(arm_modes: dict[str, dict], take_offs: dict[str, dict], seed: str) -> str:
    """What each bimodal arm of a comparison did in `seed`: `grpo took off at step 27` / `grpo never took off`."""
    said = []
    for arm in arm_modes:
        step = take_offs[arm]["first_step"].get(seed)
        said.append(f"{arm} took off at step {step}" if step is not None else f"{arm} never took off")
    return ", ".join(said)


def mark_point(points: list[list], step: int) -> tuple[int, float] | None:
    """Where a seed's take-off at `step` is marked on one of its curves: the curve's first point at or after
    `step` (the rollout curve has a point at `step` itself); None if the curve ends before it."""
    return next(((s, v) for s, v in points if s >= step), None)
