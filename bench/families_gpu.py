"""Benchmark: OPSD training steps on the released shape of each architecture family, one GPU, vLLM colocated, and
how closely the rollout engine's log-probs match the trainer's on the same tokens after training.

    VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 python bench/families_gpu.py --out bench/results/families_h200.json
    python bench/families_gpu.py --tiny --families qwen3,olmo3,lfm2 --out /tmp/families_tiny.json   # CPU check

Each family (qwen3 = Qwen3-1.7B, the control; qwen3_5 = Qwen3.5-2B text model; olmo3 = OLMo-3-7B; smollm3 =
SmolLM3-3B; gemma3 = Gemma-3-4B text model; lfm2 = LFM2-2.6B) runs in its own process (`--one FAMILY`, this script
again, killed after `--timeout` s). That process writes a random-weight bf16 model of the released shape
(`opsd.testing.families.REAL_SHAPES`, built on the GPU) and trains it with `opsd_train.main`: `--steps` optimizer
steps of 32 built-in problems (per-device batch 4 x accumulation 8), one rollout each of exactly `--length` tokens,
vLLM colocated at `--gpu-memory-utilization`, LoRA on the default targets, gradient checkpointing. The rows hold the
time split and memory the trainer logs (`bench.common.STEP_METRICS`), medians over the steps after the first
(engine warm-up), and every step's values.

Agreement: after training, the same process pushes the student's current weights into the engine
(`vllm_generation.sync_weights`), samples `--agree-prompts` student prompts x `--agree-tokens` tokens at temperature 1
with the engine's log-prob of each sampled token, and scores those tokens with the student in eval mode
(`_completion_hidden`, `head_logits` with the trainer's logit transform). The row reports max and mean |delta log p|,
the engine's log-prob mode and the engine's model class (whether it ran the family through vLLM's Transformers
backend). A failed family is recorded with its error line and stderr tail, and the next one runs. The JSON is
rewritten after every family; a family already `ok` in --out is kept unless --rerun. `--tiny` runs the same flow on
the tiny float32 models of `opsd.testing.families` (2 steps of 2 problems, 16 tokens), which vLLM's CPU engine can
run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from common import STEP_METRICS, machine, write
from opsd.rundir import METRICS_FILE, read_step_log
from opsd.testing.families import FAMILIES as TINY_FAMILIES
from opsd.testing.families import REAL_SHAPES

ROOT = Path(__file__).resolve().parents[1]

FAMILIES = ("qwen3", "qwen3_5", "olmo3", "smollm3", "gemma3", "lfm2")
# (steps, per-device batch, accumulation, length, agreement prompts, agreement tokens) on the GPU and with --tiny.
REAL = dict(steps=3, batch=4, accumulation=8, length=1024, agree_prompts=8, agree_tokens=256)
TINY = dict(steps=2, batch=2, accumulation=1, length=16, agree_prompts=4, agree_tokens=16)
AGREEMENT_FILE = "agreement.json"
ERROR_LINE = re.compile(r"(\w+(Error|Exception)\b|^error\b|\berror:|Killed|out of memory)", re.IGNORECASE)


def settings(a) -> dict:
    base = TINY if a.tiny else REAL
    return {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in base.items()}


def train_config(model_dir: Path, out: Path, s: dict, a) -> dict:
    return {
        "model_name_or_path": str(model_dir),
        "dataset_name": "builtin",
        "output_dir": str(out),
        "max_steps": s["steps"],
        "per_device_train_batch_size": s["batch"],
        "gradient_accumulation_steps": s["accumulation"],
        "gradient_checkpointing": True,
        "max_completion_length": s["length"],
        "generation_kwargs": {"min_tokens": s["length"], "ignore_eos": True},
        "vllm_gpu_memory_utilization": a.gpu_memory_utilization,
        "vllm_max_model_length": 1024 if a.tiny else s["length"] + 1536,
        "save_strategy": "no",
        "logging_steps": 1,
        "report_to": "none",
        "seed": a.seed,
    }


# -- the training process (--one FAMILY) ------------------------------------------------------------------------
def engine_model_class(llm) -> str | None:
    name = lambda m: f"{type(m).__module__}.{type(m).__name__}"  # noqa: E731
    try:
        return llm.apply_model(name)[0]
    except Exception:  # the class is a nice-to-have; the engine's internals differ between vLLM versions
        pass
    try:  # where the trainer's own weight sync reaches the engine's model on a GPU
        return name(llm.llm_engine.model_executor.driver_worker.model_runner.model)
    except Exception:
        return None


def agreement(trainer, n_prompts: int, n_tokens: int, seed: int) -> dict:
    """Engine vs trainer log-probs of `n_prompts` x `n_tokens` tokens the engine samples from the current student."""
    import torch
    from vllm import SamplingParams

    from opsd.method.hidden import IDENTITY, eval_mode, head_logits, left_pad, lm_head_weight, right_pad

    gen = trainer.engine.generation
    gen.sync_weights()  # the last optimizer step's weights are not in the engine yet
    if getattr(gen, "enable_sleep_mode", False):
        gen.llm.wake_up(tags=["kv_cache"])
    rows = trainer.train_dataset.select(range(n_prompts))
    prompts = [trainer.prompt_builder.student_ids(p) for p in rows["prompt"]]
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, max_tokens=n_tokens, min_tokens=n_tokens, ignore_eos=True,
                       logprobs=0, seed=seed + i, detokenize=False)
        for i in range(len(prompts))
    ]  # fmt: skip
    outs = gen.llm.generate(
        [{"prompt_token_ids": p} for p in prompts], sampling_params=params, use_tqdm=False
    )
    completions = [list(o.outputs[0].token_ids) for o in outs]
    engine_N = torch.tensor(
        [lp[t].logprob for o, c in zip(outs, completions, strict=True)
         for lp, t in zip(o.outputs[0].logprobs, c, strict=True)]
    )  # fmt: skip
    model, unwrapped = trainer.model, trainer.accelerator.unwrap_model(trainer.model)
    device, pad = trainer.accelerator.device, trainer.processing_class.pad_token_id
    p_ids, p_mask = left_pad(prompts, pad, device)
    c_ids, c_mask = right_pad(completions, pad, device)
    transform = trainer.logit_transform or IDENTITY
    with torch.no_grad(), eval_mode(unwrapped):
        hidden_NH = trainer.forwards(model, p_ids, p_mask, c_ids, c_mask)
        targets_N = c_ids[c_mask.bool()]
        weight_VH = lm_head_weight(unwrapped)
        chunks = [  # (chunk, V) float32 logits: a chunk at a time keeps a 262k vocabulary small
            head_logits(hidden_NH[i : i + 512], weight_VH, transform).log_softmax(-1)
            .gather(-1, targets_N[i : i + 512, None])[:, 0]
            for i in range(0, len(targets_N), 512)
        ]  # fmt: skip
    trainer_N = torch.cat(chunks).float().cpu()
    diff_N = (trainer_N - engine_N).abs()
    engine_class = engine_model_class(gen.llm)
    return {
        "tokens": len(diff_N),
        "max_abs_dlogp": round(float(diff_N.max()), 5),
        "mean_abs_dlogp": round(float(diff_N.mean()), 5),
        "p99_abs_dlogp": round(float(diff_N.quantile(0.99)), 5),
        "engine_mean_logp": round(float(engine_N.mean()), 4),
        "trainer_mean_logp": round(float(trainer_N.mean()), 4),
        "logprobs_mode": str(getattr(gen.llm.llm_engine.model_config, "logprobs_mode", None)),
        "logit_transform": transform.describe(),
        "sampling": f"temperature 1, top_p 1, no top_k, seeds {seed}..{seed + len(prompts) - 1}",
        "engine_model_class": engine_class,
        "transformers_backend": None if engine_class is None else ".transformers" in engine_class,
    }


def one(a) -> None:
    import gc

    import torch

    from opsd.testing.families import build_family

    s = settings(a)
    work = Path(a.work) / a.one
    start = time.perf_counter()
    model_dir = build_family(a.one, work / "model", a.seed, **({} if a.tiny else {"shape": "real"}))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the build's memory goes back before the trainer and the engine start
    (work / "build.json").write_text(json.dumps({"build_s": round(time.perf_counter() - start, 1)}))
    cfg = work / "train.yaml"
    cfg.write_text(yaml.safe_dump(train_config(model_dir, work / "run", s, a)))

    import opsd_train
    import opsd_trainer

    train = opsd_trainer.OPSDTrainer.train

    def train_then_agree(self, *args, **kwargs):
        out = train(self, *args, **kwargs)
        try:
            result = agreement(self, s["agree_prompts"], s["agree_tokens"], a.seed)
        except Exception as e:  # training measured fine: keep its rows, say why the comparison did not run
            import traceback

            traceback.print_exc()
            result = {"error": f"{type(e).__name__}: {e}"}
        (work / AGREEMENT_FILE).write_text(json.dumps(result))
        return out

    opsd_trainer.OPSDTrainer.train = train_then_agree
    opsd_train.main(["--config", str(cfg)])


# -- the parent ---------------------------------------------------------------------------------------------------
def error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.search(line)]
    return (errors or lines or ["(no stderr)"])[-1][:500]


def run_family(name: str, a, s: dict) -> dict:
    work = Path(a.work) / name
    shutil.rmtree(
        work, ignore_errors=True
    )  # metrics.jsonl appends: a rerun must not read an earlier run's steps
    work.mkdir(parents=True)
    forward = [
        "--work",
        a.work,
        "--seed",
        str(a.seed),
        "--gpu-memory-utilization",
        str(a.gpu_memory_utilization),
    ]
    for key, value in s.items():
        forward += [f"--{key.replace('_', '-')}", str(value)]
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--one",
        name,
        *forward,
        *(["--tiny"] if a.tiny else []),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    start, timed_out = time.perf_counter(), False
    with open(work / "stdout.log", "w") as so, open(work / "stderr.log", "w") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # its own session: the engine's helpers go with it
            rc, timed_out = proc.wait(), True
    stderr = (work / "stderr.log").read_text(errors="replace")
    source = "opsd.testing.families tiny model" if a.tiny else REAL_SHAPES[name][2]
    row = {"family": name, "shape_of": source, "wall_s": round(time.perf_counter() - start, 1)}
    if (work / "build.json").is_file():
        row.update(json.loads((work / "build.json").read_text()))
    records = read_step_log(work / "run" / METRICS_FILE) if (work / "run" / METRICS_FILE).is_file() else []
    steps_logged = [r for r in records if "loss" in r]
    row["per_step"] = [{k: r.get(k) for k in ["loss", *STEP_METRICS]} for r in steps_logged]
    if rc != 0:
        row.update(status="failed", error=f"timed out after {a.timeout} s" if timed_out else error_line(stderr),
                   stderr_tail=stderr[-4000:])  # fmt: skip
    else:
        resolved = json.loads((work / "run" / "opsd_config.json").read_text())
        measured = steps_logged[1:]  # step 1 pays the engine's warm-up
        row.update(
            status="ok",
            micro_batch_plan=resolved.get("micro_batch"),
            lora_target_modules=resolved.get("lora_target_modules"),
            steps_measured=len(measured),
        )
        for k in STEP_METRICS:
            vals = [r[k] for r in measured if r.get(k) is not None]
            row[k] = statistics.median(vals) if vals else None
        agree = work / AGREEMENT_FILE
        row["agreement"] = json.loads(agree.read_text()) if agree.is_file() else {"error": "not written"}
    if not a.keep:  # the 64 GB disk holds one model at a time (OLMo-3-7B is ~15 GB in bf16)
        shutil.rmtree(work / "model", ignore_errors=True)
        for ckpt in (work / "run").glob("checkpoint-*"):
            shutil.rmtree(ckpt, ignore_errors=True)
    return row


def record(rows: dict, s: dict, a, machine_info: dict) -> dict:
    return {
        "benchmark": "families",
        "machine": machine_info,
        "config": {
            "models": "tiny float32 (opsd.testing.families)"
            if a.tiny
            else "released shapes, random weights, bf16",
            "shapes": {} if a.tiny else {n: REAL_SHAPES[n][2] for n in rows},
            "problems_per_step": s["batch"] * s["accumulation"],
            **s,
            "vllm_gpu_memory_utilization": a.gpu_memory_utilization,
            "lora": "opsd defaults (lora_target_modules auto)",
            "gradient_checkpointing": True,
            "data": "built-in problems",
            "medians": "over the steps after the first",
        },
        "rows": [rows[n] for n in sorted(rows, key=lambda n: FAMILIES.index(n) if n in FAMILIES else 99)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"comma-separated, of {','.join(FAMILIES)} (with --tiny also {','.join(sorted(set(TINY_FAMILIES) - set(FAMILIES)))})",
    )
    ap.add_argument("--out", default="bench/results/families_h200.json")
    ap.add_argument("--work", default="/tmp/families", help="scratch: models, run directories, logs")
    ap.add_argument("--tiny", action="store_true", help="the tiny CPU models and small settings (a test run)")
    ap.add_argument(
        "--steps", type=int, help=f"optimizer steps (default {REAL['steps']}, tiny {TINY['steps']})"
    )
    ap.add_argument("--batch", type=int, help="per-device batch (default 4, tiny 2)")
    ap.add_argument("--accumulation", type=int, help="gradient accumulation (default 8, tiny 1)")
    ap.add_argument("--length", type=int, help="completion tokens (default 1024, tiny 16)")
    ap.add_argument("--agree-prompts", type=int, help="prompts sampled for the agreement (default 8, tiny 4)")
    ap.add_argument("--agree-tokens", type=int, help="tokens per agreement sample (default 256, tiny 16)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--timeout", type=int, default=420, help="seconds per family, build included")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rerun", action="store_true", help="run families already ok in --out again")
    ap.add_argument("--keep", action="store_true", help="keep each family's model directory")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the training process of one family
    a = ap.parse_args()
    if a.one:
        return one(a)
    names = a.families.split(",")
    known = TINY_FAMILIES if a.tiny else FAMILIES  # every tiny family; the released shapes of six
    if unknown := sorted(set(names) - set(known)):
        raise SystemExit(f"unknown families {unknown}; choose from {','.join(known)}")
    s, out = settings(a), Path(a.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    rows = {r["family"]: r for r in old.get("rows", []) if not a.rerun}
    info = machine()
    for name in names:
        if rows.get(name, {}).get("status") == "ok":
            continue
        rows[name] = run_family(name, a, s)
        summary = {
            k: v for k, v in rows[name].items() if k not in ("per_step", "stderr_tail", "micro_batch_plan")
        }
        print(json.dumps(summary, default=str), flush=True)
        write(record(rows, s, a, info), out)  # after every family: a run cut short keeps what it measured
    write(record(rows, s, a, info), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
