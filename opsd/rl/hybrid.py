"""`HybridTrainer`: TRL's GRPO loss plus `sd_weight` x the OPSD loss on the same rollouts (`method=hybrid`;
docs/method.md §6; SDPG-style, arXiv 2606.04036, without its reference KL, which is TRL's `beta`, 0 by default).

    python opsd_train.py --method hybrid --sd_weight 1 --max_steps 2

Each problem gets G rollouts (`num_generations`), graded by the evaluation's grader; TRL turns the grades into
group-normalised advantages and its GRPO loss (`GRPOTrainer`, unchanged). The same rollouts are also scored by
the OPSD teacher (the problem plus its reference; `opsd.method.prompts`), and the micro-batch's loss adds
`sd_weight` x OPSD's clipped divergence (`opsd.method.loss`), normalised as OPSD normalises it: summed over the
step's loss tokens and divided by their number over all processes, which is also how TRL's default `dapo` loss
normalises. So `sd_weight=0` is TRL's GRPO loss (no teacher rows, no teacher forward), and with the GRPO term
switched off (every advantage 0: a step whose groups are all right or all wrong) the loss is OPSD's on these
rollouts. The teacher is the initial policy (`teacher_mode=fixed`: the adapters off) or the student itself
(`dynamic`). Cost: the student's forward runs twice per micro-batch (TRL's for its log-probabilities and OPSD's for
the divergence), plus one teacher forward; the compute ledger counts the teacher's tokens.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from opsd.method.hidden import (
    completion_hidden,
    eval_mode,
    lm_head_weight,
    loss_token_mask,
    one_transform,
    resolve_logit_transform,
)
from opsd.method.loss import chunked_opsd_loss, loss_metrics, loss_settings
from opsd.method.prompts import teacher_rows
from opsd.rl.grpo import GRPOTrainer

logger = logging.getLogger(__name__)


class HybridTrainer(GRPOTrainer):
    """GRPO (TRL's) + sd_weight x OPSD on the same G rollouts per problem (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sd_weight = float(self.config.sd_weight)
        self.loss_settings = loss_settings(self.config)
        # The loss's logit transform (opsd.method.hidden), picked on the first forward and checked on it.
        self.logit_transform = None

    # -- the batch: TRL's, plus the teacher's rows ------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if self.sd_weight == 0:
            return out
        completion_ids, completion_mask = out["completion_ids"], out["completion_mask"]
        builder = self.prompt_builder if self.loss_settings.needs_teacher else None
        rows, truncated = teacher_rows(
            builder, [x["prompt"] for x in inputs], [x.get("privileged_context") for x in inputs],
            completion_ids, completion_mask, self._tokenizer.pad_token_id,
        )  # fmt: skip
        out.update(rows)
        # The OPSD term's denominator: its loss tokens over the whole step and every process (as OPSD's trainer).
        local = self._sd_mask(completion_ids, completion_mask).sum()
        out["sd_num_tokens"] = self.accelerator.reduce(local.clone(), reduction="sum")
        if self.model.training:
            self._metrics["train"]["prompts/teacher_truncated"].append(float(truncated))
            if builder is not None:
                self.ledger.add(teacher=int(rows["teacher_attention_mask"].sum()))
        return out

    def _sd_mask(self, completion_ids, completion_mask) -> torch.Tensor:
        c = self.config
        pad = None if c.fix_position_ids else self._tokenizer.pad_token_id
        return loss_token_mask(
            completion_ids, completion_mask, skip=c.num_loss_tokens_to_skip, pad_token_id=pad
        )

    # -- the loss --------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        grpo = super()._compute_loss(model, inputs)
        if self.sd_weight == 0:
            return grpo
        sd = self.sd_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["hybrid/grpo_loss"].append(float(grpo.detach()))
        self._metrics[mode]["hybrid/sd_loss"].append(float(sd.detach()))
        return grpo + self.sd_weight * sd

    def sd_loss(self, model, inputs) -> torch.Tensor:
        """The OPSD term of a micro-batch: its clipped divergence summed over its loss tokens, divided by the
        step's loss tokens over all processes, times the processes (DDP/DeepSpeed average the gradients)."""
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        student_NH = self._hidden(model, inputs["prompt_ids"], inputs["prompt_mask"], inputs)
        teacher_NH = teacher_weight_VH = None
        unwrapped = self.accelerator.unwrap_model(model)
        if self.loss_settings.needs_teacher:
            width = inputs["teacher_input_ids"].size(1) - completion_ids.size(1)
            with torch.no_grad(), self._teacher(unwrapped):
                teacher_NH = self._hidden(
                    unwrapped,
                    inputs["teacher_input_ids"][:, :width],
                    inputs["teacher_attention_mask"][:, :width],
                    inputs,
                ).detach()
            teacher_weight_VH = lm_head_weight(unwrapped).detach()
        keep_N = self._sd_mask(completion_ids, completion_mask)[completion_mask.bool()].bool()
        loss_sum, stats = chunked_opsd_loss(
            student_NH[keep_N],
            None if teacher_NH is None else teacher_NH[keep_N],
            lm_head_weight(unwrapped),
            teacher_weight_VH,
            settings=self.loss_settings,
            target_ids_N=completion_ids[completion_mask.bool()][keep_N],
            transform=self.logit_transform,
        )
        mode = "train" if self.model.training else "eval"
        for key, value in loss_metrics(
            loss_sum.detach(), stats, teacher=self.loss_settings.needs_teacher
        ).items():
            self._metrics[mode][key].append(value)
        denom = inputs["sd_num_tokens"].clamp(min=1).to(loss_sum.dtype)
        return loss_sum / denom * self.accelerator.num_processes

    @contextlib.contextmanager
    def _teacher(self, unwrapped):
        """The teacher's weights, in eval mode: the initial policy (a LoRA student's adapters off) for
        teacher_mode=fixed, the student itself for dynamic."""
        with eval_mode(unwrapped):
            if self.config.teacher_mode == "fixed":
                with unwrapped.disable_adapter():
                    yield
            else:
                yield

    def _hidden(self, model, prompt_ids, prompt_mask, inputs) -> torch.Tensor:
        def check(hidden_BH, logits_BV):
            unwrapped = self.accelerator.unwrap_model(model)
            found = resolve_logit_transform(unwrapped.config, hidden_BH, lm_head_weight(unwrapped), logits_BV)
            self.logit_transform = one_transform(self.logit_transform, found)

        return completion_hidden(
            model,
            prompt_ids,
            prompt_mask,
            inputs["completion_ids"],
            inputs["completion_mask"],
            fix_positions=self.config.fix_position_ids,
            pad_token_id=self._tokenizer.pad_token_id,
            on_last_logits=check if self.logit_transform is None else None,
        )
