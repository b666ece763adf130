"""The benchmark table and its loading (opsd.evaluation.benchmarks): names, local copies with each benchmark's real
columns and answer styles (tests/data/benchmarks), the preset protocol and what the command line overrides."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from opsd.errors import UserError
from opsd.evaluation.benchmarks import (
    AIME_PROTOCOL,
    BENCHMARKS,
    benchmark_config,
    load_benchmark,
    parse_benchmark_names,
    parse_local_copies,
    protocol_lines,
    training_settings,
)
from opsd.evaluation.eval_config import EvalConfig, given_flags

DATA = Path(__file__).resolve().parents[1] / "data" / "benchmarks"
DEFAULT = EvalConfig.dataset


def test_the_table_pins_every_benchmark_and_gives_aime_sets_the_aime_2024_protocol() -> None:
    assert list(BENCHMARKS) == ["aime24", "aime25", "hmmt25", "aime26", "hmmt26", "math500", "amc23"]
    for b in BENCHMARKS.values():
        assert re.fullmatch(r"[0-9a-f]{40}", b.revision), b.name
        assert b.split in ("train", "test") and b.problem_column and b.answer_column
    sizes = {name: b.size for name, b in BENCHMARKS.items()}
    assert sizes == {
        "aime24": 30,
        "aime25": 30,
        "hmmt25": 30,
        "aime26": 30,
        "hmmt26": 33,
        "math500": 500,
        "amc23": 40,
    }
    # eval_aime.py's own defaults are the AIME 2024 protocol (docs/method.md §4), which the AIME-style sets take.
    default = EvalConfig(out="x")
    assert (AIME_PROTOCOL.n, AIME_PROTOCOL.max_tokens, AIME_PROTOCOL.thinking) == (
        default.n, default.max_tokens, default.thinking,
    )  # fmt: skip
    for name in ("aime24", "aime25", "aime26", "hmmt25", "hmmt26", "amc23"):
        assert BENCHMARKS[name].protocol == AIME_PROTOCOL
    assert BENCHMARKS["aime24"].dataset == default.dataset  # today's default set, now at a pinned revision
    assert {b.answer_kind for b in BENCHMARKS.values()} == {"integer 0-999", "expression", "number"}


def test_benchmark_names_are_checked() -> None:
    assert parse_benchmark_names("aime24, hmmt25,math500") == ["aime24", "hmmt25", "math500"]
    for text, message in [
        ("aime24,aime2025", "unknown benchmark 'aime2025'; the benchmarks are aime24, aime25"),
        ("aime24,aime24", "names aime24 twice"),
        ("aime24,", "give names separated by commas"),
        ("", "give names separated by commas"),
    ]:
        with pytest.raises(UserError, match=re.escape(message)):
            parse_benchmark_names(text)
    with pytest.raises(UserError, match="unknown benchmark 'bogus'"):
        EvalConfig(out="x", benchmarks="aime24,bogus")  # refused when the flags are read


def test_local_copies_are_name_file_pairs_of_listed_benchmarks() -> None:
    names = ["aime25", "hmmt25"]
    assert parse_local_copies(DEFAULT, names, DEFAULT) == {}
    assert parse_local_copies("aime25=a.jsonl, hmmt25=b.parquet", names, DEFAULT) == {
        "aime25": "a.jsonl", "hmmt25": "b.parquet",
    }  # fmt: skip
    for text, message in [
        ("data/aime25.jsonl", "--dataset gives local copies as NAME=FILE"),
        ("aime25=", "--dataset gives local copies as NAME=FILE"),
        ("math500=m.jsonl", "'math500' is not among --benchmarks (aime25, hmmt25)"),
        ("aime25=a.jsonl,aime25=b.jsonl", "two copies of aime25"),
    ]:
        with pytest.raises(UserError, match=re.escape(message)):
            parse_local_copies(text, names, DEFAULT)


def test_local_copies_keep_their_ids_and_answer_styles() -> None:
    aime = load_benchmark(BENCHMARKS["aime25"], str(DATA / "aime25.jsonl"))
    assert aime.source == str((DATA / "aime25.jsonl").resolve()) and aime.revision is None
    assert [(p["id"], p["answer"], p["index"]) for p in aime.problems] == [
        ("1", "7", 0),
        ("2", "8", 1),
        ("3", "9", 2),
    ]
    hmmt = load_benchmark(BENCHMARKS["hmmt25"], str(DATA / "hmmt25.jsonl"))
    assert [(p["id"], p["answer"]) for p in hmmt.problems] == [
        ("2", "2^{3}"),
        ("3", "\\sqrt{81}"),
        ("1", "\\frac{14}{2}"),
    ]
    math500 = load_benchmark(BENCHMARKS["math500"], str(DATA / "math500.jsonl"))
    assert [p["id"] for p in math500.problems] == [
        "test/prealgebra/3.json", "test/prealgebra/1.json", "test/prealgebra/2.json",
    ]  # fmt: skip
    assert (
        math500.problems[2]["answer"] == "8\\text{ cm}"
        and math500.problems[0]["problem"] == "What is 18 / 2?"
    )


def test_amc_float_answers_become_integers_and_a_wrong_file_is_refused(tmp_path: Path) -> None:
    amc = tmp_path / "amc23.jsonl"
    amc.write_text("".join(json.dumps({"id": i, "question": f"Q{i}", "answer": a}) + "\n"
                           for i, a in enumerate([27.0, 2.5, 36.0])))  # fmt: skip
    loaded = load_benchmark(BENCHMARKS["amc23"], str(amc))
    assert [p["answer"] for p in loaded.problems] == ["27", "2.5", "36"]
    # MATH-500's columns in a file given as AMC 2023's copy: named with the fix, in one line.
    with pytest.raises(UserError, match=r"^benchmark amc23: .* lacks column\(s\) \['question'\]") as err:
        load_benchmark(BENCHMARKS["amc23"], str(DATA / "math500.jsonl"))
    assert "\n" not in str(err.value)
    twice = tmp_path / "twice.jsonl"
    twice.write_text(json.dumps({"problem_idx": 1, "problem": "a", "answer": 1}) + "\n"
                     + json.dumps({"problem_idx": 1, "problem": "b", "answer": 2}) + "\n")  # fmt: skip
    with pytest.raises(UserError, match=r"duplicate problem ids \['1'\]"):
        load_benchmark(BENCHMARKS["aime25"], str(twice))


def test_missing_dataset_offline_is_one_line_naming_it_and_the_local_copy(tmp_path, monkeypatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")
    with pytest.raises(UserError) as err:
        load_benchmark(BENCHMARKS["hmmt26"])
    text = str(err.value)
    assert text.startswith("benchmark hmmt26: dataset MathArena/hmmt_feb_2026 (revision 02fba4f74d8e)")
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in text and "--dataset hmmt26=FILE" in text
    assert "HF_DATASETS_CACHE" in text and "\n" not in text


def test_the_preset_protocol_yields_to_the_flags_given() -> None:
    config = EvalConfig(out="o", n=4, max_tokens=64, thinking=False)
    math500, aime = BENCHMARKS["math500"], BENCHMARKS["aime25"]
    # Nothing given: each benchmark's own preset, whatever the config's values.
    cfg = benchmark_config(config, math500, set(), Path("o/math500"), "src")
    assert (cfg.n, cfg.max_tokens, cfg.thinking, cfg.dataset, cfg.split, cfg.out) == (
        4, 38912, True, "src", "test", "o/math500",
    )  # fmt: skip
    assert benchmark_config(config, aime, set(), Path("o/a"), "src").n == 12
    # Given on the command line, under any of its names: for every benchmark.
    given = given_flags(["--n", "4", "--max_tokens=64", "--no-student-thinking", "--out", "o"])
    assert given == {"n", "max_tokens", "thinking", "out"}
    cfg = benchmark_config(config, aime, given, Path("o/a"), "src")
    assert (cfg.n, cfg.max_tokens, cfg.thinking) == (4, 64, False)
    assert given_flags(["--thinking", "false"]) == {"thinking"} and given_flags(["--no-thinking"]) == {
        "thinking"
    }
    with pytest.raises(UserError, match="--k 8 is invalid for math500: pass@k needs k <= n=4"):
        benchmark_config(dataclasses.replace(config, n=12, k=8), math500, set(), Path("o"), "src")


def test_training_settings_that_differ_are_printed_beside_the_protocol(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoint-100").mkdir(parents=True)
    (run / "opsd_config.json").write_text(
        json.dumps({"student_thinking": False, "max_completion_length": 1024})
    )
    trained = training_settings(str(run / "checkpoint-100"))
    assert trained == {"file": str(run / "opsd_config.json"), "thinking": False, "max_tokens": 1024}
    assert training_settings(str(tmp_path / "elsewhere")) is None
    rows = [
        ("aime25", EvalConfig(out="o")),
        ("math500", EvalConfig(out="o", thinking=False, max_tokens=1024)),
    ]
    lines = protocol_lines(rows, trained)
    assert lines[:3] == [
        "benchmark | n | max tokens | thinking",
        "aime25 | 12 | 38912 | on",
        "math500 | 12 | 1024 | off",
    ]
    assert lines[3:] == [
        f"aime25: training and evaluation differ ({run / 'opsd_config.json'}): thinking: trained off, scored on; "
        "length: trained 1024 tokens, scored 38912"
    ]


# --- local copies checked against the table; pairing over one problem set --------------------------------------


def _aime_rows(ids) -> str:
    return "".join(
        json.dumps({"problem_idx": i, "problem": f"Problem {i}?", "answer": i}) + "\n" for i in ids
    )


def test_a_copy_of_another_row_count_is_warned_and_a_copy_without_its_ids_is_refused(
    tmp_path, caplog
) -> None:
    # Without problem_idx its problems would be numbered 0, 1, ... and paired with the Hub's 1, 2, ...
    no_ids = tmp_path / "no_ids.jsonl"
    no_ids.write_text("".join(json.dumps({"problem": f"P{i}?", "answer": i}) + "\n" for i in range(30)))
    with pytest.raises(UserError) as err:
        load_benchmark(BENCHMARKS["aime25"], str(no_ids))
    assert str(err.value).startswith(
        f"benchmark aime25: the local copy {no_ids} lacks the id column 'problem_idx'"
    )
    refusal = str(err.value)
    assert "keep the column 'problem_idx' of MathArena/aime_2025" in refusal and "\n" not in refusal
    with caplog.at_level("WARNING", logger="opsd.evaluation.benchmarks"):
        short = load_benchmark(BENCHMARKS["aime25"], str(DATA / "aime25.jsonl"))
    (line,) = short.warnings
    assert line == (
        f"benchmark aime25: {(DATA / 'aime25.jsonl').resolve()} holds 3 problems where the table gives 30 "
        f"(MathArena/aime_2025 at c94da77eb22b); its scores are not those of the published set"
    )
    assert line in caplog.text and "\n" not in line
    full = tmp_path / "aime25.jsonl"
    full.write_text(_aime_rows(range(1, 31)))
    assert load_benchmark(BENCHMARKS["aime25"], str(full)).warnings == ()


def test_the_row_count_warning_is_recorded_in_the_summary_and_the_table(tiny_model_dir, tmp_path) -> None:
    """Planned as --benchmarks plans it, a 3-row aime25 copy's warning reaches summary.json, the table's row and
    its markdown (samples written by hand: no engine)."""
    from opsd.evaluation.suite import SINGLE, Entry, benchmark_table, plan_units, table_lines
    from opsd.evaluation.summary import write_summary

    argv = ["--model", str(tiny_model_dir), "--benchmarks", "aime25", "--dataset", f"aime25={DATA / 'aime25.jsonl'}",
            "--n", "2", "--engine", "transformers", "--out", str(tmp_path / "out")]  # fmt: skip
    config = EvalConfig(model=str(tiny_model_dir), benchmarks="aime25", dataset=f"aime25={DATA / 'aime25.jsonl'}",
                        n=2, engine="transformers", out=str(tmp_path / "out"))  # fmt: skip
    (unit,) = plan_units(config, argv, [Entry(SINGLE, "", "base")])
    unit.job.out.mkdir(parents=True)
    sample = {"correct": True, "extracted": "7", "has_box": True, "n_tokens": 3, "truncated": False}
    records = [{"id": p["id"], "idx": i, **sample} for p in unit.job.problems for i in range(2)]
    (unit.job.out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = write_summary(unit.job, {"generation_s": 0.0, "new_tokens": 0}, 0.0)
    (line,) = unit.job.data_warnings
    assert "holds 3 problems where the table gives 30" in line
    assert json.loads((unit.job.out / "summary.json").read_text())["data_warnings"] == [line]
    table = benchmark_table({"aime25": summary})
    assert table["rows"][0]["data_warnings"] == [line]
    assert table_lines(table)[-1] == f"warning: {line}"


def _summary(path: Path, ids, **config) -> Path:
    path.mkdir(parents=True)
    problems = [{"id": str(i), "n": 1, "accuracy": 1.0, "format_rate": 1.0} for i in ids]
    metrics = {"problems": problems, "n_problems": len(problems), "n": 1}
    (path / "summary.json").write_text(json.dumps({"config": {"n": 1, **config}, "metrics": metrics}))
    return path


def test_pairing_a_benchmark_run_over_another_problem_set_is_refused(tmp_path) -> None:
    """A Hub run of aime25 (30 problems) against a 12-row local copy: refused in one line, by --compare of two
    runs and of two --benchmarks directories, where it used to warn and compare the 12 common problems."""
    from opsd.evaluation.report import load_summary, run_compare
    from opsd.evaluation.suite import run_suite_compare

    hub = _summary(
        tmp_path / "hub" / "aime25", range(1, 31), benchmark="aime25", dataset_source="MathArena/aime_2025"
    )
    copy = _summary(
        tmp_path / "copy" / "aime25", range(1, 13), benchmark="aime25", dataset_source="/d/aime25.jsonl"
    )
    expected = (
        f"{hub} and {copy} scored different problems of aime25: 30 from MathArena/aime_2025 and 12 from "
        "/d/aime25.jsonl, 12 in common; a paired comparison needs one problem set"
    )
    with pytest.raises(UserError, match=re.escape(expected)) as err:
        run_compare(EvalConfig(compare=[str(hub), str(copy)]))
    assert "\n" not in str(err.value)
    for d in ("hub", "copy"):
        (tmp_path / d / "benchmarks.json").write_text(json.dumps({"benchmarks": ["aime25"]}))
    with pytest.raises(UserError, match=re.escape(expected)):
        run_suite_compare(EvalConfig(compare=[str(tmp_path / "hub"), str(tmp_path / "copy")]))
    from opsd.evaluation.benchmarks import check_same_problems

    # A plain --dataset run of the benchmark's Hub dataset is that benchmark too.
    plain = _summary(tmp_path / "plain", range(1, 13), dataset_source="MathArena/aime_2025")
    with pytest.raises(UserError, match="scored different problems of aime25"):
        check_same_problems(load_summary(str(hub)), load_summary(str(plain)), "a", "b")
    # One problem set: paired; data outside the table keep paired_compare's warning.
    check_same_problems(load_summary(str(hub)), load_summary(str(hub)), "a", "b")
    other = _summary(tmp_path / "other", range(1, 5), dataset_source="/d/mine.jsonl")
    fewer = _summary(tmp_path / "fewer", range(1, 3), dataset_source="/d/mine.jsonl")
    check_same_problems(load_summary(str(other)), load_summary(str(fewer)), "a", "b")
    assert run_compare(EvalConfig(compare=[str(other), str(fewer)]))
