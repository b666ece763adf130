"""Running an experiment's jobs on this machine: slots of GPUs, the status, resume and one retry.

Jobs (each named by a `cells.JobKey`): per training seed the base model's evaluation with that seed's sampling
seeds, and per cell (arm, seed) its capped training run, then its evaluation as soon as the training is complete.
Slots: on G GPUs with k GPUs per run there are G/k slots (`CUDA_VISIBLE_DEVICES` set to each slice); each slot runs up to `cells_per_gpu` jobs at once (a small model shares one GPU; every vLLM
engine then gets a fixed KV cache, `OPSD_KV_CACHE_GIB`, so engines starting side by side skip vLLM's start-up
memory profile, which fails when another process frees memory meanwhile). Without a GPU: one job at a time.
Jobs side by side share the host's cores: each process's thread pools get its share (`thread_env`).
While jobs share a GPU, the first training job starts alone until it logs its first step (it fills the
compile caches the others then read), and starts are staggered.

The runner's `RunSettings` (from the command line) are fixed; its `Progress` (the queue, the running jobs, the
failures, the timings) is what changes.

Status (`Runner.status`, drawn by `opsd.experiment.status`): one row per cell with its state, the disk it holds
(run and evaluations) and its progress. Disk: once a cell is scored its intermediate training state is removed (`cells.prune_cell`); a `train_capped.sh` run started
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from opsd.errors import SHOWN_CHARS, shown, stop_signals
from opsd.experiment import cells as C
from opsd.experiment import spec as S
from opsd.experiment.status import CellRow, Status
from opsd.paths import size_text

logger = logging.getLogger(__name__)

RENDEZVOUS_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK")
# The thread pools a job's processes size from the environment: torch's intra-op threads (OpenMP, and MKL's),
# and numpy's BLAS. Unset, each process takes every core, and jobs side by side oversubscribe the CPU.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def cpu_cores() -> int:
    """The cores this process may run on (its affinity mask, which a container or `taskset` narrows), or the
    machine's count where the platform has no affinity call."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def thread_env(
    environ: dict[str, str], cores: int, jobs_at_once: int, processes_per_job: int = 1
) -> dict[str, str]:
    """The `THREAD_VARIABLES` of one job's environment when `jobs_at_once` run side by side on `cores` cores,
    each job of `processes_per_job` processes (one per GPU of its slot): each process gets its share,
    max(1, cores // (jobs_at_once * processes_per_job)). {} where one job runs at a time (each library's own
    default, all the cores, is then its share) or where `environ` sets OMP_NUM_THREADS (the user's choice
    stands); a variable `environ` already sets is kept too."""
    if jobs_at_once <= 1 or "OMP_NUM_THREADS" in environ:
        return {}
    threads = str(max(1, cores // (jobs_at_once * max(1, processes_per_job))))
    return {key: threads for key in THREAD_VARIABLES if key not in environ}


@dataclass(frozen=True, eq=False)  # slots are told apart by identity: each is one slice of this machine
class Slot:
    devices: str | None  # CUDA_VISIBLE_DEVICES of this slot; None on a machine without GPUs
    capacity: int  # jobs it runs at once


@dataclass
class Job:
    key: C.JobKey
    attempts: int = 0
    proc: subprocess.Popen | None = None
    slot: Slot | None = None
    started: float = 0.0
    log: Path | None = None
    first_step_at: float | None = None  # when its first logged step was seen
    first_step: int = 0  # that step (a resumed run starts past 0)


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


def append_record(path: Path, record: dict) -> None:
    """One JSON line appended to an append-only log (DIR/jobs.jsonl). A last line cut by a stop mid-append (no
    newline at its end) is dropped first, with a warning quoting it, so that the new record starts a line of its
    own instead of continuing the cut one: a report skips a cut last line, and refuses a damaged line inside."""
    data = path.read_bytes() if path.is_file() else b""
    line = (json.dumps(record) + "\n").encode()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        try:
            S.parse_json(data[keep:])  # a whole record that only lacks its newline (an edit by hand) stays
            line = b"\n" + line
        except ValueError:
            logger.warning(
                "%s: its last line was cut by a stop mid-write; dropped: %s",
                path,
                shown(data[keep : keep + SHOWN_CHARS]),
            )
            with path.open("r+b") as f:
                f.truncate(keep)
    with path.open("ab") as f:
        f.write(line)


@dataclass(frozen=True)
class RunSettings:
    """How this machine runs the jobs, from the command line; fixed for the whole run."""

    every_checkpoint: bool = False  # score every saved checkpoint, not only the final one
    kv_cache_gib: float = 0.0  # > 0: each engine's fixed KV cache (jobs sharing a GPU)
    stagger_s: float = 0.0  # seconds between job starts
    retries: int = 1  # retries of a failed job before it is recorded in failed.json
    status_every_s: float = 30.0  # the status is shown at least this often (and on every change)
    poll_s: float = 2.0  # seconds between looks at the running jobs
    cores: int = 0  # CPU cores the jobs share; 0: this machine's (`cpu_cores`)


@dataclass
class Progress:
    """What changes while the jobs run."""

    queued: list[Job] = field(default_factory=list)  # in the order they start
    running: list[Job] = field(default_factory=list)
    failed: dict[str, dict] = field(default_factory=dict)  # DIR/failed.json: str(JobKey) -> its record
    done_s: list[float] = field(default_factory=list)  # wall seconds of each finished cell (train + eval)
    cell_started: dict[tuple[str, int], float] = field(default_factory=dict)
    phase_s: dict[str, float] = field(default_factory=dict)  # summed job seconds by kind
    warm: bool = False  # a training job has logged a step: the compile caches are filled


class Runner:
    """Runs an experiment's jobs on `slots`: the experiment (`directory`, `spec`), the slots and the settings are
    fixed; `progress` is what changes."""

    def __init__(
        self, directory: Path, spec: S.Spec, slots: list[Slot], settings: RunSettings = RunSettings()
    ):
        self.directory, self.spec, self.slots, self.settings = directory, spec, tuple(slots), settings
        self.progress = Progress()

    # -- planning ----------------------------------------------------------------------------------------
    def plan(self) -> None:
        """Every job the directory still needs, seed by seed: the base model, then the cells (so the first seed
        of every arm and of the base finishes early and a partial report already pairs them)."""
        d, spec, queued = self.directory, self.spec, self.progress.queued
        for seed in spec.seeds:
            if not C.base_scored(d, seed):
                queued.append(Job(C.JobKey("base", seed)))
            for arm in spec.arm_names:
                if not self._trained(arm, seed):
                    queued.append(Job(C.JobKey("train", seed, arm)))
                elif not self._scored(arm, seed):
                    queued.append(Job(C.JobKey("eval", seed, arm)))
                else:  # scored earlier (by an older run, or by hand): pruned now
                    self.prune(arm, seed)
        first_train = next((i for i, j in enumerate(queued) if j.key.kind == "train"), None)
        if first_train and self.sharing:
            # Sharing a GPU, the first training job warms the compile caches alone: it goes first.
            queued.insert(0, queued.pop(first_train))

    def prune(self, arm: str, seed: int) -> None:
        """A scored cell keeps what the report reads (`cells.prune_cell`)."""
        freed = C.prune_cell(self.directory, arm, seed, keep_adapters=self.settings.every_checkpoint)
        if freed:
            logger.info(
                "%s/%s: removed %s of training state (the cell is scored)", arm, seed, size_text(freed)
            )

    def _trained(self, arm: str, seed: int) -> bool:
        return C.cell_state(self.directory, arm, seed).trained

    def _scored(self, arm: str, seed: int) -> bool:
        if self.settings.every_checkpoint:
            return C.all_scored(self.directory, arm, seed)
        return C.cell_state(self.directory, arm, seed).final_scored

    def argv(self, job: Job, slot: Slot) -> list[str]:
        d, spec, key = self.directory, self.spec, job.key
        gpus = len(slot.devices.split(",")) if slot.devices else 0
        if key.kind == "train":
            return S.train_argv(d, spec, key.arm, key.seed)
        extra = ["--num-gpus", str(gpus)] if gpus > 1 else []
        if key.kind == "base":
            return S.eval_argv(d, spec, None, key.seed, every_checkpoint=False, extra=extra)
        return S.eval_argv(
            d, spec, key.arm, key.seed, every_checkpoint=self.settings.every_checkpoint, extra=extra
        )

    # -- running -----------------------------------------------------------------------------------------
    def load(self, slot: Slot) -> int:
        """Jobs running on `slot` now."""
        return sum(job.slot is slot for job in self.progress.running)

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
        if self.settings.kv_cache_gib > 0:
            env["OPSD_KV_CACHE_GIB"] = str(self.settings.kv_cache_gib)
        # Jobs side by side share the host's cores: each process gets its share of threads (`thread_env`).
        at_once = sum(s.capacity for s in self.slots)
        processes = len(slot.devices.split(",")) if slot.devices else 1
        env.update(thread_env(env, self.settings.cores or cpu_cores(), at_once, processes))
        return env

    def start(self, job: Job, slot: Slot) -> None:
        job.attempts += 1
        job.slot, job.started, job.first_step_at, job.first_step = slot, time.time(), None, 0
        job.log = self.directory / S.LOGS / f"{job.key}.log"
        job.log.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv(job, slot)
        with job.log.open("a") as f:
            f.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} attempt {job.attempts}: {S.shell(argv)}\n")
        if job.key.arm is not None:
            self.progress.cell_started.setdefault((job.key.arm, job.key.seed), time.time())
        # Its own process group, so that stopping the experiment stops the job's whole tree.
        job.proc = subprocess.Popen(
            argv, stdout=job.log.open("a"), stderr=subprocess.STDOUT, cwd=S.ROOT, env=self.env(slot),
            start_new_session=True,
        )  # fmt: skip
        self.progress.running.append(job)
        logger.info("start %s (attempt %d) on %s", job.key.name, job.attempts, slot.devices or "the CPU")

    def finish(self, job: Job, rc: int) -> None:
        p, key = self.progress, job.key
        p.running.remove(job)
        seconds = time.time() - job.started
        p.phase_s[key.kind] = p.phase_s.get(key.kind, 0.0) + seconds
        ok = rc == 0 and self._outputs_exist(job)
        record = {"job": key.name, "kind": key.kind, "arm": key.arm, "seed": key.seed, "attempt": job.attempts,
                  "devices": job.slot.devices, "start": job.started, "seconds": seconds, "exit": rc, "ok": ok}  # fmt: skip
        append_record(self.directory / C.JOBS_FILE, record)
        if ok:
            logger.info("done %s in %.0f s", key.name, seconds)
            p.failed.pop(str(key), None)
            if key.kind == "train":
                p.queued.insert(0, Job(C.JobKey("eval", key.seed, key.arm)))
            elif key.kind == "eval":
                p.done_s.append(time.time() - p.cell_started.get((key.arm, key.seed), job.started))
                self.prune(key.arm, key.seed)
        elif job.attempts <= self.settings.retries:
            logger.warning("%s failed (exit %s); retrying once: %s", key.name, rc, job.log)
            p.queued.append(job)
        else:
            logger.error("%s failed (exit %s) after %d attempts: %s", key.name, rc, job.attempts, job.log)
            p.failed[str(key)] = {"job": key.name, "exit": rc, "attempts": job.attempts, "log": str(job.log)}
        C.write_failed(self.directory, p.failed)

    def _outputs_exist(self, job: Job) -> bool:
        key = job.key
        if key.kind == "base":
            return C.base_scored(self.directory, key.seed)
        if key.kind == "train":
            return self._trained(key.arm, key.seed)
        return self._scored(key.arm, key.seed)

    def _watch_steps(self) -> None:
        """Note when each running training job logs its first step (its rate is timed from there)."""
        for job in self.progress.running:
            if job.key.kind == "train" and job.first_step_at is None:
                step = C.last_step(S.run_dir(self.directory, job.key.arm, job.key.seed))
                if step > 0:
                    job.first_step_at, job.first_step = time.time(), step
                    self.progress.warm = True

    @property
    def sharing(self) -> bool:
        return any(s.capacity > 1 for s in self.slots)

    def _gate_closed(self) -> bool:
        """While jobs share a GPU: the first training job runs alone until its first step is logged."""
        if self.progress.warm or not self.sharing:
            return False
        return any(j.key.kind == "train" for j in self.progress.running)

    def step(self, now: float, last_start: float) -> float:
        p = self.progress
        for job in list(p.running):
            rc = job.proc.poll()
            if rc is not None:
                self.finish(job, rc)
        self._watch_steps()
        if self._gate_closed():
            return last_start
        for job in list(p.queued):
            if now - last_start < self.settings.stagger_s:
                break
            slot = next((s for s in self.slots if self.load(s) < s.capacity), None)
            if slot is None:
                break
            p.queued.remove(job)
            self.start(job, slot)
            last_start = now
            if self._gate_closed():
                break
        return last_start

    def run(self, show: Callable[[Status], object]) -> None:
        """Run every planned job; `show(status)` gets the status when a cell changes state (and every
        status_every_s). Stopping the experiment (Ctrl-C, SIGTERM, SIGHUP) stops every job it started."""
        self.progress.failed = C.read_failed(self.directory)
        with stop_signals(restore_after_stop=False):  # a stop's later signals are ignored while the jobs stop
            self._run(show)

    def _run(self, show: Callable[[Status], object]) -> None:
        p = self.progress
        last_start, last_shown, states = 0.0, 0.0, None
        try:
            while p.queued or p.running:
                now = time.time()
                last_start = self.step(now, last_start)
                status = self.status()
                if status.states != states or now - last_shown >= self.settings.status_every_s:
                    show(status)
                    states, last_shown = status.states, now
                if p.queued or p.running:
                    time.sleep(self.settings.poll_s)
            show(self.status())
        finally:
            for job in p.running:
                if job.proc.poll() is None:
                    try:
                        os.killpg(job.proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
            for job in p.running:
                try:
                    job.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(job.proc.pid, signal.SIGKILL)

    # -- status ------------------------------------------------------------------------------------------
    def status(self) -> Status:
        """Where every cell stands now, from the jobs and the cells' files."""
        d, p = self.directory, self.progress
        running = {(j.key.arm, j.key.seed): j for j in p.running if j.key.arm is not None}
        queued = {(j.key.arm, j.key.seed) for j in p.queued if j.key.arm is not None}
        rows, remaining = [], []
        for seed in self.spec.seeds:
            for arm in self.spec.arm_names:
                state = C.cell_state(d, arm, seed)
                job = running.get((arm, seed))
                failure = C.cell_failure(p.failed, arm, seed)
                if job is not None and job.key.kind == "train":
                    what, detail = "training", f"step {state.step}/{S.STEPS}"
                    rate = self._seconds_per_step(job, state.step)
                    if rate:
                        remaining.append(rate * (S.STEPS - state.step))
                        detail += f" ({rate:.1f} s/step)"
                elif job is not None:
                    what, detail = "scoring", f"{state.samples} samples"
                elif (arm, seed) in queued:
                    what, detail = "queued", f"step {state.step}/{S.STEPS}" if state.step else ""
                elif failure:
                    key, f = failure
                    what, detail = "failed", f"{key.name}: exit {f['exit']}, see {f['log']}"
                elif self._scored(arm, seed):
                    what, detail = "done", ""
                else:
                    what, detail = "queued", ""
                rows.append(CellRow(arm, seed, what, C.cell_bytes(d, arm, seed), detail))
        waiting = sum(r.state == "queued" for r in rows)
        return Status(
            time=time.time(), rows=tuple(rows),
            base_scored=sum(C.base_scored(d, seed) for seed in self.spec.seeds), base_planned=len(self.spec.seeds),
            base_running=any(j.key.kind == "base" for j in p.running),
            eta_s=self._eta_s(remaining, waiting), eta_after_first=bool(p.queued or p.running) and waiting > 0
            and not p.done_s,
        )  # fmt: skip

    @staticmethod
    def _seconds_per_step(job: Job, step: int) -> float | None:
        if job.first_step_at is None or step <= job.first_step:
            return None
        return (time.time() - job.first_step_at) / (step - job.first_step)

    def _eta_s(self, remaining: list[float], queued: int) -> float | None:
        """The longest running training job's time left, plus the waves of queued cells at the mean cell time."""
        p = self.progress
        if not (p.running or p.queued) or not p.done_s:
            return None
        capacity = sum(s.capacity for s in self.slots)
        waves = -(-queued // capacity)
        return max(remaining, default=0.0) + waves * sum(p.done_s) / len(p.done_s)
