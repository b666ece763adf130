"""Which modules get LoRA adapters: `auto` finds the linear projections of every layer kind, and the adapted
modules are reported per layer kind at start-up.

Hybrid families put different modules in different layers: Qwen3.5's Gated DeltaNet layers project with
`in_proj_qkv`/`in_proj_z`/`in_proj_a`/`in_proj_b`/`out_proj`, LFM2's convolution blocks with `in_proj`/`out_proj`,
Mamba layers with `in_proj`/`out_proj`, attention layers with `q_proj`... A fixed list of names adapts only some
kinds and skips the others without a word. `auto` takes every `nn.Linear` inside the decoder layers except:
- a projection whose weight its parent's code reads directly (`self.out_proj.weight`): Mamba mixers hand it to
  a fused training kernel, which would skip an adapter in the student's forward (peft refuses `out_proj` for
  the Mamba model types it knows);
- a mixture-of-experts router (a projection onto the experts): adapting the routing is not what the recipe does.
Convolution kernels and expert weights that are not `nn.Linear` are not adapted. On the dense families the rule
gives the published recipe's q, k, v, o, gate, up and down projections.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
from collections import defaultdict
from contextlib import contextmanager

import torch

from opsd.errors import UnsupportedModel, raised_inside

logger = logging.getLogger(__name__)

AUTO = "auto"
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def decoder_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every decoder layer: the children of the model's `layers` list."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return [(f"{name}.{i}", layer) for i, layer in enumerate(module)]
    raise ValueError(f"{type(model).__name__} has no decoder `layers` list; give lora_target_modules by name")


def layer_kind(model: torch.nn.Module, index: int, layer: torch.nn.Module) -> str:
    """A layer's kind: its config's `layer_types` entry or its own `layer_type`/`block_type`, else its class."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and index < len(types):
        return str(types[index])
    return str(
        getattr(layer, "layer_type", None) or getattr(layer, "block_type", None) or type(layer).__name__
    )


def _expert_counts(model) -> set[int]:
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {v for f in EXPERT_COUNT_FIELDS if isinstance(v := getattr(config, f, None), int) and v > 1}


def _excluded(parent: torch.nn.Module, leaf: str, module: torch.nn.Linear, experts: set[int]) -> str | None:
    """Why `auto` leaves this linear module out, or None."""
    if re.search(rf"\bself\.{re.escape(leaf)}\.weight\b", _source(type(parent))):
        return "its weight is read directly by a fused kernel"
    if module.out_features in experts:
        return "expert router"
    return None


@functools.cache
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # a class built at run time has no source file
        return ""


def auto_targets(model: torch.nn.Module) -> tuple[list[str], dict[str, str]]:
    """(target_modules for peft, {module name: why left out}) under the `auto` rule (module docstring).

    Each target is the shortest name suffix that matches exactly the chosen modules among all of the model's
    modules (peft matches a target `t` to a module named `t` or ending in `.t`): the leaf name where every
    module of that name is chosen (`q_proj`), a longer suffix where it is not (`self_attn.out_proj`)."""
    experts = _expert_counts(model)
    modules = dict(model.named_modules())
    chosen, left_out = set(), {}
    for layer_name, layer in decoder_layers(model):
        for sub, module in layer.named_modules(prefix=layer_name):
            if not isinstance(module, torch.nn.Linear):
                continue
            parent_name, _, leaf = sub.rpartition(".")
            why = _excluded(modules[parent_name], leaf, module, experts)
            if why:
                left_out[sub] = why
            else:
                chosen.add(sub)
    if not chosen:
        raise ValueError(f"{type(model).__name__}: no linear projection in its decoder layers to adapt")
    targets: set[str] = set()
    for name in sorted(chosen):
        parts = name.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            matched = {m for m in modules if m == suffix or m.endswith("." + suffix)}
            if matched <= chosen:
                targets.add(suffix)
                break
    return sorted(targets, key=_published_order), left_out


def _published_order(name: str) -> tuple[int, str]:
    order = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    leaf = name.split(".")[-1]
    return (order.index(leaf) if leaf in order else len(order), name)


def resolve_targets(model: torch.nn.Module, requested: list[str]) -> str | list[str]:
    """peft's target_modules for the config's `lora_target_modules`: `auto` resolved on this model, `all-linear`
    passed to peft, any other list kept as given."""
    if requested == [AUTO]:
        targets, left_out = auto_targets(model)
        if left_out:
            reasons = defaultdict(set)
            for name, why in left_out.items():
                reasons[why].add(name.split(".")[-1])
            logger.info(
                "lora_target_modules=auto leaves out: %s",
                "; ".join(f"{', '.join(sorted(v))} ({k})" for k, v in sorted(reasons.items())),
            )
        return targets
    return "all-linear" if requested == ["all-linear"] else requested


def coverage(model: torch.nn.Module) -> dict[str, dict[str, list[str]]]:
    """Per layer kind: {"adapted": [...], "not adapted": [...]} linear modules (names inside the layer, e.g.
    `self_attn.q_proj`), from a model that already carries its LoRA adapters."""
    from peft.tuners.lora import LoraLayer

    kinds: dict[str, dict[str, set[str]]] = defaultdict(lambda: {"adapted": set(), "not adapted": set()})
    for index, (_, layer) in enumerate(decoder_layers(model)):
        kind = layer_kind(model, index, layer)
        for sub, module in layer.named_modules():
            if isinstance(module, LoraLayer):
                kinds[kind]["adapted"].add(sub)
            elif isinstance(module, torch.nn.Linear) and not _inside_lora(sub, layer):
                kinds[kind]["not adapted"].add(sub)
    return {k: {state: sorted(names) for state, names in v.items()} for k, v in kinds.items()}


def _inside_lora(name: str, layer: torch.nn.Module) -> bool:
    """Whether a module is part of a LoRA layer (its base layer, lora_A/lora_B)."""
    from peft.tuners.lora import LoraLayer

    parts = name.split(".")
    for n in range(1, len(parts)):
        if isinstance(layer.get_submodule(".".join(parts[:n])), LoraLayer):
            return True
    return False


def log_coverage(model: torch.nn.Module) -> None:
    """One INFO line per layer kind with its adapted modules; a WARNING for a kind left with none."""
    for kind, states in coverage(model).items():
        adapted, rest = states["adapted"], states["not adapted"]
        logger.info(
            "LoRA on %s layers: %s%s", kind, ", ".join(adapted) or "nothing",
            f" (not adapted: {', '.join(rest)})" if rest else "",
        )  # fmt: skip
        if not adapted and rest:
            logger.warning(
                "no LoRA adapter in the %s layers (linear modules %s): lora_target_modules names none of "
                "them; lora_target_modules=auto adapts every layer kind",
                kind, ", ".join(rest),
            )  # fmt: skip


@contextmanager
def peft_refusal(requested: list[str], model: torch.nn.Module):
    """Inside the block, peft refusing the LoRA targets (a Mamba `out_proj`, names that match no module) becomes
    one line naming the targets, the model type and `lora_target_modules=auto`."""
    try:
        yield
    except ValueError as err:
        if not raised_inside(err, "/peft/"):
            raise
        model_type = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        first = " ".join(str(err).split())[:300]
        raise UnsupportedModel(
            f"peft refuses lora_target_modules={','.join(requested)} on this {model_type!r} model ({first}); "
            "use lora_target_modules=auto (the default), which adapts every layer kind and leaves out what a "
            "fused kernel reads directly, or name other modules"
        ) from err
