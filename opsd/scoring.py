"""Scoring completions under one role: position ids, padding, and the final hidden states of completion tokens.

Torch-only, shared by the trainer and the benchmarks. Rows are laid out `[left-padded prompt ; right-padded
completion]`; positions are computed from the masks so padding never shifts a real token (docs/method.md §1.2).
"""

from __future__ import annotations

import torch


def positions(prompt_mask_BP: torch.Tensor, completion_width: int, fix: bool) -> torch.Tensor:
    """Position ids of `[left-padded prompt ; completion]` rows, shape (B, P + C).

    `fix=True`: each real token's index in its own unpadded sequence (prompt tokens 0..Lp-1, completion
    tokens Lp, Lp+1, ...), which is what the rollout engine used. `fix=False`: the reference code's layout
    (prompts right-padded to width P, completions appended), i.e. completion token j sits at P + j.
    Padding tokens get position 0; they are masked out of attention anyway.
    """
    prompt_len_B = prompt_mask_BP.sum(dim=1, keepdim=True)
    pos_prompt = (prompt_mask_BP.cumsum(dim=1) - 1).clamp(min=0)
    start_B1 = prompt_len_B if fix else torch.full_like(prompt_len_B, prompt_mask_BP.size(1))
    pos_completion = start_B1 + torch.arange(completion_width, device=prompt_mask_BP.device)
    return torch.cat([pos_prompt * prompt_mask_BP, pos_completion], dim=1)


def _pad(seqs: list[list[int]], pad_id: int, device, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            cols = slice(width - len(s), width) if left else slice(0, len(s))
            ids[i, cols] = torch.tensor(s, dtype=torch.long)
            mask[i, cols] = 1
    return ids.to(device), mask.to(device)


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of prompts padded on the left to the longest one, shape (B, P)."""
    return _pad(seqs, pad_id, device, left=True)


def right_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of completions padded on the right to the longest one, shape (B, C)."""
    return _pad(seqs, pad_id, device, left=False)


def completion_hidden(
    model, prompt_ids_BP, prompt_mask_BP, completion_ids_BC, completion_mask_BC, *, fix_positions: bool = True
) -> torch.Tensor:
    """Final hidden states (after the last norm) that predict each valid completion token, flattened to (N, H).

    The forward goes through the model object it is given (so DDP/DeepSpeed wrappers see it) and asks for
    logits at the last position only; the completion's logits are computed later, in chunks, by the loss.
    """
    input_ids = torch.cat([prompt_ids_BP, completion_ids_BC], dim=1)
    attention_mask = torch.cat([prompt_mask_BP, completion_mask_BC], dim=1)
    position_ids = positions(prompt_mask_BP, completion_ids_BC.size(1), fix_positions)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        output_hidden_states=True,
        logits_to_keep=1,
    )
    width = prompt_ids_BP.size(1)
    hidden_BCH = out.hidden_states[-1][:, width - 1 : width - 1 + completion_ids_BC.size(1)]
    return hidden_BCH[completion_mask_BC.bool()]


def lm_head_weight(model) -> torch.Tensor:
    """The output projection (V, H) of a causal LM (PEFT and accelerate wrappers unwrapped by the caller)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("models whose lm_head has a bias are not supported by the chunked loss")
    return head.weight
