"""The method registry: every method a run can train (`method`), each declared once with what the harness needs to
know about it before a model loads.

    from opsd.methods import Method, register
    register(Method("mine", trainer="my_module:MyTrainer", summary="...", reads=("sd_weight",), rollouts=GROUP))

A method is a trainer class built as `OPSDTrainer` is (`model, args, train_dataset, processing_class, peft_config,
prompt_builder, engine`), plus this entry. From the entry:
- the configuration's checks (`opsd.configuration.checks`) refuse, in one line, a switch set away from its default
  that this method does not read while another does (`reads`, against every method's `METHOD_SWITCHES`), and a
  number of rollouts per problem it cannot take (`rollouts`);
- `opsd_train.py` builds its trainer (`trainer_class`), and adds the held-out probe where it scores this method's
  teacher (`probe`);
- the micro-batch planner uses its memory model only where it models this method's step (`memory_model`);
- the capped harness and the experiment size a step by its rollouts per problem (`default_generations`).

This module imports nothing of the repository: every floor may read it (docs/layout.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# TRL's GRPOConfig default number of rollouts per problem (G).
TRL_GRPO_GENERATIONS = 8
# `Method.rollouts`: a group of `num_generations` rollouts per problem (at least 2; TRL's 8 by default).
GROUP = 0

# The switches only some methods read, each group with whom it belongs to. A method lists the groups it reads in
# `Method.reads`; a switch of another group, set away from its default, is refused for it.
# The self-distillation loss and its teacher (OPSD, and the hybrid's OPSD term).
SELF_DISTILLATION_FIELDS = (
    "beta", "loss_temperature", "divergence_clip", "clip_mode", "top_k_loss", "loss_type", "fixed_advantage",
    "token_weight", "teacher_contrast", "contrast_weight", "contrast_top_k", "contrast_log_floor", "contrast_kl_tau",
    "contrast_hints", "teacher_mode", "ema_decay", "teacher_ref", "teacher_ref_fraction",
    "teacher_ref_pairing", "teacher_ref_max_chars", "max_teacher_prompt_length", "teacher_thinking",
    "teacher_prompt_file", "num_loss_tokens_to_skip", "completions_steps", "completions_rows",
)  # fmt: skip
# OPSD's own trainer: its generation window and its compiled forwards (TRL's GRPO step has neither).
OPSD_TRAINER_FIELDS = ("steps_per_rollout", "compile_layers")
# The hybrid's: the weight of its OPSD term, which rollouts each term trains on, RLCSD's modulation of its GRPO
# advantages.
HYBRID_FIELDS = ("sd_weight", "hybrid_route", "contrast_rl_weight", "contrast_rl_tau", "contrast_rl_delta")
# TRL's GRPO settings (its GRPOConfig, `opsd.rl.grpo.grpo_args`): whoever runs TRL's GRPO step.
GRPO_FIELDS = ("rl_loss_type", "epsilon_high", "mask_truncated_completions", "scale_rewards", "rl_beta")
METHOD_SWITCHES = SELF_DISTILLATION_FIELDS + OPSD_TRAINER_FIELDS + HYBRID_FIELDS + GRPO_FIELDS

# The compute ledger's token columns (`opsd.run.ledger`): what a method may book.
LEDGER_COLUMNS = ("generated_tokens", "teacher_tokens", "trained_tokens", "probe_tokens")


@dataclass(frozen=True)
class Method:
    """One method: its `name` (the `method` switch's value), its `trainer` class (or "module:Class", imported when
    a run builds it), one line of what it is (`summary`), the method-specific switches it reads (`reads`, of
    `METHOD_SWITCHES`), its rollouts per problem (`rollouts`: 1, or `GROUP`), the ledger columns it books, the
    teacher modes it can build (None: every one), whether the held-out probe scores its teacher (`probe`),
    whether `micro_batch_size=auto`'s memory model is its step's (`memory_model`), and whether it scores sampled
    tokens under the sampler's distribution (`scores_sampler`: min_p and a repetition penalty are not
    reproduced)."""

    name: str
    trainer: str | type
    summary: str
    reads: tuple[str, ...] = ()
    rollouts: int = 1
    ledger: tuple[str, ...] = ("generated_tokens", "trained_tokens")
    teacher_modes: tuple[str, ...] | None = None
    probe: bool = False
    memory_model: bool = False
    scores_sampler: bool = False

    def __post_init__(self):
        unknown = sorted(set(self.reads) - set(METHOD_SWITCHES)) + sorted(
            set(self.ledger) - set(LEDGER_COLUMNS)
        )
        if unknown or self.rollouts not in (1, GROUP) or not self.name.isidentifier():
            raise ValueError(f"method {self.name!r}: unknown switches or ledger columns {unknown}, or rollouts "
                             f"{self.rollouts} (1 or GROUP), or a name that is not an identifier")  # fmt: skip

    @property
    def default_generations(self) -> int:
        """Its rollouts per problem when `num_generations` is 0: 1, or TRL's 8 for a group."""
        return 1 if self.rollouts == 1 else TRL_GRPO_GENERATIONS

    def trainer_class(self) -> type:
        """The trainer class, imported where it is named by path."""
        if not isinstance(self.trainer, str):
            return self.trainer
        module, _, name = self.trainer.partition(":")
        return getattr(importlib.import_module(module), name)


REGISTRY: dict[str, Method] = {}
# The registered names, in order: the `method` switch's choices (a live list, so a method registered later, by a
# module of the user's or a test, is a choice too).
NAMES: list[str] = []


def register(method: Method) -> Method:
    """Adds `method` to the registry (a name already there is replaced); returns it."""
    if method.name not in REGISTRY:
        NAMES.append(method.name)
    REGISTRY[method.name] = method
    return method


def unregister(name: str) -> None:
    """Removes a method registered by `register` (the built-in ones stay)."""
    if name in BUILT_IN:
        raise ValueError(f"method {name!r} is built in")
    REGISTRY.pop(name, None)
    if name in NAMES:
        NAMES.remove(name)


def get(name: str) -> Method:
    if name not in REGISTRY:
        raise ValueError(f"method={name!r} is not a registered method; choose one of {', '.join(NAMES)}")
    return REGISTRY[name]


def readers(switch: str) -> list[str]:
    """The registered methods that read `switch`, in registry order."""
    return [name for name, m in REGISTRY.items() if switch in m.reads]


register(Method(
    "opsd", "opsd_trainer:OPSDTrainer", "OPSD samples one rollout per problem and distils from its teacher",
    reads=SELF_DISTILLATION_FIELDS + OPSD_TRAINER_FIELDS,
    ledger=("generated_tokens", "teacher_tokens", "trained_tokens", "probe_tokens"), probe=True, memory_model=True,
))  # fmt: skip
register(Method(
    "grpo", "opsd.rl.grpo:GRPOTrainer", "TRL's GRPO, rewarded by the evaluation's grader",
    reads=GRPO_FIELDS, rollouts=GROUP, scores_sampler=True,
))  # fmt: skip
register(Method(
    "hybrid", "opsd.rl.hybrid:HybridTrainer", "GRPO's loss plus sd_weight x the OPSD loss on the same rollouts",
    reads=SELF_DISTILLATION_FIELDS + HYBRID_FIELDS + GRPO_FIELDS, rollouts=GROUP,
    ledger=("generated_tokens", "teacher_tokens", "trained_tokens"), teacher_modes=("fixed", "dynamic"),
    scores_sampler=True,
))  # fmt: skip
# The methods this repository ships (`unregister` leaves them).
BUILT_IN = tuple(NAMES)
