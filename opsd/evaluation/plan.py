"""What one evaluation still has to generate, and how its results are reported: shared by a single run
(`opsd.evaluation.evaluate`) and a sweep (`opsd.evaluation.sweep`)."""

from __future__ import annotations

import logging

from opsd.errors import UserError
from opsd.evaluation.job import EvalJob
from opsd.evaluation.requests import Prompts, Request, plan_requests
from opsd.evaluation.samples import (
    SAMPLES_FILE,
    SUMMARY_FILE,
    check_eval_resume,
    index_samples,
    merge_shards,
    read_samples,
)
from opsd.evaluation.summary import binomial_se, write_summary

logger = logging.getLogger(__name__)


def missing_requests(job: EvalJob) -> list[Request]:
    """Check `job.out` against the saved settings (`check_eval_resume`) and plan the samples it lacks, each
    request with its prompt and token cap (`Prompts`)."""
    settings, out = job.settings, job.out
    check_eval_resume(out, settings)
    merge_shards(out)  # leftovers of a killed --num-gpus run
    records = index_samples(read_samples(out / SAMPLES_FILE))
    gold = {p["id"]: p["answer"] for p in job.problems}
    changed = sorted({pid for (pid, _), r in records.items() if pid in gold and r["gold"] != gold[pid]})
    if changed:
        raise UserError(f"the dataset's answers differ from those in {out / SAMPLES_FILE} for problem(s) "
                        f"{changed[:5]}; the dataset file changed: use a new --out")  # fmt: skip
    # vLLM draws every sample as its own request; streamed, sample 0 of every problem comes first, so any
    # stretch of the queue mixes problems (opsd.evaluation.workers).
    vllm = settings.engine_used == "vllm"
    requests = plan_requests(job.problems, set(records), settings.n, settings.seed, Prompts(job),
                             per_sample=vllm, sample_major=vllm and settings.stream)  # fmt: skip
    cut = sum(r.max_tokens < settings.max_tokens for r in requests)
    if cut:
        logger.warning(
            "max_tokens cut to fit max_model_len %d for %d request(s)", settings.max_model_len_used, cut
        )
    return requests


def report_lines(job: EvalJob, timings: dict[str, float], wall_s: float) -> list[str]:
    """Write summary.json and per_problem.csv (and per_problem.png with --plot); the lines to print."""
    out = job.out
    summary = write_summary(job, timings, wall_s)
    metrics = summary["metrics"]
    from opsd.evaluation.metrics import format_summary

    adapter = f", adapter: {summary['adapter_mode']}" if summary["adapter_mode"] else ""
    lines = [
        format_summary(metrics),
        f"engine: {summary['engine']}{adapter}",
        f"samples: {out / SAMPLES_FILE}",
        f"summary: {out / SUMMARY_FILE}",
        f"per-problem: {out / 'per_problem.csv'}",
    ]
    if job.settings.plot:
        from opsd.evaluation.figures import per_problem_accuracy_plot

        rows = metrics["problems"]
        se = [binomial_se(r["accuracy"], r["n"]) for r in rows]
        title = f"{out.name}: {metrics['labels']['avg']} {metrics['avg']:.2f}"
        png = per_problem_accuracy_plot([r["id"] for r in rows], [r["accuracy"] for r in rows], se,
                                   out / "per_problem.png", title=title)  # fmt: skip
        lines.append(f"plot: {png}")
    return lines
