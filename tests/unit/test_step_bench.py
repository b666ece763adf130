"""bench/opsd_step.py's arithmetic for several steps per generation (`:kN` variants), against hand-computed values:
whole windows are run and measured, a phase's time per step is its window sum over the window's steps, and a
k > 1 row is held to its own goal."""

import pytest

from opsd_step import GOAL_RATIO, GOAL_RATIO_WINDOW, measured_steps, parse_variant, ratios, summarise


def test_variants_with_a_window():
    v = parse_variant("project:2048:auto:ckpt:compile:k4")
    assert (v["arm"], v["length"], v["compile"], v["k"]) == ("project", 2048, True, 4)
    assert parse_variant("project:1024:4:nockpt")["k"] == 1
    for bad in ("reference:1024:4:ckpt:k2", "project:1024:4:ckpt:k0", "project:1024:4:ckpt:k2:k4",
                "project:1024:4:ckpt:compile:compile", "project:1024:4:ckpt:kx"):  # fmt: skip
        with pytest.raises(SystemExit, match="bad variant"):
            parse_variant(bad)


def test_method_levers_set_the_teacher_variant():
    assert parse_variant("project:1024:auto:ckpt:compile:fixed")["method"] == {"loss_type": "fixed_advantage"}
    assert parse_variant("project:1024:auto:ckpt:contrast")["method"] == {"teacher_contrast": "shuffled"}
    assert parse_variant("project:1024:auto:ckpt")["method"] == {}
    for bad in (
        "reference:1024:4:ckpt:fixed",
        "project:1024:4:ckpt:fixed:contrast",
        "project:1024:4:ckpt:other",
    ):
        with pytest.raises(SystemExit, match="bad variant"):
            parse_variant(bad)


def test_whole_windows_at_least_two():
    assert [measured_steps(6, k) for k in (1, 2, 4)] == [6, 6, 8]
    assert measured_steps(2, 4) == 8 and measured_steps(9, 4) == 12


def test_time_per_step_over_a_window():
    # k = 2: the first step of each window rolls out (3 s), the second does not.
    window = [
        {"time/step_s": 5.0, "time/rollout_s": 3.0, "memory/step_extra_gib": 9.0},
        {"time/step_s": 2.0, "memory/step_extra_gib": 11.0},
    ]
    assert summarise("time/step_s", window * 2, 2) == pytest.approx(3.5)
    assert summarise("time/rollout_s", window * 2, 2) == pytest.approx(1.5)
    assert summarise("memory/step_extra_gib", window * 2, 2) == pytest.approx(10.0)  # median, not a sum
    # k = 1: the median step.
    assert summarise("time/step_s", [{"time/step_s": s} for s in (4.0, 9.0, 5.0)], 1) == 5.0


def test_each_row_against_its_goal():
    rows = [
        {"variant": "reference:1024:4:ckpt", "arm": "reference", "length": 1024, "status": "ok",
         "time/step_s": 8.0, "time/rollout_s": 3.0, "time/train_micro_s": 5.0},
        {"variant": "project:1024:auto:ckpt:compile", "arm": "project", "length": 1024, "status": "ok", "k": 1,
         "micro_batch": 32, "time/step_s": 5.0, "time/rollout_s": 3.0, "time/train_micro_s": 2.0},
        {"variant": "project:1024:auto:ckpt:compile:k2", "arm": "project", "length": 1024, "status": "ok", "k": 2,
         "micro_batch": 32, "time/step_s": 4.4, "time/rollout_s": 2.0, "time/train_micro_s": 2.0},
    ]  # fmt: skip
    k1, k2 = ratios(rows)
    assert (k1["step"], k1["goal"], k1["step_goal_met"]) == (0.625, GOAL_RATIO, True)
    assert (k2["step"], k2["goal"], k2["step_goal_met"]) == (0.55, GOAL_RATIO_WINDOW, False)
