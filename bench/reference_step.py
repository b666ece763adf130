"""The reference way of doing an OPSD step, run through `opsd_train.py` as a same-run baseline.

    python bench/reference_step.py --config cfg.yaml        # any opsd_train.py arguments

`bench/opsd_step.py` runs it beside the project's own step on the same model, data and machine. What differs
from `OPSDTrainer` is what the published OPSD code does, and nothing else:
- rollouts: TRL's colocated `generate` as it is: one `SamplingParams` for the batch (no per-row seeds),
  detokenised outputs;
- weight sync: TRL's `sync_weights` (merge the LoRA adapter into the base weights, push them, unmerge);
- scoring and loss: both roles' logits over the whole vocabulary (`model(...).logits`, prompt positions
  included), then the clipped divergence on the completion positions
  (`opsd.testing.reference_loss.opsd_loss_from_logits`, the same formula as the chunked loss);
- micro-batch and checkpointing: whatever the arguments say (the reference used 4 and checkpointing on).
"""

from __future__ import annotations

import sys

import torch

import opsd_train  # first: it sets the engine's environment before vLLM loads
import opsd_trainer
from opsd.errors import run_main
from opsd.method.hidden import positions
from opsd.method.loss import loss_settings
from opsd.method.scoring import loss_metrics
from opsd.testing.reference_loss import opsd_loss_from_logits


class ReferenceStepTrainer(opsd_trainer.OPSDTrainer):
    """OPSDTrainer with the reference's rollout call, weight sync and materialised-logits loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.engine.name == "vllm":
            gen = self.engine.generation
            gen.generation_kwargs = {k: v for k, v in gen.generation_kwargs.items() if k != "detokenize"}
            gen.llm.seeds_for = None  # the reference samples with TRL's one seed per engine

    def _sample(self, prompt_ids):
        from trl.generation.vllm_generation import VLLMGeneration

        if self.engine.name == "vllm" and self.state.global_step != self.engine.weights_step:
            with self.clock.phase("weight_sync"):
                VLLMGeneration.sync_weights(self.engine.generation)  # TRL's push, not OPSDGeneration's
            self.engine.weights_step = self.state.global_step  # so the engine's own push is skipped
        return super()._sample(prompt_ids)

    def _role_logits(self, model, prompt_ids, prompt_mask, completion_ids, completion_mask):
        width = prompt_ids.size(1)
        logits_BTV = model(
            input_ids=torch.cat([prompt_ids, completion_ids], 1),
            attention_mask=torch.cat([prompt_mask, completion_mask], 1),
            position_ids=positions(prompt_mask, completion_ids.size(1)),
            use_cache=False,
        ).logits
        return logits_BTV[:, width - 1 : width - 1 + completion_ids.size(1)]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        with self.clock.part("score_loss"):
            return self._reference_loss(model, inputs)

    def _reference_loss(self, model, inputs):
        a = self.args
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        student_BCV = self._role_logits(
            model, inputs["prompt_ids"], inputs["prompt_mask"], completion_ids, completion_mask
        )
        width = inputs["teacher_input_ids"].size(1) - completion_ids.size(1)
        with torch.no_grad(), self.teacher_context():
            teacher_BCV = self._role_logits(
                self.teacher_model,
                inputs["teacher_input_ids"][:, :width],
                inputs["teacher_attention_mask"][:, :width],
                completion_ids,
                completion_mask,
            )
        loss_sum, stats = opsd_loss_from_logits(
            student_BCV,
            teacher_BCV,
            self.core.token_mask(completion_ids, completion_mask),
            settings=loss_settings(a),
            target_ids_BT=completion_ids,
        )
        loss = loss_sum / inputs["num_loss_tokens"][0].clamp(min=1) * self.accelerator.num_processes
        self.record_metrics(loss_metrics(loss_sum.detach(), stats))
        return loss


def main(argv=None):
    opsd_trainer.OPSDTrainer = ReferenceStepTrainer  # opsd_train.main imports the class when it runs
    return opsd_train.main(argv)


if __name__ == "__main__":
    sys.exit(run_main(main, "reference_step.py"))
