"""Sampling engines for evaluation and benchmarks: vLLM, and a transformers fallback with the same API.

Training rollouts go through TRL's `VLLMGeneration` inside the trainer; this module serves the scripts
that only sample (`eval_aime.py`, `bench/`). Both engines take token ids (the caller renders prompts) and
return, per prompt, `n` `Sample`s with the completion ids, text, finish reason and, on request, the
log-probability of each sampled token. `SamplingConfig.vllm` is the one place that turns sampling settings
into vLLM `SamplingParams`; evaluation's streaming loop (`opsd.evaluation.generate`) uses it too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from opsd.method.engine_env import single_node_engine_env
from opsd.method.hidden import left_pad

logger = logging.getLogger(__name__)


@dataclass
class Sample:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (end of sequence) or "length" (hit max_tokens)
    logprobs: list[float] | None = None


@dataclass
class SamplingConfig:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int = 0
    logprobs: bool = False
    min_tokens: int = 0  # benchmarks force fixed-length completions with min_tokens == max_tokens

    def vllm(self, n: int = 1, **overrides):
        """These settings as vLLM `SamplingParams` for n samples (top_k 0 = off), `overrides` (any
        `SamplingParams` field, these settings' included) on top; the one builder of `SamplingParams` for
        evaluation and benchmarks."""
        from vllm import SamplingParams

        params = dict(
            n=n, max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k if self.top_k > 0 else -1, min_p=self.min_p, seed=self.seed,
            logprobs=0 if self.logprobs else None, min_tokens=self.min_tokens,
        )  # fmt: skip
        return SamplingParams(**{**params, **overrides})


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def mla_backend(model: str) -> dict[str, str]:
    """The attention backend training's engine asks for (`opsd.method.engine_env.cpu_mla_backend`), for the
    checkpoint at `model`: vLLM's CPU_MLA for a model with multi-head latent attention on a CPU, where vLLM would
    pick its AMX_MLA kernel on a CPU with AMX (which refuses the repo's tiny DeepSeek-V3, "invalid weight input
    features 16", and fails a sweep's weight push); {} otherwise, and where transformers cannot read the config
    (vLLM then reads it, and chooses, itself)."""
    from transformers import AutoConfig

    from opsd.method.engine_env import cpu_mla_backend

    try:
        config = AutoConfig.from_pretrained(model)
    except Exception as err:  # a type transformers lacks, a missing file: vLLM's own reading decides
        logger.debug("%s: no config for the attention backend (%s); vLLM chooses", model, err)
        return {}
    return cpu_mla_backend(config.get_text_config())


def llm_arguments(model: str, *, max_model_len: int | None = None, gpu_memory_utilization: float = 0.9,
                  tensor_parallel_size: int = 1, seed: int = 0, enable_lora: bool = False, max_lora_rank: int = 64,
                  dtype: str | None = None, kv_cache_dtype: str = "auto", kv_cache_bytes: int | None = None) -> dict:  # fmt: skip
    """The arguments of vLLM's `LLM` for evaluation and the benchmarks (`VLLMEngine`), the attention backend routed
    as training's engine routes it (`mla_backend`)."""
    if dtype is None:
        # vLLM's CPU backend would cast a float32 checkpoint to bf16 (slower there: docs/decisions.md).
        dtype = "auto" if torch.cuda.is_available() else "float32"
    kwargs = dict(
        model=model,
        tokenizer=model,
        max_model_len=max_model_len,
        tensor_parallel_size=tensor_parallel_size,
        seed=seed,
        dtype=dtype,
        enable_lora=enable_lora,
        **mla_backend(model),
    )
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if enable_lora:
        kwargs["max_lora_rank"] = max_lora_rank
    if kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = kv_cache_dtype
    if kv_cache_bytes is not None:  # a fixed KV cache (OPSD_KV_CACHE_GIB): no start-up memory profile
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    return kwargs


class VLLMEngine:
    """vLLM's offline `LLM` (its arguments: `llm_arguments`); `lora_path` in `generate` serves a LoRA checkpoint
    without merging it; `kv_cache_bytes` fixes its KV cache (None: vLLM sizes it)."""

    def __init__(self, model: str, **settings):
        single_node_engine_env()
        from vllm import LLM

        self.llm = LLM(**llm_arguments(model, **settings))
        self.tokenizer = self.llm.get_tokenizer()

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingConfig | Sequence[SamplingConfig],
        n: int | Sequence[int] = 1,
        lora_path: str | None = None,
    ) -> list[list[Sample]]:
        """One batched call; `sampling` and `n` may be given per prompt (e.g. each with its own seed)."""
        count = len(prompt_ids)
        samplings = [sampling] * count if isinstance(sampling, SamplingConfig) else list(sampling)
        ns = [n] * count if isinstance(n, int) else list(n)
        params = [sc.vllm(k) for sc, k in zip(samplings, ns, strict=True)]
        lora = None
        if lora_path:
            from vllm.lora.request import LoRARequest

            lora = LoRARequest("adapter", 1, lora_path)
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids], params, lora_request=lora, use_tqdm=False
        )
        results = []
        for out, sc in zip(outputs, samplings, strict=True):
            samples = []
            for o in sorted(out.outputs, key=lambda o: o.index):  # sample j of a request is output index j
                lps = None
                if sc.logprobs:
                    lps = [step[tok].logprob for step, tok in zip(o.logprobs, o.token_ids, strict=True)]
                reason = "length" if o.finish_reason == "length" else "stop"
                samples.append(Sample(list(o.token_ids), o.text, reason, lps))
            results.append(samples)
        return results


class HFEngine:
    """`transformers.generate` with left padding, batched; the fallback when vLLM is absent."""

    def __init__(self, model, tokenizer, *, batch_size: int = 32, cache_implementation: str | None = None):
        self.model = model.eval()
        # "static" preallocates the KV cache, which lets transformers compile the decoding step.
        self.cache_implementation = cache_implementation
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        eos = model.generation_config.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or [])) | {tokenizer.eos_token_id}

    @torch.no_grad()
    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, n: int = 1
    ) -> list[list[Sample]]:
        """n samples per prompt; an adapter must already be loaded into the model."""
        device = next(self.model.parameters()).device
        flat = [ids for ids in prompt_ids for _ in range(n)]
        samples: list[Sample] = []
        torch.manual_seed(sampling.seed)
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(flat), self.batch_size):
            chunk = flat[start : start + self.batch_size]
            ids, mask = left_pad(chunk, pad, device)
            width = ids.size(1)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=sampling.temperature > 0,
                temperature=sampling.temperature if sampling.temperature > 0 else None,
                top_p=sampling.top_p,
                top_k=sampling.top_k or None,
                min_p=sampling.min_p or None,
                max_new_tokens=sampling.max_tokens,
                min_new_tokens=sampling.min_tokens or None,
                cache_implementation=self.cache_implementation,
                pad_token_id=pad,
                eos_token_id=sorted(self.eos_ids),
                output_scores=sampling.logprobs,
                return_dict_in_generate=True,
            )
            new = out.sequences[:, width:].cpu()
            logp = None
            if sampling.logprobs:
                logp = (
                    torch.stack(out.scores, dim=1)
                    .float()
                    .log_softmax(-1)
                    .gather(-1, new.unsqueeze(-1))
                    .squeeze(-1)
                )
            for i, row in enumerate(new.tolist()):
                end = next((j + 1 for j, t in enumerate(row) if t in self.eos_ids), None)
                toks = row[:end] if end else row
                samples.append(
                    Sample(
                        toks,
                        self.tokenizer.decode(toks, skip_special_tokens=True),
                        "stop" if end else "length",
                        logp[i, : len(toks)].tolist() if logp is not None else None,
                    )
                )
        return [samples[i * n : (i + 1) * n] for i in range(len(prompt_ids))]
