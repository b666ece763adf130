"""`steps_per_rollout` (k optimizer steps per generation) on the tiny model: one generation serves k steps, each step
trains on its own problems (those the on-policy run trains on at that step), each step is normalised by its own
valid tokens, the staleness is logged, a run resumed inside a window trains the same problems, and the switch is
refused where it cannot work."""

import pytest

from tests.conftest import make_trainer, stop_at


def _recorded(trainer):
    """Wraps the trainer's generate and loss calls; returns the lists they fill."""
    calls = {"generate": [], "loss": []}
    generate, compute_loss = trainer.generate_rollouts, trainer.compute_loss

    def record_generate(prompt_ids):
        calls["generate"].append((trainer.state.global_step, len(prompt_ids)))
        return generate(prompt_ids)

    def record_loss(model, inputs, *args, **kwargs):
        if model.training:
            counted = trainer.core.token_mask(inputs["completion_ids"], inputs["completion_mask"]).sum()
            calls["loss"].append({
                "step": trainer.state.global_step,
                "problems": list(inputs["problems"]),
                "denominator": inputs["num_loss_tokens"].tolist(),
                "counted": int(counted),
            })  # fmt: skip
        return compute_loss(model, inputs, *args, **kwargs)

    trainer.generate_rollouts, trainer.compute_loss = record_generate, record_loss
    return calls


def _by_step(loss_calls):
    steps: dict[int, list] = {}
    for call in loss_calls:
        steps.setdefault(call["step"], []).append(call)
    return steps


def _train(tiny_model_dir, out, k, *callbacks, resume=None, **overrides):
    trainer = make_trainer(
        tiny_model_dir, out, max_steps=4, gradient_accumulation_steps=2, steps_per_rollout=k, logging_steps=1,
        **overrides,
    )  # fmt: skip
    for cb in callbacks:
        trainer.add_callback(cb)
    calls = _recorded(trainer)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, calls


def test_one_generation_serves_k_steps_each_on_its_own_problems(tiny_model_dir, tmp_path):
    _, on_policy = _train(tiny_model_dir, tmp_path / "k1", 1)
    trainer, windowed = _train(tiny_model_dir, tmp_path / "k2", 2)
    assert trainer.args.steps_per_generation == 4  # TRL's window: 2 steps x 2 micro-batches

    # 2 problems per micro-batch, 2 micro-batches per step: k=1 rolls out 4 rows at every step, k=2 8 rows at
    # steps 0 and 2, with the weights of those steps.
    assert on_policy["generate"] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert windowed["generate"] == [(0, 8), (2, 8)]

    # The budget is unchanged: every step trains on the problems the on-policy run trains on at that step.
    k1, k2 = _by_step(on_policy["loss"]), _by_step(windowed["loss"])
    assert sorted(k2) == [0, 1, 2, 3]
    for step in range(4):
        assert [c["problems"] for c in k2[step]] == [c["problems"] for c in k1[step]], step

    # Each step is normalised by its own valid tokens (both micro-batches), not by the window's.
    for step, micro in k2.items():
        own = sum(c["counted"] for c in micro)
        assert all(set(c["denominator"]) == {own} for c in micro), (step, micro)
    windows = [sum(c["counted"] for c in k2[s] + k2[s + 1]) for s in (0, 2)]
    assert all(k2[s][0]["denominator"][0] < w for s, w in zip((0, 2), windows, strict=True))

    logged = [
        e["rollout/staleness_steps"] for e in trainer.state.log_history if "rollout/staleness_steps" in e
    ]
    assert logged == [0.0, 1.0, 0.0, 1.0]


def test_resume_inside_a_window_trains_the_same_problems(tiny_model_dir, tmp_path):
    from opsd.run.callbacks import CompleteMark
    from opsd.rundir import latest_complete_checkpoint

    _, whole = _train(tiny_model_dir, tmp_path / "whole", 2)
    cut = tmp_path / "cut"
    save = dict(save_strategy="steps", save_steps=1)
    _train(tiny_model_dir, cut, 2, stop_at(1), CompleteMark(), **save)
    ckpt = latest_complete_checkpoint(cut)
    assert ckpt.name == "checkpoint-1"  # inside the window of steps 0 and 1
    trainer, resumed = _train(tiny_model_dir, cut, 2, CompleteMark(), resume=str(ckpt), **save)
    assert trainer.state.global_step == 4
    # The window is rolled out again at step 1; step 1 takes its second half.
    assert resumed["generate"] == [(1, 8), (2, 8)]
    expected, got = _by_step(whole["loss"]), _by_step(resumed["loss"])
    assert sorted(got) == [1, 2, 3]
    for step in got:
        assert [c["problems"] for c in got[step]] == [c["problems"] for c in expected[step]], step


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(steps_per_rollout=3, max_steps=100), "does not divide max_steps=100"),
        (dict(steps_per_rollout=0), "steps_per_rollout=0 is out of range"),
        (dict(steps_per_rollout=2, num_iterations=2), "set one of them"),
        (dict(steps_per_generation=4, gradient_accumulation_steps=2), "set steps_per_rollout"),
        (
            dict(steps_per_rollout=2, generation_batch_size=8, per_device_train_batch_size=4),
            "set steps_per_rollout",
        ),
    ],
)
def test_refused_where_it_cannot_work(settings, words):
    from opsd.configuration.config import OPSDConfig

    with pytest.raises(ValueError, match=words):
        OPSDConfig(output_dir="unused", use_vllm=False, **settings)


def test_sets_trl_window_in_micro_batches():
    from opsd.configuration.config import OPSDConfig

    cfg = OPSDConfig(output_dir="unused", use_vllm=False, steps_per_rollout=4, gradient_accumulation_steps=2)
    assert (cfg.steps_per_generation, cfg.generation_batch_size) == (8, 8 * cfg.per_device_train_batch_size)
    # The published setting is TRL's default window: one optimizer step.
    assert OPSDConfig(output_dir="unused", use_vllm=False).steps_per_generation == 2
