"""The completions log: what the student wrote and where its teacher disagreed, a few rows every N steps.

Every `completions_steps` optimizer steps the trainer takes the first `completions_rows` rows of the step's
first micro-batch on the main process and writes, per row, the problem, the privileged reference, the
student's completion, and a summary of the per-token divergence D_β (unclipped, at the loss's β,
temperature and top-k; `docs/method.md §1.3`):

    {"step": 10, "problem": "...", "reference": "...", "completion": "...", "num_tokens": 143,
     "divergence_mean": 0.21, "divergence_max": 3.4, "divergence_first": 0.9,
     "top_tokens": [[17, " 12", 3.4], ...]}      # (position, token text, D_β) of the largest D_β

to `<output_dir>/completions.jsonl` (append-only; cut back to the checkpoint on resume, like metrics.jsonl) and, when the run
reports to Weights & Biases, as a `completions` table. The scores reuse the hidden states the loss already
computed; only `completions_rows` rows' logits are formed, without gradients.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from opsd.method.hidden import LogitTransform, head_logits
from opsd.method.loss import LossSettings, token_divergence_with_grad

logger = logging.getLogger(__name__)

TOP_TOKENS = 5  # tokens of largest divergence listed per row
COLUMNS = (
    "step",
    "problem",
    "reference",
    "completion",
    "num_tokens",
    "divergence_mean",
    "divergence_max",
    "divergence_first",
    "top_tokens",
)


@torch.no_grad()
def completion_rows(
    *,
    step: int,
    problems: Sequence[str],
    references: Sequence[str],
    completion_ids_BC: torch.Tensor,
    completion_mask_BC: torch.Tensor,
    student_hidden_NH: torch.Tensor,
    teacher_hidden_NH: torch.Tensor | None,
    student_weight_VH: torch.Tensor,
    teacher_weight_VH: torch.Tensor | None,
    transform: LogitTransform,
    tokenizer,
    rows: int,
    settings: LossSettings,
) -> list[dict[str, Any]]:
    """Rows for the first `rows` completions of a micro-batch; hidden states are (N, H) over its valid tokens.

    The divergence is the loss's own per-token statistic (`token_divergence_with_grad`, no gradient): D_β at
    the loss's β, temperature and teacher support, unclipped. Without a teacher (a loss that reads none) the
    divergence fields are None and `top_tokens` is empty."""
    lengths = completion_mask_BC.sum(dim=1).tolist()
    out = []
    start = 0
    for b in range(min(rows, len(lengths))):
        n = int(lengths[b])
        ids = completion_ids_BC[b][completion_mask_BC[b].bool()]
        if n == 0:
            start += n
            continue
        row = _plain_row(step, problems[b], references[b], tokenizer.decode(ids.tolist()), n)
        if teacher_hidden_NH is not None:
            h_s, h_t = student_hidden_NH[start : start + n], teacher_hidden_NH[start : start + n]
            logits_s = head_logits(h_s, student_weight_VH, transform)
            logits_t = head_logits(h_t, teacher_weight_VH, transform)
            row.update(_divergence_fields(logits_s, logits_t, ids, settings, tokenizer))
        out.append(row)
        start += n
    return out


def _plain_row(step: int, problem: str, reference: str, completion: str, n: int) -> dict[str, Any]:
    """A row's text and length, its divergence fields empty (what a loss without a teacher logs)."""
    return {
        "step": step,
        "problem": problem,
        "reference": reference,
        "completion": completion,
        "num_tokens": n,
        "divergence_mean": None,
        "divergence_max": None,
        "divergence_first": None,
        "top_tokens": [],
    }


def _divergence_fields(logits_s, logits_t, ids, settings: LossSettings, tokenizer) -> dict[str, Any]:
    """A row's divergence summary from its student and teacher logits (n, V): the loss's own per-token D_β,
    its mean, max, first value and the `TOP_TOKENS` largest with their text."""
    _, stats, _ = token_divergence_with_grad(
        logits_s, logits_t, settings=settings, target_ids_N=ids, need_grad=False
    )
    d = stats["divergence"]
    worst = d.topk(min(TOP_TOKENS, len(ids))).indices.tolist()
    return {
        "divergence_mean": float(d.mean()),
        "divergence_max": float(d.max()),
        "divergence_first": float(d[0]),
        "top_tokens": [[i, tokenizer.decode([int(ids[i])]), float(d[i])] for i in worst],
    }


def append(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    """Appends `rows` to the log at `path` (the run directory's completions.jsonl: opsd.rundir)."""
    with Path(path).open("a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def to_trackers(report_to: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    """A `completions` table in W&B when the run reports there (the one tracker we use that takes tables)."""
    if "wandb" not in report_to or not rows:
        return
    import wandb

    if wandb.run is None:
        return
    table = wandb.Table(columns=list(COLUMNS))
    for row in rows:
        table.add_data(*[json.dumps(row[c]) if c == "top_tokens" else row[c] for c in COLUMNS])
    wandb.log({"completions": table}, commit=False)
