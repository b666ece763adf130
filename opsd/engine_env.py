"""The environment every vLLM engine of this repo starts with: training's colocated engine, evaluation's
and the benchmarks'.

vLLM's distributed init binds to VLLM_HOST_IP, by default the host's outward address; where that address is
unreachable (an isolated or firewalled node) the engine waits forever after "Using V2 Model Runner". Every
engine of this repo is single-node, so loopback is always right. On a CPU, vLLM's KV cache gets a bounded
size (VLLM_CPU_KVCACHE_SPACE). A user's own setting of either wins.
"""

from __future__ import annotations

import os

SINGLE_NODE_ENGINE_ENV = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "2"}


def single_node_engine_env(environ=os.environ) -> None:
    """Fill in the engine settings above that the environment does not set already."""
    for name, value in SINGLE_NODE_ENGINE_ENV.items():
        environ.setdefault(name, value)
