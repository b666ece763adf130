"""Benchmark: rollout throughput of each engine at fixed-length completions (docs/method.md §5 rollout table).

    python bench/rollout.py --out bench/results/rollout_h200.json

Random-weight Qwen3-1.7B (bf16), 256-token prompts, exactly `--new-tokens` new tokens per sequence
(min_tokens = max_tokens). Engines: vLLM (CUDA graphs, gpu_memory_utilization 0.6) at batch 8/32/128;
transformers `generate` with the dynamic cache (the reference, 493 tok/s in docs/method.md §5) and with the static
cache, which lets transformers compile the decoding step (opsd's fallback setting) at batch 32.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch

from common import machine, qwen3_1p7b_dir, write
from opsd.evaluation.sampling import HFEngine, SamplingConfig, VLLMEngine


def prompts(n: int, length: int, vocab: int = 151_000) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(1000, vocab, (n, length), generator=g).tolist()


def timed(engine, batch: int, prompt_len: int, new: int) -> dict:
    sampling = SamplingConfig(max_tokens=new, min_tokens=new, temperature=1.0, seed=0)
    p = prompts(batch, prompt_len)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = engine.generate(p, sampling)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    tokens = sum(len(s[0].token_ids) for s in out)
    return {"batch": batch, "new_tokens": new, "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def record(rows: list[dict], a, start_s: float | None) -> dict:
    return {
        "benchmark": "rollout",
        "machine": machine(),
        "vllm_engine_start_s": start_s,
        "config": {
            "model": "Qwen3-1.7B shape, random weights, bf16",
            "prompt": a.prompt,
            "vllm_new_tokens": a.new_tokens,
            "hf_new_tokens": a.hf_new_tokens,
            "fixed_length": "min_tokens = max_tokens",
            "warm_up": "one run at the timed shape",
        },
        "reference_tokens_per_s": {"transformers dynamic cache, 32 x 512 (reference measurement)": 493},
        "rows": rows,
    }


def measure_transformers(model_dir, a, rows: list[dict]) -> None:
    """transformers `generate` at batch 32, dynamic then static cache; appends a row each and writes --out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    tok = AutoTokenizer.from_pretrained(model_dir)
    for cache in (None, "static"):
        engine = HFEngine(model, tok, batch_size=32, cache_implementation=cache)
        # Warm up at the timed shape: a static cache of another length would recompile inside the timing.
        timed(engine, 32, a.prompt, a.hf_new_tokens)
        row = timed(engine, 32, a.prompt, a.hf_new_tokens)
        row["engine"] = f"transformers generate ({cache or 'dynamic'} cache)"
        rows.append(row)
        print(row, flush=True)
        write(record(rows, a, None), a.out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default="/tmp/qwen3-1.7b-random")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--hf-new-tokens", type=int, default=512)
    ap.add_argument("--out", default="bench/results/rollout.json")
    ap.add_argument("--only-hf", action="store_true", help="measure the transformers engine only")
    ap.add_argument("--only-vllm", action="store_true", help="measure the vLLM engine only")
    ap.add_argument(
        "--batches",
        default="8,32,128",
        help="vLLM batch sizes, comma-separated (32,64,128: k = 1, 2, 4 steps of 32 problems per generation)",
    )
    a = ap.parse_args()
    model_dir = qwen3_1p7b_dir(a.model_dir)
    rows = []

    if not a.only_vllm:
        measure_transformers(model_dir, a, rows)  # its model and engines are freed when it returns
        if a.only_hf:
            return
        gc.collect()
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    vllm = VLLMEngine(str(model_dir), gpu_memory_utilization=0.6, max_model_len=a.prompt + a.new_tokens + 16)
    start_s = time.perf_counter() - t0
    timed(vllm, 8, a.prompt, 32)
    for batch in (int(b) for b in a.batches.split(",")):
        row = timed(vllm, batch, a.prompt, a.new_tokens)
        row["decode_step_ms"] = 1000 * row["seconds"] / a.new_tokens
        row["engine"] = "vLLM (CUDA graphs, gpu_memory_utilization 0.6)"
        rows.append(row)
        print(row, flush=True)
    print(f"wrote {write(record(rows, a, start_s), a.out)}")
    for r in rows:
        print(f"{r['engine'][:44]:44} {r['batch']:4d} x {r['new_tokens']:5d}  {r['tokens_per_s']:9.0f} tok/s")


if __name__ == "__main__":
    main()
