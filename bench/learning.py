"""Benchmark: does OPSD make the embedded model better, and which clip mode does it?

    python bench/learning.py --out bench/results/learning_h200.json            # one GPU, every arm side by side
    python bench/learning.py --plot bench/results/learning_h200.json           # the figures again, from the JSON

Each arm is a real `opsd_train.py` run on the embedded SmolLM2-135M-Instruct and the `builtin:easy` problems
(100 steps x 32 problems, one rollout each, LoRA r64 and every other setting as published) that differs
only in `clip_mode`, `beta`, `learning_rate` and `seed`. The base model and every arm's final checkpoint are
scored with `eval_aime.py` on the held-out `builtin:easy` problems (n samples each, same sampling seeds, so
the comparison is paired) and compared with `eval_aime.py --compare`. The probe curves (`probe/divergence`,
`probe/top1_agree`, `probe/teacher_token_logp`) come from each run's metrics.jsonl.

All processes share one GPU: each gets its own MASTER_PORT, and `bench/shared_gpu.py` gives every vLLM
engine a fixed KV cache (`--kv-gib`) so that engines starting side by side skip vLLM's start-up memory
profile. The first arm starts alone (it fills the compile cache the others reuse). A failed process is
retried (`--retries`); training resumes from its last checkpoint and evaluation from its samples, so a
rerun of the whole command also continues where it stopped. The JSON is rewritten as arms finish.

Output: `{"machine", "config", "rows": [one per arm and seed], "arms": [mean over seeds], "wall_s"}` and
two PNGs (`--plot-dir`): probe divergence against step, one line per arm, and each arm's gains with 95% CIs.
"""

from __future__ import annotations

import argparse
import json
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

# clip_mode:beta:learning_rate. The four clip modes at the published beta = 0, beta = 0.5 with the two modes
# that keep a gradient on every token, and the published mode at a ten times smaller learning rate.
DEFAULT_ARMS = (
    "element:0:1e-4,token:0:1e-4,rescale:0:1e-4,none:0:1e-4,none:0.5:1e-4,rescale:0.5:1e-4,element:0:1e-5"
)
PROBE_KEYS = ("probe/divergence", "probe/top1_agree", "probe/teacher_token_logp")


@dataclass
class Arm:
    clip_mode: str
    beta: float
    learning_rate: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.clip_mode}-b{self.beta:g}-lr{self.learning_rate:g}-s{self.seed}"


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


def parse_arms(spec: str, seeds: list[int]) -> list[Arm]:
    arms = []
    for item in spec.split(","):
        mode, beta, lr = item.strip().split(":")
        arms += [Arm(mode, float(beta), float(lr), s) for s in seeds]
    return arms


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

    # -- commands -------------------------------------------------------------------------------------------
    def _shim(self, script: str) -> list[str]:
        return [sys.executable, str(ROOT / "bench" / "shared_gpu.py"), str(ROOT / script)]

    def train_argv(self, arm: Arm) -> list[str]:
        a = self.a
        return self._shim("opsd_train.py") + [
            "--model_name_or_path", a.model, "--dataset_name", a.dataset,
            "--output_dir", str(self.work / "arms" / arm.name),
            "--max_steps", str(a.steps), "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", str(a.problems // 4),
            "--max_completion_length", str(a.max_tokens), "--vllm_max_model_length", "1024",
            "--clip_mode", arm.clip_mode, "--beta", str(arm.beta), "--learning_rate", str(arm.learning_rate),
            "--seed", str(arm.seed), "--save_steps", str(max(a.steps // 2, 1)),
            "--probe_steps", str(a.probe_steps), "--probe_size", "16",
            "--gradient_checkpointing", "false", "--logging_steps", "1",
            "--vllm_gpu_memory_utilization", str(a.gpu_share), "--rollout_engine", a.rollout_engine,
        ]  # fmt: skip

    def eval_argv(self, out: Path, adapter: Path | None) -> list[str]:
        a = self.a
        argv = self._shim("eval_aime.py") + [
            "--model", a.model, "--dataset", a.dataset, "--n", str(a.eval_n), "--max-tokens", str(a.max_tokens),
            "--max-model-len", "1024", "--no-thinking", "--out", str(out), "--engine", a.eval_engine,
            "--gpu-memory-utilization", str(a.gpu_share),
        ]  # fmt: skip
        if a.eval_limit:
            argv += ["--limit", str(a.eval_limit)]
        if adapter is not None:
            argv += ["--adapter", str(adapter), "--merge-adapter"]
        return argv

    def compare_argv(self, trained: Path) -> list[str]:
        base = self.work / "evals" / "base"
        return [sys.executable, str(ROOT / "eval_aime.py"), "--compare", str(base), str(trained),
                "--out", str(trained / "compare")]  # fmt: skip

    # -- scheduling -----------------------------------------------------------------------------------------
    def plan(self, arms: list[Arm]) -> None:
        base = self.work / "evals" / "base"
        if not (base / "summary.json").is_file():
            self.queue.append(
                Job("eval-base", self.eval_argv(base, None), self.work / "logs" / "eval-base.log")
            )
        for arm in arms:
            self.queue.append(self._train_job(arm))

    def _train_job(self, arm: Arm) -> Job:
        out = self.work / "arms" / arm.name
        trained = self.work / "evals" / arm.name
        final = out / f"checkpoint-{self.a.steps}"

        def after_train():
            return Job(f"eval-{arm.name}", self.eval_argv(trained, final), self.work / "logs" / f"eval-{arm.name}.log",
                       then=after_eval)  # fmt: skip

        def after_eval():
            return Job(
                f"compare-{arm.name}", self.compare_argv(trained), self.work / "logs" / f"cmp-{arm.name}.log"
            )

        if (final / ".complete").is_file():
            if (trained / "summary.json").is_file():
                return after_eval()
            return after_train()
        return Job(f"train-{arm.name}", self.train_argv(arm), self.work / "logs" / f"train-{arm.name}.log",
                   then=after_train)  # fmt: skip

    def _start(self, job: Job) -> None:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        self.port += 1
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
               "VLLM_HOST_IP": "127.0.0.1", "KV_CACHE_GIB": str(self.a.kv_gib), "PYTHONUNBUFFERED": "1",
               # Many processes share the CPU cores: one intra-op thread each (the work is on the GPU).
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # fmt: skip
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
        first_train = next((j for j in self.queue if j.name.startswith("train-")), None)
        while self.queue or self.running:
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
                    if job.then is not None:
                        self.queue.insert(0, job.then())
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
            time.sleep(2)

    def _warm(self, job: Job) -> bool:
        """The gating arm has finished its first step (engine compiled, caches written)."""
        metrics = Path(job.argv[job.argv.index("--output_dir") + 1]) / "metrics.jsonl"
        return any(r.get("step", 0) >= 1 for r in _metrics(metrics))


# -- results ------------------------------------------------------------------------------------------------


def _metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _summary(path: Path) -> dict | None:
    f = path / "summary.json"
    if not f.is_file():
        return None
    m = json.loads(f.read_text())["metrics"]
    return {
        k: m.get(k)
        for k in ("avg", "avg_se", "format_rate", "format_rate_se", "truncation_rate", "mean_tokens")
    }


def _diff(r: dict) -> dict:
    return {"mean": r["mean_diff"], "se": r["se"], "ci_low": r["ci_low"], "ci_high": r["ci_high"]}


def arm_row(work: Path, arm: Arm) -> dict:
    records = _metrics(work / "arms" / arm.name / "metrics.jsonl")
    curves = {key: [[r["step"], r[key]] for r in records if key in r] for key in PROBE_KEYS}
    train = [r for r in records if "loss" in r and "time/step_s" in r]
    row = {
        "name": arm.name, "clip_mode": arm.clip_mode, "beta": arm.beta, "learning_rate": arm.learning_rate,
        "seed": arm.seed, "steps_done": max((r["step"] for r in train), default=0),
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
    base, trained = _summary(work / "evals" / "base"), _summary(work / "evals" / arm.name)
    if base:
        row["base"] = {"avg": base["avg"], "format": base["format_rate"], **base}
    if trained:
        row["trained"] = {"avg": trained["avg"], "format": trained["format_rate"], **trained}
    cmp = work / "evals" / arm.name / "compare" / "compare.json"
    if cmp.is_file():
        c = json.loads(cmp.read_text())
        row["diff"] = _diff(c)
        if "format_rate" in c:
            row["diff_format"] = _diff(c["format_rate"])
    return row


def arm_means(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["clip_mode"], r["beta"], r["learning_rate"]), []).append(r)
    out = []
    for (mode, beta, lr), rs in groups.items():
        done = [r for r in rs if "diff" in r]
        entry = {"clip_mode": mode, "beta": beta, "learning_rate": lr, "seeds": [r["seed"] for r in done]}
        for key in ("diff", "diff_format"):
            vals = [r[key]["mean"] for r in done if key in r]
            if vals:
                entry[f"{key}_mean"] = statistics.mean(vals)
                entry[f"{key}_per_seed"] = vals
        divs = [r["probe_divergence"] for r in rs if len(r["probe_divergence"]) > 1]
        if divs:
            entry["probe_divergence_first_last"] = [
                statistics.mean(d[0][1] for d in divs),
                statistics.mean(d[-1][1] for d in divs),
            ]
        out.append(entry)
    return out


def plot(result: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
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
                d = r[key]
                lo, hi = d["ci_low"], d["ci_high"]
                err = [[d["mean"] - lo if lo is not None else 0], [hi - d["mean"] if hi is not None else 0]]
                y = len(ys)
                ax.errorbar(d["mean"], y, xerr=err, fmt="o", color=colors[lab], capsize=3)
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


def _label(row: dict) -> str:
    return f"{row['clip_mode']}, β={row['beta']:g}, lr={row['learning_rate']:g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/learning_h200.json")
    p.add_argument("--plot", default="", help="Only redraw the figures from this JSON.")
    p.add_argument("--plot-dir", default=str(ROOT / "docs"))
    p.add_argument("--workdir", default="runs/learning")
    p.add_argument("--model", default="", help="Empty = the embedded SmolLM2-135M-Instruct.")
    p.add_argument("--dataset", default="builtin:easy")
    p.add_argument("--arms", default=DEFAULT_ARMS, help="clip_mode:beta:learning_rate,...")
    p.add_argument("--seeds", default="42,43")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--problems", type=int, default=32, help="Problems per step (4 per micro-batch).")
    p.add_argument("--max-tokens", type=int, default=128, help="Rollout and evaluation length cap.")
    p.add_argument("--probe-steps", type=int, default=10)
    p.add_argument("--eval-n", type=int, default=8)
    p.add_argument("--eval-limit", type=int, default=0)
    p.add_argument("--parallel", type=int, default=16, help="Processes on the GPU at once.")
    p.add_argument("--stagger", type=float, default=5.0, help="Seconds between process starts.")
    p.add_argument(
        "--warmup", type=int, default=1, help="1 = the first arm starts alone until its first step."
    )
    p.add_argument("--gpu-share", type=float, default=0.12, help="vLLM memory share where no fixed KV cache.")
    p.add_argument(
        "--kv-gib", type=float, default=1.5, help="Fixed KV cache per vLLM engine (0 = vLLM's own)."
    )
    p.add_argument("--retries", type=int, default=2)
    p.add_argument("--rollout-engine", default="vllm")
    p.add_argument("--eval-engine", default="vllm")
    a = p.parse_args(argv)
    if a.plot:
        for path in plot(json.loads(Path(a.plot).read_text()), Path(a.plot_dir)):
            print(path)
        return 0

    t0 = time.time()
    arms = parse_arms(a.arms, [int(s) for s in a.seeds.split(",")])
    runner = Runner(a)
    runner.plan(arms)
    config = {k: v for k, v in vars(a).items() if k not in ("plot",)}

    def collect() -> dict:
        rows = [arm_row(runner.work, arm) for arm in arms]
        result = {
            "machine": machine(), "config": config, "rows": rows, "arms": arm_means(rows),
            "wall_s": time.time() - t0, "failed": runner.failed,
        }  # fmt: skip
        write(result, a.out)
        return result

    runner.run(collect)
    result = collect()
    for path in plot(result, Path(a.plot_dir)):
        print(path)
    print(json.dumps(result["arms"], indent=1))
    return 1 if runner.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
