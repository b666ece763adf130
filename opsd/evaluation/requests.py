"""An evaluation's requests, built whole before any engine starts: the problem, its first sample and count, the
seed (`sample_seed(seed, problem, index)`), the rendered prompt and the token cap (`make_request`, `Prompts`);
the requests for the samples still missing (`plan_requests`); and where an engine loop takes them from
(`Source`: a list, `ListSource`, or the workers' claim queue, `opsd.evaluation.workers`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from opsd.errors import UserError
from opsd.evaluation.job import EvalJob
from opsd.evaluation.samples import sample_seed


@dataclass(frozen=True)
class Request:
    """`count` consecutive samples of a problem from index `start`, as the engine takes them: the rendered
    prompt and the new-token cap; vLLM's j-th sample gets `seed + j`."""

    problem: dict[str, Any]
    start: int  # first sample index
    count: int
    seed: int
    prompt_ids: list[int]
    max_tokens: int


# The prompt ids and token cap of the request for `problem` from sample `start` (a job's: `Prompts`).
PromptOf = Callable[[dict[str, Any], int], tuple[list[int], int]]


def make_request(problem: dict[str, Any], start: int, count: int, seed: int, prompt: PromptOf) -> Request:
    """The request for `count` samples of `problem` from `start`, seeded with `sample_seed(seed, problem's
    dataset index, start)`, its prompt and cap from `prompt`."""
    ids, cap = prompt(problem, start)
    return Request(problem, start, count, sample_seed(seed, problem["index"], start), ids, cap)


class Prompts:
    """A job's prompt of each problem, rendered once, and its token cap: --max-tokens, cut to fit under
    max_model_len with the prompt (a `UserError` where the prompt leaves no room). A `PromptOf`."""

    def __init__(self, job: EvalJob):
        self.builder = job.builder
        self.max_tokens, self.max_len = job.settings.max_tokens, job.settings.max_model_len_used
        self._rendered: dict[str, tuple[list[int], int]] = {}

    def __call__(self, problem: dict[str, Any], start: int = 0) -> tuple[list[int], int]:
        pid = problem["id"]
        if pid not in self._rendered:
            ids = self.builder.student_ids(problem["problem"])
            cap = min(self.max_tokens, self.max_len - len(ids))
            if cap < 1:
                raise UserError(
                    f"problem {pid!r}: its prompt has {len(ids)} tokens, no room left under "
                    f"max_model_len {self.max_len}; raise --max-model-len"
                )
            self._rendered[pid] = ids, cap
        return self._rendered[pid]


class Source(Protocol):
    """Where requests come from: `take(k)` hands out at most k, `finished(count)` is told how many of
    them finished."""

    def take(self, k: int) -> list[Request]: ...

    def finished(self, count: int) -> None: ...


class ListSource:
    """A fixed list of requests, handed out in order."""

    def __init__(self, requests: Iterable[Request]):
        self._todo = deque(requests)

    def take(self, k: int) -> list[Request]:
        return [self._todo.popleft() for _ in range(min(k, len(self._todo)))]

    def finished(self, count: int) -> None:
        pass


def plan_requests(
    problems: Sequence[dict[str, Any]],
    have: set[tuple[str, int]],
    n: int,
    seed: int,
    prompt: PromptOf,
    *,
    per_sample: bool = False,
    sample_major: bool = False,
) -> list[Request]:
    """The requests for the samples missing from `have`, each built whole (`make_request`).

    `per_sample`: one request per sample (vLLM streaming), else one per run of consecutive missing
    indices of a problem. `sample_major`: sample 0 of every problem first, then sample 1, ...: any
    stretch of the list mixes problems, so the workers that pull stretches of it get a mix of easy
    and hard problems. Seeds are per sample either way, so the order changes no sample."""
    requests = []
    for p in problems:
        missing = [i for i in range(n) if (p["id"], i) not in have]
        runs: list[list[int]] = []
        for i in missing:
            if runs and runs[-1][-1] == i - 1 and not per_sample:
                runs[-1].append(i)
            else:
                runs.append([i])
        requests += [make_request(p, run[0], len(run), seed, prompt) for run in runs]
    if sample_major:
        requests.sort(key=lambda r: r.start)  # stable: problems keep their order within an index
    return requests
