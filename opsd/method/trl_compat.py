"""Where the repository meets TRL and transformers below their public API: a narrow patch, and the one list of the
private names it touches.

- `restore_lora_dropout`: TRL's `disable_dropout` zeroes LoRA's dropout too.
- `PRIVATE_LIBRARY_NAMES`: every private name of a TRL, transformers, accelerate, peft or vLLM class that a shipped
  file (the entry points, OPSD's trainer, the GRPO arms, the whole package) overrides, calls, reads or writes, with
  why; tests/integration/test_trl_hooks.py finds them in the code and fails on any other.
"""

from __future__ import annotations

import torch

PRIVATE_LIBRARY_NAMES = {
    # OPSD's trainer (opsd_trainer.py), on TRL's SDFTTrainer and transformers' Trainer
    "_prepare_inputs": "transformers' one per-micro-batch input hook: each micro-batch of the window is handed out here",
    "_save": "a checkpoint holds the student adapter alone, at its root (peft puts each of two adapters in a subfolder)",
    "_load_optimizer_and_scheduler": "the one hook every resume runs before the first step, on every backend: restores the EMA teacher",
    "_name": "the model card's name, a declaration every TRL trainer sets for its own card and TRL only reads",
    "_paper": "the model card's citation: the method trained here, where TRL's SDFTTrainer would cite SDFT",
    "_tag_names": "the model card's tags, a declaration every TRL trainer sets for its own card and TRL only reads",
    # the GRPO arms (opsd/rl), on TRL's GRPOTrainer
    "_tokenize_prompts": "GRPOTrainer's one step from a dataset prompt to token ids: the arms render OPSD's student prompt there",
    "_generate_single_turn": "GRPOTrainer's one generation call per batch: the arms seed the engine's rows by the step and time the rollout",
    "_generate_and_score_completions": "GRPOTrainer's batch once rollouts are scored: the arms add their routes, teacher rows and metrics",
    "_get_per_token_logps_and_entropies": "GRPOTrainer's scorer of the sampled tokens: the arms score them under the sampler's own distribution",
    "_compute_loss": "GRPOTrainer's loss of a micro-batch: the hybrid arm adds sd_weight x the OPSD loss on the same rollouts",
}  # fmt: skip


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
