"""The trainer on every architecture family of `opsd.testing.families` (transformers rollouts, in this process): its
loss is the divergence of the model's own logits, LoRA `auto` reaches every layer kind (on the MoE types where
peft moves expert-named targets too), and two optimizer steps change every layer kind's adapters. The same steps
with colocated vLLM are tests/e2e/test_families_vllm.py."""

from __future__ import annotations

import logging

import pytest
import torch

from opsd.method.hidden import IDENTITY, LogitTransform, positions
from opsd.method.lora_targets import coverage, layer_kinds, log_coverage, resolve_targets
from opsd.method.loss import loss_settings
from opsd.testing import reference_loss
from opsd.testing.families import FAMILIES, build_family
from opsd.testing.tiny import build_tokenizer
from tests.conftest import make_trainer

PUBLISHED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# What each family applies after its lm_head (opsd/testing/families.py: Granite's logits_scaling 8 divides, Gemma's
# soft-cap is 5, Cohere's logit_scale 4 and Falcon-H1's lm_head_multiplier 0.25 multiply).
TRANSFORMS = {
    "granitemoehybrid": LogitTransform(1 / 8.0, 0.0),
    "granite": LogitTransform(1 / 8.0, 0.0),
    "gemma3": LogitTransform(1.0, 5.0),
    "gemma2": LogitTransform(1.0, 5.0),
    "cohere": LogitTransform(4.0, 0.0),
    "cohere2": LogitTransform(4.0, 0.0),
    "falcon_h1": LogitTransform(0.25, 0.0),
}
# The MoE families whose expert-named linears peft moves onto the routed experts' fused weights.
FUSED_MOE = ("deepseek_v3", "qwen3_moe")


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-models")
    tok = build_tokenizer(root / "tokenizer")
    return {name: build_family(name, root / name, tokenizer=tok) for name in FAMILIES}


def _trainer(model_dir, out_dir, **overrides):
    return make_trainer(model_dir, out_dir, targets=["auto"], report_to="none", **overrides)


def _own_logits(model, prompt_ids, prompt_mask, c_ids, c_mask):
    """The model's own output logits (transform included) at the positions that predict each completion token."""
    width = prompt_ids.size(1)
    out = model(
        input_ids=torch.cat([prompt_ids, c_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, c_mask], dim=1),
        position_ids=positions(prompt_mask, c_ids.size(1)),
        use_cache=False,
    )
    return out.logits[:, width - 1 : width - 1 + c_ids.size(1)][c_mask.bool()]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_loss_is_the_models_own_divergence_and_two_steps_change_every_layer_kind(
    family, family_dirs, tmp_path
):
    """One trainer per family (building it is most of the cost): the loss of a batch equals the divergence of the
    model's own output logits (its logit transform included), then two optimizer steps change the adapters of
    every layer."""
    trainer = _trainer(family_dirs[family], tmp_path, clip_mode="none", beta=0.5)
    torch.manual_seed(0)
    batch = trainer.rollout_batch([trainer.train_dataset[i] for i in range(2)])
    c_ids, c_mask = batch["completion_ids"], batch["completion_mask"]
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
        assert trainer.logit_transform == TRANSFORMS.get(family, IDENTITY)
        width = batch["teacher_input_ids"].size(1) - c_ids.size(1)
        student = _own_logits(trainer.model, batch["prompt_ids"], batch["prompt_mask"], c_ids, c_mask)
        with trainer.teacher_context():
            teacher = _own_logits(
                trainer.teacher_model,
                batch["teacher_input_ids"][:, :width],
                batch["teacher_attention_mask"][:, :width],
                c_ids,
                c_mask,
            )
    loss_N, _ = reference_loss.token_divergence(
        student, teacher, settings=loss_settings(trainer.args), target_ids_N=None
    )
    assert loss_N.numel() == int(batch["num_loss_tokens"][0]) > 0
    torch.testing.assert_close(loss, loss_N.mean(), atol=1e-6, rtol=1e-5)

    model = trainer.accelerator.unwrap_model(trainer.model)
    kinds = coverage(model)
    assert kinds and all(states["adapted"] for states in kinds.values()), kinds
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert trainer.state.global_step == 2
    changed = {n for n, p in model.named_parameters() if "lora_B" in n and not torch.equal(p, before[n])}
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n in changed}
    assert layers == set(range(model.config.get_text_config().num_hidden_layers)), sorted(changed)


@pytest.mark.parametrize(
    "family", ["qwen3", "olmo3", "smollm3", "gemma3", "llama", "granite", "cohere", "gemma2"]
)
def test_auto_is_the_published_projections_on_dense_families(family, family_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_dirs[family])
    assert resolve_targets(model, ["auto"]) == {"target_modules": PUBLISHED}


def test_auto_reaches_the_projections_a_fixed_list_misses(family_dirs, caplog):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    qwen35 = AutoModelForCausalLM.from_pretrained(family_dirs["qwen3_5"])
    auto = set(resolve_targets(qwen35, ["auto"])["target_modules"])
    assert {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"} <= auto
    nemotron = AutoModelForCausalLM.from_pretrained(family_dirs["nemotron_h"])
    targets = resolve_targets(nemotron, ["auto"])
    assert "in_proj" in targets["target_modules"] and "out_proj" not in targets["target_modules"]  # its fused
    get_peft_model(
        nemotron, LoraConfig(r=4, **targets)
    )  # Mamba kernel reads out_proj.weight; peft accepts the rest

    # The published list on a Mamba hybrid leaves its Mamba layers without an adapter: a warning, not silence.
    granite = get_peft_model(
        AutoModelForCausalLM.from_pretrained(family_dirs["granitemoehybrid"]),
        LoraConfig(r=4, target_modules=PUBLISHED),
    )
    with caplog.at_level(logging.INFO):
        log_coverage(granite)
    # Granite's config names its Mamba layers' kind linear_attention
    assert "no LoRA adapter in the linear_attention layers (linear modules mamba.in_proj" in caplog.text
    assert coverage(granite)["linear_attention"]["adapted"] == []


@pytest.mark.parametrize("targets", [["all-linear"], ["no_such_proj"]])
def test_targets_peft_refuses_are_one_line_naming_auto(family_dirs, targets):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from opsd.errors import UnsupportedModel
    from opsd.method.lora_targets import peft_refusal

    model = AutoModelForCausalLM.from_pretrained(family_dirs["nemotron_h"])
    with pytest.raises(
        UnsupportedModel, match="peft refuses lora_target_modules=.* on this 'nemotron_h' model"
    ):
        with peft_refusal(targets, model):
            get_peft_model(model, LoraConfig(r=4, **resolve_targets(model, targets)))
    with pytest.raises(ValueError, match="not from peft"), peft_refusal(targets, model):
        raise ValueError("not from peft")  # other errors keep their own message and traceback


@pytest.mark.parametrize(
    "family, targets",
    [
        ("granitemoehybrid", ["auto"]),
        ("qwen3_5", ["auto"]),
        ("lfm2", ["auto"]),
        ("deepseek_v3", ["auto"]),  # dense and shared-expert linears adapted through their weights
        ("qwen3_moe", PUBLISHED),  # peft moves gate/up/down onto the routed experts' fused weights
    ],
)
def test_synced_weights_are_the_merged_checkpoint_on_disk(family, targets, family_dirs, tmp_path):
    """What the trainer pushes into the engine (`merged_named_weights`) is what save_pretrained writes for the
    merged model, name for name: the engine reads checkpoint names (Granite's MoE weights are renamed on load,
    Qwen3-MoE's and DeepSeek-V3's experts fused), whatever peft wrapped (modules, a linear's weight, fused
    expert parameters), and the buffers a checkpoint holds (DeepSeek-V3's router bias)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from opsd.method.engine import merged_named_weights

    model = AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, **resolve_targets(model, targets)))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.1)  # a trained adapter: the merge must show in the pushed weights
    synced = dict(merged_named_weights(peft))
    copy.deepcopy(peft).merge_and_unload().save_pretrained(tmp_path / "merged")
    disk = load_file(tmp_path / "merged" / "model.safetensors")
    assert sorted(synced) == sorted(disk)
    for name, tensor in disk.items():
        torch.testing.assert_close(synced[name], tensor, atol=1e-6, rtol=1e-6, msg=name)
    base = load_file(family_dirs[family] / "model.safetensors")
    moved = {n for n in base if not torch.equal(disk[n], base[n])}
    assert moved  # the adapter moved the merged weights
    if family == "qwen3_moe":
        assert any(".experts." in n for n in moved), sorted(moved)


def _linears_in_layers(model) -> set[str]:
    """Every nn.Linear inside the decoder layers, by full name: what `auto` should adapt on these MoE families
    (their routers and routed experts are not nn.Linear)."""
    return {
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n
    }  # fmt: skip


def _wrapped(peft_model) -> set[str]:
    """Full names (in the base model's naming) of the modules peft gave an adapter, whether it wrapped the module
    or one of its parameters."""
    from peft.tuners.lora import LoraLayer

    names = set()
    for name, module in peft_model.get_base_model().named_modules():
        if isinstance(module, LoraLayer) and ".base_layer" not in name:
            names.add(name)
    return names


@pytest.mark.parametrize("family", FUSED_MOE)
def test_auto_adapts_the_dense_and_shared_linears_peft_would_move(family, family_dirs, caplog):
    """On DeepSeek-V3 and Qwen3-MoE, peft rewrites targets named gate_proj/up_proj/down_proj into the routed
    experts' fused parameters. `auto` still adapts every linear module of the decoder layers (the first layer's
    dense MLP, DeepSeek-V3's shared expert) and nothing of the routed experts; the published list, given as is,
    adapts the experts instead and leaves those linears without adapter, with a warning."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def fresh():
        return AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32)

    model = fresh()
    linears = _linears_in_layers(model)
    mlp = {n for n in linears if ".mlp." in n}
    experts = {
        n for n, _ in model.named_modules() if n.endswith(".mlp.experts")
    }  # one fused module per layer
    # 2 layers: layer 0's dense MLP (3 linears), and DeepSeek-V3's shared expert in layer 1 (3 more)
    assert len(mlp) == (6 if family == "deepseek_v3" else 3) and len(experts) == 1, sorted(mlp)
    auto = get_peft_model(model, LoraConfig(r=4, **resolve_targets(model, ["auto"])))
    assert _wrapped(auto) == linears  # and so nothing of the routed experts
    kinds = layer_kinds(auto.get_base_model())
    assert len(set(kinds)) == 2 and kinds[0].endswith("MLP)"), kinds  # dense and MoE layers told apart

    listed = get_peft_model(fresh(), LoraConfig(r=4, target_modules=PUBLISHED))
    named = {
        n for n in linears - mlp if n.rpartition(".")[2] in PUBLISHED
    }  # DeepSeek's MLA matches o_proj only
    assert _wrapped(listed) == named | experts
    with caplog.at_level(logging.INFO, logger="opsd.method.lora_targets"):
        log_coverage(listed)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # one per layer kind with dense linears left out: the dense layer's MLP (and DeepSeek's MLA projections,
    # which the published names do not match, in both kinds)
    assert len(warnings) == (2 if family == "deepseek_v3" else 1), warnings
    dense = f"the {kinds[0]} layers' linear modules mlp.down_proj, mlp.gate_proj, mlp.up_proj"
    assert any(w.startswith(dense) for w in warnings), warnings
    assert all(
        f"model type {family!r}" in w and "lora_target_modules=auto adapts them" in w for w in warnings
    )
    assert "dense linears without an adapter: mlp.down_proj, mlp.gate_proj, mlp.up_proj" in caplog.text


def test_auto_refuses_dropout_where_it_adapts_weights(family_dirs):
    """peft's parameter adapters take no dropout: with lora_dropout set, `auto` on DeepSeek-V3 is refused in one
    line naming both ways out, instead of peft's error from inside get_peft_model."""
    from transformers import AutoModelForCausalLM

    from opsd.errors import UnsupportedModel

    model = AutoModelForCausalLM.from_pretrained(family_dirs["deepseek_v3"])
    with pytest.raises(UnsupportedModel) as refused:
        resolve_targets(model, ["auto"], lora_dropout=0.05)
    line = str(refused.value)
    assert "\n" not in line and "'deepseek_v3'" in line and "set lora_dropout 0" in line
    assert "lora_target_modules=o_proj,kv_a_proj_with_mqa,kv_b_proj,q_a_proj,q_b_proj" in line
    assert resolve_targets(model, PUBLISHED, lora_dropout=0.05) == {"target_modules": PUBLISHED}  # as given
