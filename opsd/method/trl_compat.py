"""Where TRL's SDFTTrainer does something OPSD must not, and has no setting for it: narrow patches.

- `restore_lora_dropout`: TRL's `disable_dropout` zeroes LoRA's dropout too;
- `engine_max_num_seqs`: TRL sizes the colocated vLLM engine's batch with no setting of its own.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


def restore_lora_dropout(model) -> None:
    """Gives every LoRA dropout of a peft model its adapter's configured `lora_dropout` back.

    TRL's `disable_dropout` (on by default) zeroes every `nn.Dropout` of the student, LoRA's included, which
    would make `lora_dropout` a dead switch; the base model's own dropout stays off.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return
    for name, module in model.named_modules():
        parent, _, adapter = name.rpartition(".")
        if not isinstance(module, torch.nn.Dropout) or not parent.endswith("lora_dropout"):
            continue
        if adapter in model.peft_config:
            module.p = model.peft_config[adapter].lora_dropout


@contextmanager
def engine_max_num_seqs(limit: int):
    """While active, TRL's colocated vLLM engine is built with `max_num_seqs=limit` (if limit > 0).

    TRL sizes it from the batch (per-device batch x TP x steps per generation) inside SDFTTrainer.__init__,
    with no setting of its own. On vLLM's CPU backend the numerics of a decode step depend on how many
    sequences it holds, so a seeded rollout may differ between 1 and 2 processes; one sequence at a time
    makes rollouts independent of how the batch is split.
    """
    if limit <= 0:
        yield
        return
    from trl.generation import vllm_generation

    original = vllm_generation.VLLMGeneration

    class Limited(original):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "max_num_seqs": limit})

    vllm_generation.VLLMGeneration = Limited
    try:
        yield
    finally:
        vllm_generation.VLLMGeneration = original
