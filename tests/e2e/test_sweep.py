"""eval_aime.py --checkpoints (sweeps), Hub adapters and the progress line, with the real vLLM CPU engine.

The run directory holds two LoRA checkpoints of one short training run on the tiny model: it learns to
answer our three problems with `\\boxed{7}`, `\\boxed{8}` or `I am not sure.` (as tests/e2e/test_eval.py's
"boxer"), saved after 10 and 200 steps, so base, checkpoint-10 and checkpoint-200 sample differently and
score differently. The reference for a sweep is three separate evaluations of the same settings; the
table is recomputed here from samples.jsonl. Engine starts: 3 (references) + 1 (sweep) + 2 (killed sweep,
rerun).
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import conftest
from tests.conftest import (
    BOXER_PROBLEMS,
    EVAL_ENV,
    PNG_SIGNATURE,
    eval_in_process,
    kill_eval_at,
    ok,
    train_boxer,
)

PROBLEMS = BOXER_PROBLEMS
STEPS = (10, 200)
N = 12
T975 = {2: 4.302652729911275}  # Student t, 97.5% quantile, by degrees of freedom (3 problems: df 2)


def run_eval(*args, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return conftest.run_eval(*args, timeout=timeout, env=env)


def samples(out: Path) -> dict[tuple[str, int], dict]:
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    keyed = {(r["id"], r["idx"]): r for r in rows}
    assert len(keyed) == len(rows)
    return keyed


@pytest.fixture(scope="module")
def run_dir(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(base model, problems file, run directory with checkpoint-10, checkpoint-200 and an unfinished
    checkpoint-300 that lacks the .complete mark)."""
    root = tmp_path_factory.mktemp("sweep")
    problems = root / "three.jsonl"
    problems.write_text(
        "".join(json.dumps({"id": i, "problem": p, "answer": a}) + "\n" for i, p, a in PROBLEMS)
    )
    base_dir, run = root / "base", root / "run"
    train_boxer(tiny_model_dir, base_dir, {step: run / f"checkpoint-{step}" for step in STEPS})
    for step in STEPS:
        (run / f"checkpoint-{step}" / ".complete").touch()
    shutil.copytree(run / "checkpoint-200", run / "checkpoint-300")  # a save still in progress: no mark
    (run / "checkpoint-300" / ".complete").unlink()
    return base_dir, problems, run


def common(run_dir) -> list:
    base_dir, problems, _ = run_dir
    # One request in the engine at a time: every run schedules identically, and a kill lands mid-checkpoint.
    return ["--model", base_dir, "--dataset", problems, "--n", N, "--max-tokens", 16, "--max-model-len", 512,
            "--max-in-flight", 1]  # fmt: skip


@pytest.fixture(scope="module")
def evaluations(
    run_dir, tmp_path_factory
) -> tuple[dict[str, Path], tuple[Path, subprocess.CompletedProcess]]:
    """(separate, sweep): the reference, base, checkpoint-10 and checkpoint-200 each scored by its own
    eval_aime.py call, and the sweep of the run directory. The four calls are independent processes of one
    OpenMP thread each: two run at a time."""
    root = tmp_path_factory.mktemp("separate")
    out = tmp_path_factory.mktemp("sweep-out") / "sweep"
    outs = {"base": root / "base"}
    calls = {"base": [*common(run_dir), "--out", outs["base"]]}
    for step in STEPS:
        name = f"checkpoint-{step}"
        outs[name] = root / name
        calls[name] = [*common(run_dir), "--adapter", run_dir[2] / name, "--out", outs[name]]
    with ThreadPoolExecutor(2) as pool:
        swept = pool.submit(run_eval, *common(run_dir), "--checkpoints", run_dir[2], "--out", out)
        done = [pool.submit(run_eval, *args) for args in calls.values()]
        for proc in [swept, *done]:
            ok(proc.result())
    return outs, (out, swept.result())


@pytest.fixture(scope="module")
def separate(evaluations) -> dict[str, Path]:
    """The reference: base, checkpoint-10 and checkpoint-200 each scored by its own eval_aime.py call."""
    return evaluations[0]


@pytest.fixture(scope="module")
def sweep(evaluations) -> tuple[Path, subprocess.CompletedProcess]:
    return evaluations[1]


@pytest.mark.slow
def test_sweep_draws_the_samples_of_separate_evaluations_with_one_engine(sweep, separate):
    out, proc = sweep
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["base", "checkpoint-10", "checkpoint-200"]
    got = {name: samples(out / name) for name in separate}
    want = {name: samples(path) for name, path in separate.items()}
    for name in separate:
        assert len(got[name]) == 3 * N
        assert got[name] == want[name], name  # every field: text, seed, grading, prompt
    # The checkpoints change what is sampled, so the comparison above could fail.
    texts = {name: [got[name][k]["text"] for k in sorted(got[name])] for name in got}
    assert texts["base"] != texts["checkpoint-10"] != texts["checkpoint-200"] != texts["base"]
    assert not any(r["has_box"] for r in got["base"].values())  # only the adapters box
    assert any(r["has_box"] for r in got["checkpoint-200"].values())

    sweep_json = json.loads((out / "sweep.json").read_text())
    assert sweep_json["engine_starts"] == 1 and sweep_json["weight_loads"] == 2
    assert [e["name"] for e in sweep_json["evaluations"]] == ["base", "checkpoint-10", "checkpoint-200"]
    for name, ref in separate.items():
        mine = json.loads((out / name / "eval_config.json").read_text())
        theirs = json.loads((ref / "eval_config.json").read_text())
        assert {k: v for k, v in mine.items() if k != "out"} == {
            k: v for k, v in theirs.items() if k != "out"
        }
    summary = json.loads((out / "checkpoint-200" / "summary.json").read_text())
    assert summary["adapter_mode"] == "merged" and summary["step"] == 200
    assert f"{3 * N}/{3 * N} samples" in proc.stderr  # the progress line of every evaluation
    assert "checkpoint-300" in proc.stderr and not (out / "checkpoint-300").exists()  # incomplete: skipped


def _rate(values):
    return 100 * statistics.mean(values), 100 * statistics.stdev(values) / math.sqrt(len(values))


@pytest.mark.slow
def test_sweep_table_and_curve_match_a_hand_computation(sweep):
    out, _ = sweep
    per_problem = {}
    for name in ("base", "checkpoint-10", "checkpoint-200"):
        by_id: dict[str, list[dict]] = {}
        for r in samples(out / name).values():
            by_id.setdefault(r["id"], []).append(r)
        per_problem[name] = {pid: rows for pid, rows in sorted(by_id.items())}
    table = {row["name"]: row for row in json.loads((out / "sweep.json").read_text())["rows"]}
    with (out / "sweep.csv").open() as f:
        csv_rows = {row["name"]: row for row in csv.DictReader(f)}
    md = (out / "sweep.md").read_text()
    for name, groups in per_problem.items():
        acc = {pid: sum(r["correct"] for r in g) / N for pid, g in groups.items()}
        for key, field in (("avg", "correct"), ("format_rate", "has_box"), ("truncation_rate", "truncated")):
            value, se = _rate([sum(r[field] for r in g) / N for g in groups.values()])
            assert table[name][key] == pytest.approx(value), (name, key)
            assert table[name][f"{key}_se"] == pytest.approx(se), (name, key)
            assert float(csv_rows[name][key]) == pytest.approx(value)
        assert f"| {name} |" in md
        if name == "base":
            assert table[name]["vs_base"] is None and csv_rows[name]["diff_vs_base"] == ""
            base_acc = acc
            continue
        diffs = [100 * (acc[p] - base_acc[p]) for p in acc]
        mean, se = statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
        vs = table[name]["vs_base"]
        assert vs["mean_diff"] == pytest.approx(mean) and vs["se"] == pytest.approx(se)
        assert vs["ci_low"] == pytest.approx(mean - T975[2] * se)
        assert vs["ci_high"] == pytest.approx(mean + T975[2] * se)
        assert float(csv_rows[name]["diff_ci_high"]) == pytest.approx(mean + T975[2] * se)
    assert table["checkpoint-200"]["vs_base"]["mean_diff"] > 0  # it learned to box 7 and 8

    curve = json.loads((out / "accuracy_vs_step.json").read_text())
    assert [(p["step"], p["avg"]) for p in curve] == [(0, table["base"]["avg"]), (10, table["checkpoint-10"]["avg"]),
                                                      (200, table["checkpoint-200"]["avg"])]  # fmt: skip
    assert (out / "accuracy_vs_step.png").read_bytes()[:8] == PNG_SIGNATURE

    # --compare reads the sweep's result directories unchanged and agrees with the table.
    proc = ok(run_eval("--compare", out / "base", out / "checkpoint-200"))
    vs = table["checkpoint-200"]["vs_base"]
    assert f"b - a = {vs['mean_diff']:+.2f} points" in proc.stdout


@pytest.mark.slow
def test_killed_sweep_resumes_per_checkpoint_and_per_sample(run_dir, separate, tmp_path):
    out = tmp_path / "sweep"
    args = [*common(run_dir), "--checkpoints", run_dir[2], "--out", out]
    partial = out / "checkpoint-200" / "samples.jsonl"
    kill_eval_at(args, tmp_path / "killed.log", partial, 2, seconds=400, poll=0.005)
    kept = partial.read_bytes()
    done = kept.count(b"\n")
    assert 2 <= done < 3 * N, "the kill must land inside the last checkpoint"
    finished = {name: {f: (out / name / f).read_bytes() for f in ("samples.jsonl", "summary.json")}
                for name in ("base", "checkpoint-10")}  # fmt: skip
    assert not (out / "checkpoint-200" / "summary.json").exists()

    rerun = ok(run_eval(*args))
    for name, files in finished.items():  # finished evaluations are skipped, nothing rewritten
        for f, data in files.items():
            assert (out / name / f).read_bytes() == data, (name, f)
        assert f"{name} is complete; skipped" in rerun.stderr
    assert partial.read_bytes().startswith(kept[: kept.rfind(b"\n") + 1])
    summary = json.loads((out / "checkpoint-200" / "summary.json").read_text())
    assert summary["new_samples"] == 3 * N - done
    for name, ref in separate.items():  # equal to the uninterrupted, separate evaluations
        assert samples(out / name) == samples(ref), name
    sweep_json = json.loads((out / "sweep.json").read_text())
    assert sweep_json["engine_starts"] == 1
    assert [e["sampled"] for e in sweep_json["evaluations"]] == [False, False, True]


# --- benchmarks: base and a checkpoint on three benchmarks with one engine start --------------------------------

BENCH_DATA = Path(__file__).resolve().parents[1] / "data" / "benchmarks"
BENCHES = ("aime25", "hmmt25", "math500")
# The gold answers of the fixtures, valued by hand: each benchmark writes 7, 8 and 9 in its own style.
GOLD_VALUE = {"7": 7, "8": 8, "9": 9, "\\frac{14}{2}": 7, "2^{3}": 8, "\\sqrt{81}": 9, "8\\text{ cm}": 8}


def _hand_row(rows: list[dict], n: int) -> dict:
    """A benchmark's numbers recomputed from its samples.jsonl rows with plain Python."""
    from math import comb

    by_id: dict[str, list[dict]] = {}
    for r in rows:
        by_id.setdefault(r["id"], []).append(r)
    groups = list(by_id.values())
    out = {"acc": {pid: sum(r["correct"] for r in g) / n for pid, g in by_id.items()}}
    for key, field in (("avg", "correct"), ("format_rate", "has_box"), ("truncation_rate", "truncated")):
        out[key] = _rate([sum(r[field] for r in g) / n for g in groups])
    out["mean_tokens"] = statistics.mean(statistics.mean(r["n_tokens"] for r in g) for g in groups)
    out["pass"] = [_rate([1 - comb(n - sum(r["correct"] for r in g), k) / comb(n, k) for g in groups])[0]
                   for k in range(1, n + 1)]  # fmt: skip
    return out


@pytest.mark.slow
def test_benchmarks_of_base_and_checkpoint_in_one_engine_start(run_dir, tmp_path):
    """--benchmarks with a sweep: three local benchmark copies (real columns, answer styles: integers, LaTeX
    expressions, a unit), the base model and checkpoint-200, one vLLM start; every number of the tables
    recomputed from samples.jsonl."""
    from scipy import stats

    base_dir, _, run = run_dir
    out = tmp_path / "bench"
    copies = ",".join(f"{b}={BENCH_DATA / f'{b}.jsonl'}" for b in BENCHES)
    proc = ok(run_eval("--model", base_dir, "--checkpoints", run / "checkpoint-200", "--benchmarks", ",".join(BENCHES),
                       "--dataset", copies, "--n", 4, "--max-tokens", 16, "--max-model-len", 512, "--out", out))  # fmt: skip
    sweep = json.loads((out / "benchmarks.json").read_text())
    assert (
        sweep["engine_starts"] == 1 and sweep["weight_loads"] == 1
    )  # base, then the checkpoint merged in place
    assert sweep["declared"]["name"] == "checkpoint-200" and sweep["declared"]["step"] == 200
    assert sweep["protocol"] == {b: {"n": 4, "max_tokens": 16, "thinking": True} for b in BENCHES}

    hand: dict[str, dict[str, dict]] = {}
    for model in ("base", "checkpoint-200"):
        table = json.loads((out / model / "benchmarks.json").read_text())
        assert table["benchmarks"] == list(BENCHES)
        hand[model] = {}
        for b, row in zip(BENCHES, table["rows"], strict=True):
            rows = list(samples(out / model / b).values())
            assert len(rows) == 3 * 4
            for r in rows:  # expression answers graded by value
                value = GOLD_VALUE[r["gold"]]
                assert r["correct"] == (r["extracted"] is not None and r["extracted"] == str(value)), r
            config = json.loads((out / model / b / "eval_config.json").read_text())
            assert config["benchmark"] == b and config["dataset_revision"] is None
            assert config["dataset_source"] == str(BENCH_DATA / f"{b}.jsonl") and config["n"] == 4
            h = hand[model][b] = _hand_row(rows, 4)
            assert row["benchmark"] == b and row["n_problems"] == 3 and row["label"] == "avg@4"
            for key in ("avg", "format_rate", "truncation_rate"):
                assert (row[key], row[f"{key}_se"]) == pytest.approx(h[key]), (model, b, key)
            assert row["mean_tokens"] == pytest.approx(h["mean_tokens"])
            assert [p["value"] for p in row["pass_at_k_curve"]] == pytest.approx(h["pass"])
            assert [p["k"] for p in row["pass_at_k_curve"]] == [1, 2, 3, 4]
        # The macro average: the mean of the three, SE = sqrt(sum of squared SEs) / 3.
        avgs = [hand[model][b]["avg"] for b in BENCHES]
        macro = table["macro"]["avg"]
        assert macro["value"] == pytest.approx(statistics.mean(a for a, _ in avgs))
        assert macro["se"] == pytest.approx(math.sqrt(sum(se**2 for _, se in avgs)) / 3)
        assert (out / model / "pass_at_k.png").read_bytes()[:8] == PNG_SIGNATURE

    # The paired difference against the base, per benchmark and macro (Welch-Satterthwaite df).
    table = json.loads((out / "checkpoint-200" / "benchmarks.json").read_text())
    ses, means = [], []
    for b, row in zip(BENCHES, table["rows"], strict=True):
        a, c = hand["base"][b]["acc"], hand["checkpoint-200"][b]["acc"]
        diffs = [100 * (c[p] - a[p]) for p in a]
        mean, se = statistics.mean(diffs), statistics.stdev(diffs) / math.sqrt(3)
        vs = row["vs_base"]
        assert (vs["mean_diff"], vs["se"]) == pytest.approx((mean, se))
        assert (vs["ci_low"], vs["ci_high"]) == pytest.approx((mean - T975[2] * se, mean + T975[2] * se))
        means.append(mean)
        ses.append(se)
    m = table["macro_vs_base"]
    assert m["mean_diff"] == pytest.approx(statistics.mean(means))
    assert m["se"] == pytest.approx(math.sqrt(sum(s**2 for s in ses)) / 3)
    df = sum(s**2 for s in ses) ** 2 / sum(s**4 / 2 for s in ses if s > 0)
    assert m["df"] == pytest.approx(df)
    assert m["ci_high"] == pytest.approx(m["mean_diff"] + stats.t.ppf(0.975, df) * m["se"])
    assert m["mean_diff"] > 0  # the checkpoint boxes 7 and 8, the base never boxes
    assert table["rows"][0]["vs_base"]["mean_diff"] != table["rows"][1]["vs_base"]["mean_diff"]  # other seeds

    # The reported result is the declared step's, printed last; --compare of two model directories agrees.
    assert proc.stdout.splitlines()[-2].startswith(
        "reported: checkpoint-200, declared before scoring (step 200"
    )
    assert f"macro avg {m['mean_b']:.2f}" in proc.stdout.splitlines()[-1]
    cmp = eval_in_process("--compare", out / "base", out / "checkpoint-200", "--out", tmp_path / "cmp")
    assert cmp.returncode == 0, cmp.stderr[-2000:]
    compared = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert compared["macro_vs_base"] == pytest.approx(m)
    assert "macro avg accuracy" in cmp.stdout
    for png in ("accuracy_vs_step.png", "pass_at_k.png"):
        assert (out / png).read_bytes()[:8] == PNG_SIGNATURE


# --- Hub adapters ----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_hub_adapter_id_resolves_to_the_cached_snapshot(run_dir, tmp_path):
    base_dir, problems, run = run_dir
    cache = tmp_path / "hub"
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--opsd-test--boxer"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(run / "checkpoint-200" / f, snapshot / f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**EVAL_ENV, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    args = ["--model", base_dir, "--dataset", problems, "--limit", 1, "--n", 2, "--max-tokens", 8,
            "--engine", "transformers"]  # fmt: skip
    out = tmp_path / "hub-eval"
    ok(run_eval(*args, "--adapter", "opsd-test/boxer", "--out", out, env=env))
    saved = json.loads((out / "eval_config.json").read_text())
    assert saved["adapter_path"] == str(snapshot.resolve()) and saved["adapter"] == "opsd-test/boxer"
    assert len(samples(out)) == 2

    missing = run_eval(*args, "--adapter", "opsd-test/nothing", "--out", tmp_path / "missing", env=env)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    (line,) = [x for x in missing.stderr.splitlines() if x.startswith("error:")]
    assert "'opsd-test/nothing' is neither a local directory nor in the Hub cache" in line


# --- progress --------------------------------------------------------------------------------------------


def test_progress_counts_tokens_per_second_and_eta_on_a_fake_clock():
    from opsd.evaluation.generate import SampleProgress

    now = [100.0]
    progress = SampleProgress(40, clock=lambda: now[0], log_every_s=1e9, bar=False)
    assert progress.eta_s is None and progress.tokens_per_s == 0.0
    now[0] = 110.0
    progress.update(4, 1000)
    now[0] = 120.0
    progress.update(6, 2000)
    assert progress.samples == 10 and progress.tokens == 3000
    assert progress.tokens_per_s == pytest.approx(3000 / 20)  # tokens over elapsed since the start
    assert progress.eta_s == pytest.approx((40 - 10) * 20 / 10)  # unfinished x seconds per finished sample
    assert progress.line() == "10/40 samples, 3000 tokens in 20.0 s (150 tokens/s), ETA 60 s"
    progress.update(30, 0)
    assert progress.eta_s == 0 and progress.line().startswith("40/40 samples")
    assert "ETA" not in progress.line()
    worker = SampleProgress(None, clock=lambda: now[0], bar=False)  # a --num-gpus worker: no total, no ETA
    worker.update(3, 30)
    assert worker.eta_s is None and worker.line().startswith("3 samples,")


@pytest.mark.slow
def test_sweep_argument_errors_are_one_line(run_dir, tmp_path):
    base_dir, problems, run = run_dir
    empty = tmp_path / "empty-run"
    empty.mkdir()
    cases = {
        ("--checkpoints", empty): "no complete checkpoint-N inside",
        ("--checkpoints", tmp_path / "nope"): "no such directory",
        (
            "--checkpoints",
            run,
            "--adapter",
            run / "checkpoint-10",
        ): "--adapter and --checkpoints are separate",
        ("--checkpoints", run, "--num-gpus", 2): "a sweep runs one engine",
        # The reported step is declared before scoring and must be a checkpoint of the sweep (300 is incomplete).
        ("--checkpoints", run, "--step", 300): "--step 300 is past the last checkpoint (step 200)",
        ("--checkpoints", run, "--step", 50, "--benchmarks", "aime25", "--dataset",
         f"aime25={BENCH_DATA / 'aime25.jsonl'}"): "--step 50 is not a checkpoint of this sweep; declare one of",
        ("--step", 10): "--step declares which checkpoint of a sweep is reported",
    }  # fmt: skip
    for args, message in cases.items():  # refused before any model loads: in this process (in_process)
        proc = eval_in_process("--model", base_dir, "--dataset", problems, *args, "--out", tmp_path / "o")
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        assert message in proc.stderr


def test_expand_orders_complete_checkpoints_and_names_them_uniquely(tmp_path):
    from opsd.errors import UserError
    from opsd.evaluation.sweep import expand

    for run, steps in (("a", (2, 10, 11)), ("b", (10,))):
        for step in steps:
            ckpt = tmp_path / run / f"checkpoint-{step}"
            ckpt.mkdir(parents=True)
            (ckpt / "adapter_config.json").write_text("{}")
            if step != 11:  # checkpoint-11 is still being saved
                (ckpt / ".complete").touch()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    entries = expand([str(tmp_path / "a"), str(tmp_path / "b" / "checkpoint-10"), str(tmp_path / "full"),
                      "org/adapter"], with_base=True)  # fmt: skip
    assert [(e.name, e.kind) for e in entries] == [
        ("base", "base"), ("checkpoint-2", "lora"), ("a-checkpoint-10", "lora"), ("b-checkpoint-10", "lora"),
        ("full", "full"), ("org--adapter", "lora"),
    ]  # fmt: skip
    (tmp_path / "a" / "checkpoint-2" / ".complete").unlink()
    (tmp_path / "a" / "checkpoint-10" / ".complete").unlink()  # no marks at all: every checkpoint, warned
    assert [e.name for e in expand([str(tmp_path / "a")], with_base=False)] == [
        "checkpoint-2", "checkpoint-10", "checkpoint-11"
    ]  # fmt: skip
    with pytest.raises(UserError, match="twice"):
        expand([str(tmp_path / "full"), str(tmp_path / "full")], with_base=False)
