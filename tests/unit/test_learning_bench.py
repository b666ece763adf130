"""bench/learning.py's planning without running anything: the presets' runs, their checkpoints and sweeps, the
paired comparisons it asks for, and the means over seeds."""

from __future__ import annotations

import json

import pytest

from bench.learning import MATCHED, Runner, arm_means, merge_arms, parse_args, parse_arms, plan_arms


def test_the_controls_preset_plans_twelve_runs_two_of_them_longer():
    a = parse_args(["--preset", "controls"])
    assert (a.eval_dataset, a.eval_mode, a.out) == (
        "builtin:easy-disjoint",
        "sweep",
        "bench/results/controls_h200.json",
    )
    arms = plan_arms(a)
    settings = {(x.clip_mode, x.teacher_ref_pairing, x.seed) for x in arms}
    assert settings == {(m, p, s) for m in ("rescale", "element") for p in ("matched", "shuffled", "empty")
                        for s in (42, 43)}  # fmt: skip
    assert all(x.learning_rate == 1e-4 and x.beta == 0.0 for x in arms)
    long = [x for x in arms if x.steps == 300]
    # The horizon runs are the seed-42 matched runs, continued: one run each, scored at 100, 200 and 300.
    assert {(x.clip_mode, x.teacher_ref_pairing, x.seed) for x in long} == {("rescale", MATCHED, 42),
                                                                           ("element", MATCHED, 42)}  # fmt: skip
    for x in long:
        assert x.eval_steps == (100, 200, 300) and x.parts == ("main", "horizon") and x.save_steps == 100
    for x in arms:
        if x not in long:
            assert (x.steps, x.eval_steps, x.parts, x.save_steps) == (100, (100,), ("main",), 50)


def test_run_names_keep_the_learning_layout_and_name_the_pairing():
    (m, s, e) = parse_arms("element:0:1e-4,element:0:1e-4:shuffled,rescale:0.5:1e-5:empty", [42])
    assert (m.name, s.name, e.name) == ("element-b0-lr0.0001-s42", "element-b0-lr0.0001-s42-shuffled",
                                        "rescale-b0.5-lr1e-05-s42-empty")  # fmt: skip
    with pytest.raises(SystemExit, match="teacher_ref_pairing one of"):
        parse_arms("element:0:1e-4:random", [42])
    # The learning preset is what it was: seven settings, two seeds, evaluated one by one.
    a = parse_args([])
    assert a.eval_mode == "separate" and len(plan_arms(a)) == 14 and not a.horizon_arms


def test_merging_keeps_the_longer_run_and_every_scored_step():
    short = parse_arms("rescale:0:1e-4", [42], steps=100)
    longer = parse_arms("rescale:0:1e-4", [42], steps=300, eval_steps=(150, 300), part="horizon")
    (one,) = merge_arms(short + longer)
    assert (one.steps, one.eval_steps, one.parts, one.save_steps) == (
        300,
        (100, 150, 300),
        ("main", "horizon"),
        50,
    )


def test_commands_and_sweeps_of_the_controls_preset(tmp_path):
    a = parse_args(
        ["--preset", "controls", "--workdir", str(tmp_path), "--eval-limit", "20", "--eval-n", "4"]
    )
    arms = plan_arms(a)
    runner = Runner(a)
    runner.plan(arms)
    (main, main_cks), (horizon, horizon_cks) = runner.sweeps
    assert (main, len(main_cks), {s for _, s in main_cks}) == ("main", 12, {100})
    # The horizon sweep lists the first sweep's checkpoints too, so that each keeps its result name.
    assert horizon == "horizon" and horizon_cks[:12] == main_cks
    assert sorted((x.clip_mode, x.seed, s) for x, s in horizon_cks[12:]) == sorted(
        (m, 42, s) for m in ("rescale", "element") for s in (200, 300)
    )
    # Longest first: the horizon runs start before the others.
    assert [j.name for j in runner.queue[:2]] == [
        "train-rescale-b0-lr0.0001-s42",
        "train-element-b0-lr0.0001-s42",
    ]
    argv = next(j.argv for j in runner.queue if j.name == "train-element-b0-lr0.0001-s43-shuffled")
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert flags["--teacher_ref_pairing"] == "shuffled" and flags["--max_steps"] == "100"
    assert flags["--dataset_name"] == "builtin:easy" and flags["--learning_rate"] == "0.0001"
    sweep = runner.sweep_argv([runner.checkpoint(x, s) for x, s in main_cks])
    i = sweep.index("--dataset")
    assert sweep[i + 1] == "builtin:easy-disjoint" and "--merge-adapter" in sweep
    assert sweep[sweep.index("--limit") + 1] == "20" and sweep[sweep.index("--n") + 1] == "4"
    assert sweep[sweep.index("--checkpoints") + 1 :] == [str(runner.checkpoint(x, 100)) for x, _ in main_cks]


def test_comparisons_pair_each_checkpoint_with_the_base_and_its_matched_arm(tmp_path):
    a = parse_args(["--preset", "controls", "--workdir", str(tmp_path), "--arms", "rescale:0:1e-4:matched,"
                    "rescale:0:1e-4:empty", "--seeds", "42", "--horizon-arms", ""])  # fmt: skip
    arms = plan_arms(a)
    runner = Runner(a)
    runner.plan(arms)
    for d in [runner.base_dir] + [tmp_path / x.name for x in arms]:
        d.mkdir(parents=True)
        (d / "summary.json").write_text("{}")
    runner.eval_dirs = {(x.name, 100): tmp_path / x.name for x in arms}
    jobs = {j.name: j.argv for j in runner.compare_jobs(arms)}
    matched, empty = (tmp_path / x.name for x in arms)
    assert set(jobs) == {"compare-rescale-b0-lr0.0001-s42-100", "compare-rescale-b0-lr0.0001-s42-empty-100",
                         "compare-matched-rescale-b0-lr0.0001-s42-empty-100"}  # fmt: skip
    cmp = jobs["compare-matched-rescale-b0-lr0.0001-s42-empty-100"]
    assert cmp[cmp.index("--compare") + 1 :][:2] == [str(matched), str(empty)]
    (empty / "compare-matched").mkdir()
    (empty / "compare-matched" / "compare.json").write_text(json.dumps({}))
    assert "compare-matched-rescale-b0-lr0.0001-s42-empty-100" not in {
        j.name for j in runner.compare_jobs(arms)
    }


def _diff(mean: float) -> dict:
    return {"mean": mean, "se": 1.0, "ci_low": mean - 2, "ci_high": mean + 2}


def test_means_over_seeds_at_a_step():
    def row(seed, pairing, evals):
        return {"clip_mode": "rescale", "beta": 0.0, "learning_rate": 1e-4, "teacher_ref_pairing": pairing,
                "seed": seed, "probe_divergence": [[0, 0.1], [100, 0.03], [200, 0.02]], "evals": evals}  # fmt: skip

    rows = [
        row(42, "shuffled", [{"step": 100, "diff": _diff(2.0), "diff_format": _diff(6.0),
                              "vs_matched": {"diff": _diff(-1.0)}}]),
        row(43, "shuffled", [{"step": 100, "diff": _diff(4.0), "diff_format": _diff(8.0),
                              "vs_matched": {"diff": _diff(0.5)}}]),
        row(42, MATCHED, [{"step": 100, "diff": _diff(3.0)}, {"step": 200, "diff": _diff(5.0)}]),
    ]  # fmt: skip
    shuffled, matched = arm_means(rows, 100)
    assert (
        shuffled["seeds"] == [42, 43] and shuffled["diff_mean"] == 3.0 and shuffled["diff_format_mean"] == 7.0
    )
    assert shuffled["vs_matched_mean"] == -0.25 and shuffled["vs_matched_per_seed"] == [-1.0, 0.5]
    assert shuffled["probe_divergence_first_last"] == [0.1, 0.03]
    assert matched["diff_mean"] == 3.0 and "vs_matched_mean" not in matched
    (at_200,) = arm_means(rows[2:], 200)
    assert at_200["diff_mean"] == 5.0 and at_200["probe_divergence_first_last"] == [0.1, 0.02]
