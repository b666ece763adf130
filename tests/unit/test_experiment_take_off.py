"""Take-off in the experiment's report (opsd.experiment.take_off, verdict, rendering): each arm's seeds whose
training rollouts reached 50% correct and the first step each did, the per-seed outcomes shown before an interval
that averages a bimodal arm's two outcomes, and the take-off marked on the training curves. The metrics.jsonl
files are typed in here with known take-off steps; the experiment around them is test_experiment's."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from opsd.experiment import rendering, schedule, spec, take_off, verdict
from tests.unit.test_experiment import experiment, make_spec

NAN, INF = float("nan"), float("inf")


def records(correct: dict[int, float], loss_steps=None) -> list[dict]:
    """One record per step of `correct` ({step: rollout/correct}), with a loss of 2 - step/100 at `loss_steps`
    (default: every step)."""
    loss_steps = correct if loss_steps is None else loss_steps
    return [{"step": k, "rollout/correct": v, **({"loss": 2 - k / 100} if k in loss_steps else {})}
            for k, v in correct.items()]  # fmt: skip


# B's seeds: 1 takes off exactly at 0.5 at step 4; 2 at step 7 (its log misses step 5, holds a NaN at step 3, a
# record without a step at 0.9, and step 6 logged twice, the last record at 0.2 winning; loss only at even
# steps); 3 never (an infinite value at step 2, which no curve draws, is no take-off, and 0.49 is below).
# A stays near 0.1 in every seed.
LOGS = {
    ("B", 1): records({1: 0.0, 2: 0.1, 3: 0.3, 4: 0.5, 5: 0.9, 6: 1.0}),
    ("B", 2): [*records({1: 0.0, 2: 0.0, 3: NAN, 4: 0.49}, loss_steps={2, 4}), {"rollout/correct": 0.9},
               *records({6: 0.9}), *records({6: 0.2, 7: 0.75, 8: 1.0}, loss_steps={6, 8})],
    ("B", 3): records({1: 0.0, 2: INF, 3: 0.49, 4: 0.1}),
    **{("A", s): records({1: 0.1, 2: 0.1, 3: 0.12, 4: 0.1}) for s in (1, 2, 3)},
}  # fmt: skip


def write_logs(directory: Path, logs=LOGS) -> Path:
    for (arm, seed), rows in logs.items():
        path = spec.run_dir(directory, arm, seed) / "metrics.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # NaN and Infinity as Python writes them
    return directory


def test_take_off_of_each_seed_and_the_json(tmp_path: Path) -> None:
    directory = write_logs(experiment(tmp_path / "exp"))
    result, _ = rendering.write(directory, reps=200)
    assert result["take_off_rule"] == {"metric": "rollout/correct", "threshold": 0.5}
    assert result["arms"]["B"]["take_off"] == {
        "first_step": {"1": 4, "2": 7, "3": None}, "pending": {}, "unlogged": [], "took_off": 2, "of": 3,
        "bimodal": True,
    }  # fmt: skip
    assert result["arms"]["A"]["take_off"] == {
        "first_step": {"1": None, "2": None, "3": None}, "pending": {}, "unlogged": [], "took_off": 0, "of": 3,
        "bimodal": False,
    }  # fmt: skip
    # Both comparisons over seeds 1-3 span B's two outcomes; A's against the base model does not.
    split = {"B": {"took_off": [1, 2], "never": [3]}}
    for c in [*result["comparisons"]["B"].values(), *result["arms"]["B"]["vs_base"].values()]:
        assert c["bimodal"] == split
        assert c["bimodal_note"] == (
            "This interval spans both outcomes (B took off in seed(s) 1, 2 and never in 3): it averages two "
            "different outcomes; read the seeds."
        )
    for c in result["arms"]["A"]["vs_base"].values():
        assert c["bimodal"] == {} and c["bimodal_note"] is None
    assert json.loads((directory / "summary.json").read_text()) == json.loads(json.dumps(result))


def test_the_threshold_is_inclusive_and_reads_only_drawable_points() -> None:
    assert take_off.TAKE_OFF_CORRECT == 0.5
    assert take_off.first_take_off([[0, 0.2], [3, 0.5], [5, 0.9]]) == 3
    assert take_off.first_take_off([[0, 0.2], [3, 0.4999], [5, 0.9]]) == 5
    assert take_off.first_take_off([]) is None
    assert take_off.mark_point([[2, 1.0], [4, 2.0]], 3) == (4, 2.0)
    assert take_off.mark_point([[2, 1.0], [4, 2.0]], 5) is None


def test_a_seed_still_training_or_without_a_log_is_not_counted(tmp_path: Path) -> None:
    # B's seed 2 is training at step 40, below the threshold so far; its seed 3 has not started; A's seed 3 is
    # training and already took off (a known outcome).
    directory = experiment(tmp_path / "exp", unscored={("B", 2): 40, ("B", 3): None, ("A", 3): 40})
    logs = {("B", 1): records({1: 0.0, 2: 0.6}), ("B", 2): records({20: 0.1, 40: 0.2}),
            ("A", 1): records({1: 0.0}), ("A", 2): records({1: 0.0}), ("A", 3): records({20: 0.3, 40: 0.7})}  # fmt: skip
    result = verdict.build(write_logs(directory, logs), reps=200)
    b = result["arms"]["B"]["take_off"]
    assert b == {"first_step": {"1": 2}, "pending": {"2": 40}, "unlogged": [3], "took_off": 1, "of": 1,
                 "bimodal": False}  # fmt: skip
    assert take_off.describe_take_off("B", b) == (
        "B: took off in 1 of 1 seeds (1 at step 2); still training, not yet: 2 (step 40); no rollout/correct "
        "logged: 3"
    )
    a = result["arms"]["A"]["take_off"]
    assert a["first_step"] == {"1": None, "2": None, "3": 40} and a["bimodal"] is True
    # A is bimodal, but B − A pairs seed 1 alone (the seeds both scored), where A never took off.
    for c in result["comparisons"]["B"].values():
        assert c["seeds"] == [1] and c["bimodal"] == {} and c["bimodal_note"] is None


def test_report_shows_a_bimodal_arms_seeds_before_its_interval(tmp_path: Path) -> None:
    result = verdict.build(write_logs(experiment(tmp_path / "exp")), reps=200)
    md = rendering.markdown(result)
    assert "- B: took off in 2 of 3 seeds (1 at step 4, 2 at step 7; 3 never)" in md
    assert "- A: took off in 0 of 3 seeds (1, 2, 3 never)" in md
    # The arms: B's seeds come before the table of means and intervals.
    arms = md[md.index("## Arms") : md.index("## Against the baseline")]
    bimodal = arms.index(
        "- **B** is bimodal, its seeds first: took off in 2 of 3 seeds (1 at step 4, 2 at step 7; 3 never)"
    )
    assert bimodal < arms.index("| arm | seeds |")
    assert "**A** is bimodal" not in md
    per_seed = result["arms"]["B"]["per_seed"]
    assert f"1: {per_seed['1']['avg']:.2f} (took off at step 4)" in arms[bimodal:]
    assert f"3: {per_seed['3']['avg']:.2f} (never took off)" in arms[bimodal:]
    # The comparison: per seed with B's outcome, then the sentence, then the interval; no second per-seed line.
    section = md[md.index("### B − A") :]
    c = result["comparisons"]["B"]["accuracy"]
    d = {k: f"{v:+.2f}" for k, v in c["per_seed"].items()}
    first = (f"- accuracy, per seed first (an arm's outcome is bimodal): 1: {d['1']} (B took off at step 4), "
             f"2: {d['2']} (B took off at step 7), 3: {d['3']} (B never took off)")  # fmt: skip
    assert section.index(first) < section.index(c["bimodal_note"]) < section.index(f"- {c['verdict']}")
    assert "  - per seed:" not in section.split("## ")[0]
    # What the command prints: the take-off of each arm, then each comparison, its seeds first.
    lines = rendering.console_lines(result)
    assert lines[:2] == [
        "A: took off in 0 of 3 seeds (1, 2, 3 never)",
        "B: took off in 2 of 3 seeds (1 at step 4, 2 at step 7; 3 never)",
    ]
    assert lines[2:5] == [f"B − A: {first[2:]}", f"B − A: {c['bimodal_note']}", f"B − A: {c['verdict']}"]


def test_report_of_arms_that_are_not_bimodal_keeps_the_interval_first(tmp_path: Path) -> None:
    logs = {**LOGS, ("B", 3): records({1: 0.0, 2: 0.55})}  # B takes off in every seed
    result = verdict.build(write_logs(experiment(tmp_path / "exp"), logs), reps=200)
    assert result["arms"]["B"]["take_off"]["bimodal"] is False
    md = rendering.markdown(result)
    assert "per seed first" not in md and "** is bimodal" not in md and "spans both outcomes" not in md
    section = md[md.index("### B − A") :]
    c = result["comparisons"]["B"]["accuracy"]
    assert section.index(f"- {c['verdict']}") < section.index("  - per seed: ")
    assert rendering.console_lines(result)[2:] == [
        f"B − A: {c['verdict']}" for c in result["comparisons"]["B"].values()
    ]


def markers(fig) -> dict[tuple[str, str], dict[str, tuple]]:
    """{(panel title, gid): (xs, ys)} of the take-off markers drawn on `fig`."""
    out = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            if (line.get_gid() or "").startswith("take-off"):
                out[ax.get_title(), line.get_gid()] = (tuple(line.get_xdata()), tuple(line.get_ydata()))
    return out


def test_curves_mark_each_seeds_take_off_on_its_lines(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    result = verdict.build(write_logs(experiment(tmp_path / "exp")), reps=200)
    fig = rendering.draw_curves(result)
    try:
        got = markers(fig)
    finally:
        plt.close(fig)
    rollouts, loss = "training rollouts correct", "loss"
    assert got == {
        (rollouts, "take-off B 1"): ((4,), (0.5,)),
        (rollouts, "take-off B 2"): ((7,), (0.75,)),
        (loss, "take-off B 1"): ((4,), (pytest.approx(2 - 4 / 100),)),
        (loss, "take-off B 2"): ((8,), (pytest.approx(2 - 8 / 100),)),  # no loss at step 7: the next point
    }
    # The marker sits on the seed's own line: that line holds the marked point.
    fig = rendering.draw_curves(result)
    try:
        ax = next(a for a in fig.axes if a.get_title() == rollouts)
        lines = [
            tuple(zip(ln.get_xdata(), ln.get_ydata(), strict=True))
            for ln in ax.get_lines()
            if not ln.get_gid()
        ]
    finally:
        plt.close(fig)
    assert ((4, 0.5) in lines[3]) and ((7, 0.75) in lines[4])  # A's three lines, then B's seeds 1, 2, 3
    assert not any(math.isnan(y) or math.isinf(y) for line in lines for _, y in line)


# -- the threads of jobs side by side ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cores, jobs, processes, threads",
    [(16, 4, 1, "4"), (16, 3, 1, "5"), (16, 8, 2, "1"), (2, 7, 1, "1"), (64, 7, 1, "9"), (32, 2, 2, "8")],
)
def test_each_job_side_by_side_gets_its_share_of_the_cores(cores, jobs, processes, threads) -> None:
    env = schedule.thread_env({}, cores, jobs, processes)
    assert env == {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads}


def test_the_users_threads_stand_and_one_job_keeps_the_defaults() -> None:
    assert schedule.thread_env({"OMP_NUM_THREADS": "3"}, 16, 4) == {}
    assert schedule.thread_env({"MKL_NUM_THREADS": "2"}, 16, 4) == {
        "OMP_NUM_THREADS": "4",
        "OPENBLAS_NUM_THREADS": "4",
    }
    assert schedule.thread_env({}, 16, 1) == {}


def test_the_core_count_is_the_affinity_mask(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert schedule.cpu_cores() == 3
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 12)
    assert schedule.cpu_cores() == 12


def test_the_runner_gives_each_cell_its_share_of_the_injected_cores(tmp_path: Path, monkeypatch) -> None:
    for key in schedule.THREAD_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    sp = make_spec()
    # 4 GPUs, one per cell, 3 cells per GPU: 12 cells at once on 48 cores.
    runner = schedule.Runner(
        tmp_path, sp, schedule.make_slots(["0", "1", "2", "3"], 1, 3), schedule.RunSettings(cores=48)
    )
    env = runner.env(runner.slots[0])
    assert [env[k] for k in schedule.THREAD_VARIABLES] == ["4", "4", "4"]
    # 2 GPUs per cell, 2 cells per slot: 4 cells of 2 processes each on 48 cores.
    runner = schedule.Runner(
        tmp_path, sp, schedule.make_slots(["0", "1", "2", "3"], 2, 2), schedule.RunSettings(cores=48)
    )
    assert runner.env(runner.slots[1])["OMP_NUM_THREADS"] == "6"
    # One cell at a time: the libraries' own defaults.
    alone = schedule.Runner(tmp_path, sp, schedule.make_slots(["0"], 1, 1), schedule.RunSettings(cores=48))
    assert not set(schedule.THREAD_VARIABLES) & alone.env(alone.slots[0]).keys()
    # The user's OMP_NUM_THREADS stands.
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    runner = schedule.Runner(
        tmp_path, sp, schedule.make_slots(["0", "1"], 1, 4), schedule.RunSettings(cores=48)
    )
    env = runner.env(runner.slots[0])
    assert env["OMP_NUM_THREADS"] == "7" and "MKL_NUM_THREADS" not in env
