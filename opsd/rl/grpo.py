"""`GRPOTrainer`: TRL's GRPO, run by the OPSD harness (`method=grpo`; docs/method.md §6).

    python opsd_train.py --method grpo --max_steps 2                  # embedded model, built-in data, CPU is fine
    bash train_capped.sh --name grpo --recipe configs/recipes/grpo.env  # the same budget as OPSD

TRL's algorithm, unchanged: its group-normalised advantages, its loss (`loss_type=dapo`: the clipped ratio summed
over the step's completion tokens), its importance-sampling correction of the engine's rollouts, and every
`GRPOConfig` default the recipe does not set. `grpo_args` lists what the run sets. The overrides are the harness's,
so that `method` is the only difference between two arms:
- `_tokenize_prompts`: OPSD's student prompt (`opsd.method.prompts`: chat template, thinking switch, wording);
- the rollout engine is OPSD's, handed in as OPSDTrainer takes it (`opsd.method.rollouts`): one seed per row, so a run resumes on the same
  rollouts, and the merged weights pushed out of place (on vLLM's CPU backend the one push that works);
- `_get_per_token_logps_and_entropies`: each real token at its index in its own unpadded sequence, as the engine
  placed it (`fix_position_ids`, on by default; off keeps TRL's positions, which left padding shifts);
- the reward (`opsd.rl.reward.CorrectAnswer`), the `rollout/*` metrics, the phase times and the compute ledger
  (`opsd.run.ledger`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import fields

import torch
import trl
from transformers import TrainingArguments
from trl.trainer import grpo_trainer as trl_grpo

from opsd.method.prompts import PromptBuilder
from opsd.method.rollouts import build_rollout_engine
from opsd.rl.reward import CorrectAnswer
from opsd.run.step_watch import ComputeLedger, PhaseClock, StepTimer, metrics

# Fields OPSDConfig shares by name with GRPOConfig that mean something else there (OPSD's divergence beta and loss
# type; its generation window counted in problems), or that the run sets itself (num_generations).
NOT_SHARED = frozenset({
    "beta", "loss_type", "num_generations", "num_generations_eval", "generation_batch_size", "steps_per_generation",
    "disable_dropout",
})  # fmt: skip


def grpo_args(config) -> trl.GRPOConfig:
    """TRL's `GRPOConfig` for a run of `config` (an `OPSDConfig`): every transformers training argument as the run
    resolved it (optimiser, schedule, precision, logging, checkpoints, seed), the rollout settings it shares with
    TRL (temperature, top_p, top_k, max_completion_length, the vLLM engine's), `num_generations` G, and a
    micro-batch of `per_device_train_batch_size` problems x G rollouts, so that a step holds the same problems
    as OPSD's. Everything else is TRL's default (docs/method.md §6 lists them)."""
    shared = {f.name for f in fields(TrainingArguments) if f.init} | {
        f.name for f in fields(trl.GRPOConfig) if f.init and f.name in {g.name for g in fields(type(config))}
    }
    values = {name: getattr(config, name) for name in shared - NOT_SHARED if hasattr(config, name)}
    values.update(
        num_generations=config.num_generations,
        per_device_train_batch_size=config.per_device_train_batch_size * config.num_generations,
        remove_unused_columns=False,  # the reward reads the `answer` column
    )
    return trl.GRPOConfig(**values)


@contextmanager
def exact_positions(model: torch.nn.Module):
    """Inside the block, a forward of `model` given an attention mask and no position ids gets each real token's
    index in its own unpadded row (`cumsum(mask) - 1`; padding at 0, masked out of attention), as the rollout
    engine numbered it. TRL's GRPO forward passes only the mask, and a model then numbers the columns of the
    left-padded batch, shifting a shorter prompt's tokens by its pad count."""

    def add_positions(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return args, kwargs

    handle = model.register_forward_pre_hook(add_positions, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's `GRPOTrainer` with the harness's prompts, engine, reward, positions and ledger (module docstring).

    Built as `OPSDTrainer` is, from the run's `OPSDConfig` (`args`, kept as `self.config`); `self.args` is the
    `GRPOConfig` TRL runs (`grpo_args`)."""

    def __init__(
        self, model, args, train_dataset, processing_class, peft_config=None, prompt_builder=None, engine=None
    ):
        self.config = config = args
        self.clock = PhaseClock()
        self.reward = CorrectAnswer()
        # The rollout engine, as OPSDTrainer takes it; TRL's GRPOTrainer drives it (its pushes and generations).
        self.engine = engine or build_rollout_engine(config)
        with self.engine.in_place_of_trl(model, owner=trl_grpo):
            super().__init__(
                model=model,
                reward_funcs=[self.reward],
                args=grpo_args(config),
                train_dataset=train_dataset,
                processing_class=processing_class,
                peft_config=peft_config,
            )
        self.engine.bind(self)
        self.prompt_builder = prompt_builder or PromptBuilder.from_config(self.processing_class, config)
        self.ledger = ComputeLedger(self._metrics["train"], self.accelerator)
        self.step_timer = StepTimer(self._metrics["train"], self.clock, self.ledger)
        self.add_callback(self.step_timer)

    # -- a micro-batch, and the generation at a step's start ---------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        per_step = self.args.gradient_accumulation_steps
        if self._step % per_step == 0:  # TRL's micro-batch counter; it counts up in super().training_step
            self.step_timer.step_begins()
        with self.clock.phase("train_micro"):
            out = super().training_step(model, inputs, num_items_in_batch)
        if self._step % per_step == 0:
            self.step_timer.optimizer_begins()
        return out

    def _tokenize_prompts(self, prompts: list):
        """The dataset's `prompt` is the bare problem; the student turn is OPSD's (chat template included)."""
        return [self.prompt_builder.student_ids(p) for p in prompts], None, {}

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        if self.engine.name == "vllm":
            self.engine.seeds.at_step(self.state.global_step)  # the rows' seeds are the step's
        with self.clock.phase("rollout"):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.model.training:
            # [correct, graded, boxed, rows, tokens]: this process's rollouts, as the reward graded them
            sums = torch.tensor(self.reward.sums, dtype=torch.float64, device=self.accelerator.device)
            self.ledger.add(generated=int(self.reward.sums[4]), trained=int(self._loss_mask(out).sum()))
            for key, value in metrics(self.accelerator.reduce(sums, reduction="sum").tolist()).items():
                self._metrics["train"][key].append(value)
        return out

    @staticmethod
    def _loss_mask(batch) -> torch.Tensor:
        mask = batch["completion_mask"]
        return mask if "tool_mask" not in batch else mask * batch["tool_mask"]

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        if not self.config.fix_position_ids:
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        with exact_positions(self.accelerator.unwrap_model(model)):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
