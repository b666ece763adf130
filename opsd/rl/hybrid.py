"""`HybridTrainer`: TRL's GRPO loss plus `sd_weight` x the OPSD loss on the same rollouts (`method=hybrid`;
docs/method.md §6; SDPG-style, arXiv 2606.04036, without its reference KL, which is TRL's `beta`, 0 by default),
and with a contrastive teacher RLCSD (arXiv 2606.11709, docs/method.md §1.10).

    python opsd_train.py --method hybrid --sd_weight 1 --max_steps 2
    python opsd_train.py --method hybrid --teacher_contrast own_wrong --num_generations 4 --max_steps 2

Each problem gets G rollouts (`num_generations`), graded by the evaluation's grader; TRL turns the grades into
group-normalised advantages and its GRPO loss (`GRPOTrainer`, unchanged). The same rollouts are also scored by
the OPSD teacher (the problem plus its reference; `opsd.method.prompts`), and the micro-batch's loss adds
`sd_weight` x OPSD's clipped divergence (`opsd.method.loss`), normalised as OPSD normalises it: summed over the
step's loss tokens and divided by their number over all processes, which is also how TRL's default `dapo` loss
normalises. So `sd_weight=0` is TRL's GRPO loss (no teacher rows, no teacher forward), and with the GRPO term
switched off (every advantage 0: a step whose groups are all right or all wrong) the loss is OPSD's on these
rollouts. The teacher is the initial policy (`teacher_mode=fixed`: the adapters off) or the student itself
(`dynamic`). `hybrid_route` picks the rollouts under the OPSD term (`opsd.rl.routes`: every one, those of groups
without GRPO signal, or those not graded correct; a routed rollout's GRPO advantage is 0). Cost: one student
forward per micro-batch serves both terms (two with fix_position_ids=false), plus one teacher forward; the compute
ledger counts the teacher's tokens.

With `teacher_contrast` the teacher also reads wrong hints (one forward per hint and micro-batch): the OPSD term's
target becomes RLCSD's (`opsd.method.contrast_target`), and with `contrast_rl_weight` > 0 each token's GRPO
advantage gets RLCSD's bounded modulation from the sampled token's contrastive log-ratio. `own_wrong` takes the
hints from the G rollouts themselves (`opsd.method.contrast.sibling_hints`): a correct sibling (or the reference)
as c, up to `contrast_hints` wrong siblings as c~.
"""

from __future__ import annotations

import logging

import torch

from opsd.method.contrast import sibling_hints
from opsd.method.contrast_target import modulated_advantages, sampled_log_ratio
from opsd.method.hidden import CheckedForwards, left_pad, lm_head_weight
from opsd.method.loss import token_log_probs
from opsd.method.pairing import CONTRAST_COLUMN
from opsd.method.prompts import teacher_rows
from opsd.method.scoring import SelfDistillation, TeacherHidden, TeacherWeights
from opsd.rl.grpo import GRPOTrainer
from opsd.rl.routes import sd_rows

logger = logging.getLogger(__name__)


class HybridTrainer(GRPOTrainer):
    """GRPO (TRL's) + sd_weight x OPSD on the same G rollouts per problem, with RLCSD's contrast (module
    docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        self.sd_weight = float(c.sd_weight)
        self.hybrid_route = c.hybrid_route
        self.contrast = c.teacher_contrast
        # RLCSD's modulation of the GRPO advantages: with a contrast and a weight.
        self.modulate = c.contrast_on and c.contrast_rl_weight > 0
        # The OPSD term's rows: those GRPO scores (`self.forwards`, one student forward for both terms), or the
        # reference code's with fix_position_ids=false, whose layout is not TRL's (then two student forwards).
        self.sd_forwards = self.forwards
        if not c.fix_position_ids:
            self.sd_forwards = CheckedForwards(
                self.accelerator.unwrap_model,
                fix_positions=False,
                pad_token_id=self.processing_class.pad_token_id,
                mixed_precision=self.accelerator.mixed_precision,
            )
        # The OPSD term is scored by the core every self-distilling method shares (`opsd.method.scoring`); the
        # teacher is the initial policy (a LoRA student's adapters off) or the student itself (dynamic).
        route = "base" if c.teacher_mode == "fixed" else "as_is"
        teacher = TeacherWeights(
            self.accelerator.unwrap_model(self.model), self.accelerator.unwrap_model, route
        )
        self.core = SelfDistillation(c, self.sd_forwards, teacher, self.processing_class.eos_token_id)
        self.teacher_rows_needed = self.core.needs_teacher and (self.sd_weight > 0 or self.modulate)

    # -- the batch: TRL's, plus the teacher's rows ------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        if not self.teacher_rows_needed:
            return out
        completion_ids, completion_mask = out["completion_ids"], out["completion_mask"]
        problems = [x["prompt"] for x in inputs]
        hints, wrongs = self._hints(inputs)
        pad_id = self.processing_class.pad_token_id
        rows, truncated = teacher_rows(
            self.prompt_builder, problems, [h if h is not None else "" for h in hints], completion_ids,
            completion_mask, pad_id,
        )  # fmt: skip
        out.update(rows)
        if wrongs is not None:
            out.update(self._wrong_hint_rows(problems, hints, wrongs, completion_ids))
        # The OPSD term's denominator: its loss tokens over the whole step and every process (as OPSD's trainer).
        local = self.core.token_mask(completion_ids, completion_mask).sum()
        out["sd_num_tokens"] = self.accelerator.reduce(local.clone(), reduction="sum")
        if self.model.training:
            self.record_metrics({"prompts/teacher_truncated": float(truncated)})
            self.ledger.add(teacher=self.core.teacher_tokens(out))
        return out

    def _sd_rows(self, batch) -> torch.Tensor:
        """(B,) bool: the rollouts under the OPSD term, by `hybrid_route` (`opsd.rl.routes`); none without it."""
        if self.sd_weight == 0:
            return super()._sd_rows(batch)
        rows = sd_rows(self.reward.last[1], self.num_generations, self.hybrid_route)
        return torch.tensor(rows, dtype=torch.bool, device=batch["completion_mask"].device)

    def _hints(self, inputs):
        """(the hint c per row, the wrong hints c~ per row or None without a contrast). A row without a pair
        (`own_wrong`) has c = None and no wrong hint."""
        references = [x.get("privileged_context") for x in inputs]
        if not self.config.contrast_on:
            return references, None
        if self.contrast != "own_wrong":
            return references, [[x[CONTRAST_COLUMN]] for x in inputs]
        texts, rewards = self.reward.last
        prompts = [x["prompt"] for x in inputs]
        G = self.config.num_generations
        if any(prompts[i] != prompts[i - i % G] for i in range(len(prompts))):
            raise RuntimeError(
                f"teacher_contrast=own_wrong needs each problem's {G} rollouts side by side in a process's batch, and "
                "this batch splits a group; report this with the run's configuration"
            )
        seed = f"{self.config.seed}:{self.state.global_step}:{self.accelerator.process_index}"
        hints, wrongs, record = sibling_hints(
            texts, rewards, references, G, max_hints=self.config.contrast_hints, seed=seed
        )
        if self.model.training:
            paired = max(record["rows_with_pair"], 1.0)
            self.record_metrics({
                "contrast/rows_with_pair": record["rows_with_pair"] / record["rows"],
                "contrast/hints_per_row": record["wrong_hints"] / paired,
                "contrast/hint_from_reference": record["hint_from_reference"] / paired,
            })  # fmt: skip
        return hints, wrongs

    def _wrong_hint_rows(self, problems, hints, wrongs, completion_ids) -> dict:
        """The wrong hints' prompts, (B, J, P) left-padded, and which exist (B, J): J = the most hints of a row."""
        J = max(1, max(len(w) for w in wrongs))
        prompts, valid = [], []
        for problem, hint, row in zip(problems, hints, wrongs, strict=True):
            for j in range(J):
                valid.append(j < len(row))
                # a missing hint takes the row's hint in its place; it is never scored (`contrast_valid`)
                prompts.append(
                    self.prompt_builder.teacher_ids(problem, row[j] if j < len(row) else hint or "").ids
                )
        ids, mask = left_pad(prompts, self.processing_class.pad_token_id, completion_ids.device)
        B = len(problems)
        return {
            "contrast_input_ids": ids.view(B, J, -1),
            "contrast_attention_mask": mask.view(B, J, -1),
            "contrast_valid": torch.tensor(valid, device=completion_ids.device).view(B, J),
        }

    # -- the loss --------------------------------------------------------------------------------------------
    def _compute_loss(self, model, inputs):
        teacher = self.core.teacher_hidden(inputs) if self.teacher_rows_needed else None
        if self.modulate:
            inputs = {**inputs, "advantages": self._modulated_advantages(inputs, teacher)}
        if self.sd_weight == 0:
            return super()._compute_loss(model, inputs)
        # One student forward for both terms: TRL's loss scores the sampled tokens from these hidden states.
        student_NH = self.core.student_hidden(model, inputs)
        with self.scored_from(student_NH if self.sd_forwards is self.forwards else None):
            grpo = super()._compute_loss(model, inputs)
        sd = self.sd_loss(model, inputs, teacher, student_NH)
        self.record_metrics({"hybrid/grpo_loss": float(grpo.detach()), "hybrid/sd_loss": float(sd.detach())})
        return grpo + self.sd_weight * sd

    def _modulated_advantages(self, inputs, teacher: TeacherHidden) -> torch.Tensor:
        """RLCSD's per-token advantages (B, T) (`opsd.method.contrast_target.modulated_advantages`)."""
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask_BT = completion_mask.bool()
        ids_N = completion_ids[mask_BT]
        settings, contrast = self.core.settings, teacher.contrast
        kw = dict(transform=self.core.forwards.transform, temperature=settings.temperature,
                  chunk_size=settings.chunk_size)  # fmt: skip
        with torch.no_grad():
            logp_c_N = token_log_probs(teacher.hidden_NH, teacher.weight_VH, ids_N, **kw)
            logp_w_JN = torch.stack(
                [token_log_probs(h, teacher.weight_VH, ids_N, **kw) for h in contrast.hidden_JNH]
            )
            e_BT = torch.zeros_like(completion_mask, dtype=logp_c_N.dtype)
            e_BT[mask_BT] = sampled_log_ratio(logp_c_N, logp_w_JN, contrast.valid_JN)
        c = self.config
        advantages_BT, selected_BT = modulated_advantages(
            inputs["advantages"], e_BT, teacher.has_contrast_B[:, None] & mask_BT, weight=c.contrast_rl_weight,
            tau=c.contrast_rl_tau, delta=c.contrast_rl_delta,
        )  # fmt: skip
        if self.hybrid_route != "mix":  # a rollout routed to self-distillation gets no GRPO term
            advantages_BT = advantages_BT.masked_fill(inputs["sd_rows"][:, None], 0.0)
        if self.model.training:
            n = max(int(mask_BT.sum()), 1)
            shift = float((advantages_BT - inputs["advantages"][:, None]).abs()[mask_BT].sum()) / n
            self.record_metrics(
                {"contrast/rl_selected": float(selected_BT.sum()) / n, "contrast/rl_shift": shift}
            )
        return advantages_BT

    def sd_loss(self, model, inputs, teacher: TeacherHidden | None, student_NH) -> torch.Tensor:
        """The OPSD term of a micro-batch (`SelfDistillation.loss`): its clipped divergence summed over the loss
        tokens of its rollouts routed to it (`sd_rows`), divided by the step's loss tokens of every rollout over
        all processes, times the processes. `student_NH`: the student's completion hidden states in TRL's layout;
        the OPSD term runs its own forward where its layout differs (fix_position_ids=false)."""
        if self.sd_forwards is not self.forwards:
            student_NH = self.core.student_hidden(model, inputs)
        scored = self.core.loss(
            student_NH, lm_head_weight(self.accelerator.unwrap_model(model)), teacher, inputs,
            denominator=inputs["sd_num_tokens"], rows_B=inputs["sd_rows"],
            num_processes=self.accelerator.num_processes,
        )  # fmt: skip
        self.record_metrics(scored.metrics)
        return scored.loss
