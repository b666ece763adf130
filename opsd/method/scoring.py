"""The scoring core of self-distillation: what every method that distils from the teacher computes for a
micro-batch, given its rollouts, their prompts and the teacher (docs/method.md §1).

    core = SelfDistillation(config, forwards, TeacherWeights(teacher_model, unwrap, "base"), eos_token_id)
    teacher = core.teacher_hidden(batch)                       # no gradient, teacher in eval mode
    scored = core.loss(student_NH, student_weight_VH, teacher, batch, denominator=batch["num_loss_tokens"][0])

`OPSDTrainer` scores its whole loss here and `HybridTrainer` its OPSD term (on the rollouts its route sends
to it), so both read the same configuration (`loss_settings`, `num_loss_tokens_to_skip`), the same teacher
vocabulary (`TeacherWeights`) and the same batch keys:

- `completion_ids`, `completion_mask` (B, C): the rollouts, right-padded;
- `teacher_input_ids`, `teacher_attention_mask` (B, P + C): `[teacher prompt ; completion]` rows, left-padded
  prompts (`opsd.method.prompts.teacher_rows`); absent when the loss reads no teacher;
- `contrast_input_ids`, `contrast_attention_mask` (B, J, Q) and `contrast_valid` (B, J): the left-padded prompts
  of J wrong hints per row (a contrastive teacher, `opsd.method.contrast`) and which of them a row has.

What it returns is the micro-batch's loss, its `opsd/*` diagnostics and the tokens the ledger books.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from opsd.method.contrast import rows_with_contrast
from opsd.method.hidden import CheckedForwards, eval_mode, lm_head_weight, loss_token_mask
from opsd.method.loss import ContrastHidden, LossSettings, chunked_opsd_loss, loss_settings

TEACHER_ROUTES = ("base", "adapter", "as_is")


@dataclass(frozen=True)
class TeacherWeights:
    """Whose weights the teacher's forwards run with, in eval mode (the teacher must be a deterministic function
    of its weights: LoRA dropout would score the same tokens differently on every call):

    - `base`: the model's base, its adapters off (a LoRA student's initial policy, `teacher_mode=fixed`);
    - `adapter`: the model with its adapter `adapter` active (the EMA teacher kept as a second adapter);
    - `as_is`: the model as it is (a teacher model of its own, or the student itself: `teacher_mode=dynamic`).

    `model` is what the forwards run (the trainer's teacher model), `unwrap` gives the bare model the routing
    acts on."""

    model: torch.nn.Module
    unwrap: object
    route: str
    adapter: str | None = None

    def __post_init__(self):
        if self.route not in TEACHER_ROUTES or (self.route == "adapter") != (self.adapter is not None):
            raise ValueError(f"teacher route {self.route!r} with adapter {self.adapter!r}")

    @contextmanager
    def active(self):
        """The teacher's weights inside the block, in eval mode; the student's as they were afterwards."""
        teacher = self.unwrap(self.model)
        with eval_mode(teacher):
            if self.route == "base":
                with teacher.disable_adapter():
                    yield
            elif self.route == "adapter":
                student_adapter = teacher.active_adapter
                teacher.set_adapter(self.adapter)
                try:
                    yield
                finally:
                    teacher.set_adapter(student_adapter)
            else:
                yield

    def weight_VH(self) -> torch.Tensor:
        """The teacher's lm_head (V, H), without gradient."""
        return lm_head_weight(self.unwrap(self.model)).detach()


@dataclass
class TeacherHidden:
    """The teacher's final hidden states of every completion token of a micro-batch (N, H), flattened over its
    completion mask, under the row's hint; under each wrong hint (`contrast`, None without a contrastive
    teacher) and which rows have a contrast (`has_contrast_B`); the teacher's lm_head (V, H)."""

    hidden_NH: torch.Tensor
    weight_VH: torch.Tensor
    contrast: ContrastHidden | None = None
    has_contrast_B: torch.Tensor | None = None


@dataclass
class Scored:
    """A micro-batch's self-distillation: `loss` (its clipped divergence summed over the loss tokens, divided by
    the step's loss tokens over all processes, times the processes: DDP/DeepSpeed average the gradients),
    `loss_sum`, its `opsd/*` metrics, the tokens it trained on (B, C) and their number."""

    loss: torch.Tensor
    loss_sum: torch.Tensor
    metrics: dict[str, float]
    keep_BC: torch.Tensor
    trained_tokens: int


def prompt_part(batch: dict, role: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of the prompt part of a role's `[prompt ; completion]` rows (role: `teacher`)."""
    ids, mask = batch[f"{role}_input_ids"], batch[f"{role}_attention_mask"]
    width = ids.size(1) - batch["completion_ids"].size(1)
    return ids[:, :width], mask[:, :width]


def token_rows(mask_BC: torch.Tensor) -> torch.Tensor:
    """(N,) the row of each token of a (B, C) mask, in the order the flat tokens come (row-major)."""
    rows_BC = torch.arange(mask_BC.shape[0], device=mask_BC.device)[:, None].expand_as(mask_BC)
    return rows_BC[mask_BC.bool()]


def loss_metrics(loss_sum: torch.Tensor, stats: dict, *, teacher: bool = True) -> dict[str, float]:
    """The `opsd/*` metrics of one micro-batch: `chunked_opsd_loss`'s sums per valid token (without the
    teacher's statistics when the loss read no teacher)."""
    n = max(float(stats["num_tokens"]), 1.0)
    keys = [k for k in stats if k != "num_tokens"] if teacher else ["abs_advantage"]
    return {**{f"opsd/{k}": float(stats[k]) / n for k in keys}, "opsd/loss_per_token": float(loss_sum) / n}


class SelfDistillation:
    """OPSD's loss on a micro-batch's rollouts, for every method that distils (module docstring).

    `forwards` gives the completion tokens' final hidden states in the self-distillation layout
    (`fix_position_ids`) and the logit transform it checked; `teacher` routes the teacher's weights."""

    def __init__(self, config, forwards: CheckedForwards, teacher: TeacherWeights, eos_token_id: int | None):
        self.config = config
        self.settings: LossSettings = loss_settings(config)
        self.forwards = forwards
        self.teacher = teacher
        self.eos_token_id = eos_token_id

    @property
    def needs_teacher(self) -> bool:
        return self.settings.needs_teacher

    def token_mask(self, completion_ids_BC: torch.Tensor, completion_mask_BC: torch.Tensor) -> torch.Tensor:
        """(B, C) the tokens in the loss: every sampled one, the stop token included whatever the pad id and the
        layout (`loss_token_mask`)."""
        return loss_token_mask(
            completion_ids_BC, completion_mask_BC, skip=self.config.num_loss_tokens_to_skip
        )

    def student_hidden(self, model, batch: dict) -> torch.Tensor:
        """The student's final hidden states of every completion token of `batch` (N, H), through `model` (the
        wrapped model in training, so DDP/DeepSpeed see the forward), with gradient where it is enabled."""
        ids, mask = batch["completion_ids"], batch["completion_mask"]
        return self.forwards(model, batch["prompt_ids"], batch["prompt_mask"], ids, mask)

    def teacher_tokens(self, batch: dict) -> int:
        """The tokens the teacher's forwards of `batch` read (the ledger's `teacher_tokens`): each forward its
        prompt and the completion, one per scored wrong hint too."""
        if not self.needs_teacher or "teacher_attention_mask" not in batch:
            return 0
        completion_B = batch["completion_mask"].sum(1)
        tokens = int(batch["teacher_attention_mask"].sum())
        if "contrast_valid" in batch:
            valid_BJ = batch["contrast_valid"]
            tokens += int((batch["contrast_attention_mask"].sum(-1) * valid_BJ).sum())
            tokens += int((valid_BJ.sum(1) * completion_B).sum())
        return tokens

    def teacher_hidden(self, batch: dict) -> TeacherHidden:
        """The teacher's hidden states of `batch`'s completion tokens under its hint, and under each wrong hint
        (one forward per hint index; a row without that hint is left out of it); no gradient."""
        completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
        teacher_ids, teacher_mask = prompt_part(batch, "teacher")
        with torch.no_grad(), self.teacher.active():
            hidden_NH = self._forward(teacher_ids, teacher_mask, completion_ids, completion_mask).detach()
            if "contrast_input_ids" not in batch:
                return TeacherHidden(hidden_NH, self.teacher.weight_VH())
            ids_BJQ, mask_BJQ, valid_BJ = (
                batch["contrast_input_ids"], batch["contrast_attention_mask"], batch["contrast_valid"]
            )  # fmt: skip
            valid_JN = valid_BJ[token_rows(completion_mask)].T.contiguous()
            hidden_JNH = hidden_NH.new_zeros((valid_BJ.size(1), *hidden_NH.shape))
            for j in range(valid_BJ.size(1)):
                rows_B = valid_BJ[:, j]
                if rows_B.any():
                    h = self._forward(ids_BJQ[rows_B, j], mask_BJQ[rows_B, j], completion_ids[rows_B],
                                      completion_mask[rows_B])  # fmt: skip
                    hidden_JNH[j, valid_JN[j]] = h.detach()
        # A row has a contrast when it has a wrong hint and that hint is not its hint (shuffled, wrong_answer).
        has_B = valid_BJ.any(1) & rows_with_contrast(teacher_ids, teacher_mask, ids_BJQ[:, 0], mask_BJQ[:, 0])
        contrast = ContrastHidden(hidden_JNH, valid_JN, self.eos_token_id)
        return TeacherHidden(hidden_NH, self.teacher.weight_VH(), contrast, has_B)

    def _forward(self, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
        return self.forwards(self.teacher.model, prompt_ids, prompt_mask, completion_ids, completion_mask)

    def loss(
        self, student_NH: torch.Tensor, student_weight_VH: torch.Tensor, teacher: TeacherHidden | None, batch: dict,
        *, denominator: torch.Tensor, rows_B: torch.Tensor | None = None, num_processes: int = 1,
    ) -> Scored:  # fmt: skip
        """The micro-batch's loss: the clipped divergence (`chunked_opsd_loss`) of the loss tokens of the rows
        `rows_B` (None: every row; a row without a contrast adds exactly 0 under a contrastive teacher), summed,
        divided by `denominator` (the step's loss tokens over all processes), times `num_processes`.
        `student_NH`: the student's hidden states of every completion token (N, H), with gradient."""
        completion_ids, completion_mask = batch["completion_ids"], batch["completion_mask"]
        keep_BC = self.token_mask(completion_ids, completion_mask)
        if rows_B is not None:
            keep_BC = keep_BC * rows_B[:, None]
        if teacher is not None and teacher.has_contrast_B is not None:
            keep_BC = keep_BC * teacher.has_contrast_B[:, None]
        keep_N = keep_BC[completion_mask.bool()].bool()
        loss_sum, stats = chunked_opsd_loss(
            student_NH[keep_N],
            None if teacher is None else teacher.hidden_NH[keep_N],
            student_weight_VH,
            None if teacher is None else teacher.weight_VH,
            settings=self.settings,
            target_ids_N=completion_ids[completion_mask.bool()][keep_N],
            transform=self.forwards.transform,
            contrast=None if teacher is None or teacher.contrast is None else teacher.contrast.kept(keep_N),
            rows_N=token_rows(keep_BC),
        )
        loss = loss_sum / denominator.clamp(min=1).to(loss_sum.dtype) * num_processes
        metrics = loss_metrics(loss_sum.detach(), stats, teacher=self.needs_teacher)
        return Scored(loss, loss_sum, metrics, keep_BC, int(keep_N.sum()))
