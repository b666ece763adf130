"""Switches the other settings leave without effect (opsd/configuration/checks.py, `inert_fields`): each is one
warning line naming what it needs, where the run would otherwise record it as if it acted; the same value where it
acts, or a default, says nothing. The experiment compares its arms without them (`arms.effective_recipe`)."""

from __future__ import annotations

import logging
from dataclasses import fields

import pytest

from opsd.configuration.checks import inert_fields, warn_inert
from opsd.configuration.config import OPSDConfig
from opsd.experiment.arms import effective_recipe

# (settings, the warning line they give, the same switch where it acts)
CASES = [
    (dict(fixed_advantage=-1.0), "fixed_advantage=-1.0 has no effect: it needs loss_type=fixed_advantage "
     "(loss_type=jsd reads no constant advantage)", dict(loss_type="fixed_advantage")),
    (dict(loss_type="fixed_advantage", teacher_ref="answer"), "teacher_ref='answer' has no effect: it needs a loss "
     "that reads a teacher, loss_type=jsd or sampled_token (loss_type=fixed_advantage reads none)",
     dict(loss_type="jsd")),
    (dict(loss_type="fixed_advantage", beta=0.5), "beta=0.5 has no effect: it needs a loss that reads a teacher",
     dict(loss_type="jsd")),
    (dict(loss_type="sampled_token", divergence_clip=0.2), "divergence_clip=0.2 has no effect: it needs "
     "loss_type=jsd (sampled_token's policy gradient has no divergence to interpolate or clip)",
     dict(loss_type="jsd")),
    (dict(clip_mode="none", divergence_clip=0.2), "divergence_clip=0.2 has no effect: it needs clip_mode=element, "
     "token or rescale (clip_mode=none clips nothing)", dict(clip_mode="token")),
    (dict(ema_decay=0.9), "ema_decay=0.9 has no effect: it needs teacher_mode=ema (teacher_mode=fixed keeps no "
     "moving average)", dict(teacher_mode="ema")),
    (dict(teacher_ref_pairing="empty", teacher_ref="cot"), "teacher_ref='cot' has no effect: it needs a reference "
     "for the teacher, teacher_ref_pairing=matched or shuffled (teacher_ref_pairing=empty gives it none)",
     dict(teacher_ref_pairing="shuffled")),
    (dict(use_peft=False, lora_r=8), "lora_r=8 has no effect: it needs use_peft=true (full fine-tuning trains no "
     "adapter)", dict(use_peft=True)),
    (dict(completions_steps=0, completions_rows=2), "completions_rows=2 has no effect: it needs completions_steps "
     "> 0 (completions_steps=0 logs no completions)", dict(completions_steps=5)),
]  # fmt: skip
DEFAULTS = {f.name: f.default for f in fields(OPSDConfig)}


def config(tmp_path, **settings) -> OPSDConfig:
    return OPSDConfig(output_dir=str(tmp_path), use_vllm=False, **settings)


@pytest.mark.parametrize(("settings", "line", "acting"), CASES, ids=[str(c[0]) for c in CASES])
def test_a_switch_without_effect_is_one_warning_naming_what_it_needs(
    tmp_path, settings, line, acting
) -> None:
    lines = warn_inert(config(tmp_path, **settings), DEFAULTS)
    assert any(got.startswith(line) for got in lines) and all("\n" not in got for got in lines), lines
    field = line.split("=", 1)[0]
    assert not [
        got
        for got in warn_inert(config(tmp_path, **{**settings, **acting}), DEFAULTS)
        if got.startswith(field)
    ]
    # At its default the switch is not set: nothing to say, though the settings still leave it idle.
    unset = {k: v for k, v in settings.items() if k != field}
    assert field in inert_fields(config(tmp_path, **unset))
    assert not [got for got in warn_inert(config(tmp_path, **unset), DEFAULTS) if got.startswith(field)]


def test_the_config_logs_each_line_once(tmp_path, caplog, first_inert_lines) -> None:
    """Every entry point builds its config through OPSDConfig, which logs the lines; a config checked again (a new
    micro-batch plan re-runs the checks) does not repeat them."""
    with caplog.at_level(logging.WARNING, logger="opsd.configuration.checks"):
        cfg = config(tmp_path, fixed_advantage=-0.75)
        cfg.with_micro_batch(2, 1)
    said = [r.getMessage() for r in caplog.records if r.name == "opsd.configuration.checks"]
    assert said == [
        "fixed_advantage=-0.75 has no effect: it needs loss_type=fixed_advantage (loss_type=jsd reads no constant "
        "advantage)"
    ]
    assert not warn_inert(
        OPSDConfig(output_dir=str(tmp_path), use_vllm=False), DEFAULTS
    )  # the published recipe


def test_arms_are_compared_without_the_switches_their_settings_leave_idle() -> None:
    """A dry run's resolved settings (field -> value, every key the harness fixes or lets a recipe set): two arms
    that differ only in a switch without effect have one effective recipe; one that acts tells them apart."""
    base = {"loss_type": "jsd", "fixed_advantage": -0.25, "beta": 0.0, "clip_mode": "element", "learning_rate": 5e-6,
            "teacher_mode": "fixed", "ema_decay": 0.999, "output_dir": "runs/a", "seed": 42, "report_to": []}  # fmt: skip
    same = {**base, "fixed_advantage": -1.0, "ema_decay": 0.5, "output_dir": "runs/b"}
    assert effective_recipe(same) == effective_recipe(base)
    assert "output_dir" not in effective_recipe(base) and "learning_rate" in effective_recipe(base)
    assert effective_recipe({**base, "learning_rate": 1e-5}) != effective_recipe(base)
    control = {**base, "loss_type": "fixed_advantage"}
    assert effective_recipe({**control, "fixed_advantage": -1.0}) != effective_recipe(control)
    assert effective_recipe({**control, "beta": 0.5}) == effective_recipe(
        control
    )  # no teacher, no divergence
