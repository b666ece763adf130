"""The environment every vLLM engine of this repo starts with: training's colocated engine, evaluation's
and the benchmarks'.

vLLM's distributed init binds to VLLM_HOST_IP, by default the host's outward address; where that address is
unreachable (an isolated or firewalled node) the engine waits forever after "Using V2 Model Runner". Every
engine of this repo is single-node, so loopback is always right. On a CPU, vLLM's KV cache gets a bounded
size (VLLM_CPU_KVCACHE_SPACE). A user's own setting of either wins.

`OPSD_KV_CACHE_GIB` (set by `python -m opsd.experiment` when several jobs share one GPU) gives every engine
the process starts exactly that much KV cache: the entry points read it (`kv_cache_bytes`) and pass it to the
engines' constructors (nothing of vLLM is patched). vLLM otherwise sizes it from a start-up memory profile of the
whole GPU, which fails when another process allocates or frees memory meanwhile ("No available memory for the
cache blocks", "Error in memory profiling"); with a fixed size it skips that profile.

On vLLM's CPU platform a model with multi-head latent attention (DeepSeek-V2/V3's MLA) runs vLLM's reference MLA
backend, `CPU_MLA` (`cpu_mla_backend`), in training's engine (`opsd.method.engine.engine_arguments`) and in
evaluation's and the benchmarks' (`opsd.evaluation.sampling.llm_arguments`) alike. On a CPU with AMX, vLLM would otherwise pick its `AMX_MLA` backend, which
takes bfloat16 weights only, refuses a `qk_nope_head_dim` that is not a multiple of 32 ("invalid weight input
features 16") and frees `kv_b_proj` once it has packed it, so that a weight push then fails ("The size of tensor a
(0) must match the size of tensor b (512)"): a training engine, which takes a push every step, cannot use it.
"""

from __future__ import annotations

import logging
import math
import os

from opsd.configuration.switches import KV_CACHE_ENV
from opsd.errors import InvalidValue

logger = logging.getLogger(__name__)

SINGLE_NODE_ENGINE_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "2"}


# A training process: colocated vLLM runs in it (the trainer pushes weights into the engine), and TRL's
# experimental trainers are imported without their warning.
TRAINING_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TRL_EXPERIMENTAL_SILENCE": "1"}


def training_process_env(environ=os.environ) -> None:
    """The environment of a process that trains or checks a training run, set before vLLM or TRL load (a
    user's own setting of each wins): `TRAINING_PROCESS_ENV` and the single-node engine settings."""
    for name, value in TRAINING_PROCESS_ENV.items():
        environ.setdefault(name, value)
    single_node_engine_env(environ)


def single_node_engine_env(environ=os.environ) -> None:
    """Fill in the engine settings above that the environment does not set already."""
    for name, value in SINGLE_NODE_ENGINE_ENV.items():
        environ.setdefault(name, value)


# vLLM's reference MLA backend on a CPU; on a CPU with AMX, vLLM prefers AMX_MLA unless this is asked for.
CPU_MLA_BACKEND = "CPU_MLA"


def cpu_mla_backend(text_config) -> dict[str, str]:
    """The engine argument that runs a model with multi-head latent attention (a `kv_lora_rank` in its text
    config, as vLLM tells MLA) on vLLM's `CPU_MLA` backend on the CPU platform (module docstring); {} for any other
    model or platform."""
    if getattr(text_config, "kv_lora_rank", None) is None:
        return {}
    from vllm.platforms import current_platform

    return {"attention_backend": CPU_MLA_BACKEND} if current_platform.is_cpu() else {}


def kv_cache_gib(environ=os.environ) -> float | None:
    """The fixed KV cache asked for by `OPSD_KV_CACHE_GIB`, in GiB (None when unset or empty)."""
    raw = environ.get(KV_CACHE_ENV, "").strip()
    if not raw:
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib <= 0:
        raise InvalidValue(f"{KV_CACHE_ENV}={raw!r}: give a positive number of GiB (e.g. 1.5), or unset it")
    return gib


def kv_cache_bytes(environ=os.environ) -> int | None:
    """The engine argument `kv_cache_bytes` that `OPSD_KV_CACHE_GIB` asks for (None when unset): the entry points
    read it once and pass it to the engines they build (`kv_cache_memory_bytes` of vLLM's `LLM`)."""
    gib = kv_cache_gib(environ)
    return None if gib is None else int(gib * 2**30)
