"""Run a script with every vLLM engine it starts given a fixed KV cache, so several can share one GPU.

    KV_CACHE_GIB=1 python bench/shared_gpu.py opsd_train.py --output_dir runs/a ...

vLLM sizes its KV cache from a start-up memory profile that reads the whole GPU's free memory. Engines
started side by side see each other's allocations and frees during that profile and fail ("No available
memory for the cache blocks", "Error in memory profiling"). With `kv_cache_memory_bytes` vLLM skips the
profile and reserves exactly that much, whatever the other processes do. Benchmarks only: the entry points
keep vLLM's own sizing (`vllm_gpu_memory_utilization`).
"""

from __future__ import annotations

import os
import runpy
import sys


def _fix_kv_cache(gib: float) -> None:
    import dataclasses

    import vllm
    from vllm.engine.arg_utils import EngineArgs

    if "kv_cache_memory_bytes" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        print(
            "shared_gpu: this vLLM has no kv_cache_memory_bytes; keeping its memory profile", file=sys.stderr
        )
        return
    original = vllm.LLM.__init__

    def init(self, *args, **kwargs):
        kwargs.setdefault("kv_cache_memory_bytes", int(gib * 2**30))
        original(self, *args, **kwargs)

    vllm.LLM.__init__ = init


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: KV_CACHE_GIB=1 python bench/shared_gpu.py SCRIPT [ARGS...]")
    gib = float(os.environ.get("KV_CACHE_GIB", "0") or 0)
    if gib > 0:
        _fix_kv_cache(gib)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
