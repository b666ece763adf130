"""Benchmark: scoring the base model and K checkpoints with one eval_aime.py sweep against K + 1 separate calls.

    python bench/eval_sweep.py --out bench/results/eval_sweep_h200.json                     # both modes
    python bench/eval_sweep.py --modes separate --out bench/results/eval_sweep_h200.json    # resumable:
    python bench/eval_sweep.py --modes separate --out bench/results/eval_sweep_h200.json    #  rerun to go on
    python bench/eval_sweep.py --modes sweep --out bench/results/eval_sweep_h200.json       # rows merge
    python bench/eval_sweep.py --model tiny --problems 3 --n 2 --max-tokens 16 --checkpoints-count 2 \\
        --work /tmp/eval_sweep_cpu --out /tmp/eval_sweep_cpu.json                           # CPU smoke

The embedded SmolLM2-135M (`--model tiny`: the tests' tiny Qwen3) and `--checkpoints-count` LoRA checkpoints
(default 5) made here with peft: r = 64 on every linear projection, A as peft initialises it, B drawn from
N(0, `--lora-b-std`) with a fixed seed per checkpoint (small, so outputs stay sane), saved as
WORK/run/checkpoint-{10, 20, ...} with the trainer's .complete mark. `builtin:easy` held-out problems,
`--problems` x `--n` samples x `--max-tokens` tokens, thinking off.

`separate`: one `eval_aime.py --adapter CKPT` call per evaluation (and one for the base), as a user would
run them, each a subprocess that starts its own engine. The calls run one by one until `--budget-s` would be
exceeded (by the last call's time); each finished call is recorded in --out at once, and rerunning with
`--modes separate` runs the ones still missing, so the K + 1 calls may span several invocations.
`sweep`: one `eval_aime.py --checkpoints WORK/run` call. Rows: mode, wall_s (sum of the calls for
separate), engine_starts, per-evaluation times; `speedup` = separate wall / sweep wall when both covered
the same evaluations; `samples_equal` says, per evaluation, whether both modes drew identical samples.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, write  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "eval_aime.py"


def base_model(kind: str, work: Path) -> str:
    if kind == "tiny":
        from opsd.tiny import build_tiny_model

        path = work / "tiny-model"
        if not (path / "config.json").is_file():
            build_tiny_model(path)
        return str(path)
    from opsd.models import resolve_model_path

    return resolve_model_path("")


def make_checkpoints(model: str, run: Path, count: int, rank: int, b_std: float, seed: int) -> list[Path]:
    """`count` random LoRA checkpoints of `model` (module docstring), reused if already there."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [run / f"checkpoint-{10 * (k + 1)}" for k in range(count)]
    for k, path in enumerate(paths):
        if (path / ".complete").is_file():
            continue
        torch.manual_seed(seed + k)
        base = AutoModelForCausalLM.from_pretrained(model, dtype="auto")
        lora = LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear", task_type="CAUSAL_LM")
        peft_model = get_peft_model(base, lora)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, b_std)
        peft_model.save_pretrained(path)
        (path / ".complete").touch()
    return paths


def eval_args(args, model: str) -> list[str]:
    return ["--model", model, "--dataset", "builtin:easy", "--limit", str(args.problems), "--n", str(args.n),
            "--max-tokens", str(args.max_tokens), "--max-model-len", str(args.max_model_len),
            "--no-thinking", "--seed", "0"]  # fmt: skip


def call(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(
            [sys.executable, str(SCRIPT), *cmd], cwd=REPO, stdout=f, stderr=subprocess.STDOUT
        ).returncode
    if rc != 0:
        sys.exit(f"eval_aime.py failed (exit {rc}); see {log}")
    return time.perf_counter() - t0


def load(out: Path) -> dict:
    return json.loads(out.read_text()) if out.is_file() else {}


def samples(path: Path) -> dict:
    rows = [json.loads(line) for line in (path / "samples.jsonl").read_text().splitlines()]
    return {(r["id"], r["idx"]): r["text"] for r in rows}


def run_separate(args, model: str, ckpts: list[Path], work: Path, result: dict) -> None:
    calls = result.setdefault("separate_calls", {})
    todo = [("base", None), *[(p.name, p) for p in ckpts]]
    t_start, last = time.perf_counter(), 0.0
    for name, ckpt in todo:
        if name in calls:
            continue
        if last and time.perf_counter() - t_start + last > args.budget_s:
            print(f"separate: budget reached; rerun with --modes separate for {len(todo) - len(calls)} more")
            break
        out = work / "separate" / name
        shutil.rmtree(out, ignore_errors=True)  # a call killed earlier: time it again from scratch
        cmd = [*eval_args(args, model), *(["--adapter", str(ckpt)] if ckpt else []), "--out", str(out)]
        last = call(cmd, work / f"separate-{name}.log")
        summary = json.loads((out / "summary.json").read_text())
        calls[name] = {"wall_s": last, "engine_start_s": summary["engine_start_s"],
                       "generation_s": summary["generation_s"], "engine_starts": 1}  # fmt: skip
        print(f"separate {name}: {last:.1f} s")
        write(result, args.out)  # each finished call is kept, whatever happens next
    names = [n for n, _ in todo]
    done = [n for n in names if n in calls]
    row = {"mode": "separate", "wall_s": sum(calls[n]["wall_s"] for n in done),
           "engine_starts": sum(calls[n]["engine_starts"] for n in done), "evaluations": done,
           "complete": len(done) == len(names)}  # fmt: skip
    result["rows"] = [r for r in result.get("rows", []) if r["mode"] != "separate"] + [row]


def run_sweep(args, model: str, run: Path, work: Path, result: dict) -> None:
    out = work / "sweep"
    shutil.rmtree(out, ignore_errors=True)
    wall = call([*eval_args(args, model), "--checkpoints", str(run), "--out", str(out)], work / "sweep.log")
    sweep = json.loads((out / "sweep.json").read_text())
    row = {"mode": "sweep", "wall_s": wall, "engine_starts": sweep["engine_starts"],
           "evaluations": [e["name"] for e in sweep["evaluations"]], "complete": True,
           "engine_start_s": sweep["engine_start_s"], "weight_loads": sweep["weight_loads"],
           "per_evaluation": {e["name"]: {k: json.loads((Path(e["dir"]) / "summary.json").read_text())[k]
                                          for k in ("engine_start_s", "generation_s", "new_samples")}
                              for e in sweep["evaluations"]}}  # fmt: skip
    print(f"sweep: {wall:.1f} s, {sweep['engine_starts']} engine start(s)")
    result["rows"] = [r for r in result.get("rows", []) if r["mode"] != "sweep"] + [row]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", choices=("separate", "sweep"), default=["separate", "sweep"])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--checkpoints-count", type=int, default=5)
    parser.add_argument("--problems", type=int, default=40)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--lora-rank", type=int, default=64)
    parser.add_argument("--lora-b-std", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="separate: stop starting calls after this"
    )
    parser.add_argument("--work", default="runs/bench/eval_sweep", help="checkpoints and result dirs")
    parser.add_argument("--out", default="bench/results/eval_sweep_h200.json")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(args, k) for k in ("model", "checkpoints_count", "problems", "n", "max_tokens",
                                            "max_model_len", "lora_rank", "lora_b_std", "seed")}  # fmt: skip
    config["dataset"] = "builtin:easy"
    result = load(Path(args.out))
    if result.get("config") not in (None, config):
        sys.exit(f"{args.out} holds results of other settings ({result['config']}); use a new --out")
    result.update(config=config, machine=machine())
    model = base_model(args.model, work)
    run = work / "run"
    ckpts = make_checkpoints(model, run, args.checkpoints_count, args.lora_rank, args.lora_b_std, args.seed)
    if "separate" in args.modes:
        run_separate(args, model, ckpts, work, result)
    if "sweep" in args.modes:
        run_sweep(args, model, run, work, result)
    rows = {r["mode"]: r for r in result.get("rows", [])}
    if "separate" in rows and "sweep" in rows and rows["separate"]["complete"]:
        result["speedup"] = rows["separate"]["wall_s"] / rows["sweep"]["wall_s"]
        if (work / "sweep").is_dir():
            result["samples_equal"] = {
                name: samples(work / "separate" / name) == samples(work / "sweep" / name)
                for name in rows["separate"]["evaluations"]
                if (work / "separate" / name / "samples.jsonl").is_file()
            }
    print(json.dumps({k: result.get(k) for k in ("rows", "speedup", "samples_equal")}, indent=1))
    write(result, args.out)


if __name__ == "__main__":
    main()
