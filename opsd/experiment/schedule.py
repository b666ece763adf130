"""Running an experiment's jobs on this machine: slots of GPUs, a live status table, resume and one retry.

Jobs: per training seed the base model's evaluation with that seed's sampling seeds, and per cell (arm, seed)
its capped training run, then its evaluation as soon as the training is complete. Slots: on G GPUs with k GPUs per run there are G/k slots (`CUDA_VISIBLE_DEVICES`
set to each slice); each slot runs up to `cells_per_gpu` jobs at once (a small model shares one GPU; every vLLM
engine then gets a fixed KV cache, `OPSD_KV_CACHE_GIB`, so engines starting side by side skip vLLM's start-up
memory profile, which fails when another process frees memory meanwhile). Without a GPU: one job at a time.
While jobs share a GPU, the first training job starts alone until it logs its first step (it fills the
compile caches the others then read), and starts are staggered.

Status: one row per cell with its state, the disk it holds (run and evaluations) and its progress. Disk: once a
cell is scored its intermediate training state is removed (`cells.prune_cell`); a `train_capped.sh` run started
by hand keeps everything.

Resume: a job whose outputs exist is not started (a complete checkpoint-100; a summary.json for every checkpoint
scored). An interrupted training run or evaluation resumes from its own files, as train_capped.sh and
eval_aime.py always do. A job that fails is retried once, then recorded in `DIR/failed.json` (with its log) and
its cell is reported as missing; a later rerun tries it again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from opsd.experiment import cells as C
from opsd.experiment import spec as S
from opsd.paths import size_text

logger = logging.getLogger(__name__)

RENDEZVOUS_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")


@dataclass
class Slot:
    devices: str | None  # CUDA_VISIBLE_DEVICES of this slot; None on a machine without GPUs
    capacity: int
    running: int = 0


@dataclass
class Job:
    name: str  # "base SEED", "train ARM/SEED" or "eval ARM/SEED"
    kind: str  # base | train | eval
    arm: str | None = None
    seed: int | None = None
    attempts: int = 0
    proc: subprocess.Popen | None = None
    slot: Slot | None = None
    started: float = 0.0
    log: Path | None = None
    first_step_at: float | None = None  # when its first logged step was seen
    first_step: int = 0  # that step (a resumed run starts past 0)

    @property
    def key(self) -> str:
        return self.name.replace(" ", "-").replace("/", "-s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_slots(gpus: list[str], gpus_per_run: int, cells_per_gpu: int) -> list[Slot]:
    if not gpus:
        return [Slot(None, 1)]
    if gpus_per_run < 1 or len(gpus) % gpus_per_run:
        raise ValueError(f"{len(gpus)} GPU(s) cannot be split into runs of {gpus_per_run}")
    return [
        Slot(",".join(gpus[i : i + gpus_per_run]), cells_per_gpu) for i in range(0, len(gpus), gpus_per_run)
    ]


@dataclass
class Runner:
    directory: Path
    spec: S.Spec
    slots: list[Slot]
    every_checkpoint: bool = False
    kv_cache_gib: float = 0.0  # > 0: each engine's fixed KV cache (jobs sharing a GPU)
    stagger_s: float = 0.0
    retries: int = 1
    status_every_s: float = 30.0
    poll_s: float = 2.0
    jobs: list[Job] = field(default_factory=list)
    running: list[Job] = field(default_factory=list)
    failed: dict[str, dict] = field(default_factory=dict)
    done_s: list[float] = field(default_factory=list)  # wall seconds of each finished cell (train + eval)
    cell_started: dict[tuple[str, int], float] = field(default_factory=dict)
    phase_s: dict[str, float] = field(default_factory=dict)  # summed job seconds by kind
    warm: bool = False  # a training job has logged a step: the compile caches are filled

    # -- planning ----------------------------------------------------------------------------------------
    def plan(self) -> None:
        """Every job the directory still needs, seed by seed: the base model, then the cells (so the first seed
        of every arm and of the base finishes early and a partial report already pairs them)."""
        d, spec = self.directory, self.spec
        for seed in spec.seeds:
            if not C.base_scored(d, seed):
                self.jobs.append(Job(f"base {seed}", "base", seed=seed))
            for arm in spec.arm_names:
                if not self._trained(arm, seed):
                    self.jobs.append(Job(f"train {arm}/{seed}", "train", arm, seed))
                elif not self._scored(arm, seed):
                    self.jobs.append(Job(f"eval {arm}/{seed}", "eval", arm, seed))
                else:  # scored earlier (by an older run, or by hand): pruned now
                    self.prune(arm, seed)
        first_train = next((i for i, j in enumerate(self.jobs) if j.kind == "train"), None)
        if first_train and self.sharing:
            # Sharing a GPU, the first training job warms the compile caches alone: it goes first.
            self.jobs.insert(0, self.jobs.pop(first_train))

    def prune(self, arm: str, seed: int) -> None:
        """A scored cell keeps what the report reads (`cells.prune_cell`)."""
        freed = C.prune_cell(self.directory, arm, seed, keep_adapters=self.every_checkpoint)
        if freed:
            logger.info(
                "%s/%s: removed %s of training state (the cell is scored)", arm, seed, size_text(freed)
            )

    def _trained(self, arm: str, seed: int) -> bool:
        return C.cell_state(self.directory, arm, seed).trained

    def _scored(self, arm: str, seed: int) -> bool:
        if self.every_checkpoint:
            return C.all_scored(self.directory, arm, seed)
        return C.cell_state(self.directory, arm, seed).final_scored

    def argv(self, job: Job, slot: Slot) -> list[str]:
        d, spec = self.directory, self.spec
        gpus = len(slot.devices.split(",")) if slot.devices else 0
        if job.kind == "train":
            return S.train_argv(d, spec, job.arm, job.seed)
        extra = ["--num-gpus", str(gpus)] if gpus > 1 else []
        if job.kind == "base":
            return S.eval_argv(d, spec, None, job.seed, every_checkpoint=False, extra=extra)
        return S.eval_argv(d, spec, job.arm, job.seed, every_checkpoint=self.every_checkpoint, extra=extra)

    # -- running -----------------------------------------------------------------------------------------
    def env(self, slot: Slot) -> dict[str, str]:
        env = {**os.environ, "PYTHON": sys.executable, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "PYTHONUNBUFFERED": "1"}  # fmt: skip
        # Each job is a launch of its own (train_capped.sh starts its processes through accelerate): the rank
        # variables of whatever started the experiment (a torchrun or SLURM shell, an in-process vLLM engine)
        # would make the job's process join that group instead of starting its own.
        for key in RENDEZVOUS_VARIABLES:
            env.pop(key, None)
        if slot.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = slot.devices
        if self.kv_cache_gib > 0:
            env["OPSD_KV_CACHE_GIB"] = str(self.kv_cache_gib)
        if slot.capacity > 1:
            env.setdefault(
                "OMP_NUM_THREADS", "1"
            )  # many processes share the host's cores; the work is on GPU
        return env

    def start(self, job: Job, slot: Slot) -> None:
        job.attempts += 1
        job.slot, job.started, job.first_step_at, job.first_step = slot, time.time(), None, 0
        slot.running += 1
        job.log = self.directory / S.LOGS / f"{job.key}.log"
        job.log.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv(job, slot)
        with job.log.open("a") as f:
            f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} attempt {job.attempts}: {S.shell(argv)}\n")
        if job.arm is not None:
            self.cell_started.setdefault((job.arm, job.seed), time.time())
        # Its own process group, so that stopping the experiment stops the job's whole tree.
        job.proc = subprocess.Popen(
            argv, stdout=job.log.open("a"), stderr=subprocess.STDOUT, cwd=S.ROOT, env=self.env(slot),
            start_new_session=True,
        )  # fmt: skip
        self.running.append(job)
        logger.info("start %s (attempt %d) on %s", job.name, job.attempts, slot.devices or "the CPU")

    def finish(self, job: Job, rc: int) -> None:
        self.running.remove(job)
        job.slot.running -= 1
        seconds = time.time() - job.started
        self.phase_s[job.kind] = self.phase_s.get(job.kind, 0.0) + seconds
        ok = rc == 0 and self._outputs_exist(job)
        record = {"job": job.name, "kind": job.kind, "arm": job.arm, "seed": job.seed, "attempt": job.attempts,
                  "devices": job.slot.devices, "start": job.started, "seconds": seconds, "exit": rc, "ok": ok}  # fmt: skip
        with (self.directory / C.JOBS_FILE).open("a") as f:
            f.write(json.dumps(record) + "\n")
        if ok:
            logger.info("done %s in %.0f s", job.name, seconds)
            self.failed.pop(job.key, None)
            if job.kind == "train":
                self.jobs.insert(0, Job(f"eval {job.arm}/{job.seed}", "eval", job.arm, job.seed))
            elif job.kind == "eval":
                self.done_s.append(time.time() - self.cell_started.get((job.arm, job.seed), job.started))
                self.prune(job.arm, job.seed)
        elif job.attempts <= self.retries:
            logger.warning("%s failed (exit %s); retrying once: %s", job.name, rc, job.log)
            self.jobs.append(job)
        else:
            logger.error("%s failed (exit %s) after %d attempts: %s", job.name, rc, job.attempts, job.log)
            self.failed[job.key] = {
                "job": job.name,
                "exit": rc,
                "attempts": job.attempts,
                "log": str(job.log),
            }
        C.write_failed(self.directory, self.failed)

    def _outputs_exist(self, job: Job) -> bool:
        if job.kind == "base":
            return C.base_scored(self.directory, job.seed)
        if job.kind == "train":
            return self._trained(job.arm, job.seed)
        return self._scored(job.arm, job.seed)

    def _watch_steps(self) -> None:
        """Note when each running training job logs its first step (its rate is timed from there)."""
        for job in self.running:
            if job.kind == "train" and job.first_step_at is None:
                step = C.last_step(S.run_dir(self.directory, job.arm, job.seed))
                if step > 0:
                    job.first_step_at, job.first_step = time.time(), step
                    self.warm = True

    @property
    def sharing(self) -> bool:
        return any(s.capacity > 1 for s in self.slots)

    def _gate_closed(self) -> bool:
        """While jobs share a GPU: the first training job runs alone until its first step is logged."""
        if self.warm or not self.sharing:
            return False
        return any(j.kind == "train" for j in self.running)

    def step(self, now: float, last_start: float) -> float:
        for job in list(self.running):
            rc = job.proc.poll()
            if rc is not None:
                self.finish(job, rc)
        self._watch_steps()
        if self._gate_closed():
            return last_start
        for job in list(self.jobs):
            if now - last_start < self.stagger_s:
                break
            slot = next((s for s in self.slots if s.running < s.capacity), None)
            if slot is None:
                break
            self.jobs.remove(job)
            self.start(job, slot)
            last_start = now
            if self._gate_closed():
                break
        return last_start

    def run(self, show) -> None:
        """Run every planned job; `show(lines)` gets the status table when it changes (and every
        status_every_s). Stopping the experiment (Ctrl-C, SIGTERM) stops every job it started."""
        self.failed = C.read_failed(self.directory)
        last_start, last_shown, shown = 0.0, 0.0, None

        def stop(signum, frame):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGTERM, stop)
        try:
            while self.jobs or self.running:
                now = time.time()
                last_start = self.step(now, last_start)
                table = self.status_lines()
                states = [line.split()[:2] for line in table[1:]]  # cell and state, not the step it is at
                if states != shown or now - last_shown >= self.status_every_s:
                    show(table)
                    shown, last_shown = states, now
                if self.jobs or self.running:
                    time.sleep(self.poll_s)
            show(self.status_lines())
        finally:
            for job in self.running:
                if job.proc.poll() is None:
                    try:
                        os.killpg(job.proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            for job in self.running:
                try:
                    job.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(job.proc.pid, signal.SIGKILL)
            signal.signal(signal.SIGTERM, previous)

    # -- status ------------------------------------------------------------------------------------------
    def status_lines(self) -> list[str]:
        d = self.directory
        rows, counts = [], {"queued": 0, "training": 0, "scoring": 0, "done": 0, "failed": 0}
        running = {(j.arm, j.seed): j for j in self.running if j.arm is not None}
        queued = {(j.arm, j.seed) for j in self.jobs if j.arm is not None}
        remaining = []
        for seed in self.spec.seeds:
            for arm in self.spec.arm_names:
                state = C.cell_state(d, arm, seed)
                job = running.get((arm, seed))
                failed = self.failed.get(f"train-{arm}-s{seed}") or self.failed.get(f"eval-{arm}-s{seed}")
                if job is not None and job.kind == "train":
                    what, detail = "training", f"step {state.step}/{S.STEPS}"
                    rate = self._seconds_per_step(job, state.step)
                    if rate:
                        remaining.append(rate * (S.STEPS - state.step))
                        detail += f" ({rate:.1f} s/step)"
                elif job is not None:
                    what, detail = "scoring", f"{state.samples} samples"
                elif (arm, seed) in queued:
                    what, detail = "queued", f"step {state.step}/{S.STEPS}" if state.step else ""
                elif failed:
                    what, detail = "failed", f"{failed['job']}: exit {failed['exit']}, see {failed['log']}"
                elif self._scored(arm, seed):
                    what, detail = "done", ""
                else:
                    what, detail = "queued", ""
                counts[what] += 1
                disk = size_text(C.cell_bytes(d, arm, seed))
                rows.append(f"  {arm}/{seed:<6} {what:<9} {disk:>10}  {detail}".rstrip())
        base = sum(C.base_scored(d, seed) for seed in self.spec.seeds)
        scoring = " (scoring)" if any(j.kind == "base" for j in self.running) else ""
        head = (
            f"[{time.strftime('%H:%M:%S')}] {len(rows)} cells: "
            + ", ".join(f"{n} {k}" for k, n in counts.items() if n)
            + f" | base model: {base} of {len(self.spec.seeds)} seeds scored{scoring}"
            + self._eta(remaining, counts["queued"])
        )
        return [head, *rows]

    @staticmethod
    def _seconds_per_step(job: Job, step: int) -> float | None:
        if job.first_step_at is None or step <= job.first_step:
            return None
        return (time.time() - job.first_step_at) / (step - job.first_step)

    def _eta(self, remaining: list[float], queued: int) -> str:
        if not self.running and not self.jobs:
            return ""
        capacity = sum(s.capacity for s in self.slots)
        per_cell = sum(self.done_s) / len(self.done_s) if self.done_s else None
        if per_cell is None:
            return " | ETA: after the first cell" if queued else ""
        waves = -(-queued // capacity)
        eta = max(remaining, default=0.0) + waves * per_cell
        return f" | ETA ~{eta / 60:.0f} min"
