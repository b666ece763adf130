"""Shared fixtures: a tiny Qwen3 with a locally trained tokenizer, built once per test session."""

import os

# Set before vLLM or the hub client is imported anywhere in the session.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402

ENV = {
    k: os.environ[k]
    for k in (
        "HF_HUB_OFFLINE",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "TRL_EXPERIMENTAL_SILENCE",
    )
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from opsd.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def vllm_tiny(tiny_model_dir):
    """One real vLLM engine on the tiny model, shared by the engine tests."""
    from opsd.rollout import VLLMEngine

    return VLLMEngine(str(tiny_model_dir), max_model_len=512, dtype="float32")


def make_trainer(model_dir, out_dir, *, use_peft: bool = True, **overrides):
    """An OPSDTrainer on the tiny model with transformers rollouts: 2 problems per step, LoRA r4 on q/v."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.config import OPSDConfig
    from opsd_train import build_dataset
    from opsd_trainer import OPSDTrainer

    settings = dict(
        output_dir=str(out_dir), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_completion_length=8, use_vllm=False, learning_rate=5e-2, save_strategy="no",
        gradient_checkpointing=False,
    )  # fmt: skip
    cfg = OPSDConfig(**{**settings, **overrides})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = (
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=cfg.lora_dropout,
            target_modules=["q_proj", "v_proj"],
            task_type="CAUSAL_LM",
        )  # fmt: skip
        if use_peft
        else None
    )
    return OPSDTrainer(
        model=model, args=cfg, train_dataset=build_dataset(cfg),
        processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=peft,
    )  # fmt: skip
