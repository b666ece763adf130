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
        # --step declares the verdict step: one the experiment scores (each cell's final checkpoint, or with
        # --every-checkpoint every step the capped run saves)
        (
            ["--eval-flags", "--step 50"],
            "--eval-flags --step 50: the experiment scores each cell's final checkpoint "
            "only, checkpoint-100; add --every-checkpoint to score every saved step and report step 50",
        ),
        (
            ["--every-checkpoint", "--eval-flags", "--step 55"],
            "--eval-flags --step '55': the capped run saves "
            "checkpoints at steps 10, 20, 30, 40, 50, 60, 70, 80, 90, 100 only; give one of them as the verdict step",
        ),
        (["--every-checkpoint", "--eval-flags=--step=0"], "--eval-flags --step '0': the capped run saves"),
        (["--eval-flags", "--step " + "9" * 1000], "--eval-flags --step '99999"),
        (["--eval-flags=--step"], "argument --step: expected one argument"),
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
        # A damaged line inside the log (a cut last line is skipped: see the test of the cut line).
        "jobs: not JSON": (
            directory / "jobs.jsonl",
            '{"kind": "base", "start": 1, "seconds": 2}\n{cut\n{}\n',
        ),
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
    from opsd.experiment import rendering

    directory = experiment(tmp_path / "exp")
    assert commands.main(["report", str(directory), "--bootstrap-reps", "200"]) == 0
    capsys.readouterr()
    before = tree(directory)
    assert all(name in before for name in OUTPUTS)
    # The next report differs (a comparison against B), and its third file cannot be written (a full disk).
    real, calls = rendering.staged_write, []

    def full_disk(path: Path, data: bytes) -> Path:
        calls.append(path.name)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, data)

    monkeypatch.setattr(rendering, "staged_write", full_disk)
    argv = ["report", directory, "--bootstrap-reps", "200", "--baseline", "B"]
    message = refused(argv, capsys, watch=tmp_path)
    assert "No space left on device" in message and "the previous report is left as it was" in message
    # A figure that fails to draw: nothing is written either.
    monkeypatch.setattr(rendering, "staged_write", real)
    monkeypatch.setattr(rendering, "figures", lambda result: 1 / 0)
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


def alive(pid: int) -> bool:
    """Whether process `pid` still runs once a signal sent to it has had up to 10 s to land (a zombie waiting for
    its reaper does not run)."""
    import time

    for _ in range(100):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("sig", ["TERM", "HUP"])
def test_a_signal_during_an_arms_dry_run_stops_it_whole_and_leaves_no_temporary_file(
    tmp_path: Path, capsys, monkeypatch, sig: str
) -> None:
    """SIGTERM (a scheduler, kill) and SIGHUP (the terminal closed) stop the command as Ctrl-C does: the arm's dry
    run is stopped with every process it started (here a grandchild), its temporary recipe removed, nothing written.
    The dry run is a shell that keeps a copy of the recipe it was given, starts a grandchild, and signals us."""
    import signal
    import tempfile

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    seen, pid_file = tmp_path / "seen.env", tmp_path / "grandchild.pid"
    script = f'cat "$1" > {seen}; sleep 60 & echo $! > {pid_file}; kill -{sig} $PPID; wait'

    def dry_run_argv(directory: Path, spec, arm: str) -> list[str]:
        return ["bash", "-c", script, "dry-run", str(directory / "recipes" / f"{arm}.env")]

    monkeypatch.setattr(commands, "dry_run_argv", dry_run_argv)
    number = getattr(signal, f"SIG{sig}")
    # Without the command's own handler this test's would take the signal and let the dry run go on.
    previous = signal.signal(number, lambda signum, frame: None)
    try:
        rc = commands.main(["--out", str(tmp_path / "exp"), "--recipe", "", *ARMS, "--profile", "smoke",
                            "--print-commands"])  # fmt: skip
    finally:
        signal.signal(number, previous)
    err = capsys.readouterr().err
    assert "CLIP_MODE=element" in seen.read_text()  # the arm's recipe was on disk while its dry run ran
    assert rc == 130 and "stopped; rerun the same command to resume" in err
    assert not alive(int(pid_file.read_text())), "the dry run's grandchild was left running"
    assert not list(scratch.iterdir()), "the dry run's temporary recipe was left behind"
    assert not (tmp_path / "exp").exists()


# --- files over their cap, a cut last line, links that would move a file to another cell ---------------------


@pytest.mark.parametrize(
    ("where", "named"),
    [
        (
            "evals/B/seed2/checkpoint-100/summary.json",
            "is 100 MiB (104,857,600 bytes); result files are limited to 64 MiB",
        ),
        ("failed.json", "is 100 MiB (104,857,600 bytes); result files are limited to 64 MiB"),
        ("jobs.jsonl", "is 100 MiB (104,857,600 bytes); result files are limited to 64 MiB"),
        ("experiment.json", "is 100 MiB (104,857,600 bytes); experiment files are limited to 16 MiB"),
    ],
)
def test_a_file_over_its_cap_is_refused_naming_the_cap(
    tmp_path: Path, capsys, where: str, named: str
) -> None:
    directory = experiment(tmp_path / "exp")
    with (directory / where).open("ab") as f:  # sparse: nothing is written to the disk
        f.truncate(100 * 2**20)
    for argv in (["report", directory, "--bootstrap-reps", "200"], ["--out", directory, "--print-commands"]):
        message = refused(argv, capsys, watch=tmp_path)
        assert named in message and repr(str(directory / where)) in message, message


def test_a_cut_last_line_of_jobs_jsonl_is_skipped_counted_and_cut_off_by_the_next_record(
    tmp_path: Path, capsys, caplog
) -> None:
    """A stop mid-append leaves the last line of DIR/jobs.jsonl cut: the report leaves it out and says so (it once
    refused the whole report); the runner's next record first cuts it off, so it does not continue the cut line."""
    from opsd.experiment.schedule import append_record

    directory = experiment(tmp_path / "exp")
    jobs = directory / "jobs.jsonl"
    whole = [
        {"kind": "base", "start": 100.0, "seconds": 5.0},
        {"kind": "eval", "start": 110.0, "seconds": 7.0},
    ]
    jobs.write_text("".join(json.dumps(r) + "\n" for r in whole) + '{"kind": "tra')
    assert commands.main(["report", str(directory), "--bootstrap-reps", "200"]) == 0
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["jobs_lines_skipped"] == 1
    assert {k: t["attempts"] for k, t in summary["timing"].items()} == {"base": 1, "eval": 1}
    assert "leave out the last line of jobs.jsonl, cut short" in (directory / "report.md").read_text()
    assert "jobs.jsonl line 3 is cut short" in caplog.text
    # A cut in the middle of a UTF-8 character is a cut all the same.
    jobs.write_bytes(jobs.read_bytes()[:-3] + '{"x": "é'.encode()[:-1])
    assert commands.main(["report", str(directory), "--bootstrap-reps", "200"]) == 0
    assert json.loads((directory / "summary.json").read_text())["jobs_lines_skipped"] == 1
    capsys.readouterr()
    append_record(jobs, {"kind": "train", "start": 120.0, "seconds": 9.0})
    assert [json.loads(line) for line in jobs.read_text().splitlines()][-1]["kind"] == "train"
    assert "its last line was cut by a stop mid-write; dropped" in caplog.text
    assert commands.main(["report", str(directory), "--bootstrap-reps", "200"]) == 0
    summary = json.loads((directory / "summary.json").read_text())
    assert summary["jobs_lines_skipped"] == 0 and summary["timing"]["train"]["attempts"] == 1
    # A whole record that only lacks its newline (an edit by hand) is kept.
    jobs.write_text(jobs.read_text().rstrip("\n"))
    append_record(jobs, {"kind": "eval", "start": 130.0, "seconds": 1.0})
    assert [json.loads(line)["kind"] for line in jobs.read_text().splitlines()] == [
        "base",
        "eval",
        "train",
        "eval",
    ]


def link(path: Path, target: Path) -> None:
    """Replace `path` (a file or directory of the experiment, or nothing) by a link to `target`."""
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()
    path.symlink_to(target)


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("a loop of an evaluation", "evals/B/seed2' is a link that leads back to itself (a loop)"),
        ("a loop of a curve", "metrics.jsonl' is a link that leads back to itself (a loop)"),
        ("another seed's evaluation", "evals/A/seed1' is a link to"),
        ("another arm's run", "runs/B' is a link to"),
        ("two paths to one place", "both lead to"),
    ],
)
def test_a_link_that_would_read_a_file_as_another_cells_is_refused(
    tmp_path: Path, capsys, case: str, named: str
) -> None:
    """A link inside the experiment that changes which cell a file belongs to (it once paired seed 2's evaluation
    with seed 1's cells), and a loop (it once read as "not started", or dropped a curve without a word)."""
    directory = experiment(tmp_path / "exp")
    if case == "a loop of an evaluation":
        link(directory / "evals/B/seed2", directory / "evals/B/seed2")
    elif case == "a loop of a curve":
        link(directory / "runs/A/capped_seed1/metrics.jsonl", directory / "runs/A/capped_seed1/metrics.jsonl")
    elif case == "another seed's evaluation":
        link(directory / "evals/A/seed1", directory / "evals/A/seed2")
    elif case == "another arm's run":
        link(directory / "runs/B", directory / "runs/A")
    else:  # two arms' evaluations moved aside and linked back to one place
        (directory / "evals" / "A").rename(directory / "evals-A")
        link(directory / "evals/A", directory / "evals-A")
        link(directory / "evals/B", directory / "evals-A")
    for argv in (["report", directory, "--bootstrap-reps", "200"], ["--out", directory, "--print-commands"]):
        message = refused(argv, capsys, watch=tmp_path)
        assert named in message, message
    if "link to" in named:
        assert "inside the experiment's own layout: its files would be read as another cell's" in message


# --- messages that name a temporary file ----------------------------------------------------------------------


def test_a_dry_runs_message_names_the_arms_setting_not_its_temporary_recipe(tmp_path: Path) -> None:
    scratch, directory = tmp_path / "tmpabc123", tmp_path / "exp"
    recipe = "# Arm b of an opsd experiment, from: FIXED_ADVANTAGE=1\nFIXED_ADVANTAGE=1.0\nLOSS_TYPE=fixed_advantage\n"
    message = (
        f"train_capped: error: fixed_advantage=1.0 is out of range: must be in [-10000, 0) (from "
        f"{scratch}/recipes/b.env:2); output in {scratch}/runs/b/capped_seed42; see {scratch}/recipes/b.env"
    )
    shown = commands.without_scratch(message, scratch, directory, "b", recipe)
    assert str(scratch) not in shown
    assert "(from --arm b's FIXED_ADVANTAGE=1.0)" in shown and "see --arm b's recipe" in shown
    assert f"output in {directory}/runs/b/capped_seed42" in shown


def test_a_damaged_arm_recipe_in_experiment_json_names_no_temporary_file(tmp_path: Path, capsys) -> None:
    directory = experiment(tmp_path / "exp")
    data = json.loads((directory / "experiment.json").read_text())
    data["arms"]["B"]["recipe"] = {"clip_mode": "none", "beta": "not a number"}
    (directory / "experiment.json").write_text(json.dumps(data))
    message = refused(["report", directory, "--bootstrap-reps", "200"], capsys, watch=tmp_path)
    assert "arm 'B''s recipe does not parse (1 problem(s): line 2: 'BETA=\"not a number\"'" in message, (
        message
    )
    assert "arm.env" not in message


# --- an arm that trains exactly as another -------------------------------------------------------------------


def test_an_arm_whose_resolved_settings_equal_anothers_is_refused(tmp_path: Path, capsys) -> None:
    """`--arm b=FIXED_ADVANTAGE=-1` without loss_type=fixed_advantage trains exactly as the baseline, and report.md
    would show it as another recipe: the arms' resolved settings (their dry runs'), less the fields those leave
    without effect, are equal, and the new arm is refused in one line saying which setting does nothing."""
    argv = ["--out", tmp_path / "exp", "--recipe", "", "--arm", "a=CLIP_MODE=element", "--arm", "b=FIXED_ADVANTAGE=-1",
            "--profile", "smoke", "--print-commands"]  # fmt: skip
    message = refused(argv, capsys, watch=tmp_path)
    assert "arm 'b' (FIXED_ADVANTAGE=-1) trains exactly as arm 'a'" in message, message
    assert "FIXED_ADVANTAGE=-1.0 has no effect: it needs loss_type=fixed_advantage" in message


# --- paths: read where they are given, recorded absolute ---------------------------------------------------------


def test_paths_are_read_where_given_and_recorded_absolute(tmp_path: Path, monkeypatch) -> None:
    """The jobs run in the checkout, not where the command was given: --model, --dataset, --recipe, an arm's
    recipe file, the paths inside --eval-flags and a recipe's prompt files are resolved against the command's
    directory and recorded absolute. A name of a hub id's form is local when that path exists there."""
    from opsd.errors import UserError
    from opsd.experiment import spec as S

    caller = tmp_path / "caller"
    for d in ("m/tiny", "d/ok"):
        (caller / d).mkdir(parents=True)
    (caller / "evalok.jsonl").write_text('{"problem": "1 + 1?", "answer": "2"}\n')
    (caller / "p.txt").write_text("{problem}")
    (caller / "r.env").write_text("TEACHER_PROMPT_FILE=p.txt\n")
    monkeypatch.chdir(caller)
    flags = "--dataset evalok.jsonl --prompt-file=p.txt --n 2"
    a = commands.parse(["--out", str(tmp_path / "exp"), "--recipe", "r.env", "--arm", "x=BETA=0.5", "--arm", "y=r.env",
                        "--model", "m/tiny", "--dataset", "d/ok", "--eval-flags", flags])  # fmt: skip
    spec = commands.make_spec(a, None, [])
    assert (spec.model, spec.dataset) == (str(caller / "m/tiny"), str(caller / "d/ok"))
    assert spec.eval_flags == ["--dataset", str(caller / "evalok.jsonl"), f"--prompt-file={caller / 'p.txt'}",
                               "--n", "2"]  # fmt: skip
    for arm in ("x", "y"):
        assert spec.arms[arm]["recipe"]["teacher_prompt_file"] == str(caller / "p.txt")
    assert spec.arms["x"]["source"] == f"{caller / 'r.env'} + BETA=0.5" and spec.arms["y"]["source"] == str(
        caller / "r.env"
    )
    # Names no local path has stay hub ids; built-in sets and the embedded model stay as they are.
    a = commands.parse(["--out", str(tmp_path / "exp"), "--recipe", "", "--arm", "x=BETA=0.5", "--arm", "y=BETA=1",
                        "--model", "org/model", "--dataset", "org/data", "--eval-flags", "--dataset org/aime"])  # fmt: skip
    spec = commands.make_spec(a, None, [])
    assert (spec.model, spec.dataset, spec.eval_flags) == ("org/model", "org/data", ["--dataset", "org/aime"])
    assert (
        S.absolute_path("builtin:easy", data=True) == "builtin:easy"
        and S.absolute_path("embedded") == "embedded"
    )
    # A data file's name is local whether or not it exists (the check then names it absolute).
    assert S.absolute_path("none.jsonl", data=True) == str(caller / "none.jsonl")
    # A shortened path flag would pass unchanged, its path relative: eval_aime.py refuses it.
    with pytest.raises(UserError, match="unrecognized arguments: --datas evalok.jsonl"):
        S.check_eval_flags(S.absolute_eval_flags(["--datas", "evalok.jsonl"]))


# --- the verdict step (--eval-flags --step) and the arms' values past their bounds, accepted or refused -------------


def fake_dry_runs(monkeypatch) -> None:
    """The arms' dry runs (each a train_capped.sh --dry-run, seconds an arm) as their resolved settings: what these
    tests check comes before or after them."""

    def dry_run_arms(directory, spec, arms):
        return {arm: dict(spec.arms[arm]["recipe"]) for arm in arms}

    monkeypatch.setattr(commands, "dry_run_arms", dry_run_arms)


@pytest.mark.parametrize(
    ("extra", "step"),
    [
        (["--eval-flags", "--step 100"], 100),
        (["--every-checkpoint", "--eval-flags", "--step 50"], 50),
        (["--every-checkpoint", "--eval-flags", "--n 2 --step=50"], 50),
        ([], 100),
    ],
)
def test_a_verdict_step_the_experiment_scores_is_accepted_and_recorded(
    tmp_path: Path, capsys, monkeypatch, extra: list[str], step: int
) -> None:
    """The default, final step and, with --every-checkpoint, a saved step are accepted (both were refused as "invalid
    without --checkpoints": the experiment adds --checkpoints itself). The step is the verdict's
    (`cells.declared_step`, summary.json's `step`); each cell's evaluation declares it, the base model's, which
    has no checkpoints, does not carry it."""
    from opsd.experiment import cells as C
    from opsd.experiment import spec as S

    fake_dry_runs(monkeypatch)
    directory = tmp_path / "exp"
    argv = [
        "--out",
        directory,
        "--recipe",
        "",
        *ARMS,
        "--profile",
        "smoke",
        "--seeds",
        "42",
        *extra,
        "--print-commands",
    ]
    assert commands.main([str(a) for a in argv]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out.splitlines()
    assert C.declared_step(S.load(directory)) == step
    base = [line for line in out if "eval_aime.py" in line and "--checkpoints" not in line]
    cells = [line for line in out if "--checkpoints" in line]
    assert len(base) == 1 and "--step" not in base[0]
    assert len(cells) == 2 and all(("--step" in line) == bool(extra) for line in cells)
    assert all(f"--step {step}" in line or f"--step={step}" in line for line in cells if extra)
    # A rerun without --every-checkpoint would score checkpoint-100 alone: a step before it is refused then.
    if step != 100:
        message = refused(["--out", directory, "--print-commands"], capsys, watch=tmp_path)
        assert "add --every-checkpoint to score every saved step" in message


def test_an_arms_value_past_its_bound_is_refused_by_its_dry_run(tmp_path: Path, capsys, monkeypatch) -> None:
    """METHOD=grpo NUM_GENERATIONS=1000000000 in an --arm: refused in one line by the arm's dry run (here in this
    process, as train_capped.sh runs it), naming the arm and the bound; it once passed and died at step 1."""
    from tests.conftest import ENV, in_process

    def run_group(argv, *, env, cwd):
        res = in_process("train_capped.sh", argv[2:], env={**env, **ENV}, cwd=cwd)
        return res.returncode, res.stdout, res.stderr

    monkeypatch.setattr(commands, "run_group", run_group)
    for arm, bound in (
        (
            "g=METHOD=grpo,NUM_GENERATIONS=1000000000",
            "num_generations=1000000000 is out of range: must be in [0, 1024]",
        ),
        (
            "g=TEACHER_CONTRAST=shuffled,CONTRAST_KL_TAU=1e-300",
            "contrast_kl_tau=1e-300 is out of range: must be 0 or in",
        ),
    ):
        argv = ["--out", tmp_path / "exp", "--recipe", "", "--arm", arm, "--arm", "b=CLIP_MODE=none", "--profile",
                "smoke", "--print-commands"]  # fmt: skip
        message = refused(argv, capsys, watch=tmp_path)
        assert message.startswith("opsd.experiment: error: arm 'g' (") and bound in message, message
