"""Bad input to `python -m opsd.experiment` and its `report`: every malformed path, arm name, number, seed list and
damaged file in an experiment directory is refused with one line on stderr and exit status 2, and nothing is
written. In process (`commands.main`, whose return value `python -m opsd.experiment` exits with; tests/e2e checks that
exit status through a subprocess), one class of input per test."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from opsd.experiment import commands
from tests.unit.test_experiment import experiment


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("OPSD_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: visible_gpus reads this, not torch


def tree(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` with its bytes: what "nothing written" compares."""
    if not directory.exists():
        return {}
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()
    }


def refused(argv: list[str], capsys, *, watch: Path) -> str:
    """Run commands.main(argv); assert exit 2, one line on stderr, no stdout, no file under `watch` changed."""
    before = tree(watch)
    rc = commands.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert rc == 2, (argv, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("opsd.experiment: error: "), err
    assert len(lines[0]) < 800 and out == "", (out, err)
    assert tree(watch) == before, "a refused command wrote into the directory"
    return lines[0]


ARMS = ["--arm", "a=CLIP_MODE=element", "--arm", "b=CLIP_MODE=none"]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--recipe", "{tmp}/missing.env"], "missing.env' does not exist"),  # inline arms on defaults before
        (["--recipe", "{tmp}"], "is a directory"),
        (["--recipe", "/dev/zero"], "character device"),
        (["--accelerate-config", "{tmp}/none.yaml"], "none.yaml' does not exist"),
        (["--accelerate-config", "/dev/null"], "character device"),
        (["--arm", "c={tmp}/absent.env"], "no recipe file at"),
        (["--out", "{tmp}/file/exp"], "cannot be created"),
        (["--out", ""], "--out ''"),
    ],
)
def test_bad_paths(tmp_path: Path, capsys, extra: list[str], named: str) -> None:
    (tmp_path / "file").write_text("a file, not a directory")
    argv = ["--out", tmp_path / "exp", *ARMS, *[e.replace("{tmp}", str(tmp_path)) for e in extra]]
    assert named in refused(argv, capsys, watch=tmp_path)


@pytest.mark.parametrize(
    ("arms", "named"),
    [
        (["--arm", "a=CLIP_MODE=element"], "at least two arms, got 1"),
        ([], "at least two arms, got 0"),
        (["--arm", "../../x=BETA=1", "--arm", "b=BETA=0"], "'../../x'"),
        (["--arm", "a/b=BETA=1", "--arm", "b=BETA=0"], "'a/b'"),
        (["--arm", "x" * 300 + "=BETA=1", "--arm", "b=BETA=0"], "at most 64"),
        (["--arm", "a b=BETA=1", "--arm", "b=BETA=0"], "'a b'"),
        (["--arm", "base=BETA=1", "--arm", "b=BETA=0"], "'base'"),
        (["--arm", "ä=BETA=1", "--arm", "b=BETA=0"], "'ä'"),
        (["--arm", "Run=BETA=1", "--arm", "run=BETA=0"], "given twice"),
        (["--arm", "a=BETA=1", "--arm", "a=BETA=0"], "given twice"),
        ([*ARMS, "--baseline", "c"], "--baseline 'c' is not an arm"),
        (
            ["--arm", "a=JSD_TOKEN_CLIP=0.1,DIVERGENCE_CLIP=0.2", "--arm", "b=BETA=0"],
            "keep only DIVERGENCE_CLIP",
        ),
    ],
)
def test_bad_arm_names_and_arms(tmp_path: Path, capsys, arms: list[str], named: str) -> None:
    assert named in refused(["--out", tmp_path / "exp", "--recipe", "", *arms], capsys, watch=tmp_path)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--seeds", ""], "--seeds ''"),
        (["--seeds", "1,x"], "--seeds '1,x'"),
        (["--seeds", "4294967296"], "from 0 to 2147483647"),
        (["--kv-cache-gib", "-1"], "--kv-cache-gib -1.0"),
        (["--kv-cache-gib", "nan"], "--kv-cache-gib nan"),
        (["--stagger", "-5"], "--stagger -5.0"),
        (["--stagger", "inf"], "--stagger inf"),
        (["--stagger", "abc"], "argument --stagger: invalid float value"),
        (["--status-every", "0"], "--status-every 0.0: give a number > 0"),
        (["--cells-per-gpu", "0"], "--cells-per-gpu 0"),
        (["--retries", "-1"], "--retries -1"),
        (["--target-diff", "0"], "--target-diff 0.0"),
        (["--target-diff", "nan"], "--target-diff nan"),
        (["--bootstrap-reps", "5"], "--bootstrap-reps 5"),
        (["--gpus", "x,y"], "--gpus 'x,y'"),
        (["--gpus", "0,0"], "distinct GPU indices"),
        (["--gpus", ""], "CUDA_VISIBLE_DEVICES=''"),
        (["--gpus", "0,1,2", "--gpus-per-run", "3"], "--gpus-per-run 3: give 1, 2, 4 or 8"),
        (["--gpus", "0,1,2", "--gpus-per-run", "2"], "does not divide"),
        (["--gpus-per-run", "2"], "without GPUs leave it out"),
        (["--profile", "huge"], "--profile 'huge'"),
        (["--model", ""], "--model ''"),
        (["--eval-flags", "--seed 3"], "--seed, which the experiment sets itself"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_numbers_and_lists(tmp_path: Path, capsys, extra: list[str], named: str) -> None:
    argv = ["--out", tmp_path / "exp", "--recipe", "", *ARMS, *extra]
    assert named in refused(argv, capsys, watch=tmp_path)


def damage(directory: Path, what: str) -> None:
    """Edit one file of a finished synthetic experiment the way a hand or a cut copy would."""
    summary = directory / "evals" / "B" / "seed2" / "checkpoint-100" / "summary.json"
    samples = summary.with_name("samples.jsonl")
    lines = samples.read_text().splitlines(keepends=True)
    edits = {
        "failed: not JSON": (directory / "failed.json", "{"),
        "failed: a list": (directory / "failed.json", "[]"),
        "failed: a field missing": (
            directory / "failed.json",
            json.dumps({"train-B-s2": {"job": "train B/2"}}),
        ),
        "failed: not a job key": (
            directory / "failed.json",
            json.dumps({"train-B-2": {"job": "train B/2", "exit": 3, "attempts": 2, "log": "x"}}),
        ),
        "jobs: not JSON": (directory / "jobs.jsonl", '{"kind": "base", "start": 1, "seconds": 2}\n{cut'),
        "jobs: no kind": (directory / "jobs.jsonl", '{"start": 1, "seconds": 2}\n'),
        "jobs: negative seconds": (directory / "jobs.jsonl", '{"kind": "eval", "start": 1, "seconds": -2}\n'),
        "summary: not JSON": (summary, "{"),
        "summary: no metrics": (summary, "{}"),
        "summary: text metric": (summary, summary.read_text().replace('"avg": ', '"avg": "x", "was": ')),
        "samples: cut": (samples, "".join(lines[:-3])),
        "samples: a line cut in half": (samples, "".join(lines[:-1]) + lines[-1][:20]),
        "samples: a sample twice": (samples, "".join(lines + lines[:1])),
        "samples: no correct": (samples, "".join(lines[:-1]) + lines[-1].replace('"correct"', '"right"')),
        "samples: not UTF-8": (samples, None),
        "experiment.json: an arm outside": (directory / "experiment.json", None),
    }
    path, text = edits[what]
    if what == "samples: not UTF-8":
        samples.write_bytes(samples.read_bytes() + b"\xff\n")
    elif what == "experiment.json: an arm outside":
        data = json.loads(path.read_text())
        data["arms"]["../../x"] = data["arms"].pop("B")
        path.write_text(json.dumps(data))
    else:
        path.write_text(text)


DAMAGES = [
    ("failed: not JSON", "failed.json is not valid JSON"),
    ("failed: a list", "failed.json does not map jobs"),
    ("failed: a field missing", "failed.json does not map jobs"),
    ("failed: not a job key", "'train-B-2' is not a job key"),
    ("jobs: not JSON", "jobs.jsonl line 2 is not JSON"),
    ("jobs: no kind", "jobs.jsonl line 1 is not a job record"),
    ("jobs: negative seconds", "jobs.jsonl line 1 is not a job record"),
    ("summary: not JSON", "summary.json is not an eval_aime.py summary"),
    ("summary: no metrics", "summary.json is not an eval_aime.py summary"),
    ("summary: text metric", "summary.json is not an eval_aime.py summary"),
    ("samples: cut", "samples, the summary says 4"),
    ("samples: a line cut in half", "samples.jsonl line 12 is not JSON"),
    ("samples: a sample twice", "is there twice"),
    ("samples: no correct", "line 12 is not a sample"),
    ("samples: not UTF-8", "is not UTF-8 text"),
    ("experiment.json: an arm outside", "'../../x'"),
]


@pytest.mark.parametrize(("what", "named"), DAMAGES)
def test_damaged_files_in_an_experiment_directory(tmp_path: Path, capsys, what: str, named: str) -> None:
    directory = experiment(tmp_path / "exp")
    damage(directory, what)
    # The report, and a rerun (which reads them before adding to the directory), refuse the damaged file.
    message = refused(["report", directory, "--bootstrap-reps", "200"], capsys, watch=tmp_path)
    assert named in message, message
    if what.startswith(("summary", "samples")):
        assert "delete" in message and "rerun the experiment to score it again" in message
    message = refused(["--out", directory, "--print-commands"], capsys, watch=tmp_path)
    assert named in message, message


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["report", "{tmp}/nothing"], "does not exist"),
        (["report", "{tmp}"], "is not an experiment directory"),
        (["report", "{tmp}/exp", "--baseline", "Z"], "--baseline 'Z' is not an arm"),
        (["report", "{tmp}/exp", "--target-diff", "-1"], "--target-diff -1.0"),
        (["report", "{tmp}/exp", "--bootstrap-reps", "0"], "--bootstrap-reps 0"),
        (["report", "{tmp}/exp", "--bogus"], "unrecognized arguments: --bogus"),
        (["report"], "the following arguments are required: directory"),
        (["reprot", "{tmp}/exp"], "unknown command 'reprot': use run or report"),
        (["run", "--out", "{tmp}/exp", "--bogus"], "unrecognized arguments: --bogus"),
        (["run"], "the following arguments are required: --out"),
        ([], "the following arguments are required: --out"),
    ],
)
def test_bad_report_arguments(tmp_path: Path, capsys, argv: list[str], named: str) -> None:
    experiment(tmp_path / "exp")
    assert named in refused([a.replace("{tmp}", str(tmp_path)) for a in argv], capsys, watch=tmp_path)


def test_run_is_the_command_a_command_line_without_one_runs(tmp_path: Path, capsys) -> None:
    directory = experiment(tmp_path / "exp")
    assert (
        commands.parse(["--out", "d"]).command == "run"
        and commands.parse(["report", "d"]).command == "report"
    )
    assert commands.main(["--out", str(directory), "--print-commands"]) == 0
    implicit = capsys.readouterr().out
    assert commands.main(["run", "--out", str(directory), "--print-commands"]) == 0
    assert capsys.readouterr().out == implicit and "# cell B/2" in implicit
    (directory / "summary.json").unlink(missing_ok=True)
    assert commands.main(["report", str(directory), "--bootstrap-reps", "200", "--baseline", "B"]) == 0
    assert json.loads((directory / "summary.json").read_text())["baseline"] == "B"
    assert "written: " in capsys.readouterr().out
