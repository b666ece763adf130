"""eval_aime.py run as a subprocess with the real engines (vLLM CPU, transformers) on tiny models.

Correctness accounting needs completions that contain boxed answers, which a random model never
writes. So the module trains, in a few seconds, a LoRA adapter ("the boxer") on top of the tiny model
that answers any of our three problems with `\\boxed{7}`, `\\boxed{8}` or `I am not sure.`, each about
a third of the time. Sampled at temperature 1 this gives right, wrong and missing answers in one run,
and since only the adapter can produce a box, boxes in the output also show that the adapter was applied
(served as a LoRA with --no-merge-adapter, merged by default on the CPU).
The metrics are then recomputed from samples.jsonl with code written here, not opsd.evaluation.metrics.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import re
import statistics
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from opsd.evaluation.samples import sample_seed
from opsd.grading import answer_key
from tests.conftest import (
    BOXER_PROBLEMS,
    EVAL_SCRIPT,
    PNG_SIGNATURE,
    eval_in_process,
    kill_eval_at,
    ok,
    run_eval,
    train_boxer,
)

PROBLEMS = BOXER_PROBLEMS

pytestmark = pytest.mark.slow


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def problems_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "three.jsonl"
    return write_jsonl(path, [{"id": i, "problem": p, "answer": a} for i, p, a in PROBLEMS])


@pytest.fixture(scope="module")
def boxer(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(base model dir, LoRA checkpoint dir `.../checkpoint-100`) trained to box 7 or 8 or give up."""
    root = tmp_path_factory.mktemp("boxer")
    base_dir, adapter_dir = root / "base", root / "run" / "checkpoint-100"
    loss = train_boxer(tiny_model_dir, base_dir, {200: adapter_dir})
    # Three equally likely endings: the optimum mean token loss is well below 1 (it started near 34).
    assert loss < 0.5
    return base_dir, adapter_dir


# --- the end-to-end run, checked against an independent recomputation ------------------------------------


def last_box(text: str) -> str | None:
    found = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return found[-1] if found else None


def test_vllm_lora_end_to_end_matches_hand_recomputation(boxer, problems_file, tmp_path):
    base_dir, adapter_dir = boxer
    out = tmp_path / "e2e"
    proc = ok(
        run_eval(
            "--model",
            base_dir,
            "--adapter",
            adapter_dir,
            "--no-merge-adapter",  # vLLM's LoRA serving, which a CPU run would not use by default
            "--dataset",
            problems_file,
            "--n",
            4,
            "--max-tokens",
            16,
            "--max-model-len",
            512,
            "--out",
            out,
            "--plot",
        )
    )
    assert "avg@4" in proc.stdout and "adapter: vllm-lora" in proc.stdout

    samples = read_jsonl(out / "samples.jsonl")
    by_id: dict[str, list[dict]] = {}
    for s in samples:
        by_id.setdefault(s["id"], []).append(s)
    assert list(by_id) == ["p0", "p1", "p2"]
    gold = {i: a for i, _, a in PROBLEMS}
    for pid, rows in by_id.items():
        assert sorted(r["idx"] for r in rows) == [0, 1, 2, 3]
        assert [("prompt" in r) for r in sorted(rows, key=lambda r: r["idx"])] == [True, False, False, False]
        for r in rows:
            assert r["gold"] == gold[pid]
            assert r["extracted"] == last_box(r["text"])
            assert r["has_box"] == (r["extracted"] is not None)
            assert r["correct"] == (r["extracted"] == gold[pid])
    n_correct = sum(s["correct"] for s in samples)
    n_boxed = sum(s["has_box"] for s in samples)
    # A mix of right, wrong and missing answers, which only the served adapter can produce.
    assert 0 < n_correct < n_boxed < len(samples)

    def rate(values):  # percent over problems, and its SE over problems
        return 100 * statistics.mean(values), 100 * statistics.stdev(values) / math.sqrt(len(values))

    def majority_right(rows):  # answers vote by value (answer_key), as maj@n does
        votes = Counter(
            answer_key(r["extracted"])
            for r in sorted(rows, key=lambda r: r["idx"])
            if r["extracted"] is not None
        )
        if not votes:
            return False
        top = max(votes.values())
        answer = next(a for a in votes if votes[a] == top)  # Counter keeps first-seen order for ties
        return answer == answer_key(gold[rows[0]["id"]])

    groups = list(by_id.values())
    expected = {
        "avg": rate([sum(r["correct"] for r in g) / 4 for g in groups]),
        "pass_at_k": rate([float(any(r["correct"] for r in g)) for g in groups]),  # k = n: any correct
        "maj": rate([float(majority_right(g)) for g in groups]),
        "format_rate": rate([sum(r["has_box"] for r in g) / 4 for g in groups]),
        "truncation_rate": rate([sum(r["truncated"] for r in g) / 4 for g in groups]),
    }
    summary = json.loads((out / "summary.json").read_text())
    metrics = summary["metrics"]
    for key, (value, se) in expected.items():
        assert metrics[key] == pytest.approx(value), key
        assert metrics[f"{key}_se"] == pytest.approx(se), key
    assert metrics["mean_tokens"] == pytest.approx(
        statistics.mean(statistics.mean(r["n_tokens"] for r in g) for g in groups)
    )
    assert metrics["labels"] == {"avg": "avg@4", "pass_at_k": "pass@4", "maj": "maj@4"}
    assert summary["engine"] == "vllm" and summary["adapter_mode"] == "vllm-lora" and summary["step"] == 100
    assert summary["config"]["merge_adapter"] == "false"
    saved = json.loads((out / "eval_config.json").read_text())
    assert saved["adapter_mode"] == "vllm-lora" and saved["merge_adapter"] == "false"
    assert summary["new_samples"] == 12 and summary["new_tokens"] == sum(s["n_tokens"] for s in samples)
    assert summary["config"]["n"] == 4 and summary["config"]["max_model_len_used"] == 512
    assert summary["versions"]["vllm"] and summary["versions"]["torch"]
    # Every sample names its grader; none of these short answers went to the long-answer fallback.
    assert {s["grader"] for s in samples} == {"math-verify"}
    assert summary["grading"] == {"max_verify_chars": 1000, "string_fallback_long_answers": 0}

    with (out / "per_problem.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [row["id"] for row in table] == ["p0", "p1", "p2"]
    for row, g in zip(table, groups, strict=True):
        assert int(row["n_correct"]) == sum(r["correct"] for r in g) and row["gold"] == gold[row["id"]]
    assert (out / "per_problem.png").read_bytes()[:8] == PNG_SIGNATURE


# --- how an adapter is applied: merged by default on vLLM's CPU backend ----------------------------------


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="the default merges on vLLM's CPU backend only"
)
def test_cpu_adapter_default_is_merged_and_equals_merge_adapter(boxer, problems_file, tmp_path):
    base_dir, adapter_dir = boxer
    # 24 problems (the three, repeated under new ids) x 8 samples: a full-size CPU run of a LoRA checkpoint.
    many = write_jsonl(tmp_path / "24.jsonl", [
        {"id": f"q{j:02d}", "problem": PROBLEMS[j % 3][1], "answer": PROBLEMS[j % 3][2]} for j in range(24)
    ])  # fmt: skip
    common = ["--model", base_dir, "--adapter", adapter_dir, "--dataset", many]
    common += ["--n", 8, "--max-tokens", 16, "--max-model-len", 512]
    auto, forced = tmp_path / "auto", tmp_path / "forced"
    with ThreadPoolExecutor(2) as pool:  # two independent processes of one OpenMP thread each, side by side
        auto_run = pool.submit(run_eval, *common, "--out", auto)
        forced_run = pool.submit(run_eval, *common, "--merge-adapter", "--out", forced)
        proc = ok(auto_run.result())
        ok(forced_run.result())
    assert "adapter: merged" in proc.stdout
    for out, flag in ((auto, "auto"), (forced, "true")):
        saved = json.loads((out / "eval_config.json").read_text())
        summary = json.loads((out / "summary.json").read_text())
        assert saved["merge_adapter"] == flag and saved["adapter_mode"] == "merged"
        assert summary["adapter_mode"] == "merged" and summary["config"]["adapter_mode"] == "merged"
    samples = read_jsonl(auto / "samples.jsonl")
    assert samples == read_jsonl(forced / "samples.jsonl")  # the same path, so the same samples
    assert len(samples) == 24 * 8 and any(s["has_box"] for s in samples)  # only the adapter boxes

    # The same command again resumes (nothing left to sample); switching the path is refused with the
    # flag that matches the saved run, before any engine starts.
    again = ok(run_eval(*common, "--out", auto))
    assert "adapter: merged" in again.stdout
    assert json.loads((auto / "summary.json").read_text())["new_samples"] == 0
    switched = run_eval(*common, "--no-merge-adapter", "--out", auto)
    assert switched.returncode == 2 and "Traceback" not in switched.stderr
    assert "adapter_mode: saved 'merged', now 'vllm-lora'" in switched.stderr
    assert "--merge-adapter resumes it" in switched.stderr
    assert read_jsonl(auto / "samples.jsonl") == samples


FLAG_SPELLINGS = {
    (): "auto",
    ("--merge-adapter",): "true",
    ("--merge_adapter",): "true",
    ("--no-merge-adapter",): "false",
    ("--no_merge_adapter",): "false",
    ("--merge-adapter", "false"): "false",
    ("--merge_adapter", "True"): "true",
    ("--merge-adapter=auto",): "auto",
    ("--no-merge-adapter", "--merge-adapter"): "true",  # the last flag wins
}


@pytest.mark.parametrize("flags", list(FLAG_SPELLINGS), ids=lambda f: " ".join(f) or "none")
def test_merge_adapter_flag_spellings(flags):
    from opsd.evaluation.eval_config import parse_eval_args

    config = parse_eval_args(["--adapter", "ckpt", *flags, "--n", "3", "--out", "x"])
    assert config.merge_adapter == FLAG_SPELLINGS[flags] and config.n == 3  # a bare flag takes no value


def test_merge_adapter_bad_values_are_user_errors():
    from opsd.errors import UserError
    from opsd.evaluation.eval_config import parse_eval_args

    with pytest.raises(UserError, match="choose auto, true"):
        parse_eval_args(["--adapter", "ckpt", "--merge-adapter", "maybe", "--out", "x"])
    with pytest.raises(UserError, match="--merge-adapter needs --adapter"):
        parse_eval_args(["--merge-adapter", "--out", "x"])


# Training's names for eval's thinking and prompt-file flags, in both spellings: (flags, thinking, prompt_file).
TRAINING_NAME_CASES = [
    ((), True, ""),
    (("--student-thinking", "false"), False, ""),
    (("--student_thinking",), True, ""),
    (("--no-student-thinking",), False, ""),
    (("--no_student_thinking",), False, ""),
    (("--student-prompt-file", "p.txt"), True, "p.txt"),
    (("--student_prompt_file=p.txt",), True, "p.txt"),
    (("--no-thinking", "--prompt-file", "p.txt"), False, "p.txt"),  # eval's own names still work
]


@pytest.mark.parametrize(("flags", "thinking", "prompt_file"), TRAINING_NAME_CASES)
def test_eval_takes_trainings_names_for_thinking_and_the_prompt_file(flags, thinking, prompt_file):
    from opsd.evaluation.eval_config import parse_eval_args

    config = parse_eval_args([*flags, "--n", "3", "--out", "x"])
    assert (config.thinking, config.prompt_file, config.n) == (thinking, prompt_file, 3)


@pytest.mark.parametrize(
    ("flags", "shown"),
    [
        (("--thinking", "--student-thinking"), "--thinking and --student_thinking"),
        (("--no-thinking", "--student_thinking=true"), "--no_thinking and --student_thinking"),
        (("--student-thinking", "--no-thinking"), "--no_thinking and --student_thinking"),
        (("--prompt_file", "a", "--student-prompt-file", "b"), "--prompt_file and --student_prompt_file"),
    ],
)
def test_eval_refuses_one_setting_under_both_names(flags, shown):
    from opsd.errors import UserError
    from opsd.evaluation.eval_config import parse_eval_args

    with pytest.raises(UserError, match=f"^command line: {shown} are both given") as err:
        parse_eval_args([*flags, "--out", "x"])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("merge", "engine", "cuda", "expected"),
    [
        ("auto", "vllm", False, "merged"),  # vLLM's CPU backend
        ("auto", "vllm", True, "vllm-lora"),  # a GPU: serve the LoRA
        ("auto", "transformers", False, "peft"),
        ("auto", "transformers", True, "peft"),
        ("true", "vllm", True, "merged"),
        ("true", "transformers", False, "merged"),
        ("false", "vllm", False, "vllm-lora"),
        ("false", "transformers", True, "peft"),
    ],
)
def test_adapter_mode_resolution(merge, engine, cuda, expected):
    from opsd.evaluation.job import resolve_adapter_mode

    assert resolve_adapter_mode(merge, engine, True, cuda) == expected
    assert resolve_adapter_mode(merge, engine, False, cuda) is None


# --- the vLLM engine dying mid-run ------------------------------------------------------------------------


def load_script():
    spec = importlib.util.spec_from_file_location("eval_aime_under_test", EVAL_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_engine_death_mid_stream_exits_2_keeps_finished_samples_and_rerun_resumes(
    vllm_tiny, tiny_model_dir, problems_file, tmp_path, monkeypatch, capsys
):
    """In-process run on the shared real vLLM engine, whose engine loop raises after 2 samples finished."""
    from vllm.v1.engine.exceptions import EngineDeadError

    import opsd.evaluation.generate as generate

    script = load_script()
    monkeypatch.setattr(generate, "build_engine", lambda job, scratch: (vllm_tiny, None))
    engine = vllm_tiny.llm.llm_engine
    real_step, real_add = engine.step, engine.add_request
    added, finished, fail_after = [], [], [2]

    def step():
        if fail_after and len(finished) >= fail_after[0]:  # what vLLM raised on the CPU backend
            raise EngineDeadError() from RuntimeError("CPU Generator does not use offset")
        outputs = real_step()
        finished.extend(o for o in outputs if o.finished)
        return outputs

    def add_request(request_id, prompt, params, **kwargs):
        added.append(params.seed)
        return real_add(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(engine, "add_request", add_request)
    out = tmp_path / "dies"
    args = ["--model", tiny_model_dir, "--dataset", problems_file, "--n", 2, "--max-tokens", 8]
    args = [*map(str, args), "--max-model-len", "512", "--max-in-flight", "2"]

    assert script.main([*args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [x for x in err.splitlines() if "vLLM engine died" in x]
    assert line.startswith("failed: the vLLM engine died during generation (EngineDeadError: ")
    assert "caused by RuntimeError: CPU Generator does not use offset" in line
    assert f"the 2 samples written so far are kept in {out / 'samples.jsonl'}" in line
    assert "a rerun of the same command resumes" in line
    assert "Traceback" in (out / "engine_error.log").read_text()
    kept = (out / "samples.jsonl").read_bytes()
    # Two in flight, sample 0 of every problem first: the first two to finish are sample 0 of p0 and p1.
    assert sorted((r["id"], r["idx"]) for r in read_jsonl(out / "samples.jsonl")) == [("p0", 0), ("p1", 0)]
    assert not (out / "summary.json").exists()
    assert engine.get_num_unfinished_requests() == 0  # the requests in flight were aborted

    added.clear()
    fail_after.clear()
    assert script.main([*args, "--out", str(out)]) == 0
    # Only the 4 missing samples were requested, each with its own seed.
    seeds = {(p, i): sample_seed(0, k, i) for k, p in enumerate(("p0", "p1", "p2")) for i in (0, 1)}
    assert sorted(added) == sorted(seeds[key] for key in [("p2", 0), ("p0", 1), ("p1", 1), ("p2", 1)])
    assert (out / "samples.jsonl").read_bytes().startswith(kept)
    resumed = read_jsonl(out / "samples.jsonl")
    assert sorted((r["id"], r["idx"]) for r in resumed) == sorted(seeds)
    assert all(r["request_seed"] == seeds[(r["id"], r["idx"])] for r in resumed)
    assert json.loads((out / "summary.json").read_text())["new_samples"] == 4

    # The interrupted and resumed run holds the samples an uninterrupted run draws.
    assert script.main([*args, "--out", str(tmp_path / "whole")]) == 0
    whole = read_jsonl(tmp_path / "whole" / "samples.jsonl")
    assert sorted(whole, key=lambda r: (r["id"], r["idx"])) == sorted(
        resumed, key=lambda r: (r["id"], r["idx"])
    )


# --- resume ---------------------------------------------------------------------------------------------


def test_kill_mid_stream_and_resume(tiny_model_dir, tmp_path):
    out = tmp_path / "resume"
    samples_path = out / "samples.jsonl"
    # 30 problems x 4 samples streamed at most 8 at a time: long enough to kill after the first samples.
    # The default max_model_len (40960) is also cut to the tiny model's 2048 on the way.
    args = ["--model", tiny_model_dir, "--dataset", "builtin", "--n", 4, "--max-tokens", 96]
    args = [*args, "--max-in-flight", 8, "--out", out]
    kill_eval_at(args, tmp_path / "killed.log", samples_path, 4, seconds=240)
    before = samples_path.read_bytes()
    lines = before[: before.rfind(b"\n") + 1].splitlines(keepends=True)
    assert 4 <= len(lines) < 120, "the run must be killed part way"
    # A kill inside a write can leave a torn line; make that happen whatever the kill hit: drop the last
    # two samples and end the file with a torn line.
    kept, dropped = lines[:-2], [json.loads(line) for line in lines[-2:]]
    complete = b"".join(kept)
    samples_path.write_bytes(complete + b'{"id": "builtin-029", "idx": 0, "text": "tor')
    done = len(kept)

    refused = run_eval(*args[:-2], "--temperature", 0.5, "--out", out)
    assert refused.returncode == 2 and "temperature" in refused.stderr and "Traceback" not in refused.stderr

    ok(run_eval(*args))
    after = samples_path.read_bytes()
    assert after.startswith(complete)  # pre-kill lines unchanged, byte for byte
    records = read_jsonl(samples_path)
    keys = [(r["id"], r["idx"]) for r in records]
    assert len(keys) == len(set(keys)) == 120
    assert set(keys) == {(f"builtin-{p:03d}", i) for p in range(30) for i in range(4)}
    # Every sample has its own seed: the dropped samples come out as in the killed run (vLLM on the CPU is
    # deterministic for a seeded request), and the resumed run generated only what was missing.
    redone = {(r["id"], r["idx"]): r for r in records}
    for d in dropped:
        r = redone[(d["id"], d["idx"])]
        assert (r["text"], r["request_seed"]) == (d["text"], d["request_seed"])
    assert all(r["request_seed"] == sample_seed(0, r["problem_index"], r["idx"]) for r in records)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["new_samples"] == 120 - done
    assert summary["metrics"]["n_problems"] == 30 and summary["config"]["max_model_len_used"] == 2048


# --- errors ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def error_inputs(tmp_path_factory, problems_file) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("errors")
    (root / "not-an-adapter").mkdir()
    (root / "a-file").write_text("keep me\n")
    (root / "aime.jsonl").symlink_to("/dev/urandom")
    return {
        "good": problems_file,
        "wrong_columns": write_jsonl(root / "wrong.jsonl", [{"question": "1 + 1?", "solution": "2"}]),
        "not_adapter": root / "not-an-adapter",
        "file": root / "a-file",
        "urandom": root / "aime.jsonl",
    }


ERROR_CASES = {
    "missing dataset file": (["--dataset", "{missing}/nope.jsonl"], "does not exist"),
    "wrong columns": (["--dataset", "{wrong_columns}"], "lacks column(s) ['problem', 'answer']"),
    "n = 0": (["--n", "0"], "n=0 is invalid"),
    "k > n": (["--n", "4", "--k", "5"], "k=5 is invalid: pass@k needs 1 <= k <= n=4"),
    "missing model dir": (["--model", "{missing}/model"], "is not a model directory (no config.json)"),
    "missing adapter dir": (["--adapter", "{missing}/checkpoint-9"], "adapter directory"),
    "adapter without config": (["--adapter", "{not_adapter}"], "has no adapter_config.json"),
    # Paths of the wrong kind: refused before anything loads, never read without end, nothing written.
    "out is a file": (["--out", "{file}"], "--out '{file}' is a regular file, not a directory"),
    "adapter is a file": (
        ["--adapter", "{file}"], "adapter directory '{file}' is a regular file, not a directory",
    ),
    "checkpoints is a file": (
        ["--checkpoints", "{file}"], "--checkpoints '{file}' is a regular file, not a directory",
    ),
    "compare a file": (
        ["--compare", "{file}", "{not_adapter}"], "--compare directory '{file}' is a regular file",
    ),
    "aggregate a file": (["--aggregate", "{file}"], "--aggregate directory '{file}' is a regular file"),
    "fp8 KV cache off a GPU": (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 needs vLLM on a GPU"),
    "unknown KV cache dtype": (["--kv-cache-dtype", "int4"], "kv_cache_dtype='int4' is invalid: choose one of"),
    "prompt file /dev/zero": (
        ["--prompt-file", "/dev/zero"], "prompt template file '/dev/zero' is a character device",
    ),
    "dataset linked to /dev/urandom": (
        ["--dataset", "{urandom}"],
        "dataset file '{urandom}' (a link to '/dev/urandom') is a character device",
    ),
    # --benchmarks: names from the table, local copies as NAME=FILE with the benchmark's columns
    "unknown benchmark": (["--benchmarks", "aime24,aime2025"], "--benchmarks: unknown benchmark 'aime2025'"),
    "benchmark copy without its name": (["--benchmarks", "aime25"], "--dataset gives local copies as NAME=FILE"),
    "benchmark copy of the wrong columns": (
        ["--benchmarks", "aime25", "--dataset", "aime25={wrong_columns}"],
        "benchmark aime25: file '{wrong_columns}' lacks column(s) ['problem', 'answer']",
    ),
    "benchmarks over several GPUs": (["--benchmarks", "aime25", "--num-gpus", "2"], "the benchmarks share one engine"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_user_errors_exit_2_without_traceback(case, error_inputs, tiny_model_dir, tmp_path):
    args, message = ERROR_CASES[case]
    paths = {"missing": tmp_path / "missing", **{k: str(v) for k, v in error_inputs.items()}}
    args = [a.format(**paths) for a in args]
    base = ["--model", tiny_model_dir, "--dataset", error_inputs["good"], "--n", 4, "--out", tmp_path / "out"]
    # In this process (eval_in_process): each is refused before any model loads.
    proc = eval_in_process(*base, *args)  # later flags win
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message.format(**paths) in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "samples.jsonl").exists()
    assert error_inputs["file"].read_text() == "keep me\n"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--n", "abc"], "error: argument --n: invalid int value: 'abc'; see python eval_aime.py --help"),
        (["--no-such-flag", "3"], "error: unrecognized arguments: --no-such-flag 3; see python eval_aime.py --help"),
        # No abbreviation: `--no-th` is not --no-thinking, and `--student-think` cannot pass for training's name
        # beside eval's own (the refusal of one setting under both names reads the names as written).
        (["--no-th"], "error: unrecognized arguments: --no-th; see python eval_aime.py --help"),
        (["--student-think", "--no-thinking"],
         "error: unrecognized arguments: --student-think; see python eval_aime.py --help"),
        (["--student-thinking", "--no-thinking"],
         "error: command line: --no_thinking and --student_thinking are both given (one setting); keep only one"),
    ],
)  # fmt: skip
def test_argparse_refusals_are_one_line_without_the_usage(args, line, tmp_path):
    proc = eval_in_process(*args, "--out", tmp_path / "out")
    assert proc.returncode == 2 and proc.stderr.splitlines() == [line], proc.stderr[-2000:]


def test_benchmark_missing_offline_is_refused_before_any_engine(tmp_path, monkeypatch):
    """Offline, a benchmark that is not in the datasets cache is refused in one line that names the dataset and
    the two ways to give it, before any model is read."""
    import datasets

    import opsd.evaluation.job as job

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "empty-cache")
    monkeypatch.setattr(
        job, "resolve_model", lambda name: pytest.fail("the model was read before the refusal")
    )
    proc = eval_in_process("--benchmarks", "aime25,hmmt26", "--out", tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(
        "error: benchmark aime25: dataset MathArena/aime_2025 (revision c94da77eb22b) is not in"
    )
    assert "--dataset aime25=FILE (.jsonl/.parquet with columns problem, answer)" in line
    assert not (tmp_path / "out" / "aime25").exists()


# --- compare, aggregate, step plot on hand-written results ----------------------------------------------


def write_result(
    path: Path,
    accuracy: dict[str, float],
    avg: float,
    step: int | None = None,
    pass_at_k: float = 80.0,
    maj: float = 60.0,
    format_rate: dict[str, float] | None = None,
) -> Path:
    """A summary.json with the fields the comparison modes read."""
    path.mkdir(parents=True)
    metrics = {
        "avg": avg,
        "avg_se": 2.0,
        "pass_at_k": pass_at_k,
        "pass_at_k_se": 3.0,
        "maj": maj,
        "maj_se": 3.0,
        "format_rate": 95.0,
        "format_rate_se": 1.0,
        "n": 4,
        "k": 4,
        "n_problems": len(accuracy),
        "labels": {"avg": "avg@4", "pass_at_k": "pass@4", "maj": "maj@4"},
        "problems": [
            {"id": pid, "n": 4, "accuracy": a, "format_rate": (format_rate or {}).get(pid, 1.0)}
            for pid, a in accuracy.items()
        ],
    }
    (path / "summary.json").write_text(
        json.dumps({"config": {"dataset_source": "x", "n": 4}, "step": step, "metrics": metrics})
    )
    return path


def test_compare_paired_difference(tmp_path):
    a = write_result(
        tmp_path / "a", {"q1": 0.5, "q2": 0.5, "q3": 0.5, "q4": 0.5}, avg=50.0,
        format_rate={"q1": 0.0, "q2": 0.25, "q3": 0.5, "q4": 0.25},
    )  # fmt: skip
    b = write_result(
        tmp_path / "b", {"q1": 0.75, "q2": 0.5, "q3": 0.5, "q4": 0.75}, avg=62.5,
        format_rate={"q1": 0.5, "q2": 0.75, "q3": 1.0, "q4": 0.75},
    )  # fmt: skip
    proc = ok(run_eval("--compare", a, b, "--out", tmp_path / "cmp"))
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    # Differences b - a in points: 25, 0, 0, 25 -> mean 12.5. Deviations +-12.5, so the sample variance is
    # 4 * 156.25 / 3 = 208.33 and the SE sqrt(208.33 / 4) = 7.2169. 95% t (df 3, 3.182446): +-22.967.
    assert result["mean_diff"] == pytest.approx(12.5)
    assert result["se"] == pytest.approx(7.2169, abs=1e-4)
    assert result["ci_low"] == pytest.approx(12.5 - 22.9676, abs=1e-3)
    assert result["n_problems"] == 4
    assert "+12.50" in proc.stdout
    # Format rate: every problem gains 50 points, so the SE is 0 and the interval is the point.
    fmt = result["format_rate"]
    assert (fmt["mean_a"], fmt["mean_b"], fmt["mean_diff"]) == pytest.approx((25.0, 75.0, 50.0))
    assert fmt["se"] == pytest.approx(0.0) and fmt["ci_low"] == pytest.approx(50.0)
    assert "format rate" in proc.stdout and "+50.00" in proc.stdout


def test_compare_refuses_missing_summary_and_disjoint_problems(tmp_path):
    a = write_result(tmp_path / "a", {"q1": 0.5}, avg=50.0)
    other = write_result(tmp_path / "other", {"z1": 0.5}, avg=50.0)
    (tmp_path / "empty").mkdir()
    for b, message in ((tmp_path / "empty", "summary.json not found"), (other, "share no problem ids")):
        proc = run_eval("--compare", a, b)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_aggregate_and_step_plot(tmp_path):
    # The improved recipe's three published runs (docs/method.md §4): 56.94, 53.06, 56.11.
    runs = [
        write_result(tmp_path / f"r{i}", {"q1": 0.5}, avg=v, step=s, pass_at_k=p)
        for i, (v, s, p) in enumerate([(56.94, 0, 70.0), (53.06, 50, 80.0), (56.11, 100, 90.0)])
    ]
    proc = ok(run_eval("--aggregate", *runs, "--out", tmp_path / "agg"))
    result = json.loads((tmp_path / "agg" / "aggregate.json").read_text())
    # Mean 166.11 / 3 = 55.37. Deviations 1.57, -2.31, 0.74: squares sum to 8.3486, variance 4.1743,
    # SE sqrt(4.1743 / 3) = 1.1796. pass@4: 70, 80, 90 -> mean 80, SE 10 / sqrt(3) = 5.7735.
    assert result["avg"]["mean"] == pytest.approx(55.37)
    assert result["avg"]["se"] == pytest.approx(1.1796, abs=1e-4)
    assert result["pass_at_k"]["mean"] == pytest.approx(80.0)
    assert result["pass_at_k"]["se"] == pytest.approx(5.7735, abs=1e-4)
    assert "55.37 ± 1.18" in proc.stdout

    ok(run_eval("--plot-steps", *runs, "--out", tmp_path / "curve"))
    points = json.loads((tmp_path / "curve" / "accuracy_vs_step.json").read_text())
    assert sorted((p["step"], p["avg"]) for p in points) == [(0, 56.94), (50, 53.06), (100, 56.11)]
    assert (tmp_path / "curve" / "accuracy_vs_step.png").read_bytes()[:8] == PNG_SIGNATURE


# --- the transformers engine, alone and data parallel ------------------------------------------------------


def test_transformers_engine_with_peft_adapter(boxer, problems_file, tmp_path):
    base_dir, adapter_dir = boxer
    out = tmp_path / "hf"
    proc = ok(
        run_eval(
            "--model",
            base_dir,
            "--adapter",
            adapter_dir,
            "--dataset",
            problems_file,
            "--limit",
            2,
            "--n",
            2,
            "--max-tokens",
            16,
            "--max-model-len",
            512,
            "--engine",
            "transformers",
            "--out",
            out,
        )
    )
    assert "adapter: peft" in proc.stdout
    samples = read_jsonl(out / "samples.jsonl")
    assert sorted((s["id"], s["idx"]) for s in samples) == [("p0", 0), ("p0", 1), ("p1", 0), ("p1", 1)]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "transformers" and summary["metrics"]["n_problems"] == 2
    assert summary["metrics"]["avg"] == pytest.approx(
        100
        * statistics.mean(
            statistics.mean(s["correct"] for s in samples if s["id"] == pid) for pid in ("p0", "p1")
        )
    )


def test_num_gpus_2_on_cpu_merges_every_sample_once(boxer, tmp_path):
    base_dir, adapter_dir = boxer
    out = tmp_path / "dp"
    proc = ok(
        run_eval(
            "--model",
            base_dir,
            "--adapter",
            adapter_dir,
            "--merge-adapter",
            "--dataset",
            "builtin",
            "--limit",
            5,
            "--n",
            2,
            "--max-tokens",
            8,
            "--engine",
            "transformers",
            "--num-gpus",
            2,
            "--out",
            out,
        )
    )
    assert "adapter: merged" in proc.stdout
    keys = [(s["id"], s["idx"]) for s in read_jsonl(out / "samples.jsonl")]
    assert len(keys) == len(set(keys)) == 10
    assert set(keys) == {(f"builtin-{p:03d}", i) for p in range(5) for i in range(2)}
    assert not (out / "shards").exists()  # worker files merged and removed
    assert json.loads((out / "summary.json").read_text())["metrics"]["n_problems"] == 5
