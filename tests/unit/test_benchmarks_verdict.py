"""The experiment's verdict with `--benchmarks` in its evaluation flags (opsd.experiment.verdict): per benchmark as
for one table, and on the macro average, on synthetic experiment directories laid out as eval_aime.py writes a
--benchmarks evaluation. Every number is recomputed here in plain Python (t quantiles typed from a table)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from opsd.evaluation.metrics import summarize
from opsd.experiment import cells as C
from opsd.experiment import rendering, spec, verdict
from tests.unit.test_experiment import lay_out_experiment, make_spec, mean, points, var1

T975 = {1: 12.706205, 2: 4.302653}  # two-sided 95% Student t quantiles, from a table
BENCHES = {"aime24": 3, "hmmt25": 2}  # problems per benchmark: unequal, so the macro is not the pooled mean
N = 4
SEEDS = (1, 2, 3)
LIFT = {"base": 0.1, "A": 0.3, "B": 0.55}  # chance that a sample is correct


def within_var(a_table, b_table=None) -> float:
    """(100^2 / P^2) * sum_p var_i(b_pi - a_pi, ddof=1) / n (or of a_pi alone)."""
    rows = a_table if b_table is None else [[b - a for a, b in zip(x, y, strict=True)] for x, y in zip(a_table, b_table, strict=True)]  # fmt: skip
    return 100.0**2 * sum(var1(r) / len(r) for r in rows) / len(rows) ** 2


def correct(cell: str, seed: int, bench: str) -> list[list[int]]:
    rng = random.Random(f"{cell}-{seed}-{bench}")
    return [[int(rng.random() < LIFT[cell]) for _ in range(N)] for _ in range(BENCHES[bench])]


def write_eval(where: Path, cell: str, seed: int) -> None:
    """One --benchmarks evaluation: DIR/NAME/samples.jsonl and summary.json per benchmark, then DIR/benchmarks.json."""
    for bench in BENCHES:
        records = [
            {"id": f"{bench}-{p}", "idx": i, "problem_index": p, "request_seed": i, "text": "...",
             "extracted": "1" if c else "2", "correct": bool(c), "has_box": True, "n_tokens": 10, "truncated": False,
             "gold": "1"}
            for p, row in enumerate(correct(cell, seed, bench)) for i, c in enumerate(row)
        ]  # fmt: skip
        per_problem: dict[str, list[dict]] = {}
        for r in records:
            per_problem.setdefault(r["id"], []).append(r)
        (where / bench).mkdir(parents=True)
        (where / bench / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        (where / bench / "summary.json").write_text(
            json.dumps({"config": {"n": N}, "metrics": summarize(per_problem)})
        )
    (where / "benchmarks.json").write_text(json.dumps({"benchmarks": list(BENCHES)}))


def experiment(directory: Path, scored_seeds=SEEDS) -> Path:
    """A synthetic --benchmarks experiment (`lay_out_experiment`): every cell trained, scored for `scored_seeds`."""
    sp = make_spec(seeds=SEEDS, eval_flags=["--benchmarks", ",".join(BENCHES)])
    unscored = {(arm, seed): 100 for arm in sp.arms for seed in SEEDS if seed not in scored_seeds}
    return lay_out_experiment(directory, sp, write_eval, unscored=unscored)


def macro_points(cell: str, seed: int) -> float:
    return mean(points(correct(cell, seed, b)) for b in BENCHES)


def test_verdict_per_benchmark_and_on_the_macro_average(tmp_path: Path) -> None:
    directory = experiment(tmp_path / "exp")
    sp = spec.load(directory)
    assert C.spec_benchmarks(sp) == ["aime24", "hmmt25"] and C.declared_step(sp) == 100
    assert C.base_scored(directory, 1) and list(C.scored_steps(spec.eval_dir(directory, "A", 1))) == [100]
    assert C.count_samples(spec.eval_dir(directory, "A", 1)) == N * sum(BENCHES.values())
    C.check_directory(directory, sp)

    result = verdict.build(directory, target_diff=10.0, reps=300)
    # Each benchmark's table is the one-table verdict of that benchmark.
    for bench in BENCHES:
        t = result["benchmarks"][bench]
        diffs = [points(correct("B", s, bench)) - points(correct("A", s, bench)) for s in SEEDS]
        comp = t["comparisons"]["B"]["accuracy"]
        assert comp["per_seed"] == {str(s): pytest.approx(d) for s, d in zip(SEEDS, diffs, strict=True)}
        assert (
            comp["interval"]["method"] == "seed-paired t"
            and comp["bootstrap"]["method"] == "hierarchical bootstrap"
        )
        assert t["arms"]["A"]["per_seed"]["2"]["avg"] == pytest.approx(points(correct("A", 2, bench)))
        assert t["base"]["avg"] == pytest.approx(mean(points(correct("base", s, bench)) for s in SEEDS))
    # The macro: per seed, the mean over benchmarks (each weighs alike), then the seed-paired t over seeds.
    a_avgs = [macro_points("A", s) for s in SEEDS]
    assert [result["arms"]["A"]["per_seed"][str(s)]["avg"] for s in SEEDS] == pytest.approx(a_avgs)
    assert result["arms"]["A"]["mean"]["avg"]["mean"] == pytest.approx(mean(a_avgs))
    assert result["arms"]["A"]["mean"]["avg"]["se"] == pytest.approx(math.sqrt(var1(a_avgs) / 3))
    diffs = [macro_points("B", s) - macro_points("A", s) for s in SEEDS]
    comp = result["comparisons"]["B"]["accuracy"]
    assert comp["per_seed"] == {str(s): pytest.approx(d) for s, d in zip(SEEDS, diffs, strict=True)}
    half = T975[2] * math.sqrt(var1(diffs) / 3)
    iv = comp["interval"]
    assert iv["method"] == "seed-paired t" and iv["df"] == 2
    assert (iv["estimate"], iv["low"], iv["high"]) == pytest.approx(
        (mean(diffs), mean(diffs) - half, mean(diffs) + half), abs=1e-4
    )
    assert comp["bootstrap"] is None and comp["verdict"].startswith("macro accuracy: ")
    # Its variance split: the within-seed part of a mean of two independent benchmarks is (W_1 + W_2) / 2^2.
    within = mean(sum(within_var(correct("A", s, b), correct("B", s, b)) for b in BENCHES) / 4 for s in SEEDS)
    assert comp["variance"]["within_var"] == pytest.approx(within)
    assert comp["variance"]["total_var"] == pytest.approx(var1(diffs))
    # Against the base model, the macro of each seed's differences.
    base_diffs = [macro_points("B", s) - macro_points("base", s) for s in SEEDS]
    vs = result["arms"]["B"]["vs_base"]["accuracy"]
    assert vs["per_seed"] == {str(s): pytest.approx(d) for s, d in zip(SEEDS, base_diffs, strict=True)}
    assert result["base"]["avg"] == pytest.approx(mean(macro_points("base", s) for s in SEEDS))

    md = rendering.markdown(result)
    assert "Benchmarks: aime24, hmmt25." in md and "## Per benchmark" in md and "### aime24" in md
    assert "macro accuracy:" in md and result["step"] == 100 and json.loads(json.dumps(result)) == result


def test_one_common_seed_gives_the_macro_of_the_per_benchmark_intervals(tmp_path: Path) -> None:
    directory = experiment(tmp_path / "exp", scored_seeds=(2,))
    comp = verdict.build(directory, reps=200)["comparisons"]["B"]["accuracy"]
    assert comp["seeds"] == [2]
    # Per benchmark: the paired t over its problems; combined: mean, SE = sqrt(SE_1^2 + SE_2^2) / 2, and the
    # Welch-Satterthwaite df (SE_1^2 + SE_2^2)^2 / (SE_1^4 / 2 + SE_2^4 / 1).
    parts = []
    for bench in BENCHES:
        d = [
            100 * (mean(b) - mean(a))
            for a, b in zip(correct("A", 2, bench), correct("B", 2, bench), strict=True)
        ]
        parts.append((mean(d), math.sqrt(var1(d) / len(d)), len(d) - 1))
    iv = comp["interval"]
    assert iv["method"] == "macro of paired t over problems" and iv["n_seeds"] == 1
    assert iv["estimate"] == pytest.approx(mean(p[0] for p in parts))
    assert iv["se"] == pytest.approx(math.sqrt(sum(p[1] ** 2 for p in parts)) / 2)
    df = sum(p[1] ** 2 for p in parts) ** 2 / sum(p[1] ** 4 / p[2] for p in parts if p[1] > 0)
    assert iv["df"] == round(df)
    assert "one seed" in comp["verdict"]
