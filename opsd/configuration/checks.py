"""How the settings of a run are checked: each value against its field's choices and range (declared once, in
`opsd.configuration.switches`), the rules between fields, the switches each method reads, the switches the
other settings leave without effect, and TRL's fields OPSD ignores. `check_settings` runs them all, in this order,
from `OPSDConfig.__post_init__` once the derived fields are set, so the CLI, a YAML config, `recipe.env`, `OPSD_*`
variables and both dry runs (`opsd_train.py --dry-run`, `train_capped.sh --dry-run`) refuse the same values with
the same one-line message: `top_p=1.5 is out of range: must be in (0, 1]`.

* Values: `check_choice`, `range_error`, `check_table` (also eval_aime.py's `EVAL_RANGES`, in its words:
  `top_p=1.5 is invalid: must be in (0, 1]`), and the two fields whose form is parsed
  (`parse_lora_target_modules`, `parse_micro_batch_size`). Refusing here turns a crash after the model has loaded
  (or a silent no-op such as a run that is all warm-up) into one line before anything loads.
* Rules between fields (`check_cross_fields`): a warm-up of at least `max_steps` steps is refused, one over half
  the run is a note; the teacher's switches agree (`check_teacher_variants`).
* The method (`check_method`): a switch set away from its default under a method that never reads it is refused,
  naming the method that reads it; so is a number of rollouts the method cannot take.
* Switches without effect (`inert_fields`, `warn_inert`): a value the other settings leave idle (`fixed_advantage`
  under `loss_type=jsd`) is one warning line, and the experiment compares its arms without them
  (`opsd.experiment.arms.effective_recipe`).
* TRL's options (`check_trl_options`): SDFT fields OPSDTrainer never reads are refused when set, `eval_strategy`
  (OPSD trains on no evaluation set), `max_prompt_length` (ignored, with a note); TRL's generation window must be
  `steps_per_rollout` whole optimizer steps (`check_steps_per_rollout`, `check_generation_window`).

Only the standard library and `switches`: any module can import it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

from opsd import methods
from opsd.configuration.switches import (
    AUTO,
    CHOICES,
    MAX_BATCH_ROWS,
    OFF_AT_ZERO,
    PROBABILITY_OPEN_LOW,
    RANGES,
    MicroBatchSize,
    Range,
    Switches,
)

logger = logging.getLogger(__name__)

# -- values ------------------------------------------------------------------------------------------------------

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
# vLLM's KV cache in evaluation: the model's dtype, or 8-bit floats (half the cache's reads on Hopper GPUs).
KV_CACHE_DTYPES = ("auto", "fp8")


def check_choice(name: str, value: str, allowed: tuple[str, ...] | None = None) -> None:
    """ValueError naming the switch, the bad value and the allowed ones (a field's `CHOICES` by default)."""
    allowed = CHOICES[name] if allowed is None else allowed
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {list(allowed)}")


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
    """ValueError for the first field of `RANGES` whose value on `config` is out of range, then the rules
    between fields."""
    check_table(config, RANGES)
    check_cross_fields(config)


MAX_MODULE_NAMES = 1000  # far more than any model's module kinds (a name is matched against every module)


def parse_lora_target_modules(value) -> list[str]:
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


# -- rules between fields ------------------------------------------------------------------------------------------

# A warm-up over this share of max_steps is allowed, with a note: most of the run would be warm-up.
WARMUP_NOTE_SHARE = 0.5


def warmup_fraction(warmup_steps: float, max_steps: int) -> float:
    """The share of the run spent warming up (transformers reads a value below 1 as that share)."""
    return warmup_steps if warmup_steps < 1 else warmup_steps / max_steps


def _teacher_variant_problem(config) -> str | None:
    """What `check_teacher_variants` refuses, in one line, or None."""
    contrast, loss_type, top_k = config.teacher_contrast, config.loss_type, config.top_k_loss
    if config.contrast_on and loss_type == "fixed_advantage":
        return (
            f"teacher_contrast={contrast} contrasts two teachers, and loss_type=fixed_advantage reads none; "
            "set teacher_contrast=none, or another loss_type"
        )
    if contrast in ("shuffled", "wrong_answer") and config.teacher_ref_pairing == "empty":
        return (
            f"teacher_contrast={contrast} needs a reference to contrast with a wrong one, and "
            "teacher_ref_pairing=empty gives the teacher none; use teacher_ref_pairing=matched or shuffled, or "
            "teacher_contrast=none"
        )
    if contrast == "wrong_answer" and _below_one(config.teacher_ref_fraction):
        return (
            f"teacher_contrast=wrong_answer replaces the reference's final answer, and teacher_ref_fraction="
            f"{config.teacher_ref_fraction!r} cuts both hints to the same first share of their tokens, which "
            "mostly ends before that answer (c~ = c: no signal); use teacher_ref_fraction=1, or "
            "teacher_contrast=shuffled"
        )
    if top_k and config.contrast_on:
        return (
            f"top_k_loss={top_k} restricts the loss to the teacher's top-k, and teacher_contrast={contrast} "
            "replaces the teacher by a target on its own top-k and a tail bucket (contrast_top_k); set top_k_loss=0"
        )
    if loss_type == "fixed_advantage" and config.token_weight != "none":
        return (
            f"token_weight={config.token_weight} weighs tokens by the teacher (or by the teacher's advantage), and "
            "loss_type=fixed_advantage reads none; set token_weight=none, or loss_type=jsd or sampled_token"
        )
    if top_k and loss_type == "fixed_advantage":
        return (
            f"top_k_loss={top_k} restricts the loss to the teacher's top-k, and loss_type=fixed_advantage reads "
            "no teacher; set top_k_loss=0"
        )
    return None


def check_teacher_variants(config) -> None:
    """Rules between the teacher's switches: a contrast needs a reference and a teacher, `wrong_answer` needs the
    whole reference (a fraction cuts c and c~ alike, mostly before the answer that tells them apart), and the
    teacher's top-k support has no meaning without one teacher distribution (docs/method.md §1.10-1.11)."""
    problem = _teacher_variant_problem(config)
    if problem:
        raise ValueError(problem)


def _below_one(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value < 1


def check_cross_fields(config) -> None:
    """Rules between fields: the warm-up must end before the last step (a note when it is over half); the
    teacher's switches agree (`check_teacher_variants`)."""
    check_teacher_variants(config)
    warmup, steps = config.warmup_steps or 0, config.max_steps
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


# -- the method's switches -----------------------------------------------------------------------------------------
# The methods share everything a comparison must hold fixed (model, LoRA, data, prompts, rollout sampling,
# optimiser, budget, seeds); each also reads switches the others do not (docs/method.md §6).


def default_generations(method: str) -> int:
    """The rollouts per problem of `method` when `num_generations` is 0 (`opsd.methods`): 1 for a method that
    samples one per problem, TRL's 8 for a group; 1 for a name the registry lacks, which the choice check refuses)."""
    return methods.REGISTRY[method].default_generations if method in methods.REGISTRY else 1


def _check_generations(method: str, generations: object) -> None:
    G, entry = generations, methods.get(method)
    if not isinstance(G, int) or isinstance(G, bool) or G < 0:
        raise ValueError(
            f"num_generations={G!r} is out of range: must be an integer >= 0 (0 = the method's own)"
        )
    groups = " or ".join(name for name, m in methods.REGISTRY.items() if m.rollouts == methods.GROUP)
    if entry.rollouts == 1 and G != 1:
        raise ValueError(
            f"num_generations={G} with method={method}: {entry.summary}, one rollout per problem; leave it unset "
            f"(or 1), or set method={groups} for G rollouts per problem"
        )
    if entry.rollouts == methods.GROUP and G < 2:
        raise ValueError(
            f"num_generations={G} with method={method}: GRPO normalises each reward within its problem's group, "
            "so it needs at least 2 rollouts per problem; leave it unset (TRL's 8) or give 2 or more"
        )


def _unread_switch(config, method: str, defaults: Mapping[str, object]) -> str | None:
    """The refusal of the first switch set away from its default that `method` never reads while another
    registered method does (`opsd.methods`), or None."""
    entry = methods.get(method)
    if config.teacher_contrast == "own_wrong" and entry.rollouts == 1:
        groups = " or ".join(name for name, m in methods.REGISTRY.items()
                             if m.rollouts == methods.GROUP and "teacher_contrast" in m.reads)  # fmt: skip
        return (
            "teacher_contrast=own_wrong takes its wrong hints from the other rollouts of the same problem, and "
            f"method={method} draws one rollout per problem; set method={groups} (num_generations rollouts per "
            "problem), or teacher_contrast=shuffled or wrong_answer"
        )
    for name in methods.METHOD_SWITCHES:
        value = getattr(config, name)
        if name in entry.reads or value == defaults[name]:
            continue
        readers = methods.readers(name)
        return (
            f"{name}={value!r} is read by method={' and '.join(readers)} only, and method={method} never reads it; "
            f"remove it, or set method={' or '.join(readers)}"
        )
    return None


def _check_budget_unit(config) -> None:
    """With budget_unit=rollouts, per_device_train_batch_size counts rollouts: whole groups of G per micro-batch."""
    batch, G = config.per_device_train_batch_size, config.num_generations
    if config.budget_unit != "rollouts" or batch % G == 0:
        return
    raise ValueError(
        f"budget_unit=rollouts counts rollouts per micro-batch, and per_device_train_batch_size={batch} is not a "
        f"multiple of num_generations={G} (a problem's G rollouts share a micro-batch); give a "
        f"per_device_train_batch_size that is a multiple of {G}, or budget_unit=problems"
    )


def _check_generation_rows(config) -> None:
    """The rows one process generates and holds at once (`MAX_BATCH_ROWS`): a step's micro-batches, times
    steps_per_rollout, each problem G times (budget_unit=problems; with rollouts the batch counts them)."""
    G = config.num_generations if config.budget_unit == "problems" else 1
    batch, accumulation, k = (
        config.per_device_train_batch_size,
        config.gradient_accumulation_steps,
        config.steps_per_rollout,
    )
    rows = batch * accumulation * k * G
    if rows > MAX_BATCH_ROWS:
        raise ValueError(
            f"per_device_train_batch_size={batch} x gradient_accumulation_steps={accumulation} x steps_per_rollout={k} "
            f"x num_generations={G} = {rows:,} rollouts generated and held at once by each process, over "
            f"{MAX_BATCH_ROWS:,}; give fewer problems per step or fewer rollouts per problem"
        )


def check_method(config) -> None:
    """ValueError for a number of rollouts the method cannot take (`num_generations` 0 is resolved to the method's
    own before: `OPSDConfig`'s derived fields), a switch the method does not read (set away from its default),
    sd_weight outside method=hybrid, or a hybrid teacher it cannot build."""
    method = config.method
    _check_generations(method, config.num_generations)
    _check_budget_unit(config)
    _check_generation_rows(config)
    problem = _unread_switch(config, method, {f.name: f.default for f in fields(config)})
    if problem:
        raise ValueError(problem)
    modes = methods.get(method).teacher_modes
    if modes is not None and config.teacher_mode == "fixed" and not config.use_peft:
        raise ValueError(
            f"teacher_mode=fixed with method={method} and use_peft=false: its fixed teacher is the initial "
            "policy under the LoRA student's adapters; train LoRA (use_peft=true) or use teacher_mode=dynamic"
        )
    if modes is not None and config.teacher_mode not in modes:
        raise ValueError(
            f"teacher_mode={config.teacher_mode} with method={method}: its teacher is one of "
            f"{', '.join(modes)} (fixed: the initial policy, dynamic: the student itself); use one of those, or "
            "method=opsd for an EMA teacher"
        )
    _check_sampler_reproduced(config)


def _check_sampler_reproduced(config) -> None:
    """GRPO's ratio scores each sampled token under the sampler's distribution (temperature, top-k, top-p:
    `opsd.method.sampler`); min_p and a repetition penalty change that distribution too, and are not reproduced."""
    if not methods.get(config.method).scores_sampler:
        return
    for name, off in (("min_p", (None, 0, 0.0)), ("repetition_penalty", (1, 1.0))):
        value = getattr(config, name, off[0])
        if value not in off:
            raise ValueError(
                f"{name}={value!r} with method={config.method}: GRPO's importance ratio scores each sampled token "
                "under the rollout sampler's distribution, which reproduces temperature, top-k and top-p only; "
                f"remove {name} (or set method=opsd)"
            )


# -- switches without effect ---------------------------------------------------------------------------------------
# A value recorded as if it acted, while the run trains exactly as without it (`fixed_advantage` under
# `loss_type=jsd`, the teacher's reference under a loss that reads no teacher). A switch another method never
# reads is refused instead (`check_method`), as are the combinations `check_teacher_variants` names. Each rule is
# (fields, when they are inert, what they need); a rule reads the settings' attributes only, so a dry run's
# resolved settings (a mapping, completed by the declared defaults) can be checked too.

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
    applies: Callable[[Switches], bool]  # the settings leave `fields` without effect
    needs: Callable[[Switches], str]  # what they need to act, and why they do not here


def _hybrid_without_sd(c: Switches) -> bool:
    return c.method == "hybrid" and c.sd_weight == 0


RULES: tuple[Rule, ...] = (
    Rule(
        ("fixed_advantage",),
        lambda c: c.loss_type != "fixed_advantage",
        lambda c: f"it needs loss_type=fixed_advantage (loss_type={c.loss_type} reads no constant advantage)",
    ),
    Rule(
        TEACHER_FIELDS + DIVERGENCE_FIELDS,
        lambda c: c.loss_type == "fixed_advantage",
        lambda c: (
            "it needs a loss that reads a teacher, loss_type=jsd or sampled_token (loss_type=fixed_advantage "
            "reads none)"
        ),
    ),
    Rule(
        DIVERGENCE_FIELDS,
        lambda c: c.loss_type == "sampled_token",
        lambda c: (
            "it needs loss_type=jsd (sampled_token's policy gradient has no divergence to interpolate or clip)"
        ),
    ),
    Rule(
        ("divergence_clip",),
        lambda c: c.clip_mode == "none",
        lambda c: "it needs clip_mode=element, token or rescale (clip_mode=none clips nothing)",
    ),
    Rule(
        ("ema_decay",),
        lambda c: c.teacher_mode != "ema",
        lambda c: f"it needs teacher_mode=ema (teacher_mode={c.teacher_mode} keeps no moving average)",
    ),
    Rule(
        REFERENCE_FIELDS,
        lambda c: c.teacher_ref_pairing == "empty" and not c.contrast_on,
        lambda c: (
            "it needs a reference for the teacher, teacher_ref_pairing=matched or shuffled "
            "(teacher_ref_pairing=empty gives it none)"
        ),
    ),
    Rule(
        CONTRAST_FIELDS + MODULATION_FIELDS,
        lambda c: not c.contrast_on,
        lambda c: "it needs a contrastive teacher, teacher_contrast=shuffled, wrong_answer or own_wrong",
    ),
    Rule(
        ("contrast_hints",),
        lambda c: c.teacher_contrast in ("shuffled", "wrong_answer"),
        lambda c: (
            f"it needs teacher_contrast=own_wrong (teacher_contrast={c.teacher_contrast} has one wrong hint per "
            "row)"
        ),
    ),
    Rule(
        ("contrast_rl_tau", "contrast_rl_delta"),
        lambda c: c.contrast_rl_weight == 0,
        lambda c: "it needs contrast_rl_weight > 0 (contrast_rl_weight=0 modulates no advantage)",
    ),
    Rule(
        ("teacher_contrast",) + CONTRAST_FIELDS,
        lambda c: _hybrid_without_sd(c) and c.contrast_rl_weight == 0,
        lambda c: (
            "it needs sd_weight > 0 (the contrastive target) or contrast_rl_weight > 0 (the modulation); with both "
            "at 0 the hybrid reads no teacher"
        ),
    ),
    Rule(
        ("contrast_weight", "contrast_top_k", "contrast_log_floor", "contrast_kl_tau"),
        _hybrid_without_sd,
        lambda c: "it needs sd_weight > 0 (the hybrid's OPSD term is where the contrastive target acts)",
    ),
    Rule(
        ("token_weight",),
        _hybrid_without_sd,
        lambda c: "it needs sd_weight > 0 (it weighs the tokens of the hybrid's OPSD term)",
    ),
    Rule(
        ("budget_unit",),
        lambda c: methods.get(c.method).rollouts == 1,
        lambda c: (
            f"it needs a method with a group of rollouts per problem (method={c.method} samples one rollout per "
            "problem: a step's problems are its rollouts)"
        ),
    ),
    Rule(
        LORA_FIELDS,
        lambda c: c.use_peft is False,
        lambda c: "it needs use_peft=true (full fine-tuning trains no adapter)",
    ),
    Rule(
        ("completions_rows",),
        lambda c: c.completions_steps == 0,
        lambda c: "it needs completions_steps > 0 (completions_steps=0 logs no completions)",
    ),
)


def _settings(config: object) -> Switches:
    """`config` itself, or for a mapping of field to value (a dry run's resolved settings) the switches it sets,
    the others at their declared defaults."""
    if not isinstance(config, Mapping):
        return config
    names = {f.name for f in fields(Switches)}
    return Switches(**{name: value for name, value in config.items() if name in names})


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


# -- TRL's options ---------------------------------------------------------------------------------------------------

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


def check_trl_options(config, sdft_defaults: Mapping[str, object]) -> None:
    """Refuse an SDFT option OPSDTrainer ignores (set away from `sdft_defaults`) and an evaluation strategy (OPSD
    trains on no evaluation set); note `max_prompt_length`, which TRL/open-r1 recipes carry and OPSD ignores."""
    for name, instead in IGNORED_SDFT_OPTIONS.items():
        if getattr(config, name) != sdft_defaults[name]:
            raise ValueError(
                f"{name}={getattr(config, name)!r} is an SDFTTrainer option that OPSDTrainer ignores; {instead}"
            )
    if config.max_prompt_length is not None:
        logger.warning(
            "max_prompt_length=%s is ignored: OPSD never cuts a prompt (that would cut the problem); the "
            "teacher prompt's cap is max_teacher_prompt_length",
            config.max_prompt_length,
        )
    evaluation = getattr(config.eval_strategy, "value", config.eval_strategy)
    if evaluation not in (None, "no"):  # Trainer refuses it once the model has loaded
        raise ValueError(
            f"eval_strategy={evaluation!r} needs an evaluation set, and OPSD trains on none; leave it at "
            "'no' and score checkpoints with eval_aime.py"
        )


def check_steps_per_rollout(config) -> None:
    """Refuse a `steps_per_rollout` the run cannot serve (before TRL sizes its generation batch from it)."""
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
    """Each optimizer step is normalised by its own valid tokens (opsd_trainer `rollout_batch` counts
    them per step of the window), so TRL's window must be whole optimizer steps (docs/method.md §1.5)."""
    k, accumulation = config.steps_per_rollout, config.gradient_accumulation_steps
    if config.steps_per_generation != k * accumulation:
        raise ValueError(
            f"steps_per_generation={config.steps_per_generation} (generation_batch_size="
            f"{config.generation_batch_size}) is not steps_per_rollout x gradient_accumulation_steps = "
            f"{k} x {accumulation}: TRL's window counts micro-batches; leave both TRL "
            "generation settings unset and set steps_per_rollout (optimizer steps per generation)"
        )


# -- all of them -------------------------------------------------------------------------------------------------


def check_settings(config, sdft_defaults: Mapping[str, object]) -> None:
    """Every check of an `OPSDConfig` before TRL's own, in order (module docstring); `sdft_defaults`: TRL's
    `SDFTConfig` defaults. The first problem is a ValueError naming the field."""
    for name, allowed in CHOICES.items():
        check_choice(name, getattr(config, name), allowed)
    check_ranges(config)
    check_method(config)  # before TRL's checks: they read num_generations
    warn_inert(config, {f.name: f.default for f in fields(config)})  # a switch the others leave idle
    check_trl_options(config, sdft_defaults)
    check_steps_per_rollout(config)
