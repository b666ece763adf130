"""The allowed range of every numeric field a user sets, declared once: `RANGES` for `OPSDConfig` (training),
`EVAL_RANGES` for `EvalConfig` (eval_aime.py). Choices: `opsd.configuration.checks.choices`.

`OPSDConfig.__post_init__` checks every field of `RANGES` with `check_ranges`, so the CLI, a YAML config,
`recipe.env`, `OPSD_*` variables and both dry runs (`opsd_train.py --dry-run`, `train_capped.sh --dry-run`)
refuse the same values with the same message: `top_p=1.5 is out of range: must be in (0, 1]`. A value
must also be finite (`--learning_rate inf` is refused). The bounds are those of the code that reads the
value: torch's AdamW refuses betas outside [0, 1) and a negative weight decay or epsilon, peft's dropout
is a probability below 1, vLLM takes a share of GPU memory in (0, 1], numpy seeds are 32-bit unsigned.
Refusing here turns a crash after the model has loaded (or a silent no-op such as a run that is all
warm-up) into one line before anything loads. `EvalConfig.__post_init__` checks `EVAL_RANGES` with
`check_table` in eval_aime.py's words: `top_p=1.5 is invalid: must be in (0, 1]`.

Cross-field rules live in `check_cross_fields`: a warm-up of at least `max_steps` steps is refused, and
one over half of the run is logged as a note. No dependencies, so any module can import it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)


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

# OPSDConfig field -> allowed range. Every numeric field of RECIPE_KEYS, OPERATIONAL_KEYS and BUDGET_KEYS
# (opsd/configuration/sources/keys.py) is here, with OPSD's own fields and the TRL sampling options; tests
# walk the table.
RANGES: dict[str, Range] = {
    # optimiser and schedule
    # 0 would spend the whole budget without moving a weight; the base model is that control.
    # Adam moves each weight by about the learning rate per step: beyond 1, by more than the weights' own scale.
    "learning_rate": Range(0, 1, lo_open=True),
    "warmup_steps": Range(0, note="a value below 1 is a fraction of max_steps"),
    # AdamW multiplies each weight by 1 - lr x weight_decay per step: with both at most 1 it stays in [0, 1].
    "weight_decay": Range(0, 1),
    "max_grad_norm": Range(0, note="0 = no clipping"),
    "adam_beta1": Range(0, 1, hi_open=True),
    "adam_beta2": Range(0, 1, hi_open=True),
    "adam_epsilon": Range(
        MIN_ADAM_EPSILON, note="Adam divides by sqrt(v) + epsilon, and v is 0 for a zero gradient"
    ),
    # budget
    # TrainingArguments reads max_steps <= 0 as "train by epochs", which OPSD does not do.
    "max_steps": Range(0, lo_open=True, note="OPSD trains for a number of optimizer steps"),
    "per_device_train_batch_size": Range(1),
    "gradient_accumulation_steps": Range(1),
    "seed": Range(0, SEED_MAX),
    "data_seed": Range(0, SEED_MAX, optional=True),
    "probe_size": Range(0, note="0 = off"),
    "save_steps": Range(0, lo_open=True, note="a value below 1 is a fraction of max_steps"),
    # rollouts
    "temperature": Range(MIN_TEMPERATURE, MAX_TEMPERATURE, note="the logits are divided by it"),
    "top_p": PROBABILITY_OPEN_LOW,
    "top_k": OFF_AT_ZERO,
    "min_p": Range(0, 1, optional=True),
    "repetition_penalty": POSITIVE,
    "max_completion_length": Range(0, lo_open=True),
    "vllm_gpu_memory_utilization": PROBABILITY_OPEN_LOW,
    "vllm_max_num_seqs": Range(0, note="0 = TRL's sizing"),
    "vllm_tensor_parallel_size": Range(1),
    "vllm_max_model_length": Range(0, lo_open=True, optional=True),
    "vllm_server_port": Range(1, 65535),
    "vllm_server_timeout": POSITIVE,
    "num_iterations": Range(1),
    "steps_per_rollout": Range(1, note="1 = on-policy"),
    "dataloader_num_workers": NON_NEGATIVE,
    # loss
    "beta": Range(0, 1),
    "loss_temperature": Range(MIN_TEMPERATURE, MAX_TEMPERATURE, zero=True, note="0 = rollout temperature"),
    # A per-token divergence of float32 probabilities is far below 1e4 nats: a larger clip clips nothing.
    "divergence_clip": Range(0, MAX_LOSS_FACTOR, lo_open=True, note="use clip_mode=none to disable clipping"),
    "top_k_loss": OFF_AT_ZERO,
    "loss_chunk_size": POSITIVE,
    "num_loss_tokens_to_skip": Range(0, MAX_TOKENS, note="0 = none"),
    "sd_weight": Range(0, MAX_LOSS_FACTOR, note="0 = the GRPO loss alone"),
    # alpha: (1 + alpha) log p_T(c) stays far inside float32 even at log p = -1e4 (the tail bucket is >= -16.2).
    "contrast_weight": Range(0, 1000, note="0 = OPSD's teacher on the target's buckets"),
    "contrast_top_k": Range(1, MAX_TOKENS),
    "contrast_log_floor": Range(-1000, 0, note="log p_T(.|c~) below it counts as it"),
    "contrast_kl_tau": Range(0, 1e6, note="0 = no token weight"),
    "contrast_hints": Range(1, 64),
    "contrast_rl_weight": Range(0, 2, note="0 = no modulation; RLCSD clips the modulation at 2"),
    "contrast_rl_tau": Range(0, 1e6, lo_open=True),
    "contrast_rl_delta": Range(0, 2, note="0 = every token with a nonzero modulation"),
    # A positive constant would raise the probability of every sampled token: the opposite of the control.
    "fixed_advantage": Range(
        -MAX_LOSS_FACTOR, 0, hi_open=True, note="a negative constant: sampled tokens are pushed down"
    ),
    # LoRA
    "lora_r": Range(0, MAX_LORA_RANK, lo_open=True),
    # The adapter's output is scaled by lora_alpha / lora_r: a factor on the gradient, bounded as the loss's are.
    "lora_alpha": Range(0, MAX_LOSS_FACTOR, lo_open=True),
    "lora_dropout": Range(0, 1, hi_open=True),
    # teacher and data
    "ema_decay": Range(0, 1, lo_open=True, hi_open=True),
    "teacher_sync_steps": Range(1),
    "teacher_ref_max_chars": Range(0, note="0 = no cut"),
    # The cut keeps ceil(f x n) tokens with f x n rounded to 9 decimals: below 1e-9 that is no token.
    "teacher_ref_fraction": Range(
        MIN_REFERENCE_FRACTION, 1, note="1 = the whole reference; a smaller f rounds f x n to no token"
    ),
    "max_teacher_prompt_length": Range(0, note="0 = no cap"),
    # budget helpers, probe, safety, logging
    "wavg_last": OFF_AT_ZERO,
    "probe_steps": OFF_AT_ZERO,
    "max_nonfinite_steps": Range(1, note="1 = stop at the first"),
    "completions_steps": OFF_AT_ZERO,
    "completions_rows": POSITIVE,
    "logging_steps": Range(0, lo_open=True, note="a value below 1 is a fraction of max_steps"),
}
# EvalConfig field (eval_aime.py's flags) -> allowed range. pass@k's k is a rule between fields (1 <= k <= n),
# checked by EvalConfig itself.
EVAL_RANGES: dict[str, Range] = {
    "n": Range(1, note="at least one sample per problem; the protocol uses --n 12"),
    "temperature": Range(0, note="0 = greedy"),
    "top_p": PROBABILITY_OPEN_LOW,
    "top_k": OFF_AT_ZERO,
    "min_p": Range(0, 1),
    "max_tokens": Range(1),
    "max_model_len": Range(1),
    "tensor_parallel_size": Range(1),
    "num_gpus": Range(1),
    "chunk_size": Range(1),
    "max_in_flight": Range(0, note="0 = auto"),
    "limit": Range(0, note="0 = all problems"),
    "gpu_memory_utilization": PROBABILITY_OPEN_LOW,
}
# A warm-up over this share of max_steps is allowed, with a note: most of the run would be warm-up.
WARMUP_NOTE_SHARE = 0.5


def range_error(
    name: str, value: object, table: Mapping[str, Range] = RANGES, verdict: str = "is out of range"
) -> str | None:
    """The message refusing `value` for field `name` of `table`, or None when it is allowed (or `name` has no
    range): `top_p=1.5 is out of range: must be in (0, 1]`, with `verdict` between the value and the rule."""
    allowed = table.get(name)
    if allowed is None or allowed.contains(value):
        return None
    rule = allowed.rule()
    if isinstance(value, float) and not math.isfinite(value):
        rule = "must be finite and " + rule.removeprefix("must be ")
    return f"{name}={value!r} {verdict}: {rule}"


def check_table(config: object, table: Mapping[str, Range], verdict: str = "is out of range") -> None:
    """ValueError for the first field of `table`, in its order, whose value on `config` is out of range."""
    for name in table:
        if hasattr(config, name):
            message = range_error(name, getattr(config, name), table, verdict)
            if message:
                raise ValueError(message)


def check_ranges(config: object) -> None:
    """ValueError for the first field of `RANGES` whose value on `config` is out of range, then the
    cross-field rules."""
    check_table(config, RANGES)
    check_cross_fields(config)


def warmup_fraction(warmup_steps: float, max_steps: int) -> float:
    """The share of the run spent warming up (transformers reads a value below 1 as that share)."""
    return warmup_steps if warmup_steps < 1 else warmup_steps / max_steps


def check_teacher_variants(config: object) -> None:
    """Rules between the teacher's switches: a contrast needs a reference and a teacher, `wrong_answer` needs the
    whole reference (a fraction cuts c and c~ alike, mostly before the answer that tells them apart), and the
    teacher's top-k support has no meaning without one teacher distribution (docs/method.md §1.10-1.11)."""
    contrast = getattr(config, "teacher_contrast", "none")
    loss_type = getattr(config, "loss_type", "jsd")
    top_k = getattr(config, "top_k_loss", 0)
    problem = None
    if contrast != "none" and loss_type == "fixed_advantage":
        problem = (
            f"teacher_contrast={contrast} contrasts two teachers, and loss_type=fixed_advantage reads none; "
            "set teacher_contrast=none, or another loss_type"
        )
    elif (
        contrast in ("shuffled", "wrong_answer")
        and getattr(config, "teacher_ref_pairing", "matched") == "empty"
    ):
        problem = (
            f"teacher_contrast={contrast} needs a reference to contrast with a wrong one, and "
            "teacher_ref_pairing=empty gives the teacher none; use teacher_ref_pairing=matched or shuffled, or "
            "teacher_contrast=none"
        )
    elif contrast == "wrong_answer" and _below_one(getattr(config, "teacher_ref_fraction", 1.0)):
        problem = (
            f"teacher_contrast=wrong_answer replaces the reference's final answer, and teacher_ref_fraction="
            f"{config.teacher_ref_fraction!r} cuts both hints to the same first share of their tokens, which "
            "mostly ends before that answer (c~ = c: no signal); use teacher_ref_fraction=1, or "
            "teacher_contrast=shuffled"
        )
    elif top_k and contrast != "none":
        problem = (
            f"top_k_loss={top_k} restricts the loss to the teacher's top-k, and teacher_contrast={contrast} "
            "replaces the teacher by a target on its own top-k and a tail bucket (contrast_top_k); set top_k_loss=0"
        )
    elif loss_type == "fixed_advantage" and getattr(config, "token_weight", "none") != "none":
        problem = (
            f"token_weight={config.token_weight} weighs tokens by the teacher (or by the teacher's advantage), and "
            "loss_type=fixed_advantage reads none; set token_weight=none, or loss_type=jsd or sampled_token"
        )
    elif top_k and loss_type == "fixed_advantage":
        problem = (
            f"top_k_loss={top_k} restricts the loss to the teacher's top-k, and loss_type=fixed_advantage reads "
            "no teacher; set top_k_loss=0"
        )
    if problem:
        raise ValueError(problem)


def _below_one(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value < 1


def check_cross_fields(config: object) -> None:
    """Rules between fields: the warm-up must end before the last step (a note when it is over half); the
    teacher's switches agree (`check_teacher_variants`)."""
    check_teacher_variants(config)
    warmup, steps = getattr(config, "warmup_steps", 0) or 0, getattr(config, "max_steps", 0)
    if warmup >= 1 and warmup >= steps:
        raise ValueError(
            f"warmup_steps={warmup!r} is out of range: must be below max_steps={steps} (the whole run would "
            "be warm-up); lower it, or give a fraction of the run below 1"
        )
    if steps > 0 and warmup_fraction(warmup, steps) > WARMUP_NOTE_SHARE:
        logger.warning(
            "note: warmup_steps=%r is over half of max_steps=%d: most of the run trains at a reduced learning rate",
            warmup,
            steps,
        )
