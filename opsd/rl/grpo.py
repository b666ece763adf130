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
- `_get_per_token_logps_and_entropies`: each sampled token scored as the engine sampled it (temperature, top-k,
  top-p, renormalised: `opsd.method.sampler`; TRL's own head applies the temperature only, which biased its
  importance ratio below 1), at its index in its own unpadded sequence (`fix_position_ids`, on by default; off
  keeps TRL's positions, which left padding shifts);
- the reward (`opsd.rl.reward.CorrectAnswer`), the `rollout/*`, `rollout/logprob_gap/*` and `rl/*` metrics, the
  phase times and the compute ledger (`opsd.run.ledger`).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import fields

import torch
import trl
from transformers import TrainingArguments

from opsd.method.engine import weights_dtype
from opsd.method.hidden import CheckedForwards, lm_head_weight
from opsd.method.prompts import PromptBuilder
from opsd.method.rollouts import build_rollout_engine
from opsd.method.sampler import sampled_token_logps
from opsd.rl.reward import CorrectAnswer
from opsd.rl.routes import route_metrics
from opsd.run.logprob_gap import LogprobGap
from opsd.run.step_watch import ComputeLedger, MetricsWindow, PhaseClock, StepTimer, WindowLogging, metrics

logger = logging.getLogger(__name__)

# Fields OPSDConfig shares by name with GRPOConfig that mean something else there (OPSD's divergence beta and loss
# type: GRPO's are rl_beta and rl_loss_type; its generation window counted in problems), or that the run sets
# itself (num_generations, epsilon_high: 0 stands for TRL's None).
NOT_SHARED = frozenset({
    "beta", "loss_type", "num_generations", "num_generations_eval", "generation_batch_size", "steps_per_generation",
    "disable_dropout", "epsilon_high",
})  # fmt: skip


def grpo_args(config) -> trl.GRPOConfig:
    """TRL's `GRPOConfig` for a run of `config` (an `OPSDConfig`): every transformers training argument as the run
    resolved it (optimiser, schedule, precision, logging, checkpoints, seed), the rollout settings it shares with
    TRL (temperature, top_p, top_k, max_completion_length, the vLLM engine's), `num_generations` G, GRPO's own
    settings (`rl_loss_type`, `rl_beta`, `epsilon_high`, `mask_truncated_completions`, `scale_rewards`), and a
    micro-batch of `per_device_train_batch_size` problems x G rollouts (`budget_unit=problems`, so that a step
    holds the same problems as OPSD's) or of `per_device_train_batch_size` rollouts (`budget_unit=rollouts`, a
    multiple of G, so that a step holds as many rollouts as OPSD's). Everything else is TRL's default
    (docs/method.md §6 lists them)."""
    shared = {f.name for f in fields(TrainingArguments) if f.init} | {
        f.name for f in fields(trl.GRPOConfig) if f.init and f.name in {g.name for g in fields(type(config))}
    }
    values = {name: getattr(config, name) for name in shared - NOT_SHARED if hasattr(config, name)}
    G = config.num_generations
    rows_per_problem = G if config.budget_unit == "problems" else 1  # rows of TRL's micro-batch are rollouts
    values.update(
        num_generations=G,
        per_device_train_batch_size=config.per_device_train_batch_size * rows_per_problem,
        loss_type=config.rl_loss_type,
        beta=config.rl_beta,
        epsilon_high=config.epsilon_high or None,  # 0 = TRL's None: the lower bound's epsilon
        mask_truncated_completions=config.mask_truncated_completions,
        scale_rewards=config.scale_rewards,
        remove_unused_columns=False,  # the reward reads the `answer` column
    )
    return trl.GRPOConfig(**values)


class GRPOTrainer(WindowLogging, trl.GRPOTrainer):
    """TRL's `GRPOTrainer` with the harness's prompts, engine, reward, positions and ledger (module docstring).

    Built as `OPSDTrainer` is, from the run's `OPSDConfig` (`args`, kept as `self.config`); `self.args` is the
    `GRPOConfig` TRL runs (`grpo_args`)."""

    def __init__(
        self, model, args, train_dataset, processing_class, peft_config=None, prompt_builder=None, engine=None
    ):
        self.config = config = args
        self.clock = PhaseClock()
        # The harness's metrics of the logging period, averaged into TRL's `log` (NaN left out, as TRL's GRPO does).
        self.logged = MetricsWindow(skip_nan=True)
        self.reward = CorrectAnswer()
        # The rollout engine, as OPSDTrainer takes it; TRL builds none (`use_vllm`), a vLLM engine starts in `bind`.
        self.engine = engine or build_rollout_engine(config)
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
        self.ledger = ComputeLedger(self.train_record, self.accelerator)
        self.step_timer = StepTimer(self.train_record, self.clock, self.ledger)
        self.add_callback(self.step_timer)
        # The completion tokens' final hidden states, as the engine placed them (or TRL's columns: `columns`).
        self.forwards = CheckedForwards(
            self.accelerator.unwrap_model,
            fix_positions=config.fix_position_ids,
            pad_token_id=self.processing_class.pad_token_id,
            mixed_precision=self.accelerator.mixed_precision,
            columns=True,
        )
        self.logprob_gap = LogprobGap(weights_dtype(self.accelerator.unwrap_model(self.model)))
        self._given_hidden: torch.Tensor | None = None  # `scored_from`
        self.micro_batch = 0  # the micro-batches this process has run in this `train()` call
        if self.aux_loss_enabled:
            logger.warning(
                "the model's router load-balancing loss is not added to the GRPO loss: the log-probs are scored "
                "from the final hidden states (as OPSD's loss is); set the config's router_aux_loss_coef to 0 to "
                "silence this"
            )

    # TRL's GRPO takes its vLLM paths (its importance-sampling correction of the engine's log-probs) where this is
    # true, and builds an engine of its own in `__init__` where it is true then. The harness's engine starts once
    # TRL's `__init__` is done (`engine.bind`): true from then on (TRL's assignment from its config is dropped),
    # and `vllm_generation`, which TRL reads, is that engine's.
    use_vllm = property(
        lambda self: getattr(self.engine, "generation", None) is not None, lambda self, value: None
    )
    vllm_generation = property(lambda self: self.engine.generation)

    # -- a micro-batch, and the generation at a step's start ---------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        per_step = self.args.gradient_accumulation_steps
        if self.micro_batch % per_step == 0:  # the optimizer step's first micro-batch
            self.step_timer.step_begins()
        with self.clock.phase("train_micro"):
            out = super().training_step(model, inputs, num_items_in_batch)
        self.micro_batch += 1
        if self.micro_batch % per_step == 0:  # its last
            self.step_timer.optimizer_begins()
        return out

    def _tokenize_prompts(self, prompts: list):
        """The dataset's `prompt` is the bare problem; the student turn is OPSD's (chat template included)."""
        return [self.prompt_builder.student_ids(p) for p in prompts], None, {}

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        with self.clock.phase("rollout"):
            if self.engine.name != "vllm":
                return super()._generate_single_turn(
                    prompt_ids, images, multimodal_fields, num_generations, has_tool_images
                )
            # The weights pushed when the step's are not the engine's yet, the rows seeded by the step; the log-prob
            # of each sampled token, as TRL keeps it.
            completion_ids, logprobs = self.engine.generate(
                prompt_ids, step=self.state.global_step, num_generations=num_generations
            )
            return completion_ids, [[lp[0] for lp in seq] for seq in logprobs]

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        out["sd_rows"] = sd_rows_B = self._sd_rows(out)
        if self.hybrid_route != "mix":  # a rollout routed to self-distillation gets no GRPO term
            out["advantages"] = out["advantages"].masked_fill(sd_rows_B, 0.0)
        if self.model.training:
            # [correct, graded, boxed, rows, tokens]: this process's rollouts, as the reward graded them
            sums = torch.tensor(self.reward.sums, dtype=torch.float64, device=self.accelerator.device)
            self.ledger.add(generated=int(self.reward.sums[4]), trained=int(self._loss_mask(out).sum()))
            self.train_record(metrics(self.accelerator.reduce(sums, reduction="sum").tolist()))
            self._log_routes(out, sd_rows_B)
            self._log_logprob_gap(out)
        return out

    # -- routes: which rollouts get the OPSD term (none for GRPO; `opsd.rl.hybrid`) -----------------------------
    hybrid_route = "mix"

    def _sd_rows(self, batch) -> torch.Tensor:
        """(B,) bool: the rollouts of this process's batch under the self-distillation term; none for GRPO."""
        return torch.zeros_like(batch["completion_mask"][:, 0], dtype=torch.bool)

    def _log_routes(self, batch, sd_rows_B) -> None:
        """`rl/zero_signal_groups`, `rl/positive_rollouts`, `rl/sd_token_share` over every process's rollouts."""
        _, rewards = self.reward.last
        tokens_B = self._loss_mask(batch).sum(1)
        sums = route_metrics(rewards, self.num_generations, sd_rows_B.tolist(), tokens_B.tolist())
        total = self.accelerator.reduce(
            torch.tensor(sums, dtype=torch.float64, device=self.accelerator.device), reduction="sum"
        ).tolist()
        zero_groups, groups, positive, rows, sd_tokens, tokens = total
        self.train_record({
            "rl/zero_signal_groups": zero_groups / max(groups, 1.0),
            "rl/positive_rollouts": positive / max(rows, 1.0),
            "rl/sd_token_share": sd_tokens / max(tokens, 1.0),
        })  # fmt: skip

    def _log_logprob_gap(self, batch) -> None:
        """`rollout/logprob_gap/*` from what TRL computed already: the engine's log-probs of its sampled tokens
        (`sampling_per_token_logps`) against the trainer's before the step (`old_per_token_logps`), both of the
        sampler's distribution (`_get_per_token_logps_and_entropies`)."""
        engine_BT, trainer_BT = batch.get("sampling_per_token_logps"), batch.get("old_per_token_logps")
        if engine_BT is None or trainer_BT is None:
            return
        self.train_record(
            self.logprob_gap.metrics(engine_BT.float(), trainer_BT.float(), self._loss_mask(batch))
        )

    @staticmethod
    def _loss_mask(batch) -> torch.Tensor:
        mask = batch["completion_mask"]
        return mask if "tool_mask" not in batch else mask * batch["tool_mask"]

    # -- the log-probs of the sampled tokens, under the sampler's distribution ---------------------------------
    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **images,
    ):  # fmt: skip
        """TRL's per-token log-probs (B, T), entropies and aux loss, computed as the engine samples: the logits
        divided by the temperature, then top-k and top-p, renormalised (`opsd.method.sampler`). TRL's own forward
        applies the temperature only, so its ratio to the engine's processed log-probs is <= 1 at every token
        (docs/decisions.md). Positions as `fix_position_ids` says (`CheckedForwards`); text only."""
        if any(value is not None for value in images.values()):
            raise NotImplementedError("GRPO here scores text rollouts only; images are not supported")
        width = input_ids.size(1) - logits_to_keep
        rows = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), rows):
            part = slice(start, start + rows)
            ids_BT, mask_BT = input_ids[part, width:], attention_mask[part, width:]
            hidden_NH = self._completion_hidden(model, input_ids[part, :width], attention_mask[part, :width],
                                                ids_BT, mask_BT)  # fmt: skip
            logp_N, entropy_N = sampled_token_logps(
                hidden_NH, lm_head_weight(self.accelerator.unwrap_model(model)), ids_BT[mask_BT.bool()],
                transform=self.forwards.transform, temperature=self.temperature, top_k=self.config.top_k or 0,
                top_p=self.config.top_p if self.config.top_p is not None else 1.0,
                chunk_size=self.config.loss_chunk_size,
            )  # fmt: skip
            logps.append(_scatter(logp_N, mask_BT))
            entropies.append(_scatter(entropy_N, mask_BT))
        aux = torch.zeros((), device=input_ids.device) if compute_aux_loss else None
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, aux

    def _completion_hidden(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        if self._given_hidden is not None:  # the hybrid's student forward, shared with its OPSD term
            hidden_NH, self._given_hidden = self._given_hidden, None
            if hidden_NH.size(0) != int(completion_mask.sum()):
                raise RuntimeError("the shared student forward does not cover this batch's completion tokens")
            return hidden_NH
        with self.accelerator.autocast():
            return self.forwards(model, prompt_ids, prompt_mask, completion_ids, completion_mask)

    @contextmanager
    def scored_from(self, hidden_NH: torch.Tensor | None):
        """Inside the block, the next scoring of the training batch (TRL's loss) takes its completion tokens'
        hidden states from `hidden_NH` (N, H) instead of running the student forward again (None: it runs)."""
        self._given_hidden = hidden_NH
        try:
            yield
        finally:
            self._given_hidden = None


def _scatter(values_N: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """(B, T) float32 with `values_N` at the mask's true entries (row-major), 0 elsewhere; differentiable."""
    return values_N.new_zeros(mask_BT.shape).masked_scatter(mask_BT.bool(), values_N)
