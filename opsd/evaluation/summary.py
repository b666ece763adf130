"""summary.json and per_problem.csv of a finished run, from samples.jsonl."""

from __future__ import annotations

import csv
import json
import math
from typing import Any

from opsd.evaluation.eval_config import RunFailed
from opsd.evaluation.job import EvalJob
from opsd.evaluation.samples import SAMPLES_FILE, SUMMARY_FILE, index_samples, read_samples
from opsd.run.provenance import package_versions

CSV_COLUMNS = (
    "id", "gold", "n", "n_correct", "accuracy", "accuracy_se", "pass_at_k", "maj", "format_rate",
    "truncation_rate", "mean_tokens",
)  # fmt: skip


# The packages an evaluation's numbers depend on (a subset of what training records).
VERSION_KEYS = ("python", "torch", "transformers", "vllm", "peft", "math-verify", "opsd")


def versions() -> dict[str, str | None]:
    found = package_versions()
    return {k: found[k] for k in VERSION_KEYS}


def binomial_se(p: float, n: int) -> float:
    """SE of a problem's accuracy from its n samples: sqrt(p (1 - p) / n)."""
    return math.sqrt(p * (1.0 - p) / n)


def grading_counts(per_problem: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """How the samples were graded: answers over MAX_VERIFY_CHARS go to the string fallback only."""
    from opsd.grading import GRADER_LONG, MAX_VERIFY_CHARS

    samples = [s for rows in per_problem.values() for s in rows]
    long = sum(s.get("grader") == GRADER_LONG for s in samples)
    return {"max_verify_chars": MAX_VERIFY_CHARS, "string_fallback_long_answers": long}


def write_summary(job: EvalJob, timings: dict[str, float], wall_s: float) -> dict[str, Any]:
    """Summarize the in-scope problems from `samples.jsonl` into summary.json and per_problem.csv."""
    from opsd.evaluation.metrics import summarize

    out, settings = job.out, job.settings
    have = index_samples(read_samples(out / SAMPLES_FILE))
    per_problem = {}
    for p in job.problems:
        samples = [have.get((p["id"], i)) for i in range(settings.n)]
        missing = [i for i, s in enumerate(samples) if s is None]
        if missing:
            raise RunFailed(f"problem {p['id']!r} lacks samples {missing}; rerun the same command to finish")
        per_problem[p["id"]] = samples
    metrics = summarize(per_problem, k=settings.k)
    gen_s = timings["generation_s"]
    summary = {
        "config": settings.to_json(),
        "versions": versions(),
        "engine": settings.engine_used,
        "adapter_mode": settings.adapter_mode,
        "step": settings.step,
        "wall_time_s": wall_s,
        **timings,
        "tokens_per_s": timings["new_tokens"] / gen_s if gen_s > 0 else None,
        "metrics": metrics,
        "grading": grading_counts(per_problem),
        "data_warnings": list(job.data_warnings),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    gold = {p["id"]: p["answer"] for p in job.problems}
    with (out / "per_problem.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for row in metrics["problems"]:
            se = binomial_se(row["accuracy"], row["n"])
            writer.writerow(
                {**{c: row.get(c) for c in CSV_COLUMNS}, "gold": gold[row["id"]], "accuracy_se": se}
            )
    return summary
