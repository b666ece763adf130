"""`python -m opsd.experiment` end to end on CPU: 3 arms x 2 seeds of the smoke profile on the tiny model, real
capped runs (vLLM rollouts) and real evaluations; the arms are the published recipe, the teacher-free control
(the study of docs/experiments.md in CI-sized form) and GRPO (method=grpo, 2 rollouts per problem). The
experiment is started from another directory than the checkout, with the model, the training data and the
evaluation's data given relative to it, stopped in the middle of a cell and rerun from the checkout; the rerun
finishes without redoing the finished cells. Then: the report against the samples on disk, its compute ledger
per arm, the refusal of a changed arm, the printed commands reproducing a cell by hand, and an added seed
recorded."""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ENV, PNG_SIGNATURE

ROOT = Path(__file__).resolve().parents[2]
# The evaluation's problems: a local file, named relative to the directory the experiment is started from.
EVAL_FLAGS = (
    "--dataset evals/problems.jsonl --n 2 --max-tokens 8 --limit 4 --no-thinking --max-model-len 512 "
    "--engine transformers"
)


def env() -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith("OPSD_") or k == "OPSD_CACHE_DIR"}
    return {**full, **ENV, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def experiment(*args, **kw) -> list[str]:
    return [sys.executable, "-m", "opsd.experiment", *map(str, args)]


def run(*args, timeout=900, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        experiment(*args), cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout
    )


def caller_directory(where: Path, tiny_model_dir) -> Path:
    """A directory outside the checkout holding what the experiment is given by relative paths: the model as
    `models/tiny` (a name of a hub id's form: it is local because the path exists), the training data as
    `data/train.jsonl`, the evaluation's problems as `evals/problems.jsonl`."""
    from opsd.data.builtin import builtin_eval_rows, builtin_train_rows

    (where / "models").mkdir(parents=True)
    (where / "models" / "tiny").symlink_to(tiny_model_dir)
    for name, rows in (
        ("data/train.jsonl", builtin_train_rows(n=400)),
        ("evals/problems.jsonl", builtin_eval_rows()),
    ):
        (where / name).parent.mkdir(exist_ok=True)
        (where / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return where


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
    return max((r.get("step", 0) for r in lines), default=0)


def attempts(log: Path) -> int:
    return sum(line.startswith("=== ") for line in log.read_text().splitlines())


def snapshot(directory: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def exp(tmp_path_factory, tiny_model_dir):
    """An experiment started from another directory with relative paths, stopped while cell b/42 trains (a/42
    done), then rerun from the checkout to the end."""
    d = tmp_path_factory.mktemp("exp") / "clip"
    caller = caller_directory(tmp_path_factory.mktemp("caller"), tiny_model_dir)
    first = [
        "--out", d, "--profile", "smoke", "--model", "models/tiny", "--dataset", "data/train.jsonl", "--recipe", "",
        "--seeds", "42,43", "--arm", "a=CLIP_MODE=element", "--arm", "b=LOSS_TYPE=fixed_advantage",
        "--arm", "c=METHOD=grpo,NUM_GENERATIONS=2", "--eval-flags", EVAL_FLAGS, "--status-every", 5,
    ]  # fmt: skip
    proc = subprocess.Popen(experiment(*first), cwd=caller, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    b42 = d / "runs" / "b" / "capped_seed42"
    deadline = time.time() + 900
    while last_step(b42) < 15 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    stopped_at = last_step(b42)
    time.sleep(3)
    after_stop = last_step(b42)
    partial = run("report", d)
    finished = snapshot(d / "evals" / "a" / "seed42") | snapshot(d / "runs" / "a" / "capped_seed42")
    rerun = run("--out", d, "--status-every", 5)
    return {"dir": d, "stop": (proc.returncode, out, err), "stopped_at": stopped_at, "after_stop": after_stop,
            "partial": partial, "finished": finished, "rerun": rerun, "caller": caller}  # fmt: skip


def test_paths_given_relative_to_another_directory_are_recorded_absolute(exp):
    """The model, the training data and the evaluation's data were given relative to the directory the experiment
    started in, not the checkout its jobs run in: recorded absolute, they are what every job read (the cells
    trained and scored, the next test checks)."""
    caller = exp["caller"]
    spec = json.loads((exp["dir"] / "experiment.json").read_text())
    assert spec["model"] == str(
        caller / "models" / "tiny"
    )  # local: that path exists, though it reads as org/name
    assert spec["dataset"] == str(caller / "data" / "train.jsonl")
    flags = spec["eval_flags"]
    assert flags[flags.index("--dataset") + 1] == str(caller / "evals" / "problems.jsonl")
    train_log = (exp["dir"] / "logs" / "train-a-s42.log").read_text()
    assert f"--model {caller / 'models' / 'tiny'}" in train_log
    assert f"--dataset {caller / 'data' / 'train.jsonl'}" in train_log


def test_stop_then_rerun_finishes_without_redoing_finished_cells(exp):
    d = exp["dir"]
    rc, out, err = exp["stop"]
    assert rc == 130 and "rerun the same command to resume" in err
    assert "a/42" in out and "training" in out  # the live status table
    assert exp["after_stop"] == exp["stopped_at"], "the stopped cell's training went on after the stop"
    assert exp["rerun"].returncode == 0, exp["rerun"].stderr[-3000:]
    after = snapshot(d / "evals" / "a" / "seed42") | snapshot(d / "runs" / "a" / "capped_seed42")
    assert after == exp["finished"], "a finished cell's files were rewritten by the rerun"
    logs = d / "logs"
    assert attempts(logs / "train-a-s42.log") == 1 and attempts(logs / "eval-a-s42.log") == 1
    assert attempts(logs / "base-42.log") == 1 and attempts(logs / "base-43.log") == 1
    assert attempts(logs / "train-b-s42.log") == 2  # stopped, then resumed by the rerun
    assert "resuming from" in (logs / "train-b-s42.log").read_text().lower()
    for arm in "abc":
        for seed in (42, 43):
            assert (d / "runs" / arm / f"capped_seed{seed}" / "checkpoint-100" / ".complete").is_file()
            assert (d / "evals" / arm / f"seed{seed}" / "checkpoint-100" / "summary.json").is_file()
    assert not json.loads((d / "failed.json").read_text())


def test_partial_report_says_what_is_missing(exp):
    partial = exp["partial"]
    assert partial.returncode == 0, partial.stderr[-3000:]
    # The report of the stopped experiment was overwritten by the rerun's; the partial one is in stdout.
    assert "written:" in partial.stdout
    assert "b −" not in partial.stdout  # no comparison: arm b had no scored seed yet


def _accuracy(eval_dir: Path) -> dict[tuple[str, int], float]:
    rows = [json.loads(x) for x in (eval_dir / "checkpoint-100" / "samples.jsonl").read_text().splitlines()]
    return {(r["id"], r["idx"]): float(r["correct"]) for r in rows}


def test_report_pairs_seeds_and_samples(exp):
    d = exp["dir"]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["baseline"] == "a" and set(summary["arms"]) == {"a", "b", "c"}
    comp = summary["comparisons"]["b"]["accuracy"]
    assert comp["seeds"] == [42, 43] and comp["interval"]["method"] == "seed-paired t"
    for seed in (42, 43):  # per seed: mean over the same (problem, sample) pairs, in points
        a, b = _accuracy(d / "evals" / "a" / f"seed{seed}"), _accuracy(d / "evals" / "b" / f"seed{seed}")
        assert set(a) == set(b) and len(a) == 4 * 2
        assert comp["per_seed"][str(seed)] == pytest.approx(100 * sum(b[k] - a[k] for k in a) / len(a))
    for arm in "ab":
        assert summary["arms"][arm]["missing"] == {}
        assert sorted(summary["arms"][arm]["per_seed"]) == ["42", "43"]
        curves = summary["curves"][arm]["42"]
        assert [s for s, _ in curves["loss"]] == list(range(1, 101))
        assert [s for s, _ in curves["rollout/correct"]] == list(range(1, 101))
    # The teacher-free arm read no teacher: its runs log no divergence.
    from opsd.rundir import read_step_log

    steps = [r for r in read_step_log(d / "runs" / "b" / "capped_seed42" / "metrics.jsonl") if "loss" in r]
    assert len(steps) == 100 and all("opsd/abs_advantage" in r and "opsd/divergence" not in r for r in steps)
    report = (d / "report.md").read_text()
    assert "b − a" in report and "2 of 2" in report
    for name in ("verdict.png", "curves.png"):
        assert (d / name).read_bytes()[:8] == PNG_SIGNATURE


def test_report_compute_ledger_per_arm(exp):
    """Every cell's ledger.jsonl summed per arm: OPSD books teacher tokens, GRPO none and twice OPSD's rollouts
    per problem; the stopped and resumed cell (b/42) books each of its 100 steps once."""
    d = exp["dir"]
    summary = json.loads((d / "summary.json").read_text())
    led = {arm: summary["arms"][arm]["ledger"] for arm in "abc"}
    assert {arm: x["method"] for arm, x in led.items()} == {"a": "opsd", "b": "opsd", "c": "grpo"}
    for arm, x in led.items():
        assert x["seeds"] == [42, 43] and x["unavailable"] == {}, (arm, x)
        assert all(t["steps"] == 100 for t in x["per_seed"].values()), (arm, x["per_seed"])
        assert all(t["generated_tokens"] > 0 and t["trained_tokens"] > 0 for t in x["per_seed"].values())
        assert "gpu_s" not in x["total"] and x["total"]["step_s"] > 0  # a CPU run: no GPU-seconds
        pm = x["per_million_generated"]["accuracy"]
        assert pm["seeds"] == [42, 43] and pm["method"] == "seed-paired t"
        vs = summary["arms"][arm]["vs_base"]["accuracy"]["interval"]
        assert pm["estimate"] == pytest.approx(vs["estimate"] / (x["mean"]["generated_tokens"] / 1e6))
    assert all(t["teacher_tokens"] > 0 for t in led["a"]["per_seed"].values())
    assert led["c"]["total"]["teacher_tokens"] == 0
    # 2 problems x 8 tokens per step at most, x 2 rollouts per problem under GRPO.
    assert led["a"]["total"]["generated_tokens"] <= 2 * 100 * 2 * 8
    assert led["c"]["total"]["generated_tokens"] <= 2 * 100 * 2 * 2 * 8
    report = (d / "report.md").read_text()
    assert "### c − a" in report
    c_section = report.split("### c − a")[1].split("##")[0]
    assert c_section.count("\n- ") == 2  # its two verdict lines: accuracy and format rate
    ledger = report.split("## Compute ledger")[1].split("## How to read this")[0]
    rows = {
        line.split(" | ")[0][2:]: line.split(" | ") for line in ledger.splitlines() if line.startswith("| ")
    }
    assert rows["a"][1] == "`opsd`" and rows["c"][1] == "`grpo`"
    for arm in "ac":
        assert rows[arm][2] == "2 of 2" and float(rows[arm][4]) > 0 and rows[arm][8] == "n/a (no GPU)"
    assert float(rows["a"][5]) > 0 and rows["c"][5] == "0"


def test_changed_arm_is_refused(exp):
    d = exp["dir"]
    before = (d / "experiment.json").read_bytes()
    done = run("--out", d, "--arm", "a=CLIP_MODE=none", timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "arm 'a'" in lines[0] and "CLIP_MODE element -> none" in lines[0], done.stderr
    assert (d / "experiment.json").read_bytes() == before


def test_printed_commands_reproduce_a_cell(exp):
    d = exp["dir"]
    printed = run("--out", d, "--print-commands", timeout=120)
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.splitlines()
    cell = lines[lines.index("# cell a/43") + 1]
    train, evaluate = cell.split(" && ")
    assert shlex.split(train)[:2] == ["bash", str(ROOT / "train_capped.sh")]
    # Put the cell's final checkpoint and evaluation aside; the printed line, run by hand, makes them again.
    run_dir, eval_dir = d / "runs" / "a" / "capped_seed43", d / "evals" / "a" / "seed43"
    aside = d.parent / "aside"
    aside.mkdir()
    shutil.move(run_dir / "checkpoint-100", aside / "checkpoint-100")
    shutil.move(eval_dir, aside / "eval")
    done = subprocess.run(
        ["bash", "-c", cell], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    new = load_file(run_dir / "checkpoint-100" / "adapter_model.safetensors")
    old = load_file(aside / "checkpoint-100" / "adapter_model.safetensors")
    assert new.keys() == old.keys()
    for key in old:
        torch.testing.assert_close(new[key], old[key], rtol=0, atol=1e-5)

    def texts(where: Path) -> dict:
        rows = [json.loads(x) for x in (where / "samples.jsonl").read_text().splitlines()]
        return {(r["id"], r["idx"]): r["text"] for r in rows}

    assert texts(eval_dir / "checkpoint-100") == texts(aside / "eval" / "checkpoint-100")


def test_added_seed_is_recorded(exp):
    d = exp["dir"]
    done = run("--out", d, "--seeds", "42,43,44", "--print-commands", timeout=120)
    assert done.returncode == 0, done.stderr
    assert "# cell a/44" in done.stdout and "# cell b/44" in done.stdout
    spec = json.loads((d / "experiment.json").read_text())
    assert spec["seeds"] == [42, 43, 44]
    assert spec["history"][-1]["added_seeds"] == [44] and spec["history"][-1]["added_arms"] == []
    report = run("report", d, timeout=120)
    assert report.returncode == 0, report.stderr
    summary = json.loads((d / "summary.json").read_text())
    assert summary["arms"]["a"]["missing"] == {"44": "not started"}
    assert "over 2 of the 3 planned seeds" in (d / "report.md").read_text()
    # a/43 was trained again from step 0 by its printed command (its ledger.jsonl holds both runs' rows): the
    # last row of each step counts, once.
    led = summary["arms"]["a"]["ledger"]
    assert led["seeds"] == [42, 43] and led["per_seed"]["43"]["steps"] == 100, led
