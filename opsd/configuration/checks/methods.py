"""Which method a run trains (`method`: opsd | grpo | hybrid) and the switches that belong to each.

The methods share everything a comparison must hold fixed (model, LoRA, data, prompts, rollout sampling, optimiser,
budget, seeds); each also reads switches the others do not. A switch set away from its default under a method that
never reads it would be recorded in the run's configuration as if it acted, so it is refused in one line naming the
method that reads it. `num_generations` 0 becomes the method's own number of rollouts per problem here. Called by
`OPSDConfig.__post_init__`; no dependencies, so any module can import it.
"""

from __future__ import annotations

from dataclasses import fields

# TRL's GRPOConfig default number of rollouts per problem (G).
TRL_GRPO_GENERATIONS = 8

# Read by the self-distillation loss and its teacher only (opsd, and hybrid's OPSD term): method=grpo has neither.
SELF_DISTILLATION_FIELDS = (
    "beta", "loss_temperature", "divergence_clip", "clip_mode", "top_k_loss", "loss_type", "fixed_advantage",
    "token_weight", "teacher_contrast", "contrast_weight", "contrast_top_k", "contrast_log_floor", "contrast_kl_tau",
    "contrast_hints", "teacher_mode", "ema_decay", "teacher_ref", "teacher_ref_fraction",
    "teacher_ref_pairing", "teacher_ref_max_chars", "max_teacher_prompt_length", "teacher_thinking",
    "teacher_prompt_file", "num_loss_tokens_to_skip", "completions_steps", "completions_rows",
)  # fmt: skip
# Read by OPSD's own trainer only (its generation window, its compiled forwards, its probe); hybrid runs TRL's GRPO
# step, which has none of them, and its teacher is the initial policy or the student itself (no EMA adapter).
OPSD_TRAINER_FIELDS = ("steps_per_rollout", "compile_layers")
# Read by method=hybrid only: the weight of its OPSD term, and RLCSD's modulation of its GRPO advantages.
HYBRID_FIELDS = ("sd_weight", "contrast_rl_weight", "contrast_rl_tau", "contrast_rl_delta")

HYBRID_TEACHER_MODES = ("fixed", "dynamic")


def default_generations(method: str) -> int:
    return 1 if method == "opsd" else TRL_GRPO_GENERATIONS


def check_method(config) -> None:
    """Resolve `num_generations` 0 to the method's; ValueError for a switch the method does not read (set away
    from its default), a number of rollouts the method cannot take, or sd_weight outside method=hybrid."""
    method = config.method
    defaults = {f.name: f.default for f in fields(config)}
    G = config.num_generations
    if not isinstance(G, int) or isinstance(G, bool) or G < 0:
        raise ValueError(
            f"num_generations={G!r} is out of range: must be an integer >= 0 (0 = the method's own)"
        )
    if G == 0:
        config.num_generations = G = default_generations(method)
    if method == "opsd" and G != 1:
        raise ValueError(
            f"num_generations={G} with method=opsd: OPSD samples one rollout per problem; leave it unset (or 1), "
            "or set method=grpo or hybrid for G rollouts per problem"
        )
    if method != "opsd" and G < 2:
        raise ValueError(
            f"num_generations={G} with method={method}: GRPO normalises each reward within its problem's group, "
            "so it needs at least 2 rollouts per problem; leave it unset (TRL's 8) or give 2 or more"
        )
    for name in HYBRID_FIELDS if method != "hybrid" else ():
        if getattr(config, name) != defaults[name]:
            raise ValueError(
                f"{name}={getattr(config, name)!r} is read by method=hybrid only (the weight of its OPSD term, "
                f"RLCSD's modulation of its GRPO advantages), and method={method} has none; remove it, or set "
                "method=hybrid"
            )
    if config.teacher_contrast == "own_wrong" and method == "opsd":
        raise ValueError(
            "teacher_contrast=own_wrong takes its wrong hints from the other rollouts of the same problem, and "
            "method=opsd draws one rollout per problem; set method=hybrid (num_generations rollouts per problem), "
            "or teacher_contrast=shuffled or wrong_answer"
        )
    if method == "opsd":
        return
    for name in OPSD_TRAINER_FIELDS + (SELF_DISTILLATION_FIELDS if method == "grpo" else ()):
        value = getattr(config, name)
        if value != defaults[name]:
            readers = "opsd" if name in OPSD_TRAINER_FIELDS else "opsd and hybrid"
            raise ValueError(
                f"{name}={value!r} is read by method={readers} only, and method={method} never reads it; remove "
                "it, or set method=opsd"
            )
    if method == "hybrid" and config.teacher_mode == "fixed" and not config.use_peft:
        raise ValueError(
            "teacher_mode=fixed with method=hybrid and use_peft=false: the hybrid's fixed teacher is the initial "
            "policy under the LoRA student's adapters; train LoRA (use_peft=true) or use teacher_mode=dynamic"
        )
    if method == "hybrid" and config.teacher_mode not in HYBRID_TEACHER_MODES:
        raise ValueError(
            f"teacher_mode={config.teacher_mode} with method=hybrid: the hybrid's teacher is the initial policy "
            "(fixed) or the student itself (dynamic); use one of those, or method=opsd for an EMA teacher"
        )
