"""The sample store of a result directory: samples.jsonl (append-only, repaired and resumed), the workers'
shard files merged into it, and eval_config.json, which a resumed run must match."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opsd.errors import UserError
from opsd.evaluation.eval_config import EvalSettings

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
CONFIG_FILE = "eval_config.json"
SUMMARY_FILE = "summary.json"
SHARD_DIR = "shards"
ENGINE_ERROR_LOG = "engine_error.log"
SEED_STRIDE = 1 << 16  # seeds of one problem's samples; n above this would reuse a seed
# Settings (`EvalSettings` fields) that change what is sampled or how it is graded; a resumed run must match
# all of them.
RESUME_KEYS = (
    "model_path", "adapter_path", "adapter_mode", "engine_used", "dataset_source", "split", "n",
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_model_len_used", "thinking",
    "student_template", "seed", "kv_cache_dtype", "dataset_revision",
)  # fmt: skip
# Settings added after runs were saved without them: a saved run that lacks one ran at this value.
RESUME_DEFAULTS = {"kv_cache_dtype": "auto", "dataset_revision": None}


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


def check_eval_resume(out: Path, settings: EvalSettings) -> None:
    """Refuse a DIR whose saved config differs in a `RESUME_KEYS` setting; write the config if new."""
    from opsd.paths import check_output_dir

    check_output_dir(out, "result directory")  # a sweep's OUT/NAME too, before any of them is written
    cfg_path = out / CONFIG_FILE
    if cfg_path.is_file():
        saved = json.loads(cfg_path.read_text())
        now = {k: getattr(settings, k) for k in RESUME_KEYS}
        saved = {**RESUME_DEFAULTS, **saved}
        diff = [k for k in RESUME_KEYS if saved.get(k, "<missing>") != now[k]]
        if diff:
            detail = "; ".join(f"{k}: saved {saved.get(k, '<missing>')!r}, now {now[k]!r}" for k in diff)
            hint = ""
            if "adapter_mode" in diff and saved.get("adapter_mode") and settings.adapter_mode:
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
    cfg_path.write_text(json.dumps(settings.to_json(), indent=2) + "\n")
