"""Every switch of training, declared once: its default, its help, its choices or range, which sources may set it
under the capped harness (its role), its `OPSD_*` name and any older name, all in the metadata of its field.

`Switches` holds OPSD's own fields and the TRL/transformers fields whose default OPSD sets (the published recipe,
docs/method.md §2); `TRL_SWITCHES` adds a range or a role to TRL fields OPSD leaves at TRL's default.
`opsd.configuration.config.OPSDConfig` is these fields on TRL's `SDFTConfig`, checked and with its derived fields
set. Every reader takes a switch's properties from here: the command line and its `--help`, YAML
(`opsd.launch.command_line`), `recipe.env` and `OPSD_*` (`opsd.configuration.sources`), the checks
(`opsd.configuration.checks`), the generated table of docs/configuration.md (`opsd.configuration.docs`), the
resume check, the harness and the tests. The tables below the class (`CHOICES`, `RANGES`, the key sets of each
role, `ALIASES`) are views of the metadata, not copies.

A field's metadata:

* `help`: its `--help` text and its docs/configuration.md row;
* `choices`: its allowed values (the CLI enforces them too);
* `range`: its allowed numeric range (`Range`), with the reason of each bound beside it;
* `role`: `METHOD` (a method switch: `recipe.env`, `OPSD_*`), `OPERATIONAL` (logging and memory: also the harness's
  pass-through flags) or `BUDGET` (fixed by the capped harness); none: a command-line flag or YAML key only;
* `env`: its `OPSD_*` variable where it is not `OPSD_` + its name in upper case (`env_name`);
* `formerly`: an older name still accepted, with a note (`jsd_token_clip` is `divergence_clip`).

No dependency beyond the standard library and the method registry (`opsd.methods`, itself standard library only): the data, prompt, model and evaluation modules read choices from here
without importing TRL (importing `OPSDConfig` takes seconds).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from opsd import methods

METHOD, OPERATIONAL, BUDGET = "method", "operational", "budget"
ROLES = (METHOD, OPERATIONAL, BUDGET)
ENV_PREFIX = "OPSD_"
# The fixed KV cache of every vLLM engine a process starts, in GiB (opsd.method.engine_env): an operational variable.
KV_CACHE_ENV = "OPSD_KV_CACHE_GIB"


@dataclass(frozen=True)
class Range:
    """[lo, hi] with open ends where `lo_open`/`hi_open`; None = unbounded. `optional`: None is allowed."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""
    optional: bool = False
    zero: bool = False  # 0 is allowed too (it means off), below `lo`

    def contains(self, value: object) -> bool:
        if value is None:
            return self.optional
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.zero and value == 0:
            return True
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)

    def rule(self) -> str:
        """`must be in (0, 1]`, `must be > 0 (0 = off)`, ... as the error message says it."""
        if self.lo is not None and self.hi is not None:
            text = f"must be in {'(' if self.lo_open else '['}{_num(self.lo)}, {_num(self.hi)}"
            text += ")" if self.hi_open else "]"
        elif self.lo is not None:
            text = f"must be {'>' if self.lo_open else '>='} {_num(self.lo)}"
        elif self.hi is not None:
            text = f"must be {'<' if self.hi_open else '<='} {_num(self.hi)}"
        else:
            text = "must be a finite number"
        if self.zero:
            text = "must be 0 or " + text.removeprefix("must be ")
        return f"{text} ({self.note})" if self.note else text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


# Ranges several switches share. The bounds are those of the code that reads the value: torch's AdamW refuses
# betas outside [0, 1) and a negative weight decay or epsilon, peft's dropout is a probability below 1, vLLM takes a
# share of GPU memory in (0, 1], numpy seeds are 32-bit unsigned. Every value must also be finite.
POSITIVE = Range(0, lo_open=True)
NON_NEGATIVE = Range(0)
OFF_AT_ZERO = Range(0, note="0 = off")
PROBABILITY_OPEN_LOW = Range(0, 1, lo_open=True)  # (0, 1]
SEED_MAX = 2**32 - 1
# The smallest `teacher_ref_fraction`: opsd.method.prompts rounds f x n to this many decimals before its ceiling.
REFERENCE_FRACTION_DECIMALS = 9
MIN_REFERENCE_FRACTION = 10.0**-REFERENCE_FRACTION_DECIMALS
# Magnitudes that reach the loss or the update, bounded so that no accepted value makes a float32 (or bf16: the
# same exponent range) step raise or every step non-finite; tests/integration/test_inputs_extremes.py runs one
# step at each bound.
# A factor on the loss and its gradient. max_grad_norm scales the update back anyway; at 1e4, a per-parameter
# gradient of 1e3 (far beyond a real one) still sums its squares over 1e12 parameters to 1e26, well below float32's
# 3.4e38, so the gradient norm stays finite.
MAX_LOSS_FACTOR = 1e4
# The rollout and the loss divide the logits by a temperature, and the loss's gradient by it once more: within
# 1000x either side of 1 both stay finite in float32 (1e-300 makes the logits infinite, and vLLM holds 1e300
# as infinity, which turns a masked logit into NaN).
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 1e3
# Adam divides by sqrt(v) + epsilon, and v is 0 wherever the gradient is (LoRA's A at step 1, B being 0): an
# epsilon that float32 rounds to 0 (below ~1e-45) makes that 0/0 = NaN in every such weight.
MIN_ADAM_EPSILON = 1e-30
# A token count any tensor index holds (int64), beyond every model's context: a larger skip overflows the index.
MAX_TOKENS = 2**24
# The largest hidden size of released models (Llama 3.1 405B): a rank beyond a matrix's smaller side adds nothing,
# and peft allocates rank x side weights per adapted matrix.
MAX_LORA_RANK = 2**14
# Counts that size a batch or a tensor, bounded so that an accepted value is a run that can start, not a MemoryError
# at step 1 (num_generations=1e9 passed every check and died in TRL's batch sampler, which lists every rollout's
# index). Rollouts per problem (G): GRPO's published groups are 4 to 64 (DeepSeekMath 64, DAPO 16); 1024 is far
# beyond, and a step's G x problems rollouts are generated, scored and held at once.
MAX_GENERATIONS = 1024
# Rows generated and held at once by one process: per_device_train_batch_size x gradient_accumulation_steps x
# steps_per_rollout (x G, budget_unit=problems), each a prompt, a completion and its scores. The capped budget at
# the largest G is 32 x 1024 = 32,768; a vLLM engine preallocates its batch for vllm_max_num_seqs sequences.
MAX_BATCH_ROWS = 2**16
# A temperature of the contrastive weights (contrast_kl_tau, contrast_rl_tau): the loss computes KL / (KL + tau) and
# tanh(e / tau) in float32 (bf16: the same exponent range), where a tau below ~1.4e-45 is 0 (and below ~1.2e-38 is
# flushed to 0 where subnormals are): KL / (KL + tau) is then 0 / 0 = NaN wherever KL is 0, and tanh(e / tau) NaN at
# e = 0. 1e-30 is a normal float32 and bf16 number; a smaller tau only sharpens a weight that is already a step.
MIN_CONTRAST_TAU = 1e-30

# The training table's column each `teacher_ref` reads (the data checks it, the prompts read it); its keys are
# the switch's choices.
REFERENCE_COLUMNS = {"solution": "solution", "cot": "COT_Reason", "answer": "Answer"}
# micro_batch_size (memory, not method) is no plain choice: auto, a number of rows, or unset
# (`opsd.configuration.checks.parse_micro_batch_size` reads it).
AUTO = "auto"
MicroBatchSize = int | Literal["auto"] | None


class SwitchMetadata(dict):
    """A field's metadata (module docstring). HfArgumentParser hands `field.metadata.copy()` to argparse's
    `add_argument` as keywords, so a copy holds the keys argparse takes (help, choices) and no others; the
    field's `metadata` mapping itself holds them all."""

    ARGPARSE_KEYS = ("help", "choices")

    def copy(self) -> dict[str, Any]:
        return {key: self[key] for key in self.ARGPARSE_KEYS if key in self}


def switch(
    default: Any = MISSING,
    *,
    help: str,
    factory: Any = MISSING,
    choices: tuple[str, ...] | None = None,
    range: Range | None = None,
    role: str | None = None,
    env: str | None = None,
    formerly: str | None = None,
) -> Any:
    """A field of `Switches` with its metadata (module docstring); `factory` for a mutable default."""
    return field(
        default=default,
        default_factory=factory,
        metadata=_metadata(help, choices, range, role, env, formerly),
    )


def trl_switch(*, range: Range | None = None, role: str | None = None) -> SwitchMetadata:
    """A row of `TRL_SWITCHES`: what OPSD adds to a TRL field it leaves at TRL's default (its help is TRL's)."""
    return _metadata(None, None, range, role, None, None)


def _metadata(help, choices, range, role, env, formerly) -> SwitchMetadata:
    assert role in (None, *ROLES), role
    assert env is None or env.startswith(ENV_PREFIX), env
    given = {"help": help, "choices": choices, "range": range, "role": role, "env": env, "formerly": formerly}
    return SwitchMetadata({key: value for key, value in given.items() if value is not None})


@dataclass
class Switches:
    """OPSD's switches: every field of `OPSDConfig` that OPSD declares (its own, and TRL/transformers arguments
    with the published recipe's default). `OPSDConfig` adds TRL's `SDFTConfig`, the checks and the derived fields."""

    # Published recipe values for inherited TRL/transformers arguments (docs/method.md §2) -------------------------
    output_dir: str = switch("runs/opsd", role=BUDGET, help="Where checkpoints, config and metrics.jsonl go.")
    # TrainingArguments reads max_steps <= 0 as "train by epochs", which OPSD does not do.
    max_steps: int = switch(
        100,
        role=BUDGET,
        range=Range(0, lo_open=True, note="OPSD trains for a number of optimizer steps"),
        help="Optimizer steps (the capped budget is 100).",
    )
    # 0 would spend the whole budget without moving a weight; the base model is that control.
    # Adam moves each weight by about the learning rate per step: beyond 1, by more than the weights' own scale.
    learning_rate: float = switch(
        5e-6, role=METHOD, range=Range(0, 1, lo_open=True), help="Peak learning rate."
    )
    lr_scheduler_type: str = switch(
        "constant", role=METHOD, help="constant (published) | linear | cosine | ..."
    )
    max_grad_norm: float = switch(
        0.1, role=METHOD, range=Range(0, note="0 = no clipping"), help="Gradient clipping norm."
    )
    # AdamW multiplies each weight by 1 - lr x weight_decay per step: with both at most 1 it stays in [0, 1].
    weight_decay: float = switch(0.0, role=METHOD, range=Range(0, 1), help="AdamW weight decay.")
    per_device_train_batch_size: int = switch(
        4,
        role=BUDGET,
        range=Range(1, MAX_BATCH_ROWS, note="rows generated and held at once"),
        help="Problems per device per micro-batch.",
    )
    gradient_accumulation_steps: int = switch(
        2,
        role=BUDGET,
        range=Range(1, MAX_BATCH_ROWS, note="a step's micro-batches are generated at once"),
        help="Micro-batches per optimizer step.",
    )
    micro_batch_size: str | None = switch(
        None,
        role=OPERATIONAL,
        help="Rows per forward/backward, keeping per_device_train_batch_size x gradient_accumulation_steps "
        "problems per process per step (memory, not method; opsd.speed.microbatch): unset = "
        "per_device_train_batch_size as given; N (must divide them); auto = the largest that fits beside "
        "the engine on a GPU, the plan as given without one. train_capped.sh uses auto. Parsed once, here, "
        "into None, an int or 'auto'.",
    )
    gradient_checkpointing: bool = switch(True, role=OPERATIONAL, help="Recompute activations in backward.")
    compile_layers: bool = switch(
        False,
        role=OPERATIONAL,
        help="torch.compile every decoder layer for the training and teacher forwards; generation stays eager "
        "(time, not method: opsd.speed.compiled_layers). The first steps and each new sequence width pay "
        "the compile; on a CPU it needs a C++ compiler.",
    )
    bf16: bool = switch(True, help="bf16 mixed precision (turned off with a log line when no GPU).")
    logging_steps: float = switch(
        1,
        role=OPERATIONAL,
        range=Range(0, lo_open=True, note="a value below 1 is a fraction of max_steps"),
        help="Log every N optimizer steps.",
    )
    save_steps: float = switch(
        50,
        role=BUDGET,
        range=Range(0, lo_open=True, note="a value below 1 is a fraction of max_steps"),
        help="Checkpoint every N optimizer steps.",
    )
    report_to: str = switch(
        "none", role=OPERATIONAL, help="Trackers: none | wandb | tensorboard | trackio ..."
    )
    num_generations: int = switch(
        0,
        role=METHOD,
        range=Range(
            0, MAX_GENERATIONS, note="0 = the method's own; a step's G x problems rollouts are held at once"
        ),
        help="Rollouts per problem (G): 0 = the method's own, 1 for opsd and TRL's 8 for grpo and hybrid; opsd takes "
        "1, grpo and hybrid at least 2. A GRPO step samples problems per step x G rollouts.",
    )
    max_prompt_length: int | None = switch(
        None,
        help="Ignored with a logged note (TRL/open-r1 recipes carry it): prompts are never cut; see "
        "max_teacher_prompt_length.",
    )
    max_completion_length: int | None = switch(
        1024,
        role=METHOD,
        range=Range(0, MAX_TOKENS, lo_open=True, note="a token count beyond every model's context"),
        help="Rollout length cap in tokens.",
    )
    temperature: float = switch(
        1.1,
        role=METHOD,
        range=Range(MIN_TEMPERATURE, MAX_TEMPERATURE, note="the logits are divided by it"),
        help="Rollout sampling temperature.",
    )
    top_p: float = switch(0.95, role=METHOD, range=PROBABILITY_OPEN_LOW, help="Rollout top-p.")
    top_k: int = switch(
        20,
        role=METHOD,
        range=Range(0, MAX_TOKENS, note="0 = off; beyond every vocabulary"),
        help="Rollout top-k (0 = off).",
    )
    steps_per_rollout: int = switch(
        1,
        role=METHOD,
        range=Range(1, note="1 = on-policy"),
        help="Optimizer steps served by one generation: the student rolls out k steps' problems at once with "
        "the weights of the window's first step, and each step trains on its own problems (steps after "
        "the first are up to k-1 steps off-policy: rollout/staleness_steps). 1 = on-policy (published). "
        "Must divide max_steps; TRL's steps_per_generation becomes k x gradient_accumulation_steps.",
    )
    vllm_gpu_memory_utilization: float = switch(
        0.6, role=OPERATIONAL, range=PROBABILITY_OPEN_LOW, help="Share of GPU memory for colocated vLLM."
    )
    vllm_max_num_seqs: int = switch(
        0,
        role=OPERATIONAL,
        range=Range(0, MAX_BATCH_ROWS, note="0 = TRL's sizing; vLLM preallocates its batch for this many"),
        help="Most sequences the colocated vLLM engine decodes at once; 0 = TRL's sizing (per-device batch x "
        "TP x steps per generation). 1 makes rollouts independent of the process count, slowly.",
    )
    vllm_mode: str = switch(
        "colocate", help="colocate (vLLM inside the training processes) | server (trl vllm-serve)."
    )
    # Method -----------------------------------------------------------------------------------------------
    method: str = switch(
        "opsd",
        role=METHOD,
        choices=methods.NAMES,
        help="What the run trains (docs/method.md §6; the methods are registered in opsd/methods.py): opsd (self-distillation, this repo's trainer) | grpo (TRL's "
        "GRPOTrainer, rewarded by the evaluation's grader) | hybrid (GRPO's loss plus sd_weight x the OPSD loss "
        "on the same G rollouts per problem).",
    )
    sd_weight: float = switch(
        1.0,
        role=METHOD,
        range=Range(0, MAX_LOSS_FACTOR, note="0 = the GRPO loss alone"),
        help="method=hybrid: weight of the OPSD loss added to GRPO's; 0 = TRL's GRPO loss alone.",
    )
    hybrid_route: str = switch(
        "mix",
        role=METHOD,
        choices=("mix", "group", "sample"),
        help="method=hybrid: which rollouts each term trains on: mix (GRPO's loss + sd_weight x OPSD's on every "
        "rollout) | group (the OPSD term only on the rollouts of groups whose rewards are all equal, which give "
        "GRPO no signal; GRPO on the rest) | sample (correct rollouts get the GRPO term, failed ones the OPSD "
        "term, their GRPO advantage set to 0).",
    )
    budget_unit: str = switch(
        "problems",
        role=METHOD,
        choices=("problems", "rollouts"),
        help="What a step's count counts (per_device_train_batch_size x gradient_accumulation_steps x processes; "
        "the capped budget's 32): problems (each sampled G times: 32 problems x G rollouts) | rollouts (G=4: "
        "8 problems x 4 rollouts); per_device_train_batch_size then counts rollouts and must be a multiple of "
        "num_generations. The same for method=opsd (one rollout per problem).",
    )
    # GRPO (TRL's GRPOConfig, method=grpo and hybrid): OPSD's own loss_type and beta mean its divergence, so TRL's
    # loss_type and beta are rl_loss_type and rl_beta here; the defaults are TRL's.
    rl_loss_type: str = switch(
        "dapo",
        role=METHOD,
        choices=("dapo", "dr_grpo", "grpo", "bnpo"),
        help="GRPO's loss_type (TRL's, docs/method.md §6): dapo (TRL's default: token-level, divided by the "
        "step's loss tokens) | dr_grpo (divided by rows x max_completion_length) | grpo (each row's mean, "
        "then the mean over rows) | bnpo (divided by the micro-batch's loss tokens).",
    )
    # 0 stands for TRL's None (every source writes a number); a bound below epsilon would clip the ratio's rise
    # tighter than its fall, the opposite of DAPO's clip-higher; a ratio above 11 is past any real update
    # (ScaleRL's CISPO, the loosest use, recommends 5).
    epsilon_high: float = switch(
        0.0,
        role=METHOD,
        range=Range(0.2, 10, zero=True, note="0 = epsilon, 0.2; the upper bound is at least the lower"),
        help="Upper clip of GRPO's ratio, 1 + epsilon_high (DAPO's clip-higher: 0.28); 0 = TRL's None, the "
        "lower bound's epsilon (0.2).",
    )
    mask_truncated_completions: bool = switch(
        False,
        role=METHOD,
        help="GRPO: leave completions cut at max_completion_length (no EOS) out of the loss (DAPO's overlong "
        "filtering).",
    )
    scale_rewards: str = switch(
        "group",
        role=METHOD,
        choices=("group", "batch", "none"),
        help="GRPO's advantage scale (TRL's): group (divided by the group's reward std) | batch (by the "
        "batch's) | none (Dr. GRPO: centred only).",
    )
    rl_beta: float = switch(
        0.0,
        role=METHOD,
        range=Range(0, MAX_LOSS_FACTOR, note="0 = no KL term and no reference forward"),
        help="GRPO's beta (TRL's): weight of the KL to the reference policy (the initial weights); 0 = none.",
    )
    # Model ------------------------------------------------------------------------------------------------
    model_name_or_path: str = switch(
        "", role=BUDGET, help="Hub name or local directory; empty = the embedded SmolLM2-135M-Instruct."
    )
    model_revision: str = switch(
        "main", help="Hub revision (branch, tag or commit) of the model and its tokenizer."
    )
    torch_dtype: str | None = switch(
        None, help="Older name of `dtype` (TRL/open-r1 configs); sets dtype when given."
    )
    dtype: str = switch(
        "auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="auto (bf16 on GPU, fp32 on CPU) | bfloat16 | float16 | float32.",
    )
    attn_implementation: str = switch(
        "auto", help="auto (flash_attention_2 if installed on GPU, else sdpa) | sdpa | eager | ..."
    )
    allow_missing_weights: bool = switch(
        False,
        help="Train even when the checkpoint lacks weights of the model, which transformers then initialises at "
        "random (an lm_head missing under an untied config, say); without it such a model is refused in "
        "one line naming them.",
    )
    use_peft: bool = switch(True, help="Train LoRA adapters (published recipe) instead of all weights.")
    lora_r: int = switch(64, role=METHOD, range=Range(0, MAX_LORA_RANK, lo_open=True), help="LoRA rank.")
    # The adapter's output is scaled by lora_alpha / lora_r: a factor on the gradient, bounded as the loss's are.
    lora_alpha: int = switch(
        128, role=METHOD, range=Range(0, MAX_LOSS_FACTOR, lo_open=True), help="LoRA alpha."
    )
    lora_dropout: float = switch(0.0, role=METHOD, range=Range(0, 1, hi_open=True), help="LoRA dropout.")
    lora_target_modules: list[str] = switch(
        factory=lambda: ["auto"],
        help="Module names that get LoRA adapters: a YAML list, `--lora_target_modules q_proj k_proj`, or "
        "comma-separated (`q_proj,k_proj`, the recipe.env / OPSD_* form); `all-linear` as in peft; `auto`: "
        "the linear projections of every layer kind (q, k, v, o, gate, up, down on dense models, the "
        "published recipe's), minus those a fused kernel reads directly (docs/families.md).",
    )
    # Data and prompts -------------------------------------------------------------------------------------
    dataset_name: str = switch(
        "builtin",
        role=BUDGET,
        help="builtin (generated problems), a hub dataset (siyanzhao/Openthoughts_math_30k_opsd) or a file.",
    )
    dataset_split: str = switch("train", role=BUDGET, help="Split of a hub dataset.")
    data_filter: str = switch(
        "none",
        role=METHOD,
        choices=("none", "numeric", "hard_numeric"),
        help="none | numeric | hard_numeric (docs/method.md §2).",
    )
    teacher_ref: str = switch(
        "solution",
        role=METHOD,
        choices=tuple(REFERENCE_COLUMNS),
        help="Privileged context: solution | cot (COT_Reason) | answer (the Answer column alone, in the same "
        "template; docs/method.md §1.10).",
    )
    # The cut keeps ceil(f x n) tokens with f x n rounded to 9 decimals: below 1e-9 that is no token.
    teacher_ref_fraction: float = switch(
        1.0,
        role=METHOD,
        range=Range(
            MIN_REFERENCE_FRACTION, 1, note="1 = the whole reference; a smaller f rounds f x n to no token"
        ),
        help="The teacher sees the first ceil(f x n) of the reference's n tokens (the model's tokenizer), at least "
        "one whole character, after teacher_ref_max_chars; 1 = all of it. The cut is logged once with an "
        "example. Below 1 it is refused with teacher_contrast=wrong_answer (the cut would drop the answer "
        "from both hints).",
    )
    teacher_contrast: str = switch(
        "none",
        role=METHOD,
        choices=("none", "shuffled", "wrong_answer", "own_wrong"),
        help="Contrastive teacher, RLCSD's target (docs/method.md §1.10): none (published) | shuffled (the wrong hint "
        "is another problem's reference, a fixed derangement drawn from seed) | wrong_answer (the problem's own "
        "reference with its final answer replaced by another value of the same kind) | own_wrong "
        "(method=hybrid: up to contrast_hints incorrect sibling rollouts, the hint a correct sibling or the "
        "reference). One more teacher forward per wrong hint.",
    )
    # alpha: (1 + alpha) log p_T(c) stays far inside float32 even at log p = -1e4 (the exact tail bucket is >= about
    # -104, the log of float32's smallest positive value).
    contrast_weight: float = switch(
        0.5,
        role=METHOD,
        range=Range(0, 1000, note="0 = OPSD's teacher on the target's buckets"),
        help="alpha of the contrastive target q ~ p_T(.|c)^(1+alpha) / max(p_T(.|c~), e^floor)^alpha "
        "(teacher_contrast); 0 = OPSD's teacher on the same buckets.",
    )
    contrast_top_k: int = switch(
        100,
        role=METHOD,
        range=Range(1, MAX_TOKENS),
        help="The teacher's top-k tokens the contrastive target keeps beside a tail bucket.",
    )
    contrast_log_floor: float = switch(
        -5.0,
        role=METHOD,
        range=Range(-1000, 0, note="log p_T(.|c~) below it counts as it"),
        help="Floor on log p_T(.|c~) inside the contrastive target.",
    )
    contrast_kl_tau: float = switch(
        1.0,
        role=METHOD,
        range=Range(
            MIN_CONTRAST_TAU, 1e6, zero=True, note="0 = no token weight; a smaller tau is 0 in float32: 0 / 0"
        ),
        help="tau of the contrastive token weight KL(c||c~) / (KL + tau); 0 = no weight.",
    )
    contrast_hints: int = switch(
        4,
        role=METHOD,
        range=Range(1, 64),
        help="teacher_contrast=own_wrong: at most this many wrong sibling rollouts per rollout (K).",
    )
    contrast_rl_weight: float = switch(
        0.5,
        role=METHOD,
        range=Range(0, 2, note="0 = no modulation; RLCSD clips the modulation at 2"),
        help="method=hybrid with a contrast: lambda of RLCSD's modulation lambda tanh(e_ctr / tau) added to the "
        "GRPO advantage under a sign-preserving clamp; 0 = none.",
    )
    contrast_rl_tau: float = switch(
        0.02,
        role=METHOD,
        range=Range(MIN_CONTRAST_TAU, 1e6, note="a smaller tau is 0 in float32: tanh(0 / 0)"),
        help="tau of RLCSD's modulation tanh(e_ctr / tau), in nats.",
    )
    contrast_rl_delta: float = switch(
        0.02,
        role=METHOD,
        range=Range(0, 2, note="0 = every token with a nonzero modulation"),
        help="RLCSD's modulation is applied where its magnitude exceeds delta.",
    )
    token_weight: str = switch(
        "none",
        role=METHOD,
        choices=("none", "position_early", "position_late", "entropy_gate", "positive_only"),
        help="Per-token loss weight (docs/method.md §1.12): none (published) | position_early (IW-OPD) | "
        "position_late (position-weighted OPSD) | entropy_gate (teacher entropy, with a floor) | "
        "positive_only (tokens the teacher makes likelier).",
    )
    teacher_ref_pairing: str = switch(
        "matched",
        role=METHOD,
        choices=("matched", "shuffled", "empty"),
        help="Whose reference a problem's teacher reads: matched (its own, published) | shuffled (another "
        "problem's, a fixed derangement drawn from seed; teacher_pairing.json) | empty (an empty reference "
        "block) (docs/method.md §1.8).",
    )
    teacher_ref_max_chars: int = switch(
        8000,
        role=METHOD,
        range=Range(0, note="0 = no cut"),
        help="Cut the reference to this many characters; 0 = no cut.",
    )
    max_teacher_prompt_length: int = switch(
        4096,
        role=METHOD,
        range=Range(0, MAX_TOKENS, note="0 = no cap; a token count beyond every model's context"),
        help="Teacher prompt token cap; longer prompts are cut inside the reference. 0 = none.",
    )
    student_thinking: bool = switch(
        False, role=METHOD, help="Student prompt with thinking on (off appends the empty think block)."
    )
    teacher_thinking: bool = switch(True, role=METHOD, help="Teacher prompt with thinking on.")
    thinking_switch: str = switch(
        "auto",
        role=METHOD,
        help="The chat-template variable student_thinking and teacher_thinking set: auto (enable_thinking where "
        "the template reads it, else none with a warning) | none (the template has no switch) | a name.",
    )
    student_prompt_file: str = switch(
        "", role=METHOD, help="Text file replacing the student template ({problem})."
    )
    teacher_prompt_file: str = switch(
        "", role=METHOD, help="Text file replacing the teacher template ({problem}, {reference})."
    )
    # Loss ---------------------------------------------------------------------------------------------------
    beta: float = switch(
        0.0,
        role=METHOD,
        range=Range(0, 1),
        help="JSD interpolation: 0 = forward KL(p_T||p_S), 1 = reverse KL.",
    )
    loss_temperature: float = switch(
        0.0,
        role=METHOD,
        range=Range(MIN_TEMPERATURE, MAX_TEMPERATURE, zero=True, note="0 = rollout temperature"),
        help="Temperature of both distributions in the loss; 0 = rollout temperature.",
    )
    # A per-token divergence of float32 probabilities is far below 1e4 nats: a larger clip clips nothing.
    divergence_clip: float = switch(
        0.05,
        role=METHOD,
        formerly="jsd_token_clip",
        range=Range(0, MAX_LOSS_FACTOR, lo_open=True, note="use clip_mode=none to disable clipping"),
        help="Clip threshold of the divergence: of each vocabulary entry's term (clip_mode=element), or of a "
        "token's sum (token, rescale). Formerly jsd_token_clip, still accepted.",
    )
    clip_mode: str = switch(
        "element",
        role=METHOD,
        choices=("element", "token", "rescale", "none"),
        help="element | token | rescale | none (docs/method.md §1.4).",
    )
    top_k_loss: int = switch(
        0,
        role=METHOD,
        range=Range(0, MAX_TOKENS, note="0 = off; beyond every vocabulary"),
        help="Restrict both distributions to the teacher's top-k; 0 = full vocabulary.",
    )
    loss_type: str = switch(
        "jsd",
        role=METHOD,
        choices=("jsd", "sampled_token", "fixed_advantage"),
        help="jsd (full-distribution) | sampled_token (policy gradient on log p_T - log p_S) | fixed_advantage "
        "(the teacher-free control: policy gradient with the constant fixed_advantage; no teacher prompt "
        "or forward).",
    )
    # A positive constant would raise the probability of every sampled token: the opposite of the control.
    fixed_advantage: float = switch(
        -0.25,
        role=METHOD,
        range=Range(
            -MAX_LOSS_FACTOR, 0, hi_open=True, note="a negative constant: sampled tokens are pushed down"
        ),
        help="The constant advantage a < 0 of loss_type=fixed_advantage: loss = -a log p_S(y) per sampled token "
        "(docs/method.md §1.11 says how the default was chosen).",
    )
    loss_chunk_size: int = switch(
        1024,
        role=OPERATIONAL,
        range=Range(1, MAX_TOKENS, note="a chunk's (tokens, vocabulary) buffers are held at once"),
        help="Tokens per chunk of the memory-flat loss.",
    )
    fix_position_ids: bool = switch(
        True,
        role=METHOD,
        help="Positions = index in the unpadded sequence; false scores the reference code's rows exactly "
        "(right-padded prompts, pad-id mask, completion token j at position P + j).",
    )
    num_loss_tokens_to_skip: int = switch(
        0,
        role=METHOD,
        range=Range(0, MAX_TOKENS, note="0 = none"),
        help="Leave the first N completion tokens out of the loss, its token count and the opsd/* metrics.",
    )
    # Teacher ------------------------------------------------------------------------------------------------
    teacher_mode: str = switch(
        "fixed",
        role=METHOD,
        choices=("fixed", "ema", "dynamic"),
        help="fixed (initial policy) | ema | dynamic (current weights).",
    )
    ema_decay: float = switch(
        0.999,
        role=METHOD,
        range=Range(0, 1, lo_open=True, hi_open=True),
        help="EMA decay of the teacher weights (teacher_mode=ema).",
    )
    # Safety -------------------------------------------------------------------------------------------------
    max_nonfinite_steps: int = switch(
        3,
        role=METHOD,
        range=Range(1, note="1 = stop at the first"),
        help="A step whose loss or gradient is not finite is skipped (no update); stop the run after this many "
        "consecutive skipped steps (1 = stop at the first).",
    )
    # Rollouts -----------------------------------------------------------------------------------------------
    rollout_engine: str = switch(
        "auto",
        choices=("auto", "vllm", "transformers"),
        help="auto (vLLM if installed, else transformers with a warning) | vllm | transformers.",
    )
    use_vllm: bool | None = switch(
        None,
        help="Whether rollouts use vLLM (true) or transformers.generate (false). Unset: rollout_engine decides "
        "(auto: vLLM if installed). Given with rollout_engine=auto it decides; with vllm or transformers it must "
        "agree.",
    )
    # Budget helpers -------------------------------------------------------------------------------------------
    wavg_last: int = switch(
        0,
        role=METHOD,
        range=OFF_AT_ZERO,
        help="Average trainable weights over the last N optimizer steps; 0 = off.",
    )
    # Probe --------------------------------------------------------------------------------------------------
    probe_steps: int = switch(
        10,
        role=METHOD,
        range=OFF_AT_ZERO,
        help="Score the held-out probe (divergence, top-1 agreement, teacher-token log-prob) every N steps; 0 = off.",
    )
    probe_size: int = switch(
        16,
        role=BUDGET,
        range=Range(0, MAX_BATCH_ROWS, note="0 = off; the held-out problems are rolled out at once"),
        help="Problems held out of the training data for the probe (rounded down to a multiple of the "
        "processes); 0 = no probe and no hold-out.",
    )

    # Completions log ---------------------------------------------------------------------------------------
    completions_steps: int = switch(
        10,
        role=OPERATIONAL,
        range=OFF_AT_ZERO,
        help="Every N steps write a few (problem, reference, completion, per-token divergence) rows to "
        "completions.jsonl and to W&B; 0 = off.",
    )
    completions_rows: int = switch(
        4, role=OPERATIONAL, range=POSITIVE, help="Rows per completions log entry."
    )

    @property
    def contrast_on(self) -> bool:
        """Whether the teacher is contrastive (RLCSD's target, `teacher_contrast`, docs/method.md §1.10): the one
        place this is decided, for the loss, the checks and the switches it leaves idle."""
        return self.teacher_contrast != "none"


# TRL/transformers fields that OPSD leaves at TRL's default, with the range or role OPSD gives them.
TRL_SWITCHES: dict[str, SwitchMetadata] = {
    # optimiser and schedule: method switches
    "warmup_steps": trl_switch(
        role=METHOD, range=Range(0, note="a value below 1 is a fraction of max_steps")
    ),
    "adam_beta1": trl_switch(role=METHOD, range=Range(0, 1, hi_open=True)),
    "adam_beta2": trl_switch(role=METHOD, range=Range(0, 1, hi_open=True)),
    "adam_epsilon": trl_switch(
        range=Range(
            MIN_ADAM_EPSILON, note="Adam divides by sqrt(v) + epsilon, and v is 0 for a zero gradient"
        )
    ),
    # budget: steps, problems per step, reuse of each rollout, what is trained on, where results land
    "num_train_epochs": trl_switch(role=BUDGET),
    "auto_find_batch_size": trl_switch(role=BUDGET),
    "generation_batch_size": trl_switch(role=BUDGET),
    "steps_per_generation": trl_switch(role=BUDGET),
    "num_iterations": trl_switch(role=BUDGET, range=Range(1)),
    "seed": trl_switch(role=BUDGET, range=Range(0, SEED_MAX)),
    "data_seed": trl_switch(role=BUDGET, range=Range(0, SEED_MAX, optional=True)),
    "save_strategy": trl_switch(role=BUDGET),
    "resume_from_checkpoint": trl_switch(role=BUDGET),
    # operational: trackers, logging, the engine's sleep
    "run_name": trl_switch(role=OPERATIONAL),
    "logging_first_step": trl_switch(role=OPERATIONAL),
    "log_level": trl_switch(role=OPERATIONAL),
    "disable_tqdm": trl_switch(role=OPERATIONAL),
    "vllm_enable_sleep_mode": trl_switch(role=OPERATIONAL),
    # rollouts and the engine: flags and YAML only
    "min_p": trl_switch(range=Range(0, 1, optional=True)),
    "repetition_penalty": trl_switch(range=POSITIVE),
    "vllm_tensor_parallel_size": trl_switch(range=Range(1)),
    "vllm_max_model_length": trl_switch(range=Range(0, MAX_TOKENS, lo_open=True, optional=True)),
    "vllm_server_port": trl_switch(range=Range(1, 65535)),
    "vllm_server_timeout": trl_switch(range=POSITIVE),
    "dataloader_num_workers": trl_switch(range=NON_NEGATIVE),
    "teacher_sync_steps": trl_switch(range=Range(1)),
}

# field -> its metadata: OPSD's fields in the order `Switches` declares them, then `TRL_SWITCHES`.
SWITCHES: dict[str, Mapping[str, Any]] = {f.name: f.metadata for f in fields(Switches)} | TRL_SWITCHES


def _having(key: str) -> dict[str, Any]:
    return {name: meta[key] for name, meta in SWITCHES.items() if key in meta}


def _with_role(role: str) -> frozenset[str]:
    return frozenset(name for name, meta in SWITCHES.items() if meta.get("role") == role)


# Views of the metadata (read them here; the values live in the fields above).
CHOICES: dict[str, tuple[str, ...]] = _having("choices")  # field -> allowed values
RANGES: dict[str, Range] = _having("range")  # field -> allowed range
ALIASES: dict[str, str] = {old: name for name, old in _having("formerly").items()}  # older name -> field
# Which fields recipe.env, OPSD_* and the harness's flags may set (docs/method.md §3): the method's (RECIPE_KEYS)
# and the operational ones (OPERATIONAL_KEYS, also pass-through flags); the capped harness fixes BUDGET_KEYS.
RECIPE_KEYS = _with_role(METHOD)
OPERATIONAL_KEYS = _with_role(OPERATIONAL)
BUDGET_KEYS = _with_role(BUDGET)
CAPPED_KEYS = RECIPE_KEYS | OPERATIONAL_KEYS
# Fields whose OPSD_* variable is declared (`env`), by variable.
_ENV_FIELDS = {variable: name for name, variable in _having("env").items()}


def env_name(name: str) -> str:
    """The `OPSD_*` variable of field `name`: `OPSD_` + its name in upper case, unless its metadata declares one."""
    return SWITCHES.get(name, {}).get("env") or ENV_PREFIX + name.upper()


def field_of_env(variable: str) -> str:
    """The field an `OPSD_*` variable (or a recipe.env key, with or without the prefix) names; the inverse of
    `env_name`, in lower case as fields are (a variable or key not in upper case is refused by
    `opsd.configuration.sources`, naming the field meant)."""
    variable = ENV_PREFIX + variable.removeprefix(ENV_PREFIX)
    return _ENV_FIELDS.get(variable, variable.removeprefix(ENV_PREFIX).lower())
