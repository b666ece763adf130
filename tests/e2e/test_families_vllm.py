"""opsd_train.py with its default rollout engine (colocated vLLM, the CPU build here) on the architecture families of
`opsd.testing.families`: two optimizer steps where this vLLM runs the family, one line naming engine, version,
family and the engine that works where it does not.

One family per engine path: olmo3 goes through vLLM 0.32's Transformers backend, which decorates the transformers
decoder class in place when the engine starts (without `opsd.method.engine_classes` the trainer's own model of
that class then fails: 'Olmo3Model' object has no attribute 'do_not_compile'; smollm3 takes the same path);
gemma3 native with sliding windows and a soft-cap; lfm2 native with short convolutions; granitemoehybrid native
with Mamba layers (as nemotron_h), MoE weights that transformers renames on load, and logits divided by 8. The
CPU build cannot import its Qwen3.5 module (it needs torchvision), so qwen3_5 gets the one line. Every family
with the transformers engine, in process: tests/integration/test_families_training.py; every family on vLLM
0.26 at its released shape: bench/families_gpu.py (docs/families.md).
"""

from __future__ import annotations

import json

import pytest

from opsd.testing.families import build_family
from opsd.testing.tiny import build_tokenizer
from tests.e2e.test_train_cli import run_train

pytest.importorskip("vllm")

VLLM_FAMILIES = ("olmo3", "gemma3", "lfm2", "granitemoehybrid")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-families")
    tok = build_tokenizer(root / "tokenizer")
    return {name: build_family(name, root / name, tokenizer=tok) for name in (*VLLM_FAMILIES, "qwen3_5")}


def _args(model_dir, out):
    return [
        "--model_name_or_path", str(model_dir), "--output_dir", str(out), "--max_steps", "2",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
        "--max_completion_length", "8", "--lora_r", "4", "--lora_alpha", "8", "--save_strategy", "no",
        "--vllm_max_model_length", "512", "--gradient_checkpointing", "false", "--rollout_engine", "vllm",
    ]  # fmt: skip


@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_two_steps_with_colocated_vllm(family, family_dirs, tmp_path):
    out = tmp_path / "run"
    proc = run_train(_args(family_dirs[family], out), tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "loss" in r]
    assert len(losses) == 2 and all(abs(v) < 1e6 for v in losses), steps
    assert (out / "checkpoint-2" / "adapter_model.safetensors").is_file()
    assert "logit transform after the lm_head, checked against the model's logits" in proc.stderr
    if family == "granitemoehybrid":  # vLLM samples from logits / 8; the loss must use the same distribution
        assert "checked against the model's logits: scaled by 0.125" in proc.stderr


def test_a_family_this_vllm_cannot_start_is_one_line(family_dirs, tmp_path):
    proc = run_train(_args(family_dirs["qwen3_5"], tmp_path / "run"), tmp_path, timeout=600)
    assert proc.returncode == 2, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("opsd_train.py: error: the colocated vLLM ") and "Traceback" not in proc.stderr
    assert "model type 'qwen3_5_text'" in last and "--rollout_engine transformers" in last
