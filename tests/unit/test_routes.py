"""The hybrid's routes (opsd.rl.routes) on hand-computed reward lists: which rollouts get the self-distillation term
under each route, the groups without GRPO signal, and the `rl/*` sums."""

from __future__ import annotations

import pytest

from opsd.rl.routes import groups_without_signal, route_metrics, sd_rows


def test_groups_without_signal_by_hand():
    # groups of 3: all wrong | mixed | all right | one graded (None is left out of its group's signal)
    rewards = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, None, 1.0, None]
    assert groups_without_signal(rewards, 3) == [True, False, True, True]
    assert groups_without_signal([None, 0.0, 1.0], 3) == [False]


def test_rollouts_that_do_not_split_into_groups_are_refused():
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        groups_without_signal([1.0, 0.0, 1.0], 4)


@pytest.mark.parametrize(
    ("route", "want"),
    [
        ("mix", [True] * 8),
        ("group", [True, True, False, False, True, True, True, True]),  # one graded rollout: no signal
        ("sample", [True, True, False, True, False, False, True, True]),
    ],
)
def test_sd_rows_by_route(route, want):
    rewards = [
        0.0,
        0.0,
        1.0,
        0.0,
        1.0,
        1.0,
        None,
        0.0,
    ]  # G = 2: wrong-wrong | mixed | right-right | none-wrong
    assert sd_rows(rewards, 2, route) == want


def test_unknown_route_is_refused():
    with pytest.raises(ValueError, match="hybrid_route='teacher'"):
        sd_rows([1.0, 0.0], 2, "teacher")


def test_route_metrics_sums_by_hand():
    rewards = [0.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    rows = sd_rows(rewards, 2, "group")  # groups 1 and 3 carry no signal
    tokens = [5, 7, 3, 4, 10, 1]
    assert route_metrics(rewards, 2, rows, tokens) == [2.0, 3.0, 3.0, 6.0, 23.0, 30.0]
    assert route_metrics(rewards, 2, [False] * 6, tokens)[4] == 0.0
