"""The experiment with `--benchmarks` in its evaluation flags (opsd.experiment.spec, commands): `--dataset`'s local
copies NAME=FILE,... recorded with each FILE absolute, every benchmark checked as eval_aime.py reads it before any
job runs, and the report's pairing check reading each benchmark's evaluations. In process, on the local copies of
tests/data/benchmarks."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from opsd.errors import UserError
from opsd.evaluation.benchmarks import BENCHMARKS, parse_local_copies
from opsd.experiment import commands
from opsd.experiment import spec as S
from tests.unit.test_benchmarks_verdict import experiment

DATA = Path(__file__).resolve().parents[1] / "data" / "benchmarks"
ARMS = ["--arm", "a=CLIP_MODE=element", "--arm", "b=CLIP_MODE=none"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in [k for k in os.environ if k.startswith("OPSD_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: visible_gpus reads this, not torch


@pytest.fixture
def offline(tmp_path: Path, monkeypatch) -> None:
    """No Hub and an empty datasets cache (where the local copies read are cached): a benchmark without a local
    copy cannot be had."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")


def refused(argv: list, capsys) -> str:
    """commands.main(argv): exit status 2, one line on stderr and nothing on stdout; that line."""
    rc = commands.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, (rc, out, err)
    assert lines[0].startswith("opsd.experiment: error: "), err
    return lines[0]


def bench_spec(eval_flags: list[str]) -> S.Spec:
    return S.Spec(profile="smoke", model="", dataset="builtin", eval_flags=eval_flags, gpus_per_run=0)


# --- local copies recorded absolute, each against the directory it was given in -------------------------------------


def test_local_copies_are_recorded_absolute_name_by_name(tmp_path: Path, monkeypatch) -> None:
    caller = tmp_path / "caller"
    (caller / "sub").mkdir(parents=True)
    monkeypatch.chdir(caller)
    given = "aime25=aime25.jsonl, hmmt25=sub/hmmt25.jsonl"
    flags = ["--benchmarks", "aime25,hmmt25", "--n", "2"]
    expected = f"aime25={caller / 'aime25.jsonl'}, hmmt25={caller / 'sub' / 'hmmt25.jsonl'}"  # names as given
    assert S.absolute_eval_flags([*flags, "--dataset", given]) == [*flags, "--dataset", expected]
    assert S.absolute_eval_flags([f"--dataset={given}", *flags]) == [f"--dataset={expected}", *flags]
    assert parse_local_copies(expected, ["aime25", "hmmt25"], default="unused") == {
        "aime25": str(caller / "aime25.jsonl"), "hmmt25": str(caller / "sub" / "hmmt25.jsonl"),
    }  # fmt: skip
    # An absolute FILE stays, and an item that is no NAME=FILE is left for the check to refuse.
    absolute = f"aime25={DATA / 'aime25.jsonl'}"
    assert S.absolute_eval_flags([*flags, "--dataset", absolute]) == [*flags, "--dataset", absolute]
    assert S.absolute_eval_flags([*flags, "--dataset", "aime25.jsonl"])[-1] == "aime25.jsonl"
    # Without --benchmarks, --dataset is one path, made absolute whole.
    assert S.absolute_eval_flags(["--dataset", "a=b.jsonl"]) == ["--dataset", str(caller / "a=b.jsonl")]


# --- every benchmark checked as eval_aime.py reads it, before anything is written -----------------------------------


def test_benchmarks_with_local_copies_pass_the_check_and_a_bad_copy_is_refused(
    tmp_path: Path, offline, monkeypatch
) -> None:
    import opsd.evaluation.benchmarks as B

    copies = f"aime25={DATA / 'aime25.jsonl'},hmmt25={DATA / 'hmmt25.jsonl'}"
    read, load = [], B.load_benchmark
    monkeypatch.setattr(
        B,
        "load_benchmark",
        lambda bench, local=None: read.append(f"{bench.name}={local}") or load(bench, local),
    )
    S.check_spec_inputs(bench_spec(["--benchmarks", "aime25,hmmt25", "--dataset", copies]), fetch=True)
    assert read == copies.split(","), "each benchmark is read from its own copy, offline"

    no_answer = tmp_path / "hmmt25.jsonl"
    no_answer.write_text(json.dumps({"problem_idx": 1, "problem": "What is 3 + 4?"}) + "\n")
    for dataset, named in [
        (f"hmmt25={no_answer}", "lacks column(s) ['answer']"),
        (f"hmmt25={tmp_path / 'none.jsonl'}", f"--eval-flags --dataset hmmt25={tmp_path / 'none.jsonl'}: "),
        (f"aime24={DATA / 'aime25.jsonl'}", "'aime24' is not among --benchmarks (hmmt25)"),
        (str(DATA / "aime25.jsonl"), "with --benchmarks, --dataset gives local copies as NAME=FILE"),
    ]:
        with pytest.raises(UserError) as err:
            S.check_spec_inputs(bench_spec(["--benchmarks", "hmmt25", "--dataset", dataset]), fetch=True)
        assert named in str(err.value) and "\n" not in str(err.value), str(err.value)
        assert str(err.value).startswith("--eval-flags"), str(err.value)


def test_a_benchmark_missing_offline_is_refused_where_the_jobs_would_run(offline) -> None:
    """Without a local copy a benchmark comes from the datasets cache: missing there offline, a run is refused
    naming it and the local copy; a plan printed for another machine (fetch off) does not read this cache."""
    flags = ["--benchmarks", "aime25,math500", "--dataset", f"aime25={DATA / 'aime25.jsonl'}"]
    with pytest.raises(UserError) as err:
        S.check_spec_inputs(bench_spec(flags), fetch=True)
    text = str(err.value)
    assert text.startswith(f"--eval-flags: benchmark math500: dataset {BENCHMARKS['math500'].dataset}"), text
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in text and "--dataset math500=FILE" in text
    S.check_spec_inputs(bench_spec(flags), fetch=False)
    with pytest.raises(UserError, match="--dataset aime25="):  # a local copy is checked either way
        S.check_spec_inputs(bench_spec([*flags[:-1], "aime25=/nonexistent/aime25.jsonl"]), fetch=False)


def test_the_command_refuses_a_bad_benchmark_or_copy_in_one_line_before_writing(
    tmp_path: Path, capsys, monkeypatch, offline
) -> None:
    monkeypatch.chdir(tmp_path)
    shutil.copy(DATA / "aime25.jsonl", tmp_path / "aime25.jsonl")
    (tmp_path / "no_answer.jsonl").write_text(
        json.dumps({"problem_idx": 1, "problem": "What is 3 + 4?"}) + "\n"
    )
    argv = ["--out", tmp_path / "exp", "--recipe", "", *ARMS, "--profile", "smoke", "--print-commands"]
    for flags, named in [
        ("--benchmarks aime25,aime99", "unknown benchmark 'aime99'"),
        ("--benchmarks aime25,hmmt25 --dataset aime25=aime25.jsonl,hmmt25=copies/hmmt25.jsonl",
         f"--eval-flags --dataset hmmt25={tmp_path / 'copies' / 'hmmt25.jsonl'}: "),
        # aime25's copy is read first: the refusal of hmmt25's is still the only line on stderr.
        ("--benchmarks aime25,hmmt25 --dataset aime25=aime25.jsonl,hmmt25=no_answer.jsonl",
         "--eval-flags: benchmark hmmt25: "),
    ]:  # fmt: skip
        message = refused([*argv, "--eval-flags", flags], capsys)
        assert named in message, message
        assert not (tmp_path / "exp").exists()


# --- the report's pairing check reads each benchmark's evaluations --------------------------------------------------


@pytest.mark.parametrize("what", ["other problem ids", "another --n"])
def test_a_benchmark_scored_with_other_flags_is_named_by_the_report(
    tmp_path: Path, capsys, what: str
) -> None:
    directory = experiment(tmp_path / "exp")
    cell = S.eval_dir(directory, "B", 2) / "checkpoint-100" / "hmmt25"
    rows = [json.loads(line) for line in (cell / "samples.jsonl").read_text().splitlines()]
    summary = json.loads((cell / "summary.json").read_text())
    if what == "other problem ids":
        rows = [{**r, "id": f"other-{r['id']}"} for r in rows]
        named = "share no problem id (2 and 2 problems), so seed 2's samples of hmmt25 cannot be paired"
    else:
        rows = [r for r in rows if r["idx"] < 2]
        summary["metrics"]["n"] = 2
        named = "holds 4 samples per problem and"
    (cell / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (cell / "summary.json").write_text(json.dumps(summary))
    message = refused(["report", directory, "--bootstrap-reps", "200"], capsys)
    assert named in message and "seed 2's samples of hmmt25 cannot be paired" in message, message
    base = S.base_eval_dir(directory, 2) / "hmmt25"
    for evaluation in (base, cell):  # the pair the statistics refused, each benchmark's own file
        assert repr(str(evaluation / "samples.jsonl")) in message, message
    assert not (directory / "summary.json").exists()
