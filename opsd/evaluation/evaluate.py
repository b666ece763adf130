"""One evaluation run, start to finish (eval_aime.py's `run`): resolve the inputs, resume, generate what is
missing (in this process or in data-parallel workers), summarize; or one of the report modes."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from opsd.errors import UserError
from opsd.evaluation.eval_config import EvalConfig, RunFailed, parse_eval_args
from opsd.evaluation.generate import NO_TIMINGS, generate_missing
from opsd.evaluation.job import check_paths, resolve_job
from opsd.evaluation.plan import missing_requests, report_lines
from opsd.evaluation.requests import ListSource
from opsd.evaluation.samples import SAMPLES_FILE
from opsd.evaluation.sweep import run_sweep
from opsd.evaluation.workers import run_shard, run_workers

__all__ = ["RunFailed", "UserError", "run_eval", "run_evaluation"]

logger = logging.getLogger(__name__)


def run_eval(config: EvalConfig, argv: Sequence[str], script: str) -> list[str]:
    t0 = time.perf_counter()
    job = resolve_job(config)
    if config.shard_rank is not None:
        run_shard(job, *config.shard_rank)
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


def run_evaluation(argv: Sequence[str], script: str) -> list[str]:
    """Parse `argv` and run the chosen mode; returns the report lines. `script` is re-run by workers."""
    config = parse_eval_args(argv)
    check_paths(config)  # before anything loads or is written
    if config.benchmarks and config.mode in ("eval", "sweep"):
        from opsd.evaluation.suite import run_suite

        return run_suite(config, argv)
    if config.mode == "eval":
        return run_eval(config, argv, script)
    if config.mode == "sweep":
        return run_sweep(config)
    from opsd.evaluation.report import run_aggregate, run_compare, run_plot_steps

    if config.mode == "compare":
        from opsd.evaluation.suite import is_suite, run_suite_compare

        if all(is_suite(d) for d in config.compare):
            return run_suite_compare(config)
        return run_compare(config)
    if config.mode == "aggregate":
        return run_aggregate(config)
    return run_plot_steps(config)
