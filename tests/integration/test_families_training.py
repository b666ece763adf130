"""The trainer on every architecture family of `opsd.testing.families` (transformers rollouts, in this process): its
loss is the divergence of the model's own logits, LoRA `auto` reaches every layer kind, and two optimizer steps
change every layer kind's adapters. The same steps with colocated vLLM are tests/e2e/test_families_vllm.py."""

from __future__ import annotations

import logging

import pytest
import torch

from opsd.method.hidden import IDENTITY, LogitTransform, positions
from opsd.method.lora_targets import coverage, log_coverage, resolve_targets
from opsd.testing import reference_loss
from opsd.testing.families import FAMILIES, build_family
from opsd.testing.tiny import build_tokenizer
from tests.conftest import make_trainer

PUBLISHED = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# What each family applies after its lm_head (opsd/testing/families.py gives Granite logits_scaling 8, Gemma a
# soft-cap 5).
TRANSFORMS = {"granitemoehybrid": LogitTransform(1 / 8.0, 0.0), "gemma3": LogitTransform(1.0, 5.0)}


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
def test_loss_is_the_divergence_of_the_models_own_logits(family, family_dirs, tmp_path):
    trainer = _trainer(family_dirs[family], tmp_path, clip_mode="none", beta=0.5)
    torch.manual_seed(0)
    batch = trainer._prepare_training_batch([trainer.train_dataset[i] for i in range(2)])
    c_ids, c_mask = batch["completion_ids"], batch["completion_mask"]
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
        assert trainer.logit_transform == TRANSFORMS.get(family, IDENTITY)
        width = batch["teacher_input_ids"].size(1) - c_ids.size(1)
        student = _own_logits(trainer.model, batch["prompt_ids"], batch["prompt_mask"], c_ids, c_mask)
        with trainer._get_teacher_context_for_self_distillation():
            teacher = _own_logits(
                trainer.teacher_model,
                batch["teacher_input_ids"][:, :width],
                batch["teacher_attention_mask"][:, :width],
                c_ids,
                c_mask,
            )
    loss_N, _ = reference_loss.token_divergence(
        student, teacher, settings=trainer.args.loss_settings(), target_ids_N=None
    )
    assert loss_N.numel() == int(batch["num_loss_tokens"][0]) > 0
    torch.testing.assert_close(loss, loss_N.mean(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_steps_change_the_adapters_of_every_layer_kind(family, family_dirs, tmp_path):
    trainer = _trainer(family_dirs[family], tmp_path)
    model = trainer.accelerator.unwrap_model(trainer.model)
    kinds = coverage(model)
    assert kinds and all(states["adapted"] for states in kinds.values()), kinds
    before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert trainer.state.global_step == 2
    changed = {n for n, p in model.named_parameters() if "lora_B" in n and not torch.equal(p, before[n])}
    layers = {int(n.split(".layers.")[1].split(".")[0]) for n in changed}
    assert layers == set(range(model.config.get_text_config().num_hidden_layers)), sorted(changed)


@pytest.mark.parametrize("family", ["qwen3", "olmo3", "smollm3", "gemma3"])
def test_auto_is_the_published_projections_on_dense_families(family, family_dirs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(family_dirs[family])
    assert resolve_targets(model, ["auto"]) == PUBLISHED


def test_auto_reaches_the_projections_a_fixed_list_misses(family_dirs, caplog):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    qwen35 = AutoModelForCausalLM.from_pretrained(family_dirs["qwen3_5"])
    auto = set(resolve_targets(qwen35, ["auto"]))
    assert {"in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"} <= auto
    nemotron = AutoModelForCausalLM.from_pretrained(family_dirs["nemotron_h"])
    targets = resolve_targets(nemotron, ["auto"])
    assert "in_proj" in targets and "out_proj" not in targets  # its fused Mamba kernel reads out_proj.weight
    get_peft_model(nemotron, LoraConfig(r=4, target_modules=targets))  # peft accepts what auto picked

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
            get_peft_model(model, LoraConfig(r=4, target_modules=resolve_targets(model, targets)))
    with pytest.raises(ValueError, match="not from peft"), peft_refusal(targets, model):
        raise ValueError("not from peft")  # other errors keep their own message and traceback


@pytest.mark.parametrize("family", ["granitemoehybrid", "qwen3_5", "lfm2"])
def test_synced_weights_are_the_merged_checkpoint_on_disk(family, family_dirs, tmp_path):
    """What the trainer pushes into the engine (`merged_named_weights`) is what save_pretrained writes for the
    merged model, name for name: the engine reads checkpoint names (Granite's MoE weights are renamed on load)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from opsd.method.engine import merged_named_weights

    model = AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=resolve_targets(model, ["auto"])))
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
    assert any(not torch.equal(disk[n], base[n]) for n in base)  # the adapter moved the merged weights
