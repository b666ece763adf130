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
        # shlex's refusals (a ValueError) of a string a shell would not split either
        (
            ["--eval-flags", '"unbalanced'],
            "--eval-flags '\"unbalanced': no closing quotation; close every quote",
        ),
        (["--eval-flags", "--n 8 \\"], "--eval-flags '--n 8 \\\\': no escaped character; close every quote"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_numbers_and_lists(tmp_path: Path, capsys, extra: list[str], named: str) -> None:
    argv = ["--out", tmp_path / "exp", "--recipe", "", *ARMS, *extra]
    assert named in refused(argv, capsys, watch=tmp_path)


def failure(key: str, **fields) -> str:
    """failed.json with one record, as the runner writes it for `key` but for `fields`."""
    job = {"train-B-s2": "train B/2"}.get(key, key)
    return json.dumps({key: {"job": job, "exit": 1, "attempts": 2, "log": "logs/x.log", **fields}})


def metric(summary: Path, path: tuple[str, ...], value) -> str:
    """summary.json's text with metrics[path...] set to `value`."""
    data = json.loads(summary.read_text())
    target = data["metrics"]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return json.dumps(data)


def damage(directory: Path, what: str) -> None:
    """Edit one file of a finished synthetic experiment the way a hand or a cut copy would."""
    summary = directory / "evals" / "B" / "seed2" / "checkpoint-100" / "summary.json"
    samples = summary.with_name("samples.jsonl")
    lines = samples.read_text().splitlines(keepends=True)
    failed = directory / "failed.json"
    edits = {
        # numbers: of the wrong type, out of range, or too big to hold in memory or to parse
        "n: a float": (summary, metric(summary, ("n",), 4.0)),
        "n: a fraction": (summary, metric(summary, ("n",), 4.5)),
        "n: ten billion": (summary, metric(summary, ("n",), 10**10)),
        "n: true": (summary, metric(summary, ("n",), True)),
        "n_problems: ten million": (summary, metric(summary, ("n_problems",), 10**7)),
        "avg: over 100": (summary, metric(summary, ("avg",), 1e308)),
        "avg: NaN": (summary, metric(summary, ("avg",), float("nan"))),
        "samples: a huge index": (
            samples,
            "".join(lines[:-1]) + lines[-1].replace('"idx": ', '"idx": 1' + "0" * 12),
        ),
        "samples: a 5000-digit id": (
            samples,
            "".join(lines[:-1]) + lines[-1].replace('"id": ', '"id": ' + "9" * 5000 + ', "x": '),
        ),
        "failed: exit out of range": (failed, failure("train-B-s2", exit=10**6)),
        "failed: no attempt": (failed, failure("train-B-s2", attempts=0)),
        "failed: nested past the parser": (failed, "[" * 100_000 + "]" * 100_000),
        "jobs: a start in 1e308": (
            directory / "jobs.jsonl",
            '{"kind": "eval", "start": 1e308, "seconds": 1e308}\n',
        ),
        # labels and texts that report.md quotes: one line of plain text
        "label: a newline and markdown": (summary, metric(summary, ("labels", "avg"), "avg\n| x | y |")),
        "failed: a log of two lines": (failed, failure("train-B-s2", log="x.log\n| x |")),
        # keys: a job key names a log file, DIR/logs/KEY.log
        "failed: an arm outside": (failed, failure("train-../x-s1")),
        "failed: the base's name as an arm": (failed, failure("train-base-s1")),
        "failed: a seed past 2^31": (failed, failure("base-2147483648")),
        "failed: a job that is not its key's": (failed, failure("train-B-s2", job="eval B/2")),
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
    ("n: a float", "field metrics.n is 4.0, not a whole number from 1 to 100,000"),
    ("n: a fraction", "field metrics.n is 4.5"),
    ("n: ten billion", "field metrics.n is 10000000000"),
    ("n: true", "field metrics.n is True"),
    ("n_problems: ten million", "field metrics.n_problems is 10000000"),
    ("avg: over 100", "field metrics.avg is 1e+308, not a percentage"),
    ("avg: NaN", "field metrics.avg is nan"),
    ("samples: a huge index", "is not a sample"),
    ("samples: a 5000-digit id", "is not JSON (Exceeds the limit"),
    ("failed: exit out of range", "field exit is 1000000"),
    ("failed: no attempt", "field attempts is 0"),
    ("failed: nested past the parser", "failed.json is not valid JSON (nested too deeply)"),
    ("jobs: a start in 1e308", "jobs.jsonl line 1 is not a job record: start 1e+308"),
    ("label: a newline and markdown", "field metrics.labels.avg is 'avg\\n| x | y |', not a label"),
    ("failed: a log of two lines", "field log is 'x.log\\n| x |', not one line"),
    ("failed: an arm outside", "'train-../x-s1' is not a job key"),
    ("failed: the base's name as an arm", "'train-base-s1' is not a job key"),
    ("failed: a seed past 2^31", "'base-2147483648' is not a job key"),
    ("failed: a job that is not its key's", "field job is 'eval B/2', not 'train B/2'"),
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


@pytest.mark.parametrize("what", ["other problem ids", "another --n"])
def test_evaluations_scored_with_other_flags_are_named(tmp_path: Path, capsys, what: str) -> None:
    """An evaluation scored with other --eval-flags than its experiment's (another dataset: no problem id in
    common; another --n: other sample counts) cannot be paired with the rest of its seed: the report names both
    files in one line, where the statistics' ValueError once escaped as a traceback."""
    directory = experiment(tmp_path / "exp")
    cell = directory / "evals" / "B" / "seed2" / "checkpoint-100"
    rows = [json.loads(line) for line in (cell / "samples.jsonl").read_text().splitlines()]
    if what == "other problem ids":
        rows = [{**r, "id": f"other-{r['id']}"} for r in rows]
        named = "share no problem id (3 and 3 problems), so seed 2's samples cannot be paired"
    else:
        rows = [r for r in rows if r["idx"] < 2]
        (cell / "summary.json").write_text(metric(cell / "summary.json", ("n",), 2))
        named = "holds 4 samples per problem and"
    (cell / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    message = refused(["report", directory, "--bootstrap-reps", "200"], capsys, watch=tmp_path)
    assert named in message, message
    for evaluation in (directory / "evals" / "base" / "seed2", cell):  # the pair the statistics refused
        assert repr(str(evaluation / "samples.jsonl")) in message, message
    assert "delete that one's evaluation directory and rerun the experiment to score it again" in message


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


# --- the inputs a run records, checked as its jobs would check them, before anything is written ---------------


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (
            ["--model", "; touch {tmp}/x"],
            "--model '; touch {tmp}/x' is not a local file or directory, a built-in",
        ),
        (["--model", "{tmp}/no-model"], "--model: model path"),
        (["--dataset", "$(touch {tmp}/x)"], "--dataset '$(touch"),
        (["--dataset", "{tmp}/absent.jsonl"], "--dataset '{tmp}/absent.jsonl' does not exist"),
        (["--dataset", "builtin:nope"], "unknown built-in dataset 'builtin:nope'"),
        (
            ["--eval-flags", "--dataset /etc/passwd"],
            "--eval-flags --dataset: dataset file '/etc/passwd' must end in",
        ),
        (["--eval-flags", "--dataset '`touch x`'"], "--eval-flags --dataset '`touch x`' is not a local file"),
        (["--eval-flags", "--prompt-file {tmp}/none.txt"], "none.txt' does not exist"),
        (["--eval-flags", "--dataset 'a\nb'"], "--eval-flags item 'a\\nb' is not one line"),
        (["--model", "tiny\nmodel"], "--model 'tiny\\nmodel' is not one line"),
        (["--seeds", ",".join(map(str, range(1001)))], "at most 1000 seeds (got 1001 items)"),
    ],
)
def test_run_checks_model_data_and_evaluation_before_writing(tmp_path: Path, capsys, extra, named) -> None:
    # --print-commands: the model is checked for its form only, as the plan may be for another machine.
    argv = ["--out", tmp_path / "exp", "--recipe", "", *ARMS, "--profile", "smoke", "--print-commands"]
    extra = [e.replace("{tmp}", str(tmp_path)) for e in extra]
    message = refused([*argv, *extra], capsys, watch=tmp_path)
    assert named.replace("{tmp}", str(tmp_path)) in message, message
    assert not (tmp_path / "x").exists()


def test_run_refuses_more_arms_than_the_cap_and_a_file_over_its_cap(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    from dataclasses import replace

    from opsd.experiment import spec

    many = [a for i in range(spec.MAX_ARMS + 1) for a in ("--arm", f"a{i}=BETA={i}")]
    message = refused(["--out", tmp_path / "exp", "--recipe", "", *many], capsys, watch=tmp_path)
    assert f"at most {spec.MAX_ARMS} arms" in message
    # A rerun adding seeds past the cap to a directory that holds some.
    directory = experiment(tmp_path / "exp")
    seeds = ",".join(map(str, range(4, 4 + spec.MAX_SEEDS - 2)))
    message = refused(["--out", directory, "--seeds", seeds, "--print-commands"], capsys, watch=tmp_path)
    assert f"would hold {spec.MAX_SEEDS + 1} seeds" in message
    # What run writes stays within what its own loader reads.
    monkeypatch.setattr(spec, "EXPERIMENT_KIND", replace(spec.EXPERIMENT_KIND, max_bytes=2000))
    message = refused(["--out", tmp_path / "new", "--recipe", "", *ARMS, "--profile", "smoke", "--print-commands",
                       "--seeds", ",".join(map(str, range(300)))], capsys, watch=tmp_path)  # fmt: skip
    assert "experiment.json would be" in message and "over the 2 KiB" in message


def test_the_hint_for_a_method_variable_is_a_form_the_recipe_parser_accepts(
    tmp_path: Path, capsys, monkeypatch
):
    from opsd.experiment.arms import parse_arm

    monkeypatch.setenv("OPSD_learning_rate", "2e-5")
    message = refused(["--out", tmp_path / "exp", "--recipe", "", *ARMS], capsys, watch=tmp_path)
    suggested = message.split("(--arm ", 1)[1].rstrip(")")
    assert suggested == "NAME=LEARNING_RATE=VALUE", message
    arm = parse_arm(suggested.replace("NAME", "lr").replace("VALUE", "2e-5"), None)
    assert arm.recipe == {"learning_rate": "2e-05"}
    monkeypatch.delenv("OPSD_learning_rate")
    monkeypatch.setenv("OPSD_MAX_STEPS", "5")  # a budget key: no arm may set it either
    message = refused(["--out", tmp_path / "exp", "--recipe", "", *ARMS], capsys, watch=tmp_path)
    assert "MAX_STEPS is not a setting an arm's recipe may hold" in message and "--arm" not in message


# --- links out of the experiment ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "where",
    ["evals/B/seed2", "evals/B/seed2/checkpoint-100", "evals/base/seed1", "runs/A/capped_seed1", "evals"],
)
def test_a_link_out_of_the_experiment_is_refused(tmp_path: Path, capsys, where: str) -> None:
    directory = experiment(tmp_path / "exp")
    outside = tmp_path / "elsewhere"
    (directory / where).rename(outside)
    (directory / where).symlink_to(outside)
    for argv in (["report", directory, "--bootstrap-reps", "200"], ["--out", directory, "--print-commands"]):
        message = refused(argv, capsys, watch=tmp_path)
        assert f"{str(directory / where)!r} is a link to {str(outside)!r}, outside the experiment" in message


def test_a_link_that_stays_inside_the_experiment_is_followed(tmp_path: Path, capsys) -> None:
    directory = experiment(tmp_path / "exp")
    (directory / "evals" / "B").rename(directory / "evals-B")
    (directory / "evals" / "B").symlink_to(directory / "evals-B")
    assert commands.main(["report", str(directory), "--bootstrap-reps", "200"]) == 0
    assert json.loads((directory / "summary.json").read_text())["arms"]["B"]["missing"] == {}


# --- the report's outputs: unwritable, replaced whole, figures that skip what cannot be drawn -----------------


OUTPUTS = ("report.md", "summary.json", "verdict.png", "curves.png")


def test_report_refuses_outputs_it_cannot_write(tmp_path: Path, capsys, monkeypatch) -> None:
    directory = experiment(tmp_path / "exp")
    (directory / "report.md").mkdir()
    message = refused(["report", directory, "--bootstrap-reps", "200"], capsys, watch=tmp_path)
    assert "report.md' is a directory" in message and not (directory / "summary.json").exists()
    (directory / "report.md").rmdir()

    # A directory whose mode bits say writable (root's always do) where nothing can be created: the probe says so.
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "access", lambda *args, **kwargs: True)
    monkeypatch.setattr("tempfile.mkdtemp", refuse)
    message = refused(["report", directory, "--bootstrap-reps", "200"], capsys, watch=tmp_path)
    assert f"{str(directory)!r} is not writable (Permission denied)" in message
    message = refused(["--out", tmp_path / "new", "--recipe", "", *ARMS], capsys, watch=tmp_path)
    assert "cannot be created" in message and "is not writable (Permission denied)" in message


def test_report_is_replaced_whole_or_not_at_all(tmp_path: Path, capsys, monkeypatch) -> None:
    from opsd.experiment import verdict

    directory = experiment(tmp_path / "exp")
    assert commands.main(["report", str(directory), "--bootstrap-reps", "200"]) == 0
    capsys.readouterr()
    before = tree(directory)
    assert all(name in before for name in OUTPUTS)
    # The next report differs (a comparison against B), and its third file cannot be written (a full disk).
    real, calls = verdict.staged_write, []

    def full_disk(path: Path, data: bytes) -> Path:
        calls.append(path.name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(verdict, "staged_write", full_disk)
    argv = ["report", directory, "--bootstrap-reps", "200", "--baseline", "B"]
    message = refused(argv, capsys, watch=tmp_path)
    assert "No space left on device" in message and "the previous report is left as it was" in message
    # A figure that fails to draw: nothing is written either.
    monkeypatch.setattr(verdict, "staged_write", real)
    monkeypatch.setattr(verdict, "figures", lambda result: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        commands.main([str(a) for a in argv])
    assert tree(directory) == before, "a report that failed changed the previous one or left a temporary file"


def test_curve_points_that_cannot_be_drawn_are_left_out_and_counted(tmp_path: Path, capsys) -> None:
    directory = experiment(tmp_path / "exp")
    metrics = directory / "runs" / "A" / "capped_seed1" / "metrics.jsonl"
    bad = ['{"step": 101, "loss": NaN}', '{"step": 102, "loss": 1e308}', '{"step": 103, "loss": -Infinity}',
           '{"step": 1.5, "loss": 1.0}']  # fmt: skip
    metrics.write_text(metrics.read_text() + "\n".join(bad) + "\n")
    assert commands.main(["report", str(directory), "--bootstrap-reps", "200"]) == 0
    capsys.readouterr()

    def refuse(constant: str):
        raise AssertionError(f"summary.json holds {constant}, which is not JSON")

    summary = json.loads((directory / "summary.json").read_text(), parse_constant=refuse)
    assert summary["curve_points_skipped"] == 4
    assert [s for s, _ in summary["curves"]["A"]["1"]["loss"]] == [20, 40, 60, 80, 100]
    assert "leave out 4 point(s) of metrics.jsonl" in (directory / "report.md").read_text()
    assert (directory / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_planning_with_a_target_no_number_of_seeds_reaches(tmp_path: Path, capsys) -> None:
    directory = experiment(tmp_path / "exp")
    assert (
        commands.main(["report", str(directory), "--bootstrap-reps", "200", "--target-diff", "1e-300"]) == 0
    )
    planning = [
        line for line in (directory / "report.md").read_text().splitlines() if "seeds needed for" in line
    ]
    assert planning and all("None" not in line for line in planning), planning
    assert all("more than 10000, even at the smallest sd the 3 seeds allow" in line for line in planning)


# --- signals ------------------------------------------------------------------------------------------------


def test_sigterm_during_an_arms_dry_run_leaves_no_temporary_file(tmp_path: Path, capsys, monkeypatch) -> None:
    import signal
    import subprocess
    import tempfile
    import time

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    seen: list[str] = []

    def dry_run_stopped(argv, **kwargs):
        recipe = Path(argv[argv.index("--recipe") + 1])
        seen.append(recipe.read_text())  # the arm's recipe is on disk while its dry run runs
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal arrives meanwhile
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(subprocess, "run", dry_run_stopped)
    # Without the command's own handler this test's would take the signal and let the dry run go on.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        started = time.monotonic()
        rc = commands.main(["--out", str(tmp_path / "exp"), "--recipe", "", *ARMS, "--profile", "smoke",
                            "--print-commands"])  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert seen and "CLIP_MODE=element" in seen[0]
    assert rc == 130 and "stopped; rerun the same command to resume" in err
    assert time.monotonic() - started < 5
    assert not list(scratch.iterdir()), "the dry run's temporary recipe was left behind"
    assert not (tmp_path / "exp").exists()
