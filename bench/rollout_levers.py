"""Benchmark: what each rollout lever costs or saves, in one colocated-style vLLM engine (docs/performance.md g).

    python bench/rollout_levers.py --out bench/results/rollout_levers_h200.json [--async-scheduling off]

The engine is built the way TRL's colocated mode builds it (in-process engine, external launcher,
max_num_seqs 32, max_num_batched_tokens 4096, processed logprobs mode) on the random-weight Qwen3-1.7B, at
gpu_memory_utilization 0.6. For each length, 32 built-in-length prompts (64-192 random tokens) are decoded to
exactly LENGTH new tokens with the training sampling (temperature 1.1, top_p 0.95, top_k 20) under each
variant, interleaved, `--repeats` times:
- `reference`: one SamplingParams for the batch, no seed, detokenised (TRL's call, the reference code's);
- `nodetok`: the same without detokenisation;
- `seeded`: one seed per row (what makes rollouts independent of process count and resume), detokenised;
- `project`: per-row seeds, no detokenisation (what OPSDTrainer sends).
Per-row seeds take vLLM's seeded sampler (Triton top-k/top-p + Gumbel with per-request seeds) instead of
FlashInfer's unseeded one; detokenisation runs in this process between decode steps. `--profile` adds the
top host-side functions (cProfile) of one `project` and one `reference` call. Rows from earlier calls with
other engine settings (`--async-scheduling`) are kept in --out.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import os
import pstats
import statistics
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
    os.environ.setdefault(key, value)
os.environ.setdefault("MASTER_PORT", "29531")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")


from common import machine, qwen3_1p7b_dir, write  # noqa: E402

VARIANTS = {
    "reference": {"seeds": False, "detokenize": True},
    "nodetok": {"seeds": False, "detokenize": False},
    "seeded": {"seeds": True, "detokenize": True},
    "project": {"seeds": True, "detokenize": False},
}


def prompts(n: int = 32, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 193, (n,), generator=g).tolist()
    return [torch.randint(1000, 150_000, (k,), generator=g).tolist() for k in lengths]


def sampling(variant: str, length: int, n: int):
    """The variant's sampling parameters (`SamplingConfig.vllm`): one for the batch, or one seed per row."""
    from opsd.evaluation.sampling import SamplingConfig

    config = SamplingConfig(max_tokens=length, temperature=1.1, top_p=0.95, top_k=20, min_tokens=length)
    extra = dict(ignore_eos=True, detokenize=VARIANTS[variant]["detokenize"])
    if VARIANTS[variant]["seeds"]:
        return [dataclasses.replace(config, seed=1000 + i).vllm(**extra) for i in range(n)]
    return config.vllm(seed=None, **extra)  # no seed, as TRL sends it


def timed(llm, variant: str, length: int, rows: list[list[int]]) -> float:
    import torch

    reqs = [{"prompt_token_ids": r} for r in rows]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate(reqs, sampling_params=sampling(variant, length, len(rows)), use_tqdm=False)
    torch.cuda.synchronize()
    assert all(len(o.outputs[0].token_ids) == length for o in out)
    return time.perf_counter() - t0


def profile(llm, variant: str, length: int, rows) -> list[dict]:
    prof = cProfile.Profile()
    prof.enable()
    timed(llm, variant, length, rows)
    prof.disable()
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream).sort_stats("tottime")
    top = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in sorted(
        stats.stats.items(), key=lambda kv: -kv[1][2]
    )[:25]:
        top.append({"function": f"{Path(file).name}:{line}:{func}", "calls": calls, "tottime_s": round(tottime, 4),
                    "cumtime_s": round(cumtime, 4)})  # fmt: skip
    return top


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="/tmp/qwen3-1.7b-random")
    ap.add_argument("--lengths", default="1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--async-scheduling", choices=["default", "on", "off"], default="default")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="bench/results/rollout_levers.json")
    a = ap.parse_args()
    from vllm import LLM

    model_dir = qwen3_1p7b_dir(a.model_dir)
    lengths = [int(x) for x in a.lengths.split(",")]
    extra = {} if a.async_scheduling == "default" else {"async_scheduling": a.async_scheduling == "on"}
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model_dir), gpu_memory_utilization=0.6, max_model_len=max(max(lengths) + 1536, 3584), max_num_seqs=32,
        distributed_executor_backend="external_launcher", seed=0, max_num_batched_tokens=4096,
        logprobs_mode="processed_logprobs", **extra,
    )  # fmt: skip
    start_s = time.perf_counter() - t0
    cfg = llm.llm_engine.vllm_config
    engine = {
        "async_scheduling": cfg.scheduler_config.async_scheduling,
        "cudagraph_capture_sizes": list(cfg.compilation_config.cudagraph_capture_sizes or []),
        "requested_async_scheduling": a.async_scheduling,
        "start_s": round(start_s, 1),
    }
    rows_in = prompts()
    results = []
    for length in lengths:
        timed(llm, "project", length, rows_in)  # warm-up at this length
        times = {v: [] for v in VARIANTS}
        for _ in range(a.repeats):
            for v in VARIANTS:
                times[v].append(timed(llm, v, length, rows_in))
        ref = statistics.median(times["reference"])
        for v, ts in times.items():
            med = statistics.median(ts)
            results.append({
                "engine": a.async_scheduling, "length": length, "variant": v, **VARIANTS[v], "seconds": ts,
                "median_s": round(med, 4), "tokens_per_s": round(32 * length / med), "vs_reference": round(med / ref, 4),
                "per_decode_step_ms": round(1000 * med / length, 3),
            })  # fmt: skip
            print(json.dumps(results[-1]), flush=True)
    out = Path(a.out)
    old = json.loads(out.read_text()) if out.is_file() else {}
    record = {
        "benchmark": "rollout_levers",
        "machine": machine(),
        "config": {
            "model": "Qwen3-1.7B shape, random weights, bf16",
            "batch": 32,
            "prompts": "64-192 tokens",
            "sampling": "temperature 1.1, top_p 0.95, top_k 20, fixed length",
            "repeats": a.repeats,
        },  # fmt: skip
        "engines": {**old.get("engines", {}), a.async_scheduling: engine},
        "rows": [r for r in old.get("rows", []) if r["engine"] != a.async_scheduling] + results,
        "profiles": old.get("profiles", {}),
    }
    if a.profile:
        record["profiles"] = {
            f"{v}_{lengths[0]}": profile(llm, v, lengths[0], rows_in) for v in ("project", "reference")
        }
    write(record, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
