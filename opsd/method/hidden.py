"""Scoring completions under one role: position ids, padding, and the final hidden states of completion tokens.

Torch-only, shared by the trainer and the benchmarks. Rows are laid out `[left-padded prompt ; right-padded
completion]`; positions are computed from the masks so padding never shifts a real token (docs/method.md §1.2).
`fix_positions=False` instead rebuilds the rows the reference code fed its model (`reference_rows`).

Logits. What turns a final hidden state into the model's logits: the lm_head weight and the transform some families
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
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from opsd.errors import UnsupportedModel

logger = logging.getLogger(__name__)


@dataclass
class CompletionHiddenStates:
    """Both roles' hidden states (N, H) of the valid completion tokens, flattened over the completion mask, and
    the lm_head weights (V, H) and transform that turn them into each role's logits (`OPSDTrainer.
    completion_hidden_states`; the loss, the probe and the completions log read them). The teacher's are None
    when the loss reads no teacher."""

    student_hidden_NH: torch.Tensor
    teacher_hidden_NH: torch.Tensor | None
    student_weight_VH: torch.Tensor
    teacher_weight_VH: torch.Tensor | None
    logit_transform: LogitTransform


@contextmanager
def eval_mode(module: torch.nn.Module):
    """`module` in eval mode (dropout off) inside the block, its previous mode restored afterwards."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def positions(prompt_mask_BP: torch.Tensor, completion_width: int) -> torch.Tensor:
    """Position ids of `[left-padded prompt ; completion]` rows, shape (B, P + C).

    Each real token's index in its own unpadded sequence (prompt tokens 0..Lp-1, completion tokens Lp, Lp+1,
    ...), which is what the rollout engine used. Padding tokens get position 0; they are masked out of attention.
    """
    prompt_len_B1 = prompt_mask_BP.sum(dim=1, keepdim=True)
    pos_prompt = (prompt_mask_BP.cumsum(dim=1) - 1).clamp(min=0)
    pos_completion = prompt_len_B1 + torch.arange(completion_width, device=prompt_mask_BP.device)
    return torch.cat([pos_prompt * prompt_mask_BP, pos_completion], dim=1)


def reference_rows(
    prompt_ids_BP, prompt_mask_BP, completion_ids_BC, completion_mask_BC, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of the reference code's rows, shape (B, P + C), from left-padded prompts.

    The reference pads prompts on the right with the tokenizer's pad token, appends the completions (padded
    with it too), masks every position whose id is the pad id, and lets the model number positions 0..P+C-1.
    So completion token j sits at position P + j, and a shorter prompt's token 0 is predicted from the pad
    token in column P - 1. A real token equal to the pad id is masked as well (SmolLM2 pads with its
    `<|im_end|>`, so there every turn end is hidden from attention). The sampled stop token, which may equal
    the pad id, is masked from attention here too, and that changes no score: it is scored from the column
    before it, and no completion token after it is scored; `loss_token_mask` keeps it in the loss.
    """
    width = prompt_ids_BP.size(1)
    n_pad_B1 = width - prompt_mask_BP.sum(dim=1, keepdim=True)
    # Rotating each left-padded row by its pad count moves its real tokens to the front.
    cols_BP = (torch.arange(width, device=prompt_ids_BP.device) + n_pad_B1) % width
    real_BP = prompt_mask_BP.gather(1, cols_BP).bool()
    prompt_BP = torch.where(real_BP, prompt_ids_BP.gather(1, cols_BP), pad_token_id)
    completion_BC = torch.where(completion_mask_BC.bool(), completion_ids_BC, pad_token_id)
    input_ids = torch.cat([prompt_BP, completion_BC], dim=1)
    return input_ids, (input_ids != pad_token_id).long()


def loss_token_mask(
    completion_ids_BC: torch.Tensor, completion_mask_BC: torch.Tensor, *, skip: int
) -> torch.Tensor:
    """(B, C) mask of the completion tokens that enter the loss, its denominator and its metrics: every real
    completion token (`completion_mask_BC`) whatever its id, but for the first `skip` of each completion (SDFT's
    `num_loss_tokens_to_skip`).

    The reference's labels also drop a sampled token equal to the pad id, in the layout `fix_position_ids=false`
    reproduces. Where the pad token is the stop token (SmolLM2's ``<|im_end|>``, any tokenizer `opsd.models`
    gives pad = eos) or one of the stop ids (Qwen3's ``<|endoftext|>``), that drops the sampled stop, and the
    student is never trained to stop: that is not reproduced (docs/method.md §1.2).
    """
    keep_BC = completion_mask_BC.bool()
    if skip:
        keep_BC = keep_BC & (torch.arange(completion_ids_BC.size(1), device=keep_BC.device) >= skip)
    return keep_BC.long()


def _pad(seqs: list[list[int]], pad_id: int, device, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            cols = slice(width - len(s), width) if left else slice(0, len(s))
            ids[i, cols] = torch.tensor(s, dtype=torch.long)
            mask[i, cols] = 1
    return ids.to(device), mask.to(device)


def left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of prompts padded on the left to the longest one, shape (B, P)."""
    return _pad(seqs, pad_id, device, left=True)


def right_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of completions padded on the right to the longest one, shape (B, C)."""
    return _pad(seqs, pad_id, device, left=False)


def completion_hidden(
    model,
    prompt_ids_BP,
    prompt_mask_BP,
    completion_ids_BC,
    completion_mask_BC,
    *,
    fix_positions: bool,
    pad_token_id: int | None,
    on_last_logits=None,
    columns: bool = False,
) -> torch.Tensor:
    """Final hidden states (after the last norm) that predict each valid completion token, flattened to (N, H).

    `fix_positions=False` scores the reference code's rows instead (`reference_rows`, which needs the
    `pad_token_id`), or with `columns` TRL's GRPO rows: the left-padded batch as it is, the model numbering its
    columns (so left padding shifts a shorter prompt's positions); the tokens kept are still those of
    `completion_mask_BC`. The forward goes through the
    model object it is given (so DDP/DeepSpeed wrappers see it) and asks for logits at the last position
    only; the completion's logits are computed later, in chunks, by the loss. `on_last_logits(hidden_BH,
    logits_BV)`, if given, receives the last column's final hidden states and the model's own logits there:
    what the trainer checks its logit transform against (`resolve_logit_transform`, below).
    """
    if fix_positions or columns:
        input_ids = torch.cat([prompt_ids_BP, completion_ids_BC], dim=1)
        attention_mask = torch.cat([prompt_mask_BP, completion_mask_BC], dim=1)
        position_ids = positions(prompt_mask_BP, completion_ids_BC.size(1)) if fix_positions else None
    else:
        if pad_token_id is None:
            raise ValueError(
                "fix_positions=False needs the tokenizer's pad_token_id to rebuild the reference rows"
            )
        input_ids, attention_mask = reference_rows(
            prompt_ids_BP, prompt_mask_BP, completion_ids_BC, completion_mask_BC, pad_token_id
        )
        # As in the reference, the model numbers the positions itself (0..P+C-1 for causal LMs).
        position_ids = None
    width = prompt_ids_BP.size(1)
    with _last_hidden_state(model) as captured:
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            output_hidden_states=not captured.hooked,
            logits_to_keep=1,
        )
    if captured.hooked and captured.value is None:
        raise RuntimeError(
            f"the forward of {type(model).__name__} did not run its decoder's module hooks, so its final hidden "
            "states were not captured; something replaced the decoder's __call__ (vLLM's Transformers backend "
            "does so in place; opsd.method.engine_classes keeps the trainer's model out of its reach)"
        )
    last_BTH = captured.value if captured.hooked else out.hidden_states[-1]
    if on_last_logits is not None:
        on_last_logits(last_BTH[:, -1].detach(), out.logits[:, -1].detach())
    hidden_BCH = last_BTH[:, width - 1 : width - 1 + completion_ids_BC.size(1)]
    return hidden_BCH[completion_mask_BC.bool()]


class _Captured:
    hooked = False
    value: torch.Tensor | None = None


@contextmanager
def _last_hidden_state(model):
    """Captures the decoder's `last_hidden_state` (after the final norm) during one forward.

    Asking the model for `output_hidden_states` instead would keep every layer's output alive until the
    forward returns: ~L x T x H values per row for the teacher, which needs none of them. Models whose decoder
    cannot be found (no `get_decoder`) fall back to `output_hidden_states`.
    """
    inner = model
    while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):  # DDP, DeepSpeed
        inner = inner.module
    if hasattr(inner, "get_base_model"):  # peft
        inner = inner.get_base_model()
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    captured = _Captured()
    if not isinstance(decoder, torch.nn.Module) or decoder is inner:
        yield captured
        return

    def keep(_module, _args, output):
        captured.value = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    handle = decoder.register_forward_hook(keep)
    captured.hooked = True
    try:
        yield captured
    finally:
        handle.remove()


# -- logits -------------------------------------------------------------------------------------------------
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


def compute_dtype(
    weight_VH: torch.Tensor, logits_BV: torch.Tensor, mixed_precision: torch.dtype | None = None
) -> torch.dtype:
    """The coarsest dtype the model's logits went through: the weight's, the logits', the run's mixed precision
    (`mixed_precision`: a float32 model trained with bf16 computes its forward under bf16 autocast), or autocast's
    where it is on here."""
    device = logits_BV.device.type
    dtypes = [weight_VH.dtype, logits_BV.dtype, *([mixed_precision] if mixed_precision else [])]
    if torch.is_autocast_enabled(device):
        dtypes.append(torch.get_autocast_dtype(device))
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def resolve_logit_transform(
    config,
    hidden_BH: torch.Tensor,
    weight_VH: torch.Tensor,
    logits_BV: torch.Tensor,
    mixed_precision: torch.dtype | None = None,
) -> LogitTransform:
    """The candidate (`candidates`) that reproduces the model's own logits `logits_BV` from the final hidden
    states `hidden_BH` of the same positions and the lm_head weight (V, H); the closest one wins. Raises
    UnsupportedModel when none is within `tolerance` of the dtype the logits were computed in (`compute_dtype`)."""
    errors = {t: transform_error(t, hidden_BH, weight_VH, logits_BV) for t in candidates(config)}
    best = min(errors, key=errors.get)
    if errors[best] <= tolerance(compute_dtype(weight_VH, logits_BV, mixed_precision)) and math.isfinite(
        errors[best]
    ):
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


class CheckedForwards:
    """`completion_hidden` for a trainer's models, with the loss's logit transform picked on the first forward of
    the first model and checked on the first forward of every model (`resolve_logit_transform`, `one_transform`):
    `transform` is what the loss applies after the lm_head. `unwrap` gives the bare model of a wrapped one (the
    accelerator's); under `mixed_precision` the check allows that dtype's rounding. `columns`: the rows of
    `fix_positions=False` are TRL's GRPO rows, not the reference code's (`completion_hidden`)."""

    def __init__(
        self,
        unwrap,
        *,
        fix_positions: bool,
        pad_token_id: int | None,
        mixed_precision: str | None = None,
        columns: bool = False,
    ):
        self.unwrap = unwrap
        self.fix_positions = fix_positions
        self.columns = columns
        self.pad_token_id = pad_token_id
        # The accelerator's mixed precision ("bf16", "fp16", "no"): the forward's autocast dtype.
        self.mixed_precision = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision or "no")
        self.transform: LogitTransform | None = None
        self.checked: set[int] = set()

    def __call__(self, model, prompt_ids_BP, prompt_mask_BP, completion_ids_BC, completion_mask_BC):
        return completion_hidden(
            model, prompt_ids_BP, prompt_mask_BP, completion_ids_BC, completion_mask_BC,
            fix_positions=self.fix_positions, pad_token_id=self.pad_token_id,
            on_last_logits=None if id(model) in self.checked else self._check(model), columns=self.columns,
        )  # fmt: skip

    def _check(self, model):
        def check(hidden_BH, logits_BV):
            unwrapped = self.unwrap(model)
            found = resolve_logit_transform(
                unwrapped.config, hidden_BH, lm_head_weight(unwrapped), logits_BV, self.mixed_precision
            )
            if self.transform is None:
                logger.info("logit transform after the lm_head, checked against the model's logits: %s",
                            found.describe())  # fmt: skip
            self.transform = one_transform(self.transform, found)
            self.checked.add(id(model))

        return check
