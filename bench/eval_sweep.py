"""Benchmark: scoring the base model and K checkpoints with one eval_aime.py sweep against K + 1 separate calls.

    python bench/eval_sweep.py --modes sweep --out bench/results/eval_sweep_h200.json     # 1. cold compile cache
    python bench/eval_sweep.py --modes separate --out bench/results/eval_sweep_h200.json  # 2. resumable: rerun
    python bench/eval_sweep.py --modes sweep --out bench/results/eval_sweep_h200.json     # 3. warm: like 2.
    python bench/eval_sweep.py --model tiny --problems 3 --n 2 --max-tokens 16 --checkpoints-count 2 \\
        --work /tmp/eval_sweep_cpu --out /tmp/eval_sweep_cpu.json                         # CPU smoke

The embedded SmolLM2-135M (`--model tiny`: the tests' tiny Qwen3) and `--checkpoints-count` LoRA checkpoints
(default 5) made here with peft: r = 64 on every linear projection, A as peft initialises it, B drawn from
N(0, `--lora-b-std`) with a fixed seed per checkpoint (small, so outputs stay sane), saved as
WORK/run/checkpoint-{10, 20, ...} with the trainer's .complete mark. `builtin:easy` held-out problems,
`--problems` x `--n` samples x `--max-tokens` tokens, thinking off.

`separate`: one `eval_aime.py --adapter CKPT` call per evaluation (and one for the base), as a user would
run them, each a subprocess that starts its own engine. The calls run one by one until `--budget-s` would be
exceeded (by the last call's time); each finished call is recorded in --out at once, and rerunning with
`--modes separate` runs the ones still missing, so the K + 1 calls may span several invocations.
`sweep`: one `eval_aime.py --checkpoints WORK/run` call.

The compile cache. vLLM's first engine start on a machine compiles the model (~2.5 min for the embedded model
on an H200) and caches the result; later starts take ~30-50 s. Every call records whether the cache was
`cold` or `warm` before it started, and sweep rows are kept per cache state, so the order above measures a
cold sweep (1), separate calls that find the cache warm (2) and a warm sweep (3). `speedup` compares like
with like: separate wall / the warm sweep when every separate call found the cache warm, else / the cold
sweep (both paid one compile); `speedup_cold_sweep` and `speedup_warm_sweep` give both. A call that has
written its results but does not exit within `--exit-grace-s` is killed and timed to its results
(`killed_after_results`).

Rows: mode, compile_cache, wall_s (sum of the calls for separate), engine_starts, per-evaluation times;
`samples_equal` says, per evaluation, whether the last sweep drew the separate calls' samples (on a GPU,
LoRA-served samples are not reproducible run to run: docs/performance.md f).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import machine, write

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "eval_aime.py"


def base_model(kind: str, work: Path) -> str:
    if kind == "tiny":
        from opsd.testing.tiny import build_tiny_model

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


def compile_cache() -> str:
    """`warm` when vLLM's compile cache (VLLM_CACHE_ROOT or ~/.cache/vllm) already holds compiled graphs,
    else `cold`: a cold engine start compiles first (~2.5 min for the embedded model on an H200)."""
    root = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm")) / "torch_compile_cache"
    return "warm" if root.is_dir() and any(f.is_file() for f in root.rglob("*")) else "cold"


def call(cmd: list[str], log: Path, result_file: Path, exit_grace_s: float) -> tuple[float, bool]:
    """(wall seconds, killed): runs eval_aime.py; once it has written `result_file` (its last output) it gets
    `exit_grace_s` to exit, then is killed and timed to the file (a vLLM engine once hung at exit)."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), *cmd], cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        seen = None
        while proc.poll() is None:
            time.sleep(0.2)
            if seen is None and result_file.is_file():
                seen = time.perf_counter()
            if seen is not None and time.perf_counter() - seen > exit_grace_s:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                print(f"{log.name}: results written but no exit after {exit_grace_s:.0f} s; killed")
                return seen - t0, True
    if proc.returncode != 0:
        sys.exit(f"eval_aime.py failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - t0, False


def load(out: Path) -> dict:
    return json.loads(out.read_text()) if out.is_file() else {}


def samples(path: Path) -> dict:
    rows = [json.loads(line) for line in (path / "samples.jsonl").read_text().splitlines()]
    return {(r["id"], r["idx"]): r["text"] for r in rows}


def run_separate(args, model: str, ckpts: list[Path], work: Path, result: dict) -> None:
    """The separate calls still missing from `result["separate_calls"]`, each recorded at once."""
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
        cache = compile_cache()
        last, killed = call(cmd, work / f"separate-{name}.log", out / "summary.json", args.exit_grace_s)
        summary = json.loads((out / "summary.json").read_text())
        calls[name] = {"wall_s": last, "engine_start_s": summary["engine_start_s"],
                       "generation_s": summary["generation_s"], "engine_starts": 1, "compile_cache": cache,
                       "killed_after_results": killed}  # fmt: skip
        print(f"separate {name}: {last:.1f} s")
        write(result, args.out)  # each finished call is kept, whatever happens next


def separate_row(names: list[str], calls: dict) -> dict | None:
    """The `separate` row from the calls recorded so far (possibly over several invocations)."""
    done = [n for n in names if n in calls]
    if not done:
        return None
    return {"mode": "separate", "wall_s": sum(calls[n]["wall_s"] for n in done),
            "engine_starts": sum(calls[n]["engine_starts"] for n in done), "evaluations": done,
            "complete": len(done) == len(names), "compile_cache": _cache_state([calls[n] for n in done])}  # fmt: skip


def run_sweep(args, model: str, run: Path, work: Path, result: dict) -> None:
    out = work / "sweep"
    shutil.rmtree(out, ignore_errors=True)
    cache = compile_cache()
    cmd = [*eval_args(args, model), "--checkpoints", str(run), "--out", str(out)]
    wall, killed = call(cmd, work / f"sweep-{cache}.log", out / "sweep.json", args.exit_grace_s)
    sweep = json.loads((out / "sweep.json").read_text())
    row = {"mode": "sweep", "compile_cache": cache, "killed_after_results": killed, "wall_s": wall,
           "engine_starts": sweep["engine_starts"],
           "evaluations": [e["name"] for e in sweep["evaluations"]], "complete": True,
           "engine_start_s": sweep["engine_start_s"], "weight_loads": sweep["weight_loads"],
           "per_evaluation": {e["name"]: {k: json.loads((Path(e["dir"]) / "summary.json").read_text())[k]
                                          for k in ("engine_start_s", "generation_s", "new_samples")}
                              for e in sweep["evaluations"]}}  # fmt: skip
    print(f"sweep ({cache} compile cache): {wall:.1f} s, {sweep['engine_starts']} engine start(s)")
    keep = [r for r in result.get("rows", []) if (r["mode"], r.get("compile_cache")) != ("sweep", cache)]
    result["rows"] = keep + [row]


def _cache_state(calls: list[dict]) -> str:
    states = {c.get("compile_cache") for c in calls}
    return states.pop() if len(states) == 1 else "mixed"


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
    parser.add_argument("--exit-grace-s", type=float, default=60.0,
                        help="kill an eval_aime.py call this long after it wrote its results")  # fmt: skip
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
    sep = separate_row(["base", *[p.name for p in ckpts]], result.get("separate_calls", {}))
    result["rows"] = [r for r in result.get("rows", []) if r["mode"] != "separate"] + ([sep] if sep else [])
    rows = {(r["mode"], r.get("compile_cache")): r for r in result.get("rows", [])}
    if sep and sep["complete"]:
        for cache in ("warm", "cold"):
            if ("sweep", cache) in rows:
                result[f"speedup_{cache}_sweep"] = sep["wall_s"] / rows[("sweep", cache)]["wall_s"]
        # Like with like: separate calls that all found the cache warm against the warm sweep; calls of which
        # the first compiled (cold or mixed) against the sweep that compiled once too.
        same = rows.get(("sweep", "warm" if sep["compile_cache"] == "warm" else "cold"))
        result["speedup"] = sep["wall_s"] / same["wall_s"] if same else None
        if (work / "sweep").is_dir():
            result["samples_equal"] = {
                name: samples(work / "separate" / name) == samples(work / "sweep" / name)
                for name in sep["evaluations"]
                if (work / "separate" / name / "samples.jsonl").is_file()
            }
    print(json.dumps({k: result.get(k) for k in ("rows", "speedup", "samples_equal")}, indent=1))
    write(result, args.out)


if __name__ == "__main__":
    main()
