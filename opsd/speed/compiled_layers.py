"""`compile_layers`: every decoder layer's forward compiled by `torch.compile`, for the passes that carry no
KV cache: the student's training forward (and its recompute under gradient checkpointing) and the teacher's
forward. Generation keeps the eager forward: its cache and its length, one token longer at every decode step,
would recompile the layer again and again.

Time, not method: the same operations, fused into fewer kernels (rounding may differ in the last bits). The
layers of one model share their compiled graphs (identical code, parameters passed as inputs), so a model
compiles once per kind of pass (training, teacher with the adapter off, ...) and again when a new sequence
width first makes the shapes dynamic. On an H200 it took the training half of the published step from 2.57 to
1.60 s at 32 x 1024 tokens (docs/performance.md c.5); on a CPU inductor needs a C++ compiler.
"""

from __future__ import annotations

import functools
import logging

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

logger = logging.getLogger(__name__)


def _cache_free(compiled, eager, *args, **kwargs):
    if kwargs.get("past_key_values") is not None:
        return eager(*args, **kwargs)
    return compiled(*args, **kwargs)


def compile_decoder_layers(model: torch.nn.Module, backend: str = "inductor") -> int:
    """Routes each decoder layer of `model` (peft-wrapped or not) through a compiled forward when it is called
    without a KV cache; returns how many layers it found. Parameters, state dict and hooks stay as they were
    (the forward is replaced on the instance, the module is not wrapped), so LoRA merges, checkpoint saves and
    the engine's weight sync see the same modules."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"compile_layers found no decoder layer in {type(model).__name__} (transformers' "
            "GradientCheckpointingLayer); turn compile_layers off for this model"
        )
    for layer in layers:
        eager = layer.forward
        layer.forward = functools.partial(_cache_free, torch.compile(eager, backend=backend), eager)
    logger.info(
        "compile_layers: %d decoder layers compiled (%s) for passes without a KV cache", len(layers), backend
    )
    return len(layers)


def compiled_graphs() -> int:
    """Graphs torch.compile has captured in this process so far: the first compile of each kind of pass, then one
    per recompilation (a new sequence width first recompiles with dynamic shapes, after which widths share it).
    The trainer logs it as `compile/graphs` each step when compile_layers is on."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
