"""The ranges the switches declare (opsd/configuration/switches.py) through every entry path, TRL options and
other fields OPSD derives itself, YAMLs written for transformers 4 / open-r1, and the hints of unknown keys."""

from __future__ import annotations

import json
import logging
import math

import pytest
import yaml

from opsd.configuration.checks import range_error
from opsd.configuration.sources import RecipeError, parse_recipe
from opsd.configuration.switches import CAPPED_KEYS, CHOICES, RANGES
from opsd.errors import InvalidValue, UserError

# field -> (a value well inside, an edge value that is still allowed, a value just outside). Hand-written:
# each edge and each refusal is the rule the code that reads the field needs.
CASES: dict[str, tuple[object, object, object]] = {
    "learning_rate": (1e-5, 1e-12, 0.0),
    "warmup_steps": (10.0, 99.0, 100.0),  # below max_steps=100; 100 would be a run that is all warm-up
    "weight_decay": (0.01, 0.0, -0.01),
    "max_grad_norm": (1.0, 0.0, -0.1),
    "adam_beta1": (0.9, 0.0, 1.0),
    "adam_beta2": (0.999, 0.0, 1.0),
    "adam_epsilon": (1e-8, 1e-30, 0.0),  # 0: Adam's 0 / 0 wherever a gradient is 0
    "max_steps": (50, 1, 0),
    "per_device_train_batch_size": (4, 1, 0),
    "gradient_accumulation_steps": (2, 1, 0),
    "seed": (42, 2**32 - 1, -1),
    "data_seed": (7, 0, 2**32),
    "probe_size": (16, 0, -1),
    "save_steps": (10.0, 0.01, 0.0),
    "temperature": (0.7, 1e-3, 0.0),
    "top_p": (0.9, 1.0, 1.5),
    "top_k": (20, 0, -1),
    "min_p": (0.05, 1.0, 1.5),
    "repetition_penalty": (1.1, 1e-3, 0.0),
    "max_completion_length": (512, 1, 0),
    "vllm_gpu_memory_utilization": (0.5, 1.0, 5.0),
    "vllm_max_num_seqs": (8, 0, -1),
    "vllm_tensor_parallel_size": (2, 1, 0),
    "vllm_max_model_length": (1024, 1, 0),
    "vllm_server_port": (8000, 65535, 65536),
    "vllm_server_timeout": (240.0, 0.5, 0.0),
    "num_iterations": (1, 1, 0),
    "steps_per_rollout": (2, 1, 0),
    "dataloader_num_workers": (2, 0, -1),
    "beta": (0.5, 1.0, 1.5),
    "loss_temperature": (1.0, 0.0, -1.0),
    "divergence_clip": (0.05, 1e-6, 0.0),
    "top_k_loss": (64, 0, -3),
    "loss_chunk_size": (512, 1, 0),
    "num_loss_tokens_to_skip": (1, 0, -1),
    "lora_r": (16, 1, 0),
    "lora_alpha": (32, 1, 0),
    "lora_dropout": (0.1, 0.0, 1.0),
    "ema_decay": (0.99, 0.999999, 1.0),
    "teacher_sync_steps": (2, 1, 0),
    "teacher_ref_max_chars": (100, 0, -1),
    "teacher_ref_fraction": (0.5, 1e-9, 1e-12),  # below 1e-9, f x n rounds to no token (1.0: the default)
    "contrast_weight": (0.5, 0.0, -0.5),
    "contrast_top_k": (20, 1, 0),
    "contrast_log_floor": (-5.0, 0.0, 1.0),
    "contrast_kl_tau": (1.0, 0.0, -1.0),
    "contrast_hints": (4, 1, 0),
    "contrast_rl_weight": (0.5, 2.0, 2.5),  # RLCSD clips its modulation at 2
    "contrast_rl_tau": (0.02, 1e-6, 0.0),
    "contrast_rl_delta": (0.02, 0.0, -0.1),
    "sd_weight": (0.5, 0.0, -0.5),
    "epsilon_high": (0.28, 0.2, 0.19),  # 0: TRL's None; below epsilon the clip turns around
    "rl_beta": (0.04, 0.0, -0.1),
    "fixed_advantage": (-0.5, -1e-6, 0.0),  # zero would be no control at all, a positive one its opposite
    "max_teacher_prompt_length": (2048, 0, -1),
    "wavg_last": (3, 0, -1),
    "probe_steps": (5, 0, -1),
    "max_nonfinite_steps": (3, 1, 0),
    "completions_steps": (5, 0, -1),
    "completions_rows": (2, 1, 0),
    "logging_steps": (5.0, 0.5, 0.0),
    "num_generations": (8, 2, -1),  # with method=grpo (CONTEXT); 0 = the method's own
}


# Refusals that come from a rule between fields (opsd.configuration.checks.check_cross_fields), with
# max_steps=100.
CROSS = {
    "warmup_steps": "warmup_steps=100.0 is out of range: must be below max_steps=100 (the whole run would be "
    "warm-up); lower it, or give a fraction of the run below 1"
}


# Fields only one method reads (opsd.configuration.checks.check_method), set with it in every entry path: alone they
# would be refused for that reason, not their range.
CONTEXT = (
    {
        name: {"method": "hybrid"}
        for name in (
            "sd_weight",
            "hybrid_route",
            "contrast_rl_weight",
            "contrast_rl_tau",
            "contrast_rl_delta",
            "teacher_contrast",
        )
    }
    | {  # teacher_contrast's last choice, own_wrong, draws its hints from a hybrid's rollouts
        name: {"method": "grpo"}
        for name in ("rl_loss_type", "epsilon_high", "mask_truncated_completions", "scale_rewards", "rl_beta")
    }
    | {  # GRPO's settings (TRL's GRPOConfig): method=opsd has no GRPO term
        "num_generations": {"method": "grpo"},  # method=opsd takes one rollout per problem
        # The rows a process holds at once are the product of the two (opsd.configuration.checks): each end alone.
        "per_device_train_batch_size": {"gradient_accumulation_steps": "1"},
        "gradient_accumulation_steps": {"per_device_train_batch_size": "1"},
    }
)


# Upper bounds (and the lower bounds above 0) of the magnitudes that reach the loss or the update, each at the edge
# that holds in float32 and just past it (opsd/configuration/switches.py gives each its reason;
# tests/integration/test_inputs_extremes.py runs a step at every edge).
BOUNDS: dict[str, tuple[object, object]] = {
    "learning_rate": (1.0, 1.5),
    "weight_decay": (1.0, 1.5),
    "temperature": (1000.0, 1001.0),
    "loss_temperature": (0.001, 0.0009),  # 0 is allowed: the rollout temperature
    "divergence_clip": (1e4, 1.5e4),
    "sd_weight": (1e4, 1.5e4),
    "rl_beta": (1e4, 1.5e4),
    "epsilon_high": (10.0, 10.5),
    "fixed_advantage": (-1e4, -1e308),
    "num_loss_tokens_to_skip": (2**24, 2**24 + 1),
    "lora_r": (2**14, 2**14 + 1),
    "lora_alpha": (10_000, 10_001),
}


# The upper bounds of the counts that size a batch or a tensor (opsd/configuration/switches.py: MAX_GENERATIONS,
# MAX_BATCH_ROWS, MAX_TOKENS) and the smallest temperatures of the contrastive weights that float32 holds
# (MIN_CONTRAST_TAU), each at its edge and just past it, through every source.
SIZES: dict[str, tuple[object, object]] = {
    "num_generations": (1024, 1_000_000_000),
    "per_device_train_batch_size": (2**16, 2**16 + 1),
    "gradient_accumulation_steps": (2**16, 2**16 + 1),
    "vllm_max_num_seqs": (2**16, 2**16 + 1),
    "probe_size": (2**16, 2**16 + 1),
    "max_completion_length": (2**24, 2**24 + 1),
    "max_teacher_prompt_length": (2**24, 2**24 + 1),
    "vllm_max_model_length": (2**24, 2**24 + 1),
    "top_k": (2**24, 2**24 + 1),
    "top_k_loss": (2**24, 2**24 + 1),
    "loss_chunk_size": (2**24, 2**24 + 1),
    "contrast_kl_tau": (1e-30, 1e-300),  # KL / (KL + tau): 0 / 0 where KL is 0 once tau is 0 in float32
    "contrast_rl_tau": (1e-30, 1e-300),  # tanh(e / tau): NaN at e = 0
}


def expected_refusal(name: str, value: object) -> str:
    return CROSS[name] if name in CROSS else range_error(name, value)


def test_cases_cover_the_table():
    assert set(CASES) == set(RANGES)
    for name, (inside, edge, outside) in CASES.items():
        assert range_error(name, inside) is None and range_error(name, edge) is None, name
        assert (range_error(name, outside) is not None) != (name in CROSS), name
    assert (
        range_error("warmup_steps", -1.0)
        == "warmup_steps=-1.0 is out of range: must be >= 0 (a value below 1 is a fraction of max_steps)"
    )


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_the_bounds_that_hold_in_float32(name, tmp_path, monkeypatch):
    """Each bound through an OPSD_* variable (every path reaches the same check: the test above), the value past
    it refused in one line naming its range, before the run writes anything."""
    monkeypatch.delenv("OPSD_DEBUG", raising=False)
    edge, outside = BOUNDS[name]
    assert range_error(name, edge) is None and range_error(name, outside) is not None
    assert getattr(_via("env", name, edge, tmp_path, None), name) == edge
    with pytest.raises(UserError) as info:
        _via("env", name, outside, tmp_path, None)
    assert str(info.value) == f"{range_error(name, outside)} (from env OPSD_{name.upper()})"
    assert not (tmp_path / "run").exists()


def test_a_fixed_advantage_that_overflows_float32_is_refused_with_the_bound():
    """-1e308 once passed every check and died at step 1 ("cannot be converted to type float without overflow");
    -1e38 fit in float32 but made every step non-finite, silently."""
    for value in (-1e308, -1e38):
        assert range_error("fixed_advantage", value) == (
            f"fixed_advantage={value!r} is out of range: must be in [-10000, 0) (a negative constant: sampled tokens "
            "are pushed down)"
        )
    assert range_error("loss_temperature", 0.0) is None  # 0: the rollout temperature
    assert RANGES["loss_temperature"].rule() == "must be 0 or in [0.001, 1000] (0 = rollout temperature)"


@pytest.mark.parametrize("name", sorted(SIZES))
def test_the_size_bounds_and_the_smallest_taus_through_every_source(name, tmp_path, monkeypatch):
    """Each bound through the command line, a YAML file, recipe.env (the switches it takes) and OPSD_*: the edge
    is taken, the value past it refused in one line naming its range (and the source), before anything is written.
    num_generations=1e9 once passed every check and died at step 1 in TRL's batch sampler (MemoryError); a tau of
    1e-300 is 0 in float32."""
    monkeypatch.delenv("OPSD_DEBUG", raising=False)
    edge, outside = SIZES[name]
    expected = range_error(name, outside)
    assert range_error(name, edge) is None and expected is not None
    for path in ("cli", "yaml", "recipe", "env"):
        if path == "recipe" and (name not in CAPPED_KEYS or name == "max_completion_length"):
            continue  # recipe.env takes the tunable keys, its rollouts capped at 4096 (test above)
        assert getattr(_via(path, name, edge, tmp_path, None), name) == edge, path
        with pytest.raises(UserError) as info:
            _via(path, name, outside, tmp_path, None)
        source = {"cli": "", "recipe": f" (from {tmp_path / 'recipe.env'}:1)", "env": f" (from env OPSD_{name.upper()})",
                  "yaml": f" (from {tmp_path / 'c.yaml'})"}[path]  # fmt: skip
        assert str(info.value) == expected + source, (path, str(info.value))
    assert not (tmp_path / "run").exists()


def test_rollouts_held_at_once_are_bounded_and_a_count_beyond_int64_is_one_line(tmp_path):
    """G x problems per step within the rows a process holds (the product, each factor within its own range),
    and a num_generations beyond int64 (10^20) refused as 1e9 is."""
    from opsd.launch.command_line import parse_config

    out = ["--output_dir", str(tmp_path / "run"), "--method", "grpo"]
    with pytest.raises(InvalidValue) as info:
        parse_config([*out, "--num_generations", "1024", "--per_device_train_batch_size", "64"], environ={})
    assert str(info.value) == (
        "per_device_train_batch_size=64 x gradient_accumulation_steps=2 x steps_per_rollout=1 x num_generations=1024 "
        "= 131,072 rollouts generated and held at once by each process, over 65,536; give fewer problems per step "
        "or fewer rollouts per problem"
    )
    assert parse_config(
        [*out, "--num_generations", "1024", "--per_device_train_batch_size", "32"], environ={}
    )
    with pytest.raises(
        InvalidValue, match=r"^num_generations=100000000000000000000 is out of range: must be in "
    ):
        parse_config(out, environ={"OPSD_NUM_GENERATIONS": str(10**20)})


def _text(value: object) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _via(path: str, name: str, value: object, tmp_path, data):
    """Parse `name=value` through one entry path; returns the config (the dry run: its printed config)."""
    from opsd.launch.command_line import parse_config
    from opsd_train import main

    out = ["--output_dir", str(tmp_path / "run")]
    context = CONTEXT.get(name, {})
    flags = [f"--{k}={v}" for k, v in context.items()]
    if path == "cli":
        return parse_config([*out, *flags, f"--{name}={_text(value)}"], environ={})[0]
    if path == "yaml":
        cfg = tmp_path / "c.yaml"
        cfg.write_text(yaml.safe_dump({**context, name: value}))
        return parse_config(["--config", str(cfg), *out], environ={})[0]
    if path == "recipe":
        recipe = tmp_path / "recipe.env"
        recipe.write_text(
            f"{name.upper()}={_text(value)}\n" + "".join(f"{k.upper()}={v}\n" for k, v in context.items())
        )
        return parse_config([*out, "--recipe", str(recipe)], environ={})[0]
    if path == "env":
        env = {f"OPSD_{k.upper()}": v for k, v in context.items()}
        return parse_config(out, environ={**env, f"OPSD_{name.upper()}": _text(value)})[0]
    assert path == "dry-run"
    main([*out, "--dataset_name", str(data), *flags, f"--{name}={_text(value)}", "--dry-run"])
    return None


PATHS = ("cli", "yaml", "recipe", "env", "dry-run")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    # A solution that states its answer, so that teacher_contrast=wrong_answer can replace it.
    row = {
        "problem": "p",
        "solution": "s = \\boxed{1}",
        "Answer": "1",
        "COT_Reason": "c",
        "generated_token_count": 3000,
    }
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "problem": "q"}) + "\n")
    return path


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_range_through_every_entry_path(name, tmp_path, tiny_data, capsys, monkeypatch):
    monkeypatch.delenv("OPSD_DEBUG", raising=False)
    inside, edge, outside = CASES[name]
    expected = expected_refusal(name, outside)
    for path in PATHS:
        if path == "recipe" and name not in CAPPED_KEYS:
            # recipe.env takes only the tunable keys; the others are refused for that reason, not a range.
            with pytest.raises(RecipeError):
                _via(path, name, inside, tmp_path, tiny_data)
            continue
        for value in (inside, edge):
            config = _via(path, name, value, tmp_path, tiny_data)
            if config is not None:
                got = getattr(config, name)
                assert got == value or (isinstance(got, float) and math.isclose(got, value)), (path, value)
            else:
                printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["config"][name]
                assert math.isclose(printed, value), (path, value)
        with pytest.raises(UserError) as info:
            _via(path, name, outside, tmp_path, tiny_data)
        message = str(info.value)
        if path == "recipe" and name == "max_completion_length":
            # recipe.env caps rollouts tighter (1..4096, the harness's limit) and says so on the line.
            assert "max_completion_length=0 is outside 1..4096" in message and ".env:1:" in message
            continue
        assert "\n" not in message and message.startswith(expected), (path, message)
        if path in ("recipe", "env", "yaml"):  # the source is named: the recipe line, the variable, the file
            source = {"recipe": f"{tmp_path / 'recipe.env'}:1", "env": f"env OPSD_{name.upper()}",
                      "yaml": str(tmp_path / "c.yaml")}[path]  # fmt: skip
            assert message == f"{expected} (from {source})", message


@pytest.mark.parametrize("name", sorted(CHOICES))
def test_every_choice_through_every_entry_path(name, tmp_path, tiny_data, capsys):
    choices = CHOICES[name]
    for path in PATHS:
        if path == "recipe" and name not in CAPPED_KEYS:
            continue
        for value in (choices[0], choices[-1]):
            config = _via(path, name, value, tmp_path, tiny_data)
            if config is None:
                capsys.readouterr()
            elif name != "dtype":  # dtype may come back as the torch_dtype alias's value; it is the same
                assert getattr(config, name) == value
        with pytest.raises(UserError) as info:
            _via(path, name, "nonesuch", tmp_path, tiny_data)
        assert "'nonesuch'" in str(info.value) and "\n" not in str(info.value), (path, info.value)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_non_finite_numbers_are_refused_on_the_cli(value, tmp_path):
    from opsd.launch.command_line import parse_config

    with pytest.raises(
        InvalidValue, match=rf"learning_rate={value}.* is out of range: must be finite and in \(0, 1\]"
    ):
        parse_config(["--output_dir", str(tmp_path), f"--learning_rate={value}"], environ={})


def test_warmup_over_half_is_a_note(tmp_path, caplog):
    from opsd.launch.command_line import parse_config

    with caplog.at_level(logging.WARNING, logger="opsd.configuration.checks"):
        parse_config(["--output_dir", str(tmp_path), "--warmup_steps", "60"], environ={})
    assert "warmup_steps=60.0 is over half of max_steps=100" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="opsd.configuration.checks"):
        parse_config(["--output_dir", str(tmp_path), "--warmup_steps", "0.1"], environ={})
    assert "over half" not in caplog.text


# -- TRL options that OPSD sets from its own switches ------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--teacher_update_rate", "0.5"], "teacher_update_rate=0.5 is a TRL option that OPSD sets itself"),
        (["--teacher_model_kind", "live"], "teacher_model_kind='live' is a TRL option that OPSD sets itself"),
        (["--teacher_model_kind", "ema", "--teacher_mode", "dynamic"], "set the teacher with teacher_mode"),
    ],
)
def test_trl_teacher_options_are_refused(args, message, tmp_path):
    from opsd.launch.command_line import parse_config

    with pytest.raises(InvalidValue, match=message) as info:
        parse_config(["--output_dir", str(tmp_path), *args], environ={})
    assert "ema_decay" in str(info.value) or "teacher_mode" in str(info.value)


def test_trl_teacher_options_at_opsd_values_pass(tmp_path):
    from opsd.launch.command_line import parse_config

    out = ["--output_dir", str(tmp_path)]
    cfg, _ = parse_config([*out, "--teacher_mode", "dynamic", "--teacher_model_kind", "live"], environ={})
    assert cfg.teacher_model_kind == "live"
    cfg, _ = parse_config(
        [*out, "--teacher_mode", "ema", "--ema_decay", "0.9", "--teacher_update_rate", "0.1"], environ={}
    )
    assert cfg.teacher_model_kind == "ema" and math.isclose(cfg.teacher_update_rate, 0.1)
    # SDFTConfig's own defaults cannot be told from unset: they pass and are replaced by OPSD's values.
    cfg, _ = parse_config([*out, "--teacher_update_rate", "0.05", "--teacher_model_kind", "base"], environ={})
    assert cfg.teacher_model_kind == "base" and math.isclose(cfg.teacher_update_rate, 1 - 0.999)


# -- fields derived from others, once -----------------------------------------------------------------------------


@pytest.mark.parametrize("installed", [True, False])
def test_the_rollout_engine_is_derived_with_the_config(installed, tmp_path, monkeypatch, caplog):
    """`use_vllm` comes from `rollout_engine` when the config is built (not rewritten after its checks): auto is
    whether vLLM is installed, with a warning when not; vllm without vLLM is one line naming the fix; a caller's
    own `use_vllm` decides under auto and must agree with vllm or transformers."""
    from opsd.configuration import config
    from opsd.launch.command_line import parse_config

    monkeypatch.setattr(config, "vllm_installed", lambda: installed)

    def build(**settings):
        return config.OPSDConfig(output_dir=str(tmp_path), **settings)

    with caplog.at_level(logging.WARNING, logger="opsd.configuration.config"):
        assert build().use_vllm is installed
    assert ("vLLM is not installed; rollouts use transformers.generate" in caplog.text) is not installed
    assert build(rollout_engine="transformers").use_vllm is False
    for given in (True, False):  # tests and benchmarks pick the engine so
        assert build(use_vllm=given).use_vllm is given
        assert build(use_vllm=given).with_micro_batch(2, 4).use_vllm is given
    with pytest.raises(ValueError, match="use_vllm=True disagrees with rollout_engine=transformers"):
        build(rollout_engine="transformers", use_vllm=True)
    if installed:
        assert build(rollout_engine="vllm").use_vllm is True
        return
    with pytest.raises(InvalidValue) as info:
        parse_config(["--output_dir", str(tmp_path)], environ={"OPSD_ROLLOUT_ENGINE": "vllm"})
    assert str(info.value) == (
        "rollout_engine=vllm but vLLM is not installed: `pip install opsd[vllm]` (GPU) or `pip install opsd[cpu]`; "
        "or use --rollout_engine transformers (from env OPSD_ROLLOUT_ENGINE)"
    )


def test_whether_the_teacher_is_contrastive_is_one_property_the_loss_reads(tmp_path):
    from opsd.configuration.config import OPSDConfig
    from opsd.method.loss import loss_settings

    for contrast in CHOICES["teacher_contrast"]:
        method = "hybrid" if contrast == "own_wrong" else "opsd"
        cfg = OPSDConfig(output_dir=str(tmp_path), use_vllm=False, teacher_contrast=contrast, method=method)
        assert cfg.contrast_on is (contrast != "none")
        assert (loss_settings(cfg).contrast is not None) is cfg.contrast_on


# -- YAML configs written for TRL / open-r1 ---------------------------------------------------------------------

OPEN_R1_YAML = """\
# Model arguments
model_name_or_path: ""
model_revision: main
torch_dtype: float32
attn_implementation: sdpa
use_peft: true
lora_r: 16
lora_alpha: 32
lora_dropout: 0.05
lora_target_modules:
- q_proj
- k_proj
- v_proj
- o_proj

# Data training arguments
dataset_name: builtin
dataset_split: train

# Training arguments
bf16: true
do_eval: true
eval_strategy: steps
eval_steps: 100
evaluation_strategy: steps
gradient_accumulation_steps: 4
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
hub_model_id: Qwen3-OPSD
hub_strategy: every_save
learning_rate: 2.0e-05
log_level: info
logging_steps: 5
logging_strategy: steps
lr_scheduler_type: cosine
max_steps: 200
num_generations: 1
output_dir: data/Qwen3-OPSD
overwrite_output_dir: true
per_device_train_batch_size: 2
push_to_hub: false
report_to:
- none
save_strategy: "no"
seed: 42
warmup_ratio: 0.1
"""


def test_open_r1_style_yaml_loads_as_written(tmp_path, caplog):
    from opsd.launch.command_line import parse_config

    cfg_path = tmp_path / "config_opsd.yaml"
    cfg_path.write_text(OPEN_R1_YAML)
    with caplog.at_level(logging.WARNING, logger="opsd.launch.command_line"):
        cfg, _ = parse_config(["--config", str(cfg_path)], environ={})
    assert cfg.warmup_steps == 0.1 and cfg.get_warmup_steps(cfg.max_steps) == 20  # the fraction form
    assert cfg.lr_scheduler_type.value == "cosine" and cfg.learning_rate == 2e-5 and cfg.max_steps == 200
    assert cfg.dtype == "float32" and cfg.attn_implementation == "sdpa"
    assert cfg.lora_target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"] and cfg.lora_dropout == 0.05
    assert cfg.report_to == []  # transformers reads a list holding "none" as no tracker
    assert cfg.push_to_hub is False and cfg.eval_strategy.value == "no" and cfg.do_eval is False
    notes = [r.getMessage() for r in caplog.records if r.name == "opsd.launch.command_line"]
    assert len(notes) == 5, notes  # one per translated or ignored key
    for key in ("warmup_ratio", "overwrite_output_dir", "evaluation_strategy", "eval_strategy", "do_eval"):
        assert any(f"note: {key}=" in n for n in notes), key
    assert all(str(cfg_path) in n for n in notes)


# Eight levels of aliases, nine each, all in one value: 9^8 = 43 million leaves in about 330 bytes.
ALIAS_BOMB = (
    "{key}: [&a [x, x, x, x, x, x, x, x, x], "
    + ", ".join(f"&{b} [{', '.join(['*' + a] * 9)}]" for a, b in zip("abcdefg", "bcdefgh", strict=True))
    + "]\n"
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("learnin_rate: 1.0e-5\n", "learnin_rate is not a config field (did you mean learning_rate?)"),
        ("per_gpu_train_batch_size: 8\n", "use per_device_train_batch_size"),
        ("warmup_ratio: 0.1\nwarmup_steps: 5\n", "warmup_ratio and warmup_steps are both set"),
        ("reward_funcs: [accuracy]\n", "reward_funcs is not a config field"),
        ("beta: [unclosed\n", "is not valid YAML"),
        ("warmup_ratio: 1.5\n", "warmup_steps=1.5 is out of range"),
        # A YAML value of the wrong kind for a number is named as such, not as out of range.
        (
            "learning_rate: true\n",
            "learning_rate: true in {cfg} is not a number; write e.g. learning_rate: 0.5",
        ),
        ("beta: [0.5]\n", "beta: a list in {cfg} is not a number"),
        ("lora_r: 2.5\n", "lora_r: 2.5 in {cfg} is not a whole number"),
        ("lora_target_modules: [q_proj, [v_proj]]\n", "lora_target_modules holds a list, not a module name"),
        ("lora_target_modules: {q_proj: 1}\n", "lora_target_modules holds a dict, not a module name"),
        # Values bounded before anything expands them: 9^8 leaves in 300 bytes of nested aliases, under a field,
        # under TRL's `env` (which it str()-s whole), and an alias that holds itself.
        (
            ALIAS_BOMB.format(key="lora_target_modules"),
            "{cfg}: the value of 'lora_target_modules' takes the config past 10,000",
        ),
        (ALIAS_BOMB.format(key="env"), "{cfg}: the value of 'env' takes the config past 10,000 YAML nodes"),
        ("env: &e [1, *e]\n", "{cfg}: the value of 'env' takes the config past 10,000 YAML nodes"),
        (
            ",".join(f"m{i}" for i in range(1001)).join(("lora_target_modules: '", "'\n")),
            "more than 1000 names",
        ),
    ],
)
def test_yaml_mistakes_are_one_line(text, message, tmp_path):
    from opsd.launch.command_line import parse_config

    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(text)
    with pytest.raises(InvalidValue) as info:
        parse_config(
            ["--config", str(cfg_path), "--output_dir", str(tmp_path), "--max_steps", "1"], environ={}
        )
    assert message.format(cfg=cfg_path) in str(info.value) and "\n" not in str(info.value), info.value
    assert "fail_with_unknown_args" not in str(info.value)


# -- hints --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("max_steps=200", "MAX_STEPS is the key, and it is fixed by the capped harness"),
        ("opsd_beta=0.5", "did you mean BETA? keys are upper case"),
        ("learning_rate=1e-5", "did you mean LEARNING_RATE? keys are upper case"),
        ("bf16=false", "BF16 is the key, and it is not tunable in recipe.env"),
        ("MAX_STEP=200", "did you mean MAX_STEPS? it is fixed by the capped harness"),
        ("LERNING_RATE=1e-5", "did you mean LEARNING_RATE?"),
    ],
)
def test_recipe_hints_name_the_field_meant(tmp_path, line, expected):
    recipe = tmp_path / "recipe.env"
    recipe.write_text(line + "\n")
    with pytest.raises(RecipeError) as info:
        parse_recipe(recipe)
    assert expected in str(info.value)
    assert "WARMUP_STEPS" not in str(info.value) and "ADAM_BETA2" not in str(info.value)


def test_edit_distance():
    from opsd.errors import closest, edit_distance

    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("lerning_rate", "learning_rate") == 1
    assert edit_distance("leanring_rate", "learning_rate") == 1  # a transposition is one edit
    assert closest("max_steps", ["warmup_steps", "max_steps"]) == "max_steps"
    assert closest("zzz", ["learning_rate"]) is None
    assert closest("zzz", ["learning_rate"], any_distance=True) == "learning_rate"


def test_help_starts_with_the_entry_flags_and_opsd_fields(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import ENV

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run(
        [sys.executable, str(root / "opsd_train.py"), "--help"],
        cwd=tmp_path, env={**ENV, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    head = res.stdout.split("Every TRL/transformers training argument")[0].splitlines()  # OPSD's part, first
    text = "\n".join(head)
    assert head[0].startswith("usage: python opsd_train.py")
    for flag in ("--config FILE", "--recipe FILE", "--dry-run", "--debug", "--allow-config-change"):
        assert f"  {flag}" in text, flag
    for field in ("--beta", "--clip_mode", "--teacher_mode", "--top_p"):
        assert any(line.startswith(f"  {field} ") for line in head), field
    assert "must be in (0, 1]" in text and "one of element|token|rescale|none" in text
    assert "--adam_beta1" in res.stdout  # the inherited arguments follow


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--learnin_rate", "1e-5"], "--learnin_rate: did you mean --learning_rate?"),
        (
            ["--warmup_ratio", "0.1"],
            "--warmup_ratio: transformers 5 removed it; use --warmup_steps with the same value",
        ),
        (
            ["--eval_strategy", "steps"],
            "eval_strategy='steps' needs an evaluation set, and OPSD trains on none",
        ),
    ],
)
def test_cli_mistakes_get_the_hint(args, message, tmp_path):
    from opsd.launch.command_line import parse_config

    with pytest.raises(InvalidValue) as info:
        parse_config(["--output_dir", str(tmp_path), *args], environ={})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_harness_passes_allow_config_change_to_training(tmp_path, monkeypatch, capsys):
    from opsd.launch import capped

    for key in [k for k in __import__("os").environ if k.startswith("OPSD_") and k != "OPSD_CACHE_DIR"]:
        monkeypatch.delenv(key)
    argv = ["--dry-run", "--profile", "smoke", "--runs-dir", str(tmp_path), "--name", "x"]
    assert capped.main(argv) == 0
    assert "--allow-config-change" not in json.loads(capsys.readouterr().out)["command"]
    assert capped.main([*argv, "--allow-config-change"]) == 0
    assert json.loads(capsys.readouterr().out)["command"][-1] == "--allow-config-change"


def test_max_prompt_length_is_ignored_with_a_note(tmp_path, caplog):
    """TRL's SDFTTrainer would cut prompts from the left at max_prompt_length; OPSD renders its own prompts
    and never cuts one, so a recipe's value is named as ignored instead of passing silently."""
    import logging

    from opsd.launch.command_line import parse_config

    with caplog.at_level(logging.WARNING, logger="opsd.configuration.checks"):
        cfg, _ = parse_config(["--output_dir", str(tmp_path), "--max_prompt_length", "512"], environ={})
    assert cfg.max_prompt_length == 512
    assert "max_prompt_length=512 is ignored" in caplog.text and "max_teacher_prompt_length" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="opsd.configuration.checks"):
        parse_config(["--output_dir", str(tmp_path)], environ={})
    assert "max_prompt_length" not in caplog.text
