"""Benchmark: does `compile_layers` pay over a whole capped run? 100 steps eager against 100 steps compiled.

    python bench/compile_run.py --out bench/results/compile_run_h200.json              # one GPU, one arm after the other
    python bench/compile_run.py --parallel --out bench/results/compile_run_h200x2.json # two GPUs, both arms at once

Each arm is `train_capped.sh --num-gpus 1` as a user runs it (recipe.env, micro_batch_size=auto, a checkpoint every
10 steps) on a random-weight Qwen3-1.7B and the built-in problems, with `OPSD_COMPILE_LAYERS` false or true, and
completions of whatever length the model samples up to the recipe's cap (no min_tokens), so sequence widths
change from micro-batch to micro-batch as in training. Recorded per arm:
- wall time of the whole harness call (model load, engine start, compile and checkpoints included) and the sum
  of the logged step times;
- warm-up: the first 10 steps' time above the median step of steps 11..100;
- compiled graphs after each step (`compile/graphs`, the compiled arm) and the steps where the count grew:
  recompilations, e.g. at a sequence width never seen before;
- the phase split (median after step 1) as bench/capped_run.py records it.
`decision` says whether the compiled arm's whole run took less wall time than the eager arm's in this run.
With --parallel the two arms run at the same time on GPUs 0 and 1 of one machine (they share its CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from capped_run import step_stats, timed
from common import machine, qwen3_1p7b_dir, write
from opsd.rundir import read_step_log

ROOT = Path(__file__).resolve().parents[1]
ARMS = {"eager": "false", "compiled": "true"}
WARMUP_STEPS = 10


def graphs_per_step(metrics_path: Path) -> dict:
    steps = {r["step"]: r["compile/graphs"] for r in read_step_log(metrics_path) if "compile/graphs" in r}
    counts = [steps[k] for k in sorted(steps)]
    grew = [k for k, before in zip(sorted(steps)[1:], counts, strict=False) if steps[k] > before]
    return {"graphs": counts, "final_graphs": counts[-1] if counts else None, "steps_that_recompiled": grew}


def warmup_s(step_s: list[float]) -> float | None:
    if len(step_s) <= WARMUP_STEPS:
        return None
    steady = statistics.median(step_s[WARMUP_STEPS:])
    return round(sum(max(0.0, s - steady) for s in step_s[:WARMUP_STEPS]), 2)


def run_arm(arm: str, model: str, work: Path, gpu: str | None, profile: str = "full") -> dict:
    runs = work / "runs"
    cmd = [
        "bash", str(ROOT / "train_capped.sh"), "--model", model, "--dataset", "builtin",
        "--runs-dir", str(runs), "--name", arm, "--profile", profile,
    ]  # fmt: skip
    if profile == "full":
        cmd += ["--num-gpus", "1"]
    env = {**os.environ, "OPSD_COMPILE_LAYERS": ARMS[arm], "PYTHONUNBUFFERED": "1"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    plan = json.loads(
        subprocess.run(cmd + ["--dry-run"], capture_output=True, text=True, check=True, env=env).stdout
    )
    rc, wall, peak = timed(cmd, work / f"{arm}.log", env=env)
    out_dir = Path(plan["output_dir"])
    row = {"arm": arm, "gpu": gpu, "exit_code": rc, "wall_s": round(wall, 1), "peak_gib_nvidia_smi": peak,
           "budget": plan["budget"]}  # fmt: skip
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file():
        row["train"] = step_stats(metrics)
        row["warmup_s"] = warmup_s(row["train"]["step_s"])
        row["compile"] = graphs_per_step(metrics)
    return row


def decide(rows: dict) -> dict:
    eager, compiled = rows.get("eager"), rows.get("compiled")
    if not eager or not compiled or eager["exit_code"] or compiled["exit_code"]:
        return {"compile_pays": None, "why": "an arm did not finish"}
    ratio = compiled["wall_s"] / eager["wall_s"]
    return {"compile_pays": ratio < 1.0, "wall_ratio_compiled_over_eager": round(ratio, 3),
            "sum_step_ratio": round(compiled["train"]["sum_step_s"] / eager["train"]["sum_step_s"], 3)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/compile-run")
    ap.add_argument(
        "--model", default="", help="model directory (default: random Qwen3-1.7B built in --work)"
    )
    ap.add_argument("--parallel", action="store_true", help="both arms at once, on GPUs 0 and 1")
    ap.add_argument(
        "--profile", default="full", help="train_capped.sh profile (smoke: a CPU check of the script)"
    )
    ap.add_argument("--out", default="bench/results/compile_run.json")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model = a.model or str(qwen3_1p7b_dir(work / "qwen3-1.7b-random"))
    result = {
        "benchmark": "compile_run",
        "machine": machine(),
        "config": {
            "model": "random-weight Qwen3-1.7B shape (bf16)" if not a.model else model,
            "dataset": "builtin",
            "harness": "train_capped.sh --num-gpus 1, recipe.env",
            "parallel": a.parallel,
        },  # fmt: skip
        "arms": {},
    }
    if a.parallel:
        with ThreadPoolExecutor(2) as pool:
            futures = {
                arm: pool.submit(run_arm, arm, model, work, str(i), a.profile) for i, arm in enumerate(ARMS)
            }
            result["arms"] = {arm: f.result() for arm, f in futures.items()}
    else:
        for arm in ARMS:
            result["arms"][arm] = run_arm(arm, model, work, None, a.profile)
            write(result, a.out)
    result["decision"] = decide(result["arms"])
    write(result, a.out)
    print(json.dumps(result["decision"]))


if __name__ == "__main__":
    main()
