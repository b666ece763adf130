"""Shared pieces of the GPU benchmarks: the random-weight Qwen3-1.7B checkpoint and the JSON record."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch

# What the trainer logs per optimizer step (StepTimer and TRL) that the step benchmarks summarise.
STEP_METRICS = [
    "time/step_s",
    "time/rollout_s",
    "time/weight_sync_s",
    "time/train_micro_s",
    "time/score_loss_s",
    "time/optimizer_s",
    "time/grade_wait_s",
    "rollout/tokens_per_s",
    "memory/peak_gib",
    "memory/step_extra_gib",
    "completions/mean_length",
]


def qwen3_1p7b_dir(path: str | Path) -> Path:
    """A random-weight Qwen3-1.7B (bf16) with a locally trained tokenizer padded to its 151,936-token vocabulary."""
    from opsd.testing.tiny import build_qwen3, build_tokenizer, qwen3_1p7b_shape

    path = Path(path)
    if not (path / "config.json").is_file():
        tok = build_tokenizer(path, pad_vocab_to=151936)
        build_qwen3(path, tokenizer=tok, dtype="bfloat16", **qwen3_1p7b_shape())
    return path


def machine() -> dict:
    """The host, its GPU and the package versions (`opsd.run.provenance`, the lookup runs use too)."""
    from opsd.run.provenance import package_versions

    info = {"host": platform.node(), **package_versions()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["gpus"] = torch.cuda.device_count()
    return info


def write(result: dict, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    return out
