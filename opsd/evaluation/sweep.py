"""Sweeps (`--checkpoints`): the base model and many checkpoints scored with one engine start.

    eval_aime.py --model M --checkpoints RUN_DIR --out OUT        # base + every complete checkpoint-N, by N
    eval_aime.py --model M --checkpoints CKPT1 CKPT2 org/name --out OUT --no-base

What is scored. A RUN_DIR (a directory with `checkpoint-N` subdirectories) stands for its complete
checkpoints in order of N: those with the trainer's `.complete` mark, written once a checkpoint is fully
saved. A run directory without any mark (not written by opsd_train.py) contributes the checkpoints that
hold adapter_config.json or config.json, with a warning. Any other argument is one checkpoint: a LoRA
directory (adapter_config.json), a full fine-tune of the base model (config.json, no adapter_config.json)
or a Hub adapter id. The base model (`--model`) comes first unless `--no-base`.

Each one is an ordinary evaluation into OUT/NAME (OUT/base, OUT/checkpoint-N; a Hub id `org/name` becomes
`org--name`, and every checkpoint of a name used more than once gets its parent directory's name in front:
run-a-checkpoint-100, run-b-checkpoint-100): samples.jsonl,
eval_config.json, summary.json and per_problem.csv exactly as `--adapter CKPT --out OUT/NAME` (or `--model
CKPT` for a full fine-tune) would write them, so --compare, --aggregate and --plot-steps read them, and a
single evaluation can resume one. Sample seeds depend on (seed, problem, sample index) only, so a sweep
draws the samples that separate evaluations draw, except for LoRAs served on a GPU, whose samples vLLM does
not reproduce run to run (use --merge-adapter there for byte-identical reruns; docs/decisions.md).

One engine. vLLM starts once on the base model; every checkpoint is then put into the running engine:
* on vLLM's CPU backend (adapters merged by default, `resolve_adapter_mode`): base + LoRA delta computed
  with peft from the base model and the adapter (`opsd.method.engine.merged_named_weights`, the trainer's
  rollout sync) and loaded in place (`opsd.method.engine.push_weights`: vLLM's `reload_weights`);
* on a GPU (adapters served as LoRAs by default): each adapter a `LoRARequest` of its own on an engine
  started with LoRA enabled and `max_lora_rank` fitting the largest adapter, the base weights unchanged;
* a full fine-tune, or the base model after merged or full weights: its checkpoint reloaded in place
  from disk (`push_weights(path=...)`).
The transformers engine has no start worth saving: each evaluation loads its model as a single run does.

Resume. Rerunning the same command skips every evaluation whose samples are complete and whose
summary.json exists (nothing is rewritten), continues a partial one from its samples.jsonl, and starts
the engine only if some sample is missing.

Outputs at OUT: sweep.json (one row per evaluation: avg@n, format and truncation rates with SEs, the
paired difference in accuracy against the base with its 95% CI (`opsd.evaluation.metrics.paired_compare`);
the engine starts and times), sweep.csv and sweep.md (the same table), accuracy_vs_step.png/.json (the
curve of --plot-steps; the base at step 0, checkpoints without a step, such as Hub adapters, left out).

The reported step (`declare_step`). Every step is scored and tabled, but one checkpoint is the result: the one
declared before anything is scored, the final checkpoint by default (the largest step; without step numbers, the
last checkpoint listed), or `--step N`. It is logged before scoring and printed last with its numbers, and
sweep.json holds it under ``declared``. A step past the last checkpoint, or one the sweep does not hold, is
refused in one line before any engine starts. Picking the best step after scoring, per benchmark or at all,
would report the maximum of noisy numbers (docs/evaluation.md, The reported step).
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opsd.errors import UserError
from opsd.evaluation.eval_config import EvalConfig
from opsd.evaluation.generate import NO_TIMINGS, generate_missing
from opsd.evaluation.job import EvalJob, resolve_job, resolve_model
from opsd.evaluation.plan import missing_requests, report_lines
from opsd.evaluation.requests import ListSource, Request
from opsd.evaluation.samples import SAMPLES_FILE, SUMMARY_FILE
from opsd.method.engine_env import kv_cache_bytes

logger = logging.getLogger(__name__)

BASE = "base"
SWEEP_FILE = "sweep.json"
TABLE_COLUMNS = (
    "name", "step", "adapter_mode", "avg", "avg_se", "format_rate", "format_rate_se", "truncation_rate",
    "truncation_rate_se", "diff_vs_base", "diff_se", "diff_ci_low", "diff_ci_high",
)  # fmt: skip
# Architecture fields a full fine-tune must share with the base model to be reloaded into its engine.
_SHAPE_KEYS = ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")


@dataclass
class Entry:
    """One evaluation of a sweep: result directory name, what it scores and how."""

    name: str
    source: str  # "" for the base model, else the checkpoint directory or Hub id as given
    kind: str  # base | lora | full


def _run_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoint-N of a run directory, by N (module docstring)."""
    from opsd.rundir import COMPLETE_MARK, checkpoints, is_complete

    found = checkpoints(run_dir)
    marked = [p for p in found if is_complete(p)]
    if marked:
        skipped = [p.name for p in found if p not in marked]
        if skipped:
            logger.warning("%s: skipping %s without the %s mark (still being written, or a killed save)",
                           run_dir, ", ".join(skipped), COMPLETE_MARK)  # fmt: skip
        return marked
    usable = [p for p in found if (p / "adapter_config.json").is_file() or (p / "config.json").is_file()]
    if usable:
        logger.warning("%s: no checkpoint has the %s mark of opsd_train.py; using the %d that hold "
                       "adapter_config.json or config.json", run_dir, COMPLETE_MARK, len(usable))  # fmt: skip
    return usable


def _kind(path: Path) -> str | None:
    if (path / "adapter_config.json").is_file():
        return "lora"
    if (path / "config.json").is_file():
        return "full"
    return None


def expand(args: list[str], with_base: bool) -> list[Entry]:
    """The evaluations of a sweep, in order: the base (unless not `with_base`), then the checkpoints."""
    from opsd.models import looks_like_hub_id

    found: list[tuple[Path | None, str, str]] = []  # (local path, as given, kind)
    for arg in args:
        path = Path(arg).expanduser()
        if path.is_dir():
            kind = _kind(path)
            if kind:
                found.append((path, arg, kind))
                continue
            ckpts = _run_checkpoints(path)
            if not ckpts:
                raise UserError(
                    f"--checkpoints {arg}: not a checkpoint (no adapter_config.json or config.json) and no "
                    "complete checkpoint-N inside; pass a training output directory or checkpoint directories"
                )
            found += [(p, str(p), _kind(p) or "lora") for p in ckpts]
        elif looks_like_hub_id(arg):
            found.append((None, arg, "lora"))
        else:
            raise UserError(
                f"--checkpoints {arg}: no such directory; pass a run directory, checkpoint directories "
                "or Hub adapter ids (org/name)"
            )
    entries = [Entry(BASE, "", "base")] if with_base else []
    seen: set[str] = set()
    for path, source, _ in found:
        key = str(path.resolve()) if path is not None else source
        if key in seen:
            raise UserError(f"--checkpoints names {source} twice; list each checkpoint once")
        seen.add(key)
    short = [path.name if path is not None else source.replace("/", "--") for path, source, _ in found]
    taken = [BASE] * with_base + short
    names = {BASE} if with_base else set()
    for (path, source, kind), name in zip(found, short, strict=True):
        if taken.count(name) > 1 and path is not None:  # every one of a repeated name gets its parent's
            name = f"{path.resolve().parent.name}-{name}"
        if name in names:
            raise UserError(f"--checkpoints: two checkpoints share the result directory name {name}")
        names.add(name)
        entries.append(Entry(name, source, kind))
    return entries


def entry_step(entry: Entry) -> int | None:
    """The training step of an entry: N of its checkpoint-N path; 0 for the base model; None for a checkpoint
    without one (a Hub adapter, a directory of another name)."""
    from opsd.rundir import step_in_path

    if entry.kind == "base":
        return 0
    return step_in_path(entry.source) if entry.source else None


def declare_step(entries: list[Entry], step: int | None) -> tuple[Entry | None, str]:
    """The evaluation a sweep reports, chosen before anything is scored, and why (module docstring): `--step`'s
    checkpoint, else the final one. UserError for a step past the last checkpoint or not in the sweep."""
    ckpts = [e for e in entries if e.kind != "base"]
    stepped = {entry_step(e): e for e in ckpts if entry_step(e) is not None}
    if step is None:
        if stepped:
            last = max(stepped)
            return stepped[last], f"step {last}, the final checkpoint; --step N declares another"
        if ckpts:
            return ckpts[-1], f"{ckpts[-1].name}, the last checkpoint listed; no checkpoint has a step number"
        return None, "the base model alone"
    if not stepped:
        raise UserError(
            f"--step {step}: no checkpoint of this sweep has a step (checkpoint-N); leave --step out"
        )
    if step > max(stepped):
        raise UserError(
            f"--step {step} is past the last checkpoint (step {max(stepped)}); declare one of the steps "
            f"{', '.join(map(str, sorted(stepped)))}"
        )
    if step not in stepped:
        raise UserError(
            f"--step {step} is not a checkpoint of this sweep; declare one of the steps "
            f"{', '.join(map(str, sorted(stepped)))}"
        )
    return stepped[step], f"step {step}, declared with --step"


def child_config(config: EvalConfig, entry: Entry) -> EvalConfig:
    """The single evaluation an entry stands for: `--adapter CKPT` (LoRA), `--model CKPT` (full
    fine-tune) or the base model, into OUT/NAME."""
    changes: dict[str, Any] = {
        "checkpoints": [],
        "base": True,
        "step": None,
        "out": str(Path(config.out) / entry.name),
    }
    if entry.kind == "lora":
        changes["adapter"] = entry.source
    else:
        changes["merge_adapter"] = "auto" if config.merge_adapter == "true" else config.merge_adapter
        if entry.kind == "full":
            changes["model"] = entry.source
    return dataclasses.replace(config, **changes)


def _check_full_fine_tune(job: EvalJob, base_path: str) -> None:
    from transformers import AutoConfig

    base = AutoConfig.from_pretrained(base_path).to_dict()
    mine = AutoConfig.from_pretrained(job.settings.model_path).to_dict()
    diff = [k for k in _SHAPE_KEYS if base.get(k) != mine.get(k)]
    if diff:
        raise UserError(
            f"{job.settings.model_path} differs from the base model {base_path} in {', '.join(diff)}; "
            "a sweep reloads checkpoints of the base model only: evaluate it on its own with --model"
        )


class SweepEngine:
    """One vLLM engine, started on the base model when first needed, holding one evaluation's weights at
    a time (module docstring); counts its starts and weight loads."""

    def __init__(self, config: EvalConfig, base_path: str, jobs: list[EvalJob]):
        """`jobs`: the evaluations that will be served, which fix the engine's LoRA settings."""
        self.config, self.base_path = config, base_path
        ranks = [int(j.settings.adapter_rank or 0) for j in jobs if j.settings.adapter_mode == "vllm-lora"]
        self.enable_lora, self.max_rank = bool(ranks), max(ranks, default=0)
        # Merged weights go to the engine as tensors and a tied lm_head is rebuilt by a function: both
        # need the engine in this process (vLLM's multiprocess engine would have to serialize them).
        self.in_process = any(
            j.settings.adapter_mode == "merged" or j.settings.model_path != base_path for j in jobs
        )
        self.engine = None
        self.weights: tuple[str, str] = ("base", base_path)  # what the engine holds
        self.starts = self.loads = 0
        self.lora_ids: dict[str, int] = {}
        self._hf_base = None

    def _start(self, max_model_len: int) -> None:
        from opsd.evaluation.engines import _vllm_lora_rank
        from opsd.evaluation.sampling import VLLMEngine

        if self.in_process:
            import os

            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        rank = _vllm_lora_rank(self.max_rank) if self.enable_lora else 16
        self.engine = VLLMEngine(
            self.base_path, max_model_len=max_model_len, gpu_memory_utilization=self.config.gpu_memory_utilization,
            tensor_parallel_size=self.config.tensor_parallel_size, seed=self.config.seed,
            enable_lora=self.enable_lora, max_lora_rank=rank, kv_cache_dtype=self.config.kv_cache_dtype,
            kv_cache_bytes=kv_cache_bytes(),
        )  # fmt: skip
        self.starts += 1

    def _base_hf(self):
        """The base model in transformers, kept for merging adapters (in its checkpoint dtype, as
        `engines._merge` loads it, so merged weights equal those of a single --merge-adapter run)."""
        if self._hf_base is None:
            from transformers import AutoModelForCausalLM

            self._hf_base = AutoModelForCausalLM.from_pretrained(self.base_path, dtype="auto")
        return self._hf_base

    def serve(self, job: EvalJob):
        """Start the engine if needed and put `job`'s weights in it; returns (engine, LoRARequest or None)."""
        from opsd.method.engine import merged_named_weights, push_weights

        settings = job.settings
        mode, adapter = settings.adapter_mode, settings.adapter_path
        if self.engine is None:
            self._start(settings.max_model_len_used)
        if mode == "merged":
            want = ("merged", adapter)
        elif settings.model_path != self.base_path:
            want = ("full", settings.model_path)
        else:
            want = ("base", self.base_path)  # the base model, or a LoRA served on top of it
        if want != self.weights:
            llm = self.engine.llm
            tied = bool(llm.llm_engine.model_config.hf_config.get_text_config().tie_word_embeddings)
            logger.info("loading %s weights of %s into the running engine", want[0], want[1])
            if want[0] == "merged":
                from peft import PeftModel

                peft_model = PeftModel.from_pretrained(self._base_hf(), adapter)
                try:
                    push_weights(llm, merged_named_weights(peft_model), tie_word_embeddings=tied)
                finally:
                    self._hf_base = peft_model.unload()  # the LoRA layers out again, base weights untouched
            else:
                push_weights(llm, path=want[1], tie_word_embeddings=tied)
            self.weights = want
            self.loads += 1
        lora = None
        if mode == "vllm-lora":
            from vllm.lora.request import LoRARequest

            lora_id = self.lora_ids.setdefault(adapter, len(self.lora_ids) + 1)
            lora = LoRARequest(f"adapter-{lora_id}", lora_id, adapter)
        return self.engine, lora


def _summary_row(entry: Entry, summary: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any]:
    from opsd.evaluation.metrics import paired_compare, per_problem_accuracy

    m = summary["metrics"]
    row: dict[str, Any] = {"name": entry.name, "step": summary.get("step"), "source": entry.source or None,
                           "adapter_mode": summary.get("adapter_mode"), "n_problems": m["n_problems"],
                           "label": m["labels"]["avg"]}  # fmt: skip
    for key in ("avg", "format_rate", "truncation_rate"):
        row[key], row[f"{key}_se"] = m[key], m[f"{key}_se"]
    row["vs_base"] = None
    if base is not None and entry.kind != "base":
        row["vs_base"] = paired_compare(per_problem_accuracy(base["metrics"]), per_problem_accuracy(m))
    return row


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def write_table(out: Path, rows: list[dict[str, Any]], extra: dict[str, Any]) -> list[str]:
    """sweep.json, sweep.csv and sweep.md at `out`; returns the markdown lines."""
    flat = []
    for r in rows:
        d = r["vs_base"] or {}
        flat.append({**{k: r.get(k) for k in TABLE_COLUMNS[:9]}, "diff_vs_base": d.get("mean_diff"),
                     "diff_se": d.get("se"), "diff_ci_low": d.get("ci_low"),
                     "diff_ci_high": d.get("ci_high")})  # fmt: skip
    (out / SWEEP_FILE).write_text(json.dumps({**extra, "rows": rows}, indent=2) + "\n")
    with (out / "sweep.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=TABLE_COLUMNS)
        writer.writeheader()
        writer.writerows(flat)
    label = rows[0]["label"] if rows else "avg"
    lines = [
        f"| name | step | {label} | format % | truncated % | {label} - base [95% CI] |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in flat:
        diff = "" if r["diff_vs_base"] is None else (
            f"{r['diff_vs_base']:+.2f} [{_fmt(r['diff_ci_low'])}, {_fmt(r['diff_ci_high'])}]")  # fmt: skip
        lines.append(
            f"| {r['name']} | {_fmt(r['step'])} | {r['avg']:.2f} ± {_fmt(r['avg_se'])} | "
            f"{r['format_rate']:.1f} ± {_fmt(r['format_rate_se'], 1)} | "
            f"{r['truncation_rate']:.1f} ± {_fmt(r['truncation_rate_se'], 1)} | {diff} |"
        )
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    return lines


def run_sweep(config: EvalConfig) -> list[str]:
    """Score every entry of the sweep (module docstring); returns the table and where things are."""
    from opsd.evaluation.report import load_summary

    t0 = time.perf_counter()
    out = Path(config.out).expanduser()
    entries = expand(config.checkpoints, config.base)
    declared, why = declare_step(entries, config.step)
    logger.info("reported result, declared before scoring: %s", why)
    jobs, base_path = _resolve_jobs(config, entries)
    plans: list[list[Request]] = [missing_requests(job) for job in jobs]
    todo = [(e, j) for e, j, p in zip(entries, jobs, plans, strict=True) if p]
    logger.info("sweep of %d evaluation(s) into %s: %d to sample (%s)", len(entries), out, len(todo),
                ", ".join(e.name for e, _ in todo) or "none")  # fmt: skip
    vllm = jobs[0].settings.engine_used == "vllm"
    served = SweepEngine(config, base_path, [j for _, j in todo]) if vllm else None
    lines, engine_start_s = _sample_entries(entries, jobs, plans, served)
    summaries = [load_summary(str(j.out)) for j in jobs]
    base_summary = summaries[0] if config.base else None
    rows = [_summary_row(e, s, base_summary) for e, s in zip(entries, summaries, strict=True)]
    extra = {
        "engine": jobs[0].settings.engine_used,
        "engine_starts": served.starts if served is not None else sum(1 for p in plans if p),
        "weight_loads": served.loads if served is not None else 0,
        "engine_start_s": engine_start_s,
        "declared": {"name": declared.name if declared else None, "why": why},
        "wall_time_s": time.perf_counter() - t0,
        "evaluations": [
            {"name": e.name, "dir": str(j.out), "sampled": bool(p)}
            for e, j, p in zip(entries, jobs, plans, strict=True)
        ],  # fmt: skip
    }
    table = write_table(out, rows, extra)
    png = _write_plot(out, entries, jobs, summaries)
    return [*lines, "", *table, "", *_closing_lines(out, png, rows, extra, declared, why)]


def _resolve_jobs(config: EvalConfig, entries: list[Entry]) -> tuple[list[EvalJob], str]:
    """(every entry's job, the base model's path): every input is checked, and every result directory's
    settings, before the engine starts."""
    jobs = [resolve_job(child_config(config, e)) for e in entries]
    base_path = resolve_model(config.model)
    for entry, job in zip(entries, jobs, strict=True):
        if entry.kind == "full":
            _check_full_fine_tune(job, base_path)
    return jobs, base_path


def _sample_entries(
    entries: list[Entry], jobs: list[EvalJob], plans: list[list[Request]], served: SweepEngine | None
) -> tuple[list[str], float]:
    """Sample every entry's missing samples in order (a complete entry is skipped); returns the entries'
    report lines and the time the shared engine took to start (0.0 if it did not start)."""
    lines: list[str] = []
    engine_start_s = 0.0
    for i, (entry, job, requests) in enumerate(zip(entries, jobs, plans, strict=True), 1):
        t_job = time.perf_counter()
        if not requests and (job.out / SUMMARY_FILE).is_file():
            logger.info("sweep %d/%d: %s is complete; skipped", i, len(entries), entry.name)
            continue
        timings = dict(NO_TIMINGS)
        if requests:
            missing = sum(r.count for r in requests)
            logger.info("sweep %d/%d: %s (%s): %d missing samples into %s", i, len(entries), entry.name,
                        job.settings.adapter_mode or entry.kind, missing, job.out)  # fmt: skip
            timings, start_s = _sample_entry(job, requests, served)
            if start_s is not None:
                engine_start_s = start_s
        lines += [f"== {entry.name}", *report_lines(job, timings, time.perf_counter() - t_job)]
    return lines, engine_start_s


def _sample_entry(
    job: EvalJob, requests: list[Request], served: SweepEngine | None
) -> tuple[dict[str, float], float | None]:
    """One entry's missing samples, in the shared engine when there is one; returns its timings and the
    engine's start time when the engine started for this entry (else None)."""
    engine = None
    start_s = None
    if served is not None:
        t_load = time.perf_counter()
        started = served.starts
        engine = served.serve(job)
        if served.starts > started:
            start_s = time.perf_counter() - t_load
    scratch = job.out / ".merged-model"
    timings = generate_missing(job, requests, ListSource(requests), job.out / SAMPLES_FILE, scratch,
                               served=engine)  # fmt: skip
    if engine is not None:
        # Time to put this evaluation's weights in the engine (its start, for the first one).
        timings["engine_start_s"] = time.perf_counter() - t_load - timings["generation_s"]
    return timings, start_s


def _write_plot(
    out: Path, entries: list[Entry], jobs: list[EvalJob], summaries: list[dict[str, Any]]
) -> Path:
    """The score-by-step plot of the base and of the entries whose step is known."""
    from opsd.evaluation.report import step_point, write_step_plot

    points = [step_point(str(j.out), s) for e, j, s in zip(entries, jobs, summaries, strict=True)
              if e.kind == "base" or s.get("step") is not None]  # fmt: skip
    return write_step_plot(points, out)


def _closing_lines(
    out: Path, png: Path, rows: list[dict[str, Any]], extra: dict[str, Any], declared: Entry | None, why: str
) -> list[str]:
    """Where the table and plot are, and the result declared before scoring (the first row when none was)."""
    head = next(r for r in rows if declared is None or r["name"] == declared.name)
    vs = head["vs_base"]
    diff = "" if not vs else f", {vs['mean_diff']:+.2f} vs base [{_fmt(vs['ci_low'])}, {_fmt(vs['ci_high'])}]"
    return [f"table: {out / 'sweep.md'}, {out / 'sweep.csv'}, {out / SWEEP_FILE}",
            f"plot: {png}", f"engine starts: {extra['engine_starts']}",
            f"reported: {head['name']}, declared before scoring ({why})",
            f"  {head['label']} {head['avg']:.2f} ± {_fmt(head['avg_se'])}{diff}"]  # fmt: skip
