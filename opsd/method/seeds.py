"""Per-row rollout seeds: the same rollouts for any number of processes, and on resume.

TRL passes one `SamplingParams` for a whole generate call; with one seed in it every request would draw the same
random numbers (identical samples for a repeated prompt), and without one the rollouts would depend on how
the batch is split. So every row of an optimizer step's global batch gets its own seed, a function of the
run's seed, the step and the row's position in that batch. The probe's frozen rollouts are seeded as if from
a step no training step uses (`PROBE_STEP`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

PROBE_STEP = -1


def row_seed(seed: int, step: int, position: int) -> int:
    """Seed of the rollout at `position` of step `step`'s global batch (< 2**20 rows per step)."""
    return ((seed * 1_000_003 + step) * (1 << 20) + position) % (1 << 62)


def first_rollout_row(process_index: int, tensor_parallel_size: int, num_rows: int) -> int:
    """Global position in a generation's batch of the first of this process's `num_rows` colocated prompts.

    Each process generates its contiguous share of the global generation batch (TRL's sampler), and a
    tensor-parallel group generates the shares of its ranks in rank order, so the position is the group's first
    rank x rows per rank. Hence every row has its own seed (repeated prompts get different samples), a resumed
    run draws the same rollouts, and the rollouts do not depend on how many processes share the batch.
    """
    first = process_index // tensor_parallel_size * tensor_parallel_size
    return first * (num_rows // tensor_parallel_size)


class RolloutSeeds:
    """The seeds of a run's rollouts: `for_rows(first, n)` for n rows starting at global position `first` of
    the current step (`step_of()`, e.g. the trainer's global step), or of the probe inside `probe()`."""

    def __init__(self, seed: int, step_of: Callable[[], int]):
        self.seed = seed
        self._step_of = step_of
        self._override: int | None = None

    @property
    def step(self) -> int:
        return self._step_of() if self._override is None else self._override

    def for_rows(self, first: int, n: int) -> list[int]:
        return [row_seed(self.seed, self.step, first + j) for j in range(n)]

    @contextmanager
    def probe(self):
        """Inside the block, seeds are those of the probe's rollouts."""
        self._override = PROBE_STEP
        try:
            yield
        finally:
            self._override = None

    def seeded(self, llm, first_row: Callable[[int], int]) -> SeededLLM:
        """`llm` (a `vllm.LLM`) whose `generate` seeds each prompt of a call with its own seed; `first_row(n)`
        is the global position of a call's first prompt when the call has n prompts."""
        return SeededLLM(llm, lambda n: self.for_rows(first_row(n), n))


class SeededLLM:
    """A `vllm.LLM` whose `generate` gives every prompt its own seed; everything else is the wrapped engine's."""

    def __init__(self, llm, seeds_for: Callable[[int], list[int]]):
        self.llm = llm
        self.seeds_for = seeds_for  # number of prompts -> one seed per prompt

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def generate(self, prompts, sampling_params=None, **kwargs):
        if sampling_params is not None and not isinstance(sampling_params, list | tuple):
            per_row = []
            for seed in self.seeds_for(len(prompts)):
                sp = sampling_params.clone()
                sp.seed = seed
                per_row.append(sp)
            sampling_params = per_row
        return self.llm.generate(prompts, sampling_params=sampling_params, **kwargs)
