"""Micro-batch plans (opsd.speed.microbatch): parsing (opsd.configuration.checks), divisibility, the
memory estimate and auto's choice, against hand-computed values."""

import logging
from types import SimpleNamespace

import pytest

from opsd.configuration.checks import parse_micro_batch_size
from opsd.configuration.switches import AUTO
from opsd.errors import InvalidValue
from opsd.speed import microbatch
from opsd.speed.microbatch import GIB, ModelShape, auto_micro_batch, estimate_micro_batch_bytes, plan_for
from opsd.testing.tiny import qwen3_1p7b_shape

QWEN3_1P7B = SimpleNamespace(**qwen3_1p7b_shape())


def cfg(**kw):
    """A config's micro-batch fields; micro_batch_size is parsed as OPSDConfig parses it."""
    base = dict(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=8,
        micro_batch_size="",
        max_completion_length=1024,
        gradient_checkpointing=True,
        loss_chunk_size=1024,
    )
    out = SimpleNamespace(**{**base, **kw})
    out.micro_batch_size = parse_micro_batch_size(out.micro_batch_size)
    return out


def test_shape_of_qwen3_1p7b():
    shape = ModelShape.from_config(QWEN3_1P7B)
    # per layer: q,o 2048x2048 each; k,v 2048x1024 each; MLP 3 x 2048x6144; one tied embedding 151936x2048
    per_layer = 2 * 2048 * 2048 + 2 * 2048 * 1024 + 3 * 2048 * 6144
    assert shape.params == 28 * per_layer + 151936 * 2048  # 1.72e9, the published size without norms
    assert (shape.layers, shape.hidden, shape.intermediate, shape.vocab) == (28, 2048, 6144, 151936)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", None), (None, None), ("auto", AUTO), ("AUTO", "auto"), ("8", 8), (" 2 ", 2), (8, 8)],
)
def test_parse(value, expected):
    assert parse_micro_batch_size(value) == expected


@pytest.mark.parametrize("value", ["0", "-4", "two", "1.5"])
def test_parse_refuses(value):
    with pytest.raises(ValueError, match="micro_batch_size"):
        parse_micro_batch_size(value)


def test_a_fixed_plan_keeps_a_problems_rollouts_together_when_the_unit_is_rollouts():
    """budget_unit=rollouts: a micro-batch counts rollouts, and TRL's holds whole groups of G."""
    rollouts = dict(budget_unit="rollouts", num_generations=4)
    assert plan_for(cfg(micro_batch_size="8", **rollouts)).micro_batch == 8
    with pytest.raises(InvalidValue, match="micro_batch_size=2 is not a multiple of num_generations=4"):
        plan_for(cfg(micro_batch_size="2", **rollouts))
    assert plan_for(cfg(micro_batch_size="2", budget_unit="problems", num_generations=4)).micro_batch == 2


def test_fixed_plans_keep_the_problems_per_process():
    assert plan_for(cfg()).micro_batch == 4 and plan_for(cfg()).accumulation == 8
    p = plan_for(cfg(micro_batch_size="16"))
    assert (p.micro_batch, p.accumulation, p.problems_per_process) == (16, 2, 32)
    with pytest.raises(InvalidValue, match=r"does not divide the 32 problems .* \[1, 2, 4, 8, 16, 32\]"):
        plan_for(cfg(micro_batch_size="12"))
    # auto without a GPU (no shape, no free memory) keeps the plan as given
    p = plan_for(cfg(micro_batch_size="auto"))
    assert (p.micro_batch, p.accumulation) == (4, 8) and "no GPU" in p.reason


def test_estimate_by_hand():
    shape = ModelShape(layers=2, hidden=4, intermediate=8, vocab=10, params=0)
    b = 2
    # checkpointing: student (H (L+1) + 6H + 2I) = 12 + 24 + 16 = 52 values per token; teacher 6H + 2I = 40;
    # hidden 3H = 12 per completion token; loss: min(chunk, m C) x V x (5 x 4 + 2 x 2) bytes
    got = estimate_micro_batch_bytes(
        shape, 3, student_tokens=7, teacher_tokens=9, completion_tokens=5, gradient_checkpointing=True,
        chunk_size=4,
    )  # fmt: skip
    assert got == 3 * (7 * b * 52 + 9 * b * 40 + 5 * b * 12) + 4 * 10 * 24
    # no checkpointing: every layer's activations, L (14H + 7I) = 2 x 112 values per token
    got = estimate_micro_batch_bytes(
        shape, 1, student_tokens=7, teacher_tokens=9, completion_tokens=5, gradient_checkpointing=False,
        chunk_size=100,
    )  # fmt: skip
    assert got == 7 * b * 224 + 9 * b * 40 + 5 * b * 12 + 5 * 10 * 24


def test_auto_takes_the_largest_that_fits_and_is_monotone():
    shape = ModelShape.from_config(QWEN3_1P7B)
    kw = dict(student_tokens=1124, teacher_tokens=1524, completion_tokens=1024, chunk_size=1024)
    sizes = [
        auto_micro_batch(32, shape, free_bytes=free * GIB, gradient_checkpointing=True, **kw).micro_batch
        for free in (0, 4, 8, 16, 50)
    ]
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == 32
    for free in (4, 8, 16, 50):
        p = auto_micro_batch(32, shape, free_bytes=free * GIB, gradient_checkpointing=True, **kw)
        budget = (free * GIB - microbatch.AUTO_RESERVE_BYTES) * microbatch.AUTO_MEMORY_SHARE
        assert p.micro_batch * p.accumulation == 32
        if p.micro_batch > 1:
            assert p.estimate_gib * GIB <= budget + 0.01 * GIB
        larger = [m for m in microbatch.divisors(32) if m > p.micro_batch]
        if larger:  # the next divisor would not have fitted
            need = estimate_micro_batch_bytes(shape, larger[0], gradient_checkpointing=True, **kw)
            assert need > budget
    # without checkpointing each row costs far more, so the same memory holds fewer rows
    off = auto_micro_batch(32, shape, free_bytes=16 * GIB, gradient_checkpointing=False, **kw).micro_batch
    on = auto_micro_batch(32, shape, free_bytes=16 * GIB, gradient_checkpointing=True, **kw).micro_batch
    assert off < on


def test_auto_stops_at_the_token_cap():
    shape = ModelShape.from_config(QWEN3_1P7B)
    p = auto_micro_batch(
        32, shape, free_bytes=1000 * GIB, student_tokens=2148, teacher_tokens=2548, completion_tokens=2048,
        gradient_checkpointing=True, chunk_size=1024,
    )  # fmt: skip
    assert p.micro_batch == 16 and 16 * 2148 <= microbatch.AUTO_MAX_TOKENS < 32 * 2148


def test_apply_rederives_the_generation_window(tmp_path):
    from opsd.configuration.config import OPSDConfig

    config = OPSDConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        report_to="none",
    )
    out = microbatch.apply(config, microbatch.fixed_plan(2, 1, "micro_batch_size"))
    assert (out.per_device_train_batch_size, out.gradient_accumulation_steps) == (1, 2)
    assert (out.steps_per_generation, out.generation_batch_size) == (2, 2)
    assert microbatch.apply(config, plan_for(config)) is config
    # The window follows steps_per_rollout (optimizer steps) through the new accumulation: 2 steps x 4.
    two = OPSDConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, steps_per_rollout=2, max_steps=4
    )
    out = microbatch.apply(two, microbatch.fixed_plan(4, 1, "micro_batch_size"))
    assert (out.steps_per_rollout, out.steps_per_generation, out.generation_batch_size) == (2, 8, 8)


def test_gpu_plan_reads_free_memory_shape_and_prompts(tiny_model_dir, tmp_path):
    """auto on a GPU: the memory left beside a 0.6 engine share and the weights, the model's shape from its
    config, and the longest prompts of the rows."""
    from transformers import AutoConfig, AutoTokenizer

    from opsd.configuration.config import OPSDConfig
    from opsd.method.prompts import PromptBuilder

    config = OPSDConfig(
        output_dir=str(tmp_path), report_to="none", micro_batch_size="auto", per_device_train_batch_size=4,
        gradient_accumulation_steps=8, max_completion_length=64,
    )  # fmt: skip
    rows = [{"prompt": "What is 2 + 3?" * k, "privileged_context": "It is 5. " * (3 * k)} for k in (1, 4, 2)]
    shape = ModelShape.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    builder = PromptBuilder(AutoTokenizer.from_pretrained(tiny_model_dir))
    student = max(len(builder.student_ids(r["prompt"])) for r in rows)
    teacher = max(len(builder.teacher_ids(r["prompt"], r["privileged_context"]).ids) for r in rows)
    assert teacher > student > 0
    total = 80 * GIB
    for free in (80 * GIB, 49 * GIB, 40 * GIB):
        plan = microbatch.gpu_plan(
            config,
            rows,
            str(tiny_model_dir),
            free_bytes=free,
            total_bytes=total,
            colocated_engine=True,
            prompt_builder=builder,
        )
        left = int(free - 0.6 * total - shape.params * 4)  # float32 weights: no bf16 without a GPU
        expected = plan_for(
            config, shape=shape, free_bytes=left, student_prompt_tokens=student, teacher_prompt_tokens=teacher
        )
        assert plan == expected and plan.reason.startswith("auto:")
    big = microbatch.gpu_plan(
        config,
        rows,
        str(tiny_model_dir),
        free_bytes=total,
        total_bytes=total,
        colocated_engine=True,
        prompt_builder=builder,
    )
    assert (big.micro_batch, big.accumulation) == (32, 1)  # a tiny model fits all 32 rows
    # less free memory than the engine's share: the smallest split
    small = microbatch.gpu_plan(
        config,
        rows,
        str(tiny_model_dir),
        free_bytes=40 * GIB,
        total_bytes=total,
        colocated_engine=True,
        prompt_builder=builder,
    )
    assert (small.micro_batch, small.accumulation) == (1, 32)
    # without an engine on the GPU the same memory holds everything
    alone = microbatch.gpu_plan(
        config,
        rows,
        str(tiny_model_dir),
        free_bytes=40 * GIB,
        total_bytes=total,
        colocated_engine=False,
        prompt_builder=builder,
    )
    assert alone.micro_batch == 32


def test_a_run_resolves_the_thinking_switch_once(tiny_model_dir, tmp_path, caplog):
    """A run's prompts are rendered by the micro-batch plan (auto, on a GPU) and by the trainer: with a chat
    template that reads no thinking switch, the run warns once, because both use the one builder
    opsd_train.py builds (each builder resolves the switch, and warns, when it is made)."""
    import shutil

    from transformers import AutoTokenizer

    from opsd.configuration.config import OPSDConfig
    from opsd.method.prompts import PromptBuilder
    from tests.conftest import make_trainer

    model_dir = tmp_path / "no-switch"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(model_dir)
    config = OPSDConfig(output_dir=str(tmp_path / "run"), report_to="none", micro_batch_size="auto")
    rows = [{"prompt": "What is 2 + 3?", "privileged_context": "It is 5."}]
    with caplog.at_level(logging.WARNING, logger="opsd.method.prompts"):
        builder = PromptBuilder.from_config(AutoTokenizer.from_pretrained(model_dir), config)
        microbatch.gpu_plan(
            config, rows, str(model_dir), free_bytes=80 * GIB, total_bytes=80 * GIB, colocated_engine=False,
            prompt_builder=builder,
        )  # fmt: skip
        trainer = make_trainer(model_dir, tmp_path / "run", prompt_builder=builder)
    assert trainer.prompt_builder is builder
    assert caplog.text.count("reads no enable_thinking variable") == 1
