"""Benchmark: eval_aime.py's streaming generation against the chunked schedule it replaced, on one GPU.

    python bench/eval_throughput.py --out bench/results/eval_throughput_h200.json           # both modes
    python bench/eval_throughput.py --modes chunked      # one mode per call; rows merge into --out
    python bench/eval_throughput.py --num-gpus 2 --out bench/results/eval_balance_2gpu_h200.json
    python bench/eval_throughput.py --model-config tiny --problems 4 --n 4 --median 48 --cap 128 \\
        --out /tmp/eval_throughput_cpu.json                                                 # CPU smoke

A random-weight Qwen3-1.7B (vLLM `load_format="dummy"`: only config.json and a local tokenizer on disk),
30 problems x 12 samples with random 128-token prompts. Each sample's length is drawn once from a seeded
long-tailed distribution shaped like Qwen3-1.7B thinking on AIME (log-normal, median `--median` tokens,
`--cap-share` of the samples at the `--cap` cap) and enforced with `ignore_eos` and a per-sample
`max_tokens`; `--scale` multiplies every length and the cap so that a run fits a time limit. Both modes
draw the same lengths and run through the generation loop eval_aime.py uses (`opsd.evaluation.generate`):
`chunked` = chunks of `--chunk-size` problems, each drained before the next (the previous schedule);
`streaming` = every sample submitted at once, at most `--max-in-flight` in the engine.

Lower bound on the wall time of either mode: max(the longest sample's decode time, total tokens / peak
throughput). Peak throughput is measured in the same run with a short full-batch generation (`--peak-batch`
sequences x `--peak-tokens`); the longest sample's decode time is its length over the single-sequence decode
speed, also measured here.

`--num-gpus 2`: two worker processes (one GPU each, this script again) run the streaming loop twice on the
same draw, `dynamic` (the claim queue of `opsd.evaluation.workers`) and `static` (worker r takes problems
r, r + 2, ..., eval_aime.py's previous striping), each started when both engines are ready.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from statistics import NormalDist

from common import machine, write
from opsd.configuration.checks import KV_CACHE_DTYPES
from opsd.evaluation.eval_config import EvalConfig
from opsd.evaluation.generate import auto_window, stream, stream_chunked, vllm_params
from opsd.evaluation.requests import ListSource, plan_requests

PROMPT_LEN = 128


def draw_lengths(count: int, median: float, cap: int, cap_share: float, seed: int) -> list[int]:
    """`count` log-normal lengths with median `median`, the top `cap_share` of the distribution at `cap`."""
    sigma = math.log(cap / median) / NormalDist().inv_cdf(1 - cap_share)
    rng = random.Random(seed)
    return [int(min(cap, max(16, round(rng.lognormvariate(math.log(median), sigma))))) for _ in range(count)]


def model_dir(kind: str, path: Path) -> Path:
    """config.json and tokenizer of the benchmark model; vLLM draws dummy weights."""
    from transformers import Qwen3Config

    from opsd.testing.tiny import build_tokenizer, qwen3_1p7b_shape, tiny_qwen3_shape

    path = path / kind
    if not (path / "config.json").is_file():
        tok = build_tokenizer(path, pad_vocab_to=151936 if kind == "qwen3-1.7b" else 0)
        shape = qwen3_1p7b_shape() if kind == "qwen3-1.7b" else {**tiny_qwen3_shape(), "vocab_size": len(tok)}
        shape.update(
            bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
        dtype = "bfloat16" if kind == "qwen3-1.7b" else "float32"
        Qwen3Config(**shape, dtype=dtype, architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    return path


def start_engine(a, path: Path, max_len: int):
    import torch
    from vllm import LLM

    from opsd.method.engine_env import single_node_engine_env

    single_node_engine_env()
    kwargs = dict(model=str(path), tokenizer=str(path), load_format="dummy", max_model_len=max_len, seed=0)
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = a.gpu_memory_utilization
    else:
        kwargs["dtype"] = "float32"
    if a.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = a.kv_cache_dtype
    return LLM(**kwargs)


def token(i: int, vocab: int) -> int:
    """A prompt token id: ordinary ids, clear of the special ones at both ends of the vocabulary."""
    return 10 + i % (vocab - 400)


def fixed(llm, batch: int, tokens: int) -> float:
    """Tokens per second of `batch` sequences of exactly `tokens` new tokens."""
    from opsd.evaluation.sampling import SamplingConfig

    vocab = llm.llm_engine.model_config.get_vocab_size()

    prompts = [
        {"prompt_token_ids": [token(i * 7 + j, vocab) for j in range(PROMPT_LEN)]} for i in range(batch)
    ]
    params = SamplingConfig(max_tokens=tokens, temperature=1.0, seed=0).vllm(ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / dt


def workload(a):
    """(config, problems, lengths {(problem, sample): tokens}, cap) of the benchmark."""
    config = EvalConfig(out="unused", n=a.n, max_tokens=a.cap, temperature=1.0, top_p=0.95, seed=0)
    problems = [{"id": f"b{p:03d}", "index": p, "answer": "0"} for p in range(a.problems)]
    cap = max(16, round(a.cap * a.scale))
    drawn = draw_lengths(a.problems * a.n, a.median * a.scale, cap, a.cap_share, a.seed)
    lengths = {(p["index"], i): drawn[p["index"] * a.n + i] for p in problems for i in range(a.n)}
    return config, problems, lengths, cap


def make_prompts(llm, problems) -> dict[str, list[int]]:
    vocab = llm.llm_engine.model_config.get_vocab_size()
    return {p["id"]: [token(p["index"] * 31 + j * 17, vocab) for j in range(PROMPT_LEN)] for p in problems}


def prompt_of(prompts, lengths):
    """The benchmark's `PromptOf`: a problem's random prompt, each sample's drawn length as its cap."""
    return lambda problem, start: (prompts[problem["id"]], lengths[(problem["index"], start)])


def run_mode(llm, mode: str, a, config, problems, prompt, window: int, source=None) -> dict:
    """One pass over the workload through eval_aime.py's loop; returns wall time and tokens."""
    if source is None:  # else a claim queue, which builds its own requests
        source = ListSource(
            plan_requests(
                problems, set(), a.n, config.seed, prompt, per_sample=True, sample_major=mode != "chunked"
            )
        )
    got = {"tokens": 0, "samples": 0}

    def on_finished(done):
        for r, outputs in done:
            [o] = outputs
            assert len(o.token_ids) == r.max_tokens, (len(o.token_ids), r.max_tokens)
            got["tokens"] += len(o.token_ids)
            got["samples"] += 1

    kwargs = dict(
        window=window, params=lambda r: vllm_params(config, r, ignore_eos=True), on_finished=on_finished
    )
    t0 = time.perf_counter()
    if mode == "chunked":
        stream_chunked(llm, source, chunk=a.chunk_size * a.n, **kwargs)
    else:
        stream(llm, source, **kwargs)
    wall = time.perf_counter() - t0
    return {"mode": mode, "wall_s": wall, "tokens": got["tokens"], "samples": got["samples"],
            "tokens_per_s": got["tokens"] / wall, "t0": time.time() - wall, "t1": time.time()}  # fmt: skip


def measure_speeds(llm, a) -> dict:
    fixed(llm, 4, 32)  # warm-up
    return {
        "peak_tokens_per_s": fixed(llm, a.peak_batch, a.peak_tokens),
        "single_tokens_per_s": fixed(llm, 1, a.peak_tokens),
        "peak_batch": a.peak_batch,
        "peak_tokens": a.peak_tokens,
    }


def single_gpu(a) -> dict:
    config, problems, lengths, cap = workload(a)
    path = model_dir(a.model_config, Path(a.work))
    t0 = time.perf_counter()
    llm = start_engine(a, path, PROMPT_LEN + cap + 16)
    start_s = time.perf_counter() - t0
    prompts = make_prompts(llm, problems)
    import torch

    window = a.max_in_flight or auto_window(llm, PROMPT_LEN, torch.cuda.is_available())
    speeds = measure_speeds(llm, a)
    prior = load(a.out) if a.merge else {}
    if prior and prior.get("config") != bench_config(a, cap):
        print(f"{a.out} holds another configuration; starting it anew", flush=True)
        prior = {}
    rows = {r["mode"]: r for r in prior.get("rows", [])}
    for mode in a.modes:
        row = run_mode(llm, mode, a, config, problems, prompt_of(prompts, lengths), window)
        row.pop("t0"), row.pop("t1")
        rows[mode] = {**row, "max_in_flight": window, "speeds": speeds, "engine_start_s": start_s}
        print(json.dumps(rows[mode]), flush=True)
        result = record(a, list(rows.values()), lengths, cap, speeds)
        write(result, a.out)
    return result


# H200 HBM bandwidth (vendor figure), for the KV-read bound below.
HBM_BYTES_PER_S = 4.8e12


def kv_bytes_per_token(kind: str) -> int:
    """Bytes of K and V cached per token over all layers (bf16 for the Qwen3-1.7B shape, fp32 for tiny)."""
    from opsd.testing.tiny import qwen3_1p7b_shape, tiny_qwen3_shape

    shape = qwen3_1p7b_shape() if kind == "qwen3-1.7b" else tiny_qwen3_shape()
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    dtype_bytes = 2 if kind == "qwen3-1.7b" else 4
    return 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * dtype_bytes


def kv_read_bound_s(
    lengths, prompt_len: int, bytes_per_token: int, bandwidth: float = HBM_BYTES_PER_S
) -> float:
    """Seconds to read the KV cache once per decoded token: a sample decoding its t-th token attends to
    prompt_len + t cached tokens, so a sample of length L reads sum_t (prompt_len + t) tokens' K and V. Every
    schedule has to do these reads; at long lengths they, not the weights, bound decode speed."""
    reads = sum(length * prompt_len + length * (length - 1) / 2 for length in lengths)
    return reads * bytes_per_token / bandwidth


def record(a, rows: list[dict], lengths, cap: int, speeds: dict) -> dict:
    total = sum(lengths.values())
    bound = max(max(lengths.values()) / speeds["single_tokens_per_s"], total / speeds["peak_tokens_per_s"])
    kv_bound = kv_read_bound_s(lengths.values(), PROMPT_LEN, kv_bytes_per_token(a.model_config))
    by_mode = {r["mode"]: r for r in rows}
    speedup = None
    if "chunked" in by_mode and "streaming" in by_mode:
        speedup = by_mode["chunked"]["wall_s"] / by_mode["streaming"]["wall_s"]
    ordered = sorted(lengths.values())
    return {
        "benchmark": "eval_throughput",
        "machine": machine(),
        "config": bench_config(a, cap),
        "lengths": {
            "total": total,
            "mean": total / len(ordered),
            "median": ordered[len(ordered) // 2],
            "max": ordered[-1],
            "at_cap": sum(x == cap for x in ordered),
        },  # fmt: skip
        "speeds": speeds,
        "lower_bound_s": bound,
        # The bound above takes throughput from short (1,024-token) contexts; this one adds what long
        # contexts cost: reading every cached token once per decode step at the full HBM bandwidth.
        "kv_read_bound_s": kv_bound,
        "rows": rows,
        "speedup": speedup,
    }


def bench_config(a, cap: int) -> dict:
    return {
        "model": f"{a.model_config} shape, dummy weights (vLLM load_format=dummy)",
        "problems": a.problems, "n": a.n, "prompt_tokens": PROMPT_LEN, "median": a.median, "cap": a.cap,
        "cap_share": a.cap_share, "scale": a.scale, "scaled_cap": cap, "chunk_size": a.chunk_size,
        "max_in_flight": a.max_in_flight, "seed": a.seed, "num_gpus": a.num_gpus, "kv_cache_dtype": a.kv_cache_dtype,
    }  # fmt: skip


def load(path: str) -> dict:
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else {}


# --- two GPUs: dynamic balancing against static striping --------------------------------------------------


def barrier(work: Path, name: str, rank: int, world: int) -> None:
    (work / f"{name}-r{rank}").touch()
    while not all((work / f"{name}-r{r}").exists() for r in range(world)):
        time.sleep(0.05)


def worker(a) -> None:
    from opsd.evaluation.workers import ClaimQueue, write_queue

    rank, world = (int(x) for x in a.worker.split("/"))
    work = Path(a.work) / "balance"
    config, problems, lengths, cap = workload(a)
    llm = start_engine(a, model_dir(a.model_config, Path(a.work)), PROMPT_LEN + cap + 16)
    prompt = prompt_of(make_prompts(llm, problems), lengths)
    import torch

    window = a.max_in_flight or auto_window(llm, PROMPT_LEN, torch.cuda.is_available())
    speeds = measure_speeds(llm, a)
    rows = []
    for balance in ("dynamic", "static"):
        if balance == "dynamic" and rank == 0:
            requests = plan_requests(
                problems, set(), a.n, config.seed, prompt, per_sample=True, sample_major=True
            )
            write_queue(work / "queue", requests, world)
        barrier(work, f"ready-{balance}", rank, world)
        if balance == "dynamic":
            source = ClaimQueue(work / "queue", rank, problems, config.seed, prompt)
            row = run_mode(llm, "streaming", a, config, problems, prompt, window, source=source)
        else:
            row = run_mode(llm, "streaming", a, config, problems[rank::world], prompt, window)
        rows.append({**row, "balance": balance, "rank": rank})
        barrier(work, f"done-{balance}", rank, world)
    (work / f"rows-r{rank}.json").write_text(json.dumps({"rows": rows, "speeds": speeds}))


def two_gpus(a) -> dict:
    import shutil

    work = Path(a.work) / "balance"
    shutil.rmtree(work, ignore_errors=True)
    (work / "queue").mkdir(parents=True)
    model_dir(a.model_config, Path(a.work))  # once, before the workers read it
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *sys.argv[1:], "--worker", f"{r}/2"],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": str(r)},
        )  # fmt: skip
        for r in range(2)
    ]
    if any(p.wait() for p in procs):
        raise SystemExit("a worker failed")
    per_rank = [json.loads((work / f"rows-r{r}.json").read_text()) for r in range(2)]
    _, _, lengths, cap = workload(a)
    rows = []
    for balance in ("dynamic", "static"):
        mine = [row for w in per_rank for row in w["rows"] if row["balance"] == balance]
        wall = max(r["t1"] for r in mine) - min(r["t0"] for r in mine)
        tokens = sum(r["tokens"] for r in mine)
        rows.append({"mode": f"streaming-{balance}", "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                     "per_worker": [{k: r[k] for k in ("rank", "wall_s", "tokens", "samples")} for r in mine]})  # fmt: skip
    speeds = per_rank[0]["speeds"]
    # Two engines: the throughput bound halves, the longest sample still decodes on one of them.
    result = record(a, rows, lengths, cap, {**speeds, "peak_tokens_per_s": 2 * speeds["peak_tokens_per_s"]})
    result["speedup"] = rows[1]["wall_s"] / rows[0]["wall_s"]  # static / dynamic
    result["speeds_per_engine"] = speeds
    write(result, a.out)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", choices=("qwen3-1.7b", "tiny"), default="qwen3-1.7b")
    ap.add_argument("--work", default="/tmp/eval-throughput", help="model config and scratch files")
    ap.add_argument("--problems", type=int, default=30)
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--median", type=float, default=12000, help="median sample length (tokens)")
    ap.add_argument("--cap", type=int, default=38912, help="length cap (tokens)")
    ap.add_argument("--cap-share", type=float, default=0.15, help="share of samples at the cap")
    ap.add_argument("--scale", type=float, default=0.35, help="multiplies every length and the cap")
    ap.add_argument("--seed", type=int, default=0, help="seed of the length draw")
    ap.add_argument("--modes", nargs="+", choices=("chunked", "streaming"), default=["chunked", "streaming"])
    ap.add_argument("--chunk-size", type=int, default=8, help="problems per chunk of the chunked mode")
    ap.add_argument("--max-in-flight", type=int, default=0, help="0 = eval_aime.py's default")
    ap.add_argument("--peak-batch", type=int, default=256)
    ap.add_argument("--peak-tokens", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="eval_aime.py's flag")
    ap.add_argument("--num-gpus", type=int, choices=(1, 2), default=1)
    ap.add_argument(
        "--no-merge", dest="merge", action="store_false", help="overwrite --out instead of merging"
    )
    ap.add_argument("--out", default="bench/results/eval_throughput_h200.json")
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    result = two_gpus(a) if a.num_gpus == 2 else single_gpu(a)
    print(f"lower bound {result['lower_bound_s']:.1f} s; lengths {result['lengths']}")
    for r in result["rows"]:
        print(
            f"{r['mode']:>18}  {r['wall_s']:8.1f} s  {r['tokens']:>10,} tokens  {r['tokens_per_s']:9.0f} tok/s"
        )
    if result["speedup"]:
        print(f"speedup {result['speedup']:.2f}x")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
