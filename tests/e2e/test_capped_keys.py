"""train_capped.sh: the dry run validates values as training does, operational keys pass through recipe.env,
OPSD_* and flags after `--`, budget keys stay refused, and an explicit --num-gpus plans that many GPUs."""

import json
import os

import pytest

from opsd.configuration.sources import RecipeError, env_overrides, flag_overrides, parse_recipe
from opsd.configuration.switches import CAPPED_KEYS, OPERATIONAL_KEYS
from tests.e2e.test_capped import dry, finish, harness

# One value per operational key the harness used to refuse; each is checked in the resolved config.
OPERATIONAL = {
    "report_to": ("tensorboard", ["tensorboard"]),
    "run_name": ("capped-x", "capped-x"),
    "logging_steps": ("5", 5),
    "vllm_gpu_memory_utilization": ("0.3", 0.3),
    "vllm_enable_sleep_mode": ("true", True),
}


def dry_run(*args, env=None, recipe_text=None, tmp_path, own_process=False):
    """(exit status, stdout, stderr) of `train_capped.sh --dry-run ARGS`: in this process (`dry`), or through
    bash with `own_process`."""
    extra = []
    if recipe_text is not None:
        recipe = tmp_path / "recipe.env"
        recipe.write_text(recipe_text)
        extra = ["--recipe", str(recipe)]
    args = ["--dry-run", "--runs-dir", str(tmp_path), *extra, *args]
    return finish(harness(*args, env=env)) if own_process else dry(*args, env=env)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("train_capped: error:") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("BETA", "2", "beta=2.0 is out of range: must be in [0, 1]"),
        ("DIVERGENCE_CLIP", "-1", "divergence_clip=-1.0 is out of range"),
        ("JSD_TOKEN_CLIP", "-1", "divergence_clip=-1.0 is out of range"),  # the older name, the same check
        ("TOP_K_LOSS", "-3", "top_k_loss=-3 is out of range"),
        ("LOSS_TEMPERATURE", "-1", "loss_temperature=-1.0 is out of range"),
        ("LEARNING_RATE", "-1", "learning_rate=-1.0 is out of range: must be in (0, 1]"),
        ("LEARNING_RATE", "0", "learning_rate=0.0 is out of range: must be in (0, 1]"),
    ],
)
def test_dry_run_validates_values_as_training_does(tmp_path, key, value, message):
    rc, out, err = dry_run(env={f"OPSD_{key}": value}, tmp_path=tmp_path)
    assert rc == 2 and out == ""
    assert message in one_error_line(err)


def test_zero_steps_are_refused_before_training(tmp_path):
    # Outside the harness max_steps is settable; 0 used to start a run that trained one step.
    from opsd.launch.command_line import parse_config

    with pytest.raises(ValueError, match="max_steps=0 is out of range: must be > 0"):
        parse_config(["--output_dir", str(tmp_path), "--max_steps", "0"], environ={})


@pytest.mark.parametrize("route", ["recipe", "env", "flag"])
def test_operational_keys_reach_the_training_command(tmp_path, route):
    env, recipe_text, flags = None, None, []
    if route == "recipe":
        recipe_text = "".join(f"{k.upper()}={v}\n" for k, (v, _) in OPERATIONAL.items())
    elif route == "env":
        env = {f"OPSD_{k.upper()}": v for k, (v, _) in OPERATIONAL.items()}
    else:
        flags = ["--"] + [a for k, (v, _) in OPERATIONAL.items() for a in (f"--{k}", v)]
    rc, out, err = dry_run(*flags, env=env, recipe_text=recipe_text, tmp_path=tmp_path)
    assert rc == 0, err[-3000:]
    plan = json.loads(out)
    for key, (_, resolved) in OPERATIONAL.items():
        assert plan["resolved"][key] == resolved, key
        if route == "flag":
            assert any(c.startswith(f"--{key}=") for c in plan["command"]), key
        else:
            assert any(o.startswith(f"{key}=") for o in plan["overrides"]), key
    assert plan["resolved"]["max_steps"] == 100 and plan["resolved"]["seed"] == 42


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max_steps", "50"], "--max_steps is fixed by the capped harness"),
        (["--per_device_train_batch_size=8"], "--per_device_train_batch_size=8"),
        (["--seed", "1"], "--seed is fixed by the capped harness"),
        (["--beta", "0.5"], "set BETA in recipe.env or OPSD_BETA"),
        (["--config", "x.yaml"], "--config is not a config field"),
    ],
)
def test_pass_through_flags_refuse_budget_and_method_keys(tmp_path, flags, message):
    rc, out, err = dry_run("--", *flags, tmp_path=tmp_path)
    assert rc == 2 and out == ""
    assert message.split("=")[0] in err and "Traceback" not in err
    assert err.startswith("train_capped: error: pass-through flags: 1 problem(s):")


def test_operational_keys_in_recipe_and_env_parsers(tmp_path):
    recipe = tmp_path / "r.env"
    recipe.write_text("REPORT_TO=wandb\nBETA=0.5\nOPSD_LOGGING_STEPS=10\n")
    assert {o.field: o.value for o in parse_recipe(recipe)} == {
        "report_to": "wandb",
        "beta": "0.5",
        "logging_steps": "10.0",
    }
    got = env_overrides({"OPSD_RUN_NAME": "x", "OPSD_VLLM_ENABLE_SLEEP_MODE": "yes"}, allowed=CAPPED_KEYS)
    assert [(o.field, o.value) for o in got] == [("run_name", "x"), ("vllm_enable_sleep_mode", "true")]
    assert [o.field for o in flag_overrides(["--vllm-enable-sleep-mode", "--run_name=y"])] == [
        "vllm_enable_sleep_mode",
        "run_name",
    ]
    with pytest.raises(RecipeError, match="--logging_steps needs a value"):
        flag_overrides(["--logging_steps"])
    assert "max_steps" not in OPERATIONAL_KEYS and not OPERATIONAL_KEYS & {"seed", "learning_rate", "beta"}


def test_explicit_num_gpus_plans_gpu_processes_without_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the plan on a machine without GPUs")
    rc, out, err = dry_run("--num-gpus", "8", "--name", "x", tmp_path=tmp_path)
    assert rc == 0, err[-3000:]
    plan = json.loads(out)
    assert plan["num_processes"] == 8 and plan["accelerate_config"].endswith("zero2_8gpu.yaml")
    assert (plan["per_device_train_batch_size"], plan["gradient_accumulation_steps"]) == (4, 1)
    assert (
        "--num_processes" in plan["command"]
        and plan["command"][plan["command"].index("--num_processes") + 1] == "8"
    )
    assert plan["notes"] == [
        "8 GPU process(es) planned, and this machine has 0 GPU(s): this is the plan for a machine with 8"
    ]
    # Without --num-gpus the same machine plans one CPU process.
    rc, out, err = dry_run("--name", "x", tmp_path=tmp_path)
    assert rc == 0 and json.loads(out)["num_processes"] == 1
    assert json.loads(out)["accelerate_config"].endswith("cpu.yaml")
    # A real run cannot use GPUs that are not there: one line, exit 2, nothing launched.
    rc, out, err = finish(harness("--num-gpus", "2", "--name", "x", "--runs-dir", str(tmp_path)))
    assert rc == 2 and "this machine has 0 GPU(s)" in one_error_line(err) and "leave out --num-gpus" in err
    assert not (tmp_path / "x").exists()


def test_debug_shows_the_traceback(tmp_path):
    # Through bash, as a user runs it.
    rc, _, err = dry_run("--debug", env={"OPSD_BETA": "2"}, tmp_path=tmp_path, own_process=True)
    assert rc == 2 and "Traceback" in err
    assert (
        err.strip().splitlines()[-1]
        == "train_capped: error: beta=2.0 is out of range: must be in [0, 1] (from env OPSD_BETA)"
    )


@pytest.mark.parametrize(
    ("recipe_text", "env", "message"),
    [
        ("TOP_P=1.5\n", None, "top_p=1.5 is out of range: must be in (0, 1] (from {recipe}:1)"),
        (
            "LORA_DROPOUT=0.1\nWARMUP_STEPS=500\n",
            None,
            "warmup_steps=500.0 is out of range: must be below max_steps=100",
        ),
        (
            "",
            {"OPSD_VLLM_GPU_MEMORY_UTILIZATION": "5"},
            "vllm_gpu_memory_utilization=5.0 is out of range: must be in (0, 1] (from env OPSD_VLLM_GPU_MEMORY_UTILIZATION)",
        ),
    ],
)
def test_dry_run_refuses_out_of_range_values_naming_the_source(tmp_path, recipe_text, env, message):
    rc, out, err = dry_run(env=env, recipe_text=recipe_text, tmp_path=tmp_path)
    assert rc == 2 and out == ""
    assert message.format(recipe=tmp_path / "recipe.env") in one_error_line(err)


PATH_CASES = {
    # The dry run used to read these without bound until it was killed.
    "recipe.env linked to /dev/urandom": (
        ["--recipe", "{urandom}"], None, None,
        "recipe file '{urandom}' (a link to '/dev/urandom') is a character device, not a regular file",
    ),
    "TEACHER_PROMPT_FILE=/dev/zero in recipe.env": (
        [], None, "TEACHER_PROMPT_FILE=/dev/zero\n",
        "prompt template file '/dev/zero' is a character device, not a regular file",
    ),
    "OPSD_TEACHER_PROMPT_FILE=/dev/zero": (
        [], {"OPSD_TEACHER_PROMPT_FILE": "/dev/zero"}, None,
        "prompt template file '/dev/zero' is a character device, not a regular file",
    ),
    "--runs-dir that is a file": (
        ["--runs-dir", "{file}"], None, None, "--runs-dir '{file}' is a regular file, not a directory",
    ),
    "--accelerate-config that is a FIFO": (
        ["--accelerate-config", "{fifo}"], None, None,
        "accelerate config '{fifo}' is a FIFO (named pipe), not a regular file",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_dry_run_refuses_paths_that_are_not_what_they_must_be(tmp_path, case):
    args, env, recipe_text, message = PATH_CASES[case]
    paths = {
        "urandom": tmp_path / "recipe-link.env",
        "file": tmp_path / "runs",
        "fifo": tmp_path / "acc.yaml",
    }
    paths["urandom"].symlink_to("/dev/urandom")
    paths["file"].write_text("keep me\n")
    os.mkfifo(paths["fifo"])
    args = [a.format(**paths) for a in args]
    rc, out, err = dry_run(*args, env=env, recipe_text=recipe_text, tmp_path=tmp_path)
    assert rc == 2 and out == ""
    assert message.format(**paths) in one_error_line(err)
    assert not (tmp_path / "opsd").exists() and paths["file"].read_text() == "keep me\n"


def test_dry_run_lists_recipe_lines_that_env_values_replace(tmp_path):
    rc, out, err = dry_run(env={"OPSD_BETA": "1"}, recipe_text="LORA_R=8\nBETA=0.5\n", tmp_path=tmp_path)
    assert rc == 0, err[-3000:]
    plan = json.loads(out)
    recipe = tmp_path / "recipe.env"
    assert plan["replaced"] == [f"beta=0.5 ({recipe}:2) is replaced by beta=1.0 (env OPSD_BETA)"]
    assert plan["resolved"]["beta"] == 1.0 and "beta=1.0 (env OPSD_BETA)" in plan["overrides"]


def test_dry_run_validates_in_one_interpreter(tmp_path, monkeypatch, capsys):
    # The dry run used to start a second interpreter (opsd_train.py --dry-run) that imported torch,
    # transformers and TRL again; it now runs training's checks in this one.
    import subprocess

    from opsd.launch import capped

    def no_child(*args, **kwargs):
        raise AssertionError(f"the dry run started a process: {args}")

    monkeypatch.setattr(subprocess, "run", no_child)
    monkeypatch.setattr(subprocess, "Popen", no_child)
    for key in [k for k in os.environ if k.startswith("OPSD_") and k != "OPSD_CACHE_DIR"]:
        monkeypatch.delenv(key)
    rc = capped.main(["--dry-run", "--profile", "smoke", "--runs-dir", str(tmp_path), "--name", "x"])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    plan = json.loads(out.out)
    assert plan["resolved"]["max_steps"] == 100 and plan["data_rows"] > 0
    monkeypatch.setenv("OPSD_TOP_P", "1.5")
    rc = capped.main(["--dry-run", "--profile", "smoke", "--runs-dir", str(tmp_path), "--name", "x"])
    err = capsys.readouterr().err
    assert rc == 2 and one_error_line(err).endswith(
        "top_p=1.5 is out of range: must be in (0, 1] (from env OPSD_TOP_P)"
    )
