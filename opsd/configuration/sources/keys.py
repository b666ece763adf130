"""Which `OPSDConfig` fields each source may set under the capped budget (docs/method.md §3).

`RECIPE_KEYS` (the method) and `OPERATIONAL_KEYS` (logging and memory) may be set in `recipe.env` and `OPSD_*`
under the harness; `BUDGET_KEYS` are fixed by it. Read by the recipe parser
(`opsd.configuration.sources.recipe`), the resume check (`opsd.run.resume`), the harness
(`opsd.launch.capped`) and docs/configuration.md's table.
"""

from __future__ import annotations

# Method and optimiser switches a researcher may tune under the capped budget.
RECIPE_KEYS = frozenset({
    # the method, and what only one method reads (rollouts per problem, the hybrid's weight)
    "method", "num_generations", "sd_weight",
    # optimiser and schedule
    "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "adam_beta1",
    "adam_beta2",
    # rollouts
    "temperature", "top_p", "top_k", "max_completion_length", "steps_per_rollout",
    # loss
    "beta", "loss_temperature", "divergence_clip", "clip_mode", "top_k_loss", "loss_type", "fix_position_ids",
    "num_loss_tokens_to_skip", "fixed_advantage", "token_weight",
    # LoRA
    "lora_r", "lora_alpha", "lora_dropout",
    # teacher and data
    "teacher_mode", "ema_decay", "data_filter", "teacher_ref", "teacher_ref_pairing", "teacher_ref_max_chars",
    "teacher_ref_fraction",
    # the contrastive teacher (RLCSD's target; its RL form under method=hybrid)
    "teacher_contrast", "contrast_weight", "contrast_top_k", "contrast_log_floor", "contrast_kl_tau",
    "contrast_hints", "contrast_rl_weight", "contrast_rl_tau", "contrast_rl_delta",
    "max_teacher_prompt_length", "student_thinking", "teacher_thinking", "thinking_switch", "student_prompt_file",
    "teacher_prompt_file",
    # budget helpers that spend no extra compute; the probe's cadence (a few forwards every N steps)
    "wavg_last", "probe_steps",
    # safety: how many non-finite (skipped) steps in a row end the run; a skipped step costs nothing extra
    "max_nonfinite_steps",
})  # fmt: skip

# Settings that change neither the budget nor the method (trackers, logging, memory): the capped harness
# takes them from recipe.env, OPSD_* variables and its pass-through flags (`train_capped.sh -- --report_to
# wandb`). Gradient checkpointing, the loss chunk size and the micro-batch (opsd.speed.microbatch) trade memory
# for time on identical arithmetic; compile_layers (opsd.speed.compiled_layers) fuses the same arithmetic into
# fewer kernels.
OPERATIONAL_KEYS = frozenset({
    "report_to", "run_name", "logging_steps", "logging_first_step", "log_level", "disable_tqdm",
    "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "gradient_checkpointing", "loss_chunk_size",
    "completions_steps", "completions_rows", "vllm_max_num_seqs", "micro_batch_size",
    "compile_layers",
})  # fmt: skip
# Everything recipe.env (and OPSD_* under the harness) may set.
CAPPED_KEYS = RECIPE_KEYS | OPERATIONAL_KEYS

# Fields that change how much compute or data a run gets, or what it is measured on: the capped harness
# fixes them (100 steps x 32 problems on one model and dataset), so recipe.env must not move them.
BUDGET_KEYS = frozenset({
    # steps
    "max_steps", "num_train_epochs",
    # problems per step
    "per_device_train_batch_size", "gradient_accumulation_steps", "auto_find_batch_size",
    # reuse of each rollout (rollouts per problem are the method's: num_generations, a recipe key)
    "generation_batch_size", "steps_per_generation", "num_iterations",
    # what is trained, on what, in which order
    "model_name_or_path", "dataset_name", "dataset_split", "seed", "data_seed", "probe_size",
    # where results land and resuming (a resumed run would get more than the budget)
    "output_dir", "save_steps", "save_strategy", "resume_from_checkpoint",
})  # fmt: skip
