"""Benchmark: the capped run end to end on N GPUs, `train_capped.sh` then `eval_aime.py`.

    python bench/capped_run.py --num-gpus 2 --work /tmp/capped --out bench/results/capped_2gpu_h200.json

Trains with the harness exactly as a user would (`train_capped.sh --num-gpus N`, its accelerate config and
`recipe.env`) on a random-weight Qwen3-1.7B (bench/common.py) and the built-in data, then scores
checkpoint-100 with `eval_aime.py --num_gpus N` on the built-in evaluation set. Recorded in one JSON:
- wall time of the whole harness call (model load and vLLM start included) and of every step;
- the per-step split by phase from metrics.jsonl (rank 0: rollout, weight sync, scoring+loss+backward,
  optimizer), medians over steps 2..100 (step 1 pays for compilation and CUDA graphs);
- peak memory per GPU polled with nvidia-smi every second (everything the GPU holds: colocated vLLM plus
  training), and rank 0's torch peak from the trainer;
- the evaluation's wall time, tokens/s and metrics (meaningless on random weights: 0% is expected).

Rerunning the same command resumes an interrupted training (the harness does) and evaluation (eval_aime
does). `--fallback-config` names an accelerate config to retry with when the default one fails before its
first checkpoint (e.g. DDP where DeepSpeed is missing); the JSON lists every attempt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import STEP_METRICS, machine, qwen3_1p7b_dir, write
from opsd.rundir import latest_complete_checkpoint, read_step_log

ROOT = Path(__file__).resolve().parents[1]


class GPUMemoryPoller:
    """Highest `memory.used` per GPU seen by nvidia-smi while running (GiB); empty without nvidia-smi."""

    def __init__(self, every_s: float = 1.0):
        self.every_s = every_s
        self.peak_gib: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _read(self) -> dict[int, float]:
        cmd = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return {}
        used = {}
        for line in out.strip().splitlines():
            idx, mib = (x.strip() for x in line.split(","))
            used[int(idx)] = float(mib) / 1024
        return used

    def _run(self):
        while not self._stop.is_set():
            for gpu, gib in self._read().items():
                self.peak_gib[gpu] = max(gib, self.peak_gib.get(gpu, 0.0))
            self._stop.wait(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def timed(cmd: list[str], log: Path, env: dict | None = None) -> tuple[int, float, dict[int, float]]:
    """Run `cmd` with output appended to `log`; (exit code, wall seconds, peak GiB per GPU)."""
    print("+", " ".join(cmd), flush=True)
    with open(log, "a") as f, GPUMemoryPoller() as mem:
        t0 = time.perf_counter()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
        wall = time.perf_counter() - t0
    return rc, wall, dict(sorted(mem.peak_gib.items()))


def step_stats(metrics_path: Path) -> dict:
    """Per-step records of metrics.jsonl summarised: times per step and medians of each phase after step 1."""
    steps = {}
    for rec in read_step_log(metrics_path):  # unreadable lines are skipped with a warning naming them
        if "time/step_s" in rec:
            steps[rec["step"]] = rec
    ordered = [steps[k] for k in sorted(steps)]
    later = ordered[1:] or ordered

    def med(key, recs):
        vals = [r[key] for r in recs if key in r]
        return statistics.median(vals) if vals else None

    step_s = [r["time/step_s"] for r in ordered]
    return {
        "steps_logged": len(ordered),
        "step_s": step_s,
        "step1_s": step_s[0] if step_s else None,
        "sum_step_s": sum(step_s),
        "median_after_step1": {k: med(k, later) for k in STEP_METRICS},
        "mean_step_s_after_step1": statistics.fmean(r["time/step_s"] for r in later) if later else None,
        "max_memory_peak_gib_rank0": max((r.get("memory/peak_gib", 0.0) for r in ordered), default=None),
        "loss_first_last": [ordered[0].get("loss"), ordered[-1].get("loss")] if ordered else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-gpus", type=int, default=2)
    ap.add_argument("--work", default="/tmp/capped", help="model, runs, logs and eval results go here")
    ap.add_argument(
        "--model", default="", help="model directory (default: random Qwen3-1.7B built in --work)"
    )
    ap.add_argument("--profile", default="full", help="train_capped.sh profile (full on GPUs)")
    ap.add_argument("--fallback-config", default="", help="accelerate config to retry with (see above)")
    ap.add_argument("--eval-max-tokens", type=int, default=2048)
    ap.add_argument("--eval-n", type=int, default=12)
    ap.add_argument("--eval-chunk-size", type=int, default=15, help="problems per generate call per worker")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--out", default="bench/results/capped_run.json")
    a = ap.parse_args()

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = a.model or str(qwen3_1p7b_dir(work / "qwen3-1.7b-random"))
    build_s = time.perf_counter() - t0
    runs = work / "runs"
    base = [
        "bash", str(ROOT / "train_capped.sh"), "--num-gpus", str(a.num_gpus), "--model", model,
        "--dataset", "builtin", "--runs-dir", str(runs), "--name", "bench", "--profile", a.profile,
    ]  # fmt: skip
    plan = json.loads(subprocess.run(base + ["--dry-run"], capture_output=True, text=True, check=True).stdout)
    out_dir = Path(plan["output_dir"])
    result = {
        "benchmark": "capped_run",
        "machine": machine(),
        "config": {
            "num_gpus": a.num_gpus,
            "model": model if a.model else "random-weight Qwen3-1.7B shape (bf16), bench/common.py",
            "dataset": "builtin",
            "plan": {k: plan[k] for k in ("budget", "accelerate_config", "overrides", "shell")},
        },
        "model_build_s": build_s,
        "attempts": [],
    }

    configs = [None] + ([a.fallback_config] if a.fallback_config else [])
    for cfg in configs:
        cmd = base + (["--accelerate-config", cfg] if cfg else [])
        resumed_from = latest_complete_checkpoint(out_dir)
        rc, wall, peak = timed(cmd, work / "train.log")
        attempt = {
            "accelerate_config": cfg or plan["accelerate_config"],
            "exit_code": rc,
            "wall_s": wall,
            "resumed_from": str(resumed_from) if resumed_from else None,
            "peak_gib_per_gpu_nvidia_smi": peak,
        }
        result["attempts"].append(attempt)
        write(result, a.out)
        if rc == 0 or latest_complete_checkpoint(out_dir) is not None:
            break  # success, or a failure after a checkpoint: rerunning resumes, a new config would not

    final = Path(plan["final_checkpoint"])
    if (out_dir / "metrics.jsonl").is_file():
        result["train"] = step_stats(out_dir / "metrics.jsonl")
    result["train_complete"] = (final / ".complete").is_file()
    write(result, a.out)
    if not result["train_complete"]:
        sys.exit(f"training did not reach {final}; see {work / 'train.log'}")
    if a.skip_eval:
        return

    ev_out = work / "eval"
    ev = [
        sys.executable, str(ROOT / "eval_aime.py"), "--model", model, "--adapter", str(final),
        "--dataset", "builtin", "--num_gpus", str(a.num_gpus), "--n", str(a.eval_n),
        "--max_tokens", str(a.eval_max_tokens), "--chunk_size", str(a.eval_chunk_size), "--out", str(ev_out),
    ]  # fmt: skip
    rc, wall, peak = timed(ev, work / "eval.log", env={**os.environ, "PYTHONUNBUFFERED": "1"})
    result["eval"] = {
        "command": " ".join(ev),
        "exit_code": rc,
        "wall_s": wall,
        "peak_gib_per_gpu_nvidia_smi": peak,
    }
    summary = ev_out / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text())
        metrics = {k: v for k, v in s["metrics"].items() if k != "problems"}
        timing = {k: v for k, v in s.items() if k not in ("config", "versions", "metrics")}
        result["eval"]["summary"] = {**timing, "metrics": metrics}
    write(result, a.out)
    print(json.dumps(result, indent=1))
    if rc != 0:
        sys.exit(f"evaluation failed (exit {rc}); see {work / 'eval.log'}")


if __name__ == "__main__":
    main()
