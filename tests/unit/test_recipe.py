"""Tests for opsd.configuration.sources: recipe.env parsing, OPSD_* environment overrides and their
argv round trip; and each value through every source into the config (opsd.launch.command_line)."""

from __future__ import annotations

import dataclasses
import enum
import logging
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from opsd.configuration.config import OPSDConfig
from opsd.configuration.sources import (
    MAX_COMPLETION_CAP,
    MAX_FILE_BYTES,
    Override,
    RecipeError,
    canonical_flags,
    canonical_keys,
    env_overrides,
    field_specs,
    flag_overrides,
    parse_recipe,
    resolve_overrides,
    to_argv,
)
from opsd.configuration.switches import BUDGET_KEYS, CAPPED_KEYS, RECIPE_KEYS, env_name, field_of_env
from opsd.errors import InvalidValue

BUDGET_MESSAGE = "fixed by the capped harness"


def write(tmp_path: Path, text: str | bytes, name: str = "recipe.env") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def refusal(path: Path) -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(path)
    return str(info.value)


def parse_argv(tmp_path: Path, argv: list[str]) -> OPSDConfig:
    (config,) = HfArgumentParser(OPSDConfig).parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path)] + argv
    )
    return config


def typed(field: str, value: str) -> object:
    """What the config attribute must equal after argparse reads `value`."""
    kind = field_specs()[field].kind
    return {"bool": lambda v: v == "true", "int": int, "float": float}.get(kind, str)(value)


# ------------------------------------------------------------------------------------------------------------
# Tables
# ------------------------------------------------------------------------------------------------------------
def test_every_field_has_one_variable_and_one_key():
    """A field's OPSD_* variable (OPSD_ + its name in upper case unless its declaration says otherwise) and its
    recipe.env key name that field back, and no other."""
    variables = {env_name(f.name) for f in dataclasses.fields(OPSDConfig)}
    assert len(variables) == len(dataclasses.fields(OPSDConfig)) and env_name("beta") == "OPSD_BETA"
    for f in dataclasses.fields(OPSDConfig):
        assert field_of_env(env_name(f.name)) == f.name
        assert field_of_env(env_name(f.name).removeprefix("OPSD_")) == f.name  # the recipe.env key


def test_key_tables_name_real_settable_fields():
    fields = {f.name for f in dataclasses.fields(OPSDConfig)}
    assert RECIPE_KEYS <= fields
    assert BUDGET_KEYS <= fields
    assert not RECIPE_KEYS & BUDGET_KEYS
    assert all(field_specs()[k].kind != "unsupported" for k in RECIPE_KEYS)


# ------------------------------------------------------------------------------------------------------------
# Good recipes
# ------------------------------------------------------------------------------------------------------------
def test_good_lines_parse(tmp_path):
    path = write(
        tmp_path,
        "# OPSD recipe\n"
        "\n"
        "LEARNING_RATE=1e-5\n"
        "   OPSD_BETA = 0.5   # trailing comment\n"
        "CLIP_MODE='token'\n"
        'LOSS_TYPE="jsd"  # quoted, then a comment\n'
        "FIX_POSITION_IDS=No\n"
        "TEACHER_THINKING=TRUE\n"
        "TOP_K=+20\n"
        "STUDENT_PROMPT_FILE=prompts/a#b.txt\n"
        'TEACHER_PROMPT_FILE="prompts/my #1 prompt.txt"\n'
        "\t# indented comment\n",
    )
    got = parse_recipe(path)
    assert [(o.field, o.value) for o in got] == [
        ("learning_rate", "1e-05"),
        ("beta", "0.5"),
        ("clip_mode", "token"),
        ("loss_type", "jsd"),
        ("fix_position_ids", "false"),
        ("teacher_thinking", "true"),
        ("top_k", "20"),
        ("student_prompt_file", "prompts/a#b.txt"),
        ("teacher_prompt_file", "prompts/my #1 prompt.txt"),
    ]
    assert got[0].source == f"{path}:3"
    assert got[1].source == f"{path}:4"


def test_crlf_and_bom(tmp_path):
    path = write(tmp_path, "\ufeffBETA=1\r\n# comment\r\nWARMUP_STEPS=0.1\r\n")
    assert [(o.field, o.value) for o in parse_recipe(path)] == [("beta", "1.0"), ("warmup_steps", "0.1")]


def test_empty_file(tmp_path):
    assert parse_recipe(write(tmp_path, "")) == []


def test_sample_recipe_with_every_key_round_trips(tmp_path):
    """A recipe setting every tunable key to its default parses and gives the default config back."""
    defaults = OPSDConfig(output_dir=str(tmp_path))
    lines = ["# every tunable key at its default"]
    for key in sorted(RECIPE_KEYS):
        value = getattr(defaults, key)
        value = value.value if isinstance(value, enum.Enum) else value  # lr_scheduler_type becomes an enum
        text = str(value).lower() if isinstance(value, bool) else str(value)
        lines.append(f'{key.upper()}="{text}"')
    got = parse_recipe(write(tmp_path, "\n".join(lines) + "\n"))
    assert {o.field for o in got} == RECIPE_KEYS
    config = parse_argv(tmp_path, to_argv(got))
    for key in RECIPE_KEYS:
        assert getattr(config, key) == getattr(defaults, key), key


# ------------------------------------------------------------------------------------------------------------
# Refusals: each names the file, the line and the fix
# ------------------------------------------------------------------------------------------------------------
REFUSALS = {
    "no equals sign": ("LEARNING_RATE 1e-5", "no '='"),
    "empty key": ("=0.5", "key before '=' is empty"),
    "space in key": ("LEARNING RATE=1e-5", "not a valid key"),
    "lower-case key": ("learning_rate=1e-5", "did you mean LEARNING_RATE"),
    "export": ("export BETA=0.5", "drop 'export'"),
    "unknown key": ("LEARNIN_RATE=1e-5", "did you mean LEARNING_RATE"),
    "removed warmup_ratio": ("WARMUP_RATIO=0.1", "below 1 is a ratio"),
    "not tunable": ("BF16=false", "not tunable in recipe.env"),
    "int as float": ("TOP_K=1.5", "expects an integer"),
    "float word": ("BETA=half", "expects a finite number"),
    "nan": ("BETA=nan", "expects a finite number"),
    "inf": ("LEARNING_RATE=inf", "expects a finite number"),
    "overflow": ("LEARNING_RATE=1e999", "expects a finite number"),
    "empty number": ("BETA=", "expects a finite number"),
    "bad bool": ("TEACHER_THINKING=maybe", "expects true or false"),
    "bad choice": ("CLIP_MODE=elementt", "did you mean element"),
    "bad scheduler": ("LR_SCHEDULER_TYPE=cosinus", "did you mean cosine"),
    "completion over cap": (
        f"MAX_COMPLETION_LENGTH={MAX_COMPLETION_CAP + 1}",
        f"outside 1..{MAX_COMPLETION_CAP}",
    ),
    "completion zero": ("MAX_COMPLETION_LENGTH=0", f"outside 1..{MAX_COMPLETION_CAP}"),
    "unclosed quote": ('BETA="0.5', "never closed"),
    "text after quote": ('BETA="0.5" x', "follows the closing quote"),
    "quote inside value": ("STUDENT_PROMPT_FILE=it's.txt", "quote the whole value"),
    "variable in path": ("STUDENT_PROMPT_FILE=$HOME/p.txt", "nothing is expanded"),
    "escape char": ("BETA=0\x1b[2J", "control character U+001B"),
    "tab in value": ("STUDENT_PROMPT_FILE=a\tb.txt", "control character U+0009"),
    "bidi override": ("STUDENT_PROMPT_FILE=a\u202eb.txt", "control character U+202E"),
    "long line": ("BETA=" + "0" * 5000, "bytes long (limit 4096)"),
}


@pytest.mark.parametrize("line, expected", REFUSALS.values(), ids=REFUSALS.keys())
def test_refusals_name_file_line_and_fix(tmp_path, line, expected):
    path = write(tmp_path, f"# header\nLORA_R=32\n{line}\n")
    message = refusal(path)
    assert f"{path}:3:" in message
    assert expected in message
    assert "fix:" in message
    assert "1 problem(s)" in message


def test_duplicate_names_both_lines(tmp_path):
    message = refusal(write(tmp_path, "BETA=0.5\nLORA_R=8\nOPSD_BETA=0.5\n"))
    assert "BETA is set twice, on lines 1 and 3" in message


@pytest.mark.parametrize(
    "text",
    [
        "JSD_TOKEN_CLIP=0.1\nDIVERGENCE_CLIP=0.2\n",
        "DIVERGENCE_CLIP=0.2\nBETA=0.5\nOPSD_JSD_TOKEN_CLIP=0.1\n",
        "OPSD_DIVERGENCE_CLIP=0.2\nJSD_TOKEN_CLIP=0.2\n",  # even with equal values
    ],
)
def test_older_and_canonical_name_in_one_recipe_are_refused(tmp_path, text):
    message = refusal(write(tmp_path, text))
    assert "1 problem(s)" in message and "\n" not in message
    assert "under its older and its canonical name" in message and "keep only DIVERGENCE_CLIP" in message


@pytest.mark.parametrize(
    "environ",
    [
        {"OPSD_JSD_TOKEN_CLIP": "0.1", "OPSD_DIVERGENCE_CLIP": "0.2"},
        {"OPSD_DIVERGENCE_CLIP": "0.2", "OPSD_JSD_TOKEN_CLIP": "0.2", "OPSD_BETA": "0.5"},
    ],
)
def test_older_and_canonical_name_in_the_environment_are_refused(environ):
    for allowed in (None, CAPPED_KEYS):
        with pytest.raises(RecipeError) as info:
            env_overrides(environ, allowed=allowed)
        message = str(info.value)
        assert "OPSD_DIVERGENCE_CLIP and OPSD_JSD_TOKEN_CLIP both set divergence_clip" in message
        assert "keep only OPSD_DIVERGENCE_CLIP" in message and "\n" not in message
    # Alone, either name is read as divergence_clip.
    assert [(o.field, o.value) for o in env_overrides({"OPSD_JSD_TOKEN_CLIP": "0.1"})] == [
        ("divergence_clip", "0.1")
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--jsd_token_clip", "0.1", "--divergence_clip", "0.2"],
        ["--divergence-clip=0.2", "--output_dir", "x", "--jsd-token-clip=0.1"],
    ],
)
def test_older_and_canonical_flag_are_refused(argv):
    with pytest.raises(
        InvalidValue,
        match=r"--jsd_token_clip and --divergence_clip are both given; keep only --divergence_clip",
    ):
        canonical_flags(argv)
    assert canonical_flags(["--jsd-token-clip=0.1", "--beta", "1"]) == [
        "--divergence_clip=0.1",
        "--beta",
        "1",
    ]


def test_older_and_canonical_yaml_key_are_refused():
    with pytest.raises(
        InvalidValue, match="jsd_token_clip and divergence_clip are both set; keep only divergence_clip"
    ):
        canonical_keys({"jsd_token_clip": 0.1, "divergence_clip": 0.2}, source="c.yaml")


def test_invalid_utf8(tmp_path):
    assert "not valid UTF-8" in refusal(write(tmp_path, b"BETA=0.5\nSTUDENT_PROMPT_FILE=\xff.txt\n"))


def test_missing_file(tmp_path):
    message = refusal(tmp_path / "nope.env")
    assert f"recipe file {str(tmp_path / 'nope.env')!r} does not exist" in message


def test_oversized_file(tmp_path):
    path = tmp_path / "recipe.env"
    with path.open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse: no megabyte is written
    message = refusal(path)
    assert "is 1 MiB (1,048,577 bytes); recipe files are limited to 1 MiB" in message and str(path) in message


def test_link_to_a_device_is_refused_without_reading(tmp_path):
    # A recipe.env linked to /dev/urandom used to be read until the process was killed.
    link = tmp_path / "recipe.env"
    link.symlink_to("/dev/urandom")
    message = refusal(link)
    assert f"{str(link)!r} (a link to '/dev/urandom') is a character device, not a regular file" in message


@pytest.mark.parametrize(
    "key",
    [
        "MAX_STEPS",
        "PER_DEVICE_TRAIN_BATCH_SIZE",
        "GRADIENT_ACCUMULATION_STEPS",
        "SEED",
        "GENERATION_BATCH_SIZE",
    ],
)
@pytest.mark.parametrize("prefix", ["", "OPSD_"])
def test_budget_keys_refused(tmp_path, key, prefix):
    path = write(tmp_path, f"BETA=0.5\n{prefix}{key}=1\n")
    message = refusal(path)
    assert f"{path}:2:" in message
    assert BUDGET_MESSAGE in message


def test_all_errors_reported_at_once(tmp_path):
    path = write(tmp_path, "BETA=x\nLORA_R=8\nMAX_STEPS=5\nnonsense\nCLIP_MODE=nope\nTOP_P=0.9\nLORA_R=9\n")
    message = refusal(path)
    assert "5 problem(s)" in message
    for lineno in (1, 3, 4, 5, 7):
        assert f"{path}:{lineno}:" in message
    for lineno in (2, 6):
        assert f"{path}:{lineno}:" not in message


def test_error_list_is_capped(tmp_path):
    message = refusal(write(tmp_path, "BETA=x\n" * 120))
    assert "120 problem(s)" in message
    assert "and 70 more" in message


# ------------------------------------------------------------------------------------------------------------
# Hostile lines: refused, and nothing in them ever runs
# ------------------------------------------------------------------------------------------------------------
HOSTILE = {
    "command substitution": "LEARNING_RATE=$(touch {m})",
    "backticks": "LEARNING_RATE=`touch {m}`",
    "semicolon": "BETA=0; touch {m}",
    "and-and": "OPSD_BETA=0 && rm -rf {victim} && touch {m}",
    "pipe": "BETA=0 | touch {m}",
    "mismatched quotes": "BETA=\"0' ; touch {m}",
    "quoted command": "BETA='0; touch {m}'",
    "substitution in path": "STUDENT_PROMPT_FILE=$(touch {m})",
    "backticks in path": "TEACHER_PROMPT_FILE=`touch {m}`",
    "cyrillic key": "\u0412ETA=0",
    "fullwidth digits": "LEARNING_RATE=\uff11e-5",
    "fullwidth int": "TOP_K=\uff12\uff10",
    "huge line": "BETA=0 $(touch {m}) " + "x" * 100_000,
    "no equals": "touch {m}",
    "nul byte": "BETA=0\x00; touch {m}",
    "newline injection via CR": "BETA=0\r; touch {m}",
}


@pytest.mark.parametrize("template", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_lines_refused_and_never_run(tmp_path, template):
    marker, victim = tmp_path / "PWNED_marker", tmp_path / "victim"
    victim.mkdir()
    path = write(tmp_path, "LORA_R=32\n" + template.format(m=marker, victim=victim) + "\n")
    message = refusal(path)
    assert f"{path}:2:" in message
    assert len(message) < 2000  # the huge line is shown cut, not echoed whole
    with pytest.raises(RecipeError):
        resolve_overrides(path, {}, capped=True)
    assert not marker.exists()
    assert victim.is_dir()


@pytest.mark.parametrize("value", ["0; touch {m}", "$(touch {m})", "`touch {m}`", "0\n", "\uff10"])
def test_hostile_env_values_refused(tmp_path, value):
    marker = tmp_path / "PWNED_env"
    with pytest.raises(RecipeError, match="OPSD_BETA"):
        env_overrides({"OPSD_BETA": value.format(m=marker)}, allowed=RECIPE_KEYS)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------------------
# Environment
# ------------------------------------------------------------------------------------------------------------
def test_env_overrides_parse_and_skip_others():
    env = {"OPSD_BETA": "1", "OPSD_CACHE_DIR": "/cache", "PATH": "/bin", "OPSD_TEACHER_THINKING": "no"}
    got = env_overrides(env)
    assert got == [
        Override("beta", "1.0", "env OPSD_BETA"),
        Override("teacher_thinking", "false", "env OPSD_TEACHER_THINKING"),
    ]


def test_env_unknown_name_suggests_field():
    with pytest.raises(RecipeError) as info:
        env_overrides({"OPSD_LEARNIN_RATE": "1e-5"})
    assert "OPSD_LEARNIN_RATE" in str(info.value)
    assert "did you mean OPSD_LEARNING_RATE" in str(info.value)
    with pytest.raises(ValueError, match="OPSD_FOO.*nearest is OPSD_"):
        env_overrides({"OPSD_FOO": "1"})


def test_env_lower_case_name_refused():
    with pytest.raises(RecipeError, match="did you mean OPSD_BETA"):
        env_overrides({"OPSD_beta": "0.5"})


def test_env_capped_restriction():
    assert env_overrides({"OPSD_MAX_STEPS": "5", "OPSD_BF16": "false"}) == [
        Override("bf16", "false", "env OPSD_BF16"),
        Override("max_steps", "5", "env OPSD_MAX_STEPS"),
    ]
    with pytest.raises(RecipeError) as info:
        env_overrides({"OPSD_MAX_STEPS": "5", "OPSD_BF16": "false", "OPSD_BETA": "0.5"}, allowed=RECIPE_KEYS)
    message = str(info.value)
    assert "2 problem(s)" in message
    assert "OPSD_MAX_STEPS is " + BUDGET_MESSAGE in message
    assert "OPSD_BF16 is a config field but not tunable" in message


def test_env_completion_cap_only_when_capped():
    assert env_overrides({"OPSD_MAX_COMPLETION_LENGTH": "8192"})[0].value == "8192"
    with pytest.raises(RecipeError, match="outside 1..4096"):
        env_overrides({"OPSD_MAX_COMPLETION_LENGTH": "8192"}, allowed=RECIPE_KEYS)


def test_env_list_field_points_to_yaml():
    with pytest.raises(RecipeError, match="YAML"):
        env_overrides({"OPSD_LABEL_NAMES": "labels"})


# ------------------------------------------------------------------------------------------------------------
# resolve_overrides and to_argv
# ------------------------------------------------------------------------------------------------------------
def test_env_beats_recipe(tmp_path, caplog):
    path = write(tmp_path, "BETA=0.5\nLORA_R=8\n")
    with caplog.at_level(logging.INFO, logger="opsd.configuration.sources"):
        got = resolve_overrides(path, {"OPSD_BETA": "1"}, capped=True)
    assert got == [Override("lora_r", "8", f"{path}:2"), Override("beta", "1.0", "env OPSD_BETA")]
    assert f"override lora_r=8 ({path}:2)" in caplog.text
    assert "override beta=1.0 (env OPSD_BETA)" in caplog.text
    assert "replaced by env OPSD_BETA" in caplog.text


def test_resolve_without_recipe_and_uncapped():
    assert resolve_overrides(None, {"OPSD_MAX_STEPS": "3"}, capped=False) == [
        Override("max_steps", "3", "env OPSD_MAX_STEPS")
    ]
    with pytest.raises(RecipeError, match=BUDGET_MESSAGE):
        resolve_overrides(None, {"OPSD_MAX_STEPS": "3"}, capped=True)


def test_resolve_reports_recipe_and_env_problems_together(tmp_path):
    path = write(tmp_path, "BETA=x\n")
    with pytest.raises(RecipeError) as info:
        resolve_overrides(path, {"OPSD_TOP_K": "many"}, capped=True)
    assert f"{path}:1:" in str(info.value)
    assert "OPSD_TOP_K" in str(info.value)


def test_to_argv_round_trips_through_the_real_parser(tmp_path):
    recipe = write(
        tmp_path,
        "LEARNING_RATE=3e-6\nFIX_POSITION_IDS=false\nSTUDENT_THINKING=yes\nCLIP_MODE=rescale\n"
        "MAX_COMPLETION_LENGTH=2048\nWARMUP_STEPS=0.1\nTEACHER_PROMPT_FILE='-odd name.txt'\n",
    )
    overrides = resolve_overrides(
        recipe, {"OPSD_ADAM_BETA1": "0.8", "OPSD_WEIGHT_DECAY": "0.01"}, capped=True
    )
    argv = to_argv(overrides)
    assert argv[0] == "--learning_rate=3e-06"
    config = parse_argv(tmp_path, argv)
    for o in overrides:
        assert getattr(config, o.field) == typed(o.field, o.value), o.field
    assert config.learning_rate == 3e-6
    assert config.fix_position_ids is False
    assert config.student_thinking is True
    assert config.weight_decay == 0.01
    # A leading '-' stays a value, not a flag: it reaches the field, whose range (>= 0, as torch's AdamW
    # requires) refuses it, instead of argparse reading `-0.01` as an option.
    negative = to_argv(resolve_overrides(None, {"OPSD_WEIGHT_DECAY": "-0.01"}, capped=True))
    with pytest.raises(ValueError, match=r"weight_decay=-0\.01 is out of range: must be in \[0, 1\]"):
        parse_argv(tmp_path, negative)
    assert config.teacher_prompt_file == "-odd name.txt"
    assert config.max_completion_length == 2048


def test_overrides_win_over_earlier_cli_flags(tmp_path):
    argv = ["--beta", "0.2"] + to_argv([Override("beta", "0.7", "test")])
    assert parse_argv(tmp_path, argv).beta == 0.7


def test_teacher_ref_pairing_is_a_method_key_everywhere(tmp_path):
    assert OPSDConfig(output_dir=str(tmp_path)).teacher_ref_pairing == "matched"
    assert "teacher_ref_pairing" in RECIPE_KEYS and "teacher_ref_pairing" not in BUDGET_KEYS
    recipe = write(tmp_path, "TEACHER_REF_PAIRING=shuffled\n")
    assert [(o.field, o.value) for o in parse_recipe(recipe)] == [("teacher_ref_pairing", "shuffled")]
    env = {"OPSD_TEACHER_REF_PAIRING": "empty"}
    overrides = resolve_overrides(recipe, env, capped=True)  # the harness's whitelist takes it; env wins
    assert [(o.field, o.value) for o in overrides] == [("teacher_ref_pairing", "empty")]
    assert parse_argv(
        tmp_path, ["--teacher_ref_pairing", "shuffled", *to_argv(overrides)]
    ).teacher_ref_pairing == ("empty")
    with pytest.raises(RecipeError, match="did you mean shuffled"):
        env_overrides({"OPSD_TEACHER_REF_PAIRING": "shufled"})
    # The harness's pass-through flags take operational keys only: the recipe records the method.
    with pytest.raises(RecipeError, match="--teacher_ref_pairing changes the method"):
        flag_overrides(["--teacher_ref_pairing", "empty"])


# -- the RL arms' switches: GRPO's settings, the hybrid's route, the budget's unit -------------------------------

# Each new switch at a value away from its default, as a recipe line writes it, and as the config holds it.
RL_SWITCHES = {
    "grpo": {
        "rl_loss_type": ("dr_grpo", "dr_grpo"),
        "epsilon_high": ("0.28", 0.28),
        "mask_truncated_completions": ("yes", True),  # recipe.env's booleans: true/false, 1/0, yes/no
        "scale_rewards": ("none", "none"),
        "rl_beta": ("0.04", 0.04),
        "budget_unit": ("rollouts", "rollouts"),
    },
    "hybrid": {"hybrid_route": ("group", "group"), "budget_unit": ("rollouts", "rollouts")},
}
# A value each refuses, and what the one-line refusal says.
RL_BAD = {
    "rl_loss_type": ("cispo", "'cispo'"),
    "epsilon_high": ("0.1", "epsilon_high=0.1 is out of range: must be 0 or in [0.2, 10]"),
    "mask_truncated_completions": ("maybe", "mask_truncated_completions"),
    "scale_rewards": ("std", "'std'"),
    "rl_beta": ("-1.5", "rl_beta=-1.5 is out of range: must be in [0, 10000]"),
    "hybrid_route": ("both", "'both'"),
    "budget_unit": ("tokens", "'tokens'"),
}


def _parsed(tmp_path: Path, source: str, values: dict[str, str]) -> OPSDConfig:
    """The config `values` (field -> text) give through one source: flags, a YAML file, recipe.env or OPSD_*."""
    import yaml

    from opsd.launch.command_line import parse_config

    out = ["--output_dir", str(tmp_path / "run"), "--rollout_engine", "transformers"]
    if source == "cli":
        return parse_config([*out, *(f"--{k}={v}" for k, v in values.items())], environ={})[0]
    if source == "yaml":
        path = tmp_path / "c.yaml"
        path.write_text(yaml.safe_dump({k: yaml.safe_load(v) for k, v in values.items()}))
        return parse_config(["--config", str(path), *out], environ={})[0]
    if source == "recipe":
        recipe = write(tmp_path, "".join(f"{k.upper()}={v}\n" for k, v in values.items()))
        return parse_config([*out, "--recipe", str(recipe)], environ={})[0]
    assert source == "env"
    return parse_config(out, environ={env_name(k): v for k, v in values.items()})[0]


SOURCES = ("cli", "yaml", "recipe", "env")


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("method", sorted(RL_SWITCHES))
def test_rl_switches_through_every_source(tmp_path, source, method):
    """GRPO's settings, the hybrid's route and the budget's unit are method switches (recipe.env, OPSD_*, flags,
    YAML) with TRL's defaults; each bad value is refused in one line naming the switch."""
    d = OPSDConfig(output_dir=str(tmp_path), rollout_engine="transformers")
    assert (d.rl_loss_type, d.epsilon_high, d.mask_truncated_completions, d.scale_rewards, d.rl_beta) == (
        "dapo", 0.0, False, "group", 0.0,
    )  # fmt: skip
    assert (d.hybrid_route, d.budget_unit) == ("mix", "problems")
    switches = RL_SWITCHES[method]
    assert set(switches) <= RECIPE_KEYS and not set(switches) & BUDGET_KEYS
    context = {"method": method, "num_generations": "4"}
    config = _parsed(tmp_path, source, {**context, **{k: v for k, (v, _) in switches.items()}})
    assert (config.method, config.num_generations) == (method, 4)
    for name, (_, value) in switches.items():
        assert getattr(config, name) == value, (source, name)
    for name, (bad, needle) in RL_BAD.items():
        if name not in switches:
            continue
        with pytest.raises((InvalidValue, RecipeError)) as info:
            _parsed(tmp_path, source, {**context, name: bad})
        message = str(info.value)
        assert needle in message and "\n" not in message.strip(), (source, name, message)


@pytest.mark.parametrize(
    ("recipe", "needles"),
    [
        ("RL_LOSS_TYPE=dr_grpo\n", ["rl_loss_type='dr_grpo' is read by method=grpo and hybrid only", "method=opsd",
                                    "set method=grpo or hybrid"]),
        ("EPSILON_HIGH=0.28\n", ["epsilon_high=0.28", "method=opsd never reads it"]),
        ("MASK_TRUNCATED_COMPLETIONS=true\n", ["mask_truncated_completions=True", "method=opsd"]),
        ("SCALE_REWARDS=none\n", ["scale_rewards='none'", "method=opsd"]),
        ("RL_BETA=0.04\n", ["rl_beta=0.04", "method=opsd"]),
        ("METHOD=grpo\nHYBRID_ROUTE=group\n", ["hybrid_route='group' is read by method=hybrid only", "method=grpo"]),
        ("HYBRID_ROUTE=sample\n", ["hybrid_route='sample'", "method=hybrid", "method=opsd never reads it"]),
        ("METHOD=grpo\nNUM_GENERATIONS=3\nBUDGET_UNIT=rollouts\n",
         ["budget_unit=rollouts", "per_device_train_batch_size=4 is not a multiple of num_generations=3",
          "or budget_unit=problems"]),
    ],
)  # fmt: skip
def test_switches_another_method_reads_are_refused_in_one_line(tmp_path, recipe, needles):
    from opsd.launch.command_line import parse_config

    path = write(tmp_path, recipe)
    with pytest.raises(InvalidValue) as info:
        parse_config(["--output_dir", str(tmp_path / "run"), "--recipe", str(path)], environ={})
    message = str(info.value)
    assert "\n" not in message and f"(from {path}:" in message, message
    for needle in needles:
        assert needle in message, message


def test_budget_unit_under_opsd_is_the_same_step(tmp_path, caplog, first_inert_lines):
    """method=opsd samples one rollout per problem: budget_unit=rollouts is accepted with a note that it changes
    nothing (and the experiment compares arms without it)."""
    from opsd.configuration.checks import inert_fields

    with caplog.at_level(logging.WARNING):
        config = OPSDConfig(output_dir=str(tmp_path), budget_unit="rollouts", rollout_engine="transformers")
    assert "budget_unit" in inert_fields(config)
    assert any("budget_unit='rollouts' has no effect" in r.getMessage() for r in caplog.records)
    assert "budget_unit" not in inert_fields({"method": "grpo", "budget_unit": "rollouts"})


@pytest.mark.parametrize("method", ["grpo", "hybrid"])
@pytest.mark.parametrize(("flag", "value"), [("--min_p", "0.05"), ("--repetition_penalty", "1.1")])
def test_sampler_settings_the_ratio_does_not_reproduce_are_refused(tmp_path, method, flag, value):
    """GRPO's ratio scores sampled tokens under temperature, top-k and top-p (opsd.method.sampler); min_p and a
    repetition penalty would make the engine sample from another distribution: one line naming the setting."""
    from opsd.launch.command_line import parse_config

    argv = ["--output_dir", str(tmp_path / "run"), "--method", method, "--num_generations", "2", flag, value]
    with pytest.raises(ValueError) as info:
        parse_config(argv, environ={})
    message = str(info.value)
    assert "\n" not in message and flag.removeprefix("--") in message and "remove" in message, message
    assert parse_config(
        ["--output_dir", str(tmp_path / "o"), flag, value], environ={}
    )  # OPSD's loss reads neither
