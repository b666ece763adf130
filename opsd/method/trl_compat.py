"""Where TRL's SDFTTrainer does something OPSD must not, and has no setting for it: a narrow patch.

- `restore_lora_dropout`: TRL's `disable_dropout` zeroes LoRA's dropout too.
"""

from __future__ import annotations

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
