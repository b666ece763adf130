"""The rollout engine as the trainer and the evaluation drive it: every request with its own seed, and new
weights pushed into the running engine.

Seeds. TRL passes one `SamplingParams` for a whole generate call; with one seed in it every request would draw the
same random numbers (identical samples for a repeated prompt), and without one the rollouts would depend on how
the batch is split. So every row of a generation's global batch gets its own seed, a function of the run's seed,
the step and the row's position in that batch (`row_seed`). The probe's frozen rollouts are seeded as if from a
step no training step uses (`PROBE_STEP`).

Weights. `merged_named_weights` turns a peft model into plain checkpoint-format weights (LoRA merged out of
place); `push_weights` loads such weights, or a checkpoint directory, into the engine in place through vLLM's
`reload_weights`, the one path that works on vLLM's CPU backend (per-parameter `load_weights` fails there), so
an engine started once can serve the base model and any number of checkpoints (eval_aime.py's sweeps);
`sync_colocated_engine` is the trainer's push before a generation.

Engine. The colocated engine runs at the trainer's dtype (`engine_arguments`: TRL starts vLLM without one, and
vLLM's CPU backend would run a float32 model in bfloat16, so rollouts would come from another model than the one the
loss scores), an MLA model on vLLM's CPU_MLA backend on a CPU (`opsd.method.engine_env.cpu_mla_backend`),
and returns the log-prob of every sampled token (`rollout/logprob_gap`, `opsd.run.logprob_gap`). A failure of
vLLM's once it is up (a push, a generation) is one line, as at its start (`opsd.method.engine_classes`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)

PROBE_STEP = -1


def row_seed(seed: int, step: int, position: int) -> int:
    """Seed of the rollout at `position` of step `step`'s global batch (< 2**20 rows per step)."""
    return ((seed * 1_000_003 + step) * (1 << 20) + position) % (1 << 62)


def first_rollout_row(process_index: int, tensor_parallel_size: int, num_rows: int) -> int:
    """Global position in a generation's batch of the first of this process's `num_rows` colocated prompts.

    Each process generates its contiguous share of the global generation batch (TRL's sampler), and a
    tensor-parallel group generates the shares of its ranks in rank order, so the position is the group's first
    rank x rows per rank. Hence every row has its own seed (repeated prompts get different samples), a resumed
    run draws the same rollouts, and the rollouts do not depend on how many processes share the batch.
    """
    first = process_index // tensor_parallel_size * tensor_parallel_size
    return first * (num_rows // tensor_parallel_size)


class RolloutSeeds:
    """The seeds of a run's rollouts: `for_rows(first, n)` for n rows starting at global position `first` of
    step `current_step` (set by the engine before each generation), or of the probe inside `probe()`."""

    def __init__(self, seed: int):
        self.seed = seed
        self.current_step = 0
        self._override: int | None = None

    @property
    def step(self) -> int:
        return self.current_step if self._override is None else self._override

    def at_step(self, step: int) -> None:
        """The rows generated next are step `step`'s."""
        self.current_step = step

    def for_rows(self, first: int, n: int) -> list[int]:
        return [row_seed(self.seed, self.step, first + j) for j in range(n)]

    @contextmanager
    def probe(self):
        """Inside the block, seeds are those of the probe's rollouts."""
        self._override = PROBE_STEP
        try:
            yield
        finally:
            self._override = None


# -- weights ------------------------------------------------------------------------------------------------
def merged_named_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of the model with its active LoRA adapter merged, in checkpoint naming.

    Computed as base + delta without touching the base weights; other parameters are yielded as they are. Names
    and layouts are the checkpoint's, as `save_pretrained` writes them: transformers renames some families'
    weights when it loads them (Granite's MoE router and experts, for one), and the engine reads the names on disk.
    """
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    yield from checkpoint_format(base, dict(_merged(model)))


def _merged(model) -> Iterator[tuple[str, torch.Tensor]]:
    yield from _merged_parameters(model)
    yield from _persistent_buffers(model)


def _persistent_buffers(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint holds (DeepSeek-V3's router score-correction bias): the engine's reload leaves a
    weight it is not given uninitialised."""
    from peft import PeftModel

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    for module_name, module in base.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                full = f"{module_name}.{name}" if module_name else name
                yield full.replace(".base_layer.", "."), buffer.detach()


def _merged_parameters(model) -> Iterator[tuple[str, torch.Tensor]]:
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        for name, p in model.named_parameters():
            yield name, p.detach()
        return
    from peft.tuners.lora import LoraLayer, ParamWrapper

    base = model.get_base_model()
    adapter = model.active_adapter
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        if ".base_layer." not in name:
            yield name, p.detach()
            continue
        # `a.b.base_layer[.base_layer...].leaf`: a LoRA module at `a.b`, or nested parameter wrappers there (one per
        # adapted parameter: peft's target_parameters, e.g. the routed experts' fused `gate_up_proj`)
        module_path, _, rest = name.partition(".base_layer.")
        leaf = rest.replace("base_layer.", "")
        value = p.detach()
        module = base.get_submodule(module_path)
        while isinstance(module, LoraLayer) and "." not in leaf:  # a parameter of the wrapped module itself
            wrapped = module.parameter_name if isinstance(module, ParamWrapper) else "weight"
            if leaf == wrapped and adapter in module.lora_A:
                value = value + module.get_delta_weight(adapter).to(value.dtype)
            module = module.base_layer
        yield f"{module_path}.{leaf}", value


def checkpoint_format(model, state: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """`state` (in the loaded model's naming) renamed and reshaped back to the checkpoint's, as save_pretrained
    does it; unchanged for the families transformers loads as they are stored."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers that loads every family under its checkpoint names
        yield from state.items()
        return
    yield from revert_weight_conversion(model, state).items()


def push_weights(
    llm,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    *,
    path: str | None = None,
    tie_word_embeddings: bool,
) -> None:
    """Load `weights` ((name, tensor) pairs in checkpoint naming) or the checkpoint at `path` into the
    running `vllm.LLM` in place, then drop the prefix cache (its KV entries came from the old weights).

    Reloading in checkpoint format re-runs vLLM's post-load processing (on the CPU backend, the packing of
    float32 linear weights for oneDNN). A tied lm_head shares the embedding's checkpoint tensor, so on the
    CPU backend its packed copy is rebuilt from the reloaded embedding."""
    if (weights is None) == (path is None):
        raise ValueError("push_weights needs exactly one of weights or path")
    kwargs = {"is_checkpoint_format": True}
    if weights is not None:
        kwargs["weights_iterator"] = list(weights)
    else:
        kwargs["weights_path"] = path
    llm.collective_rpc("reload_weights", kwargs=kwargs)
    if _cpu_backend():
        llm.apply_model(repack_cpu_experts)
        if tie_word_embeddings:
            llm.apply_model(repack_tied_heads)
    llm.reset_prefix_cache()


def repack_cpu_experts(model: torch.nn.Module) -> int:
    """Pack again, for the CPU backend's fused-MoE kernel, the expert weights of every mixture-of-experts layer of
    the engine's `model` after a reload; returns how many layers were packed.

    vLLM 0.32 packs expert weights for its CPU kernel only when the layer's kernel is first set up: a reload
    processes the layer again but, the kernel being set up already, leaves the reloaded weights in checkpoint
    layout, and the kernel then reads them as packed (the rollouts of a Qwen3-MoE or DeepSeek-V3 engine move away
    from the model's own distribution on the first push, even of unchanged weights)."""
    packed = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            experts.process_weights_after_loading(module)
            packed += 1
    return packed


def repack_tied_heads(model: torch.nn.Module) -> int:
    """Rebuild the CPU backend's packed copy of the output head of the engine's `model` (a tied model's, whose
    head shares the embedding's weight); returns how many heads were rebuilt.

    A tied head's weight is not in the checkpoint, so the reload never re-processes the head itself and its
    packed copy would keep the old embedding. Heads are found by type, not by name: several tied vLLM classes
    (Gemma 2, Cohere) have no `lm_head` and compute their logits from the embedding module itself, which the
    reload re-processes like any other module; for them there is nothing to rebuild."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    for head in heads:
        head.quant_method.process_weights_after_loading(head)
    return len(heads)


def _cpu_backend() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def sync_colocated_engine(generation, model, *, on_cpu: bool) -> None:
    """Pushes `model`'s merged weights (LoRA folded in, computed out of place) into TRL's colocated engine
    (`generation`, a `VLLMGeneration`). Out of place because TRL's merge_adapter/unmerge_adapter round trip
    perturbs the base weights by rounding error, which would slowly move the fixed teacher."""
    weights = list(merged_named_weights(model))
    llm = generation.llm
    if on_cpu:
        # vLLM's CPU backend packs float32 linear weights for oneDNN, so per-parameter `load_weights` fails;
        # reloading in checkpoint format re-runs that packing, and a tied lm_head is rebuilt.
        tied = model.config.get_text_config().tie_word_embeddings
        push_weights(llm, weights, tie_word_embeddings=tied)
        return
    if generation.enable_sleep_mode:  # TRL's `generate` calls this before each generation (the weights slept)
        llm.wake_up(tags=["weights"])
    llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)
    llm.reset_prefix_cache()


# -- TRL's engine -------------------------------------------------------------------------------------------
def weights_dtype(model) -> torch.dtype:
    """The dtype of `model`'s own weights (its input embedding's: a peft model's float32 adapters on a bfloat16
    base do not count), the one its forwards compute in."""
    return model.get_input_embeddings().weight.dtype


def engine_arguments(model) -> dict:
    """What OPSD's colocated engine starts with beside TRL's arguments, for the trainer's `model`: its dtype, and
    vLLM's CPU_MLA backend for an MLA model on a CPU (`opsd.method.engine_env.cpu_mla_backend`)."""
    from opsd.method.engine_env import cpu_mla_backend

    dtype = str(weights_dtype(model)).removeprefix("torch.")
    return {"dtype": dtype, **cpu_mla_backend(model.config.get_text_config())}


def prefill_groups(lengths: list[int], budget: int, max_seqs: int) -> list[slice]:
    """Consecutive groups of prompts (by their token `lengths`) that prefill together in one scheduler step: at
    most `budget` prompt tokens and `max_seqs` prompts each (a prompt longer than the budget alone)."""
    groups, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (tokens + n > budget or i - start >= max_seqs):
            groups.append(slice(start, i))
            start, tokens = i, 0
        tokens += n
    if lengths:
        groups.append(slice(start, len(lengths)))
    return groups
