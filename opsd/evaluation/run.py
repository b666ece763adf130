"""One evaluation run, start to finish (eval_aime.py's `run`): resolve the inputs, resume, generate what is
missing (in this process or in data-parallel workers), summarize; or one of the report modes."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from opsd.evaluation.config import EvalConfig, RunFailed, UserError, parse_config
from opsd.evaluation.generate import NO_TIMINGS, ListSource, Request, generate_missing, plan_requests
from opsd.evaluation.job import Job, resolve
from opsd.evaluation.samples import (
    SAMPLES_FILE,
    SUMMARY_FILE,
    check_resume,
    index_samples,
    merge_shards,
    read_samples,
)
from opsd.evaluation.summary import binomial_se, write_summary
from opsd.evaluation.workers import run_shard, run_workers

__all__ = ["RunFailed", "UserError", "missing_requests", "report_lines", "run", "run_eval"]

logger = logging.getLogger(__name__)


def missing_requests(job: Job) -> list[Request]:
    """Check `job.out` against the saved settings (`check_resume`) and plan the samples it lacks."""
    config, out = job.config, job.out
    check_resume(out, job.resolved)
    merge_shards(out)  # leftovers of a killed --num-gpus run
    records = index_samples(read_samples(out / SAMPLES_FILE))
    gold = {p["id"]: p["answer"] for p in job.problems}
    changed = sorted({pid for (pid, _), r in records.items() if pid in gold and r["gold"] != gold[pid]})
    if changed:
        raise UserError(f"the dataset's answers differ from those in {out / SAMPLES_FILE} for problem(s) "
                        f"{changed[:5]}; the dataset file changed: use a new --out")  # fmt: skip
    # vLLM draws every sample as its own request; streamed, sample 0 of every problem comes first, so any
    # stretch of the queue mixes problems (opsd.evaluation.workers).
    vllm = job.resolved["engine_used"] == "vllm"
    return plan_requests(job.problems, set(records), config.n, config.seed, per_sample=vllm,
                         sample_major=vllm and config.stream)  # fmt: skip


def report_lines(job: Job, timings: dict[str, float], wall_s: float) -> list[str]:
    """Write summary.json and per_problem.csv (and per_problem.png with --plot); the lines to print."""
    config, out = job.config, job.out
    summary = write_summary(job, timings, wall_s)
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
        se = [binomial_se(r["accuracy"], r["n"]) for r in rows]
        title = f"{out.name}: {metrics['labels']['avg']} {metrics['avg']:.2f}"
        png = per_problem_accuracy([r["id"] for r in rows], [r["accuracy"] for r in rows], se,
                                   out / "per_problem.png", title=title)  # fmt: skip
        lines.append(f"plot: {png}")
    return lines


def run_eval(config: EvalConfig, argv: Sequence[str], script: str) -> list[str]:
    t0 = time.perf_counter()
    job = resolve(config)
    if config.shard_rank is not None:
        run_shard(job)
        return []
    out = job.out
    requests = missing_requests(job)
    timings = dict(NO_TIMINGS)
    if not requests:
        logger.info("all %d x %d samples are in %s; summarizing", len(job.problems), config.n, out)
    elif config.num_gpus > 1:
        timings = run_workers(config, argv, script, out, requests)
    else:
        missing = sum(r.count for r in requests)
        logger.info("generating %d missing samples into %s", missing, out / SAMPLES_FILE)
        timings = generate_missing(
            job, requests, ListSource(requests), out / SAMPLES_FILE, out / ".merged-model"
        )
    return report_lines(job, timings, time.perf_counter() - t0)


def run(argv: Sequence[str], script: str) -> list[str]:
    """Parse `argv` and run the chosen mode; returns the report lines. `script` is re-run by workers."""
    config = parse_config(argv)
    if config.mode == "eval":
        return run_eval(config, argv, script)
    if config.mode == "sweep":
        from opsd.evaluation.sweep import run_sweep

        return run_sweep(config)
    from opsd.evaluation.report import run_aggregate, run_compare, run_plot_steps

    if config.mode == "compare":
        return run_compare(config)
    if config.mode == "aggregate":
        return run_aggregate(config)
    return run_plot_steps(config)
