"""The trainer's model against vLLM's real compile decorator (what its Transformers backend applies in place to a
transformers decoder class): opsd.method.engine_classes keeps the model's forward and hooks, and the hidden-state
capture refuses loudly when its hook did not run. The decorator is applied to a throwaway subclass, so the real
Qwen3 classes other tests use stay untouched. Then an engine start that fails: one line, the engine's own output
kept in the run directory and off both streams (shown under --debug), and replayed when the engine starts."""

from __future__ import annotations

import pytest
import torch

from opsd.method.engine_classes import OWN_CLASS_FLAG, own_classes
from opsd.method.hidden import completion_hidden, left_pad, right_pad

pytest.importorskip("vllm")


def _decorate(cls):
    from vllm.compilation.decorators import support_torch_compile

    support_torch_compile(dynamic_arg_dims={"input_ids": 1, "position_ids": -1})(cls)


@pytest.fixture
def model_and_throwaway(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    decoder_cls = type(model.model)
    throwaway = type(decoder_cls.__name__, (decoder_cls,), {"__module__": decoder_cls.__module__})
    model.model.__class__ = throwaway
    return model, throwaway


def _hidden(model):
    p_ids, p_mask = left_pad([[5, 6, 7, 8], [9, 10]], 0, "cpu")
    c_ids, c_mask = right_pad([[11, 12, 13], [14]], 0, "cpu")
    with torch.no_grad():
        return completion_hidden(model, p_ids, p_mask, c_ids, c_mask, fix_positions=True, pad_token_id=0)


def test_a_decorated_decoder_without_hooks_is_refused_in_one_line(model_and_throwaway):
    model, throwaway = model_and_throwaway
    _decorate(throwaway)
    with pytest.raises(AttributeError, match="do_not_compile"):  # vLLM's own failure on an older instance
        _hidden(model)
    model.model.do_not_compile = True  # past that, its __call__ runs forward directly: no hooks
    with pytest.raises(RuntimeError, match="did not run its decoder's module hooks"):
        _hidden(model)


@pytest.mark.parametrize("when", ["before", "after"])
def test_own_classes_keep_forward_and_hooks_through_the_decorator(model_and_throwaway, when):
    model, throwaway = model_and_throwaway
    want = _hidden(model)
    if when == "before":  # the trainer's model, before the engine starts
        assert own_classes(model) == 2  # the causal LM and its decoder
        _decorate(throwaway)
    else:  # a model moved after the engine decorated its class (the trainer's teacher)
        _decorate(throwaway)
        own_classes(model)
    assert isinstance(model.model, throwaway) and type(model.model) is not throwaway
    assert type(model.model).__name__ == throwaway.__name__ and type(model.model).__dict__[OWN_CLASS_FLAG]
    torch.testing.assert_close(_hidden(model), want, atol=0, rtol=0)
    assert own_classes(model) == 0  # idempotent


# -- engine start-up failures -------------------------------------------------------------------------------
# Stands in for vLLM's code: its file sits under a `vllm/` folder, which is how a failure is told to be vLLM's.
# It writes to the file descriptors directly, as vLLM's logger (its stream was bound to the process's stdout when
# it was configured), its C++ code and progress bars do.
FAKE_ENGINE = """
import os

def start(fail):
    os.write(1, b"INFO 12-05 [core.py:133] Initializing a V1 LLM engine\\n")
    os.write(2, b"Loading safetensors checkpoint shards: 100%\\n")
    if fail:
        os.write(1, b"(MainProcess) ERROR [registry.py:1120] Error in inspecting model architecture\\n"
                    b"(MainProcess) ERROR [registry.py:1120] Traceback (most recent call last):\\n"
                    b"(MainProcess) ERROR [registry.py:1120]   File \\"vllm/model_executor/models/qwen3_5.py\\", line 88\\n"
                    b"(MainProcess) ERROR [registry.py:1120] ModuleNotFoundError: No module named 'torchvision'\\n")
        raise ValueError("Model architectures ['Qwen3_5ForConditionalGeneration'] failed to be inspected.")


class Engine:  # a started engine whose kernel refuses the model on the calls in `fail_on`
    def __init__(self, hf_config, fail_on):
        self.llm_engine = type("LLMEngine", (), {})()
        self.llm_engine.model_config = type("ModelConfig", (), {"hf_config": hf_config})()
        self.fail_on, self.calls = fail_on, 0

    def generate(self, prompts, sampling_params=None, **kwargs):
        self.calls += 1
        if self.calls in self.fail_on:
            raise ValueError("Head dimension 48 is not supported by MLA.")
        return ["completion"] * len(prompts)
"""


@pytest.fixture
def fake_engine(tmp_path):
    import importlib.util
    import json
    from types import SimpleNamespace

    folder = tmp_path / "vllm"
    folder.mkdir()
    (folder / "fake_engine.py").write_text(FAKE_ENGINE)
    spec = importlib.util.spec_from_file_location("fake_vllm_engine", folder / "fake_engine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    declared = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"]}
    (checkpoint / "config.json").write_text(json.dumps(declared))
    # the text model a multimodal Qwen3.5 checkpoint loads as
    model = SimpleNamespace(config=SimpleNamespace(model_type="qwen3_5_text", _name_or_path=str(checkpoint)))
    return SimpleNamespace(start=module.start, Engine=module.Engine, model=model)


def test_a_failed_start_is_one_line_and_its_output_kept_off_both_streams(
    fake_engine, tmp_path, capfd, monkeypatch
):
    from opsd.errors import DEBUG_ENV, UnsupportedModel
    from opsd.method.engine_classes import engine_start_refusal

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    start, model = fake_engine.start, fake_engine.model
    run = tmp_path / "run"
    with pytest.raises(UnsupportedModel) as refused, engine_start_refusal(True, model, run):
        start(fail=True)
    line = str(refused.value)
    assert "\n" not in line
    assert "for Qwen3_5ForConditionalGeneration (model type 'qwen3_5', loaded as 'qwen3_5_text')" in line
    assert "(vllm.model_executor.models.qwen3_5) imports 'torchvision', which is not installed here" in line
    assert "--rollout_engine transformers" in line and line.endswith(f"{run / 'vllm_engine_start.log'}")
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Initializing" not in out and "checkpoint shards" not in err
    assert [p.name for p in run.iterdir()] == ["vllm_engine_start.log"]
    log = (run / "vllm_engine_start.log").read_text()
    assert "ModuleNotFoundError: No module named 'torchvision'" in log and "checkpoint shards" in log
    assert "ValueError: Model architectures" in log  # and the error itself, with its traceback

    monkeypatch.setenv(DEBUG_ENV, "1")  # --debug: the engine's own output is shown as well
    with pytest.raises(UnsupportedModel), engine_start_refusal(True, model, run):
        start(fail=True)
    out, err = capfd.readouterr()
    assert "Traceback (most recent call last)" in out and "checkpoint shards" in err


def test_a_started_engine_shows_its_output_and_other_errors_keep_theirs(fake_engine, tmp_path, capfd):
    from opsd.method.engine_classes import engine_start_refusal

    start, model = fake_engine.start, fake_engine.model
    with engine_start_refusal(True, model, tmp_path / "run"):
        start(fail=False)
    out, err = capfd.readouterr()
    assert "Initializing a V1 LLM engine" in out and "checkpoint shards" in err  # replayed on its own stream
    assert not (tmp_path / "run" / "vllm_engine_start.log").exists()
    assert list((tmp_path / "run").iterdir()) == []  # the capture's folder is gone too
    with (
        pytest.raises(KeyError, match="not the engine's"),
        engine_start_refusal(True, model, tmp_path / "run"),
    ):
        start(fail=False)
        raise KeyError("not the engine's")
    assert "Initializing a V1 LLM engine" in capfd.readouterr().out


def test_a_kernel_refusing_the_model_on_the_first_generation_is_one_line(fake_engine):
    """vLLM checks some kernels' shapes only when they first run (its CPU MLA kernel takes one latent size): the
    first generation's failure is one line too; later failures are not a refusal of the model and keep theirs."""
    from opsd.errors import UnsupportedModel
    from opsd.method.engine import SeededLLM

    config = fake_engine.model.config
    with pytest.raises(UnsupportedModel) as refused:
        SeededLLM(fake_engine.Engine(config, fail_on={1}), lambda n: [0] * n).generate(["prompt"])
    line = str(refused.value)
    assert "failed on its first generation for Qwen3_5ForConditionalGeneration (model type 'qwen3_5'" in line
    assert (
        "ValueError: Head dimension 48 is not supported by MLA; train with --rollout_engine transformers"
        in line
    )

    later = SeededLLM(fake_engine.Engine(config, fail_on={2}), lambda n: [0] * n)
    assert later.generate(["prompt"]) == ["completion"]
    with pytest.raises(ValueError, match="Head dimension 48"):
        later.generate(["prompt"])
