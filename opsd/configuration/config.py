"""`OPSDConfig`: every switch of the method, with the published recipe as defaults (docs/method.md §1–2).

It extends TRL's `SDFTConfig` (itself a `TrainingArguments`), so every TRL/transformers training argument
is available too. Which source wins when several set a field: docs/configuration.md (Running and
precedence). Every field `name` is also the CLI flag `--name` and the environment
switch `OPSD_NAME` (upper case); see `opsd.configuration.sources.recipe`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace

from trl.experimental.sdft import SDFTConfig

from opsd.configuration.checks.choices import CHOICES, check_choice, parse_micro_batch_size
from opsd.configuration.checks.inert import warn_inert
from opsd.configuration.checks.methods import check_method
from opsd.configuration.checks.ranges import check_ranges
from opsd.configuration.checks.trl_options import (
    IGNORED_SDFT_OPTIONS,
    TEACHER_KIND,
    check_generation_window,
    check_steps_per_rollout,
    check_trl_teacher_options,
)

logger = logging.getLogger(__name__)


def _help(text: str) -> dict:
    return {"help": text}


def _choice(name: str, text: str) -> dict:
    """Metadata of a choice field: its help and its allowed values (opsd.configuration.checks.choices), which
    the CLI enforces too."""
    return {"help": text, "choices": CHOICES[name]}


MAX_MODULE_NAMES = 1000  # far more than any model's module kinds (a name is matched against every module)


def _module_list(value) -> list[str]:
    """LoRA target modules from a list (YAML, CLI) or a comma-separated string, entries split on commas too.
    Each entry is a name: a nested list or mapping (YAML) is refused, not flattened, and so are more than
    `MAX_MODULE_NAMES` of them."""
    items = [value] if isinstance(value, str) else value or []
    listed = isinstance(items, (list, tuple))
    odd = next((i for i in items if not isinstance(i, str)), None) if listed else items
    if not listed or odd is not None:
        # Named by its type: the text of a nested YAML value may be all its aliases expanded.
        raise ValueError(
            f"lora_target_modules holds a {type(odd).__name__}, not a module name; give names such as "
            "q_proj,v_proj, all-linear or auto"
        )
    if len(items) > MAX_MODULE_NAMES or sum(item.count(",") for item in items) >= MAX_MODULE_NAMES:
        raise ValueError(
            f"lora_target_modules holds more than {MAX_MODULE_NAMES} names; give the module names of one layer "
            "(q_proj,v_proj), all-linear or auto"
        )
    modules = [m.strip() for item in items for m in item.split(",") if m.strip()]
    if not modules:
        raise ValueError(
            f"lora_target_modules={value!r} names no module; give e.g. q_proj,v_proj, all-linear or auto"
        )
    for keyword in ("auto", "all-linear"):
        if keyword in modules and len(modules) > 1:
            raise ValueError(
                f"lora_target_modules={value!r}: {keyword} stands alone; give it or a list of names"
            )
    return modules


@dataclass
class OPSDConfig(SDFTConfig):
    # Published recipe values for inherited TRL/transformers arguments (docs/method.md §2) -------------------------------
    output_dir: str = field(
        default="runs/opsd", metadata=_help("Where checkpoints, config and metrics.jsonl go.")
    )
    max_steps: int = field(default=100, metadata=_help("Optimizer steps (the capped budget is 100)."))
    learning_rate: float = field(default=5e-6, metadata=_help("Peak learning rate."))
    lr_scheduler_type: str = field(
        default="constant", metadata=_help("constant (published) | linear | cosine | ...")
    )
    max_grad_norm: float = field(default=0.1, metadata=_help("Gradient clipping norm."))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay."))
    per_device_train_batch_size: int = field(
        default=4, metadata=_help("Problems per device per micro-batch.")
    )
    gradient_accumulation_steps: int = field(default=2, metadata=_help("Micro-batches per optimizer step."))
    micro_batch_size: str | None = field(
        default=None,
        metadata=_help(
            "Rows per forward/backward, keeping per_device_train_batch_size x gradient_accumulation_steps "
            "problems per process per step (memory, not method; opsd.speed.microbatch): unset = "
            "per_device_train_batch_size as given; N (must divide them); auto = the largest that fits beside "
            "the engine on a GPU, the plan as given without one. train_capped.sh uses auto. Parsed once, here, "
            "into None, an int or 'auto'."
        ),
    )
    gradient_checkpointing: bool = field(default=True, metadata=_help("Recompute activations in backward."))
    compile_layers: bool = field(
        default=False,
        metadata=_help(
            "torch.compile every decoder layer for the training and teacher forwards; generation stays eager "
            "(time, not method: opsd.speed.compiled_layers). The first steps and each new sequence width pay "
            "the compile; on a CPU it needs a C++ compiler."
        ),
    )
    bf16: bool = field(
        default=True, metadata=_help("bf16 mixed precision (turned off with a log line when no GPU).")
    )
    logging_steps: float = field(default=1, metadata=_help("Log every N optimizer steps."))
    save_steps: float = field(default=50, metadata=_help("Checkpoint every N optimizer steps."))
    report_to: str = field(
        default="none", metadata=_help("Trackers: none | wandb | tensorboard | trackio ...")
    )
    num_generations: int = field(
        default=0,
        metadata=_help(
            "Rollouts per problem (G): 0 = the method's own, 1 for opsd and TRL's 8 for grpo and hybrid; opsd takes "
            "1, grpo and hybrid at least 2. A GRPO step samples problems per step x G rollouts."
        ),
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata=_help(
            "Ignored with a logged note (TRL/open-r1 recipes carry it): prompts are never cut; see "
            "max_teacher_prompt_length."
        ),
    )
    max_completion_length: int | None = field(default=1024, metadata=_help("Rollout length cap in tokens."))
    temperature: float = field(default=1.1, metadata=_help("Rollout sampling temperature."))
    top_p: float = field(default=0.95, metadata=_help("Rollout top-p."))
    top_k: int = field(default=20, metadata=_help("Rollout top-k (0 = off)."))
    steps_per_rollout: int = field(
        default=1,
        metadata=_help(
            "Optimizer steps served by one generation: the student rolls out k steps' problems at once with "
            "the weights of the window's first step, and each step trains on its own problems (steps after "
            "the first are up to k-1 steps off-policy: rollout/staleness_steps). 1 = on-policy (published). "
            "Must divide max_steps; TRL's steps_per_generation becomes k x gradient_accumulation_steps."
        ),
    )
    vllm_gpu_memory_utilization: float = field(
        default=0.6, metadata=_help("Share of GPU memory for colocated vLLM.")
    )
    vllm_max_num_seqs: int = field(
        default=0,
        metadata=_help(
            "Most sequences the colocated vLLM engine decodes at once; 0 = TRL's sizing (per-device batch x "
            "TP x steps per generation). 1 makes rollouts independent of the process count, slowly."
        ),
    )
    vllm_mode: str = field(
        default="colocate",
        metadata=_help("colocate (vLLM inside the training processes) | server (trl vllm-serve)."),
    )
    # Method -----------------------------------------------------------------------------------------------
    method: str = field(
        default="opsd",
        metadata=_choice(
            "method",
            "What the run trains (docs/method.md §6): opsd (self-distillation, this repo's trainer) | grpo (TRL's "
            "GRPOTrainer, rewarded by the evaluation's grader) | hybrid (GRPO's loss plus sd_weight x the OPSD loss "
            "on the same G rollouts per problem).",
        ),
    )
    sd_weight: float = field(
        default=1.0,
        metadata=_help("method=hybrid: weight of the OPSD loss added to GRPO's; 0 = TRL's GRPO loss alone."),
    )
    # Model ------------------------------------------------------------------------------------------------
    model_name_or_path: str = field(
        default="", metadata=_help("Hub name or local directory; empty = the embedded SmolLM2-135M-Instruct.")
    )
    model_revision: str = field(
        default="main", metadata=_help("Hub revision (branch, tag or commit) of the model and its tokenizer.")
    )
    torch_dtype: str | None = field(
        default=None, metadata=_help("Older name of `dtype` (TRL/open-r1 configs); sets dtype when given.")
    )
    dtype: str = field(
        default="auto",
        metadata=_choice("dtype", "auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32."),
    )
    attn_implementation: str = field(
        default="auto",
        metadata=_help("auto (flash_attention_2 if installed on GPU, else sdpa) | sdpa | eager | ..."),
    )
    allow_missing_weights: bool = field(
        default=False,
        metadata=_help(
            "Train even when the checkpoint lacks weights of the model, which transformers then initialises at "
            "random (an lm_head missing under an untied config, say); without it such a model is refused in "
            "one line naming them."
        ),
    )
    use_peft: bool = field(
        default=True, metadata=_help("Train LoRA adapters (published recipe) instead of all weights.")
    )
    lora_r: int = field(default=64, metadata=_help("LoRA rank."))
    lora_alpha: int = field(default=128, metadata=_help("LoRA alpha."))
    lora_dropout: float = field(default=0.0, metadata=_help("LoRA dropout."))
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["auto"],
        metadata=_help(
            "Module names that get LoRA adapters: a YAML list, `--lora_target_modules q_proj k_proj`, or "
            "comma-separated (`q_proj,k_proj`, the recipe.env / OPSD_* form); `all-linear` as in peft; `auto`: "
            "the linear projections of every layer kind (q, k, v, o, gate, up, down on dense models, the "
            "published recipe's), minus those a fused kernel reads directly (docs/families.md)."
        ),
    )
    # Data and prompts -------------------------------------------------------------------------------------
    dataset_name: str = field(
        default="builtin",
        metadata=_help(
            "builtin (generated problems), a hub dataset (siyanzhao/Openthoughts_math_30k_opsd) or a file."
        ),
    )
    dataset_split: str = field(default="train", metadata=_help("Split of a hub dataset."))
    data_filter: str = field(
        default="none", metadata=_choice("data_filter", "none | numeric | hard_numeric (docs/method.md §2).")
    )
    teacher_ref: str = field(
        default="solution",
        metadata=_choice(
            "teacher_ref",
            "Privileged context: solution | cot (COT_Reason) | answer (the Answer column alone, in the same "
            "template; docs/method.md §1.10).",
        ),
    )
    teacher_ref_fraction: float = field(
        default=1.0,
        metadata=_help(
            "The teacher sees the first ceil(f x n) of the reference's n tokens (the model's tokenizer), at least "
            "one whole character, after teacher_ref_max_chars; 1 = all of it. The cut is logged once with an "
            "example. Below 1 it is refused with teacher_contrast=wrong_answer (the cut would drop the answer "
            "from both hints)."
        ),
    )
    teacher_contrast: str = field(
        default="none",
        metadata=_choice(
            "teacher_contrast",
            "Contrastive teacher, RLCSD's target (docs/method.md §1.10): none (published) | shuffled (the wrong hint "
            "is another problem's reference, a fixed derangement drawn from seed) | wrong_answer (the problem's own "
            "reference with its final answer replaced by another value of the same kind) | own_wrong "
            "(method=hybrid: up to contrast_hints incorrect sibling rollouts, the hint a correct sibling or the "
            "reference). One more teacher forward per wrong hint.",
        ),
    )
    contrast_weight: float = field(
        default=0.5,
        metadata=_help(
            "alpha of the contrastive target q ~ p_T(.|c)^(1+alpha) / max(p_T(.|c~), e^floor)^alpha "
            "(teacher_contrast); 0 = OPSD's teacher on the same buckets."
        ),
    )
    contrast_top_k: int = field(
        default=100,
        metadata=_help("The teacher's top-k tokens the contrastive target keeps beside a tail bucket."),
    )
    contrast_log_floor: float = field(
        default=-5.0, metadata=_help("Floor on log p_T(.|c~) inside the contrastive target.")
    )
    contrast_kl_tau: float = field(
        default=1.0,
        metadata=_help("tau of the contrastive token weight KL(c||c~) / (KL + tau); 0 = no weight."),
    )
    contrast_hints: int = field(
        default=4,
        metadata=_help(
            "teacher_contrast=own_wrong: at most this many wrong sibling rollouts per rollout (K)."
        ),
    )
    contrast_rl_weight: float = field(
        default=0.5,
        metadata=_help(
            "method=hybrid with a contrast: lambda of RLCSD's modulation lambda tanh(e_ctr / tau) added to the "
            "GRPO advantage under a sign-preserving clamp; 0 = none."
        ),
    )
    contrast_rl_tau: float = field(
        default=0.02, metadata=_help("tau of RLCSD's modulation tanh(e_ctr / tau), in nats.")
    )
    contrast_rl_delta: float = field(
        default=0.02, metadata=_help("RLCSD's modulation is applied where its magnitude exceeds delta.")
    )
    token_weight: str = field(
        default="none",
        metadata=_choice(
            "token_weight",
            "Per-token loss weight (docs/method.md §1.12): none (published) | position_early (IW-OPD) | "
            "position_late (position-weighted OPSD) | entropy_gate (teacher entropy, with a floor) | "
            "positive_only (tokens the teacher makes likelier).",
        ),
    )
    teacher_ref_pairing: str = field(
        default="matched",
        metadata=_choice(
            "teacher_ref_pairing",
            "Whose reference a problem's teacher reads: matched (its own, published) | shuffled (another "
            "problem's, a fixed derangement drawn from seed; teacher_pairing.json) | empty (an empty reference "
            "block) (docs/method.md §1.8).",
        ),
    )
    teacher_ref_max_chars: int = field(
        default=8000, metadata=_help("Cut the reference to this many characters; 0 = no cut.")
    )
    max_teacher_prompt_length: int = field(
        default=4096,
        metadata=_help("Teacher prompt token cap; longer prompts are cut inside the reference. 0 = none."),
    )
    student_thinking: bool = field(
        default=False, metadata=_help("Student prompt with thinking on (off appends the empty think block).")
    )
    teacher_thinking: bool = field(default=True, metadata=_help("Teacher prompt with thinking on."))
    thinking_switch: str = field(
        default="auto",
        metadata=_help(
            "The chat-template variable student_thinking and teacher_thinking set: auto (enable_thinking where "
            "the template reads it, else none with a warning) | none (the template has no switch) | a name."
        ),
    )
    student_prompt_file: str = field(
        default="", metadata=_help("Text file replacing the student template ({problem}).")
    )
    teacher_prompt_file: str = field(
        default="", metadata=_help("Text file replacing the teacher template ({problem}, {reference}).")
    )
    # Loss ---------------------------------------------------------------------------------------------------
    beta: float = field(
        default=0.0, metadata=_help("JSD interpolation: 0 = forward KL(p_T||p_S), 1 = reverse KL.")
    )
    loss_temperature: float = field(
        default=0.0, metadata=_help("Temperature of both distributions in the loss; 0 = rollout temperature.")
    )
    divergence_clip: float = field(
        default=0.05,
        metadata=_help(
            "Clip threshold of the divergence: of each vocabulary entry's term (clip_mode=element), or of a "
            "token's sum (token, rescale). Formerly jsd_token_clip, still accepted."
        ),
    )
    clip_mode: str = field(
        default="element",
        metadata=_choice("clip_mode", "element | token | rescale | none (docs/method.md §1.4)."),
    )
    top_k_loss: int = field(
        default=0, metadata=_help("Restrict both distributions to the teacher's top-k; 0 = full vocabulary.")
    )
    loss_type: str = field(
        default="jsd",
        metadata=_choice(
            "loss_type",
            "jsd (full-distribution) | sampled_token (policy gradient on log p_T - log p_S) | fixed_advantage "
            "(the teacher-free control: policy gradient with the constant fixed_advantage; no teacher prompt "
            "or forward).",
        ),
    )
    fixed_advantage: float = field(
        default=-0.25,
        metadata=_help(
            "The constant advantage a < 0 of loss_type=fixed_advantage: loss = -a log p_S(y) per sampled token "
            "(docs/method.md §1.11 says how the default was chosen)."
        ),
    )
    loss_chunk_size: int = field(default=1024, metadata=_help("Tokens per chunk of the memory-flat loss."))
    fix_position_ids: bool = field(
        default=True,
        metadata=_help(
            "Positions = index in the unpadded sequence; false scores the reference code's rows exactly "
            "(right-padded prompts, pad-id mask, completion token j at position P + j)."
        ),
    )
    num_loss_tokens_to_skip: int = field(
        default=0,
        metadata=_help(
            "Leave the first N completion tokens out of the loss, its token count and the opsd/* metrics."
        ),
    )
    # Teacher ------------------------------------------------------------------------------------------------
    teacher_mode: str = field(
        default="fixed",
        metadata=_choice("teacher_mode", "fixed (initial policy) | ema | dynamic (current weights)."),
    )
    ema_decay: float = field(
        default=0.999, metadata=_help("EMA decay of the teacher weights (teacher_mode=ema).")
    )
    # Safety -------------------------------------------------------------------------------------------------
    max_nonfinite_steps: int = field(
        default=3,
        metadata=_help(
            "A step whose loss or gradient is not finite is skipped (no update); stop the run after this many "
            "consecutive skipped steps (1 = stop at the first)."
        ),
    )
    # Rollouts -----------------------------------------------------------------------------------------------
    rollout_engine: str = field(
        default="auto",
        metadata=_choice(
            "rollout_engine",
            "auto (vLLM if installed, else transformers with a warning) | vllm | transformers.",
        ),
    )
    # Budget helpers -------------------------------------------------------------------------------------------
    wavg_last: int = field(
        default=0, metadata=_help("Average trainable weights over the last N optimizer steps; 0 = off.")
    )
    # Probe --------------------------------------------------------------------------------------------------
    probe_steps: int = field(
        default=10,
        metadata=_help(
            "Score the held-out probe (divergence, top-1 agreement, teacher-token log-prob) every N steps; 0 = off."
        ),
    )
    probe_size: int = field(
        default=16,
        metadata=_help(
            "Problems held out of the training data for the probe (rounded down to a multiple of the "
            "processes); 0 = no probe and no hold-out."
        ),
    )

    # Completions log ---------------------------------------------------------------------------------------
    completions_steps: int = field(
        default=10,
        metadata=_help(
            "Every N steps write a few (problem, reference, completion, per-token divergence) rows to "
            "completions.jsonl and to W&B; 0 = off."
        ),
    )
    completions_rows: int = field(default=4, metadata=_help("Rows per completions log entry."))

    def __post_init__(self):
        import torch

        if self.torch_dtype is not None:  # TRL/open-r1 configs still say torch_dtype
            if self.dtype not in ("auto", self.torch_dtype):
                raise ValueError(
                    f"torch_dtype={self.torch_dtype!r} and dtype={self.dtype!r} disagree; set only dtype"
                )
            self.dtype, self.torch_dtype = self.torch_dtype, None
        self.lora_target_modules = _module_list(self.lora_target_modules)
        for name in CHOICES:
            check_choice(name, getattr(self, name))
        check_ranges(
            self
        )  # every numeric field's range, declared once in opsd/configuration/checks/ranges.py
        self.micro_batch_size = parse_micro_batch_size(self.micro_batch_size)
        check_method(self)  # before TRL's checks: they read num_generations
        warn_inert(self, {f.name: f.default for f in fields(self)})  # a switch the others leave idle
        sdft_defaults = {f.name: f.default for f in fields(SDFTConfig)}
        for name, instead in IGNORED_SDFT_OPTIONS.items():
            if getattr(self, name) != sdft_defaults[name]:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is an SDFTTrainer option that OPSDTrainer ignores; {instead}"
                )
        check_trl_teacher_options(self, sdft_defaults)
        if self.max_prompt_length is not None:  # TRL/open-r1 recipes carry it; OPSD renders its own prompts
            logger.warning(
                "max_prompt_length=%s is ignored: OPSD never cuts a prompt (that would cut the problem); the "
                "teacher prompt's cap is max_teacher_prompt_length",
                self.max_prompt_length,
            )
        evaluation = getattr(self.eval_strategy, "value", self.eval_strategy)
        if evaluation not in (None, "no"):  # Trainer refuses it once the model has loaded
            raise ValueError(
                f"eval_strategy={evaluation!r} needs an evaluation set, and OPSD trains on none; leave it at "
                "'no' and score checkpoints with eval_aime.py"
            )
        # Map OPSD's switches onto the TRL fields that implement them.
        self.teacher_model_kind = TEACHER_KIND[self.teacher_mode]
        self.teacher_update_rate = 1.0 - self.ema_decay
        if self.bf16 and not torch.cuda.is_available():
            logger.info("bf16 mixed precision needs a GPU; training in float32 on this machine")
            self.bf16 = False
        check_steps_per_rollout(self)
        if self.steps_per_generation is None and self.generation_batch_size is None:
            # TRL's generation window counts micro-batches; OPSD's switch counts optimizer steps. The one place
            # steps_per_rollout becomes TRL's window (`with_micro_batch` re-runs it for a new accumulation).
            self.steps_per_generation = self.steps_per_rollout * self.gradient_accumulation_steps
        # SDFTConfig counts a generation batch in rollouts of one per problem; GRPO's G rollouts per problem are
        # applied where its TRL config is built (opsd.rl.grpo.grpo_args), which checks them in TRL's terms.
        generations, self.num_generations = self.num_generations, 1
        super().__post_init__()
        self.num_generations = generations
        check_generation_window(self)

    def with_micro_batch(self, micro_batch: int, accumulation: int) -> OPSDConfig:
        """This config with `micro_batch` rows per micro-batch and `accumulation` micro-batches per step. TRL's
        window fields are cleared so that `__post_init__` derives them again from steps_per_rollout: the
        window, in micro-batches, changes with the accumulation."""
        return replace(
            self,
            per_device_train_batch_size=micro_batch,
            gradient_accumulation_steps=accumulation,
            generation_batch_size=None,
            steps_per_generation=None,
        )
