"""Benchmark: one full OPSD optimizer step on one GPU with vLLM colocated, the project's step against the
reference way of doing it, measured in the same run (docs/performance.md c).

    python bench/opsd_step.py --out bench/results/opsd_step_h200.json

Every variant ARM:LENGTH:MICRO:ckpt|nockpt runs a training entry point in its own process on the same
random-weight Qwen3-1.7B (bf16), the same built-in problems and the same settings: 32 problems per step
(per-device batch 4 x accumulation 8, as the capped harness plans one GPU), one rollout each of exactly
LENGTH tokens (min_tokens = max_tokens), vLLM colocated at gpu_memory_utilization 0.6, LoRA r64, fixed
teacher, beta 0, per-entry clip 0.05.
- `project`: `opsd_train.py` with `micro_batch_size=MICRO` (auto = what `train_capped.sh` runs; with
  `ckpt`, auto may still turn checkpointing off, and the row's `gradient_checkpointing` says what ran); a
  further parts: `:compile` adds `compile_layers=true` (its first steps pay the compile: give `--steps 6`),
  `:kN` sets `steps_per_rollout=N` (N steps per generation; the run takes whole windows, at least two);
  `:fixed` the teacher-free control (`loss_type=fixed_advantage`: no teacher prompt, no teacher forward) and
  `:contrast` the contrastive teacher (`teacher_contrast=shuffled`: a second teacher forward), docs/method.md
  §1.10-1.11;
- `reference`: `bench/reference_step.py` (both roles' logits over the whole vocabulary, TRL's rollout call
  and merged-LoRA sync) with per-device micro-batch MICRO.
The first step (the first window of N steps with `:kN`: engine warm-up, compilation) is excluded; the rows
hold medians over the remaining steps of the time split the trainer logs (rollout, weight sync, scoring + loss
+ backward, optimizer) and of GPU memory; with `:kN` a phase's time per step is its sum over the measured
windows divided by their steps (only a window's first step rolls out). `ratios` divides each project row by the reference row of the same length: step, rollout and
training part. A variant already in --out with status ok is kept unless --rerun, so a cut-short run resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from common import STEP_METRICS, machine, qwen3_1p7b_dir, write
from opsd.rundir import METRICS_FILE, read_step_log

ROOT = Path(__file__).resolve().parents[1]

# The reference's micro-batch 4 runs out of memory beside vLLM at 2048 on an H200; its micro-batch 2 runs.
DEFAULT_VARIANTS = (
    "reference:1024:4:ckpt,project:1024:auto:ckpt:compile,project:1024:auto:ckpt:compile:k2,"
    "project:1024:auto:ckpt:compile:k4,"
    "reference:2048:2:ckpt,project:2048:auto:ckpt:compile,project:2048:auto:ckpt:compile:k2,"
    "project:2048:auto:ckpt:compile:k4"
)
ENTRY = {"project": ROOT / "opsd_train.py", "reference": ROOT / "bench" / "reference_step.py"}
# The published setting (one generation per step) and k = 2 steps per generation, against the reference step.
GOAL_RATIO = 0.65
GOAL_RATIO_WINDOW = 0.5


# The method levers a project variant may add, and the settings each stands for.
METHOD_LEVERS = {"fixed": {"loss_type": "fixed_advantage"}, "contrast": {"teacher_contrast": "shuffled"}}


def parse_variant(text: str) -> dict:
    arm, length, micro, ckpt, *levers = text.split(":")
    windows = [int(x[1:]) for x in levers if re.fullmatch(r"k[1-9][0-9]*", x)]
    known = {"compile", *METHOD_LEVERS}
    if (
        arm not in ENTRY
        or ckpt not in ("ckpt", "nockpt")
        or len(levers) != len(set(levers))
        or any(x not in known and not re.fullmatch(r"k[1-9][0-9]*", x) for x in levers)
        or len(windows) > 1
        or (levers and arm != "project")
        or {"fixed", "contrast"} <= set(levers)
    ):
        raise SystemExit(
            f"bad variant {text!r}: ARM:LENGTH:MICRO:ckpt|nockpt[:compile][:kN][:fixed|:contrast] with ARM in "
            f"{sorted(ENTRY)} (compile, kN, fixed and contrast: project only)"
        )
    method = {k: v for lever in levers for k, v in METHOD_LEVERS.get(lever, {}).items()}
    return {"arm": arm, "length": int(length), "micro": micro, "ckpt": ckpt == "ckpt",
            "compile": "compile" in levers, "k": windows[0] if windows else 1, "method": method,
            "variant": text}  # fmt: skip


def measured_steps(steps: int, k: int) -> int:
    """Steps to run: at least `steps` and two windows of k, in whole windows (k must divide max_steps)."""
    return max(-(-steps // k), 2) * k


def run(v: dict, model_dir: Path, work: Path, steps: int) -> dict:
    tag = v["variant"].replace(":", "_")
    out = work / tag
    shutil.rmtree(
        out, ignore_errors=True
    )  # metrics.jsonl appends: a rerun must not read an earlier run's steps
    cfg = {
        "model_name_or_path": str(model_dir),
        "dataset_name": "builtin",
        "output_dir": str(out),
        "max_steps": measured_steps(steps, v["k"]),
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 8,
        "gradient_checkpointing": v["ckpt"],
        "max_completion_length": v["length"],
        "generation_kwargs": {"min_tokens": v["length"], "ignore_eos": True},
        "vllm_gpu_memory_utilization": 0.6,
        # One model length for every variant, so later engines reuse the first one's compiled graphs.
        "vllm_max_model_length": max(v["length"] + 1536, 3584),
        "save_strategy": "no",
        "logging_steps": 1,
        "report_to": "none",
    }
    if v["arm"] == "project":
        cfg["micro_batch_size"] = v["micro"]
        cfg["compile_layers"] = v["compile"]
        cfg["steps_per_rollout"] = v["k"]
        cfg.update(v.get("method", {}))
    else:
        cfg["per_device_train_batch_size"] = int(v["micro"])
        cfg["gradient_accumulation_steps"] = 32 // int(v["micro"])
    work.mkdir(parents=True, exist_ok=True)
    cfg_path = work / f"{tag}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    res = subprocess.run(
        [sys.executable, str(ENTRY[v["arm"]]), "--config", str(cfg_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    row = {k: v[k] for k in ("variant", "arm", "length", "micro", "ckpt", "compile", "k")}
    row["method"] = v.get("method", {})
    if res.returncode != 0:
        return {**row, "status": "failed", "stderr_tail": res.stderr[-4000:]}
    resolved = json.loads((out / "opsd_config.json").read_text())
    records = read_step_log(out / METRICS_FILE)
    steps_logged = [r for r in records if "loss" in r]
    # The first window (step 1 with k = 1) pays the engine's warm-up and the compile.
    measured = steps_logged[v["k"] :]
    row.update(
        status="ok",
        micro_batch=resolved["per_device_train_batch_size"],
        accumulation=resolved["gradient_accumulation_steps"],
        micro_batch_plan=resolved.get("micro_batch"),
        gradient_checkpointing=resolved["gradient_checkpointing"],
        steps_measured=len(measured),
        per_step=[{k: r.get(k) for k in STEP_METRICS} for r in steps_logged],
        engine_log=[line for line in res.stderr.splitlines() if "Asynchronous scheduling" in line][:1],
    )
    row["statistic"] = per_step_statistic(v["k"])
    for key in STEP_METRICS:
        row[key] = summarise(key, measured, v["k"])
    return row


def per_step_statistic(k: int) -> str:
    if k == 1:
        return "median over the steps after the first"
    return f"times: sum over the whole windows after the first / steps (one generation serves {k} steps); rest: median"


def summarise(key: str, measured: list[dict], k: int) -> float | None:
    """A metric per optimizer step. With k > 1 only a window's first step rolls out, so a phase's time is its
    sum over whole windows divided by their steps (a step without the phase counts 0)."""
    vals = [r[key] for r in measured if r.get(key) is not None]
    if k > 1 and key.startswith("time/"):
        return sum(vals) / len(measured) if measured else None
    return statistics.median(vals) if vals else None


def ratios(rows: list[dict]) -> list[dict]:
    ref = {r["length"]: r for r in rows if r["arm"] == "reference" and r["status"] == "ok"}
    out = []
    for r in rows:
        base = ref.get(r["length"])
        if r["arm"] != "project" or r["status"] != "ok" or base is None:
            continue
        entry = {"variant": r["variant"], "against": base["variant"], "micro_batch": r["micro_batch"]}
        failed = [x["variant"] for x in rows if x["arm"] == "reference" and x["length"] == r["length"]
                  and x["status"] != "ok"]  # fmt: skip
        if failed:  # e.g. out of memory beside the engine: the baseline is the reference setting that ran
            entry["reference_failed"] = failed
        for name, key in (
            ("step", "time/step_s"),
            ("rollout", "time/rollout_s"),
            ("train", "time/train_micro_s"),
        ):
            if r.get(key) and base.get(key):
                entry[name] = round(r[key] / base[key], 3)
        entry["ratio"] = entry.get("step")
        entry["goal"] = GOAL_RATIO if r.get("k", 1) == 1 else GOAL_RATIO_WINDOW
        entry["step_goal_met"] = entry.get("step") is not None and entry["step"] <= entry["goal"]
        entry["extra_memory_gib"] = r.get("memory/step_extra_gib")
        out.append(entry)
    return out


# Qwen3-1.7B without embeddings (28 layers: q,o 2048x2048, k,v 2048x1024, MLP 3 x 2048x6144); H200 datasheet.
BODY_PARAMS = 28 * (2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 6144)
ALL_PARAMS = BODY_PARAMS + 151936 * 2048
HBM_BYTES_PER_S = 4.8e12
BF16_DENSE_FLOPS = 989e12


def bounds(row: dict) -> dict:
    """What limits a measured step: the decode step against reading the weights once, and the training part's
    matrix FLOPs (student forward, its recompute when checkpointing, and activation backward with frozen base
    weights; teacher forward; three lm_head products per completion token) against the bf16 peak. Token counts are the longest rows'
    (`micro_batch_plan`), so the FLOPs are an upper estimate."""
    # A generation decodes `length` steps for k x 32 rows; the row's rollout time is per optimizer step.
    out = {"decode_step_ms": round(1000 * row["time/rollout_s"] * row.get("k", 1) / row["length"], 3)}
    out["weight_read_ms"] = round(1000 * ALL_PARAMS * 2 / HBM_BYTES_PER_S, 3)
    reason = (row.get("micro_batch_plan") or {}).get("reason", "")
    found = re.search(r"of (\d+) student / (\d+) teacher tokens", reason)
    if found and row.get("time/train_micro_s"):
        student, teacher = (32 * int(t) for t in found.groups())
        completion = 32 * row["length"]
        passes = 3 if row.get("gradient_checkpointing", True) else 2
        flops = 2 * BODY_PARAMS * (passes * student + teacher) + 3 * 2 * 2048 * 151936 * completion
        out["train_tflop"] = round(flops / 1e12, 1)
        out["train_tflop_per_s"] = round(flops / row["time/train_micro_s"] / 1e12, 1)
        out["train_at_peak_s"] = round(flops / BF16_DENSE_FLOPS, 3)
    return out


def record(rows: list[dict], machine_info: dict | None = None) -> dict:
    for r in rows:
        if r.get("status") == "ok" and r["arm"] == "project":
            r["bounds"] = bounds(r)
    return {
        "benchmark": "opsd_step",
        "machine": machine_info or machine(),
        "config": {
            "model": "Qwen3-1.7B shape, random weights, bf16",
            "problems_per_step": 32,
            "lora_r": 64,
            "teacher": "fixed",
            "beta": 0.0,
            "clip": "element, 0.05",
            "vllm_gpu_memory_utilization": 0.6,
            "data": "built-in problems (short prompts)",
            "goal": f"project step <= {GOAL_RATIO} x reference step of the same length, same run "
            f"({GOAL_RATIO_WINDOW} with 2 or more steps per generation)",
        },
        "rows": rows,
        "ratios": ratios(rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="/tmp/qwen3-1.7b-random")
    ap.add_argument("--work", default="/tmp/opsd-step")
    ap.add_argument(
        "--variants",
        default=DEFAULT_VARIANTS,
        help="comma-separated ARM:LENGTH:MICRO:ckpt|nockpt[:compile][:kN]",
    )
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="bench/results/opsd_step.json")
    ap.add_argument("--rerun", action="store_true", help="run variants already in --out again")
    a = ap.parse_args()
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    rows = [r for r in old.get("rows", []) if a.rerun is False]
    ran = False
    for text in a.variants.split(","):
        v = parse_variant(text)
        if any(r["variant"] == v["variant"] and r["status"] == "ok" for r in rows):
            continue
        row, ran = run(v, qwen3_1p7b_dir(a.model_dir), Path(a.work), a.steps), True
        rows = [r for r in rows if r["variant"] != v["variant"]] + [row]
        print(json.dumps({k: x for k, x in row.items() if k not in ("per_step", "stderr_tail")}), flush=True)
        write(record(rows), out)  # after every variant: a run cut short keeps what it measured
    result = record(rows, None if ran else old.get("machine"))
    write(result, out)
    print(json.dumps(result["ratios"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
