"""The teacher variants inside the trainer (tiny model, transformers rollouts): the teacher-free control renders
no teacher prompt and runs no teacher forward; the contrastive teacher runs one more forward, and with the wrong
hint equal to the hint it gives no loss and no gradient, and its target stays where it is while the student
moves; every step logs its rollouts' correctness."""

import pytest
import torch

from opsd.method.pairing import CONTRAST_COLUMN
from tests.conftest import make_trainer

NO_PROBE = dict(probe_size=0, probe_steps=0, completions_steps=0)


def lora_weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def count_calls(trainer, counts: dict[str, int]) -> None:
    """Counts teacher prompts rendered, entries into the teacher's weights and model forwards (both roles), as the
    scoring core (`trainer.core`) runs them."""
    builder, core = trainer.prompt_builder, trainer.core
    render, forwards, teacher = builder.teacher_ids, core.forwards, core.teacher

    class CountedForwards:
        transform = property(lambda _: forwards.transform)

        def __call__(self, *a, **kw):
            counts["forwards"] += 1
            return forwards(*a, **kw)

    class CountedTeacher:
        model = teacher.model
        weight_VH = teacher.weight_VH

        def active(self):
            counts["teacher_contexts"] += 1
            return teacher.active()

    def teacher_ids(*a, **kw):
        counts["prompts"] += 1
        return render(*a, **kw)

    builder.teacher_ids = teacher_ids
    core.forwards, core.teacher = CountedForwards(), CountedTeacher()


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


def same_hints(trainer) -> None:
    """Every row's wrong hint made its hint (c~ = c)."""
    table = trainer.train_dataset
    assert list(table[CONTRAST_COLUMN]) != list(table["privileged_context"])
    trainer.train_dataset = table.remove_columns(CONTRAST_COLUMN).add_column(
        CONTRAST_COLUMN, list(table["privileged_context"])
    )


def test_contrast_with_the_hint_as_its_own_wrong_hint_gives_no_loss_and_no_gradient(tiny_model_dir, tmp_path):
    """Without the KL weight (contrast_kl_tau=0) such a row would train as plain OPSD (q = p_c); with it, rounding
    would leave ~1e-7 per logit, which Adam turns into a full step. Rows without a contrast are skipped: exactly
    no loss, no gradient, and the weights do not move."""
    trainer = make_trainer(tiny_model_dir, tmp_path, teacher_contrast="wrong_answer", contrast_kl_tau=0.0,
                           **NO_PROBE)  # fmt: skip
    same_hints(trainer)
    before = lora_weights(trainer)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(h["loss"] == 0.0 and h["grad_norm"] == 0.0 for h in logged)
    after = lora_weights(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)


def target_and_student(trainer, batch):
    """(q, p_S) at the first completion token of `batch`, from the trainer's own forwards."""
    from opsd.method.contrast_target import contrast_support

    settings = trainer.core.settings
    with torch.no_grad():
        hidden, teacher = trainer.completion_hidden_states(trainer.model, batch)
        tau = settings.temperature
        x = hidden.student_hidden_NH[:1] @ hidden.student_weight_VH.T / tau
        xt = hidden.teacher_hidden_NH[:1] @ hidden.teacher_weight_VH.T / tau
        xw = (teacher.contrast.hidden_JNH[0, :1] @ hidden.teacher_weight_VH.T / tau)[None]
        c = settings.contrast
        sup = contrast_support(x, xt, xw, torch.ones(1, 1, dtype=torch.bool), alpha=c.alpha, top_k=c.top_k,
                               floor=c.floor, kl_tau=c.kl_tau)  # fmt: skip
    return sup.log_q_NB.exp(), x.softmax(-1)


def test_the_target_stays_where_it_is_while_the_student_moves(tiny_model_dir, tmp_path):
    """RLCSD's target reads no student: three optimizer steps that move p_S leave q where it was (the student-anchored
    form it replaces re-tilted the moved student after every step)."""
    trainer = make_trainer(tiny_model_dir, tmp_path, teacher_contrast="shuffled", max_steps=3, learning_rate=1e-3,
                           clip_mode="none", **NO_PROBE)  # fmt: skip
    trainer.model.eval()
    batch = trainer.rollout_batch([trainer.train_dataset[i] for i in range(2)])
    q0, p0 = target_and_student(trainer, batch)
    trainer.train()
    trainer.model.eval()
    q1, p1 = target_and_student(trainer, batch)
    assert float((p1.log() - p0.log()).abs().max()) > 1e-3  # the student moved
    assert float((q1 - q0).abs().max()) <= 1e-6  # the target did not


def test_contrast_with_a_wrong_hint_has_a_gradient_and_logs_its_diagnostics(tiny_model_dir, tmp_path):
    """The tiny random model barely tells c from c~ (its KL weight is ~1e-7), so the weight is off here."""
    trainer = make_trainer(tiny_model_dir, tmp_path, teacher_contrast="wrong_answer", clip_mode="none",
                           contrast_kl_tau=0.0, **NO_PROBE)  # fmt: skip
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2 and all(h["grad_norm"] > 1e-4 for h in logged)
    for h in logged:
        assert h["opsd/contrast_kl"] > 0 and h["opsd/contrast_weight"] == 1.0
        assert (
            0 <= h["opsd/argmax_differs"] <= 1
            and 0 < h["opsd/eos_student"] < 1
            and 0 < h["opsd/eos_target"] < 1
        )


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


def test_rows_without_a_contrast_move_no_weight_of_the_embedded_model(embedded_cache_dir, tmp_path):
    """On the embedded model (49,152-token vocabulary), rows whose wrong hint is their hint leave every adapter weight
    bit-identical after two steps (without the KL weight they would train as plain OPSD; with it, rounding would
    leave a gradient Adam normalises into a full step): they are skipped."""
    from opsd.models import EMBEDDED_NAME

    model_dir = embedded_cache_dir / EMBEDDED_NAME
    trainer = make_trainer(
        model_dir, tmp_path, teacher_contrast="shuffled", contrast_kl_tau=0.0, max_completion_length=4,
        per_device_train_batch_size=1, **NO_PROBE,
    )  # fmt: skip
    same_hints(trainer)
    before = lora_weights(trainer)
    trainer.train()
    after = lora_weights(trainer)
    assert all(torch.equal(before[n], after[n]) for n in before)
