"""TRL's `SDFTConfig` fields as OPSD treats them: those it ignores (refused when set), those it derives from its own
switches (refused when set to anything else), and TRL's generation window, which OPSD sets from
`steps_per_rollout` (optimizer steps per generation, docs/method.md §1.9). Called by `OPSDConfig.__post_init__`.
"""

from __future__ import annotations

# OPSD's names for TRL's teacher kinds.
TEACHER_KIND = {"fixed": "base", "ema": "ema", "dynamic": "live"}
# SDFTConfig fields that OPSDTrainer never reads, with what to use instead. A value other than SDFTConfig's
# default is refused: silently training with another objective or prompt than the one asked for is worse.
IGNORED_SDFT_OPTIONS = {
    "generate_from_teacher": "OPSD always samples from the student prompt; leave it unset",
    "distillation_alpha": "set the OPSD divergence with beta instead",
    "distillation_mode": "set the OPSD objective with loss_type (jsd | sampled_token) instead",
    "distillation_topk": "restrict the OPSD loss with top_k_loss instead",
    "distillation_is_clip": "clip the OPSD loss with divergence_clip and clip_mode instead",
    "distillation_add_tail": "the OPSD loss has no tail bucket; leave it unset",
    "teacher_prompt_template": "give a teacher template file with teacher_prompt_file ({problem}, {reference})",
    "use_teacher_server": "OPSD scores the teacher locally on the full vocabulary; leave it unset",
    "chat_template_kwargs": "use student_thinking / teacher_thinking, or the prompt template files",
}


# SDFTConfig fields that OPSD sets itself from its own switches, with the switch to use instead. A value other
# than SDFTConfig's default and other than the one OPSD derives is refused: it would be rewritten silently.
DERIVED_SDFT_OPTIONS = {
    "teacher_model_kind": "set the teacher with teacher_mode (fixed | ema | dynamic) instead",
    "teacher_update_rate": "set the EMA teacher's speed with ema_decay (update rate = 1 - ema_decay) instead",
}


def _shown(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else repr(value)


def check_trl_teacher_options(config, sdft_defaults: dict) -> None:
    """Refuse `teacher_model_kind` / `teacher_update_rate` set to anything but what OPSD derives from
    `teacher_mode` / `ema_decay` (SDFTConfig's default cannot be told from unset and passes)."""
    derived = {
        "teacher_model_kind": TEACHER_KIND.get(config.teacher_mode),
        "teacher_update_rate": 1.0 - config.ema_decay,
    }
    for name, instead in DERIVED_SDFT_OPTIONS.items():
        value, ours = getattr(config, name), derived[name]
        same = value == ours or (
            isinstance(value, float) and isinstance(ours, float) and abs(value - ours) <= 1e-12
        )
        if value != sdft_defaults[name] and not same:
            raise ValueError(
                f"{name}={value!r} is a TRL option that OPSD sets itself (here to {_shown(ours)}, from "
                f"teacher_mode={config.teacher_mode!r}, ema_decay={config.ema_decay!r}); {instead}"
            )


def check_steps_per_rollout(config) -> None:
    """Refuse a `steps_per_rollout` the run cannot serve (before TRL derives its window from it)."""
    k = config.steps_per_rollout
    if k > 1 and config.num_iterations > 1:
        raise ValueError(
            f"steps_per_rollout={k} with num_iterations={config.num_iterations}: both train several steps "
            "on one generation; set one of them"
        )
    if config.max_steps > 0 and config.max_steps % k:
        raise ValueError(
            f"steps_per_rollout={k} does not divide max_steps={config.max_steps}: the last generation would "
            "roll out problems no step trains on; choose a divisor of max_steps"
        )


def check_generation_window(config) -> None:
    """Each optimizer step is normalised by its own valid tokens (opsd_trainer `_prepare_training_batch` counts
    them per step of the window), so TRL's window must be whole optimizer steps (docs/method.md §1.5)."""
    k, accumulation = config.steps_per_rollout, config.gradient_accumulation_steps
    if config.steps_per_generation != k * accumulation:
        raise ValueError(
            f"steps_per_generation={config.steps_per_generation} (generation_batch_size="
            f"{config.generation_batch_size}) is not steps_per_rollout x gradient_accumulation_steps = "
            f"{k} x {accumulation}: TRL's window counts micro-batches; leave both TRL "
            "generation settings unset and set steps_per_rollout (optimizer steps per generation)"
        )
