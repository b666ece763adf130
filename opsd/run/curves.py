"""Training curves of a run as one PNG, from its `metrics.jsonl`.

    python -m opsd.run.curves runs/opsd                     # writes runs/opsd/curves.png
    python -m opsd.run.curves runs/a runs/b --out cmp.png   # several runs, one line each

One panel per group of metrics that the run logged (loss, divergence, agreement, the probe, rollout
correctness and lengths, the rollout engine's log-prob gap to the trainer, time and tokens per step); groups without data are left out, so the same command serves runs with and
without the probe. A resumed run's metrics.jsonl holds each step once (opsd_train.py trims it on resume);
should a step still appear twice, the last record wins. A line that is not a JSON object is skipped with a
warning naming its line (`opsd.rundir.read_step_log`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from opsd.rundir import METRICS_FILE, read_step_log

# (panel title, metric keys drawn in it). Keys are the names in metrics.jsonl.
PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("loss", ("loss",)),
    ("divergence D_β (per token)", ("opsd/divergence", "probe/divergence")),
    ("top-1 agreement", ("opsd/top1_agree", "probe/top1_agree")),
    ("clipped share", ("opsd/clipped_frac",)),
    ("teacher-token log-prob (probe)", ("probe/teacher_token_logp",)),
    ("rollout correctness (graded like the evaluation)", ("rollout/correct", "rollout/boxed")),
    ("rollout length (tokens)", ("completions/mean_length", "completions/max_length")),
    (
        "contrastive target (per token): KL(q || p_S), end-of-sequence mass, argmax differs",
        ("opsd/contrast_kl", "opsd/eos_target", "opsd/eos_student", "opsd/argmax_differs"),
    ),
    (
        "contrastive hints and weights",
        ("contrast/rows_with_pair", "contrast/hints_per_row", "opsd/contrast_weight", "opsd/token_weight"),
    ),
    (
        "|log p engine - log p trainer|, sampled tokens",
        ("rollout/logprob_gap/mean", "rollout/logprob_gap/p99", "rollout/logprob_gap/max"),
    ),
    ("seconds per step", ("time/step_s", "time/rollout_s", "time/train_micro_s", "time/probe_s")),
    (
        "tokens per step (compute ledger)",
        ("ledger/generated_tokens", "ledger/teacher_tokens", "ledger/trained_tokens", "ledger/probe_tokens"),
    ),
    ("gradient norm", ("grad_norm",)),
    ("learning rate", ("learning_rate",)),
)


def read_metrics(run_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """{metric: [(step, value), ...]} from `<run_dir>/metrics.jsonl`, steps ascending, one value per step."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass the output_dir of a training run")
    by_key: dict[str, dict[int, float]] = {}
    # Lines that are not JSON objects (a line cut by a kill, garbage) are skipped with a warning naming them.
    for record in read_step_log(path):
        step = record.get("step")
        if step is None:  # not a step's record: nothing to place on the x axis
            continue
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                by_key.setdefault(key, {})[int(step)] = float(value)
    return {key: sorted(points.items()) for key, points in by_key.items()}


def training_curves(runs: dict[str, dict[str, list[tuple[int, float]]]], path: str | Path) -> list[str]:
    """Draws one panel per group of PANELS with data; returns the panel titles drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = [(title, keys) for title, keys in PANELS if any(k in m for m in runs.values() for k in keys)]
    if not drawn:
        raise ValueError("no known training metric in these runs; is this a run directory of opsd_train.py?")
    cols = 3
    rows = (len(drawn) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, drawn, strict=False):
        for label, metrics in runs.items():
            for key in keys:
                if key in metrics:
                    xs, ys = zip(*metrics[key], strict=True)
                    name = key if len(runs) == 1 else f"{label}: {key}"
                    ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, markersize=3, label=name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(drawn) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [title for title, _ in drawn]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opsd.run.curves", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="output_dir(s) of training runs (each holds metrics.jsonl)")
    ap.add_argument("--out", default="", help="PNG path (default: <first run>/curves.png)")
    args = ap.parse_args(argv)
    try:
        runs = {str(r): read_metrics(r) for r in args.runs}
        out = Path(args.out or Path(args.runs[0]) / "curves.png")
        titles = training_curves(runs, out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({', '.join(titles)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
