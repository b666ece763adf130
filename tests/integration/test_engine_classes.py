"""The trainer's model against vLLM's real compile decorator (what its Transformers backend applies in place to a
transformers decoder class): opsd.method.engine_classes keeps the model's forward and hooks, and the hidden-state
capture refuses loudly when its hook did not run. The decorator is applied to a throwaway subclass, so the real
Qwen3 classes other tests use stay untouched."""

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
