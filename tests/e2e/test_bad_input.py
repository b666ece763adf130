"""Bad input: data files refused with the file, line or row and the fix; entry points print user errors as one
line with exit status 2 (the traceback only with --debug or OPSD_DEBUG=1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opsd.data.loading import DataError, load_eval_dataset, load_table, load_train_dataset
from opsd.errors import UserError, split_debug
from tests.conftest import ENV, in_process

ROOT = Path(__file__).resolve().parents[2]


def row(i: int, **changes) -> dict:
    base = {
        "problem": f"problem {i}",
        "solution": f"worked {i}",
        "Answer": str(i),
        "COT_Reason": f"thinking {i}",
        "generated_token_count": 100,
    }
    return {**base, **changes}


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def refused(path: Path | str, load=load_train_dataset, **kw) -> str:
    with pytest.raises(UserError) as info:
        load(str(path), **kw)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- data files ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".csv", ".parquet"])
def test_empty_file_is_named(tmp_path, suffix):
    path = tmp_path / f"train{suffix}"
    path.write_bytes(b"")
    message = refused(path)
    assert str(path) in message and "is empty" in message


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_blank_lines_only(tmp_path, suffix):
    path = tmp_path / f"train{suffix}"
    path.write_text("\n  \n\n", encoding="utf-8")
    message = refused(path)
    assert str(path) in message and "only blank lines" in message


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(row(0)) + "\n\n" + '{"problem": "p", oops}\n', encoding="utf-8")
    message = refused(path)
    assert (
        str(path) in message
        and "line 3 is not valid JSON" in message
        and "one JSON object per line" in message
    )


def test_malformed_json_document_names_line(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("[\n" + json.dumps(row(0)) + ",\n{broken}\n]\n", encoding="utf-8")
    message = refused(path)
    assert str(path) in message and "invalid JSON at line 3" in message


def test_jsonl_line_that_is_not_an_object(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(row(0)) + "\n[1, 2]\n", encoding="utf-8")
    assert "line 2 is a JSON list, not an object" in refused(path)


@pytest.mark.parametrize(
    ("column", "value", "teacher_ref"),
    [
        ("problem", None, "solution"),
        ("problem", 12, "solution"),
        ("solution", None, "solution"),
        ("solution", "", "solution"),
        ("solution", "   ", "solution"),
        ("COT_Reason", None, "cot"),
        ("COT_Reason", "", "cot"),
    ],
)
def test_missing_or_empty_text_names_the_row(tmp_path, column, value, teacher_ref):
    path = jsonl(tmp_path / "train.jsonl", [row(0), row(1), row(2, **{column: value})])
    message = refused(path, teacher_ref=teacher_ref)
    assert str(path) in message and repr(column) in message
    assert f"row 3 has {value!r}" in message and "fill in or drop those rows" in message
    assert "row 1 " not in message and "row 2 " not in message


def test_the_reference_the_teacher_does_not_read_may_be_empty(tmp_path):
    path = jsonl(tmp_path / "train.jsonl", [row(0, COT_Reason=None), row(1, COT_Reason="")])
    assert load_train_dataset(str(path), teacher_ref="solution")["problem"] == ["problem 0", "problem 1"]
    assert "'COT_Reason'" in refused(path, teacher_ref="cot")


def test_many_bad_rows_are_counted(tmp_path):
    path = jsonl(tmp_path / "train.jsonl", [row(i, problem=None) for i in range(9)])
    message = refused(path)
    assert "row 5 has None" in message and "row 6 " not in message and "and 4 more" in message


def test_eval_rows_need_problem_and_answer(tmp_path):
    path = jsonl(tmp_path / "aime.jsonl", [{"problem": "P", "answer": 3}, {"problem": "Q", "answer": None}])
    message = refused(path, load=load_eval_dataset)
    assert "'answer'" in message and "row 2 has None" in message
    path = jsonl(tmp_path / "aime2.jsonl", [{"problem": "", "answer": "3"}])
    assert "'problem'" in refused(path, load=load_eval_dataset)
    # numbers are answers (AIME files store integers)
    path = jsonl(tmp_path / "aime3.jsonl", [{"problem": "P", "answer": 33}])
    assert load_eval_dataset(str(path)) == [{"id": "0", "problem": "P", "answer": "33"}]


def test_csv_file(tmp_path):
    path = tmp_path / "aime.csv"
    path.write_text('problem,answer\nCompute 1+1.,2\n"Find x, if x=3.",3\n', encoding="utf-8")
    assert load_eval_dataset(str(path)) == [
        {"id": "0", "problem": "Compute 1+1.", "answer": "2"},
        {"id": "1", "problem": "Find x, if x=3.", "answer": "3"},
    ]
    empty_cell = tmp_path / "bad.csv"
    empty_cell.write_text("problem,answer\n,2\n", encoding="utf-8")
    assert "row 1 has None" in refused(empty_cell, load=load_eval_dataset)


def test_directory_with_split_files(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    jsonl(d / "train.jsonl", [row(0), row(1)])
    jsonl(d / "test.jsonl", [row(7)])
    assert load_train_dataset(str(d))["problem"] == ["problem 0", "problem 1"]
    assert load_train_dataset(str(d), split="test")["problem"] == ["problem 7"]
    message = refused(d, split="validation")
    assert "validation" in message and "--dataset_split" in message


def test_directory_of_unnamed_files_is_the_train_split(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    jsonl(d / "part-a.jsonl", [row(0)])
    jsonl(d / "part-b.jsonl", [row(1)])
    assert sorted(load_table(str(d), required=("problem",))["problem"]) == ["problem 0", "problem 1"]


def test_directory_problems_name_the_file(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    jsonl(d / "train.jsonl", [row(0)])
    (d / "extra.jsonl").write_text("")
    message = refused(d)
    assert str(d / "extra.jsonl") in message and "is empty" in message
    (d / "extra.jsonl").unlink()
    (d / "more.csv").write_text("problem\nx\n")
    assert "mixes csv and json files" in refused(d)


def test_data_errors_are_value_errors():
    # Callers that catch ValueError (the evaluation's input checks) still catch data errors.
    assert issubclass(DataError, ValueError) and issubclass(DataError, UserError)


@pytest.mark.parametrize(
    ("argv", "env", "debug", "rest"),
    [
        (["--debug"], {}, True, []),
        (["--beta", "1", "--debug"], {}, True, ["--beta", "1"]),
        (["--debug", "underflow_overflow"], {}, False, ["--debug", "underflow_overflow"]),
        (["--debug=underflow_overflow"], {}, False, ["--debug=underflow_overflow"]),
        ([], {"OPSD_DEBUG": "1"}, True, []),
        ([], {"OPSD_DEBUG": "0"}, False, []),
    ],
)
def test_split_debug(argv, env, debug, rest):
    # A bare --debug is ours; with a value it is transformers' own `debug` training argument.
    assert split_debug(argv, env) == (debug, rest)


# -- entry points as users run them ---------------------------------------------------------------------------


def run(
    script: str,
    args: list[str],
    tmp_path: Path,
    env: dict | None = None,
    timeout: int = 300,
    *,
    own_process: bool = False,
) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` in `tmp_path`; in this process (`tests.conftest.in_process`: these refusals come
    before any model loads) unless `own_process`, for what a fresh interpreter reads at import."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("OPSD_") or k == "OPSD_CACHE_DIR"}
    full.update(ENV, **(env or {}))
    if not own_process:
        return in_process(script, args, env=full, cwd=tmp_path)
    return subprocess.run(
        [sys.executable, str(ROOT / script), *args],
        cwd=tmp_path, env=full, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def one_line(res: subprocess.CompletedProcess, prefix: str, *needles: str) -> None:
    """Exit status 2, no traceback, and the error in one line, the last (progress bars may come before)."""
    assert res.returncode == 2, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert [line for line in lines if "error:" in line] == lines[-1:], res.stderr[-3000:]
    assert lines[-1].startswith(prefix) and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stdout, res.stdout[-3000:]  # libraries log to stdout too
    for needle in needles:
        assert needle in lines[-1]


def test_train_bad_config_value_is_one_line(tmp_path):
    res = run("opsd_train.py", ["--output_dir", str(tmp_path / "o"), "--learning_rate", "-1"], tmp_path)
    one_line(res, "opsd_train.py: error:", "learning_rate=-1.0 is out of range", "must be in (0, 1]")
    res = run("opsd_train.py", ["--output_dir", str(tmp_path / "o"), "--beta", "abc"], tmp_path)
    one_line(res, "opsd_train.py: error:", "--beta: invalid float value", "--help")


def test_train_bad_data_is_refused_before_the_model_loads(tmp_path):
    data = jsonl(tmp_path / "train.jsonl", [row(0), row(1, solution=None)])
    args = [
        "--output_dir",
        str(tmp_path / "o"),
        "--dataset_name",
        str(data),
        "--model_name_or_path",
        "./none",
    ]
    res = run("opsd_train.py", args[:4], tmp_path)
    one_line(res, "opsd_train.py: error:", str(data), "row 2 has None")
    assert not (tmp_path / "o").exists()
    # A missing model directory is named too, still before anything loads.
    jsonl(data, [row(0)])
    one_line(run("opsd_train.py", args, tmp_path), "opsd_train.py: error:", "not a model directory")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_train_debug_shows_the_traceback(tmp_path, how):
    args = ["--output_dir", str(tmp_path / "o"), "--beta", "2"] + (["--debug"] if how == "flag" else [])
    res = run("opsd_train.py", args, tmp_path, {"OPSD_DEBUG": "1"} if how == "env" else None)
    assert res.returncode == 2
    assert "Traceback" in res.stderr and "InvalidValue" in res.stderr
    assert (
        res.stderr.strip().splitlines()[-1]
        == "opsd_train.py: error: beta=2.0 is out of range: must be in [0, 1]"
    )


def test_train_internal_errors_keep_their_traceback(tmp_path):
    # A bug is not a user error: its traceback shows and the status is not 2.
    code = (
        "import sys, opsd_train; from opsd.errors import run_main\n"
        "def boom(argv): raise KeyError('bug')\n"
        "sys.exit(run_main(boom, 'opsd_train.py', []))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "Traceback" in res.stderr and "KeyError: 'bug'" in res.stderr


def test_eval_bad_data_is_one_line_and_debug_shows_the_traceback(tmp_path):
    data = jsonl(tmp_path / "aime.jsonl", [{"problem": "P", "answer": None}])
    args = ["--dataset", str(data), "--out", str(tmp_path / "e")]
    # As a user runs it, in a process of its own (the other evaluation refusals run in the test's process).
    one_line(run("eval_aime.py", args, tmp_path, own_process=True), "error:", "row 1 has None", str(data))
    res = run("eval_aime.py", [*args, "--debug"], tmp_path)
    assert res.returncode == 2 and "Traceback" in res.stderr and "row 1 has None" in res.stderr


# -- no traceback for a user's mistake: paths, malformed data, hub ids offline, incomplete model dirs -----------


def _train_refused(
    tmp_path: Path, args: list[str], *needles: str, env: dict | None = None, own_process: bool = False
) -> str:
    out = tmp_path / "o"
    res = run("opsd_train.py", ["--output_dir", str(out), *args], tmp_path, env, own_process=own_process)
    one_line(res, "opsd_train.py: error:", *needles)
    assert not out.exists()  # refused before anything is written to the output directory
    return res.stderr.strip().splitlines()[-1]


def test_over_long_and_unreadable_prompt_paths_are_one_line(tmp_path):
    long_path = str(tmp_path / ("p" * 4000))
    line = _train_refused(tmp_path, [], "prompt template file", "cannot be read",
                          env={"OPSD_TEACHER_PROMPT_FILE": long_path})  # fmt: skip
    assert len(line) < 600  # the 4,000-character path is shown cut
    folder = tmp_path / "prompts"
    folder.mkdir()
    _train_refused(
        tmp_path, ["--student_prompt_file", str(folder)], str(folder), "is a directory, not a file"
    )
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("{problem} caf\xe9".encode("latin-1"))
    _train_refused(tmp_path, ["--student_prompt_file", str(latin1)], "is not UTF-8 text")


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        (
            "train.csv",
            b'problem,solution,Answer,COT_Reason,generated_token_count\n"open quote,s,1,c,1\n',
            "EOF inside string",
        ),
        (
            "ragged.csv",
            b"problem,solution,Answer,COT_Reason,generated_token_count\np,s,1,c,1\np,s,1,c,1,extra,more\n",
            "Expected 5 fields",
        ),
        ("train.parquet", b"PAR1 this is not parquet at all", "cannot be read as parquet"),
    ],
)
def test_malformed_data_files_are_one_line(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content)
    message = refused(path)
    assert str(path) in message and needle in message and "fix the file" in message
    _train_refused(tmp_path, ["--dataset_name", str(path)], str(path), needle)


def test_hub_model_id_offline_names_the_cache_and_the_way_out(tmp_path):
    cache = tmp_path / "hub-cache"
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    # In a process of its own: huggingface_hub reads HF_HUB_CACHE when it is imported.
    line = _train_refused(tmp_path, ["--model_name_or_path", "someorg/some-model"], "'someorg/some-model'",
                          "HF_HUB_OFFLINE", str(cache), "--model_name_or_path /path/to/model", env=env,
                          own_process=True)  # fmt: skip
    assert "is not in the Hugging Face cache" in line
    # A dry run plans for any machine: it leaves hub ids unchecked, as it leaves hub datasets unloaded.
    res = run("opsd_train.py", ["--output_dir", str(tmp_path / "o"), "--model_name_or_path", "someorg/some-model",
                                "--dry-run"], tmp_path, env)  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]


def test_model_directory_without_tokenizer_is_one_line(tmp_path, tiny_model_dir):
    import shutil

    bare = tmp_path / "bare-model"
    bare.mkdir()
    shutil.copy(Path(tiny_model_dir) / "config.json", bare / "config.json")
    _train_refused(tmp_path, ["--model_name_or_path", str(bare)], str(bare), "no tokenizer files")
    from opsd.models import check_model_source

    check_model_source(str(tiny_model_dir))  # a complete directory passes


def _untied_copy(tiny_model_dir, dest: Path) -> Path:
    """The tiny Qwen3 (saved tied: its checkpoint has no lm_head.weight) with a config that unties the head, as a
    multimodal checkpoint's text config without tie_word_embeddings reads."""
    import shutil

    shutil.copytree(tiny_model_dir, dest)
    config = json.loads((dest / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    config["tie_word_embeddings"] = False
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_a_checkpoint_without_its_lm_head_is_refused_before_training(tmp_path, tiny_model_dir):
    model = _untied_copy(tiny_model_dir, tmp_path / "untied")
    out = tmp_path / "o"
    args = ["--output_dir", str(out), "--model_name_or_path", str(model), "--rollout_engine", "transformers",
            "--max_steps", "1", "--per_device_train_batch_size", "2", "--max_completion_length", "4"]  # fmt: skip
    res = run("opsd_train.py", args, tmp_path)
    one_line(res, "opsd_train.py: error: model ", "lm_head.weight", "initialised at random",
             "tie_word_embeddings true", "--allow_missing_weights")  # fmt: skip
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("checkpoint-*"))


def test_allow_missing_weights_loads_them_random_with_a_warning(tmp_path, tiny_model_dir, caplog):
    """The opt-in: the same checkpoint loads, its lm_head is not the embedding (transformers drew it at random),
    and the warning names it."""
    import logging

    from opsd.errors import UnsupportedModel
    from opsd.models import load_model

    model_dir = str(_untied_copy(tiny_model_dir, tmp_path / "untied"))
    with pytest.raises(UnsupportedModel, match="1 weights of Qwen3ForCausalLM are not in the checkpoint"):
        load_model(model_dir)
    with caplog.at_level(logging.WARNING, logger="opsd.models"):
        model = load_model(model_dir, allow_missing_weights=True)
    assert "lm_head.weight" in caplog.text and "training anyway (allow_missing_weights)" in caplog.text
    assert not model.lm_head.weight.equal(model.get_input_embeddings().weight)
    load_model(str(tiny_model_dir))  # the tied original loads without a word


def test_hub_dataset_offline_and_missing_split(tmp_path, monkeypatch):
    _train_refused(tmp_path, ["--dataset_name", "someorg/some-data"], "'someorg/some-data'", "HF_HUB_OFFLINE",
                   "local .json/.jsonl/.csv/.parquet", env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
    import datasets

    def no_split(name, split):
        raise ValueError(f"Unknown split \"{split}\". Should be one of ['train'].")

    monkeypatch.setattr(datasets, "load_dataset", no_split)
    message = refused("someorg/some-data", split="validation")
    assert (
        "has no split 'validation'" in message
        and "one of ['train']" in message
        and "--dataset_split" in message
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top_p", "1.5"], "top_p=1.5 is out of range: must be in (0, 1]"),
        (["--lora_dropout", "1.5"], "lora_dropout=1.5 is out of range: must be in [0, 1)"),
        (["--learning_rate=inf"], "learning_rate=inf is out of range: must be finite and in (0, 1]"),
        (["--teacher_update_rate", "0.5"], "teacher_update_rate=0.5 is a TRL option that OPSD sets itself"),
    ],
)
def test_train_out_of_range_values_are_one_line_before_anything_loads(tmp_path, args, message):
    _train_refused(tmp_path, args, message)


# -- paths that are not what they must be: devices, FIFOs, files over their cap, a file for a directory ------


@pytest.fixture
def odd_paths(tmp_path) -> dict[str, str]:
    """Paths that read without end or are of the wrong kind; none holds more than a few bytes on disk."""
    urandom = tmp_path / "recipe.env"
    urandom.symlink_to("/dev/urandom")
    data = tmp_path / "train.jsonl"
    data.symlink_to("/dev/urandom")
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    big = tmp_path / "big_prompt.txt"
    with big.open("wb") as f:
        f.truncate((1 << 20) + 1)  # sparse: 1 MiB + 1 byte, nothing written
    file = tmp_path / "results"
    file.write_text("keep me\n")
    return {"urandom": str(urandom), "data": str(data), "fifo": str(fifo), "big": str(big), "file": str(file)}


PATH_CASES = {
    # The dry run used to read these without bound until it was killed.
    "teacher prompt /dev/zero from env": (
        ["--dry-run"], {"OPSD_TEACHER_PROMPT_FILE": "/dev/zero"},
        "prompt template file '/dev/zero' is a character device, not a regular file",
    ),
    "recipe linked to /dev/urandom": (
        ["--dry-run", "--recipe", "{urandom}"], {},
        "recipe file '{urandom}' (a link to '/dev/urandom') is a character device, not a regular file",
    ),
    "dataset linked to /dev/urandom": (
        ["--dataset_name", "{data}"], {},
        "dataset file '{data}' (a link to '/dev/urandom') is a character device, not a regular file",
    ),
    "YAML config that is a FIFO": (
        ["--config", "{fifo}"], {}, "YAML config '{fifo}' is a FIFO (named pipe), not a regular file",
    ),
    "deepspeed config /dev/zero": (
        ["--deepspeed", "/dev/zero"], {},
        "DeepSpeed config '/dev/zero' is a character device, not a regular file",
    ),
    "prompt file over 1 MiB": (
        ["--student_prompt_file", "{big}"], {},
        "'{big}' is 1 MiB (1,048,577 bytes); prompt template files are limited to 1 MiB",
    ),
    "output_dir that is a file": (
        ["--output_dir", "{file}"], {}, "--output_dir '{file}' is a regular file, not a directory",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_train_refuses_paths_that_are_not_what_they_must_be(tmp_path, odd_paths, case):
    args, env, message = PATH_CASES[case]
    args = [a.format(**odd_paths) for a in args]
    res = run("opsd_train.py", ["--output_dir", str(tmp_path / "o"), *args], tmp_path, env, timeout=120)
    one_line(res, "opsd_train.py: error:", message.format(**odd_paths))
    assert not (tmp_path / "o").exists() and Path(odd_paths["file"]).read_text() == "keep me\n"


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (
            ["--method", "grpo", "--teacher_contrast", "shuffled"],
            ["teacher_contrast='shuffled'", "method=grpo"],
        ),
        (["--method", "grpo", "--clip_mode", "rescale"], ["clip_mode='rescale'", "never reads it"]),
        (
            ["--method", "grpo", "--num_generations", "1"],
            ["num_generations=1 with method=grpo", "at least 2"],
        ),
        (["--num_generations", "4"], ["num_generations=4 with method=opsd", "one rollout per problem"]),
        (["--sd_weight", "0.5"], ["sd_weight=0.5", "method=hybrid"]),
        (["--method", "hybrid", "--teacher_mode", "ema"], ["teacher_mode=ema with method=hybrid"]),
        (["--method", "hybrid", "--steps_per_rollout", "2"], ["steps_per_rollout=2", "method=opsd only"]),
        (["--method", "ppo"], ["method", "'ppo'", "opsd", "grpo", "hybrid"]),
    ],
)
def test_keys_of_another_method_are_refused_in_one_line(tmp_path, args, needles):
    """A switch the run's method never reads, or rollouts per problem it cannot take, is refused before anything
    is written (the run would record it as if it acted)."""
    out = tmp_path / "o"
    res = run("opsd_train.py", ["--output_dir", str(out), "--dry-run", *args], tmp_path)
    one_line(res, "opsd_train.py: error:", *needles)
    assert not out.exists()


def test_recipe_keys_of_another_method_are_refused_in_one_line(tmp_path):
    recipe = tmp_path / "grpo.env"
    recipe.write_text("METHOD=grpo\nNUM_GENERATIONS=4\nTEACHER_REF=cot\n")
    res = run(
        "opsd_train.py", ["--output_dir", str(tmp_path / "o"), "--dry-run", "--recipe", recipe], tmp_path
    )
    one_line(res, "opsd_train.py: error:", "teacher_ref='cot'", "method=grpo")
    recipe.write_text("METHOD=grpo\nNUM_GENERATIONS=4\n")
    dry = run(
        "opsd_train.py", ["--output_dir", str(tmp_path / "o"), "--dry-run", "--recipe", recipe], tmp_path
    )
    assert dry.returncode == 0, dry.stderr[-2000:]
    resolved = json.loads(dry.stdout)
    config = resolved.get("config", resolved)
    assert (config["method"], config["num_generations"]) == ("grpo", 4)


def test_train_dry_run_prints_the_step_in_problems_and_rollouts(tmp_path):
    """`opsd_train.py --dry-run` prints the step's shape; with BUDGET_UNIT=rollouts per_device_train_batch_size
    counts rollouts (8 x 2 accumulation = 16 per step: 4 problems x 4), and one that splits a problem's group is
    refused in one line naming both values and the fix, as is a micro_batch_size that would."""
    recipe = tmp_path / "grpo.env"
    recipe.write_text("METHOD=grpo\nNUM_GENERATIONS=4\nBUDGET_UNIT=rollouts\n")
    base = ["--output_dir", str(tmp_path / "o"), "--dry-run", "--recipe", recipe]
    dry = run("opsd_train.py", [*base, "--per_device_train_batch_size", "8"], tmp_path)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert json.loads(dry.stdout)["step"] == "4 problems x 4 rollouts = 16 rollouts per step"
    res = run("opsd_train.py", [*base, "--per_device_train_batch_size", "6"], tmp_path)
    one_line(res, "opsd_train.py: error:", "budget_unit=rollouts", "per_device_train_batch_size=6",
             "num_generations=4", "or budget_unit=problems")  # fmt: skip
    res = run(
        "opsd_train.py", [*base, "--per_device_train_batch_size", "8", "--micro_batch_size", "2"], tmp_path
    )
    one_line(res, "opsd_train.py: error:", "micro_batch_size=2 is not a multiple of num_generations=4")
    dry = run("opsd_train.py", ["--output_dir", str(tmp_path / "o"), "--dry-run"], tmp_path)
    assert json.loads(dry.stdout)["step"] == "8 problems x 1 rollout = 8 rollouts per step"


@pytest.mark.parametrize("recipe", sorted((ROOT / "configs" / "recipes").glob("*.env")), ids=lambda p: p.name)
def test_every_shipped_recipe_passes_the_dry_run(tmp_path, recipe):
    """Each shipped recipe, the other methods' included, passes every check a real run makes (no key another
    method reads, a valid number of rollouts per problem)."""
    from opsd.configuration.sources import parse_recipe

    dry = run(
        "opsd_train.py", ["--output_dir", str(tmp_path / "o"), "--dry-run", "--recipe", recipe], tmp_path
    )
    assert dry.returncode == 0, dry.stderr[-2000:]
    resolved = json.loads(dry.stdout)
    config = resolved.get("config", resolved)
    values = {o.field: o.value for o in parse_recipe(recipe)}
    method = values.get("method", "opsd")
    assert config["method"] == method
    assert config["num_generations"] == int(values.get("num_generations", 1 if method == "opsd" else 8))


# -- a closed stdout: a normal end of every command that prints ------------------------------------------------


def closed_stdout(argv: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`argv` with its stdout a pipe whose reader is gone before the first write: what `| head -c 1` is to every
    write after its byte (a command whose output fits one write would otherwise race the reader's exit)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    full = {k: v for k, v in os.environ.items() if not k.startswith("OPSD_")}
    full.update(ENV, CUDA_VISIBLE_DEVICES="", **(env or {}))
    try:
        return subprocess.run(argv, stdout=write_end, stderr=subprocess.PIPE, text=True, cwd=cwd, env=full,
                              timeout=300)  # fmt: skip
    finally:
        os.close(write_end)


def _summary_dir(path: Path) -> Path:
    """A result directory of eval_aime.py (summary.json) with what --aggregate reads."""
    path.mkdir(parents=True)
    metrics = {"avg": 50.0, "avg_se": 1.0, "pass_at_k": 80.0, "maj": 60.0, "format_rate": 95.0, "n": 4,
               "n_problems": 1, "labels": {"avg": "avg@4", "pass_at_k": "pass@4", "maj": "maj@4"},
               "problems": [{"id": "q1", "accuracy": 0.5, "format_rate": 1.0}]}  # fmt: skip
    (path / "summary.json").write_text(json.dumps({"config": {"n": 4}, "step": None, "metrics": metrics}))
    return path


def test_a_closed_stdout_is_a_normal_end_of_every_command_that_prints(tmp_path):
    """Each command that prints, its reader gone: exit 141 (128 + SIGPIPE, as a shell reports it; 0 for argparse's
    --help, which ignores a failed write), no traceback on
    either stream, and what it writes to files written. Once `--print-commands | head -c 1` and `report DIR | head
    -c 1` ended in a BrokenPipeError traceback with exit 1."""
    from tests.unit.test_experiment import experiment

    directory = experiment(tmp_path / "exp")
    runs = [_summary_dir(tmp_path / f"r{i}") for i in range(2)]
    py = sys.executable
    cases = {
        "print-commands": ([py, "-m", "opsd.experiment", "--out", str(directory), "--print-commands"],
                           directory / "experiment.json"),
        "report": ([py, "-m", "opsd.experiment", "report", str(directory), "--bootstrap-reps", "200"],
                   directory / "report.md"),
        "eval_aime.py": ([py, str(ROOT / "eval_aime.py"), "--aggregate", *map(str, runs), "--out",
                          str(tmp_path / "agg")], tmp_path / "agg" / "aggregate.json"),
        "opsd_train.py --dry-run": ([py, str(ROOT / "opsd_train.py"), "--output_dir", str(tmp_path / "o"),
                                     "--dry-run"], None),
        "step trace": ([py, "-m", "opsd.testing.step_trace", "--help"], None),
    }  # fmt: skip
    for what, (argv, written) in cases.items():
        res = closed_stdout(argv, ROOT)
        # 141, or 0 where the reader's absence is swallowed before it ends (argparse's --help ignores it)
        assert res.returncode in (0, 141) and (res.returncode == 141 or what == "step trace"), (
            what,
            res.returncode,
            res.stderr[-3000:],
        )
        assert "Traceback" not in res.stderr and "BrokenPipeError" not in res.stderr, (
            what,
            res.stderr[-3000:],
        )
        assert written is None or written.is_file(), (what, written)


# -- what eval_aime.py --compare reads: damaged results are one line naming the file -----------------------------


def _suite_dir(path: Path, names=("aime24",)) -> Path:
    """A --benchmarks result: DIR/benchmarks.json listing `names`, DIR/NAME/summary.json each (what the table reads)."""
    for name in names:
        row = {"id": "1", "accuracy": 0.5, "format_rate": 1.0, "n_correct": 2}
        metrics = {"avg": 50.0, "avg_se": None, "pass_at_k": 100.0, "maj": 100.0, "maj_se": None, "format_rate": 100.0,
                   "format_rate_se": None, "truncation_rate": 0.0, "truncation_rate_se": None, "mean_tokens": 10.0,
                   "mean_tokens_se": None, "n": 4, "n_problems": 1, "problems": [row],
                   "labels": {"avg": "avg@4", "pass_at_k": "pass@4", "maj": "maj@4"}}  # fmt: skip
        (path / name).mkdir(parents=True)
        (path / name / "summary.json").write_text(json.dumps({"config": {"n": 4}, "metrics": metrics}))
    (path / "benchmarks.json").write_text(json.dumps({"benchmarks": list(names)}))
    return path


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"garbage", "is not JSON (Expecting value)"),
        (b"[1, 2]", "holds a JSON list, not an object"),
        (b"\xff\xfe" + bytes(range(256)) * 4, "is not UTF-8 text (byte 0)"),
        (
            b'{"benchmarks": ["../outside"]}',
            "its field benchmarks is ['../outside'], not a list of distinct benchmark",
        ),
        (b'{"benchmarks": "aime24"}', "its field benchmarks is 'aime24', not a list"),
        (b'{"benchmarks": ["aime24", "aime24"]}', "not a list of distinct benchmark names of the table"),
    ],
)
@pytest.mark.parametrize("side", ["a", "b"])
def test_compare_refuses_a_damaged_benchmarks_json_naming_it(tmp_path, content, needle, side):
    """Once JSONDecodeError, AttributeError and UnicodeDecodeError tracebacks; a benchmark name that is a path made
    both sides read one directory outside both, compared with itself."""
    a, b = _suite_dir(tmp_path / "a"), _suite_dir(tmp_path / "b")
    _suite_dir(tmp_path / "outside")  # what ../outside would reach from either side
    damaged = (a if side == "a" else b) / "benchmarks.json"
    damaged.write_bytes(content)
    res = run("eval_aime.py", ["--compare", str(a), str(b)], tmp_path)
    one_line(res, "error:", repr(str(damaged)), needle)
    assert res.stdout == ""


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"garbage", "is not JSON"),
        (b"[1, 2]", "holds a JSON list, not an object"),
        (b"\x80" + bytes(range(256)), "is not UTF-8 text (byte 0)"),
        (b'{"metrics": [1, 2]}', "it has no metrics object"),
        (
            b'{"metrics": {"problems": [{"id": "1"}], "n_problems": 1}}',
            "metrics.problems[0] is not a problem's row",
        ),
        (b'{"config": 3, "metrics": {"problems": [], "n_problems": 0}}', "field config is 3, not an object"),
    ],
)
@pytest.mark.parametrize("suite", [False, True], ids=["one table", "benchmarks"])
def test_compare_refuses_a_damaged_summary_naming_it(tmp_path, content, needle, suite):
    a, b = _suite_dir(tmp_path / "a"), _suite_dir(tmp_path / "b")
    if not suite:
        a, b = a / "aime24", b / "aime24"
    damaged = b / ("aime24" if suite else "") / "summary.json"
    damaged.write_bytes(content)
    res = run("eval_aime.py", ["--compare", str(a), str(b)], tmp_path)
    one_line(res, "error:", repr(str(damaged)), needle)
    assert res.stdout == ""


def test_compare_refuses_a_result_file_over_its_cap(tmp_path):
    a, b = _suite_dir(tmp_path / "a"), _suite_dir(tmp_path / "b")
    with (b / "benchmarks.json").open("ab") as f:  # sparse: nothing is written to the disk
        f.truncate(100 * 2**20)
    res = run("eval_aime.py", ["--compare", str(a), str(b)], tmp_path)
    one_line(res, "error:", str(b / "benchmarks.json"), "result files are limited to 64 MiB")
    a, b = _suite_dir(tmp_path / "c"), _suite_dir(tmp_path / "d")
    assert run("eval_aime.py", ["--compare", str(a), str(b)], tmp_path).returncode == 0  # the same, undamaged


def test_an_echoed_value_of_any_length_is_cut_to_one_short_line(tmp_path):
    """An unknown benchmark name of 100,000 characters was echoed whole (a line of 100,137 characters); every value
    a message echoes is cut at 200 characters (opsd.errors.shown, and short_message where the entry points
    print)."""
    from opsd.errors import SHOWN_CHARS, short_message, shown

    name = "x" * 100_000
    res = run("eval_aime.py", ["--benchmarks", name, "--out", str(tmp_path / "e")], tmp_path)
    one_line(res, "error:", "unknown benchmark 'xxx")
    assert len(res.stderr.strip()) < 600, len(res.stderr)
    assert shown(name) == repr("x" * SHOWN_CHARS + "...") and shown(list(range(10**4))).endswith("...")
    assert len(shown(list(range(10**4)))) == SHOWN_CHARS + 3
    message = short_message(f"bad {name!r}; fix it")
    assert message.startswith("bad 'xxx") and message.endswith("...' (100,000 characters); fix it")
    assert short_message("keep 'short' values") == "keep 'short' values"


# -- a stop signal, sent twice, is one line -----------------------------------------------------------------------

# `python -m opsd.experiment` as a user starts it, its arms' dry runs and its jobs replaced: each job sleeps until
# it is stopped (the subject is the experiment's own process: its handlers, its one line, its exit).
FAKE_JOBS = """
import runpy, sys
from opsd.experiment import commands, schedule
commands.dry_run_arms = lambda directory, spec, arms: {a: dict(spec.arms[a]["recipe"]) for a in arms}
schedule.Runner.argv = lambda self, job, slot: ["sleep", "120"]
runpy.run_module("opsd.experiment", run_name="__main__", alter_sys=True)
"""


def _default_stop_signals() -> None:
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


@pytest.mark.parametrize(("sig", "group"), [("SIGTERM", False), ("SIGINT", True)])  # SIGHUP: as SIGTERM
def test_a_stop_signal_sent_twice_leaves_one_line(tmp_path, sig, group):
    """A stop while jobs run: one line, exit 130, however often the signal comes. `timeout` sends SIGTERM to the
    command and then to its group, and a terminal's Ctrl-C (SIGINT) reaches every process of its job-control
    group: the second signal once added a "Terminated" line (the default handler, restored as the command
    returned) or a KeyboardInterrupt traceback of the interpreter's exit."""
    import signal
    import time

    full = {k: v for k, v in os.environ.items() if not k.startswith("OPSD_")}
    full.update(ENV, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-c", FAKE_JOBS, "--out", str(tmp_path / "exp"), "--recipe", "", "--arm",
            "a=CLIP_MODE=element", "--arm", "b=CLIP_MODE=none", "--profile", "smoke", "--seeds", "42",
            "--eval-flags", "--dataset builtin --n 2"]  # fmt: skip
    # As a terminal starts a foreground job: SIGINT and SIGTERM at their defaults (a pytest-xdist worker ignores
    # SIGINT, and an ignored signal stays ignored across exec, so the command would never see the Ctrl-C).
    proc = subprocess.Popen(argv, cwd=ROOT, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_default_stop_signals)  # fmt: skip
    try:
        before = []
        for line in proc.stderr:  # the log, up to the first job's start
            before.append(line)
            if line.startswith("start "):
                break
        assert proc.poll() is None, "".join(before)[-3000:]
        number = getattr(signal, sig)
        for _ in range(2):
            os.killpg(proc.pid, number) if group else os.kill(proc.pid, number)
            time.sleep(0.5)
        rest = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    after = [line for line in rest.splitlines() if not line.startswith("start ")]
    assert proc.returncode == 130 and after == [
        "opsd.experiment: stopped; rerun the same command to resume"
    ], (
        proc.returncode,
        rest[-3000:],
    )
