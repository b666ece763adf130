"""What turns a final hidden state into the model's logits: the lm_head weight and the transform some families
apply after it, found by checking candidates against the model's own logits.

The chunked loss computes logits itself, from hidden states and the lm_head weight, so it must apply what the
model applies after that matmul, or it trains on a different distribution than the one the rollout engine
samples from. Families differ, and the config names alone are ambiguous (`logits_scaling` divides the logits
in Granite and multiplies them in HyperCLOVA X), so `resolve_logit_transform` takes the candidates a config
names and keeps the one that reproduces the model's own logits on a forward the trainer runs anyway. A model
whose logits none of them reproduce is refused with one line.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from opsd.errors import UnsupportedModel

# Config fields that change the logits after the lm_head matmul, in the families transformers ships:
# a scale (Granite, Cohere, Falcon-H1, HyperCLOVA X) or a tanh soft-cap (Gemma 2/3, nanochat, VaultGemma).
SCALE_FIELDS = ("logits_scaling", "logit_scale", "lm_head_multiplier")
SOFTCAP_FIELDS = ("final_logit_softcapping",)


@dataclass(frozen=True)
class LogitTransform:
    """logits = softcap * tanh(scale * z / softcap) with z = h @ W.T, or scale * z when softcap is 0."""

    scale: float = 1.0
    softcap: float = 0.0

    @property
    def identity(self) -> bool:
        return self.scale == 1.0 and not self.softcap

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """The model's logits from z = h @ W.T, in z's dtype (float32 in the loss); out of place."""
        if self.identity:
            return z
        y = z * self.scale
        if self.softcap:
            y = torch.tanh(y / self.softcap) * self.softcap
        return y

    def backward_(self, grad_y: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """dL/dz from dL/dy and the transformed logits y (same shape), in place on grad_y.

        d(scale z)/dz = scale; d(c tanh(x / c))/dx = 1 - tanh(x / c)^2 = 1 - (y / c)^2.
        """
        if self.softcap:
            grad_y.mul_(1.0 - (y / self.softcap).square())
        if self.scale != 1.0:
            grad_y.mul_(self.scale)
        return grad_y

    def describe(self) -> str:
        if self.identity:
            return "none (logits = h @ W.T)"
        parts = []
        if self.scale != 1.0:
            parts.append(f"scaled by {self.scale:g}")
        if self.softcap:
            parts.append(f"soft-capped at {self.softcap:g}")
        return ", then ".join(parts)


IDENTITY = LogitTransform()


def text_config(config):
    """The text model's config (multimodal configs nest it)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def candidates(config) -> list[LogitTransform]:
    """Every transform the config could mean, the identity first: each named scale and its inverse, with and
    without each named soft-cap."""
    config = text_config(config)
    scales = {1.0}
    for name in SCALE_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
            scales |= {float(value), 1.0 / float(value)}
    caps = {0.0}
    for name in SOFTCAP_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            caps.add(float(value))
    found = [LogitTransform(s, c) for s, c in itertools.product(sorted(scales), sorted(caps))]
    return sorted(found, key=lambda t: not t.identity)


def transform_error(
    transform: LogitTransform, hidden_BH: torch.Tensor, weight_VH: torch.Tensor, logits_BV: torch.Tensor
) -> float:
    """Largest |transform(h @ W.T) - model logits| relative to the logits' scale (1 + max |logit|)."""
    with torch.no_grad():
        z = (hidden_BH.to(weight_VH.dtype) @ weight_VH.T).float()
        y = logits_BV.float()
        return float((transform(z) - y).abs().max() / (1.0 + y.abs().max()))


def tolerance(dtype: torch.dtype) -> float:
    """How far a reproduced logit may sit from the model's own: a few rounding steps of the model's dtype."""
    return 16 * torch.finfo(dtype).eps if dtype in (torch.bfloat16, torch.float16) else 1e-4


def resolve_logit_transform(
    config, hidden_BH: torch.Tensor, weight_VH: torch.Tensor, logits_BV: torch.Tensor
) -> LogitTransform:
    """The candidate (`candidates`) that reproduces the model's own logits `logits_BV` from the final hidden
    states `hidden_BH` of the same positions and the lm_head weight (V, H); the closest one wins. Raises
    UnsupportedModel when none is within `tolerance` of the model's dtype."""
    errors = {t: transform_error(t, hidden_BH, weight_VH, logits_BV) for t in candidates(config)}
    best = min(errors, key=errors.get)
    if errors[best] <= tolerance(weight_VH.dtype) and math.isfinite(errors[best]):
        return best
    model_type = getattr(text_config(config), "model_type", "?")
    raise UnsupportedModel(
        f"model type {model_type!r}: its logits are not h @ lm_head.weight under any transform its config names "
        f"(closest: {best.describe()}, relative error {errors[best]:.2g}); the chunked loss cannot reproduce "
        "its output distribution, so training it would optimise another one; use a model whose logits it can "
        "reproduce (docs/families.md)"
    )


def one_transform(current: LogitTransform | None, found: LogitTransform) -> LogitTransform:
    """The transform the loss applies to both roles: the first model's, which every other model must share."""
    if current is not None and found != current:
        raise UnsupportedModel(
            f"the teacher's logits follow another transform ({found.describe()}) than the student's "
            f"({current.describe()}); the loss applies one transform to both roles"
        )
    return found


def head_logits(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    """The model's logits (N, V) in float32: transform(h @ W.T), the matmul in the weight's dtype as the model's
    lm_head runs it."""
    return transform((hidden_NH.to(weight_VH.dtype) @ weight_VH.T).float())


def lm_head_weight(model) -> torch.Tensor:
    """The output projection (V, H) of a causal LM (PEFT and accelerate wrappers unwrapped by the caller)."""
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise UnsupportedModel(
            f"{type(model).__name__}: its lm_head has a bias, which the chunked loss does not apply; "
            "use a model whose lm_head has none"
        )
    return head.weight
