"""Which modules get LoRA adapters: `auto` finds the linear projections of every layer kind, and the adapted
modules are reported per layer kind at start-up.

Hybrid families put different modules in different layers: Qwen3.5's Gated DeltaNet layers project with
`in_proj_qkv`/`in_proj_z`/`in_proj_a`/`in_proj_b`/`out_proj`, LFM2's convolution blocks with `in_proj`/`out_proj`,
Mamba layers with `in_proj`/`out_proj`, attention layers with `q_proj`... A fixed list of names adapts only some
kinds and skips the others without a word. `auto` takes every `nn.Linear` inside the decoder layers except:
- a projection whose weight its parent's code reads directly (`self.out_proj.weight`): Mamba mixers hand it to
  a fused training kernel, which would skip an adapter in the student's forward (peft refuses `out_proj` for
  the Mamba model types it knows);
- a mixture-of-experts router: adapting the routing is not what the recipe does. A router is told by the model's
  own names, never by its width alone (a k/v projection as wide as the expert count is a projection): in a model
  with experts (an expert count in its config or a sub-config, or an `experts` module), a linear whose class or
  an enclosing module's class inside the layer is named as a router (`Router`, `TopK`, `Gating`, a trailing
  `Gate`: Llama 4's `Llama4Router`, PhiMoE's `PhimoeTopKRouter`), or one named `router`, `gate`, `wg` or
  `gating` directly in a block that holds the experts (Jamba's `feed_forward.router`, the `mlp.gate` of
  transformers 4's sparse MoE blocks). transformers 5 builds most routers (Qwen3-MoE's, DeepSeek-V3's,
  Granite's, Mixtral's) as modules of their own that are not `nn.Linear`, left out as such.
Every linear module `auto` leaves out is named in one WARNING at start-up, with the reason.
Convolution kernels and expert weights that are not `nn.Linear` are not adapted. On the dense families the rule
gives the published recipe's q, k, v, o, gate, up and down projections.

Where peft moves them. For the mixture-of-experts model types whose experts transformers 5 fuses into stacked
parameters (DeepSeek-V3, Qwen3-MoE, GLM-4-MoE, OLMoE... transformers' `_MODEL_TO_CONVERSION_PATTERN`), peft
rewrites every target_modules entry named like an expert projection (`gate_proj`, `up_proj`, `down_proj`, even as
a full module name) into a target parameter of the routed experts, for adapters trained before that fusion. Such
a target then adapts the routed experts, and the dense MLP of the first layers and the shared experts, whose
`nn.Linear` modules carry those names, get nothing. `auto` asks peft's own conversion which of its chosen modules
it would move, and adapts those through peft's `target_parameters` (`mlp.gate_proj.weight`: a LoRA delta on
that one weight, the same W + BA as on a module) instead; peft's parameter adapters take no dropout, so with
`lora_dropout` > 0 such a model is refused in one line.
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


def layer_kinds(model: torch.nn.Module) -> list[str]:
    """Every decoder layer's kind (`layer_kind`), split further where layers of one kind are built of different
    blocks: DeepSeek-V3's first layers have a dense MLP where the later ones have experts, in one layer class and
    with no `layer_types`, so their kinds are `DeepseekV3DecoderLayer (mlp: DeepseekV3MLP)` and `... (mlp:
    DeepseekV3MoE)`, and the coverage line of each says what its own linears got."""
    layers = decoder_layers(model)
    kinds = [layer_kind(model, i, layer) for i, (_, layer) in enumerate(layers)]
    blocks = [tuple((n, type(c).__name__) for n, c in layer.named_children()) for _, layer in layers]
    for kind in set(kinds):
        members = [i for i, k in enumerate(kinds) if k == kind]
        if len({blocks[i] for i in members}) < 2:
            continue
        # the children whose class differs between layers of this kind name the split
        differing = [n for n, _ in blocks[members[0]] if len({dict(blocks[i]).get(n) for i in members}) > 1]
        for i in members:
            parts = ", ".join(f"{n}: {dict(blocks[i]).get(n)}" for n in differing)
            kinds[i] = f"{kind} ({parts})"
    return kinds


def _expert_counts(model) -> set[int]:
    """The expert counts the model's (text) config declares, in its own fields or a sub-config's (DBRX's
    `ffn_config.moe_num_experts`)."""
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if config is None:
        return set()
    configs = [config, *(v for v in vars(config).values() if hasattr(v, "to_dict"))]
    return {
        v for c in configs for f in EXPERT_COUNT_FIELDS if isinstance(v := getattr(c, f, None), int) and v > 1
    }  # fmt: skip


# A router's class names it so (Llama4Router, PhimoeTopKRouter, DbrxRouter, JetMoeTopKGating, HunYuanMoEV1Gate);
# `Gate` only at the end, so that `GatedDeltaNet` or `RMSNormGated` are not routers.
ROUTER_CLASS = re.compile(r"Router|TopK|Topk|Gating|Gate$")
# What a router module is called inside the block that holds the experts (`mlp.gate`, `feed_forward.router`).
ROUTER_NAMES = frozenset({"router", "gate", "wg", "gating"})


def _holds_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is a mixture-of-experts block: it has a child `experts` or a child of an Experts class."""
    return any(n == "experts" or "Experts" in type(c).__name__ for n, c in module.named_children())


def _has_experts(model: torch.nn.Module) -> bool:
    """Whether the model is a mixture of experts: an expert count in its config or an experts block."""
    return bool(_expert_counts(model)) or any(_holds_experts(m) for m in model.modules())


def _router(layer: torch.nn.Module, sub: str) -> str | None:
    """Why the linear at `sub` (a name inside `layer`) is a mixture-of-experts router, by its names, or None.
    Only asked of a model with experts (`_has_experts`)."""
    parts = sub.split(".")
    # from the layer's child down to the module itself
    chain = [layer.get_submodule(".".join(parts[:n])) for n in range(1, len(parts) + 1)]
    for module in reversed(chain):
        if ROUTER_CLASS.search(cls := type(module).__name__):
            return f"expert router: class {cls}"
    parent = chain[-2] if len(chain) > 1 else layer
    if parts[-1] in ROUTER_NAMES and _holds_experts(parent):
        return f"expert router: `{parts[-1]}` of the MoE block {type(parent).__name__}"
    return None


def _excluded(layer: torch.nn.Module, sub: str, moe: bool) -> str | None:
    """Why `auto` leaves out the linear module at `sub` (a name inside `layer`), or None. `moe`: the model has
    experts (`_has_experts`); a router is told by its names, never by its width alone (module docstring)."""
    parent_name, _, leaf = sub.rpartition(".")
    parent = layer.get_submodule(parent_name) if parent_name else layer
    if re.search(rf"\bself\.{re.escape(leaf)}\.weight\b", _source(type(parent))):
        return "its weight is read directly by a fused kernel"
    return _router(layer, sub) if moe else None


@functools.cache
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # a class built at run time has no source file
        return ""


def auto_targets(model: torch.nn.Module) -> tuple[list[str], list[str], dict[str, str]]:
    """(target_modules, target_parameters for peft, {module name: why left out}) under the `auto` rule (module
    docstring).

    Each target is the shortest name suffix that matches exactly the chosen modules among all of the model's
    modules (peft matches a target `t` to a module named `t` or ending in `.t`): the leaf name where every
    module of that name is chosen (`q_proj`), a longer suffix where it is not (`self_attn.out_proj`). The
    chosen modules peft would move off target_modules (`peft_moved`) become target parameters instead, the
    shortest suffix of their `weight` that matches exactly those weights (`mlp.gate_proj.weight`,
    `shared_experts.gate_proj.weight`)."""
    moe = _has_experts(model)
    modules = dict(model.named_modules())
    chosen, left_out = set(), {}
    for layer_name, layer in decoder_layers(model):
        for sub, module in layer.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            why = _excluded(layer, sub, moe)
            if why:
                left_out[f"{layer_name}.{sub}"] = why
            else:
                chosen.add(f"{layer_name}.{sub}")
    if not chosen:
        raise ValueError(f"{type(model).__name__}: no linear projection in its decoder layers to adapt")
    moved = peft_moved(model, chosen)
    targets = _shortest_suffixes(chosen - moved, set(modules))
    weights = {f"{name}.weight" for name in moved}
    parameters = _shortest_suffixes(weights, {n for n, _ in model.named_parameters()})
    return sorted(targets, key=_published_order), sorted(parameters), left_out


def _shortest_suffixes(chosen: set[str], names: set[str]) -> set[str]:
    """For each of `chosen`, its shortest dotted suffix that matches (as peft matches) only names in `chosen`."""
    suffixes: set[str] = set()
    for name in sorted(chosen):
        parts = name.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if {m for m in names if m == suffix or m.endswith("." + suffix)} <= chosen:
                suffixes.add(suffix)
                break
    return suffixes


def peft_moved(model: torch.nn.Module, names: set[str]) -> set[str]:
    """Which of the modules `names` peft would not adapt as target_modules on this model, because its conversion
    for transformers 5 moves such targets onto fused expert parameters (module docstring). Asked of peft's own
    conversion, so the answer follows peft's list of model types; empty with a peft that has no conversion."""
    try:
        from peft import LoraConfig
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except ImportError:
        return set()

    def kept(targets: set[str]) -> set[str]:
        config = LoraConfig(r=1, target_modules=sorted(targets))
        convert_peft_config_for_transformers(config, model=model, conversions=None)
        return set(config.target_modules or ())

    try:
        return set(names) - kept(set(names))
    except ValueError:  # peft refuses half of a fused pair (gate_proj without up_proj): ask name by name
        moved = set()
        for name in names:
            try:
                moved |= {name} - kept({name})
            except ValueError:
                moved.add(name)
        return moved


def _published_order(name: str) -> tuple[int, str]:
    order = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    leaf = name.split(".")[-1]
    return (order.index(leaf) if leaf in order else len(order), name)


def resolve_targets(model: torch.nn.Module, requested: list[str], *, lora_dropout: float = 0.0) -> dict:
    """peft's LoraConfig targets for the config's `lora_target_modules`, as keyword arguments: `auto` resolved on
    this model (`target_modules`, and `target_parameters` where peft would move modules off target_modules),
    `all-linear` passed to peft, any other list kept as given. Raises UnsupportedModel when `auto` needs target
    parameters and `lora_dropout` is set (peft's parameter adapters refuse dropout)."""
    if requested != [AUTO]:
        return {"target_modules": "all-linear" if requested == ["all-linear"] else requested}
    targets, parameters, left_out = auto_targets(model)
    if left_out:
        logger.warning(
            "lora_target_modules=auto leaves these linear modules without a LoRA adapter: %s; name them in "
            "lora_target_modules to adapt them",
            describe_left_out(model, left_out),
        )
    if not parameters:
        return {"target_modules": targets}
    model_type = _model_type(model)
    if lora_dropout:
        raise UnsupportedModel(
            f"lora_target_modules=auto on this {model_type!r} model adapts {', '.join(parameters)} as peft "
            "target_parameters (peft moves target_modules of those names onto the routed experts' fused "
            f"weights for this model type), and peft's parameter adapters take no dropout: set lora_dropout 0, "
            f"or lora_target_modules={','.join(targets)} to leave those linear layers without adapters"
        )
    logger.info(
        "lora_target_modules=auto adapts %s as peft target_parameters: peft would move modules of those names "
        "onto the routed experts' fused weights of this %r model",
        ", ".join(parameters), model_type,
    )  # fmt: skip
    return {"target_modules": targets, "target_parameters": parameters}


def describe_left_out(model: torch.nn.Module, left_out: dict[str, str]) -> str:
    """`auto_targets`' left-out modules in a few words: each name inside its layer, the layers that hold it and
    why (`mamba.out_proj in layers 0, 2 (its weight is read directly by a fused kernel)`)."""
    prefix = {name: index for index, (name, _) in enumerate(decoder_layers(model))}
    where: dict[tuple[str, str], list[int]] = defaultdict(list)
    for name, why in left_out.items():
        layer, sub = next((p, name[len(p) + 1 :]) for p in prefix if name.startswith(p + "."))
        where[(sub, why)].append(prefix[layer])
    return "; ".join(
        f"{sub} in layer{'s' if len(idx) > 1 else ''} {_ranges(idx)} ({why})"
        for (sub, why), idx in sorted(where.items())
    )


def _ranges(indices: list[int]) -> str:
    """`[0, 1, 2, 5]` as `0-2, 5`."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _model_type(model: torch.nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


def coverage(model: torch.nn.Module) -> dict[str, dict[str, list[str]]]:
    """Per layer kind (`layer_kinds`): {"adapted": [...], "not adapted": [...]} names inside the layer, from a
    model that already carries its LoRA adapters. A linear module counts as adapted under its own name whether
    peft wrapped the module or its weight (`mlp.gate_proj`); an adapted parameter of anything else is named
    with the parameter (`mlp.experts.gate_up_proj`, the routed experts' fused weight)."""
    kinds: dict[str, dict[str, set[str]]] = defaultdict(lambda: {"adapted": set(), "not adapted": set()})
    for kind, (_, layer) in zip(layer_kinds(model), decoder_layers(model), strict=True):
        adapted, rest = _layer_coverage(layer)
        kinds[kind]["adapted"] |= adapted
        kinds[kind]["not adapted"] |= rest
    return {k: {state: sorted(names) for state, names in v.items()} for k, v in kinds.items()}


def _layer_coverage(layer: torch.nn.Module) -> tuple[set[str], set[str]]:
    """(adapted, not adapted linear) names inside one decoder layer (`coverage`)."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    adapted, rest = set(), set()
    for sub, module in layer.named_modules():
        if _inside_lora(sub, layer):
            continue
        wrapper = module
        while isinstance(wrapper, ParamWrapper):  # nested: one wrapper per adapted parameter of a module
            base = wrapper.get_base_layer()
            linear_weight = isinstance(base, torch.nn.Linear) and wrapper.parameter_name == "weight"
            adapted.add(sub if linear_weight else f"{sub}.{wrapper.parameter_name}")
            wrapper = wrapper.base_layer
        if isinstance(module, ParamWrapper):
            continue
        if isinstance(module, LoraLayer):
            adapted.add(sub)
        elif isinstance(module, torch.nn.Linear):
            rest.add(sub)
    return adapted, rest


def _inside_lora(name: str, layer: torch.nn.Module) -> bool:
    """Whether a module is part of a LoRA layer (its base layer, lora_A/lora_B)."""
    from peft.tuners.lora import LoraLayer

    parts = name.split(".")
    for n in range(1, len(parts)):
        if isinstance(layer.get_submodule(".".join(parts[:n])), LoraLayer):
            return True
    return False


def left_out_dense(model: torch.nn.Module) -> dict[str, list[str]]:
    """Per layer kind, its linear modules without an adapter that `auto` would adapt (neither a weight that a
    fused kernel reads directly nor an expert router): dense linears that a target list leaves out, or that peft
    moved off its target_modules (module docstring)."""
    moe = _has_experts(model)
    found: dict[str, set[str]] = defaultdict(set)
    for kind, (_, layer) in zip(layer_kinds(model), decoder_layers(model), strict=True):
        for sub in _layer_coverage(layer)[1]:
            if not _excluded(layer, sub, moe):
                found[kind].add(sub)
    return {kind: sorted(names) for kind, names in found.items()}


def log_coverage(model: torch.nn.Module) -> None:
    """One INFO line per layer kind with its adapted modules and the linear modules it leaves out; a WARNING for
    a kind left with no adapter, and one for a kind whose dense linears (those `auto` would adapt) got none."""
    dense = left_out_dense(model)
    for kind, states in coverage(model).items():
        adapted, rest = states["adapted"], states["not adapted"]
        missed = dense.get(kind, [])
        by_design = [name for name in rest if name not in missed]
        notes = []
        if missed:
            notes.append(f"dense linears without an adapter: {', '.join(missed)}")
        if by_design:
            notes.append(f"not adapted: {', '.join(by_design)}")
        logger.info(
            "LoRA on %s layers: %s%s", kind, ", ".join(adapted) or "nothing",
            f" ({'; '.join(notes)})" if notes else "",
        )  # fmt: skip
        if not adapted and rest:
            logger.warning(
                "no LoRA adapter in the %s layers (linear modules %s): lora_target_modules names none of "
                "them; lora_target_modules=auto adapts every layer kind",
                kind, ", ".join(rest),
            )  # fmt: skip
        elif missed:
            logger.warning(
                "the %s layers' linear modules %s have no LoRA adapter: lora_target_modules leaves them out, or "
                "peft moved targets of those names onto fused expert weights (model type %r); "
                "lora_target_modules=auto adapts them",
                kind, ", ".join(missed), _model_type(model),
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
