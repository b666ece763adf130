"""How a process splits its share of an optimizer step into micro-batches: memory, not method.

A step's problems per process (`per_device_train_batch_size x gradient_accumulation_steps`) are rolled out at
once, each row with its own seed, and the loss is normalised by the valid tokens of the whole step across
micro-batches and processes (docs/method.md §1.5). So splitting those rows into m micro-batches of the same
total changes nothing but the order of float sums; a larger m only costs memory and saves time.

`micro_batch_size` chooses m and re-derives the accumulation from the problems per process. `OPSDConfig`
parses it once (`opsd.configuration.checks.parse_micro_batch_size`) into one of:
- None (unset, the default; "" reads as unset): `per_device_train_batch_size` as given;
- a positive integer: that m, which must divide the problems per process;
- `AUTO` ("auto"): on a GPU, the largest divisor whose estimated memory fits beside the colocated engine
  (`estimate_micro_batch_bytes`, from the model's shape and the step's sequence lengths) and whose student
  tokens stay under `AUTO_MAX_TOKENS`; without a GPU, the plan as given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from opsd import methods
from opsd.configuration.switches import AUTO
from opsd.errors import InvalidValue

logger = logging.getLogger(__name__)

GIB = 1 << 30
# Past this many student tokens per micro-batch the matrix products already fill an H200; larger micro-batches
# only add memory (docs/performance.md).
AUTO_MAX_TOKENS = 40 * 1024
# Share of the memory left beside the engine that the estimate may fill: allocator fragmentation, the CUDA
# context and NCCL buffers are not in it.
AUTO_MEMORY_SHARE = 0.8
AUTO_RESERVE_BYTES = 2 * GIB


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    params: int  # all weights, embeddings included

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers model config (its text config for multimodal models)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        h, i, v, n = text.hidden_size, text.intermediate_size, text.vocab_size, text.num_hidden_layers
        heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or h // heads
        kv = getattr(text, "num_key_value_heads", None) or heads
        attn = 2 * h * heads * head_dim + 2 * h * kv * head_dim
        embeddings = v * h * (1 if getattr(text, "tie_word_embeddings", False) else 2)
        return cls(layers=n, hidden=h, intermediate=i, vocab=v, params=n * (attn + 3 * h * i) + embeddings)


@dataclass(frozen=True)
class MicroBatchPlan:
    micro_batch: int
    accumulation: int
    problems_per_process: int
    reason: str
    estimate_gib: float | None = None  # estimated memory of one micro-batch beyond weights and engine
    budget_gib: float | None = None  # what auto allowed it

    def describe(self) -> str:
        return (
            f"micro-batch {self.micro_batch} x {self.accumulation} accumulation = {self.problems_per_process} "
            f"problems per process per step ({self.reason})"
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def estimate_micro_batch_bytes(
    shape: ModelShape,
    micro_batch: int,
    *,
    student_tokens: int,
    teacher_tokens: int,
    completion_tokens: int,
    gradient_checkpointing: bool,
    chunk_size: int,
    bytes_per_value: int = 2,
) -> int:
    """GPU memory one micro-batch's scoring, loss and backward adds to the weights and the engine (bytes).

    Student (with gradients), rows of `student_tokens`: with checkpointing, each layer's input is kept
    (L + 1 hidden vectors per token) and one layer's activations are live while it is recomputed
    (~6H + 2I values per token); without it, every layer's activations are kept (~14H + 7I per token and
    layer). Teacher (no gradients): one layer's activations at a time. Loss: the flattened hidden states and
    their gradient (N x H, N = completion tokens of the micro-batch) and about five float32 (chunk x V)
    buffers plus both roles' (chunk x V) logits. Constants are per-token value counts, so they carry over
    between model sizes; docs/performance.md compares the estimate with what was measured.
    """
    b, h, i, n_layers = bytes_per_value, shape.hidden, shape.intermediate, shape.layers
    if gradient_checkpointing:
        student = student_tokens * b * (h * (n_layers + 1) + 6 * h + 2 * i)
    else:
        student = student_tokens * b * n_layers * (14 * h + 7 * i)
    teacher = teacher_tokens * b * (6 * h + 2 * i)
    hidden = completion_tokens * b * h * 3
    chunk = min(chunk_size, micro_batch * completion_tokens)
    loss = chunk * shape.vocab * (5 * 4 + 2 * b)
    return micro_batch * (student + teacher + hidden) + loss


def auto_micro_batch(
    problems_per_process: int,
    shape: ModelShape,
    *,
    free_bytes: int,
    student_tokens: int,
    teacher_tokens: int,
    completion_tokens: int,
    gradient_checkpointing: bool,
    chunk_size: int,
) -> MicroBatchPlan:
    """The largest divisor of `problems_per_process` whose estimate fits in `free_bytes` (the memory that
    weights, optimizer and engine leave) within `AUTO_MEMORY_SHARE`, and whose student tokens stay under
    `AUTO_MAX_TOKENS`; 1 if none does (the smallest split there is)."""
    budget = max(free_bytes - AUTO_RESERVE_BYTES, 0) * AUTO_MEMORY_SHARE
    chosen, estimate = 1, None
    for m in divisors(problems_per_process):
        need = estimate_micro_batch_bytes(
            shape,
            m,
            student_tokens=student_tokens,
            teacher_tokens=teacher_tokens,
            completion_tokens=completion_tokens,
            gradient_checkpointing=gradient_checkpointing,
            chunk_size=chunk_size,
        )
        if m == 1 or (need <= budget and m * student_tokens <= AUTO_MAX_TOKENS):
            chosen, estimate = m, need
    reason = (
        f"auto: {free_bytes / GIB:.1f} GiB free beside the engine, {estimate / GIB:.1f} GiB estimated for "
        f"{chosen} rows of {student_tokens} student / {teacher_tokens} teacher tokens, checkpointing "
        f"{'on' if gradient_checkpointing else 'off'}"
    )
    return MicroBatchPlan(
        chosen,
        problems_per_process // chosen,
        problems_per_process,
        reason,
        estimate_gib=round(estimate / GIB, 2),
        budget_gib=round(budget / GIB, 2),
    )


def fixed_plan(problems_per_process: int, micro_batch: int, reason: str) -> MicroBatchPlan:
    if problems_per_process % micro_batch:
        raise InvalidValue(
            f"micro_batch_size={micro_batch} does not divide the {problems_per_process} problems per process "
            f"per step; choose one of {divisors(problems_per_process)} or auto"
        )
    return MicroBatchPlan(micro_batch, problems_per_process // micro_batch, problems_per_process, reason)


def apply(config, plan: MicroBatchPlan):
    """`config` with the plan's micro-batch and accumulation (the config derives TRL's window from them)."""
    if (config.per_device_train_batch_size, config.gradient_accumulation_steps) == (
        plan.micro_batch,
        plan.accumulation,
    ):
        return config
    return config.with_micro_batch(plan.micro_batch, plan.accumulation)


def plan_for(
    config,
    *,
    shape: ModelShape | None = None,
    free_bytes: int | None = None,
    student_prompt_tokens: int = 0,
    teacher_prompt_tokens: int = 0,
) -> MicroBatchPlan:
    """The plan for `config.micro_batch_size`; `free_bytes` (memory left beside weights and engine) and
    `shape` are only read by auto, which keeps the plan as given when they are None (no GPU)."""
    per_device = config.per_device_train_batch_size
    per_process = per_device * config.gradient_accumulation_steps
    choice = config.micro_batch_size  # parsed by the config (`parse_micro_batch_size`)
    if choice is None:
        return fixed_plan(per_process, per_device, "per_device_train_batch_size")
    if choice != AUTO:
        rollouts = getattr(config, "budget_unit", "problems") == "rollouts"
        G = config.num_generations if rollouts else 1
        if choice % G:  # budget_unit=rollouts: TRL's micro-batch is whole groups of G rollouts
            raise InvalidValue(
                f"micro_batch_size={choice} is not a multiple of num_generations={G}: with budget_unit=rollouts a "
                f"micro-batch counts rollouts, and a problem's G rollouts share one; give a multiple of {G} that "
                f"divides the {per_process} rollouts per process per step, or auto"
            )
        return fixed_plan(per_process, choice, "micro_batch_size")
    if shape is None or free_bytes is None:
        return fixed_plan(per_process, per_device, "auto: no GPU, the plan as given")
    completion = config.max_completion_length
    return auto_micro_batch(
        per_process,
        shape,
        free_bytes=free_bytes,
        student_tokens=student_prompt_tokens + completion,
        teacher_tokens=teacher_prompt_tokens + completion,
        completion_tokens=completion,
        gradient_checkpointing=config.gradient_checkpointing,
        chunk_size=config.loss_chunk_size,
    )


def prompt_token_lengths(rows, prompt_builder, sample: int = 256) -> tuple[int, int]:
    """Longest student and teacher prompt (tokens) over up to `sample` evenly spaced training rows."""
    n = len(rows)
    picked = sorted({k * n // sample for k in range(sample)}) if n > sample else range(n)
    student = teacher = 0
    for k in picked:
        row = rows[k]
        student = max(student, len(prompt_builder.student_ids(row["prompt"])))
        teacher = max(teacher, len(prompt_builder.teacher_ids(row["prompt"], row["privileged_context"]).ids))
    return student, teacher


def resolve(config, rows, model_path: str | None, *, colocated_engine: bool, prompt_builder):
    """(config with the resolved micro-batch, the plan), for `opsd_train.py` before the model loads.

    auto reads the GPU's free memory (the minimum over processes, so all agree on the accumulation), the
    model's config and, with `rows` and the run's `prompt_builder`, the longest prompts of a sample of them;
    without rows (a hub dataset in a dry run, which passes no builder) it assumes the teacher prompt cap for both roles. `model_path` None (a dry run,
    which reads neither the hub nor the GPU) leaves the choice to the real run.
    """
    import torch

    if config.micro_batch_size != AUTO or not torch.cuda.is_available():
        plan = plan_for(config)
        return apply(config, plan), plan
    if not methods.get(
        config.method
    ).memory_model:  # auto's memory model is OPSD's step (student + teacher rows)
        per_process = config.per_device_train_batch_size * config.gradient_accumulation_steps
        plan = fixed_plan(
            per_process, config.per_device_train_batch_size, f"auto: method={config.method}, as given"
        )
        return apply(config, plan), plan
    if model_path is None:
        per_process = config.per_device_train_batch_size * config.gradient_accumulation_steps
        plan = fixed_plan(
            per_process, config.per_device_train_batch_size, "auto: chosen when training starts"
        )
        return config, plan
    from accelerate import PartialState

    device = PartialState().device  # this process's GPU, not the first one
    free, total = torch.cuda.mem_get_info(device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        t = torch.tensor([free], device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        free = int(t.item())
    plan = gpu_plan(
        config,
        rows,
        model_path,
        free_bytes=free,
        total_bytes=total,
        colocated_engine=colocated_engine,
        prompt_builder=prompt_builder,
    )
    return apply(config, plan), plan


def gpu_plan(
    config,
    rows,
    model_path: str,
    *,
    free_bytes: int,
    total_bytes: int,
    colocated_engine: bool,
    prompt_builder,
):
    """auto's plan on a GPU with `free_bytes` free of `total_bytes`, before the model and the engine load.
    `prompt_builder` is the run's own (opsd_train.py), not one built here: a second builder would resolve
    thinking_switch a second time (and warn twice about a template without one)."""
    from transformers import AutoConfig

    shape = ModelShape.from_config(
        AutoConfig.from_pretrained(
            model_path, revision=config.model_revision, trust_remote_code=config.trust_remote_code
        )
    )
    b = 2 if config.bf16 or config.dtype in ("bfloat16", "float16") else 4
    weights = shape.params * b
    if not config.use_peft:  # fp32 master copy, gradients and two Adam moments
        weights += shape.params * 16
        if config.teacher_mode != "fixed":
            weights += shape.params * b  # a separate teacher copy
    engine = config.vllm_gpu_memory_utilization * total_bytes if colocated_engine else 0
    cap = config.max_teacher_prompt_length or 4096
    student_p, teacher_p = cap, cap
    if rows is not None and len(rows):
        student_p, teacher_p = prompt_token_lengths(rows, prompt_builder)
    return plan_for(
        config,
        shape=shape,
        free_bytes=int(free_bytes - engine - weights),
        student_prompt_tokens=student_p,
        teacher_prompt_tokens=teacher_p,
    )
