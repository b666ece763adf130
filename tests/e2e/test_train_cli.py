"""opsd_train.py as users run it: subprocesses on the tiny model (vLLM and fallback), the embedded model,
configuration precedence and refusals; teacher modes in-process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ENV, free_port, in_process, make_trainer

ROOT = Path(__file__).resolve().parents[2]


def run_train(args, tmp_path, extra_env=None, timeout=900, *, own_process=True):
    """`python opsd_train.py ARGS` in `tmp_path`; a refusal before any model loads can run in this process
    (`own_process=False`, `tests.conftest.in_process`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPSD_")}
    env.update(ENV, OPSD_CACHE_DIR=os.environ.get("OPSD_CACHE_DIR", str(Path.home() / ".cache" / "opsd")))
    env["MASTER_PORT"] = str(free_port())
    env.update(extra_env or {})
    if not own_process:
        return in_process("opsd_train.py", args, env=env, cwd=tmp_path)
    return subprocess.run(
        [sys.executable, str(ROOT / "opsd_train.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def short_run_args(out, *extra, **flags) -> list[str]:
    """The flags of a short run writing to `out` (2 steps of 2 problems, no gradient checkpointing, 1,024
    positions for the engine) and `flags`, as `--name value` pairs, then `extra` (later flags win)."""
    flags = dict(
        output_dir=out,
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_checkpointing="false",
        vllm_max_model_length=1024,
        **flags,
    )
    return [*(arg for name, value in flags.items() for arg in (f"--{name}", str(value))), *extra]


def tiny_args(model_dir, out, *extra):
    return short_run_args(
        out,
        "--model_name_or_path",
        str(model_dir),
        *extra,
        gradient_accumulation_steps=2,
        max_completion_length=12,
        lora_r=8,
        lora_alpha=16,
        save_steps=1,
    )


def check_run(out, steps):
    ckpt = out / f"checkpoint-{steps}"
    assert (ckpt / ".complete").is_file() and (ckpt / "adapter_model.safetensors").is_file()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in train)
    assert {"opsd/divergence", "opsd/clipped_frac", "opsd/top1_agree", "rollout/tokens_per_s"} <= set(
        train[0]
    )
    cfg = json.loads((out / "opsd_config.json").read_text())
    # Reproduction details: the versions the run used and the revision of this checkout.
    assert cfg["provenance"]["versions"]["torch"] == torch.__version__
    assert cfg["provenance"]["versions"]["trl"] and "commit" in cfg["provenance"]["git"]
    return cfg, ckpt


def test_cli_vllm_lora_run_with_env_override_and_reload(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    res = run_train(
        tiny_args(tiny_model_dir, out, "--beta", "0.5"),
        tmp_path,
        {"OPSD_BETA": "1.0", "OPSD_CLIP_MODE": "token"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    cfg, ckpt = check_run(out, 2)
    # env beats the CLI flag; the engine actually used is recorded
    assert cfg["beta"] == 1.0 and cfg["clip_mode"] == "token" and cfg["use_vllm"] is True
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tuned = PeftModel.from_pretrained(base, str(ckpt))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        with tuned.disable_adapter():
            before = tuned(ids).logits
        after = tuned(ids).logits
    assert torch.isfinite(after).all() and not torch.equal(before, after)


def test_cli_transformers_fallback(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    res = run_train(
        tiny_args(tiny_model_dir, out, "--rollout_engine", "transformers", "--max_steps", "1"), tmp_path
    )
    assert res.returncode == 0, res.stderr[-3000:]
    cfg, _ = check_run(out, 1)
    assert cfg["use_vllm"] is False


@pytest.mark.slow
def test_cli_embedded_model_two_steps(embedded_cache_dir, tmp_path):
    out = tmp_path / "run"
    res = run_train(
        short_run_args(out, gradient_accumulation_steps=1, max_completion_length=16, save_steps=2),
        tmp_path,
        {"OPSD_CACHE_DIR": str(embedded_cache_dir)},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    cfg, _ = check_run(out, 2)
    assert cfg["resolved_model_path"] == str(embedded_cache_dir / "smollm2-135m-instruct")
    # Its rollouts are graded every step, and the run's curves draw the grades.
    from opsd.run.curves import read_metrics, training_curves

    metrics = read_metrics(out)
    assert [s for s, _ in metrics["rollout/correct"]] == [1, 2]
    assert all(0.0 <= v <= 1.0 for _, v in metrics["rollout/boxed"])
    titles = training_curves({"run": metrics}, tmp_path / "c.png")
    assert "rollout correctness (graded like the evaluation)" in titles
    # The engine's log-probs of the sampled tokens against the trainer's, every step (float32 on both sides).
    assert [s for s, _ in metrics["rollout/logprob_gap/mean"]] == [1, 2]
    assert all(v < 1e-4 for _, v in metrics["rollout/logprob_gap/max"])
    assert "|log p engine - log p trainer|, sampled tokens" in titles


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        ([], {"OPSD_BETAA": "0.5"}, "OPSD_BETAA"),
        (["--beta", "1.5"], {}, "beta=1.5 is out of range"),
        (["--clip_mode", "elementwise"], {}, "invalid choice: 'elementwise'"),
        (["--model_name_or_path", "./no/such/model"], {}, "not a model directory"),
        (["--dataset_name", "missing.jsonl"], {}, "does not exist"),
    ],
)
def test_cli_refuses_bad_input_before_loading(tmp_path, args, env, message):
    res = run_train(["--output_dir", str(tmp_path / "o"), *args], tmp_path, env, own_process=False)
    assert res.returncode != 0 and message in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_bad_recipe_line_is_named(tmp_path):
    recipe = tmp_path / "recipe.env"
    recipe.write_text("LEARNING_RATE=1e-5\nMAX_STEPS=5\n")
    res = run_train(
        ["--output_dir", str(tmp_path / "o"), "--recipe", str(recipe)], tmp_path, own_process=False
    )
    assert res.returncode != 0 and "recipe.env:2" in res.stderr


def test_precedence_defaults_yaml_cli_recipe_env(tmp_path):
    from opsd.launch.command_line import parse_config

    yaml = tmp_path / "c.yaml"
    yaml.write_text("beta: 0.1\ntemperature: 0.9\ntop_k_loss: 3\nwavg_last: 2\n")
    recipe = tmp_path / "recipe.env"
    recipe.write_text("TEMPERATURE=0.8\nTOP_K_LOSS=4\n")
    argv = [
        "--config",
        str(yaml),
        "--output_dir",
        str(tmp_path),
        "--temperature",
        "0.95",
        "--top_k_loss",
        "5",
        "--wavg_last",
        "3",
        "--recipe",
        str(recipe),
    ]
    cfg, _ = parse_config(argv, environ={"OPSD_TOP_K_LOSS": "6"})
    assert cfg.beta == 0.1  # YAML over default
    assert cfg.wavg_last == 3  # CLI over YAML
    assert cfg.temperature == 0.8  # recipe over CLI
    assert cfg.top_k_loss == 6  # env over recipe
    assert cfg.learning_rate == 5e-6 and cfg.divergence_clip == 0.05  # published defaults


def test_older_name_jsd_token_clip_is_read_as_divergence_clip(tmp_path, caplog):
    """divergence_clip was called jsd_token_clip: every source still takes the older name, reads it as the
    canonical one with a note that names it, and refuses both names at once."""
    import logging

    from opsd.configuration.sources import RecipeError
    from opsd.configuration.switches import ALIASES
    from opsd.errors import InvalidValue
    from opsd.launch.command_line import parse_config

    assert ALIASES == {"jsd_token_clip": "divergence_clip"}
    out = ["--output_dir", str(tmp_path)]
    yaml = tmp_path / "c.yaml"
    yaml.write_text("jsd_token_clip: 0.2\n")
    recipe = tmp_path / "recipe.env"
    recipe.write_text("JSD_TOKEN_CLIP=0.3\n")
    routes = {
        "flag": ([*out, "--jsd_token_clip", "0.1"], {}, 0.1),
        "flag=": ([*out, "--jsd_token_clip=0.15"], {}, 0.15),
        "yaml": (["--config", str(yaml), *out], {}, 0.2),
        "recipe": ([*out, "--recipe", str(recipe)], {}, 0.3),
        "env": (out, {"OPSD_JSD_TOKEN_CLIP": "0.4"}, 0.4),
    }
    for route, (argv, environ, expected) in routes.items():
        caplog.clear()
        with caplog.at_level(logging.INFO):
            cfg, _ = parse_config(argv, environ=environ)
        assert cfg.divergence_clip == expected, route
        assert not hasattr(cfg, "jsd_token_clip")
        assert "jsd_token_clip is the older name of divergence_clip, the canonical name" in caplog.text, route
    both = tmp_path / "both.yaml"
    both.write_text("jsd_token_clip: 0.2\ndivergence_clip: 0.1\n")
    with pytest.raises(InvalidValue, match="keep only divergence_clip"):
        parse_config(["--config", str(both), *out], environ={})
    recipe.write_text("JSD_TOKEN_CLIP=0.3\nDIVERGENCE_CLIP=0.2\n")
    with pytest.raises(
        RecipeError, match="JSD_TOKEN_CLIP .line 1. and DIVERGENCE_CLIP .line 2. both set DIVERGENCE_CLIP"
    ):
        parse_config([*out, "--recipe", str(recipe)], environ={})


def test_every_shipped_config_loads(tmp_path):
    from opsd.launch.command_line import parse_config

    configs = sorted((ROOT / "configs").rglob("*.yaml"))
    assert configs
    for path in configs:
        text = path.read_text()
        assert text.startswith("#") and ("opsd_train.py" in text or "accelerate" in text), (
            f"{path}: no header"
        )
        if "compute_environment" in text:  # an accelerate launcher config
            from accelerate.commands.config.config_args import load_config_from_file

            load_config_from_file(str(path))
        else:
            cfg, _ = parse_config(["--config", str(path), "--output_dir", str(tmp_path)], environ={})
            assert cfg.max_steps > 0


# -- teacher modes and full fine-tuning, in-process with transformers rollouts ---------------------------------


def _trainer(tiny_model_dir, tmp_path, **overrides):
    return make_trainer(tiny_model_dir, tmp_path, **overrides)


def test_ema_teacher_follows_hand_computed_average(tiny_model_dir, tmp_path):
    from transformers import TrainerCallback

    trainer = _trainer(tiny_model_dir, tmp_path, teacher_mode="ema", ema_decay=0.75)
    student = {n: p for n, p in trainer.model.named_parameters() if ".default." in n and "lora_" in n}
    expected = {n: p.detach().clone() for n, p in student.items()}  # teacher starts as the initial student

    class Track(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            for n, p in student.items():
                expected[n] = 0.75 * expected[n] + 0.25 * p.detach()

    trainer.callback_handler.callbacks.insert(0, Track())
    trainer.train()
    teacher = dict(trainer.model.named_parameters())
    for n, value in expected.items():
        torch.testing.assert_close(teacher[n.replace(".default.", ".teacher.")], value, atol=1e-6, rtol=1e-5)
    assert any(
        not torch.allclose(teacher[n.replace(".default.", ".teacher.")], p) for n, p in student.items()
    )


def test_dynamic_teacher_is_the_current_student(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, teacher_mode="dynamic")
    trainer.train()
    assert trainer.teacher_model is trainer.model


def test_full_finetuning_fixed_teacher_is_a_frozen_copy(tiny_model_dir, tmp_path):
    trainer = _trainer(tiny_model_dir, tmp_path, use_peft=False)
    initial = {n: p.detach().clone() for n, p in trainer.teacher_model.named_parameters()}
    trainer.train()
    assert trainer.teacher_model is not trainer.model
    assert all(torch.equal(p, initial[n]) for n, p in trainer.teacher_model.named_parameters())
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, initial[n])]
    assert moved, "full fine-tuning changed no weight"


def test_shipped_recipes_parse_and_match_the_spec():
    from opsd.configuration.sources import parse_recipe

    recipes = {p.name: p for p in (ROOT / "configs" / "recipes").glob("*.env")}
    assert {"published.env", "improved.env"} <= set(recipes)
    for path in [ROOT / "recipe.env", *recipes.values()]:
        text = path.read_text()
        assert text.startswith("#") and "train_capped.sh" in text, f"{path}: no header with its command"
    values = {p.name: {o.field: o.value for o in parse_recipe(p)} for p in recipes.values()}
    shipped = {o.field: o.value for o in parse_recipe(ROOT / "recipe.env")}
    improved = {"data_filter": "hard_numeric", "learning_rate": "1e-05", "lr_scheduler_type": "linear"}
    assert values["improved.env"] == improved and shipped == improved
    # every value of the published recipe equals the config default (the paper's recipe is the default),
    # except the positions: it scores the reference code's rows, the default scores the engine's
    from opsd.configuration.config import OPSDConfig

    defaults = OPSDConfig(output_dir="/tmp/unused")
    assert defaults.fix_position_ids is True and values["published.env"].pop("fix_position_ids") == "false"
    for field, value in values["published.env"].items():
        default = getattr(defaults, field)
        default = getattr(default, "value", default)
        assert str(default).lower() == value.lower() or float(default) == float(value), field
