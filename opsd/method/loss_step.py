"""OPSDTrainer's loss side: both roles' hidden states of the completion tokens, the chunked loss normalised by the
step's valid tokens, the `opsd/*` metrics and the completions log (docs/method.md §1).

`LossHooks` is mixed into `opsd_trainer.OPSDTrainer` ahead of TRL's `SDFTTrainer`, whose `compute_loss` and
teacher context it overrides. It reads the trainer's `args` (`OPSDConfig`, which hands the loss its arguments:
`loss_settings`), `accelerator`, `teacher_model`, `processing_class`, `clock` and `record_metrics`.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from opsd.errors import UnsupportedModel
from opsd.method import completions
from opsd.method.hidden import completion_hidden, eval_mode, loss_token_mask
from opsd.method.logits import LogitTransform, lm_head_weight, resolve_logit_transform
from opsd.method.loss import chunked_opsd_loss

if TYPE_CHECKING:
    from opsd.configuration.config import OPSDConfig

logger = logging.getLogger(__name__)


@dataclass
class CompletionHiddenStates:
    """What `OPSDTrainer.completion_hidden_states` returns: hidden states (N, H) of the valid completion tokens, flattened
    over the completion mask, and the lm_head weights (V, H) that turn them into each role's logits."""

    student_hidden_NH: torch.Tensor
    teacher_hidden_NH: torch.Tensor
    student_weight_VH: torch.Tensor
    teacher_weight_VH: torch.Tensor
    logit_transform: LogitTransform


class LossHooks:
    """`compute_loss` (part `score_loss`): `completion_hidden_states` gives both roles' final hidden states of the
    completion tokens (the student with gradients, the teacher under `_get_teacher_context_for_self_distillation`
    in eval mode), `chunked_opsd_loss` their clipped divergence; then the `opsd/*` metrics and, every
    `completions_steps`, the completions log."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss of a micro-batch: its clipped divergence summed over its valid tokens, divided by its
        optimizer step's valid tokens over all processes (`num_loss_tokens`, carried by every row)."""
        if return_outputs:
            raise ValueError("OPSDTrainer does not return outputs")
        a: OPSDConfig = self.args
        with self.clock.part("score_loss"):
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            width = inputs["teacher_input_ids"].size(1) - completion_ids.size(1)
            hidden = self.completion_hidden_states(
                model,
                inputs["prompt_ids"],
                inputs["prompt_mask"],
                inputs["teacher_input_ids"][:, :width],
                inputs["teacher_attention_mask"][:, :width],
                completion_ids,
                completion_mask,
            )
            # Hidden states come flattened over completion_mask; the loss counts the subset keep_N.
            keep_N = self._loss_mask(completion_ids, completion_mask)[completion_mask.bool()].bool()
            loss_sum, stats = chunked_opsd_loss(
                hidden.student_hidden_NH[keep_N],
                hidden.teacher_hidden_NH[keep_N],
                hidden.student_weight_VH,
                hidden.teacher_weight_VH,
                settings=a.loss_settings(),
                target_ids_N=completion_ids[completion_mask.bool()][keep_N],
                transform=hidden.logit_transform,
            )
            # Gradients are averaged over processes by DDP/DeepSpeed, hence the factor num_processes.
            denom = inputs["num_loss_tokens"][0].clamp(min=1).to(loss_sum.dtype)
            loss = loss_sum / denom * self.accelerator.num_processes
            self._record_loss_stats(loss_sum.detach(), stats)
            if self.model.training:
                self.record_metrics(
                    {"rollout/staleness_steps": float(self.state.global_step - self.rollout_step)}
                )
            if self._completions_due():
                self._log_completions(inputs, hidden)
        return loss

    def completion_hidden_states(
        self, model, student_ids, student_mask, teacher_ids, teacher_mask, completion_ids, completion_mask
    ) -> CompletionHiddenStates:
        """Both roles' final hidden states of the valid completion tokens of a batch, and their lm_heads.

        The student goes through `model` (the wrapped model in training, so DDP/DeepSpeed see the forward),
        with gradients if they are enabled; the teacher through TRL's teacher context in eval mode, without
        gradients. Prompts are left-padded, completions right-padded (`opsd.method.hidden`).
        """
        student_hidden_NH = self._completion_hidden(
            model, student_ids, student_mask, completion_ids, completion_mask
        )
        with torch.no_grad(), self._get_teacher_context_for_self_distillation():
            teacher_hidden_NH = self._completion_hidden(
                self.teacher_model, teacher_ids, teacher_mask, completion_ids, completion_mask
            )
        unwrap = self.accelerator.unwrap_model
        return CompletionHiddenStates(
            student_hidden_NH=student_hidden_NH,
            teacher_hidden_NH=teacher_hidden_NH.detach(),
            student_weight_VH=lm_head_weight(unwrap(model)),
            teacher_weight_VH=lm_head_weight(unwrap(self.teacher_model)).detach(),
            logit_transform=self.logit_transform,
        )

    @contextmanager
    def _get_teacher_context_for_self_distillation(self):
        # The teacher must be a deterministic function of its weights: in training mode LoRA dropout would
        # make the EMA adapter and the dynamic teacher (the student itself) score the same tokens differently
        # on every call. So every teacher forward (loss, probe) runs in eval mode.
        with (
            eval_mode(self.accelerator.unwrap_model(self.teacher_model)),
            super()._get_teacher_context_for_self_distillation(),
        ):
            yield

    def _completion_hidden(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        return completion_hidden(
            model,
            prompt_ids,
            prompt_mask,
            completion_ids,
            completion_mask,
            fix_positions=self.args.fix_position_ids,
            pad_token_id=self.processing_class.pad_token_id,
            on_last_logits=None if id(model) in self.logits_checked else self._logits_check(model),
        )

    def _logits_check(self, model):
        """A check, for a model's first forward, that the loss's logit transform reproduces its own logits
        (`opsd.method.logits`); the first check picks the transform. Student and teacher share the lm_head's
        transform, so a teacher that disagrees is refused."""

        def check(hidden_BH, logits_BV):
            unwrapped = self.accelerator.unwrap_model(model)
            found = resolve_logit_transform(unwrapped.config, hidden_BH, lm_head_weight(unwrapped), logits_BV)
            if self.logit_transform is None:
                self.logit_transform = found
                logger.info("logit transform after the lm_head, checked against the model's logits: %s",
                            found.describe())  # fmt: skip
            elif found != self.logit_transform:
                raise UnsupportedModel(
                    f"the teacher's logits follow another transform ({found.describe()}) than the student's "
                    f"({self.logit_transform.describe()}); the loss applies one transform to both roles"
                )
            self.logits_checked.add(id(model))

        return check

    def _loss_mask(self, completion_ids, completion_mask):
        a: OPSDConfig = self.args
        pad = None if a.fix_position_ids else self.processing_class.pad_token_id
        return loss_token_mask(
            completion_ids, completion_mask, skip=a.num_loss_tokens_to_skip, pad_token_id=pad
        )

    def _record_loss_stats(self, loss_sum: torch.Tensor, stats: dict) -> None:
        n = max(float(stats["num_tokens"]), 1.0)
        self.record_metrics(
            {
                "opsd/divergence": float(stats["divergence"]) / n,
                "opsd/clipped_frac": float(stats["clipped_frac"]) / n,
                "opsd/top1_agree": float(stats["top1_agree"]) / n,
                "opsd/loss_per_token": float(loss_sum) / n,
            }
        )

    def _completions_due(self) -> bool:
        """The first micro-batch of every `completions_steps`-th optimizer step, on the main process."""
        every = self.args.completions_steps
        return (
            every > 0
            and self.model.training
            and self.accelerator.is_main_process
            and self.state.global_step % every == 0
            and self._step % self.args.gradient_accumulation_steps == 0
        )

    def _log_completions(self, inputs, hidden: CompletionHiddenStates) -> None:
        a: OPSDConfig = self.args
        rows = completions.completion_rows(
            step=self.state.global_step,
            problems=inputs["problems"],
            references=inputs["references"],
            completion_ids_BC=inputs["completion_ids"],
            completion_mask_BC=inputs["completion_mask"],
            student_hidden_NH=hidden.student_hidden_NH.detach(),
            teacher_hidden_NH=hidden.teacher_hidden_NH,
            student_weight_VH=hidden.student_weight_VH.detach(),
            teacher_weight_VH=hidden.teacher_weight_VH,
            transform=hidden.logit_transform,
            tokenizer=self.processing_class,
            rows=a.completions_rows,
            settings=a.loss_settings(),
        )
        completions.append(a.output_dir, rows)
        completions.to_trackers(a.report_to, rows)
