"""Benchmark: does OPSD make the embedded model better, which clip mode does it, and what does the reference do?

    python bench/learning.py --out bench/results/learning_h200.json            # one GPU, every arm side by side
    python bench/learning.py --preset controls                                  # the reference controls, one GPU
    python bench/learning.py --plot bench/results/learning_h200.json           # the figures again, from the JSON

Each arm is a real `opsd_train.py` run on the embedded SmolLM2-135M-Instruct and the `builtin:easy` problems
(100 steps x 32 problems, one rollout each, LoRA r64 and every other setting as published) that differs
only in `clip_mode`, `beta`, `learning_rate`, `teacher_ref_pairing` and `seed`. The base model and the arms'
checkpoints are scored with `eval_aime.py` on held-out problems (n samples each, same sampling seeds, so the
comparison is paired) and compared with `eval_aime.py --compare`. The probe curves (`probe/divergence`,
`probe/top1_agree`, `probe/teacher_token_logp`) come from each run's metrics.jsonl.

Presets (`--preset`; every flag below still overrides them):
- `learning` (default): the clip modes and betas of docs/learning.md; each final checkpoint evaluated on
  its own (`--eval-mode separate`) on the held-out `builtin:easy` problems.
- `controls`: the reference controls of docs/method.md §1.8. The `rescale` and `element` clips at 1e-4, each
  with `teacher_ref_pairing` matched, shuffled and empty, seeds 42 and 43; plus the longer horizon: the
  seed-42 matched run of each mode continued to `--horizon-steps` (300), checkpoints every
  `--horizon-every` (100) steps. Evaluated on `builtin:easy-disjoint` (held out by arithmetic) in sweeps
  (`--eval-mode sweep`: one engine start for the base model and every checkpoint, adapters merged): one
  as soon as every control has its checkpoint-100, one for the horizon checkpoints once they exist, into
  the same directory (it lists the first one's checkpoints too, so that names agree; what is scored already
  is skipped). Every checkpoint is paired
  against the base model and, for shuffled and empty, against the matched arm of the same mode, seed and
  step. Output: `bench/results/controls_h200.json` and `docs/controls.png`.
- `horizon`: the horizon part of `controls` alone.

All processes share one GPU: each gets its own MASTER_PORT, and `bench/shared_gpu.py` gives every vLLM
engine a fixed KV cache (`--kv-gib`; the sweeps `--sweep-kv-gib`) so that engines starting side by side skip
vLLM's start-up memory profile. The first arm starts alone (it fills the compile cache the others reuse). A
failed process is retried (`--retries`); training resumes from its last checkpoint and evaluation from its
samples, so a rerun of the whole command also continues where it stopped (a run planned for more steps
continues from its last checkpoint). The JSON is rewritten as stages finish. `--compare-only` trains and
samples nothing: it makes the missing comparisons, the JSON and the figures from the evaluations on disk.

Output: `{"machine", "config", "rows": [one per run], "arms": [mean over seeds], "wall_s", "failed"}`. A row
holds the run's settings, probe curves and training summary, and its evaluations by step (`evals`: avg and
format of the checkpoint, its paired differences with the base model and, where it applies, the matched
arm); its top-level `trained` / `diff` / `diff_format` are those of the last evaluated step. Figures
(`--plot-dir`): for `learning`, probe divergence against step and each arm's gains with 95% CIs; for
`controls`, one figure of four panels (gains in accuracy and format, probe divergence, the horizon).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine, write  # noqa: E402
from opsd.choices import CLIP_MODES, TEACHER_REF_PAIRINGS  # noqa: E402
from opsd.rundir import read_step_log  # noqa: E402

MATCHED = TEACHER_REF_PAIRINGS[0]
# clip_mode:beta:learning_rate[:teacher_ref_pairing]. The four clip modes at the published beta = 0, beta = 0.5
# with the two modes that keep a gradient on every token, and the published mode at a ten times smaller rate.
DEFAULT_ARMS = (
    "element:0:1e-4,token:0:1e-4,rescale:0:1e-4,none:0:1e-4,none:0.5:1e-4,rescale:0.5:1e-4,element:0:1e-5"
)
CONTROL_ARMS = ",".join(f"{m}:0:1e-4:{p}" for m in ("rescale", "element") for p in TEACHER_REF_PAIRINGS)
HORIZON_ARMS = "rescale:0:1e-4,element:0:1e-4"
PROBE_KEYS = ("probe/divergence", "probe/top1_agree", "probe/teacher_token_logp")
SWEEP_DIR = "sweep"

# Defaults of each preset for the flags left unset.
PRESETS: dict[str, dict] = {
    "learning": {
        "out": "bench/results/learning_h200.json", "workdir": "runs/learning", "arms": DEFAULT_ARMS,
        "seeds": "42,43", "horizon_arms": "", "eval_dataset": "", "eval_mode": "separate", "figure": "learning",
    },
    "controls": {
        "out": "bench/results/controls_h200.json", "workdir": "runs/controls", "arms": CONTROL_ARMS,
        "seeds": "42,43", "horizon_arms": HORIZON_ARMS, "eval_dataset": "builtin:easy-disjoint",
        "eval_mode": "sweep", "figure": "controls",
    },
    "horizon": {
        "out": "bench/results/controls_horizon_h200.json", "workdir": "runs/controls", "arms": "",
        "seeds": "42,43", "horizon_arms": HORIZON_ARMS, "eval_dataset": "builtin:easy-disjoint",
        "eval_mode": "sweep", "figure": "controls",
    },
}  # fmt: skip


@dataclass
class Arm:
    """One training run, and the steps at which its checkpoints are scored."""

    clip_mode: str
    beta: float
    learning_rate: float
    seed: int
    teacher_ref_pairing: str = MATCHED
    steps: int = 100
    eval_steps: tuple[int, ...] = (100,)
    parts: tuple[str, ...] = ("main",)  # main (the preset's arms) and/or horizon

    @property
    def key(self) -> tuple:
        return (self.clip_mode, self.beta, self.learning_rate, self.seed, self.teacher_ref_pairing)

    @property
    def name(self) -> str:
        name = f"{self.clip_mode}-b{self.beta:g}-lr{self.learning_rate:g}-s{self.seed}"
        return name if self.teacher_ref_pairing == MATCHED else f"{name}-{self.teacher_ref_pairing}"

    @property
    def save_steps(self) -> int:
        """Checkpoints at every scored step before the last (the last is saved anyway), else at half the run
        (a resume point)."""
        before = [s for s in self.eval_steps if s < self.steps]
        return math.gcd(*before) if before else max(self.steps // 2, 1)

    def matched(self) -> tuple:
        return (self.clip_mode, self.beta, self.learning_rate, self.seed, MATCHED)


@dataclass
class Job:
    """One subprocess stage of the benchmark; `then` runs once it succeeds."""

    name: str
    argv: list[str]
    log: Path
    then: object = None
    attempts: int = 0
    proc: subprocess.Popen | None = None
    started: float = 0.0
    seconds: list[float] = field(default_factory=list)
    env: dict = field(default_factory=dict)


def parse_arms(spec: str, seeds: list[int], *, steps: int = 100, eval_steps: tuple[int, ...] | None = None,
               part: str = "main") -> list[Arm]:  # fmt: skip
    """Arms from `clip_mode:beta:learning_rate[:teacher_ref_pairing],...`, one per seed."""
    arms = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        fields_ = item.split(":")
        if len(fields_) not in (3, 4):
            raise SystemExit(
                f"--arms item {item!r}: write clip_mode:beta:learning_rate[:teacher_ref_pairing]"
            )
        mode, beta, lr, pairing = (*fields_, MATCHED)[:4]
        if mode not in CLIP_MODES or pairing not in TEACHER_REF_PAIRINGS:
            raise SystemExit(
                f"--arms item {item!r}: clip_mode is one of {list(CLIP_MODES)}, teacher_ref_pairing one of "
                f"{list(TEACHER_REF_PAIRINGS)}"
            )
        arms += [Arm(mode, float(beta), float(lr), s, pairing, steps, eval_steps or (steps,), (part,))
                 for s in seeds]  # fmt: skip
    return arms


def merge_arms(arms: list[Arm]) -> list[Arm]:
    """One run per setting: an arm asked for by both parts trains to the longer horizon and is scored at the
    union of their steps (with a constant learning rate its first 100 steps are the 100-step run's)."""
    merged: dict[tuple, Arm] = {}
    for arm in arms:
        if arm.key not in merged:
            merged[arm.key] = arm
            continue
        have = merged[arm.key]
        merged[arm.key] = Arm(*arm.key, max(have.steps, arm.steps),
                              tuple(sorted(set(have.eval_steps) | set(arm.eval_steps))),
                              tuple(dict.fromkeys(have.parts + arm.parts)))  # fmt: skip
    return list(merged.values())


def plan_arms(a) -> list[Arm]:
    """The runs a command asks for: `--arms` x `--seeds` at `--steps`, and the horizon arms."""
    arms = parse_arms(a.arms, _ints(a.seeds), steps=a.steps)
    if a.horizon_arms:
        every = a.horizon_every or a.horizon_steps
        eval_steps = tuple(range(every, a.horizon_steps + 1, every))
        if not eval_steps or eval_steps[-1] != a.horizon_steps:
            raise SystemExit(f"--horizon-every {every} must divide --horizon-steps {a.horizon_steps}")
        arms += parse_arms(a.horizon_arms, _ints(a.horizon_seeds), steps=a.horizon_steps, eval_steps=eval_steps,
                           part="horizon")  # fmt: skip
    return merge_arms(arms)


def _ints(text: str) -> list[int]:
    return [int(s) for s in str(text).split(",") if s.strip()]


class Runner:
    def __init__(self, args):
        self.a = args
        self.work = Path(args.workdir).resolve()
        self.queue: list[Job] = []
        self.running: list[Job] = []
        self.failed: list[str] = []
        self.port = 29600
        self.last_start = 0.0
        self.gate: Job | None = None  # while set and running, nothing else starts (compile-cache warm-up)
        self.training: set[str] = set()  # arms whose training job is queued or running
        self.sweeps: list[tuple[str, list[tuple[Arm, int]]]] = []  # (label, checkpoints), run one at a time
        self.sweep_busy = False
        self.eval_dirs: dict[tuple[str, int], Path] = {}  # (arm name, step) -> its evaluation directory

    # -- commands -------------------------------------------------------------------------------------------
    def _shim(self, script: str) -> list[str]:
        return [sys.executable, str(ROOT / "bench" / "shared_gpu.py"), str(ROOT / script)]

    def train_argv(self, arm: Arm) -> list[str]:
        a = self.a
        return self._shim("opsd_train.py") + [
            "--model_name_or_path", a.model, "--dataset_name", a.dataset,
            "--output_dir", str(self.work / "arms" / arm.name),
            "--max_steps", str(arm.steps), "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", str(a.problems // 4),
            "--max_completion_length", str(a.max_tokens), "--vllm_max_model_length", "1024",
            "--clip_mode", arm.clip_mode, "--beta", str(arm.beta), "--learning_rate", str(arm.learning_rate),
            "--teacher_ref_pairing", arm.teacher_ref_pairing,
            "--seed", str(arm.seed), "--save_steps", str(arm.save_steps),
            "--probe_steps", str(a.probe_steps), "--probe_size", "16",
            "--gradient_checkpointing", "false", "--logging_steps", "1",
            "--vllm_gpu_memory_utilization", str(a.gpu_share), "--rollout_engine", a.rollout_engine,
        ]  # fmt: skip

    def _eval_flags(self) -> list[str]:
        a = self.a
        argv = ["--model", a.model, "--dataset", a.eval_dataset or a.dataset, "--n", str(a.eval_n),
                "--max-tokens", str(a.max_tokens), "--max-model-len", "1024", "--no-thinking",
                "--engine", a.eval_engine]  # fmt: skip
        return argv + (["--limit", str(a.eval_limit)] if a.eval_limit else [])

    def eval_argv(self, out: Path, adapter: Path | None) -> list[str]:
        argv = self._shim("eval_aime.py") + self._eval_flags() + [
            "--out", str(out), "--gpu-memory-utilization", str(self.a.gpu_share),
        ]  # fmt: skip
        if adapter is not None:
            argv += ["--adapter", str(adapter), "--merge-adapter"]
        return argv

    def sweep_argv(self, checkpoints: list[Path]) -> list[str]:
        return self._shim("eval_aime.py") + self._eval_flags() + [
            "--out", str(self.work / "evals" / SWEEP_DIR), "--gpu-memory-utilization", str(self.a.gpu_share),
            "--merge-adapter", "--checkpoints", *map(str, checkpoints),
        ]  # fmt: skip

    def compare_argv(self, a_dir: Path, b_dir: Path, out: Path) -> list[str]:
        return [sys.executable, str(ROOT / "eval_aime.py"), "--compare", str(a_dir), str(b_dir),
                "--out", str(out)]  # fmt: skip

    def checkpoint(self, arm: Arm, step: int) -> Path:
        return self.work / "arms" / arm.name / f"checkpoint-{step}"

    @property
    def base_dir(self) -> Path:
        return self.work / "evals" / (SWEEP_DIR if self.a.eval_mode == "sweep" else "") / "base"

    # -- scheduling -----------------------------------------------------------------------------------------
    def plan(self, arms: list[Arm]) -> None:
        if self.a.eval_mode == "separate":
            if any(len(arm.eval_steps) > 1 for arm in arms):
                raise SystemExit("scoring several checkpoints of a run needs --eval-mode sweep")
            if not (self.base_dir / "summary.json").is_file():
                self.queue.append(Job("eval-base", self.eval_argv(self.base_dir, None),
                                      self.work / "logs" / "eval-base.log"))  # fmt: skip
            for arm in arms:
                self.eval_dirs[(arm.name, arm.steps)] = self.work / "evals" / arm.name
        else:
            # The horizon sweep lists every checkpoint of the first sweep too, so each checkpoint gets the same
            # result name in both (a sweep makes a name unique against the others it scores); those the first
            # sweep scored are found complete in the shared directory and skipped.
            main = [
                (arm, s) for arm in arms if "main" in arm.parts for s in arm.eval_steps if s <= self.a.steps
            ]
            horizon = [(arm, s) for arm in arms if "horizon" in arm.parts for s in arm.eval_steps]
            horizon = main + [ck for ck in horizon if ck not in main] if horizon else []
            self.sweeps = [(label, cks) for label, cks in (("main", main), ("horizon", horizon)) if cks]
        # Horizon runs first: they are the longest.
        for arm in sorted(arms, key=lambda x: -x.steps):
            self.queue.append(self._train_job(arm))

    def _train_job(self, arm: Arm) -> Job:
        out = self.work / "arms" / arm.name
        final = out / f"checkpoint-{arm.steps}"
        separate = self.a.eval_mode == "separate"
        trained = self.work / "evals" / arm.name

        def after_train():
            self.training.discard(arm.name)
            if not separate:
                return None
            return Job(f"eval-{arm.name}", self.eval_argv(trained, final), self.work / "logs" / f"eval-{arm.name}.log",
                       then=after_eval)  # fmt: skip

        def after_eval():
            return Job(f"compare-{arm.name}", self.compare_argv(self.base_dir, trained, trained / "compare"),
                       self.work / "logs" / f"cmp-{arm.name}.log")  # fmt: skip

        if (final / ".complete").is_file():
            if not separate:
                return None
            if (trained / "summary.json").is_file():
                return after_eval()
            return after_train()
        self.training.add(arm.name)
        return Job(f"train-{arm.name}", self.train_argv(arm), self.work / "logs" / f"train-{arm.name}.log",
                   then=after_train)  # fmt: skip

    def _next_sweep(self) -> Job | None:
        """The next sweep once every checkpoint it scores exists (or its run has stopped for good)."""
        if self.sweep_busy or not self.sweeps:
            return None
        label, cks = self.sweeps[0]
        if any(not (self.checkpoint(arm, s) / ".complete").is_file() and arm.name in self.training
               for arm, s in cks):  # fmt: skip
            return None
        self.sweeps.pop(0)
        ready = [(arm, s) for arm, s in cks if (self.checkpoint(arm, s) / ".complete").is_file()]
        if not ready:  # every run of it failed
            return None
        self.sweep_busy = True

        def after():
            self.sweep_busy = False
            self.read_sweep(ready)

        job = Job(f"sweep-{label}", self.sweep_argv([self.checkpoint(arm, s) for arm, s in ready]),
                  self.work / "logs" / f"sweep-{label}.log", then=after,
                  env={"KV_CACHE_GIB": str(self.a.sweep_kv_gib)})  # fmt: skip
        return job

    def read_sweep(self, ready: list[tuple[Arm, int]]) -> None:
        """Where the sweeps put each checkpoint's evaluation. Every evaluation directory names the checkpoint it
        scored (`adapter` in its eval_config.json), whichever sweep wrote it: sweep.json lists only the last
        sweep's."""
        dirs = {}
        for cfg in sorted((self.work / "evals" / SWEEP_DIR).glob("*/eval_config.json")):
            adapter = json.loads(cfg.read_text()).get("adapter")
            if adapter:
                dirs.setdefault(adapter, cfg.parent)
        for arm, s in ready:
            found = dirs.get(str(self.checkpoint(arm, s)))
            if found is not None:
                self.eval_dirs.setdefault((arm.name, s), found)  # a checkpoint scored twice keeps its first

    def compare_jobs(self, arms: list[Arm]) -> list[Job]:
        """Paired comparisons not yet made: each evaluation against the base (sweeps) and against the matched
        arm of the same mode, seed and step."""
        by_key = {arm.key: arm for arm in arms}
        jobs = []
        for arm in arms:
            for s in arm.eval_steps:
                mine = self.eval_dirs.get((arm.name, s))
                if mine is None or not (mine / "summary.json").is_file():
                    continue
                pairs = []
                if self.a.eval_mode == "sweep":
                    pairs.append(("compare", self.base_dir))
                matched = by_key.get(arm.matched())
                if arm.teacher_ref_pairing != MATCHED and matched is not None:
                    other = self.eval_dirs.get((matched.name, s))
                    if other is not None:
                        pairs.append(("compare-matched", other))
                for sub, a_dir in pairs:
                    if (a_dir / "summary.json").is_file() and not (mine / sub / "compare.json").is_file():
                        jobs.append(Job(f"{sub}-{arm.name}-{s}", self.compare_argv(a_dir, mine, mine / sub),
                                        self.work / "logs" / f"{sub}-{arm.name}-{s}.log"))  # fmt: skip
        return jobs

    def _start(self, job: Job) -> None:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        self.port += 1
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
               "VLLM_HOST_IP": "127.0.0.1", "KV_CACHE_GIB": str(self.a.kv_gib), "PYTHONUNBUFFERED": "1",
               # Many processes share the CPU cores: one intra-op thread each (the work is on the GPU).
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **job.env}  # fmt: skip
        job.attempts += 1
        job.started = time.time()
        with job.log.open("a") as f:
            f.write(f"\n=== attempt {job.attempts}: {' '.join(job.argv)}\n")
        job.proc = subprocess.Popen(
            job.argv, stdout=job.log.open("a"), stderr=subprocess.STDOUT, cwd=ROOT, env=env
        )
        self.last_start = time.time()
        print(f"[{time.strftime('%H:%M:%S')}] start {job.name} (attempt {job.attempts})", flush=True)

    def run(self, on_progress) -> None:
        a = self.a
        self.queue = [j for j in self.queue if j is not None]
        first_train = next((j for j in self.queue if j.name.startswith("train-")), None)
        while self.queue or self.running or self.sweeps:
            for job in list(self.running):
                rc = job.proc.poll()
                if rc is None:
                    continue
                self.running.remove(job)
                job.seconds.append(time.time() - job.started)
                if job is self.gate:
                    self.gate = None
                if rc == 0:
                    print(
                        f"[{time.strftime('%H:%M:%S')}] done {job.name} in {job.seconds[-1]:.0f} s",
                        flush=True,
                    )
                    nxt = job.then() if job.then is not None else None
                    if nxt is not None:
                        self.queue.insert(0, nxt)
                    on_progress()
                elif job.attempts <= a.retries:
                    print(f"[{time.strftime('%H:%M:%S')}] {job.name} failed (rc {rc}); retrying", flush=True)
                    self.queue.append(job)
                else:
                    print(
                        f"[{time.strftime('%H:%M:%S')}] {job.name} failed (rc {rc}); see {job.log}",
                        flush=True,
                    )
                    self.failed.append(job.name)
                    if job.name.startswith("train-"):
                        self.training.discard(job.name.removeprefix("train-"))
                    if job.name.startswith("sweep-"):
                        self.sweep_busy = False
            sweep = self._next_sweep()
            if sweep is not None:
                self.queue.insert(0, sweep)
            gate_open = self.gate is None or self._warm(self.gate)
            while (
                self.queue and gate_open and len(self.running) < a.parallel
                and time.time() - self.last_start >= a.stagger
            ):  # fmt: skip
                job = self.queue.pop(0)
                self._start(job)
                self.running.append(job)
                if job is first_train and a.warmup:
                    self.gate, gate_open = job, False
            if self.running or self.queue:
                time.sleep(a.poll)
            elif self.sweeps and self._next_sweep_blocked():
                break  # nothing left that could make the next sweep ready

    def _next_sweep_blocked(self) -> bool:
        return not self.sweep_busy and not self.training

    def _warm(self, job: Job) -> bool:
        """The gating arm has finished its first step (engine compiled, caches written)."""
        metrics = Path(job.argv[job.argv.index("--output_dir") + 1]) / "metrics.jsonl"
        return any(r.get("step", 0) >= 1 for r in _metrics(metrics))


# -- results ------------------------------------------------------------------------------------------------


def _metrics(path: Path) -> list[dict]:
    """A run's metrics.jsonl records ([] before it exists); unreadable lines are skipped with a warning."""
    return read_step_log(path)


def _summary(path: Path | None) -> dict | None:
    f = None if path is None else path / "summary.json"
    if f is None or not f.is_file():
        return None
    m = json.loads(f.read_text())["metrics"]
    return {
        k: m.get(k)
        for k in ("avg", "avg_se", "format_rate", "format_rate_se", "truncation_rate", "mean_tokens")
    }


def _diff(r: dict) -> dict:
    return {"mean": r["mean_diff"], "se": r["se"], "ci_low": r["ci_low"], "ci_high": r["ci_high"]}


def _compared(path: Path) -> dict:
    """`diff` and `diff_format` of a compare.json, or nothing where there is none."""
    if not path.is_file():
        return {}
    c = json.loads(path.read_text())
    out = {"diff": _diff(c)}
    if "format_rate" in c:
        out["diff_format"] = _diff(c["format_rate"])
    return out


def arm_row(work: Path, arm: Arm, eval_dirs: dict[tuple[str, int], Path], base_dir: Path) -> dict:
    records = _metrics(work / "arms" / arm.name / "metrics.jsonl")
    curves = {key: [[r["step"], r[key]] for r in records if key in r] for key in PROBE_KEYS}
    train = [r for r in records if "loss" in r and "time/step_s" in r]
    row = {
        "name": arm.name, "clip_mode": arm.clip_mode, "beta": arm.beta, "learning_rate": arm.learning_rate,
        "teacher_ref_pairing": arm.teacher_ref_pairing, "seed": arm.seed, "steps": arm.steps,
        "parts": list(arm.parts), "steps_done": max((r["step"] for r in train), default=0),
        "probe_divergence": curves["probe/divergence"], "probe_top1_agree": curves["probe/top1_agree"],
        "probe_teacher_token_logp": curves["probe/teacher_token_logp"],
    }  # fmt: skip
    if train:
        step_s = [r["time/step_s"] for r in train]
        probe_s = [r["time/probe_s"] for r in records if "time/probe_s" in r and r["step"] > 0]

        def first_last(key):
            vals = [r[key] for r in train if key in r]
            return [statistics.mean(vals[:5]), statistics.mean(vals[-5:])] if vals else None

        row["train"] = {
            "median_step_s": statistics.median(step_s),
            "probe_overhead": sum(probe_s) / sum(step_s),
            "loss_first5_last5": first_last("loss"),
            "divergence_first5_last5": first_last("opsd/divergence"),
            "top1_agree_first5_last5": first_last("opsd/top1_agree"),
            "clipped_ratio_first5_last5": first_last("completions/clipped_ratio"),
            "mean_length_first5_last5": first_last("completions/mean_length"),
        }
    base = _summary(base_dir)
    if base:
        row["base"] = {"avg": base["avg"], "format": base["format_rate"], **base}
    evals = []
    for step in arm.eval_steps:
        where = eval_dirs.get((arm.name, step))
        trained = _summary(where)
        if trained is None:
            continue
        entry = {"step": step, "trained": {"avg": trained["avg"], "format": trained["format_rate"], **trained},
                 **_compared(where / "compare" / "compare.json")}  # fmt: skip
        vs_matched = _compared(where / "compare-matched" / "compare.json")
        if vs_matched:
            entry["vs_matched"] = vs_matched
        evals.append(entry)
    if evals:
        row["evals"] = evals
        row.update({k: evals[-1][k] for k in ("trained", "diff", "diff_format") if k in evals[-1]})
    return row


def arm_means(rows: list[dict], step: int | None = None) -> list[dict]:
    """Mean over seeds of each setting's differences, at `step` (None: each row's last evaluation)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["clip_mode"], r["beta"], r["learning_rate"], r.get("teacher_ref_pairing", MATCHED))
        groups.setdefault(key, []).append(r)
    out = []
    for (mode, beta, lr, pairing), rs in groups.items():
        at = [_at(r, step) for r in rs]
        done = [(r, e) for r, e in zip(rs, at, strict=True) if e is not None and "diff" in e]
        entry = {"clip_mode": mode, "beta": beta, "learning_rate": lr, "teacher_ref_pairing": pairing,
                 "step": step, "seeds": [r["seed"] for r, _ in done]}  # fmt: skip
        for key, pick in (("diff", lambda e: e.get("diff")), ("diff_format", lambda e: e.get("diff_format")),
                          ("vs_matched", lambda e: e.get("vs_matched", {}).get("diff")),
                          ("vs_matched_format", lambda e: e.get("vs_matched", {}).get("diff_format"))):  # fmt: skip
            vals = [pick(e)["mean"] for _, e in done if pick(e)]
            if vals:
                entry[f"{key}_mean"] = statistics.mean(vals)
                entry[f"{key}_per_seed"] = vals
        divs = [r["probe_divergence"] for r in rs if len(r["probe_divergence"]) > 1]
        if divs:
            last = [_curve_at(d, step) for d in divs]
            entry["probe_divergence_first_last"] = [
                statistics.mean(d[0][1] for d in divs),
                statistics.mean(last),
            ]
        out.append(entry)
    return out


def _at(row: dict, step: int | None) -> dict | None:
    """The row's evaluation at `step` (its top level for rows without `evals`)."""
    if "evals" not in row:
        return row if "diff" in row else None
    found = [e for e in row["evals"] if step is None or e["step"] == step]
    return found[-1] if found else None


def _curve_at(curve: list, step: int | None) -> float:
    """The curve's value at the last point not past `step`."""
    points = [v for s, v in curve if step is None or s <= step]
    return points[-1] if points else curve[-1][1]


def plot(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    if result.get("config", {}).get("figure") == "controls":
        return [plot_controls(result, out_dir, plt)]
    rows = result["rows"]
    labels = list(dict.fromkeys(_label(r) for r in rows))
    colors = {lab: plt.cm.tab10(i % 10) for i, lab in enumerate(labels)}

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for lab in labels:
        for i, r in enumerate(x for x in rows if _label(x) == lab and x["probe_divergence"]):
            steps, vals = zip(*r["probe_divergence"], strict=True)
            ax.plot(steps, vals, color=colors[lab], alpha=0.85, lw=1.5, label=lab if i == 0 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("probe/divergence (held-out, unclipped)")
    ax.set_title("Student-teacher divergence on held-out problems (one line per seed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    curve = out_dir / "learning_probe_divergence.png"
    fig.savefig(curve, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=False)
    for ax, key, title in ((axes[0], "diff", "accuracy"), (axes[1], "diff_format", "format rate")):
        ys, names = [], []
        for lab in labels:
            for r in (x for x in rows if _label(x) == lab and key in x):
                y = len(ys)
                _interval(ax, r[key], y, colors[lab], "o")
                ys.append(y)
                names.append(f"{lab}, seed {r['seed']}")
        ax.axvline(0, color="grey", lw=1)
        ax.set_yticks(ys, names, fontsize=7)
        ax.set_xlabel(f"trained - base, {title} (points, 95% CI)")
    fig.suptitle("Held-out gain after 100 steps, paired over problems")
    fig.tight_layout()
    gains = out_dir / "learning_gains.png"
    fig.savefig(gains, dpi=120)
    plt.close(fig)
    return [curve, gains]


def _interval(ax, d: dict, y: float, color, marker: str, filled: bool = True) -> None:
    lo, hi = d["ci_low"], d["ci_high"]
    err = [[d["mean"] - lo if lo is not None else 0], [hi - d["mean"] if hi is not None else 0]]
    ax.errorbar(d["mean"], y, xerr=err, fmt=marker, color=color, capsize=3,
                markerfacecolor=color if filled else "white")  # fmt: skip


def plot_controls(result: dict, out_dir: Path, plt) -> Path:
    """docs/controls.png: gains in accuracy and format at the main step (against the base, filled; against the
    matched arm, open), probe divergence of every run, and accuracy against step for the horizon runs."""
    rows, main_step = result["rows"], result["config"]["steps"]
    colors = {p: plt.cm.tab10(i) for i, p in enumerate(TEACHER_REF_PAIRINGS)}
    styles = {"rescale": "-", "element": "--", "token": ":", "none": "-."}
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    main = [r for r in rows if "main" in r.get("parts", ["main"])]
    for ax, key, title in ((axes[0][0], "diff", "accuracy"), (axes[0][1], "diff_format", "format rate")):
        ys, names = [], []
        for r in main:
            e = _at(r, main_step)
            if e is None or key not in e:
                continue
            y = len(ys)
            color = colors[r["teacher_ref_pairing"]]
            _interval(ax, e[key], y, color, "o")
            if key in e.get("vs_matched", {}):
                _interval(ax, e["vs_matched"][key], y + 0.3, color, "s", filled=False)
            ys.append(y)
            names.append(f"{r['clip_mode']} {r['teacher_ref_pairing']}, seed {r['seed']}")
        ax.axvline(0, color="grey", lw=1)
        ax.set_yticks(ys, names, fontsize=7)
        ax.set_xlabel(f"{title} at step {main_step}, points (95% CI)")
    ax = axes[1][0]
    for r in rows:
        if r["probe_divergence"]:
            steps, vals = zip(*r["probe_divergence"], strict=True)
            ax.plot(steps, vals, color=colors[r["teacher_ref_pairing"]], ls=styles.get(r["clip_mode"], "-"),
                    lw=1.3, alpha=0.85, label=f"{r['clip_mode']} {r['teacher_ref_pairing']} s{r['seed']}")  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("probe/divergence (to the run's own teacher)")
    ax.legend(fontsize=6, ncol=2)
    ax = axes[1][1]
    for i, r in enumerate(x for x in rows if "horizon" in x.get("parts", [])):
        for key, marker, what in (("diff", "o", "accuracy"), ("diff_format", "s", "format")):
            points = [(0, 0.0, 0.0, 0.0)] + [
                (e["step"], e[key]["mean"], _or(e[key]["ci_low"], e[key]["mean"]),
                 _or(e[key]["ci_high"], e[key]["mean"])) for e in r.get("evals", []) if key in e
            ]  # fmt: skip
            s, m, lo, hi = zip(*points, strict=True)
            color = plt.cm.Dark2(2 * i + (key == "diff_format"))
            ax.plot(s, m, marker=marker, color=color, ls=styles.get(r["clip_mode"], "-"),
                    label=f"{r['clip_mode']} s{r['seed']}, {what}")  # fmt: skip
            ax.fill_between(s, lo, hi, color=color, alpha=0.12)
    ax.axhline(0, color="grey", lw=1)
    ax.set_xlabel("optimizer step (matched reference; 0 = base)")
    ax.set_ylabel("trained - base, points (95% CI)")
    ax.legend(fontsize=8)
    dataset = result["config"].get("eval_dataset") or result["config"].get("dataset")
    fig.suptitle(f"Reference controls, held-out {dataset}, paired over problems; "
                 "top: trained − base (filled), − matched arm (open)")  # fmt: skip
    fig.tight_layout()
    path = out_dir / "controls.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _or(value, default):
    return default if value is None else value


def _label(row: dict) -> str:
    label = f"{row['clip_mode']}, β={row['beta']:g}, lr={row['learning_rate']:g}"
    pairing = row.get("teacher_ref_pairing", MATCHED)
    return label if pairing == MATCHED else f"{label}, {pairing}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="learning", choices=list(PRESETS))
    p.add_argument(
        "--out", default=None, help="Result JSON (preset: learning_h200.json / controls_h200.json)."
    )
    p.add_argument("--plot", default="", help="Only redraw the figures from this JSON.")
    p.add_argument("--plot-dir", default=str(ROOT / "docs"))
    p.add_argument("--workdir", default=None, help="Runs, evaluations and logs (preset: runs/<preset>).")
    p.add_argument("--model", default="", help="Empty = the embedded SmolLM2-135M-Instruct.")
    p.add_argument("--dataset", default="builtin:easy", help="Training problems.")
    p.add_argument("--eval-dataset", default=None, help="Held-out problems; empty = --dataset's.")
    p.add_argument("--arms", default=None, help="clip_mode:beta:learning_rate[:teacher_ref_pairing],...")
    p.add_argument("--seeds", default=None)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--horizon-arms", default=None, help="Arms run to --horizon-steps ('' = none).")
    p.add_argument("--horizon-seeds", default="42")
    p.add_argument("--horizon-steps", type=int, default=300)
    p.add_argument("--horizon-every", type=int, default=100, help="Score the horizon runs every N steps.")
    p.add_argument("--problems", type=int, default=32, help="Problems per step (4 per micro-batch).")
    p.add_argument("--max-tokens", type=int, default=128, help="Rollout and evaluation length cap.")
    p.add_argument("--probe-steps", type=int, default=10)
    p.add_argument("--eval-n", type=int, default=8)
    p.add_argument("--eval-limit", type=int, default=0, help="Score only the first N held-out problems.")
    p.add_argument("--eval-mode", default=None, choices=["separate", "sweep"],
                   help="separate: one eval_aime.py per final checkpoint; sweep: one engine for all.")  # fmt: skip
    p.add_argument("--parallel", type=int, default=16, help="Processes on the GPU at once.")
    p.add_argument("--stagger", type=float, default=5.0, help="Seconds between process starts.")
    p.add_argument(
        "--warmup", type=int, default=1, help="1 = the first arm starts alone until its first step."
    )
    p.add_argument("--gpu-share", type=float, default=0.12, help="vLLM memory share where no fixed KV cache.")
    p.add_argument(
        "--kv-gib", type=float, default=1.5, help="Fixed KV cache per vLLM engine (0 = vLLM's own)."
    )
    p.add_argument("--sweep-kv-gib", type=float, default=8.0, help="Fixed KV cache of a sweep's engine.")
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--rollout-engine", default="vllm")
    p.add_argument("--eval-engine", default="vllm")
    p.add_argument("--poll", type=float, default=2.0, help="Seconds between looks at the processes.")
    p.add_argument(
        "--compare-only", action="store_true",
        help="Train and evaluate nothing: make the missing paired comparisons, then the JSON and the figures, "
        "from the evaluations in --workdir (say, one copied off the GPU machine at the same path). The JSON "
        "keeps the machine and wall time of the --out it updates and names this host under compared_on.",
    )  # fmt: skip
    a = p.parse_args(argv)
    preset = PRESETS[a.preset]
    for key in ("out", "workdir", "arms", "seeds", "horizon_arms", "eval_dataset", "eval_mode"):
        if getattr(a, key) is None:
            setattr(a, key, preset[key])
    a.figure = preset["figure"]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.plot:
        for path in plot(json.loads(Path(a.plot).read_text()), Path(a.plot_dir)):
            print(path)
        return 0

    t0 = time.time()
    arms = plan_arms(a)
    runner = Runner(a)
    runner.plan(arms)
    config = {k: v for k, v in vars(a).items() if k not in ("plot", "compare_only")}
    earlier = {}
    if a.compare_only:
        runner.queue, runner.training = [], set()
        if a.eval_mode == "sweep":
            runner.sweeps = []
            runner.read_sweep([(arm, s) for arm in arms for s in arm.eval_steps])
        if Path(a.out).is_file():
            earlier = json.loads(Path(a.out).read_text())
            config = earlier.get("config", config)

    def collect() -> dict:
        rows = [arm_row(runner.work, arm, runner.eval_dirs, runner.base_dir) for arm in arms]
        result = {
            "machine": earlier.get("machine") or machine(), "config": config, "rows": rows,
            "arms": arm_means(rows, a.steps if a.figure == "controls" else None),
            "wall_s": earlier.get("wall_s", time.time() - t0), "failed": runner.failed,
        }  # fmt: skip
        if a.compare_only:
            result["compared_on"] = machine()
        if a.figure == "controls":
            result["horizon"] = [m for s in range(a.horizon_every, a.horizon_steps + 1, a.horizon_every or 1)
                                 for m in arm_means([r for r in rows if "horizon" in r["parts"]], s)]  # fmt: skip
        write(result, a.out)
        return result

    runner.run(collect)
    runner.queue = runner.compare_jobs(arms)  # the paired comparisons, once their evaluations exist
    runner.run(collect)
    result = collect()
    for path in plot(result, Path(a.plot_dir)):
        print(path)
    print(json.dumps(result["arms"], indent=1))
    return 1 if runner.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
