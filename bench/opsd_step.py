"""Benchmark: one full OPSD optimizer step on one GPU with vLLM colocated (docs/method.md §5 step table).

    python bench/opsd_step.py --lengths 1024,2048 --out bench/results/opsd_step_h200.json

Each length runs `opsd_train.py` (the real entry point) in a subprocess: random-weight Qwen3-1.7B (bf16),
32 problems per step (micro-batch M x accumulation 32/M; the reference used M = 4), one rollout each of exactly L tokens (min_tokens
= max_tokens), vLLM colocated at gpu_memory_utilization 0.6, LoRA r64, fixed teacher, gradient checkpointing.
The first step (engine warm-up, compilation) is excluded; medians over the remaining steps of the time split
logged by the trainer (rollout, weight sync, scoring+loss+backward, optimizer) and of GPU memory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import STEP_METRICS, machine, qwen3_1p7b_dir, write  # noqa: E402


def run(length: int, model_dir: Path, work: Path, steps: int, micro: int, ckpt: bool) -> dict:
    tag = f"step{length}_mb{micro}{'' if ckpt else '_nockpt'}"
    out = work / tag
    cfg = {
        "model_name_or_path": str(model_dir),
        "dataset_name": "builtin",
        "output_dir": str(out),
        "max_steps": steps,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": 32 // micro,
        "gradient_checkpointing": ckpt,
        "max_completion_length": length,
        "generation_kwargs": {"min_tokens": length, "ignore_eos": True},
        "vllm_gpu_memory_utilization": 0.6,
        "vllm_max_model_length": length + 1536,
        "save_strategy": "no",
        "logging_steps": 1,
        "report_to": "none",
    }
    cfg_path = work / f"{tag}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "opsd_train.py"), "--config", str(cfg_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        return {
            "length": length,
            "micro_batch": micro,
            "gradient_checkpointing": ckpt,
            "status": "failed",
            "stderr_tail": res.stderr[-4000:],
        }
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r for r in records if "loss" in r]
    measured = steps_logged[1:]  # step 1 pays the engine's warm-up
    row = {
        "length": length,
        "micro_batch": micro,
        "gradient_checkpointing": ckpt,
        "status": "ok",
        "steps_measured": len(measured),
        "per_step": [{k: r.get(k) for k in STEP_METRICS} for r in steps_logged],
    }
    for k in STEP_METRICS:
        vals = [r[k] for r in measured if r.get(k) is not None]
        row[k] = statistics.median(vals) if vals else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="/tmp/qwen3-1.7b-random")
    ap.add_argument("--work", default="/tmp/opsd-step")
    ap.add_argument(
        "--variants", default="1024:4:ckpt,2048:4:ckpt", help="comma-separated LENGTH:MICRO_BATCH:ckpt|nockpt"
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="bench/results/opsd_step.json")
    a = ap.parse_args()
    model_dir = qwen3_1p7b_dir(a.model_dir)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for variant in a.variants.split(","):
        length, micro, ckpt = variant.split(":")
        row = run(int(length), model_dir, work, a.steps, int(micro), ckpt == "ckpt")
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "per_step"}), flush=True)
        write(record(rows), a.out)  # after every variant: a run cut short keeps what it measured
    print(f"wrote {a.out}")


def record(rows: list[dict]) -> dict:
    return {
        "benchmark": "opsd_step",
        "machine": machine(),
        "config": {
            "model": "Qwen3-1.7B shape, random weights, bf16",
            "problems_per_step": 32,
            "lora_r": 64,
            "teacher": "fixed",
            "vllm_gpu_memory_utilization": 0.6,
            "data": "built-in problems (short prompts)",
        },
        "reference_step_s": {"1024": 7.8, "2048": 13.9},
        "rows": rows,
    }


if __name__ == "__main__":
    main()
