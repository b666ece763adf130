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


def push(fail):  # a weight push: vLLM's logger reports it, a progress bar opens, and it may fail
    from tqdm import tqdm

    os.write(1, b"INFO 12-05 [inplace.py:101] Reloading weights inplace...\\n")
    bar = tqdm(total=2, desc="Reloading shards", file=open(2, "w", closefd=False))  # sys.stderr in a process
    bar.update(1)
    if fail:
        raise RuntimeError("The size of tensor a (0) must match the size of tensor b (512) at non-singleton dimension 1")
    bar.close()


def load_router():  # vLLM's DeepSeek-V3 with the router its config.json declares none of
    raise KeyError("layers.1.mlp.gate.e_score_correction_bias")


def pack_mla(features):  # vLLM's AMX MLA kernel packing W_UK (qk_nope_head_dim input features)
    if features % 32:
        raise RuntimeError(f"invalid weight input features {features}")


def mla_metadata(head_dim):  # vLLM's MLA metadata checking kv_lora_rank + qk_rope_head_dim
    raise ValueError(f"Head dimension {head_dim} is not supported by MLA.")


def long_failure(words):  # a library message of many long identifiers
    raise RuntimeError(" ".join(words))
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
    return SimpleNamespace(module=module, start=module.start, model=model, checkpoint=checkpoint)


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


def test_a_failure_of_the_started_engine_is_one_line_with_its_log_kept(
    fake_engine, tmp_path, capfd, monkeypatch
):
    """After start-up (a weight push, a generation): one line naming what failed, the traceback kept in
    vllm_engine_error.log, and no traceback on either stream. Nothing is captured: vLLM's lines about the push reach
    the streams as it writes them, and so does whatever else the process writes meanwhile; the progress bars open
    when it fails (the trainer's, the one vLLM left open) are closed before the line, so that it starts a line and
    nothing of a bar follows it."""
    from tqdm import tqdm

    from opsd.errors import DEBUG_ENV, UnsupportedModel
    from opsd.method.engine_classes import engine_failure

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    run = tmp_path / "run"
    trainer_bar = tqdm(total=2, desc="trainer steps", file=open(2, "w", closefd=False))
    with (
        pytest.raises(UnsupportedModel) as refused,
        engine_failure(fake_engine.model, run, failed="on a weight push"),
    ):
        print("a line of the grader's", flush=True)
        assert "a line of the grader's" in capfd.readouterr().out  # written through, not held back
        fake_engine.module.push(fail=True)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("the colocated vLLM ") and " engine failed on a weight push for " in line
    assert "RuntimeError: The size of tensor a (0) must match the size of tensor b (512)" in line
    assert line.endswith(f"its traceback: {run / 'vllm_engine_error.log'}")
    assert trainer_bar.disable  # closed
    import gc

    out, err = capfd.readouterr()
    assert "Reloading weights inplace" in out and "Reloading shards" in err  # as vLLM wrote them
    # The error's frames, and the bar vLLM left open in them, are freed: closed already, the bar draws nothing.
    del refused
    gc.collect()
    out, err = capfd.readouterr()
    assert (out + err).strip() == ""
    log = (run / "vllm_engine_error.log").read_text()
    assert "Traceback" in log and "The size of tensor a (0)" in log

    # a push that succeeds: its output is where vLLM wrote it, and no log is written
    with engine_failure(fake_engine.model, tmp_path / "other", failed="on a generation"):
        fake_engine.module.push(fail=False)
        out, err = capfd.readouterr()
        assert "Reloading weights inplace" in out and "Reloading shards" in err
    assert not (tmp_path / "other").exists()
    # an error that is not the engine's keeps its traceback
    with (
        pytest.raises(KeyError),
        engine_failure(fake_engine.model, tmp_path / "other", failed="on a generation"),
    ):
        raise KeyError("not the engine's")
    assert not (tmp_path / "other").exists()


def test_refusals_name_the_router_fields_and_the_kernel(fake_engine, tmp_path):
    """A DeepSeek-V3 config.json without the router fields vLLM reads (one line naming them, and the fix), and
    vLLM's AMX MLA kernel refusing a head dimension (naming the kernel and the dimension)."""
    import json
    from types import SimpleNamespace

    from opsd.errors import UnsupportedModel
    from opsd.method.engine_classes import engine_start_refusal

    declared = {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "qk_nope_head_dim": 16,
    }
    (fake_engine.checkpoint / "config.json").write_text(json.dumps(declared))
    config = SimpleNamespace(
        model_type="deepseek_v3", _name_or_path=str(fake_engine.checkpoint), qk_nope_head_dim=16
    )
    model = SimpleNamespace(config=config)
    with pytest.raises(UnsupportedModel) as refused, engine_start_refusal(True, model, tmp_path / "run"):
        fake_engine.module.load_router()
    line = str(refused.value)
    assert "its config.json has no topk_method or scoring_func, so vLLM built another router" in line
    assert 'add "topk_method": "noaux_tc", "scoring_func": "sigmoid" to config.json' in line
    assert "--rollout_engine" not in line
    with pytest.raises(UnsupportedModel) as refused, engine_start_refusal(True, model, tmp_path / "run"):
        fake_engine.module.pack_mla(16)
    line = str(refused.value)
    assert "vLLM's AMX MLA kernel (AMX_MLA, picked on a CPU with AMX)" in line
    assert "refuses qk_nope_head_dim 16" in line and "--rollout_engine transformers" in line


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_starts_at_the_trainers_dtype(tiny_model_dir, dtype):
    """The colocated engine's arguments (`engine_arguments`): the dtype of the trainer's own weights, a LoRA
    student's float32 adapters on a bfloat16 base notwithstanding (TRL gives vLLM none, and its CPU backend would
    run bfloat16); CPU_MLA only for a model with multi-head latent attention."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    from opsd.method.engine import engine_arguments
    from opsd.method.engine_env import cpu_mla_backend

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype)
    student = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    assert any(p.dtype == torch.float32 for n, p in student.named_parameters() if "lora_" in n)
    assert engine_arguments(student) == {"dtype": str(dtype).removeprefix("torch.")}
    assert cpu_mla_backend(DeepseekV3Config(kv_lora_rank=512)) == {"attention_backend": "CPU_MLA"}
    assert cpu_mla_backend(model.config) == {}


def test_the_evaluation_engine_routes_mla_to_cpu_mla_as_training_does(tmp_path, monkeypatch):
    """eval_aime.py's vLLM engine (`VLLMEngine`, every evaluation, sweep and benchmark builds it) starts a
    DeepSeek-V3 checkpoint on CPU_MLA, as training's does, also as on a CPU with AMX (torch's AMX probe answering
    yes, as tests/e2e/test_families_push.py simulates it), where vLLM's own choice, AMX_MLA, refuses the tiny
    layout; another model gets no backend. vLLM's `LLM` is replaced by a recorder: no engine starts."""
    import vllm
    from transformers import DeepseekV3Config, Qwen3Config

    from opsd.evaluation.sampling import VLLMEngine

    class Recorder:
        def __init__(self, **kwargs):
            started.append(kwargs)

        def get_tokenizer(self):
            return None

    started: list[dict] = []
    monkeypatch.setattr(vllm, "LLM", Recorder)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    mla, plain = tmp_path / "deepseek_v3", tmp_path / "qwen3"
    DeepseekV3Config(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16).save_pretrained(mla)
    Qwen3Config().save_pretrained(plain)
    VLLMEngine(str(mla), max_model_len=512, seed=3)
    VLLMEngine(str(plain), max_model_len=512)
    from vllm.platforms import current_platform

    on_cpu = current_platform.is_cpu()  # on a GPU vLLM's own MLA backends run
    assert started[0].get("attention_backend") == ("CPU_MLA" if on_cpu else None) and started[0][
        "model"
    ] == str(mla)
    assert started[0]["dtype"] == ("float32" if on_cpu else "auto") and started[0]["seed"] == 3
    assert "attention_backend" not in started[1]
    from opsd.evaluation.sampling import llm_arguments

    assert llm_arguments(str(tmp_path / "no-such-model")).get("attention_backend") is None  # vLLM decides


def _deepseek(fake_engine, **dims):
    """A DeepSeek-V3 model (its config: `dims`) as the refusals read it."""
    import json
    from types import SimpleNamespace

    declared = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **dims}
    (fake_engine.checkpoint / "config.json").write_text(json.dumps(declared))
    config = SimpleNamespace(model_type="deepseek_v3", _name_or_path=str(fake_engine.checkpoint), **dims)
    return SimpleNamespace(config=config)


def test_the_amx_push_and_the_mla_head_refusals_name_the_kernel_the_dimension_and_the_fix(
    fake_engine, tmp_path
):
    """A weight push into vLLM's AMX MLA kernel, which freed kv_b_proj once it packed it, names the kernel, the
    dimensions and CPU_MLA (the qwen3_5 stand-in of the test above keeps the generic line); an MLA head dimension
    vLLM does not take names kv_lora_rank + qk_rope_head_dim and the sizes it takes here."""
    from opsd.errors import UnsupportedModel
    from opsd.method.engine_classes import engine_failure

    model = _deepseek(fake_engine, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32)
    with (
        pytest.raises(UnsupportedModel) as refused,
        engine_failure(model, tmp_path / "run", failed="on a weight push"),
    ):
        fake_engine.module.push(fail=True)
    line = str(refused.value)
    assert " failed on a weight push for DeepseekV3ForCausalLM" in line and "\n" not in line
    assert (
        "vLLM's AMX MLA kernel (AMX_MLA, picked on a CPU with AMX) frees kv_b_proj once it has packed it"
        in line
    )
    assert "qk_nope_head_dim 32" in line and "kv_lora_rank 512 input features" in line
    assert 'start vLLM with attention_backend="CPU_MLA"' in line and "--rollout_engine transformers" in line

    model = _deepseek(fake_engine, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16)
    with (
        pytest.raises(UnsupportedModel) as refused,
        engine_failure(model, tmp_path / "run", failed="on a generation"),
    ):
        fake_engine.module.mla_metadata(48)
    line = str(refused.value)
    assert (
        "vLLM's MLA attention here takes a head dimension (kv_lora_rank + qk_rope_head_dim) of 576 only"
        in line
    )
    assert "this model's is 48 = kv_lora_rank 32 + qk_rope_head_dim 16" in line
    assert (
        "give the model a kv_lora_rank + qk_rope_head_dim of 576 (the released DeepSeek-V3's 512 + 64" in line
    )


def test_a_long_cause_is_cut_at_a_word_boundary(fake_engine, tmp_path):
    """A library message past 300 characters is cut after a whole word, never inside an identifier."""
    import re

    from opsd.errors import UnsupportedModel
    from opsd.method.engine_classes import engine_start_refusal

    words = [f"model.layers.{i}.self_attn.q_proj.lora_A.default.weight" for i in range(12)]
    with (
        pytest.raises(UnsupportedModel) as refused,
        engine_start_refusal(True, fake_engine.model, tmp_path / "run"),
    ):
        fake_engine.module.long_failure(words)
    cause = re.search(r"\): RuntimeError: (.+?); train with", str(refused.value)).group(1)
    kept = cause.removesuffix(" [...]").split(" ")
    assert kept == words[: len(kept)] and len(kept) >= 4, cause  # whole identifiers only
    assert cause.endswith(" [...]") and len(cause) <= 300 + len(" [...]")
    from opsd.method.engine_classes import CAUSE_CHARS, clipped

    assert clipped("short message") == "short message"
    # one word longer than the limit: cut at the limit
    assert clipped("x" * 400) == "x" * CAUSE_CHARS + " [...]"


def test_sleep_mode_on_a_cpu_is_refused_with_its_own_fix(fake_engine, tmp_path):
    """vLLM's own validation of sleep mode (its EngineArgs, as the engine's start runs it) on this CPU: the line says
    to drop --vllm_enable_sleep_mode, not the generic fix."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    from opsd.errors import UnsupportedModel
    from opsd.method.engine_classes import engine_start_refusal

    if current_platform.is_sleep_mode_available():
        pytest.skip("vLLM has sleep mode on this platform")
    from transformers import Qwen3Config

    checkpoint = tmp_path / "qwen3"
    Qwen3Config(num_hidden_layers=1, hidden_size=64, intermediate_size=64, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=128).save_pretrained(checkpoint)  # fmt: skip
    with (
        pytest.raises(UnsupportedModel) as refused,
        engine_start_refusal(True, fake_engine.model, tmp_path / "run"),
    ):
        EngineArgs(model=str(checkpoint), enable_sleep_mode=True).create_model_config()
    line = str(refused.value)
    assert "vLLM has no sleep mode on this platform (Sleep mode is not supported on current platform" in line
    assert "drop --vllm_enable_sleep_mode" in line and "--rollout_engine" not in line and "\n" not in line
