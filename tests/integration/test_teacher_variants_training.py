"""The teacher variants inside the trainer (tiny model, transformers rollouts): the teacher-free control renders
no teacher prompt and runs no teacher forward; the contrastive teacher runs one more forward, and with the wrong
hint equal to the hint it gives no loss and no gradient; every step logs its rollouts'
correctness."""

import pytest
import torch

from opsd.method.pairing import CONTRAST_COLUMN
from tests.conftest import make_trainer

NO_PROBE = dict(probe_size=0, probe_steps=0, completions_steps=0)


def lora_weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def count_calls(trainer, counts: dict[str, int]) -> None:
    """Counts teacher prompts rendered, entries into TRL's teacher context and model forwards (both roles)."""
    builder = trainer.prompt_builder
    render, context = builder.teacher_ids, trainer._get_teacher_context_for_self_distillation
    forward = trainer._completion_hidden

    def completion_hidden(*a, **kw):
        counts["forwards"] += 1
        return forward(*a, **kw)

    def teacher_ids(*a, **kw):
        counts["prompts"] += 1
        return render(*a, **kw)

    def teacher_context(*a, **kw):
        counts["teacher_contexts"] += 1
        return context(*a, **kw)

    builder.teacher_ids = teacher_ids
    trainer._get_teacher_context_for_self_distillation = teacher_context
    trainer._completion_hidden = completion_hidden


def test_fixed_advantage_builds_no_teacher_prompt_and_runs_no_teacher_forward(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        tiny_model_dir, tmp_path, loss_type="fixed_advantage", fixed_advantage=-0.3, **NO_PROBE
    )
    counts = {"prompts": 0, "teacher_contexts": 0, "forwards": 0}
    count_calls(trainer, counts)
    before = lora_weights(trainer)
    trainer.train()
    assert counts == {"prompts": 0, "teacher_contexts": 0, "forwards": 2}  # the student's, one per step
    after = lora_weights(trainer)
    assert any(not torch.equal(before[n], after[n]) for n in before)  # it trains: the control is not a no-op
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(h["opsd/abs_advantage"] == pytest.approx(0.3) for h in logged)
    assert not any("opsd/divergence" in h for h in logged)  # no teacher, no divergence to report
    # The loss is -a times the mean log-prob of the sampled tokens: negative.
    assert all(h["loss"] < 0 for h in logged)


def test_contrast_runs_a_second_teacher_forward(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, teacher_contrast="shuffled", **NO_PROBE)
    counts = {"prompts": 0, "teacher_contexts": 0, "forwards": 0}
    count_calls(trainer, counts)
    trainer.train()
    # 2 steps x 1 micro-batch of 2 rows: the student, the teacher after the reference and after the wrong hint.
    assert counts == {"prompts": 2 * 2 * 2, "teacher_contexts": 2, "forwards": 2 * 3}


def test_contrast_with_the_hint_as_its_own_wrong_hint_gives_no_loss_and_no_gradient(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, teacher_contrast="wrong_answer", **NO_PROBE)
    table = trainer.train_dataset
    assert list(table[CONTRAST_COLUMN]) != list(table["privileged_context"])
    same = table.remove_columns(CONTRAST_COLUMN).add_column(
        CONTRAST_COLUMN, list(table["privileged_context"])
    )
    trainer.train_dataset = same
    before = lora_weights(trainer)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    # q = p_S in exact arithmetic; rounding would leave ~1e-7 per logit, which Adam turns into a full step, so
    # rows without a contrast are skipped: exactly no loss, no gradient, and the weights do not move.
    assert len(logged) == 2 and all(h["loss"] == 0.0 and h["grad_norm"] == 0.0 for h in logged)
    after = lora_weights(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_contrast_weight_zero_leaves_every_adapter_weight_bit_identical(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        tiny_model_dir,
        tmp_path,
        teacher_contrast="shuffled",
        contrast_weight=0.0,
        clip_mode="none",
        **NO_PROBE,
    )
    before = lora_weights(trainer)
    trainer.train()
    after = lora_weights(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(h["loss"] == 0.0 and h["grad_norm"] == 0.0 for h in logged)


def test_contrast_with_a_wrong_hint_has_a_gradient(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        tiny_model_dir, tmp_path, teacher_contrast="wrong_answer", clip_mode="none", **NO_PROBE
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(h["grad_norm"] > 1e-4 for h in logged)


def test_every_step_logs_rollout_correctness(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=3, **NO_PROBE)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 3
    for h in logged:
        assert 0.0 <= h["rollout/correct"] <= 1.0 and 0.0 <= h["rollout/boxed"] <= 1.0
        # Counted apart from TRL's own length metric, and equal to it.
        assert h["rollout/length"] == h["completions/mean_length"]
        assert h["time/grade_wait_s"] >= 0.0


def test_contrast_weight_zero_on_the_embedded_model_moves_no_weight(embedded_cache_dir, tmp_path):
    """On the embedded model (49,152-token vocabulary) float rounding of q = p_S leaves a nonzero gradient that
    Adam normalises into a full step on every LoRA weight; rows without a contrast are skipped instead."""
    from opsd.models import EMBEDDED_NAME

    model_dir = embedded_cache_dir / EMBEDDED_NAME
    trainer = make_trainer(
        model_dir, tmp_path, teacher_contrast="shuffled", contrast_weight=0.0, max_completion_length=4,
        per_device_train_batch_size=1, **NO_PROBE,
    )  # fmt: skip
    before = lora_weights(trainer)
    trainer.train()
    after = lora_weights(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)
