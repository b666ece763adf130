"""Tests for opsd.method.hidden (the transform a model applies after its lm_head) and its use by the chunked loss:
against the float64 oracle of test_loss.py, fed logits transformed by hand, and against autograd."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from opsd.errors import UnsupportedModel
from opsd.method import loss
from opsd.method.hidden import IDENTITY, LogitTransform, candidates, resolve_logit_transform
from tests.unit.test_loss import CLIP_MODES, oracle, settings


def by_hand(z: torch.Tensor, scale: float, softcap: float) -> torch.Tensor:
    """The families' own code, written out: Granite divides by logits_scaling, Gemma soft-caps."""
    y = z.double() * scale
    if softcap:
        y = softcap * torch.tanh(y / softcap)
    return y


TRANSFORMS = [(1 / 8, 0.0), (3.0, 0.0), (1.0, 2.0), (0.5, 1.5)]


@pytest.mark.parametrize("scale,softcap", TRANSFORMS)
@pytest.mark.parametrize("clip_mode", CLIP_MODES)
@pytest.mark.parametrize("beta", (0.0, 0.5, 1.0))
def test_chunked_loss_uses_the_transformed_logits_and_their_gradient(scale, softcap, clip_mode, beta):
    torch.manual_seed(0)
    n, h, v = 13, 8, 24
    # Logits of std ~1 and a clip that catches some tokens but not all: a saturated clip would hide the transform.
    h_s = (0.3 * torch.randn(n, h, dtype=torch.float64)).requires_grad_(True)
    h_t = 0.3 * torch.randn(n, h, dtype=torch.float64)
    w = torch.randn(v, h, dtype=torch.float64)
    kw = dict(beta=beta, clip_mode=clip_mode, clip=0.05 if clip_mode == "element" else 0.3)
    got, _ = loss.chunked_opsd_loss(
        h_s, h_t, w, w, settings=settings(chunk_size=5, **kw), target_ids_N=None,
        transform=LogitTransform(scale, softcap),
    )  # fmt: skip
    (grad_got,) = torch.autograd.grad(got, h_s)

    h_ref = h_s.detach().clone().requires_grad_(True)
    want = oracle(by_hand(h_ref @ w.T, scale, softcap), by_hand(h_t @ w.T, scale, softcap), **kw)[
        "loss"
    ].sum()
    (grad_want,) = torch.autograd.grad(want, h_ref)
    # The loss does its math in float32 (test_loss.py's tolerances).
    torch.testing.assert_close(got.detach().double(), want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad_got, grad_want, atol=1e-5, rtol=1e-5)

    # The same loss without the transform is another number: the test sees a loss that ignores it.
    plain, _ = loss.chunked_opsd_loss(
        h_s, h_t, w, w, settings=settings(chunk_size=5, **kw), target_ids_N=None
    )
    assert abs(float(plain) - float(want)) > 1e-3


def _config(**fields):
    return SimpleNamespace(model_type="test", **fields)


def _head(transform_fn, dtype=torch.float32):
    torch.manual_seed(1)
    hidden, weight = torch.randn(3, 16, dtype=dtype), torch.randn(40, 16, dtype=dtype)
    z = hidden @ weight.T
    return hidden, weight, transform_fn(z.float()).to(dtype)


@pytest.mark.parametrize(
    "fields,fn,want",
    [
        ({}, lambda z: z, IDENTITY),
        ({"logits_scaling": 8.0}, lambda z: z / 8.0, LogitTransform(1 / 8.0, 0.0)),  # Granite
        ({"logits_scaling": 8.0}, lambda z: z * 8.0, LogitTransform(8.0, 0.0)),  # HyperCLOVA X
        ({"logit_scale": 0.25}, lambda z: z * 0.25, LogitTransform(0.25, 0.0)),  # Cohere
        ({"final_logit_softcapping": 3.0}, lambda z: 3.0 * torch.tanh(z / 3.0), LogitTransform(1.0, 3.0)),
        ({"final_logit_softcapping": None, "logits_scaling": 1.0}, lambda z: z, IDENTITY),
        ({"final_logit_softcapping": 30.0}, lambda z: z, IDENTITY),  # a named cap the model does not apply
    ],
)
def test_resolve_picks_the_transform_that_reproduces_the_models_logits(fields, fn, want):
    hidden, weight, logits = _head(fn)
    assert resolve_logit_transform(_config(**fields), hidden, weight, logits) == want


def test_resolve_in_bfloat16_keeps_scale_and_cap_apart():
    hidden, weight, logits = _head(lambda z: 2.0 * torch.tanh(z / 8.0 / 2.0), dtype=torch.bfloat16)
    got = resolve_logit_transform(
        _config(logits_scaling=8.0, final_logit_softcapping=2.0), hidden, weight, logits
    )
    assert got == LogitTransform(1 / 8.0, 2.0)


def test_a_float32_model_under_bf16_autocast_is_checked_at_bf16():
    """A float32 model trained under bf16 autocast (a GPU run's default) computes its lm_head in bf16: its logits
    sit a bf16 rounding away from the float32 h @ W.T, which passes under autocast and only there."""
    torch.manual_seed(1)
    hidden, weight = torch.randn(3, 64), torch.randn(40, 64)
    logits = (hidden.bfloat16() @ weight.bfloat16().T).float()
    with pytest.raises(UnsupportedModel, match="relative error"):
        resolve_logit_transform(_config(), hidden, weight, logits)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert resolve_logit_transform(_config(), hidden, weight, logits) == IDENTITY
    # The run's mixed precision, given: the check runs after the forward, outside its autocast (accelerate's).
    assert resolve_logit_transform(_config(), hidden, weight, logits, torch.bfloat16) == IDENTITY
    # Autocast does not loosen the check for a transform the model does not apply.
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(UnsupportedModel):
        resolve_logit_transform(_config(logits_scaling=8.0), hidden, weight, logits * 1.5)


def test_a_transform_no_config_field_names_is_refused_in_one_line():
    hidden, weight, logits = _head(lambda z: z + 1.0)
    with pytest.raises(UnsupportedModel, match="model type 'test': its logits are not h @ lm_head.weight"):
        resolve_logit_transform(_config(logits_scaling=8.0), hidden, weight, logits)


def test_candidates_are_each_named_value_and_its_inverse_identity_first():
    found = candidates(_config(logits_scaling=4.0, final_logit_softcapping=10.0))
    assert found[0] == IDENTITY
    assert set(found) == {LogitTransform(s, c) for s in (1.0, 4.0, 0.25) for c in (0.0, 10.0)}
    assert candidates(_config(logits_scaling=True)) == [IDENTITY]  # a flag is not a scale
