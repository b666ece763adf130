"""The allowed values of every choice switch, declared once.

`OPSDConfig` validates its fields against these (and hands them to the CLI parser as `choices`), the
recipe parser checks `recipe.env` / `OPSD_*` values against them, and the data modules validate their own
arguments with the same tuples. The loss checks nothing again: its settings come from a checked config
(`opsd.method.loss.loss_settings`). `parse_micro_batch_size` reads the one switch that is a choice or a number
(`micro_batch_size`: auto, a positive integer or unset). No dependencies, so any module can import it.
"""

from __future__ import annotations

from typing import Literal

# What a run trains: self-distillation, TRL's GRPO, or GRPO plus the self-distillation loss (docs/method.md §6).
METHODS = ("opsd", "grpo", "hybrid")
CLIP_MODES = ("element", "token", "rescale", "none")
LOSS_TYPES = ("jsd", "sampled_token", "fixed_advantage")
TEACHER_MODES = ("fixed", "ema", "dynamic")
TEACHER_REFS = ("solution", "cot", "answer")
TEACHER_CONTRASTS = ("none", "shuffled", "wrong_answer", "own_wrong")
# Per-token loss weights (opsd.method.token_weights).
TOKEN_WEIGHTS = ("none", "position_early", "position_late", "entropy_gate", "positive_only")
# The training table's column each `teacher_ref` reads (the data checks it, the prompts read it).
REFERENCE_COLUMNS = {"solution": "solution", "cot": "COT_Reason", "answer": "Answer"}
TEACHER_REF_PAIRINGS = ("matched", "shuffled", "empty")
DATA_FILTERS = ("none", "numeric", "hard_numeric")
# vLLM's KV cache in evaluation: the model's dtype, or 8-bit floats (half the cache's reads on Hopper GPUs).
KV_CACHE_DTYPES = ("auto", "fp8")
ROLLOUT_ENGINES = ("auto", "vllm", "transformers")
DTYPES = ("auto", "bfloat16", "float16", "float32")

# OPSDConfig field -> allowed values.
CHOICES: dict[str, tuple[str, ...]] = {
    "method": METHODS,
    "clip_mode": CLIP_MODES,
    "loss_type": LOSS_TYPES,
    "teacher_mode": TEACHER_MODES,
    "teacher_ref": TEACHER_REFS,
    "teacher_ref_pairing": TEACHER_REF_PAIRINGS,
    "teacher_contrast": TEACHER_CONTRASTS,
    "token_weight": TOKEN_WEIGHTS,
    "data_filter": DATA_FILTERS,
    "rollout_engine": ROLLOUT_ENGINES,
    "dtype": DTYPES,
}


def check_choice(name: str, value: str, allowed: tuple[str, ...] | None = None) -> None:
    """ValueError naming the switch, the bad value and the allowed ones."""
    allowed = CHOICES[name] if allowed is None else allowed
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {list(allowed)}")


# micro_batch_size (memory, not method) is no plain choice: auto, a number of rows, or unset.
AUTO = "auto"
# micro_batch_size once parsed.
MicroBatchSize = int | Literal["auto"] | None


def parse_micro_batch_size(value: str | int | None) -> MicroBatchSize:
    """None for unset ("" or None), `AUTO` for auto (any case), else a positive int; ValueError naming the allowed
    values. A value already parsed is returned as it is (`dataclasses.replace` of a config parses it again)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        return value
    text = str(value).strip().lower()
    if text in ("", AUTO):
        return text or None
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise ValueError(
        f"micro_batch_size={value!r} is not allowed; give auto, a positive integer that divides the problems "
        "per process per step, or leave it unset (per_device_train_batch_size as given)"
    )
