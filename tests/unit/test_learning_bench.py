"""bench/learning.py without running anything: the arms and experiment command lines of each preset, the reports
it asks for, and the JSON rows and arms it builds from a synthetic experiment (its summary and samples)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from learning import (
    arm_entries,
    baselines,
    build_rows,
    experiment_argv,
    parse_args,
    parse_arms,
    report_argv,
)
from opsd.evaluation.metrics import summarize

RECIPE = (
    "CLIP_MODE={},BETA={},LEARNING_RATE={},TEACHER_REF_PAIRING={},MAX_COMPLETION_LENGTH={},PROBE_STEPS=10,"
    "VLLM_GPU_MEMORY_UTILIZATION=0.12"
)
SHARED_GPU = ["--cells-per-gpu", "16", "--kv-cache-gib", "1.5", "--status-every", "60",
              "--accelerate-config", "configs/accelerate/single_gpu.yaml"]  # fmt: skip


def test_the_learning_preset_is_one_experiment_of_seven_arms():
    a = parse_args(["--max-tokens", "256"])
    arms = parse_arms(a.arms)
    assert (a.out, a.eval_dataset, a.seeds) == ("bench/results/learning_h200.json", "builtin:easy", "42,43")
    settings = [("element", "0", "0.0001"), ("token", "0", "0.0001"), ("rescale", "0", "0.0001"),
                ("none", "0", "0.0001"), ("none", "0.5", "0.0001"), ("rescale", "0.5", "0.0001"),
                ("element", "0", "1e-05")]  # fmt: skip
    names = ["element-b0-lr0.0001", "token-b0-lr0.0001", "rescale-b0-lr0.0001", "none-b0-lr0.0001",
             "none-b0.5-lr0.0001", "rescale-b0.5-lr0.0001", "element-b0-lr1e-05"]  # fmt: skip
    argv = experiment_argv(a, arms, Path("/w/learning"))
    assert argv == [
        sys.executable, "-m", "opsd.experiment", "--out", "/w/learning", "--profile", "full", "--model", "embedded",
        "--dataset", "builtin:easy", "--recipe", "",
        *[x for name, (m, b, lr) in zip(names, settings, strict=True)
          for x in ("--arm", f"{name}={RECIPE.format(m, b, lr, 'matched', 256)}")],
        "--seeds", "42,43", "--eval-flags", "--dataset builtin:easy --n 8 --max-tokens 256 --max-model-len 1024 "
        "--no-thinking --gpu-memory-utilization 0.12", *SHARED_GPU,
    ]  # fmt: skip
    # No control: one report, against the first arm (the experiment's default baseline).
    assert baselines(arms) == ["element-b0-lr0.0001"]


def test_the_controls_preset_pairs_each_control_with_its_matched_arm():
    a = parse_args(["--preset", "controls", "--workdir", "/w"])
    arms = parse_arms(a.arms)
    assert (a.out, a.eval_dataset) == ("bench/results/controls_h200.json", "builtin:easy-disjoint")
    argv = experiment_argv(a, arms, Path("/w/controls"))
    got = [argv[i + 1] for i, x in enumerate(argv) if x == "--arm"]
    assert got == [
        f"rescale-b0-lr0.0001={RECIPE.format('rescale', 0, '0.0001', 'matched', 128)}",
        f"rescale-b0-lr0.0001-shuffled={RECIPE.format('rescale', 0, '0.0001', 'shuffled', 128)}",
        f"rescale-b0-lr0.0001-empty={RECIPE.format('rescale', 0, '0.0001', 'empty', 128)}",
        f"element-b0-lr0.0001={RECIPE.format('element', 0, '0.0001', 'matched', 128)}",
        f"element-b0-lr0.0001-shuffled={RECIPE.format('element', 0, '0.0001', 'shuffled', 128)}",
        f"element-b0-lr0.0001-empty={RECIPE.format('element', 0, '0.0001', 'empty', 128)}",
    ]
    assert argv[argv.index("--eval-flags") + 1] == (
        "--dataset builtin:easy-disjoint --n 8 --max-tokens 128 --max-model-len 1024 --no-thinking "
        "--gpu-memory-utilization 0.12"
    )
    assert argv[-len(SHARED_GPU) :] == SHARED_GPU
    # The first arm's report (every arm against the base model), then one per matched arm of a control.
    assert baselines(arms) == ["rescale-b0-lr0.0001", "element-b0-lr0.0001"]
    assert report_argv(Path("/w/controls"), "element-b0-lr0.0001") == [
        sys.executable, "-m", "opsd.experiment", "report", "/w/controls", "--baseline", "element-b0-lr0.0001",
    ]  # fmt: skip
    # A control whose matched arm is not in the experiment has no report of its own.
    assert baselines(parse_arms("none:0:1e-4:empty,rescale:0:1e-4,rescale:0:1e-4:shuffled")) == [
        "none-b0-lr0.0001-empty",
        "rescale-b0-lr0.0001",
    ]


def test_flags_shrink_the_experiment_and_pass_through():
    a = parse_args(["--preset", "controls", "--profile", "smoke", "--model", "/m", "--max-tokens", "8",
                    "--probe-steps", "50", "--eval-n", "2", "--eval-limit", "3", "--eval-engine", "transformers",
                    "--cells-per-gpu", "1", "--kv-cache-gib", "0", "--accelerate-config", "", "--seeds", "42",
                    "--arms", "rescale:0:1e-4", "--", "--gpus", "0", "--retries", "0"])  # fmt: skip
    argv = experiment_argv(a, parse_arms(a.arms), Path("/w/controls"))
    assert argv[3:] == [
        "--out", "/w/controls", "--profile", "smoke", "--model", "/m", "--dataset", "builtin:easy", "--recipe", "",
        "--arm", "rescale-b0-lr0.0001=CLIP_MODE=rescale,BETA=0,LEARNING_RATE=0.0001,TEACHER_REF_PAIRING=matched,"
        "MAX_COMPLETION_LENGTH=8,PROBE_STEPS=50,VLLM_GPU_MEMORY_UTILIZATION=0.12", "--seeds", "42",
        "--eval-flags", "--dataset builtin:easy-disjoint --n 2 --max-tokens 8 --max-model-len 1024 --no-thinking "
        "--gpu-memory-utilization 0.12 --limit 3 --engine transformers",
        "--cells-per-gpu", "1", "--kv-cache-gib", "0", "--status-every", "60", "--gpus", "0", "--retries", "0",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "text",
    ["element:0", "element:0:1e-4:shuffled:x", "random:0:1e-4", "element:0:1e-4:random", "element:x:1e-4",
     "element:0:1e-4,element:0:1e-4", ""],
)  # fmt: skip
def test_bad_arms_are_refused(text):
    with pytest.raises(SystemExit, match="--arms"):
        parse_arms(text)


# -- the JSON from a synthetic experiment ------------------------------------------------------------------------

M, SH = "rescale-b0-lr0.0001", "rescale-b0-lr0.0001-shuffled"


def samples(where: Path, correct: list[list[int]], boxed: list[list[int]]) -> None:
    """samples.jsonl of 3 problems x 2 samples and the summary.json that eval_aime.py writes beside it."""
    where.mkdir(parents=True)
    records = [{"id": f"p{p}", "idx": i, "correct": bool(c), "has_box": bool(boxed[p][i]), "n_tokens": 10,
                "truncated": False, "extracted": "1" if c else None, "gold": "1"}
               for p, row in enumerate(correct) for i, c in enumerate(row)]  # fmt: skip
    per_problem = {f"p{p}": [r for r in records if r["id"] == f"p{p}"] for p in range(len(correct))}
    (where / "summary.json").write_text(json.dumps({"metrics": summarize(per_problem)}))
    (where / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def comparison(per_seed: dict) -> dict:
    return {
        "per_seed": per_seed,
        "interval": {"estimate": 1.0},
        "verdict": "v",
        "bootstrap": {},
        "mde_80": 1.0,
    }


@pytest.fixture
def experiment(tmp_path):
    """Arms rescale matched and shuffled, seeds 42 and 43; shuffled/43 failed to train."""
    d = tmp_path / "controls"
    for seed in (42, 43):  # the base model, scored with each seed's sampling seeds
        samples(d / "evals" / "base" / f"seed{seed}", [[0, 0], [0, 0], [0, 0]], [[1, 0], [0, 0], [0, 0]])
    for seed in (42, 43):
        samples(d / "evals" / M / f"seed{seed}" / "checkpoint-100", [[1, 1], [1, 0], [0, 0]],
                [[1, 1], [1, 1], [0, 1]])  # fmt: skip
    samples(
        d / "evals" / SH / "seed42" / "checkpoint-100", [[1, 0], [0, 0], [0, 0]], [[1, 1], [1, 1], [0, 1]]
    )
    trained = {"avg": 50.0, "pass_at_k": 66.7, "maj": 33.3, "format_rate": 83.3}
    summary = {
        "baseline": M, "base": {"avg": 0.0, "pass_at_k": 0.0, "maj": 0.0, "format_rate": 16.7},
        "base_per_seed": {s: {"avg": 0.0, "pass_at_k": 0.0, "maj": 0.0, "format_rate": 16.7} for s in ("42", "43")},
        "seeds_planned": [42, 43],
        "arms": {
            M: {"per_seed": {"42": trained, "43": trained}, "missing": {},
                "vs_base": {"accuracy": comparison({"42": 50.0, "43": 50.0})}},
            SH: {"per_seed": {"42": {**trained, "avg": 16.7}}, "missing": {"43": "train failed (2 attempts)"},
                 "vs_base": {"accuracy": comparison({"42": 16.7})}},
        },
        "comparisons": {SH: {"accuracy": comparison({"42": -33.3})}},
        "curves": {M: {"42": {"loss": [[1, 0.5], [2, 0.4]], "probe/divergence": [[0, 0.1], [10, 0.05]]},
                       "43": {"loss": [[1, 0.5]], "probe/divergence": [[0, 0.2], [10, 0.15]]}}},
    }  # fmt: skip
    return d, summary


T2 = 4.302652729749464  # Student's t, 97.5% quantile, 2 degrees of freedom (3 problems)


def interval(diffs: list[float]) -> dict:
    """Hand-computed paired t interval over problems of per-problem differences in points."""
    mean = sum(diffs) / 3
    se = (sum((x - mean) ** 2 for x in diffs) / 2) ** 0.5 / 3**0.5
    return {"mean": mean, "se": se, "ci_low": mean - T2 * se, "ci_high": mean + T2 * se}


def test_rows_pair_each_cell_with_the_base_and_its_matched_arm(experiment):
    d, summary = experiment
    arms = parse_arms("rescale:0:1e-4,rescale:0:1e-4:shuffled")
    rows = build_rows(d, arms, summary)
    assert [r["name"] for r in rows] == [f"{M}-s42", f"{M}-s43", f"{SH}-s42", f"{SH}-s43"]
    m42, m43, s42, s43 = rows
    assert (m42["clip_mode"], m42["beta"], m42["learning_rate"], m42["seed"]) == ("rescale", 0.0, 1e-4, 42)
    assert (m42["steps_done"], m43["steps_done"], s42["steps_done"]) == (2, 1, 0)
    assert m42["probe_divergence"] == [[0, 0.1], [10, 0.05]] and s42["probe_divergence"] == []
    assert m42["base"] == {"avg": 0.0, "format": 16.7}
    (e,) = m42["evals"]
    assert e["step"] == 100 and e["trained"]["avg"] == 50.0 and e["trained"]["format"] == 83.3
    # Per problem, the matched cell's mean minus the base's, in points: accuracy 100, 50, 0; format 50, 100, 50.
    assert e["diff"] == pytest.approx(interval([100, 50, 0]))
    assert e["diff_format"] == pytest.approx(interval([50, 100, 50]))
    assert m42["diff"] == e["diff"] and "vs_matched" not in e
    # The shuffled cell: accuracy 50, 0, 0 against the base; 50 - 100, 0 - 50, 0 - 0 against the matched cell.
    (e,) = s42["evals"]
    assert e["diff"] == pytest.approx(interval([50, 0, 0]))
    assert e["vs_matched"]["diff"] == pytest.approx(interval([-50, -50, 0]))
    # Identical per-problem differences: their spread is unknown, so no interval.
    assert e["vs_matched"]["diff_format"] == {"mean": 0.0, "se": 0.0, "ci_low": None, "ci_high": None}
    assert "evals" not in s43 and s43["missing"] == "train failed (2 attempts)"


def test_arms_carry_the_experiments_verdicts(experiment):
    d, summary = experiment
    arms = parse_arms("rescale:0:1e-4,rescale:0:1e-4:shuffled")
    rows = build_rows(d, arms, summary)
    matched, shuffled = arm_entries(arms, rows, {M: summary})
    assert matched["arm"] == M and matched["seeds"] == [42, 43] and shuffled["seeds"] == [42]
    kept = {"per_seed", "interval", "verdict"}
    assert matched["vs_base"]["accuracy"] == {"per_seed": {"42": 50.0, "43": 50.0}, "interval": {"estimate": 1.0},
                                              "verdict": "v"}  # fmt: skip
    assert set(shuffled["vs_matched"]["accuracy"]) == kept
    assert shuffled["vs_matched"]["accuracy"]["per_seed"] == {"42": -33.3} and "vs_matched" not in matched
    assert matched["probe_divergence_first_last"] == pytest.approx([0.15, 0.1])
    assert "probe_divergence_first_last" not in shuffled
