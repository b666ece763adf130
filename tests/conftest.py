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
