"""The rollout engine a run's trainer is handed: one object with a small protocol, built by the entry point
(`build_rollout_engine`) from the run's config.

    generate(prompt_ids, *, step, num_generations) -> (completion ids, sampled-token log-probs or None)
    push_weights(step)     the trainer's current weights into the engine (once per step that generates)
    sleep(level) / wake_up()
    probe()                a block whose rollouts are seeded as the probe's
    bind(trainer)          the trainer the engine serves, once its `__init__` is done (a vLLM engine starts here)

`TransformersRolloutEngine` (here) samples from the trained model itself; `VLLMRolloutEngine`
(`opsd.method.engine_vllm`, imported only with vLLM) builds TRL's vLLM engine itself, with OPSD's seeds, weight
pushes and settings, each a constructor argument (docs/decisions.md, "One engine, owned counters, private TRL
names" and "The engine's construction").
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


class TransformersRolloutEngine:
    """Training's rollouts from transformers' `generate` on the trainer's own model, in eval mode (no dropout, as
    the vLLM engine's), drawn from the global random state; no log-probs. The trainer binds it to its model once
    built (`bind`): the generation settings are the trainer's (TRL's `generation_config`)."""

    name = "transformers"

    def __init__(self):
        self.trainer = None

    def bind(self, trainer) -> None:
        """The trainer whose wrapped model, accelerator and generation settings the rollouts use."""
        self.trainer = trainer

    def generate(self, prompt_ids, *, step: int, num_generations: int):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        from opsd.method.hidden import eval_mode

        t = self.trainer
        device = t.accelerator.device
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        inputs = {
            "input_ids": pad(prompts, padding_value=t.processing_class.pad_token_id, padding_side="left").to(
                device
            ),
            "attention_mask": pad(
                [torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"
            ).to(device),
        }
        with (
            eval_mode(t.accelerator.unwrap_model(t.model)),
            unwrap_model_for_generation(
                t.model_wrapped, t.accelerator, gather_deepspeed3_params=t.args.ds3_gather_for_generation,
                generation_kwargs=t.generation_kwargs,
            ) as unwrapped,
            torch.no_grad(),
            FSDP.summon_full_params(t.model_wrapped, recurse=False) if t.is_fsdp_enabled else nullcontext(),
        ):  # fmt: skip
            ids = unwrapped.generate(**inputs, generation_config=t.generation_config)
        return completions_to_eos(ids[:, inputs["input_ids"].size(1) :], t.eos_token_ids), None

    def probe(self):
        """The probe's rollouts draw from the global random state too (the trainer forks it around them)."""
        return nullcontext()

    def push_weights(self, step: int) -> None:
        """Nothing to push: the rollouts come from the trained model itself."""

    def sleep(self, level: int = 1) -> None:
        """Nothing to free: the engine is the trained model."""

    def wake_up(self) -> None:
        """Nothing to restore (`sleep`)."""


def completions_to_eos(completion_ids_BC: torch.Tensor, eos_token_ids: list[int]) -> list[list[int]]:
    """Each row of generated ids up to and including its first end-of-sequence token (all of it without one)."""
    device = completion_ids_BC.device
    is_eos = torch.isin(completion_ids_BC, torch.tensor(eos_token_ids, device=device))
    eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long, device=device)
    eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
    seq_idx = torch.arange(is_eos.size(1), device=device).expand(is_eos.size(0), -1)
    keep = (seq_idx <= eos_idx.unsqueeze(1)).int()
    return [c[m].tolist() for c, m in zip(completion_ids_BC.cpu(), keep.bool().cpu(), strict=True)]


def build_rollout_engine(config, *, kv_cache_bytes: int | None = None):
    """The rollout engine a run's `config` asks for (`use_vllm`, settled by the configuration): a
    `VLLMRolloutEngine` (`opsd.method.engine_vllm`) with the run's seeds and settings, or a
    `TransformersRolloutEngine`. Built by the entry point and handed to the trainer; a trainer given none builds
    its own here."""
    if not config.use_vllm:
        return TransformersRolloutEngine()
    from opsd.method.engine import RolloutSeeds
    from opsd.method.engine_vllm import VLLMRolloutEngine

    return VLLMRolloutEngine(
        seeds=RolloutSeeds(config.seed),
        max_num_seqs=config.vllm_max_num_seqs,
        kv_cache_bytes=kv_cache_bytes,
        tensor_parallel_size=config.vllm_tensor_parallel_size,
        process_index=config.process_index,
        colocated=config.vllm_mode == "colocate",
        log_dir=config.output_dir,
    )
