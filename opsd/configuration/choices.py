"""The allowed values of every choice switch, declared once.

`OPSDConfig` validates its fields against these (and hands them to the CLI parser as `choices`), the
recipe parser checks `recipe.env` / `OPSD_*` values against them, and the data modules validate their own
arguments with the same tuples. The loss checks nothing again: its settings come from a checked config
(`OPSDConfig.loss_settings`). No dependencies, so any module can import it.
"""

from __future__ import annotations

CLIP_MODES = ("element", "token", "rescale", "none")
LOSS_TYPES = ("jsd", "sampled_token")
TEACHER_MODES = ("fixed", "ema", "dynamic")
TEACHER_REFS = ("solution", "cot")
TEACHER_REF_PAIRINGS = ("matched", "shuffled", "empty")
DATA_FILTERS = ("none", "numeric", "hard_numeric")
ROLLOUT_ENGINES = ("auto", "vllm", "transformers")
DTYPES = ("auto", "bfloat16", "float16", "float32")

# OPSDConfig field -> allowed values.
CHOICES: dict[str, tuple[str, ...]] = {
    "clip_mode": CLIP_MODES,
    "loss_type": LOSS_TYPES,
    "teacher_mode": TEACHER_MODES,
    "teacher_ref": TEACHER_REFS,
    "teacher_ref_pairing": TEACHER_REF_PAIRINGS,
    "data_filter": DATA_FILTERS,
    "rollout_engine": ROLLOUT_ENGINES,
    "dtype": DTYPES,
}


def check_choice(name: str, value: str, allowed: tuple[str, ...] | None = None) -> None:
    """ValueError naming the switch, the bad value and the allowed ones."""
    allowed = CHOICES[name] if allowed is None else allowed
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {list(allowed)}")
