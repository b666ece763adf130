"""Data parallel (`--num-gpus N`): N worker processes pull the missing samples from one shared queue.

The parent writes the run's requests, in the order `plan_requests` gives them, to ``DIR/shards/queue.json``
and starts N workers of the same script, each with ``CUDA_VISIBLE_DEVICES`` set to its GPU(s) and
``--shard r/N``. A worker claims requests whenever its engine has room (`ClaimQueue.take`), under an
exclusive lock (`fcntl.flock`) on ``DIR/shards/queue.lock``; the claim state (the next unclaimed request,
each worker's requests in flight) is ``DIR/shards/queue-state.json``. Worker r appends its samples to
``DIR/shards/samples-r{r}-of{N}.jsonl``; the parent then appends the workers' new lines to samples.jsonl
(deduplicated by key) and summarizes.

Fair share: a worker holds at most ceil(R / N) requests in flight, R being the unclaimed requests plus
those in flight on all workers. So the first engine to start does not take the whole run while the others
are still loading; a worker that finishes its samples early takes more from the queue while a slower one
is still busy; a worker that died leaves its share to the others. Requests carry their own seeds, so which
worker draws a sample changes nothing in it: 1 and N workers write the same samples (tested on CPU).
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import subprocess
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from opsd.errors import UserError
from opsd.evaluation.eval_config import EvalConfig, RunFailed
from opsd.evaluation.generate import NO_TIMINGS, generate_missing
from opsd.evaluation.job import EvalJob
from opsd.evaluation.requests import PromptOf, Prompts, Request, make_request
from opsd.evaluation.samples import SAMPLES_FILE, SHARD_DIR, merge_shards

logger = logging.getLogger(__name__)

QUEUE_FILE = "queue.json"
STATE_FILE = "queue-state.json"
LOCK_FILE = "queue.lock"


def write_queue(shard_dir: Path, requests: Sequence[Request], world: int) -> None:
    """The work of a data-parallel run: (problem id, first sample, count) of every request, in order (each
    worker builds the requests whole again: `ClaimQueue`)."""
    shard_dir.mkdir(parents=True, exist_ok=True)
    units = [[r.problem["id"], r.start, r.count] for r in requests]
    (shard_dir / QUEUE_FILE).write_text(json.dumps({"world": world, "requests": units}))
    (shard_dir / STATE_FILE).write_text(json.dumps({"next": 0, "in_flight": [0] * world}))


class ClaimQueue:
    """Worker `rank`'s view of the shared queue: `take(k)` claims up to k requests, `finished(count)`
    gives back `count` requests' places. The queue's requests are built whole with the run's `seed` and
    `prompt` (`make_request`; a worker's own `Prompts`)."""

    def __init__(
        self,
        shard_dir: Path,
        rank: int,
        problems: Sequence[dict[str, Any]],
        seed: int,
        prompt: PromptOf,
    ):
        self.dir, self.rank = shard_dir, rank
        queue = json.loads((shard_dir / QUEUE_FILE).read_text())
        self.world = queue["world"]
        by_id = {p["id"]: p for p in problems}
        self.requests = [
            make_request(by_id[pid], start, count, seed, prompt) for pid, start, count in queue["requests"]
        ]
        self._may_claim = True  # False once a claim was refused, until one of ours finishes

    @contextmanager
    def _state(self):
        with (self.dir / LOCK_FILE).open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = json.loads((self.dir / STATE_FILE).read_text())
                yield state
                tmp = self.dir / f"{STATE_FILE}.r{self.rank}"
                tmp.write_text(json.dumps(state))
                os.replace(tmp, self.dir / STATE_FILE)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def take(self, k: int) -> list[Request]:
        # Our share only grows when our own requests finish, so a refused claim is not retried before.
        if not self._may_claim or k < 1:
            return []
        with self._state() as state:
            first, mine = state["next"], state["in_flight"][self.rank]
            unclaimed = len(self.requests) - first
            share = math.ceil((unclaimed + sum(state["in_flight"])) / self.world)
            count = max(0, min(k, unclaimed, share - mine))
            state["next"] = first + count
            state["in_flight"][self.rank] = mine + count
        if count == 0:
            self._may_claim = False
        return self.requests[first : first + count]

    def finished(self, count: int) -> None:
        if count:
            with self._state() as state:
                state["in_flight"][self.rank] = max(0, state["in_flight"][self.rank] - count)
            self._may_claim = True


def run_workers(
    config: EvalConfig, argv: Sequence[str], script: str, out: Path, requests: Sequence[Request]
) -> dict[str, float]:
    """Start `num_gpus` workers of `script` on a queue of `requests`, wait for all, merge their samples;
    returns the summed timings and each worker's new samples (`worker_samples`)."""
    import torch

    world, tp = config.num_gpus, config.tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(world * tp)]
    if torch.cuda.is_available() and torch.cuda.device_count() < world * tp:
        raise UserError(
            f"--num-gpus {world} x --tensor-parallel-size {tp} needs {world * tp} GPUs; "
            f"{torch.cuda.device_count()} are visible"
        )
    if not torch.cuda.is_available():
        logger.warning("no GPU: running %d CPU workers", world)
    shard_dir = out / SHARD_DIR
    write_queue(shard_dir, requests, world)
    procs = []
    for r in range(world):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tp : (r + 1) * tp])}
        cmd = [sys.executable, os.path.abspath(script), *argv, "--num_gpus", "1", "--shard", f"{r}/{world}"]
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        codes = [p.wait() for p in procs]
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    merge_shards(out)
    totals: dict[str, Any] = {**NO_TIMINGS, "worker_samples": [0] * world}
    for r in range(world):
        f = shard_dir / f"stats-r{r}.json"
        if not f.is_file():  # the worker died before it finished
            continue
        stats = json.loads(f.read_text())
        f.unlink()
        totals["worker_samples"][r] = stats["new_samples"]
        for key in ("new_samples", "new_tokens"):
            totals[key] += stats[key]
        # Workers run side by side: the slowest one sets the wall clock.
        for key in ("engine_start_s", "generation_s"):
            totals[key] = max(totals[key], stats[key])
    for name in (QUEUE_FILE, STATE_FILE, LOCK_FILE):
        (shard_dir / name).unlink(missing_ok=True)
    if not any(shard_dir.iterdir()):
        shard_dir.rmdir()
    failed = [r for r, c in enumerate(codes) if c != 0]
    if failed:
        raise RunFailed(
            f"worker(s) {failed} failed (exit codes {[codes[r] for r in failed]}); the samples they "
            f"finished are in {out / SAMPLES_FILE}; rerun the same command to resume"
        )
    return totals


def run_shard(job: EvalJob, rank: int, world: int) -> None:
    """Worker `rank` of `world` (--num-gpus): sample what it claims into its own file and leave its timings
    for the parent."""
    shard_dir = job.out / SHARD_DIR
    queue = ClaimQueue(shard_dir, rank, job.problems, job.settings.seed, Prompts(job))
    if queue.world != world:
        raise RunFailed(f"{shard_dir / QUEUE_FILE} was written for {queue.world} workers, not {world}")
    timings = generate_missing(
        job, queue.requests, queue, shard_dir / f"samples-r{rank}-of{world}.jsonl",
        shard_dir / f".merged-r{rank}", position=rank,
    )  # fmt: skip
    (shard_dir / f"stats-r{rank}.json").write_text(json.dumps(timings))
