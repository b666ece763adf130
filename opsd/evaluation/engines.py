"""The sampling engine of a run: vLLM (the adapter served as a LoRA or merged first) or transformers."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from opsd.errors import UserError
from opsd.evaluation.job import EvalJob
from opsd.method.engine_env import kv_cache_bytes

logger = logging.getLogger(__name__)


def _vllm_lora_rank(r: int) -> int:
    """vLLM accepts a fixed set of max_lora_rank values; the smallest one that holds rank r."""
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    try:
        import typing

        from vllm.config.lora import MaxLoRARanks

        allowed = tuple(sorted(typing.get_args(MaxLoRARanks)))
    except ImportError:
        pass
    fit = [a for a in allowed if a >= r]
    if not fit:
        raise UserError(
            f"LoRA rank r={r} exceeds vLLM's largest max_lora_rank {allowed[-1]}; use --merge-adapter"
        )
    return fit[0]


def _merge(model_path: str, adapter_path: str):
    """The base model with the adapter merged in (peft), on the CPU in the checkpoint's dtype."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")
    return PeftModel.from_pretrained(base, adapter_path).merge_and_unload()


def build_engine(job: EvalJob, scratch: Path):
    """(engine, lora_path for generate); the adapter is served, merged or loaded as `job.settings` says."""
    settings, tokenizer = job.settings, job.tokenizer
    model_path, adapter_path = settings.model_path, settings.adapter_path
    if settings.engine_used == "vllm":
        from opsd.evaluation.sampling import VLLMEngine

        load_path, enable_lora, rank = model_path, False, 16
        if settings.adapter_mode == "merged":
            load_path = str(scratch)
            logger.info("merging %s into %s for vLLM", adapter_path, scratch)
            _merge(model_path, adapter_path).save_pretrained(load_path)
            tokenizer.save_pretrained(load_path)
        elif adapter_path:
            if not settings.adapter_rank:
                raise UserError(
                    f"{adapter_path}/adapter_config.json names no LoRA rank r; use --merge-adapter"
                )
            enable_lora, rank = True, _vllm_lora_rank(int(settings.adapter_rank))
        try:
            engine = VLLMEngine(
                load_path,
                max_model_len=settings.max_model_len_used,
                gpu_memory_utilization=settings.gpu_memory_utilization,
                tensor_parallel_size=settings.tensor_parallel_size,
                seed=settings.seed,
                enable_lora=enable_lora,
                max_lora_rank=rank,
                kv_cache_dtype=settings.kv_cache_dtype,
                kv_cache_bytes=kv_cache_bytes(),
            )
        finally:
            if load_path != model_path:
                shutil.rmtree(load_path, ignore_errors=True)  # vLLM holds the weights once started
        return engine, adapter_path if enable_lora else None

    import torch
    from transformers import AutoModelForCausalLM

    from opsd.evaluation.sampling import HFEngine
    from opsd.models import resolve_dtype

    if settings.adapter_mode == "merged":
        model = _merge(model_path, adapter_path)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=resolve_dtype("auto"))
        if adapter_path:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter_path)
    model = model.to("cuda" if torch.cuda.is_available() else "cpu")
    return HFEngine(model, tokenizer), None
