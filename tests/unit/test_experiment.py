"""Tests for opsd.experiment (spec, cells, schedule, verdict, rendering, commands) and the fixed KV cache of
opsd.method.engine_env.

No model, engine or training run: arms are parsed from recipe files written here; commands are parsed back
with shlex and checked against opsd.launch.capped's own plan of where a run writes; reports are built from synthetic
experiment directories whose per-sample values are typed in below and whose statistics are recomputed here in
plain Python (t quantiles typed from a table); the scheduler runs `sh -c` jobs that create the files it
checks.
"""

from __future__ import annotations

import io
import json
import math
import random
import shlex
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from opsd.configuration.sources import env_overrides, parse_recipe
from opsd.errors import InvalidValue, UserError
from opsd.evaluation.metrics import summarize
from opsd.experiment import cells as C
from opsd.experiment import commands, power, rendering, schedule, spec, verdict
from opsd.experiment.arms import parse_arm
from opsd.experiment.status import CellRow, Display, Status
from opsd.launch.capped import make_plan
from opsd.method.engine_env import kv_cache_bytes, kv_cache_gib

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Two-sided 95% Student t quantiles t_{0.975, df}, typed from a table.
T975 = {1: 12.706205, 2: 4.302653}


# --- plain-Python statistics (the references) -------------------------------------------------------------


def mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def var1(xs) -> float:
    """Sample variance, ddof=1."""
    xs = list(xs)
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def points(table) -> float:
    """100 x the mean over problems of the per-problem mean (problems weigh alike)."""
    return 100.0 * mean(mean(row) for row in table)


def t_interval(values, df_t: dict = T975) -> tuple[float, float, float]:
    m = mean(values)
    half = df_t[len(values) - 1] * math.sqrt(var1(values)) / math.sqrt(len(values))
    return m, m - half, m + half


def within_var(a_table, b_table) -> float:
    """(100^2 / P^2) * sum_p var_i(b_pi - a_pi, ddof=1) / n of one seed's paired difference."""
    per_problem = [
        var1([b - a for a, b in zip(a_row, b_row, strict=True)]) / len(a_row)
        for a_row, b_row in zip(a_table, b_table, strict=True)
    ]
    return 100.0**2 * sum(per_problem) / len(a_table) ** 2


# --- helpers -------------------------------------------------------------------------------------------------


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def refused(fn, *args, **kwargs) -> str:
    with pytest.raises(UserError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def make_spec(arms: dict[str, dict[str, str]] | None = None, seeds=(1, 2, 3), **shared) -> spec.Spec:
    arms = arms if arms is not None else {"A": {"clip_mode": "element"}, "B": {"clip_mode": "none"}}
    settings = {"profile": "smoke", "model": "tiny/model", "dataset": "builtin:easy", "eval_flags": [],
                "gpus_per_run": 0, **shared}  # fmt: skip
    return spec.Spec(
        **settings,
        arms={name: {"recipe": dict(r), "source": f"{name}.env"} for name, r in arms.items()},
        seeds=list(seeds),
    )


def options(tokens: list[str]) -> dict[str, str]:
    """`--flag value` pairs of an argv tail (every flag here takes a value)."""
    assert len(tokens) % 2 == 0, tokens
    pairs = dict(zip(tokens[::2], tokens[1::2], strict=True))
    assert all(k.startswith("--") for k in pairs), tokens
    return pairs


# === spec: arms ==============================================================================================


def test_parse_arm_recipe_file_gives_its_normalised_settings(tmp_path: Path) -> None:
    write(
        tmp_path / "recipes" / "mine.env",
        "# my recipe\n\nLEARNING_RATE=1e-5   # the learning rate\nCLIP_MODE=element\nOPSD_BETA=0.5\n"
        "FIX_POSITION_IDS=yes\n",
    )
    arm = parse_arm("mine=recipes/mine.env", None, cwd=tmp_path)
    assert arm.name == "mine"
    # Hand-normalised: lower-case field names, floats as repr(float), booleans as true/false, prefix dropped.
    assert arm.recipe == {
        "learning_rate": "1e-05",
        "clip_mode": "element",
        "beta": "0.5",
        "fix_position_ids": "true",
    }
    assert arm.source == str(tmp_path / "recipes" / "mine.env")  # recorded absolute: the cells run elsewhere


def test_parse_arm_inline_overrides_win_over_the_base_recipe(tmp_path: Path) -> None:
    base = write(tmp_path / "base.env", "# base\nLEARNING_RATE=1e-5\nCLIP_MODE=element\n")
    arm = parse_arm("lr2=LEARNING_RATE=2e-5, TEMPERATURE=0.7", base)
    assert arm.name == "lr2"
    assert arm.recipe == {"learning_rate": "2e-05", "clip_mode": "element", "temperature": "0.7"}
    assert str(base) in arm.source and "LEARNING_RATE=2e-5" in arm.source


def test_parse_arm_inline_without_a_base_recipe_holds_only_its_overrides(tmp_path: Path) -> None:
    arm = parse_arm("x=CLIP_MODE=none,BETA=1", None)
    assert arm.recipe == {"clip_mode": "none", "beta": "1.0"}
    assert arm.source == "CLIP_MODE=none,BETA=1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("noequals", ["'noequals'", "NAME=RECIPE_FILE"]),
        ("x=", ["'x='", "NAME=RECIPE_FILE"]),
        (".x=CLIP_MODE=none", ["arm name '.x'"]),
        ("-x=CLIP_MODE=none", ["arm name '-x'"]),
        ("a/b=CLIP_MODE=none", ["arm name 'a/b'"]),
        ("base=CLIP_MODE=none", ["arm name 'base'", "base model"]),
        ("pub=missing.env", ["no recipe file at", "missing.env"]),
        ("a=CLIP_MODE=bogus", ["clip_mode", "'bogus'", "element"]),
        ("a=NOT_A_KEY=1", ["NOT_A_KEY is not a config field"]),
        ("a=MAX_STEPS=5", ["MAX_STEPS", "fixed by the capped harness"]),
        ("a=LEARNING_RATE=fast", ["learning_rate", "'fast'"]),
    ],
)
def test_parse_arm_refusals_name_the_problem(tmp_path: Path, text: str, expected: list[str]) -> None:
    message = refused(parse_arm, text, None, cwd=tmp_path)
    assert message.startswith("--arm ")
    for part in expected:
        assert part in message, (part, message)


def test_parse_arm_refuses_a_bad_line_of_a_recipe_file(tmp_path: Path) -> None:
    write(tmp_path / "bad.env", "CLIP_MODE=element\nTOP_P=lots\n")
    message = refused(parse_arm, "bad=bad.env", None, cwd=tmp_path)
    assert "--arm bad" in message and "top_p" in message and "'lots'" in message
    assert "\n" not in message  # one line


# === spec: seeds and evaluation flags ==========================================================================


@pytest.mark.parametrize(
    ("text", "seeds"), [("42,43,44", [42, 43, 44]), (" 7 ", [7]), ("3, 1,2", [3, 1, 2]), ("0,5,", [0, 5])]
)
def test_parse_seeds_accepts(text: str, seeds: list[int]) -> None:
    assert spec.parse_seeds(text) == seeds


@pytest.mark.parametrize(
    "text", ["", ",", " , ", "a", "1,b", "1.5", "1,1", "-1", "2,-3", "1e3", "+5", "2147483648", "0x10", "4 2"]
)
def test_parse_seeds_refuses(text: str) -> None:
    assert refused(spec.parse_seeds, text).startswith(f"--seeds {text!r}")


def test_check_eval_flags_accepts_protocol_flags() -> None:
    spec.check_eval_flags([])
    spec.check_eval_flags(["--dataset", "builtin", "--n", "2"])
    spec.check_eval_flags(["--n", "4", "--max-tokens", "128", "--no-thinking"])


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--out", "x"], "--out"),
        (["--model", "m"], "--model"),
        (["--adapter", "a"], "--adapter"),
        (["--no-merge-adapter"], "--merge-adapter"),
        (["--merge-adapter", "true"], "--merge-adapter"),
        (["--checkpoints", "runs/x"], "--checkpoints"),
        (["--n", "2", "--num-gpus", "2"], "--num-gpus"),
    ],
)
def test_check_eval_flags_refuses_flags_the_experiment_owns(flags: list[str], named: str) -> None:
    message = refused(spec.check_eval_flags, flags)
    assert message.startswith("--eval-flags") and named in message


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--n", "0"], "n=0"),
        (["--bogus"], "--bogus"),
        # An argparse type error must be a UserError (one line) as well, not argparse's SystemExit with
        # eval_aime.py's whole usage text.
        (["--n", "abc"], "abc"),
    ],
)
def test_check_eval_flags_refuses_invalid_values(flags: list[str], named: str) -> None:
    message = refused(spec.check_eval_flags, flags)
    assert message.startswith("--eval-flags") and named in message


# === spec: merge, save, load ==================================================================================


def test_merge_into_a_new_directory_records_history(tmp_path: Path) -> None:
    new = make_spec()
    merged = spec.merge(None, new, tmp_path)
    assert merged.arm_names == ["A", "B"] and merged.seeds == [1, 2, 3]
    assert len(merged.history) == 1
    assert merged.history[0]["arms"] == ["A", "B"] and merged.history[0]["seeds"] == [1, 2, 3]
    assert "time" in merged.history[0]


def test_merge_adds_new_arms_and_seeds_and_records_them(tmp_path: Path) -> None:
    old = spec.merge(None, make_spec(), tmp_path)
    # The rerun names A again (unchanged), a new arm C and a new seed 4; B is not named and is kept.
    new = make_spec({"A": {"clip_mode": "element"}, "C": {"clip_mode": "token"}}, seeds=(3, 4))
    merged = spec.merge(old, new, tmp_path)
    assert merged.arm_names == ["A", "B", "C"]
    assert merged.arms["B"]["recipe"] == {"clip_mode": "none"}
    assert merged.arms["C"]["recipe"] == {"clip_mode": "token"}
    assert merged.seeds == [1, 2, 3, 4]
    assert len(merged.history) == 2
    assert merged.history[1]["added_arms"] == ["C"] and merged.history[1]["added_seeds"] == [4]
    # The same command again adds nothing and records nothing.
    again = spec.merge(merged, make_spec({"A": {"clip_mode": "element"}}, seeds=(1,)), tmp_path)
    assert again.arm_names == ["A", "B", "C"] and again.seeds == [1, 2, 3, 4]
    assert len(again.history) == 2


@pytest.mark.parametrize(
    ("key", "value"),
    [("eval_flags", ["--n", "2"]), ("profile", "demo"), ("model", "other/model"), ("dataset", "x.jsonl"),
     ("gpus_per_run", 2), ("accelerate_config", "/x/acc.yaml")],
)  # fmt: skip
def test_merge_refuses_a_changed_shared_setting(tmp_path: Path, key: str, value) -> None:
    old = spec.merge(None, make_spec(), tmp_path)
    message = refused(spec.merge, old, make_spec(**{key: value}), tmp_path)
    assert f"{key}=" in message and repr(value) in message and str(tmp_path) in message


def test_merge_refuses_a_changed_arm_recipe_naming_the_change(tmp_path: Path) -> None:
    old = spec.merge(
        None, make_spec({"A": {"clip_mode": "element", "beta": "0.5"}, "B": {"clip_mode": "none"}}), tmp_path
    )
    new = make_spec({"A": {"clip_mode": "none", "temperature": "0.7"}, "B": {"clip_mode": "none"}})
    message = refused(spec.merge, old, new, tmp_path)
    assert "arm 'A'" in message
    assert "CLIP_MODE element -> none" in message
    assert "BETA 0.5 -> (unset)" in message
    assert "TEMPERATURE (unset) -> 0.7" in message
    assert "'B'" not in message


def test_save_load_round_trip_and_the_arm_recipe_files(tmp_path: Path) -> None:
    write(tmp_path / "base.env", "LEARNING_RATE=1e-5\nCLIP_MODE=element\nDATA_FILTER=hard_numeric\n")
    arms = [
        parse_arm("published=CLIP_MODE=element", tmp_path / "base.env"),
        parse_arm("nolimit=CLIP_MODE=none,TEMPERATURE=0.7,FIX_POSITION_IDS=no", tmp_path / "base.env"),
    ]
    new = replace(make_spec(seeds=(42, 43), eval_flags=["--n", "2"]),
                  arms={a.name: {"recipe": a.recipe, "source": a.source} for a in arms})  # fmt: skip
    directory = tmp_path / "exp"
    saved = spec.merge(None, new, directory)
    spec.save(directory, saved)
    loaded = spec.load(directory)
    assert loaded == saved
    assert json.loads((directory / "experiment.json").read_text())["seeds"] == [42, 43]
    for arm in arms:
        path = directory / "recipes" / f"{arm.name}.env"
        lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
        assert all(line.split("=", 1)[0].isupper() for line in lines)
        assert {o.field: o.value for o in parse_recipe(path)} == arm.recipe
    assert spec.load(tmp_path / "nothing-here") is None


def test_arm_recipe_file_keeps_values_with_a_hash_or_spaces(tmp_path: Path) -> None:
    # A quoted value may hold ' #' (a comment marker when unquoted) or spaces; the arm's copy
    # DIR/recipes/NAME.env, which the cells train from, must parse back to the same recipe.
    write(
        tmp_path / "r.env",
        "CLIP_MODE=element\nSTUDENT_PROMPT_FILE=\"prompts/v2 #draft.txt\"\nRUN_NAME='my run'\n",
    )
    arm = parse_arm("q=r.env", None, cwd=tmp_path)
    # A path is read where the command is given (here `cwd`) and recorded absolute: the cells run elsewhere.
    assert arm.recipe["student_prompt_file"] == str(tmp_path / "prompts/v2 #draft.txt")
    directory = tmp_path / "exp"
    new = replace(make_spec(), arms={"q": {"recipe": arm.recipe, "source": arm.source}})
    spec.save(directory, spec.merge(None, new, directory))
    assert {o.field: o.value for o in parse_recipe(directory / "recipes" / "q.env")} == arm.recipe


def saved(directory: Path) -> dict:
    spec.save(directory, spec.merge(None, make_spec(), directory))
    return json.loads((directory / "experiment.json").read_text())


def edit(data: dict, path: tuple, value) -> dict:
    """A copy of `data` with the entry at `path` (keys) set to `value`, or deleted for value DELETE."""
    data = json.loads(json.dumps(data))
    *parents, last = path
    target = data
    for key in parents:
        target = target[key]
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return data


DELETE = object()
A_RECIPE = {"recipe": {"clip_mode": "element"}, "source": "A.env"}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ((("arms", "../../x"), A_RECIPE), "'../../x'"),  # would write outside the directory
        ((("arms", "/abs"), A_RECIPE), "'/abs'"),
        ((("arms", "a" * 300), A_RECIPE), "at most 64"),
        ((("arms", "base"), A_RECIPE), "'base'"),
        ((("arms", "a"), A_RECIPE), "differ only in case"),
        ((("arms", "A", "recipe", "clip_mode"), "bogus"), "does not parse"),
        ((("arms", "A", "recipe", "beta"), 0.5), "not a mapping of settings to strings"),
        ((("arms", "A", "recipe", "beta"), "0.50"), "normalised form"),
        ((("arms", "A", "recipe", "max_steps"), "5"), "does not parse"),
        ((("arms", "A", "source"), DELETE), "'recipe': ..., 'source'"),
        ((("arms",), {}), "arms is not a mapping"),
        ((("seeds",), []), "seeds must be"),
        ((("seeds",), [1, 1]), "seeds must be"),
        ((("seeds",), [-1]), "seeds must be"),
        ((("seeds",), ["1"]), "seeds must be"),
        ((("seeds",), [True]), "seeds must be"),
        ((("seeds",), [2**40]), "seeds must be"),
        ((("profile",), "huge"), "profile 'huge'"),
        ((("model",), None), "model is None"),
        ((("model",), "tiny\n| x |"), "model is 'tiny\\n| x |', not one line"),  # report.md quotes it
        ((("eval_flags",), ["--n", "4\n"]), "eval_flags is not a list of one-line strings"),
        ((("arms", "A", "source"), "A.env\n# x"), "'source': one line of text"),
        ((("seeds",), list(range(1001))), "seeds must be 1 to 1000"),
        ((("eval_flags",), "--n 4"), "eval_flags"),
        ((("gpus_per_run",), -1), "gpus_per_run"),
        ((("gpus_per_run",), 1.5), "gpus_per_run"),
        ((("history",), {}), "history"),
        ((("colour",), "red"), "unknown field(s) ['colour']"),
        ((("dataset",), DELETE), "missing field(s) ['dataset']"),
        ((("layout",), DELETE), "older opsd.experiment"),
        ((("layout",), 1), "older opsd.experiment"),
    ],
)
def test_load_refuses_a_hand_edited_experiment_file(tmp_path: Path, change, named: str) -> None:
    data = edit(saved(tmp_path), *change)
    write(tmp_path / "experiment.json", json.dumps(data))
    message = refused(spec.load, tmp_path)
    assert named in message and "\n" not in message, message
    assert len(message) < 600


@pytest.mark.parametrize(
    "text", ["{not json", "[]", "null", '"x"', "\xff\xfe", "", '{"profile": "smoke"} trailing']
)
def test_load_refuses_a_damaged_experiment_file(tmp_path: Path, text: str) -> None:
    (tmp_path / "experiment.json").write_bytes(text.encode("latin-1"))
    message = refused(spec.load, tmp_path)
    assert "experiment.json" in message and "\n" not in message


def test_load_reads_back_what_save_wrote(tmp_path: Path) -> None:
    data = saved(tmp_path)
    assert data["layout"] == spec.LAYOUT
    assert spec.load(tmp_path) == spec.Spec(**data)


# === spec / commands: the commands of each cell ======================================================================


def command_lines(out: str) -> tuple[list[str], list[list[str]]]:
    lines = out.strip().splitlines()
    return [x for x in lines if x.startswith("#")], [shlex.split(x) for x in lines if not x.startswith("#")]


def check_train(train: list[str], directory: Path, sp: spec.Spec, arm: str, seed: int) -> None:
    assert train[0] == "bash" and Path(train[1]).name == "train_capped.sh" and Path(train[1]).is_file()
    flags = options(train[2:])
    assert flags == {
        "--name": arm, "--seed": str(seed), "--profile": sp.profile, "--model": sp.model, "--dataset": sp.dataset,
        "--recipe": str(directory / "recipes" / f"{arm}.env"), "--runs-dir": str(directory / "runs"),
    }  # fmt: skip
    # The recipe the cell trains from is the arm's own copy.
    assert {o.field: o.value for o in parse_recipe(flags["--recipe"])} == sp.arms[arm]["recipe"]


def where_capped_writes(train: list[str]) -> Path:
    """opsd.launch.capped's own plan for these train_capped.sh flags: the run's final checkpoint."""
    flags = options(train[2:])
    plan = make_plan(
        name=flags["--name"], seed=int(flags["--seed"]), num_gpus=1, profile=flags["--profile"],
        model=flags["--model"], dataset=flags["--dataset"], root=Path(train[1]).parent, gpu=False,
        recipe=Path(flags["--recipe"]), runs_dir=Path(flags["--runs-dir"]),
    )  # fmt: skip
    return Path(plan.final_checkpoint)


@pytest.mark.parametrize("every_checkpoint", [False, True])
def test_print_commands_one_line_per_cell(
    tmp_path: Path, capsys: pytest.CaptureFixture, every_checkpoint: bool
) -> None:
    directory = tmp_path / "my exp"  # a space: the lines must be quoted for a shell
    flags = ["--dataset", "builtin", "--n", "2"]
    sp = spec.merge(None, make_spec(seeds=(7, 8), eval_flags=flags), directory)
    spec.save(directory, sp)
    commands.print_commands(directory, sp, every_checkpoint)
    comments, argvs = command_lines(capsys.readouterr().out)
    assert [c for c in comments if c.startswith("# cell")] == [
        "# cell A/7",
        "# cell B/7",
        "# cell A/8",
        "# cell B/8",
    ]
    *bases, report_line = [c for c in argvs if "&&" not in c]
    cells = [c for c in argvs if "&&" in c]
    assert len(cells) == 4 and len(bases) == 2
    for base, seed in zip(
        bases, (7, 8), strict=True
    ):  # the base model once per seed, with its sampling seeds
        assert base[0] == sys.executable and Path(base[1]).name == "eval_aime.py" and Path(base[1]).is_file()
        out = str(directory / "evals" / "base" / f"seed{seed}")
        assert base[2:] == ["--model", "tiny/model", *flags, "--seed", str(seed), "--out", out]
    assert report_line[1:] == ["-m", "opsd.experiment", "report", str(directory)]
    for tokens, (arm, seed) in zip(cells, [("A", 7), ("B", 7), ("A", 8), ("B", 8)], strict=True):
        assert tokens.count("&&") == 1
        cut = tokens.index("&&")
        train, ev = tokens[:cut], tokens[cut + 1 :]
        check_train(train, directory, sp, arm, seed)
        assert ev[0] == sys.executable and Path(ev[1]).name == "eval_aime.py"
        assert ev[2:10] == ["--model", "tiny/model", *flags, "--seed", str(seed)]
        run = directory / "runs" / arm / f"capped_seed{seed}"
        target = run if every_checkpoint else run / "checkpoint-100"
        assert ev[10:] == ["--checkpoints", str(target), "--no-base", "--merge-adapter",
                          "--out", str(directory / "evals" / arm / f"seed{seed}")]  # fmt: skip
        # The checkpoint scored is the one train_capped.sh writes, by opsd.launch.capped's own plan.
        assert where_capped_writes(train) == run / "checkpoint-100"


def test_train_argv_passes_gpus_accelerate_config_and_extra_flags(tmp_path: Path) -> None:
    sp = make_spec(gpus_per_run=2, accelerate_config="/x/acc.yaml")
    argv = spec.train_argv(tmp_path, sp, "A", 5, extra=["--report_to", "none"])
    cut = argv.index("--")
    assert argv[cut + 1 :] == ["--report_to", "none"]
    flags = options(argv[2:cut])
    assert flags["--num-gpus"] == "2" and flags["--accelerate-config"] == "/x/acc.yaml"
    assert flags["--seed"] == "5" and flags["--name"] == "A"
    assert "--num-gpus" not in spec.train_argv(tmp_path, make_spec(), "A", 5)


# === report: synthetic experiments ===========================================================================

PIDS = ["2024-I-1", "2024-I-2", "2024-II-3"]
# Per-sample values, [problem][sample index], 3 problems x 4 samples. CORRECT implies BOXED.
CORRECT = {
    ("A", 1): [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]],  # 25.00
    ("A", 2): [[1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1]],  # 33.33
    ("A", 3): [[0, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]],  # 25.00
    ("B", 1): [[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]],  # 50.00
    ("B", 2): [[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 0, 1]],  # 66.67
    ("B", 3): [[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 1, 0]],  # 41.67
    # The base model, scored once per seed with that seed's sampling seeds.
    ("base", 1): [[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]],  # 8.33
    ("base", 2): [[0, 1, 0, 0], [1, 0, 0, 1], [0, 0, 0, 0]],  # 25.00
    ("base", 3): [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],  # 0.00
}
BOXED = {
    ("A", 1): [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0]],  # 5/12
    ("A", 2): [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 1]],  # 6/12
    ("A", 3): [[0, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]],  # 4/12
    ("B", 1): [[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]],  # 7/12
    ("B", 2): [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 0, 1]],  # 9/12
    ("B", 3): [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 1, 0]],  # 7/12
    ("base", 1): [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]],  # 2/12
    ("base", 2): [[0, 1, 0, 0], [1, 0, 0, 1], [0, 0, 1, 0]],  # 4/12
    ("base", 3): [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]],  # 0/12
}
SEEDS = (1, 2, 3)


def curve(arm: str, seed: int, step: int) -> dict:
    off = 0.05 if arm == "B" else 0.0
    return {"step": step, "loss": round(2.0 - 0.01 * step - 0.1 * seed + off, 6),
            "probe/divergence": round(0.5 + 0.001 * step + off, 6), "rollout/correct": round(0.2 + 0.002 * step, 6),
            "completions/mean_length": 100 + step + seed, "learning_rate": 1e-5}  # fmt: skip


def write_eval(where: Path, cell: str, seed: int) -> None:
    """samples.jsonl (in a shuffled finish order) and summary.json as eval_aime.py writes them."""
    key = (cell, seed)
    records = []
    for p, (c_row, b_row) in enumerate(zip(CORRECT[key], BOXED[key], strict=True)):
        for i, (c, b) in enumerate(zip(c_row, b_row, strict=True)):
            assert b or not c, key
            records.append({
                "id": PIDS[p], "idx": i, "problem_index": p, "request_seed": 1000 * p + i, "text": "...",
                "extracted": ("42" if c else "7") if b else None, "correct": bool(c), "has_box": bool(b),
                "n_tokens": 100 + 10 * i + p, "truncated": not b, "gold": "42",
            })  # fmt: skip
    per_problem = {
        pid: sorted((r for r in records if r["id"] == pid), key=lambda r: r["idx"]) for pid in PIDS
    }
    random.Random(f"{key}").shuffle(records)
    write(where / "samples.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    write(where / "summary.json", json.dumps({"config": {"n": 4}, "metrics": summarize(per_problem)}))


def write_run(directory: Path, arm: str, seed: int, last_step: int) -> None:
    run = spec.run_dir(directory, arm, seed)
    steps = range(20, last_step + 1, 20)
    write(run / "metrics.jsonl", "".join(json.dumps(curve(arm, seed, k)) + "\n" for k in steps))
    for k in steps:
        (run / f"checkpoint-{k}").mkdir()
        (run / f"checkpoint-{k}" / ".complete").touch()


def lay_out_experiment(
    directory: Path,
    sp: spec.Spec,
    write_evaluation: Callable[[Path, str, int], None],
    *,
    unscored: dict[tuple[str, int], int | None] | None = None,
    base: bool = True,
) -> Path:
    """A synthetic experiment directory laid out as the experiment writes one, shared by the tests that report
    on one (here and tests/unit/test_benchmarks_verdict.py): `sp` recorded, the base model scored once per
    seed (unless not `base`), every cell trained to step 100 and scored at its final checkpoint but those in
    `unscored` (cell -> the step its training reached, None for not started).
    `write_evaluation(where, cell, seed)` writes one evaluation (cell "base" for the base model)."""
    unscored = unscored or {}
    spec.save(directory, spec.merge(None, sp, directory))
    if base:
        for seed in sp.seeds:
            write_evaluation(spec.base_eval_dir(directory, seed), "base", seed)
    for arm in sp.arms:
        for seed in sp.seeds:
            if (arm, seed) in unscored:
                if unscored[arm, seed] is not None:
                    write_run(directory, arm, seed, unscored[arm, seed])
                continue
            write_run(directory, arm, seed, 100)
            write_evaluation(spec.eval_dir(directory, arm, seed) / "checkpoint-100", arm, seed)
    return directory


def experiment(directory: Path, *, unscored: dict[tuple[str, int], int | None] | None = None,
               arms=("A", "B"), seeds=SEEDS, base: bool = True, recipes: dict | None = None) -> Path:  # fmt: skip
    """A synthetic experiment (`lay_out_experiment`) of this file's typed-in samples; `recipes` ({arm: recipe})
    replaces the arms' clip modes."""
    recipes = recipes or {a: {"clip_mode": "element" if a == "A" else "none"} for a in arms}
    return lay_out_experiment(
        directory, make_spec(recipes, seeds=seeds), write_eval, unscored=unscored, base=base
    )


def test_report_of_a_complete_experiment(tmp_path: Path) -> None:
    directory = experiment(tmp_path / "exp")
    result, paths = rendering.write(directory, target_diff=10.0, reps=2000)

    # Per arm: each seed's rates, their mean and the between-seed SE.
    for arm in ("A", "B"):
        e = result["arms"][arm]
        assert e["missing"] == {}
        avgs = [points(CORRECT[arm, s]) for s in SEEDS]
        for s, avg in zip(SEEDS, avgs, strict=True):
            cell = e["per_seed"][str(s)]
            assert cell["avg"] == pytest.approx(avg)
            assert cell["format_rate"] == pytest.approx(points(BOXED[arm, s]))
            assert cell["pass_at_k"] == pytest.approx(100 * mean(float(any(r)) for r in CORRECT[arm, s]))
        assert e["mean"]["avg"]["mean"] == pytest.approx(mean(avgs))
        assert e["mean"]["avg"]["se"] == pytest.approx(math.sqrt(var1(avgs) / 3))
        assert e["mean"]["avg"]["n"] == 3
        # vs the base model: each seed's difference from the base scored with that seed's sampling seeds.
        base_diffs = [a - points(CORRECT["base", s]) for s, a in zip(SEEDS, avgs, strict=True)]
        vs = e["vs_base"]["accuracy"]
        assert vs["per_seed"] == {str(s): pytest.approx(d) for s, d in zip(SEEDS, base_diffs, strict=True)}
        if arm == "B":  # 50 - 8.33, 66.67 - 25, 41.67 - 0: identical, so their spread is unknown
            assert base_diffs == pytest.approx([125 / 3] * 3)
            assert (
                vs["interval"]["low"] is None and vs["interval"]["high"] is None and vs["interval"]["se"] == 0
            )
            assert "cannot tell: the 3 per-seed differences are identical" in vs["verdict"]
            assert vs["plan"]["why"] and vs["seeds_needed"] is None and vs["mde_80"] is None
            continue
        est, low, high = t_interval(base_diffs)
        assert (vs["interval"]["estimate"], vs["interval"]["low"], vs["interval"]["high"]) == pytest.approx(
            (est, low, high)
        )
    assert [result["arms"]["A"]["per_seed"][str(s)]["avg"] for s in SEEDS] == pytest.approx([25, 100 / 3, 25])
    assert result["base"]["avg"] == pytest.approx(mean(points(CORRECT["base", s]) for s in SEEDS))
    assert result["base"]["format_rate"] == pytest.approx(mean(points(BOXED["base", s]) for s in SEEDS))
    assert result["base_per_seed"]["2"]["avg"] == pytest.approx(25.0)

    # B - A, accuracy: per seed 25, 33.33, 16.67 (hand-computed), mean 25 ± 4.302653 * 8.333 / sqrt(3).
    comp = result["comparisons"]["B"]["accuracy"]
    diffs = [points(CORRECT["B", s]) - points(CORRECT["A", s]) for s in SEEDS]
    assert diffs == pytest.approx([25, 100 / 3, 50 / 3])
    assert comp["seeds"] == [1, 2, 3]
    assert comp["per_seed"] == {str(s): pytest.approx(d) for s, d in zip(SEEDS, diffs, strict=True)}
    iv = comp["interval"]
    assert iv["method"] == "seed-paired t" and iv["df"] == 2 and iv["n_seeds"] == 3
    assert (iv["estimate"], iv["low"], iv["high"]) == pytest.approx(t_interval(diffs), abs=1e-4)
    assert (iv["low"], iv["high"]) == pytest.approx((25 - 20.70115, 25 + 20.70115), abs=1e-4)
    assert iv["se"] == pytest.approx(math.sqrt(var1(diffs) / 3))
    boot = comp["bootstrap"]
    assert boot["method"] == "hierarchical bootstrap" and boot["estimate"] == pytest.approx(25.0)
    assert boot["low"] <= 25.0 <= boot["high"]

    # Variance components of the per-seed difference.
    v = comp["variance"]
    expected_within = mean(within_var(CORRECT["A", s], CORRECT["B", s]) for s in SEEDS)
    assert v["within_var"] == pytest.approx(expected_within)
    assert v["total_var"] == pytest.approx(var1(diffs))
    assert v["between_var"] == pytest.approx(max(0.0, var1(diffs) - expected_within))
    assert v["total_sd"] == pytest.approx(math.sqrt(var1(diffs)))
    # Planning from sigma_d, never below the evaluation noise alone, and from its chi-square bounds (df 2:
    # chi2 quantiles 0.0506356 and 7.377759, typed from a table).
    sd = max(math.sqrt(var1(diffs)), math.sqrt(expected_within))
    plan = comp["plan"]
    assert plan["sd"] == pytest.approx(sd)
    bounds = [max(math.sqrt(var1(diffs) * 2 / q), math.sqrt(expected_within)) for q in (7.377759, 0.0506356)]
    assert plan["sd_range"] == pytest.approx(bounds, rel=1e-6)
    assert comp["target_diff"] == 10.0
    for n, sigma in zip([comp["seeds_needed"], *plan["seeds_range"]], [sd, *bounds], strict=True):
        # The seeds needed for 10 points reach 80% power, one fewer does not.
        assert isinstance(n, int) and n >= 2
        assert power.power_paired_t(10.0, sigma, n) >= 0.8 > power.power_paired_t(10.0, sigma, n - 1)
    assert power.power_paired_t(comp["mde_80"], sd, 3) == pytest.approx(0.8, abs=1e-6)
    assert comp["planning"] == power.describe_plan(plan, 3, 10.0)

    # B - A, format rate: per seed 2/12, 3/12, 3/12.
    fmt = result["comparisons"]["B"]["format rate"]
    fdiffs = [points(BOXED["B", s]) - points(BOXED["A", s]) for s in SEEDS]
    assert fdiffs == pytest.approx([100 * 2 / 12, 25, 25])
    assert fmt["per_seed"] == {str(s): pytest.approx(d) for s, d in zip(SEEDS, fdiffs, strict=True)}
    assert fmt["interval"]["method"] == "seed-paired t"
    assert (fmt["interval"]["estimate"], fmt["interval"]["low"], fmt["interval"]["high"]) == pytest.approx(
        t_interval(fdiffs), abs=1e-4
    )
    assert fmt["variance"]["within_var"] == pytest.approx(
        mean(within_var(BOXED["A", s], BOXED["B", s]) for s in SEEDS)
    )
    assert list(result["comparisons"]) == ["B"]  # the baseline is the first arm, not compared with itself

    # Training curves, as written.
    loss = result["curves"]["B"]["2"]["loss"]
    assert loss == [[k, pytest.approx(curve("B", 2, k)["loss"])] for k in range(20, 101, 20)]
    assert set(result["curves"]["A"]["1"]) == {
        "loss",
        "probe/divergence",
        "rollout/correct",
        "completions/mean_length",
    }
    assert result["curves"]["A"]["3"]["rollout/correct"][-1] == [100, pytest.approx(0.4)]

    # The files.
    names = sorted(p.name for p in paths)
    assert names == ["curves.png", "report.md", "summary.json", "verdict.png"]
    assert json.loads((directory / "summary.json").read_text()) == json.loads(json.dumps(result))
    md = (directory / "report.md").read_text()
    assert "| A | 3 of 3 |" in md and "| B | 3 of 3 |" in md
    assert "Base model (mean over its 3 evaluation(s)" in md and "avg@4 11.11" in md
    assert "### B − A" in md and "planned seeds" not in md
    assert "per seed: 1: +25.00, 2: +33.33, 3: +16.67" in md
    for png in ("verdict.png", "curves.png"):
        assert (directory / png).read_bytes()[:8] == PNG_SIGNATURE


def test_report_of_a_partial_experiment(tmp_path: Path) -> None:
    # B's seed 3 is still training: metrics.jsonl at step 40, no checkpoint-100.
    directory = experiment(tmp_path / "exp", unscored={("B", 3): 40})
    result = verdict.build(directory, reps=500)
    b = result["arms"]["B"]
    assert sorted(b["per_seed"]) == ["1", "2"]
    assert b["missing"] == {"3": "training at step 40/100"}
    assert b["mean"]["avg"]["n"] == 2
    comp = result["comparisons"]["B"]["accuracy"]
    assert comp["seeds"] == [1, 2]
    diffs = [points(CORRECT["B", s]) - points(CORRECT["A", s]) for s in (1, 2)]
    assert comp["interval"]["df"] == 1
    assert (comp["interval"]["estimate"], comp["interval"]["low"], comp["interval"]["high"]) == pytest.approx(
        t_interval(diffs), abs=1e-4
    )
    md = rendering.markdown(result)
    assert "| B | 2 of 3 |" in md and "| A | 3 of 3 |" in md
    assert "over 2 of the 3 planned seeds (1, 2)" in md
    assert "3: training at step 40/100" in md


def test_report_missing_cells_say_why(tmp_path: Path) -> None:
    directory = experiment(tmp_path / "exp", unscored={("B", 3): 100, ("B", 2): None, ("A", 3): 60})
    # B/3 trained to step 100 but never scored; B/2 failed; A/3 stopped at step 60 and its eval failed.
    # (write_run marks checkpoint-100 complete for B/3 only.)
    log = str(directory / "logs" / "train-B-s2.log")
    C.write_failed(directory, {
        "train-B-s2": {"job": "train B/2", "exit": 3, "attempts": 2, "log": log},
        "eval-A-s3": {"job": "eval A/3", "exit": 1, "attempts": 2, "log": "/l/eval-A-s3.log"},
    })  # fmt: skip
    result = verdict.build(directory, reps=200)
    assert result["arms"]["B"]["missing"] == {
        "2": f"train failed (2 attempts, exit 3; {log})",
        "3": "trained, not scored yet",
    }
    assert result["arms"]["A"]["missing"] == {"3": "eval failed (2 attempts, exit 1; /l/eval-A-s3.log)"}
    assert result["comparisons"]["B"]["accuracy"]["seeds"] == [1]
    md = rendering.markdown(result)
    assert f"2: train failed (2 attempts, exit 3; {log})" in md


def test_report_baseline_choice(tmp_path: Path) -> None:
    directory = experiment(tmp_path / "exp")
    message = refused(verdict.build, directory, baseline="C", reps=200)
    assert "--baseline 'C'" in message and "A, B" in message
    result = verdict.build(directory, baseline="B", reps=200)
    assert list(result["comparisons"]) == ["A"]
    diffs = [points(CORRECT["A", s]) - points(CORRECT["B", s]) for s in SEEDS]
    assert result["comparisons"]["A"]["accuracy"]["per_seed"] == {
        str(s): pytest.approx(d) for s, d in zip(SEEDS, diffs, strict=True)
    }
    assert "Against the baseline `B`" in rendering.markdown(result)
    assert "holds no experiment.json" in refused(verdict.build, tmp_path / "empty")


def test_report_with_one_common_seed_is_paired_over_problems(tmp_path: Path) -> None:
    directory = experiment(tmp_path / "exp", unscored={("B", 2): None, ("B", 3): None}, base=False)
    result = verdict.build(directory, reps=200)
    assert result["base"] is None and "vs_base" not in result["arms"]["A"]
    comp = result["comparisons"]["B"]["accuracy"]
    assert comp["seeds"] == [1]
    iv = comp["interval"]
    assert iv["method"] == "paired t over problems" and iv["n_seeds"] == 1 and iv["df"] == 2
    # Per-problem differences of seed 1: 100 * (0.75 - 0.25, 0.5 - 0.5, 0.25 - 0) = 50, 0, 25.
    per_problem = [100 * (mean(b) - mean(a)) for a, b in zip(CORRECT["A", 1], CORRECT["B", 1], strict=True)]
    assert per_problem == pytest.approx([50, 0, 25])
    assert (iv["estimate"], iv["low"], iv["high"]) == pytest.approx(t_interval(per_problem), abs=1e-4)
    assert comp["seeds_needed"] is None and comp["mde_80"] is None
    assert "one seed" in comp["verdict"]
    assert result["arms"]["B"]["missing"] == {"2": "not started", "3": "not started"}


# === schedule: the runner with fake jobs =======================================================================


class ShRunner(schedule.Runner):
    """Jobs are `sh -c` scripts (self.script(job) -> str) instead of train_capped.sh / eval_aime.py."""

    def argv(self, job: schedule.Job, slot: schedule.Slot) -> list[str]:
        return ["sh", "-c", self.script(job)]


def q(path: Path) -> str:
    return shlex.quote(str(path))


def job_script(
    directory: Path, job: schedule.Job, order: Path, *, fail: str = "", marker: Path | None = None
) -> str:
    """Record the job's start (name, CUDA_VISIBLE_DEVICES, OPSD_KV_CACHE_GIB), then write the outputs the runner
    checks. fail="always": exit 3 without outputs; fail="once": exit 1 the first time (marker file);
    fail="no-output": exit 0 without outputs."""
    key = job.key
    record = f'echo "{key.name}|${{CUDA_VISIBLE_DEVICES-unset}}|${{OPSD_KV_CACHE_GIB-unset}}" >> {q(order)}'
    if key.kind == "base":
        out = spec.base_eval_dir(directory, key.seed)
        work = f"mkdir -p {q(out)} && echo '{{}}' > {q(out / 'summary.json')}"
    elif key.kind == "train":
        run = spec.run_dir(directory, key.arm, key.seed)
        ck = run / "checkpoint-100"
        work = (f"mkdir -p {q(ck)} && echo '{{\"step\": 100, \"loss\": 1.0}}' >> {q(run / 'metrics.jsonl')} "
                f"&& touch {q(ck / '.complete')}")  # fmt: skip
    else:
        out = spec.eval_dir(directory, key.arm, key.seed) / "checkpoint-100"
        work = f"mkdir -p {q(out)} && echo '{{}}' > {q(out / 'summary.json')}"
    if fail == "always":
        return f"{record}; exit 3"
    if fail == "no-output":
        return f"{record}; exit 0"
    if fail == "once":
        return f"{record}; if [ ! -e {q(marker)} ]; then touch {q(marker)}; exit 1; fi; {work}"
    return f"{record}; {work}"


def run_fake(directory: Path, sp: spec.Spec, *, failing: dict[str, str] | None = None, slots=None,
             kv_cache_gib: float = 0.0) -> tuple[ShRunner, list[Status], list[str]]:  # fmt: skip
    """Plan and run the experiment with fake jobs; returns the runner, the statuses shown and the job
    starts in order (lines NAME|CUDA_VISIBLE_DEVICES|OPSD_KV_CACHE_GIB)."""
    failing = failing or {}
    order = directory / "order.txt"
    settings = schedule.RunSettings(kv_cache_gib=kv_cache_gib, poll_s=0.05, status_every_s=1e9)
    runner = ShRunner(directory, sp, slots or schedule.make_slots([], 0, 1), settings)
    runner.script = lambda job: job_script(
        directory, job, order, fail=failing.get(job.key.name, ""), marker=directory / f"{job.key}.marker"
    )
    runner.plan()
    tables: list[Status] = []
    runner.run(tables.append)
    starts = order.read_text().splitlines() if order.is_file() else []
    return runner, tables, starts


def shown(status: Status) -> list[str]:
    """The status as a log shows it (stdout not a terminal): the headline, then the table's lines."""
    out = io.StringIO()
    Display(out).show(status)
    return out.getvalue().splitlines()


def new_experiment(directory: Path, seeds=(1, 2)) -> spec.Spec:
    sp = spec.merge(None, make_spec(seeds=seeds), directory)
    spec.save(directory, sp)
    return sp


def jobs_log(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "jobs.jsonl").read_text().splitlines()]


def test_runner_runs_base_then_each_cell_train_before_eval(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("OPSD_KV_CACHE_GIB", raising=False)
    directory = tmp_path / "exp"
    sp = new_experiment(directory)
    runner, tables, starts = run_fake(directory, sp)
    names = [s.split("|")[0] for s in starts]
    assert names == ["base 1", "train A/1", "eval A/1", "train B/1", "eval B/1",
                     "base 2", "train A/2", "eval A/2", "train B/2", "eval B/2"]  # fmt: skip
    assert all(s.endswith("|unset") for s in starts)  # no fixed KV cache unless asked for
    for arm in ("A", "B"):
        for seed in (1, 2):
            state = C.cell_state(directory, arm, seed)
            assert state.trained and state.final_scored
    assert C.base_scored(directory, 1) and C.base_scored(directory, 2)
    last = tables[-1]
    assert "4 cells: 4 done" in last.headline() and "base model: 2 of 2 seeds scored" in last.headline()
    # Each row: the cell, its state and the disk it holds (run and evaluations), as du would count it; the
    # display shows the three on the cell's line.
    assert [(r.cell, r.state) for r in last.rows] == [("A/1", "done"), ("B/1", "done"), ("A/2", "done"),
                                                      ("B/2", "done")]  # fmt: skip
    lines = shown(last)
    assert last.headline() == lines[0]
    for r in last.rows:
        held = sum(p.stat().st_size for where in (spec.run_dir(directory, r.arm, r.seed),
                                                   spec.eval_dir(directory, r.arm, r.seed))
                   for p in where.rglob("*") if p.is_file())  # fmt: skip
        assert held > 0 and r.disk_bytes == held
        line = next(x for x in lines if x.split()[:1] == [r.cell])
        assert line.replace("|", " ").split() == [r.cell, "done", str(held), "bytes"]
    assert C.read_failed(directory) == {}
    records = jobs_log(directory)
    assert [r["job"] for r in records] == names and all(r["ok"] and r["exit"] == 0 for r in records)
    assert any(r.state == "training" for t in tables for r in t.rows)  # the status was shown while jobs ran


def test_runner_retries_a_failing_job_once_then_records_it(tmp_path: Path) -> None:
    directory = tmp_path / "exp"
    sp = new_experiment(directory)
    runner, tables, starts = run_fake(directory, sp, failing={"train B/1": "always"})
    names = [s.split("|")[0] for s in starts]
    assert names.count("train B/1") == 2
    assert "eval B/1" not in names
    for name in (
        "base 1",
        "base 2",
        "train A/1",
        "eval A/1",
        "train A/2",
        "eval A/2",
        "train B/2",
        "eval B/2",
    ):
        assert names.count(name) == 1, name
    log = directory / "logs" / "train-B-s1.log"
    assert C.read_failed(directory) == {
        "train-B-s1": {"job": "train B/1", "exit": 3, "attempts": 2, "log": str(log)}
    }
    assert log.read_text().count("attempt ") == 2
    assert not C.cell_state(directory, "B", 1).trained
    for arm, seed in (("A", 1), ("A", 2), ("B", 2)):
        assert C.cell_state(directory, arm, seed).final_scored
    last = tables[-1]
    assert "3 done" in last.headline() and "1 failed" in last.headline()
    row = next(r for r in last.rows if r.cell == "B/1")
    assert row.state == "failed" and str(log) in row.detail
    line = next(x for x in shown(last) if x.split()[:1] == ["B/1"])
    assert line.replace("|", " ").split()[1] == "failed" and str(log) in line
    tries = [r for r in jobs_log(directory) if r["job"] == "train B/1"]
    assert [(r["attempt"], r["exit"], r["ok"]) for r in tries] == [(1, 3, False), (2, 3, False)]


def test_runner_job_that_succeeds_on_its_retry_is_done(tmp_path: Path) -> None:
    directory = tmp_path / "exp"
    sp = new_experiment(directory, seeds=(1,))
    runner, tables, starts = run_fake(directory, sp, failing={"eval A/1": "once"})
    names = [s.split("|")[0] for s in starts]
    assert names == ["base 1", "train A/1", "eval A/1", "train B/1", "eval B/1", "eval A/1"]
    assert C.cell_state(directory, "A", 1).final_scored
    assert C.read_failed(directory) == {}
    tries = [r for r in jobs_log(directory) if r["job"] == "eval A/1"]
    assert [(r["attempt"], r["exit"], r["ok"]) for r in tries] == [(1, 1, False), (2, 0, True)]
    assert "2 cells: 2 done" in tables[-1].headline()


def test_runner_job_exiting_zero_without_its_outputs_has_failed(tmp_path: Path) -> None:
    directory = tmp_path / "exp"
    sp = new_experiment(directory, seeds=(1,))
    runner, tables, starts = run_fake(directory, sp, failing={"eval B/1": "no-output"})
    assert [s.split("|")[0] for s in starts].count("eval B/1") == 2
    failed = C.read_failed(directory)
    assert list(failed) == ["eval-B-s1"] and failed["eval-B-s1"]["exit"] == 0
    assert C.cell_state(directory, "B", 1).trained and not C.cell_state(directory, "B", 1).final_scored


def test_runner_resumes_from_the_directory(tmp_path: Path) -> None:
    directory = tmp_path / "exp"
    sp = new_experiment(directory)
    # Before anything ran: seed by seed, the base model, then every training run.
    fresh = schedule.Runner(directory, sp, schedule.make_slots([], 0, 1))
    fresh.plan()
    assert [j.key.name for j in fresh.progress.queued] == [
        "base 1",
        "train A/1",
        "train B/1",
        "base 2",
        "train A/2",
        "train B/2",
    ]
    # By hand: base scored for both seeds, A/1 done, B/1 trained but not scored, A/2 at step 40; a stale
    # failure of B/2.
    for seed in (1, 2):
        write(directory / "evals" / "base" / f"seed{seed}" / "summary.json", "{}")
    for arm, seed, step in (("A", 1, 100), ("B", 1, 100), ("A", 2, 40)):
        write_run(directory, arm, seed, step)
    write(spec.eval_dir(directory, "A", 1) / "checkpoint-100" / "summary.json", "{}")
    C.write_failed(directory, {"train-B-s2": {"job": "train B/2", "exit": 3, "attempts": 2, "log": "x"}})
    partial = schedule.Runner(directory, sp, schedule.make_slots([], 0, 1))
    partial.plan()
    assert [j.key.name for j in partial.progress.queued] == ["eval B/1", "train A/2", "train B/2"]
    # The rerun tries the failed cell again; its success clears failed.json.
    runner, tables, starts = run_fake(directory, sp)
    assert [s.split("|")[0] for s in starts] == ["eval B/1", "train A/2", "eval A/2", "train B/2", "eval B/2"]
    assert C.read_failed(directory) == {}
    # A finished directory plans nothing.
    done = schedule.Runner(directory, sp, schedule.make_slots([], 0, 1))
    done.plan()
    assert done.progress.queued == []


def test_runner_plan_sharing_a_gpu_starts_the_first_training_run_first(tmp_path: Path) -> None:
    # Sharing a GPU slot, the first training run warms the compile caches alone, so it precedes the base model.
    directory = tmp_path / "exp"
    sp = new_experiment(directory)
    runner = schedule.Runner(directory, sp, schedule.make_slots(["0"], 1, 3))
    runner.plan()
    assert [j.key.name for j in runner.progress.queued] == [
        "train A/1",
        "base 1",
        "train B/1",
        "base 2",
        "train A/2",
        "train B/2",
    ]


@pytest.mark.parametrize(
    ("key", "text", "name"),
    [
        (C.JobKey("train", 42, "A"), "train-A-s42", "train A/42"),
        (C.JobKey("eval", 7, "lr-s1"), "eval-lr-s1-s7", "eval lr-s1/7"),  # an arm name holding "-s"
        (C.JobKey("eval", 0, "x.y_z"), "eval-x.y_z-s0", "eval x.y_z/0"),
        (C.JobKey("base", 3), "base-3", "base 3"),
    ],
)
def test_job_key_reads_back_its_string_form(key: C.JobKey, text: str, name: str) -> None:
    # The string form is what failed.json's keys and the logs' names have always been.
    assert str(key) == text and C.JobKey.parse(text) == key and key.name == name


@pytest.mark.parametrize(
    "text", ["", "train-A", "base-", "base-A", "train-A-sx", "fit-A-s1", "train--s1", "base-1-s2"]
)
def test_job_key_refuses_other_text(text: str) -> None:
    with pytest.raises(ValueError, match="is not a job key"):
        C.JobKey.parse(text)


def test_job_key_is_base_without_an_arm_or_a_cell_job_with_one() -> None:
    for kind, arm in (("base", "A"), ("train", None), ("score", "A")):
        with pytest.raises(ValueError, match="a job key is base with no arm"):
            C.JobKey(kind, 1, arm)


def test_the_plain_status_display_has_no_terminal_codes(tmp_path: Path) -> None:
    rows = (
        CellRow("A", 1, "training", 3 << 30, "step 40/100 (2.5 s/step)"),
        CellRow("B", 1, "failed", 0, f"train B/1: exit 3, see {tmp_path / 'logs' / ('x' * 150 + '.log')}"),
    )
    status = Status(
        0.0, rows, base_scored=1, base_planned=2, base_running=False, eta_s=None, eta_after_first=True
    )
    lines = shown(status)
    assert not any("\x1b" in line for line in lines)
    assert lines[0].endswith(
        "2 cells: 1 training, 1 failed | base model: 1 of 2 seeds scored | ETA: after the first cell"
    )
    a = next(x for x in lines if x.startswith("A/1"))
    assert a.replace("|", " ").split() == ["A/1", "training", "3", "GiB", "step", "40/100", "(2.5", "s/step)"]
    b = next(x for x in lines if x.startswith("B/1"))  # a long log path stays on its cell's line
    assert rows[1].detail in b
    assert status.counts == {"training": 1, "failed": 1}
    assert status.states == (("A", 1, "training"), ("B", 1, "failed"))


def test_make_slots() -> None:
    slots = schedule.make_slots(["0", "1", "2", "3"], 2, 3)
    assert [(s.devices, s.capacity) for s in slots] == [("0,1", 3), ("2,3", 3)]
    assert [(s.devices, s.capacity) for s in schedule.make_slots(["5", "7"], 1, 1)] == [("5", 1), ("7", 1)]
    assert [(s.devices, s.capacity) for s in schedule.make_slots([], 0, 1)] == [(None, 1)]
    with pytest.raises(ValueError, match="cannot be split"):
        schedule.make_slots(["0", "1", "2"], 2, 1)


def test_runner_env_gives_each_slot_its_devices(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("OPSD_KV_CACHE_GIB", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "9")
    for key, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(key, value)  # left by a launcher around the experiment
    sp = make_spec()
    slots = schedule.make_slots(["0", "1", "2", "3"], 2, 3)
    shared = schedule.Runner(tmp_path, sp, slots, schedule.RunSettings(kv_cache_gib=1.5, cores=24))
    envs = [shared.env(s) for s in slots]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "2,3"]
    assert all(e["OPSD_KV_CACHE_GIB"] == "1.5" for e in envs)
    # 6 jobs of 2 processes share the 24 cores: 2 threads each
    assert all(e["OMP_NUM_THREADS"] == "2" for e in envs)
    assert envs[0]["MASTER_PORT"].isdigit() and envs[0]["MASTER_PORT"] != "29500"
    assert not any({"RANK", "LOCAL_RANK", "WORLD_SIZE"} & e.keys() for e in envs)
    alone = schedule.Runner(tmp_path, sp, schedule.make_slots(["0"], 1, 1))
    env = alone.env(alone.slots[0])
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and "OPSD_KV_CACHE_GIB" not in env
    cpu = schedule.Runner(tmp_path, sp, schedule.make_slots([], 0, 1))
    assert "OPSD_KV_CACHE_GIB" not in cpu.env(cpu.slots[0])


def test_runner_started_jobs_get_their_slots_devices(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("OPSD_KV_CACHE_GIB", raising=False)
    directory = tmp_path / "exp"
    sp = new_experiment(directory)
    slots = schedule.make_slots(["0", "1", "2", "3"], 2, 3)
    runner, tables, starts = run_fake(directory, sp, slots=slots, kv_cache_gib=1.5)
    assert len(starts) == 10
    records = jobs_log(directory)
    assert all(r["ok"] for r in records)
    devices_of = {r["job"]: r["devices"] for r in records}
    for line in starts:
        name, devices, kv = line.split("|")
        assert devices in ("0,1", "2,3") and devices == devices_of[name], line
        assert kv == "1.5", line
    assert all(runner.load(s) == 0 for s in slots) and runner.progress.running == []


def test_runner_argv_is_the_cells_commands(tmp_path: Path) -> None:
    sp = make_spec(gpus_per_run=2)
    runner = schedule.Runner(tmp_path, sp, schedule.make_slots(["0", "1"], 2, 1))
    slot = runner.slots[0]
    train = runner.argv(schedule.Job(C.JobKey("train", 1, "A")), slot)
    assert options(train[2:])["--num-gpus"] == "2" and options(train[2:])["--name"] == "A"
    ev = runner.argv(schedule.Job(C.JobKey("eval", 1, "A")), slot)
    assert ev[ev.index("--num-gpus") + 1] == "2"
    assert ev[ev.index("--checkpoints") + 1] == str(
        tmp_path / "runs" / "A" / "capped_seed1" / "checkpoint-100"
    )
    assert ev[ev.index("--seed") + 1] == "1"
    base = runner.argv(schedule.Job(C.JobKey("base", 1)), slot)
    assert (
        base[-4:] == ["--seed", "1", "--out", str(tmp_path / "evals" / "base" / "seed1")]
        and "--num-gpus" in base
    )
    cpu = schedule.Runner(tmp_path, sp, schedule.make_slots([], 0, 1))
    assert "--num-gpus" not in cpu.argv(schedule.Job(C.JobKey("eval", 1, "A")), cpu.slots[0])


# === engine_env: the fixed KV cache ============================================================================


@pytest.fixture
def llm_init(monkeypatch):
    """vllm.LLM.__init__ replaced by a recorder (restored after the test); yields the recorded kwargs."""
    import vllm

    calls: list[dict] = []

    def recorder(self, *args, **kwargs):
        calls.append(kwargs)

    monkeypatch.setattr(vllm.LLM, "__init__", recorder)
    return vllm, recorder, calls


def test_kv_cache_unset_gives_no_engine_argument(llm_init) -> None:
    from opsd.evaluation.sampling import VLLMEngine

    vllm, recorder, calls = llm_init
    assert kv_cache_gib({}) is None and kv_cache_gib({"OPSD_KV_CACHE_GIB": "  "}) is None
    assert kv_cache_bytes({}) is None and kv_cache_bytes({"OPSD_KV_CACHE_GIB": ""}) is None
    engine = object.__new__(VLLMEngine)
    with pytest.raises(AttributeError):  # the recorder builds no engine; its arguments are what count
        VLLMEngine.__init__(engine, "m")
    assert "kv_cache_memory_bytes" not in calls[-1]
    assert vllm.LLM.__init__ is recorder


def test_kv_cache_is_the_engines_constructor_argument(llm_init) -> None:
    """The variable is read into bytes (`kv_cache_bytes`) and passed to the engine's constructor, which hands it
    to vLLM; nothing of vLLM is replaced."""
    from opsd.evaluation.sampling import VLLMEngine

    vllm, recorder, calls = llm_init
    assert kv_cache_gib({"OPSD_KV_CACHE_GIB": " 1.5 "}) == 1.5
    assert kv_cache_bytes({"OPSD_KV_CACHE_GIB": "1.5"}) == 1610612736  # 1.5 * 2**30
    with pytest.raises(AttributeError):
        VLLMEngine.__init__(object.__new__(VLLMEngine), "m", kv_cache_bytes=1610612736)
    assert calls[-1]["kv_cache_memory_bytes"] == 1610612736
    assert vllm.LLM.__init__ is recorder


@pytest.mark.parametrize("raw", ["abc", "0", "-1", "nan", "inf", "1.5GiB"])
def test_kv_cache_refuses_bad_values(llm_init, raw: str) -> None:
    vllm, recorder, calls = llm_init
    for fn in (kv_cache_gib, kv_cache_bytes):
        with pytest.raises(InvalidValue) as info:
            fn({"OPSD_KV_CACHE_GIB": raw})
        assert "OPSD_KV_CACHE_GIB" in str(info.value) and repr(raw) in str(info.value)
    assert vllm.LLM.__init__ is recorder


def test_kv_cache_variable_is_tooling_not_a_config_field(monkeypatch) -> None:
    assert env_overrides({"OPSD_KV_CACHE_GIB": "1"}) == []
    assert [o.field for o in env_overrides({"OPSD_KV_CACHE_GIB": "1", "OPSD_BETA": "0.5"})] == ["beta"]
    # The experiment refuses method switches in its environment, not the KV cache variable.
    commands.refuse_method_env({"OPSD_KV_CACHE_GIB": "1", "PATH": "/bin"})
    message = refused(commands.refuse_method_env, {"OPSD_KV_CACHE_GIB": "1", "OPSD_BETA": "0.5"})
    assert "OPSD_BETA" in message and "OPSD_KV_CACHE_GIB" not in message


# === report: what the seeds run cannot tell ====================================================================


def test_report_with_one_sample_per_problem_gives_the_t_interval(tmp_path: Path, monkeypatch) -> None:
    # eval_aime.py --n 1: each cell holds one sample per problem; the t interval over seeds stands, the split into
    # between and within a seed is said to need n >= 2.
    for key in list(CORRECT):
        monkeypatch.setitem(CORRECT, key, [row[:1] for row in CORRECT[key]])
        monkeypatch.setitem(BOXED, key, [row[:1] for row in BOXED[key]])
    directory = experiment(tmp_path / "exp")
    result, _ = rendering.write(directory, reps=200)
    comp = result["comparisons"]["B"]["accuracy"]
    diffs = [points(CORRECT["B", s]) - points(CORRECT["A", s]) for s in SEEDS]
    assert diffs == pytest.approx(
        [100 / 3, 0, 100 / 3]
    )  # first samples: 100 - 66.67, 66.67 - 66.67, 66.67 - 33.33
    iv = comp["interval"]
    assert (iv["estimate"], iv["low"], iv["high"]) == pytest.approx(t_interval(diffs), abs=1e-4)
    assert comp["variance"]["within_var"] is None and comp["variance"]["total_var"] == pytest.approx(
        var1(diffs)
    )
    md = (directory / "report.md").read_text()
    assert "needs n >= 2 samples per problem (this evaluation drew 1)" in md


def test_report_says_when_the_between_part_cannot_be_told_from_zero(tmp_path: Path) -> None:
    # Seeds 1 and 2 only: B - A = 25 and 33.33 (sd 5.89), below the within-seed sd of the paired difference.
    directory = experiment(tmp_path / "exp", seeds=(1, 2))
    result = verdict.build(directory, reps=200)
    v = result["comparisons"]["B"]["accuracy"]["variance"]
    within = mean(within_var(CORRECT["A", s], CORRECT["B", s]) for s in (1, 2))
    assert v["total_var"] == pytest.approx(var1([25, 100 / 3]))
    assert var1([25, 100 / 3]) < within
    assert v["between_floored"] and v["between_var"] == 0.0
    md = rendering.markdown(result)
    assert f"below the within-seed (evaluation sampling) sd {math.sqrt(within):.2f} alone" in md
    assert "cannot be told from 0 with 2 seeds" in md and "between seeds 0.00" not in md
    assert "2 seeds cannot pin this down" in md


# === disk: a scored cell keeps what the report reads ===========================================================

STATE_FILES = (
    "optimizer.pt",
    "scheduler.pt",
    "rng_state.pth",
    "global_step50/zero_pp_rank_0_optim_states.pt",
)
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", ".complete")


def trained_cell(directory: Path, arm: str, seed: int, steps=range(10, 101, 10)) -> None:
    """A cell's run directory as train_capped.sh leaves it: a checkpoint every 10 steps with its adapter and the
    optimizer state a resume reads (1000 bytes each)."""
    for step in steps:
        for name in (*STATE_FILES, *ADAPTER_FILES):
            write(spec.run_dir(directory, arm, seed) / f"checkpoint-{step}" / name, "x" * 1000)


def files(directory: Path) -> set[str]:
    return {str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()}


@pytest.mark.parametrize("keep_adapters", [False, True])
def test_prune_cell_keeps_the_final_checkpoint_and_the_adapters_asked_for(
    tmp_path: Path, keep_adapters
) -> None:
    trained_cell(tmp_path, "A", 1)
    run = spec.run_dir(tmp_path, "A", 1)
    # Not scored yet: nothing goes (the cell may still resume).
    assert C.prune_cell(tmp_path, "A", 1, keep_adapters=keep_adapters) == 0
    before = files(run)
    write(spec.eval_dir(tmp_path, "A", 1) / "checkpoint-100" / "summary.json", "{}")
    write(spec.eval_dir(tmp_path, "A", 1) / "checkpoint-30" / "summary.json", "{}")  # scored by hand
    freed = C.prune_cell(tmp_path, "A", 1, keep_adapters=keep_adapters)
    final = {f"checkpoint-100/{n}" for n in (*STATE_FILES, *ADAPTER_FILES)}
    kept_adapters = {
        f"checkpoint-{k}/{n}" for k in (range(10, 100, 10) if keep_adapters else [30]) for n in ADAPTER_FILES
    }
    assert files(run) == final | kept_adapters
    assert freed == 1000 * (len(before) - len(files(run)))
    assert C.prune_cell(tmp_path, "A", 1, keep_adapters=keep_adapters) == 0  # nothing left to drop


def test_the_runner_prunes_scored_cells_only(tmp_path: Path) -> None:
    directory = tmp_path / "exp"
    sp = new_experiment(directory, seeds=(1,))
    for arm in ("A", "B"):
        trained_cell(directory, arm, 1, steps=range(10, 100, 10))  # the fake training writes checkpoint-100
    runner, tables, starts = run_fake(directory, sp, failing={"eval B/1": "always"})
    # A/1 scored: its intermediate checkpoints are gone. B/1's evaluation failed: its run is as training left it.
    assert [c.name for c in C.checkpoints(spec.run_dir(directory, "A", 1))] == ["checkpoint-100"]
    b = C.checkpoints(spec.run_dir(directory, "B", 1))
    assert len(b) == 10 and all((c / "optimizer.pt").is_file() for c in b[:-1])


def test_the_figure_labels_each_interval_with_its_method(tmp_path: Path, monkeypatch) -> None:
    import matplotlib.axes

    labels: list[str] = []
    real = matplotlib.axes.Axes.set_yticks

    def record(self, ticks, tick_labels=None, **kw):
        labels.extend(tick_labels or [])
        return real(self, ticks, tick_labels, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_yticks", record)
    one = experiment(tmp_path / "one", unscored={("B", 2): None, ("B", 3): None})
    rendering.figures(verdict.build(one, reps=200))
    assert labels == [
        "B: accuracy (paired t over problems, 1 seed)",
        "B: format rate (paired t over problems, 1 seed)",
    ]
    labels.clear()
    three = experiment(tmp_path / "three")
    rendering.figures(verdict.build(three, reps=200))
    assert labels == ["B: accuracy (seed-paired t, 3 seeds)", "B: format rate (seed-paired t, 3 seeds)"]


# === report: the compute ledger ================================================================================


def write_ledger(directory: Path, arm: str, seed: int, row: dict, steps=range(1, 101)) -> Path:
    """A cell's ledger.jsonl as a run writes it: one row per optimizer step, each `row` with its step."""
    path = spec.run_dir(directory, arm, seed) / "ledger.jsonl"
    return write(path, "".join(json.dumps({"step": k, **row}) + "\n" for k in steps))


OPSD_ROW = {"generated_tokens": 96, "teacher_tokens": 150, "trained_tokens": 90, "step_s": 0.25, "rollout_s": 0.125,
            "gpu_s": 0.5}  # fmt: skip


def test_cell_ledger_sums_a_finished_cells_rows(tmp_path: Path) -> None:
    write_ledger(tmp_path, "A", 1, OPSD_ROW)
    totals, why = C.cell_ledger(tmp_path, "A", 1)
    # 100 rows: 100 x each value; the phases (rollout_s) are not totalled.
    assert why == ""
    assert totals == {"generated_tokens": 9600.0, "teacher_tokens": 15000.0, "trained_tokens": 9000.0,
                      "step_s": 25.0, "gpu_s": 50.0, "steps": 100.0}  # fmt: skip
    # GPU-seconds only when every step has them (a CPU run books none).
    rows = [{"step": k, **OPSD_ROW} for k in range(1, 101)]
    del rows[49]["gpu_s"]
    write(spec.run_dir(tmp_path, "A", 2) / "ledger.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    totals, _ = C.cell_ledger(tmp_path, "A", 2)
    assert "gpu_s" not in totals and totals["step_s"] == 25.0
    # A run from before the ledger has none.
    assert C.cell_ledger(tmp_path, "A", 3) == (None, C.NO_LEDGER)
    # A run started again from step 0 in the directory appends its rows: the last row of each step wins.
    earlier = [{"step": k, **OPSD_ROW, "generated_tokens": 1000} for k in range(1, 61)]
    write(
        spec.run_dir(tmp_path, "A", 4) / "ledger.jsonl",
        "".join(json.dumps(r) + "\n" for r in [*earlier, *rows]),
    )
    totals, _ = C.cell_ledger(tmp_path, "A", 4)
    assert totals["generated_tokens"] == 9600.0 and totals["steps"] == 100.0


def _ledger_lines(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


FULL = [{"step": k, **OPSD_ROW} for k in range(1, 101)]


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (_ledger_lines(*FULL[:4], "{not json", *FULL[5:]), "line 5 is not JSON"),
        (_ledger_lines(*FULL[:99], {**FULL[99], "generated_tokens": -1}), "line 100 is not a ledger row"),
        (_ledger_lines({**FULL[0], "teacher_tokens": "150"}, *FULL[1:]), "line 1 is not a ledger row"),
        (_ledger_lines({**FULL[0], "step_s": float("inf")}, *FULL[1:]), "line 1 is not a ledger row"),
        (_ledger_lines({**FULL[0], "gpu_s": 1e13}, *FULL[1:]), "line 1 is not a ledger row"),
        (_ledger_lines({**FULL[0], "step": True}, *FULL[1:]), "line 1 is not a ledger row"),
        (_ledger_lines([1, 2], *FULL[1:]), "line 1 is not a ledger row"),
        (_ledger_lines(*FULL[:99]), "has no row for step(s) 100, not one for each step from 1 to 100"),
        (_ledger_lines(*FULL[:49], FULL[48], *FULL[50:]), "has no row for step(s) 50, not one"),
        (_ledger_lines(*FULL[7:]), "has no row for step(s) 1, 2, 3, 4, 5 and 2 more, not one"),
        (_ledger_lines(*FULL, {**FULL[0], "step": 101}), "has rows for step(s) 101, not one"),
        ("\ufffe".encode("utf-16").decode("latin-1"), "not UTF-8"),
    ],
)
def test_a_damaged_ledger_gives_no_totals_and_the_report_says_why(
    tmp_path: Path, text: str, named: str
) -> None:
    directory = experiment(tmp_path / "exp")
    for seed in SEEDS:
        write_ledger(directory, "A", seed, OPSD_ROW)
    path = spec.run_dir(directory, "A", 2) / "ledger.jsonl"
    path.write_bytes(text.encode("latin-1") if named == "not UTF-8" else text.encode())
    totals, why = C.cell_ledger(directory, "A", 2)
    assert totals is None and named in why and str(path) in why
    result, _ = rendering.write(directory, reps=200)  # the report is written all the same
    led = result["arms"]["A"]["ledger"]
    assert led["seeds"] == [1, 3] and led["unavailable"] == {"2": why}
    assert led["per_million_generated"] is None
    assert led["per_million_why"] == "no ledger for seed(s) 2 of the comparison"
    md = (directory / "report.md").read_text()
    assert f"- **A**, seed 2: no ledger totals: {why}" in md
    assert "| A | `opsd` | 2 of 3 | 0.0096 ± 0 | 0.0192 |" in md


def test_a_ledger_that_is_a_directory_gives_no_totals(tmp_path: Path) -> None:
    (spec.run_dir(tmp_path, "A", 1) / "ledger.jsonl").mkdir(parents=True)
    totals, why = C.cell_ledger(tmp_path, "A", 1)
    assert totals is None and "is a directory" in why


def test_report_compute_ledger_per_arm(tmp_path: Path) -> None:
    recipes = {"A": {"clip_mode": "rescale"}, "B": {"method": "grpo", "num_generations": "2"}}
    directory = experiment(tmp_path / "exp", recipes=recipes)
    without = verdict.build(directory, reps=500)
    # A (opsd, 2 GPUs): 100 s x generated tokens per step, seeds 1, 2, 3: 10,000, 20,000, 30,000 in all.
    for seed in SEEDS:
        write_ledger(directory, "A", seed, {"generated_tokens": 100 * seed, "teacher_tokens": 150,
                                            "trained_tokens": 90, "step_s": 0.36, "gpu_s": 0.72})  # fmt: skip
    # B (grpo, a CPU run: no gpu_s): no teacher; seed 3 trained before the ledger.
    for seed in (1, 2):
        write_ledger(
            directory,
            "B",
            seed,
            {"generated_tokens": 400, "teacher_tokens": 0, "trained_tokens": 360, "step_s": 0.18},
        )
    result, _ = rendering.write(directory, reps=500)

    # The verdict is the same with the ledger as without it.
    for arm in ("A", "B"):
        assert without["arms"][arm]["ledger"]["seeds"] == []
        assert without["arms"][arm]["ledger"]["unavailable"] == {str(s): C.NO_LEDGER for s in SEEDS}
        assert {k: v for k, v in result["arms"][arm].items() if k != "ledger"} == {
            k: v for k, v in without["arms"][arm].items() if k != "ledger"
        }
    assert result["comparisons"] == without["comparisons"]

    a = result["arms"]["A"]["ledger"]
    assert a["method"] == "opsd" and a["seeds"] == [1, 2, 3] and a["unavailable"] == {}
    assert a["per_seed"]["2"]["generated_tokens"] == 20000
    assert a["total"] == pytest.approx({"generated_tokens": 60000, "teacher_tokens": 45000, "trained_tokens": 27000,
                                        "step_s": 108, "gpu_s": 216})  # fmt: skip
    assert a["mean"]["generated_tokens"] == 20000 and a["sd"]["generated_tokens"] == pytest.approx(10000)
    # Per million generated tokens: the vs-base interval over 0.02 M tokens per seed (the mean over seeds 1-3).
    # Accuracy vs base per seed: 25 - 8.33, 33.33 - 25, 25 - 0.
    base_diffs = [50 / 3, 25 / 3, 25]
    for name, diffs in (("accuracy", base_diffs),
                        ("format rate", [points(BOXED["A", s]) - points(BOXED["base", s]) for s in SEEDS])):  # fmt: skip
        pm = a["per_million_generated"][name]
        est, low, high = t_interval(diffs)
        assert (pm["estimate"], pm["low"], pm["high"]) == pytest.approx((est / 0.02, low / 0.02, high / 0.02))
        assert pm["method"] == "seed-paired t" and pm["n_seeds"] == 3 and pm["seeds"] == [1, 2, 3]
        assert pm["generated_m"] == pytest.approx(0.02) and pm["generated_m_sd"] == pytest.approx(0.01)
    assert a["per_million_generated"]["accuracy"]["estimate"] == pytest.approx(50 / 3 / 0.02)  # 833.3

    b = result["arms"]["B"]["ledger"]
    assert b["method"] == "grpo" and b["seeds"] == [1, 2] and b["unavailable"] == {"3": C.NO_LEDGER}
    assert b["total"] == pytest.approx({"generated_tokens": 80000, "teacher_tokens": 0, "trained_tokens": 72000,
                                        "step_s": 36})  # fmt: skip
    assert b["sd"]["generated_tokens"] == 0
    assert b["per_million_generated"] is None
    assert b["per_million_why"] == "no ledger for seed(s) 3 of the comparison"

    md = (directory / "report.md").read_text()
    assert "## Compute ledger" in md
    # A: accuracy +833.3 [-201.7, +1,868.4] per M (t_interval([16.67, 8.33, 25]) = 16.67 [-4.03, +37.37], / 0.02).
    est, low, high = (x / 0.02 for x in t_interval(base_diffs))
    assert (round(est), round(low), round(high)) == (833, -202, 1868)
    assert (
        "| A | `opsd` | 3 of 3 | 0.02 ± 0.01 | 0.06 | 0.045 | 0.027 | 0.03 | 0.06 | +833 [-202, +1,868] |"
        in md
    )
    assert "| B | `grpo` | 2 of 3 | 0.04 ± 0 | 0.08 | 0 | 0.072 | 0.01 | n/a (no GPU) | n/a | n/a |" in md
    assert "- **B**, seed 3: no ledger totals: no ledger.jsonl (a run from before the compute ledger)" in md
    assert "- **B**: no gain per million generated tokens: no ledger for seed(s) 3 of the comparison" in md
    assert "the token count is treated as fixed" in md
    assert json.loads((directory / "summary.json").read_text())["arms"]["A"]["ledger"] == json.loads(
        json.dumps(a)
    )


def test_report_compute_ledger_with_one_seed_or_no_base(tmp_path: Path) -> None:
    # One seed: the vs-base interval is the paired t over problems, divided alike.
    one = experiment(tmp_path / "one", seeds=(1,))
    write_ledger(
        one, "A", 1, {"generated_tokens": 50, "teacher_tokens": 10, "trained_tokens": 40, "step_s": 1.0}
    )
    result = verdict.build(one, reps=200)
    led = result["arms"]["A"]["ledger"]
    # Per problem of seed 1, A - base: 100 x (1/4 - 0, 1/2 - 1/4, 0 - 0) = 25, 25, 0; over 5,000 tokens.
    per_problem = [
        100 * (mean(a) - mean(b)) for a, b in zip(CORRECT["A", 1], CORRECT["base", 1], strict=True)
    ]
    assert per_problem == pytest.approx([25, 25, 0])
    pm = led["per_million_generated"]["accuracy"]
    assert pm["method"] == "paired t over problems" and pm["n_seeds"] == 1 and pm["generated_m_sd"] is None
    est, low, high = t_interval(per_problem)
    assert (pm["estimate"], pm["low"], pm["high"]) == pytest.approx((est / 0.005, low / 0.005, high / 0.005))
    assert led["sd"]["generated_tokens"] is None
    md = rendering.markdown(result)
    assert "| A | `opsd` | 1 of 1 | 0.005 | 0.005 | 0.001 | 0.004 | 0.0278 | n/a (no GPU) | +3,333 [" in md
    # B has no ledger: n/a throughout, and no note on the gain (there is no ledger to note it against).
    assert "| B | `opsd` | 0 of 1 | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |" in md
    assert "- **B**: no gain" not in md
    # No base model scored: the totals stand, the gain per million is n/a.
    nobase = experiment(tmp_path / "nobase", seeds=(1,), base=False)
    write_ledger(
        nobase, "A", 1, {"generated_tokens": 50, "teacher_tokens": 10, "trained_tokens": 40, "step_s": 1.0}
    )
    led = verdict.build(nobase, reps=200)["arms"]["A"]["ledger"]
    assert led["total"]["generated_tokens"] == 5000 and led["per_million_generated"] is None
    assert led["per_million_why"] == "no evaluation against the base model yet"


def test_bench_rl_preset_arms_differ_by_the_method_alone() -> None:
    """bench/experiment_run.py --preset rl: the study's baseline recipe under each method, on the full profile
    (the other presets'), the hybrid once per route (group, sample); the arms differ only by the method's own
    keys, the RL arms counting the step's 32 in rollouts (budget_unit); every preset's flags parse as
    `python -m opsd.experiment`'s."""
    import experiment_run

    a = commands.parse(experiment_run.rl_flags())
    assert (a.profile, a.model, a.dataset, a.seeds, a.recipe) == (
        "full",
        "embedded",
        "builtin:easy",
        "42,43,44",
        "",
    )
    arms = {arm.name: arm.recipe for arm in (parse_arm(text, None) for text in a.arm)}
    assert list(arms) == ["opsd", "grpo", "hybrid_group", "hybrid_sample"]
    assert arms["grpo"] == {
        **{k: v for k, v in arms["opsd"].items() if k != "clip_mode"}, "method": "grpo", "num_generations": "4",
        "budget_unit": "rollouts",
    }  # fmt: skip
    hybrid = {
        **arms["opsd"],
        "method": "hybrid",
        "num_generations": "4",
        "sd_weight": "1.0",
        "budget_unit": "rollouts",
    }
    assert arms["hybrid_group"] == {**hybrid, "hybrid_route": "group"}
    assert arms["hybrid_sample"] == {**hybrid, "hybrid_route": "sample"}
    assert arms["opsd"]["clip_mode"] == "rescale" and arms["opsd"]["vllm_gpu_memory_utilization"] == "0.12"
    for flags in experiment_run.PRESETS.values():
        commands.parse(flags)


def test_report_gpu_hours_only_when_every_run_had_a_gpu(tmp_path: Path) -> None:
    directory = experiment(tmp_path / "exp", seeds=(1, 2))
    row = {"generated_tokens": 50, "teacher_tokens": 10, "trained_tokens": 40, "step_s": 1.8}
    write_ledger(directory, "A", 1, {**row, "gpu_s": 3.6})  # 360 GPU-seconds: 0.1 GPU-hours
    write_ledger(directory, "A", 2, {**row, "gpu_s": 7.2})
    write_ledger(directory, "B", 1, {**row, "gpu_s": 3.6})
    write_ledger(directory, "B", 2, row)  # this run had no GPU
    result = verdict.build(directory, reps=200)
    assert result["arms"]["A"]["ledger"]["total"]["gpu_s"] == pytest.approx(1080)
    assert "gpu_s" not in result["arms"]["B"]["ledger"]["total"]
    md = rendering.markdown(result)
    assert "| A | `opsd` | 2 of 2 | 0.005 ± 0 | 0.01 | 0.002 | 0.008 | 0.1 | 0.3 |" in md
    assert (
        "| B | `opsd` | 2 of 2 | 0.005 ± 0 | 0.01 | 0.002 | 0.008 | 0.1 | n/a (not every run had a GPU) |"
        in md
    )
