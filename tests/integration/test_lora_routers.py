"""`lora_target_modules=auto` tells a mixture-of-experts router by the model's own names and config, never by a
linear's width alone, and names every linear it leaves out in a WARNING (a Qwen3-MoE layout with 32
experts and k/v projections 32 wide lost its k_proj/v_proj adapters to a width rule). The models are built in
memory from their configs (no weights saved, no training)."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from opsd.method.lora_targets import auto_targets, left_out_dense, resolve_targets
from opsd.testing.families import FAMILIES
from opsd.testing.tiny import TINY_HEAD_DIM, TINY_SIZE

LOGGER = "opsd.method.lora_targets"
TOKENS = dict(vocab_size=300, pad_token_id=0, bos_token_id=0, eos_token_id=1)
# One key/value head of TINY_HEAD_DIM: k_proj and v_proj are 32 wide, as many outputs as 32 experts.
KV_WIDTH = TINY_SIZE["num_key_value_heads"] * TINY_HEAD_DIM


def _family(name: str, **changes) -> torch.nn.Module:
    """The tiny layout of `opsd.testing.families` family `name`, with `changes` to its config, built in memory."""
    config_cls, model_cls, layout = FAMILIES[name]
    config = getattr(transformers, config_cls)(**{**TINY_SIZE, **layout, **TOKENS, **changes})
    torch.manual_seed(0)
    return getattr(transformers, model_cls)(config)


def _linears(model) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}


def _wrapped(model, **targets) -> set[str]:
    """The modules peft gives an adapter (module or weight) under `targets`, by their names in the base model."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    peft = get_peft_model(model, LoraConfig(r=4, **targets))
    return {
        n for n, m in peft.get_base_model().named_modules() if isinstance(m, LoraLayer) and ".base_layer" not in n
    }  # fmt: skip


def _left_out_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == LOGGER and "leaves these linear modules without a LoRA adapter" in r.getMessage()
    ]


def test_a_projection_as_wide_as_the_expert_count_gets_its_adapter(caplog):
    """Issue 56 D5: Qwen3-MoE with 32 experts and k/v projections 32 wide. k_proj and v_proj are adapted (and
    every other linear of the decoder layers); the router `mlp.gate` is not."""
    model = _family("qwen3_moe", num_experts=32)
    attention = model.model.layers[1].self_attn
    assert attention.k_proj.out_features == attention.v_proj.out_features == KV_WIDTH == 32
    assert model.config.num_experts == 32
    with caplog.at_level(logging.INFO, logger=LOGGER):
        targets = resolve_targets(model, ["auto"])
    assert targets["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert not _left_out_warnings(caplog)  # nothing left out: transformers 5's router is not an nn.Linear
    linears = _linears(model)
    wrapped = _wrapped(model, **targets)
    assert wrapped == linears
    assert {"model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj"} <= wrapped
    assert not any(n.endswith("mlp.gate") for n in wrapped)


def test_a_linear_router_as_wide_as_the_projections_is_told_by_its_name(caplog):
    """The same layout with the router an nn.Linear 32 wide, as transformers 4 built Qwen3-MoE's `mlp.gate`: the
    router and k/v have the same width, and only the router, named `gate` in the block that holds the experts, is
    left out, in a WARNING that names it."""
    model = _family("qwen3_moe", num_experts=32)
    model.model.layers[1].mlp.gate = torch.nn.Linear(TINY_SIZE["hidden_size"], 32, bias=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        targets = resolve_targets(model, ["auto"])
    assert targets["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    linears = _linears(model)
    assert _wrapped(model, **targets) == linears - {"model.layers.1.mlp.gate"}
    (line,) = _left_out_warnings(caplog)
    record = next(r for r in caplog.records if r.getMessage() == line)
    assert record.levelno == logging.WARNING
    assert "mlp.gate in layer 1 (expert router: `gate` of the MoE block Qwen3MoeSparseMoeBlock)" in line
    assert "k_proj" not in line and "v_proj" not in line
    # the coverage warning's "dense linears" are the ones auto adapts: the router is not among them
    assert all(not n.endswith("mlp.gate") for names in left_out_dense(model).values() for n in names)


BASE = dict(**TINY_SIZE, **TOKENS, num_hidden_layers=2, head_dim=TINY_HEAD_DIM)
# transformers 5 layouts whose routers are nn.Linear modules, each with as many experts as k/v outputs: (config
# class, model class, config values, {router's name in its layer: why}).
LINEAR_ROUTERS = {
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        dict(num_local_experts=32, num_experts_per_tok=2),
        {"mlp.router": "expert router: class PhimoeTopKRouter"},
    ),
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            num_local_experts=32,
            num_experts_per_tok=1,
            intermediate_size_mlp=128,
            interleave_moe_layer_step=1,
        ),
        {"feed_forward.router": "expert router: class Llama4Router"},
    ),
    "jamba": (  # a plain nn.Linear named `router` in the MoE block of layer 1; Mamba in layer 0
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            num_experts=32,
            num_experts_per_tok=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_dt_rank=8,
        ),
        {"feed_forward.router": "expert router: `router` of the MoE block JambaSparseMoeBlock"},
    ),
}


@pytest.mark.parametrize("name", LINEAR_ROUTERS)
def test_linear_routers_are_left_out_by_their_names_and_warned_about(name, caplog):
    config_cls, model_cls, values, routers = LINEAR_ROUTERS[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**BASE, **values}))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        targets, _, left_out = auto_targets(model)
        resolve_targets(model, ["auto"])
    found = {n.split(".", 3)[3]: why for n, why in left_out.items() if "router" in why}
    assert found == routers
    assert {"k_proj", "v_proj"} <= set(targets)  # 32 wide, as the routers
    assert all("fused kernel" in why for why in left_out.values() if "router" not in why)
    (line,) = _left_out_warnings(caplog)
    for sub, why in routers.items():
        assert f"{sub} in layer" in line and why in line
    for full in left_out:  # every module left out is in the line, by its name inside the layer
        assert full.split(".", 3)[3] in line


def test_router_names_without_experts_are_adapted():
    """`router`, `gate` and a Router class in a model without experts (no expert count, no experts block) are
    ordinary projections: adapted."""

    class Router(torch.nn.Linear):
        pass

    model = _family("qwen3")
    mlp = model.model.layers[0].mlp
    mlp.gate, mlp.router, mlp.scorer = (torch.nn.Linear(64, 4), torch.nn.Linear(64, 4), Router(64, 4))
    targets, _, left_out = auto_targets(model)
    assert not left_out
    assert {"gate", "router", "scorer"} <= set(targets)


PUBLISHED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
EXPERT_WEIGHTS = ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
# `auto` on every family of opsd/testing/families.py, as the earlier width rule resolved it (that rule
# never fired there: their routers are not nn.Linear): (target_modules, target_parameters).
FAMILY_TARGETS = {
    **{name: (PUBLISHED, []) for name in FAMILIES},
    "qwen3_5": (PUBLISHED + ["in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z", "out_proj"], []),
    "lfm2": (["q_proj", "k_proj", "v_proj", "in_proj", "out_proj", "w1", "w2", "w3"], []),
    "granitemoehybrid": (
        ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "input_linear", "output_linear"],
        [],
    ),
    "nemotron_h": (["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "in_proj"], []),
    "falcon_h1": (PUBLISHED + ["in_proj"], []),
    "phi3": (["o_proj", "down_proj", "gate_up_proj", "qkv_proj"], []),
    "deepseek_v3": (["o_proj", "kv_a_proj_with_mqa", "kv_b_proj", "q_a_proj", "q_b_proj"], EXPERT_WEIGHTS),
    "qwen3_moe": (["q_proj", "k_proj", "v_proj", "o_proj"], EXPERT_WEIGHTS),
    "bamba": (PUBLISHED + ["in_proj"], []),
}
# What `auto` leaves out of them: the Mamba mixers' out_proj, which their fused kernel reads directly.
FAMILY_LEFT_OUT = {
    "granitemoehybrid": "mamba.out_proj in layers 0, 2",
    "nemotron_h": "mixer.out_proj in layer 0",
    "falcon_h1": "mamba.out_proj in layers 0-1",
    "bamba": "mamba.out_proj in layer 0",
}


@pytest.mark.parametrize("name", FAMILIES)
def test_every_family_resolves_as_before_and_warns_about_what_it_leaves_out(name, caplog):
    """The repo's families resolve the targets they did before; the only linears left out are the Mamba mixers'
    `out_proj`, named with their layers in one WARNING."""
    model = _family(name)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        targets, parameters, left_out = auto_targets(model)
        resolve_targets(model, ["auto"])
    assert (targets, parameters) == FAMILY_TARGETS[name]
    assert all(n.endswith(".out_proj") and "fused kernel" in why for n, why in left_out.items()), left_out
    records = [r for r in caplog.records if "leaves these linear modules" in r.getMessage()]
    if name not in FAMILY_LEFT_OUT:
        assert not left_out and not records
        return
    (record,) = records
    assert record.levelno == logging.WARNING
    assert (
        f"leaves these linear modules without a LoRA adapter: {FAMILY_LEFT_OUT[name]} (its weight is read "
        "directly by a fused kernel)" in record.getMessage()
    )
