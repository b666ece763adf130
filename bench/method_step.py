"""Benchmark: what one optimizer step of each method costs, in tokens and seconds (the compute ledger), one run
after the other on one machine.

    python bench/method_step.py --out bench/results/rl_step_cost_h100.json
    python bench/method_step.py --out X.json --steps 4 --max-completion-length 64    # a CPU smoke of the same
    python bench/method_step.py --methods grpo,hybrid,hybrid_two_forwards --out bench/results/hybrid_step_h100.json
    python bench/method_step.py --methods grpo,hybrid,hybrid_two_forwards --problems 4 --steps 4 \
        --max-completion-length 32 --out bench/results/hybrid_step_cpu.json               # the same on a CPU

Each method trains the embedded SmolLM2-135M-Instruct on `builtin:easy` for `--steps` optimizer steps of 32
problems (one process: per-device 8 x accumulation 4), 128-token rollouts, learning rate 1e-4, colocated vLLM at
0.3 of the GPU: `opsd` (clip_mode=rescale, one rollout per problem), `grpo` (TRL's GRPO, 4 rollouts per problem)
and `hybrid` (GRPO + 1 x OPSD's loss on the same 4 rollouts, clip_mode=rescale, one student forward for both
terms); `hybrid_group` and `hybrid_sample` are the routed hybrids, and `hybrid_two_forwards` the hybrid with
`fix_position_ids=false`, whose two terms lay out their rows differently, so it runs the student forward twice as
every hybrid did before the shared forward. Each run's ledger.jsonl rows are kept whole; the summary is the median
of steps 2..N (step 1 pays the engine's first batch). `--problems` sets the problems per step (per-device
problems x accumulation 4; a CPU can take 4).

Output: {"machine", "config", "arms": {method: {"rows", "median", "rollout_correct", "rollout_length",
"wall_s"}}, "ratios": {method: its median step_s / the first method's}, "vs_grpo": {method: its median step_s /
grpo's, where grpo ran}}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine, write

ROOT = Path(__file__).resolve().parents[1]
METHODS = {
    "opsd": ["--clip_mode", "rescale"],
    "grpo": ["--method", "grpo", "--num_generations", "4"],
    "hybrid": ["--method", "hybrid", "--num_generations", "4", "--clip_mode", "rescale"],
    "hybrid_group": ["--method", "hybrid", "--num_generations", "4", "--clip_mode", "rescale", "--hybrid_route",
                     "group"],
    "hybrid_sample": ["--method", "hybrid", "--num_generations", "4", "--clip_mode", "rescale", "--hybrid_route",
                      "sample"],
    "hybrid_two_forwards": ["--method", "hybrid", "--num_generations", "4", "--clip_mode", "rescale",
                            "--fix_position_ids", "false"],
}  # fmt: skip
SUMMARY = ("step_s", "rollout_s", "weight_sync_s", "train_micro_s", "gpu_s", "generated_tokens", "teacher_tokens",
           "trained_tokens")  # fmt: skip


def run_method(name: str, a: argparse.Namespace, work: Path) -> dict:
    out = work / name
    cmd = [
        sys.executable, str(ROOT / "opsd_train.py"), "--model_name_or_path", "embedded", "--dataset_name",
        "builtin:easy", "--max_steps", str(a.steps), "--per_device_train_batch_size", str(a.problems // 4),
        "--gradient_accumulation_steps", "4", "--max_completion_length", str(a.max_completion_length),
        "--learning_rate", "1e-4", "--probe_steps", "0", "--save_steps", "1000", "--seed", "42",
        "--vllm_gpu_memory_utilization", "0.3", "--output_dir", str(out), *METHODS[name],
    ]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    rows = [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:] or rows
    return {
        "rows": rows,
        "median": {k: statistics.median(r.get(k, 0.0) for r in later) for k in SUMMARY},
        "rollout_correct": [r["rollout/correct"] for r in logs if "rollout/correct" in r],
        "rollout_length": [r["rollout/length"] for r in logs if "rollout/length" in r],
        "wall_s": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="The result JSON.")
    p.add_argument("--steps", type=int, default=8, help="Optimizer steps per method.")
    p.add_argument("--max-completion-length", type=int, default=128, help="Rollout length cap in tokens.")
    p.add_argument("--methods", default="opsd,grpo,hybrid", help=f"Comma-separated, of {', '.join(METHODS)}.")
    p.add_argument("--problems", type=int, default=32, help="Problems per step (a multiple of 4).")
    a = p.parse_args(argv)
    names = a.methods.split(",")
    unknown = [n for n in names if n not in METHODS]
    if unknown or a.problems < 4 or a.problems % 4:
        p.error(
            f"--methods takes {', '.join(METHODS)} and --problems a multiple of 4 (got {a.methods}, {a.problems})"
        )
    with tempfile.TemporaryDirectory() as tmp:
        arms = {name: run_method(name, a, Path(tmp)) for name in names}
    step_s = {name: arm["median"]["step_s"] for name, arm in arms.items()}
    result = {
        "machine": machine(),
        "config": {
            "steps": a.steps,
            "max_completion_length": a.max_completion_length,
            "problems_per_step": a.problems,
            "methods": {name: METHODS[name] for name in names},
        },  # fmt: skip
        "arms": arms,
        "ratios": {name: s / step_s[names[0]] for name, s in step_s.items()},
        "vs_grpo": {name: s / step_s["grpo"] for name, s in step_s.items()} if "grpo" in step_s else {},
    }
    write(result, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
