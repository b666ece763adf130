"""Every numeric switch of a training step at each end of the range the checks accept, through a step of the tiny
model on the CPU: no value the checks let through may make step 1 raise (-1e308 for fixed_advantage once died with
"cannot be converted to type float without overflow"), skip it as non-finite (-1e38 once skipped every step,
silently), or leave a weight non-finite for the next step (adam_epsilon=0: Adam's 0 / 0 where a gradient is 0).

The ends come from the ranges the switches declare (opsd/configuration/switches.py), so a bound that moves is swept
where it moves; an end the table leaves open is swept at the largest number it accepts. A step costs about a
second on two busy cores, so the switches go together: one step with every switch at its low end, one with every
switch at its high end (harder than one at a time: the extremes meet), and alone the ends that would hide the
others (a learning rate of 5e-324 or an Adam epsilon of 1.8e308 moves no weight, a skip of every token leaves
no loss) and the switches that
change what the step computes (fixed_advantage reads no teacher, sd_weight is GRPO's). loss_temperature's third
accepted value, 0, is its default: every step that leaves it alone takes it."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from opsd.configuration.sources import field_specs
from opsd.configuration.switches import OPERATIONAL_KEYS, RANGES, RECIPE_KEYS, Range

# Numeric fields of the range table a run's recipe or operational settings set (and adam_epsilon, a flag) that
# the step does not read, or that one step cannot take to an end; each with why.
NOT_SWEPT = {
    "max_completion_length": "a rollout length: its end (4096 tokens under the harness) is a long generation",
    "steps_per_rollout": "it divides max_steps: 1 is its only value in a one-step run",
    "warmup_steps": "below max_steps: swept by hand (0 and just under the one step)",
    "wavg_last": "read by the tail average opsd_train.py adds at the end of a run, not by the step",
    "probe_steps": "read by the probe opsd_train.py adds (tests/integration/test_probe.py), not by the step",
    "max_nonfinite_steps": "counts skipped steps; it changes no arithmetic",
    "logging_steps": "when metrics are logged; it changes no arithmetic",
    "completions_steps": "how often the completions log is written (1 in every step here, for completions_rows)",
    "vllm_gpu_memory_utilization": "the vLLM engine's; a CPU step rolls out with transformers",
    "vllm_max_num_seqs": "the vLLM engine's; a CPU step rolls out with transformers",
    "num_generations": "rollouts per problem: a batch's size, bounded for memory (tests/e2e/test_config_ranges.py), "
    "and method=opsd, the other switches' step, takes 1",
}
# What every grouped step sets, so that the switches that need it act: the EMA teacher (ema_decay) and the
# completions log (completions_rows).
GROUPED = {"teacher_mode": "ema", "completions_steps": 1}
# Ends that would hide the others' arithmetic: each gets a step of its own.
HIDING = {("learning_rate", "low"), ("adam_epsilon", "high"), ("divergence_clip", "low"),
          ("num_loss_tokens_to_skip", "high"), ("lora_dropout", "high")}  # fmt: skip
# Switches whose context changes what the step computes: each end alone, in that context.
ALONE = {
    "fixed_advantage": {"loss_type": "fixed_advantage"},
    "sd_weight": {"method": "hybrid", "num_generations": 2},
    "epsilon_high": {"method": "grpo", "num_generations": 2},  # GRPO's settings: method=opsd refuses them
    "rl_beta": {"method": "grpo", "num_generations": 2},
}
HUGE_INT = 10**100  # an integer end the table leaves open
# The contrastive teacher's switches, at their ends together, with the teacher they need: the target's under OPSD
# with a shuffled hint; the modulation's under the hybrid (shuffled: every row has a hint pair); the number of
# sibling hints under the hybrid with its own hints.
CONTRAST = {
    "target": ({"teacher_contrast": "shuffled"},
               ("contrast_weight", "contrast_top_k", "contrast_log_floor", "contrast_kl_tau")),
    "modulation": ({"method": "hybrid", "num_generations": 2, "teacher_contrast": "shuffled"},
                   ("contrast_rl_weight", "contrast_rl_tau", "contrast_rl_delta")),
    "sibling hints": ({"method": "hybrid", "num_generations": 2, "teacher_contrast": "own_wrong"},
                      ("contrast_hints",)),
}  # fmt: skip


def swept() -> list[str]:
    numeric = {name for name, spec in field_specs().items() if spec.kind in ("int", "float")}
    names = (RECIPE_KEYS | OPERATIONAL_KEYS | {"adam_epsilon"}) & numeric & set(RANGES)
    # The contrastive teacher's switches are swept by their own tests, with the teacher they need.
    return sorted(n for n in names if n not in NOT_SWEPT and not n.startswith("contrast_"))


def end(name: str, side: str) -> float | int:
    """The smallest (`side` low) or the largest (high) value `RANGES[name]` accepts."""
    r: Range = RANGES[name]
    integer = field_specs()[name].kind == "int"
    bound, is_open, towards = (r.lo, r.lo_open, math.inf) if side == "low" else (r.hi, r.hi_open, -math.inf)
    if bound is None:
        value = (HUGE_INT if integer else sys.float_info.max) * (1 if side == "high" else -1)
    elif is_open:
        value = int(bound) + (1 if side == "low" else -1) if integer else math.nextafter(bound, towards)
    else:
        value = int(bound) if integer else float(bound)
    assert r.contains(value), (name, side, value)
    return value


def steps() -> list[tuple[str, dict]]:
    """(what, the settings of one step) of the sweep."""
    out = []
    for side in ("low", "high"):
        together = {n: end(n, side) for n in swept() if n not in ALONE and (n, side) not in HIDING}
        out.append((f"every switch at its {side} end", {**GROUPED, **together}))
    out += [(f"{n} at its {side} end", {n: end(n, side)}) for n, side in sorted(HIDING)]
    out += [
        (f"{n} at its {side} end", {**c, n: end(n, side)})
        for n, c in ALONE.items()
        for side in ("low", "high")
    ]
    out += [
        (
            f"the contrastive {what} switches at their {side} ends",
            {**context, **{n: end(n, side) for n in names}},
        )
        for what, (context, names) in CONTRAST.items()
        for side in ("low", "high")
    ]
    out.append(("warmup over all but 1e-16 of the step", {"warmup_steps": math.nextafter(1.0, 0.0)}))
    # The adapter's largest scale, lora_alpha / lora_r: the high end of one over the low end of the other.
    out.append(
        ("the largest LoRA scale", {"lora_alpha": end("lora_alpha", "high"), "lora_r": end("lora_r", "low")})
    )
    return out


def test_the_sweep_covers_every_numeric_switch() -> None:
    numeric = {name for name, spec in field_specs().items() if spec.kind in ("int", "float")}
    switches = {
        n for n in (RECIPE_KEYS | OPERATIONAL_KEYS) & numeric & set(RANGES) if not n.startswith("contrast_")
    }
    assert set(NOT_SWEPT) <= switches, "NOT_SWEPT names a field that is not a numeric switch"
    assert switches == (set(swept()) | set(NOT_SWEPT)) - {"adam_epsilon"}
    assert {"fixed_advantage", "sd_weight", "temperature", "loss_temperature", "lora_alpha"} <= set(swept())
    contrast = {
        n for n in (RECIPE_KEYS | OPERATIONAL_KEYS) & numeric & set(RANGES) if n.startswith("contrast_")
    }
    assert contrast == {n for _, names in CONTRAST.values() for n in names}
    # Every switch at both its ends in some step.
    for name in [*swept(), *sorted(contrast)]:
        for side in ("low", "high"):
            assert any(settings.get(name) == end(name, side) for _, settings in steps()), (name, side)


def one_step(model_dir, out_dir, **settings) -> tuple[dict, bool]:
    """(the step's logged record, whether every trainable weight is finite after it) of one optimizer step of the
    trainer `settings` choose, with LoRA as the settings give it (rank, alpha, dropout on q and v)."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd import methods
    from opsd.configuration.config import OPSDConfig
    from opsd.launch.preflight import build_paired_dataset

    base = dict(output_dir=str(out_dir), max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=1,
                max_completion_length=4, use_vllm=False, save_strategy="no", gradient_checkpointing=False,
                report_to=[], probe_size=0, disable_tqdm=True)  # fmt: skip
    cfg = OPSDConfig(**{**base, **settings})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")  # fmt: skip
    trainer = methods.get(cfg.method).trainer_class()(
        model=model, args=cfg, train_dataset=build_paired_dataset(cfg)[0],
        processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=lora,
    )  # fmt: skip
    trainer.train()
    weights = [p for p in trainer.model.parameters() if p.requires_grad]
    return trainer.state.log_history[0], all(bool(torch.isfinite(p).all()) for p in weights)


STEPS = steps()


@pytest.mark.parametrize("settings", [settings for _, settings in STEPS], ids=[what for what, _ in STEPS])
def test_one_step_at_the_ends_of_every_range(tiny_model_dir, tmp_path, settings) -> None:
    record, finite = one_step(tiny_model_dir, tmp_path, **settings)
    assert math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"]), (settings, record)
    assert record.get("train/nonfinite_skipped", 0) == 0, (settings, record)
    assert finite, f"{settings} left a weight non-finite for the next step"
