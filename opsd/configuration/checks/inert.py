"""Switches that the other settings leave without effect: a value recorded as if it acted, while the run
trains exactly as without it (`fixed_advantage` under `loss_type=jsd`, the teacher's reference under a loss that
reads no teacher).

`inert_fields` names every field the settings leave without effect, whatever its value, with what it needs to
act; `warn_inert` (called by `OPSDConfig.__post_init__`) logs one warning line per such field that is set away
from its default: `fixed_advantage=-1.0 has no effect: it needs loss_type=fixed_advantage (loss_type=jsd reads no
constant advantage)`. A switch another method never reads is refused instead (`opsd.configuration.checks.methods`),
as are the combinations `ranges.check_teacher_variants` names. The experiment compares its arms by their resolved
settings less the fields inert under them (`opsd.experiment.arms.effective_recipe`), so two arms that train alike
are one arm.

Each rule is (fields, when they are inert, what they need); a rule reads the config's attributes only, so any
object with them (a dry run's resolved settings) can be checked. No dependencies, so any module can import it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace

logger = logging.getLogger(__name__)

# What the teacher side of the loss reads: its prompt, its reference, its weights. A loss without a teacher
# (loss_type=fixed_advantage) trains the same whatever they are; the probe's diagnostics still read them.
TEACHER_FIELDS = (
    "teacher_mode", "ema_decay", "teacher_ref", "teacher_ref_pairing", "teacher_ref_fraction", "teacher_ref_max_chars",
    "max_teacher_prompt_length", "teacher_thinking", "teacher_prompt_file",
)  # fmt: skip
# What only the divergence reads: its interpolation and its clip (sampled_token and fixed_advantage have none).
DIVERGENCE_FIELDS = ("beta", "divergence_clip", "clip_mode")
REFERENCE_FIELDS = ("teacher_ref", "teacher_ref_fraction", "teacher_ref_max_chars")
LORA_FIELDS = ("lora_r", "lora_alpha", "lora_dropout")
# The contrastive target's switches (read with any teacher_contrast) and RLCSD's modulation's (method=hybrid).
CONTRAST_FIELDS = (
    "contrast_weight",
    "contrast_top_k",
    "contrast_log_floor",
    "contrast_kl_tau",
    "contrast_hints",
)
MODULATION_FIELDS = ("contrast_rl_weight", "contrast_rl_tau", "contrast_rl_delta")


@dataclass(frozen=True)
class Rule:
    fields: tuple[str, ...]
    applies: Callable[[object], bool]  # the settings leave `fields` without effect
    needs: Callable[[object], str]  # what they need to act, and why they do not here


def _get(config: object, name: str, default: object = None) -> object:
    return getattr(config, name, default)


RULES: tuple[Rule, ...] = (
    Rule(
        ("fixed_advantage",),
        lambda c: _get(c, "loss_type") != "fixed_advantage",
        lambda c: (
            f"it needs loss_type=fixed_advantage (loss_type={_get(c, 'loss_type')} reads no constant advantage)"
        ),
    ),
    Rule(
        TEACHER_FIELDS + DIVERGENCE_FIELDS,
        lambda c: _get(c, "loss_type") == "fixed_advantage",
        lambda c: (
            "it needs a loss that reads a teacher, loss_type=jsd or sampled_token (loss_type=fixed_advantage "
            "reads none)"
        ),
    ),
    Rule(
        DIVERGENCE_FIELDS,
        lambda c: _get(c, "loss_type") == "sampled_token",
        lambda c: (
            "it needs loss_type=jsd (sampled_token's policy gradient has no divergence to interpolate or clip)"
        ),
    ),
    Rule(
        ("divergence_clip",),
        lambda c: _get(c, "clip_mode") == "none",
        lambda c: "it needs clip_mode=element, token or rescale (clip_mode=none clips nothing)",
    ),
    Rule(
        ("ema_decay",),
        lambda c: _get(c, "teacher_mode") != "ema",
        lambda c: (
            f"it needs teacher_mode=ema (teacher_mode={_get(c, 'teacher_mode')} keeps no moving average)"
        ),
    ),
    Rule(
        REFERENCE_FIELDS,
        lambda c: _get(c, "teacher_ref_pairing") == "empty" and _get(c, "teacher_contrast", "none") == "none",
        lambda c: (
            "it needs a reference for the teacher, teacher_ref_pairing=matched or shuffled "
            "(teacher_ref_pairing=empty gives it none)"
        ),
    ),
    Rule(
        CONTRAST_FIELDS + MODULATION_FIELDS,
        lambda c: _get(c, "teacher_contrast", "none") == "none",
        lambda c: "it needs a contrastive teacher, teacher_contrast=shuffled, wrong_answer or own_wrong",
    ),
    Rule(
        ("contrast_hints",),
        lambda c: _get(c, "teacher_contrast", "none") in ("shuffled", "wrong_answer"),
        lambda c: (
            f"it needs teacher_contrast=own_wrong (teacher_contrast={_get(c, 'teacher_contrast')} has one wrong "
            "hint per row)"
        ),
    ),
    Rule(
        ("contrast_rl_tau", "contrast_rl_delta"),
        lambda c: _get(c, "contrast_rl_weight", 0.5) == 0,
        lambda c: "it needs contrast_rl_weight > 0 (contrast_rl_weight=0 modulates no advantage)",
    ),
    Rule(
        ("teacher_contrast",) + CONTRAST_FIELDS,
        lambda c: (
            _get(c, "method") == "hybrid"
            and _get(c, "sd_weight", 1.0) == 0
            and _get(c, "contrast_rl_weight", 0.5) == 0
        ),
        lambda c: (
            "it needs sd_weight > 0 (the contrastive target) or contrast_rl_weight > 0 (the modulation); with both "
            "at 0 the hybrid reads no teacher"
        ),
    ),
    Rule(
        ("contrast_weight", "contrast_top_k", "contrast_log_floor", "contrast_kl_tau"),
        lambda c: _get(c, "method") == "hybrid" and _get(c, "sd_weight", 1.0) == 0,
        lambda c: "it needs sd_weight > 0 (the hybrid's OPSD term is where the contrastive target acts)",
    ),
    Rule(
        ("token_weight",),
        lambda c: _get(c, "method") == "hybrid" and _get(c, "sd_weight", 1.0) == 0,
        lambda c: "it needs sd_weight > 0 (it weighs the tokens of the hybrid's OPSD term)",
    ),
    Rule(
        LORA_FIELDS,
        lambda c: _get(c, "use_peft", True) is False,
        lambda c: "it needs use_peft=true (full fine-tuning trains no adapter)",
    ),
    Rule(
        ("completions_rows",),
        lambda c: _get(c, "completions_steps", 0) == 0,
        lambda c: "it needs completions_steps > 0 (completions_steps=0 logs no completions)",
    ),
)


def _settings(config: object) -> object:
    return SimpleNamespace(**config) if isinstance(config, Mapping) else config


def inert_fields(config: object) -> dict[str, str]:
    """field -> what it needs to act, for every field the settings of `config` (an `OPSDConfig`, or a mapping of
    field to value such as a dry run's resolved settings) leave without effect, whatever its value."""
    settings = _settings(config)
    found: dict[str, str] = {}
    for rule in RULES:
        if rule.applies(settings):
            for name in rule.fields:
                found.setdefault(name, rule.needs(settings))
    return found


# Lines already logged by this process: a config checked again (`OPSDConfig.with_micro_batch` re-runs its
# checks for a new micro-batch plan) says each once.
_logged: set[str] = set()


def warn_inert(config: object, defaults: Mapping[str, object]) -> list[str]:
    """One line per field of `inert_fields` set away from its value in `defaults`, each logged as a warning
    the first time this process meets it; the lines."""
    lines = []
    for name, needs in inert_fields(config).items():
        value = getattr(config, name, None)
        if name in defaults and value != defaults[name]:
            lines.append(f"{name}={value!r} has no effect: {needs}")
            if lines[-1] not in _logged:
                _logged.add(lines[-1])
                logger.warning("%s", lines[-1])
    return lines
