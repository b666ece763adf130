"""Score a model or an OPSD checkpoint on AIME 2024 (docs/method.md §4): n samples per problem, graded, with errors.

The published protocol (30 problems x 12 samples, temperature 1.0, top_p 0.95, top_k off, min_p 0,
thinking on, 38,912 new tokens, model length 40,960) is the default:

    python eval_aime.py --model Qwen/Qwen3-1.7B --out runs/eval/base
    python eval_aime.py --model Qwen/Qwen3-1.7B --adapter runs/opsd/checkpoint-100 --out runs/eval/opsd-100
    python eval_aime.py --model Qwen/Qwen3-1.7B --adapter runs/opsd/checkpoint-100 --out runs/eval/opsd-100 \
        --num-gpus 4                     # 4 data-parallel workers, one GPU each, one shared queue
    python eval_aime.py --dataset builtin --limit 4 --n 2 --max-tokens 256 --out runs/eval/smoke   # CPU smoke
    python eval_aime.py --model Qwen/Qwen3-1.7B --checkpoints runs/opsd --out runs/eval/opsd-sweep
                                         # sweep: the base and every complete checkpoint-N, one engine start
    python eval_aime.py --model Qwen/Qwen3-1.7B --checkpoints runs/opsd --benchmarks aime24,aime25,hmmt25 \
        --out runs/eval/opsd-bench       # every benchmark for the base and each checkpoint, one engine start;
                                         # reported: the final checkpoint (--step N declares another)

Comparing two recipes (one run is noise: evaluate each recipe's runs, e.g. the three capped seeds):

    for s in 42 43 44; do
      python eval_aime.py --model Qwen/Qwen3-1.7B --adapter runs/released/capped_seed$s/checkpoint-100 \
          --out runs/eval/released-$s
      python eval_aime.py --model Qwen/Qwen3-1.7B --adapter runs/improved/capped_seed$s/checkpoint-100 \
          --out runs/eval/improved-$s
    done
    python eval_aime.py --aggregate runs/eval/released-{42,43,44} --out runs/eval/released
    python eval_aime.py --aggregate runs/eval/improved-{42,43,44} --out runs/eval/improved
    python eval_aime.py --compare runs/eval/released-42 runs/eval/improved-42      # paired per problem
    python eval_aime.py --plot-steps runs/eval/base runs/eval/opsd-* --out runs/eval/curve

`--aggregate` gives mean ± SE across runs; the difference of two recipes' means has SE
sqrt(SE_a^2 + SE_b^2). `--compare` pairs the problems of two single runs, which removes problem
difficulty from the noise but not the run-to-run spread.

A sweep (`--checkpoints RUN_DIR` or `CKPT ...`, `--no-base` to leave out the base model) writes each
evaluation into OUT/base, OUT/checkpoint-N as a single run would, plus a table against the base (sweep.md,
.csv, .json) and the accuracy-vs-step curve; rerunning it skips what is finished (opsd/evaluation/sweep.py).
`--adapter` and `--checkpoints` also take Hub adapter ids (org/name).

`--benchmarks NAME,...` scores benchmarks of the table in opsd/evaluation/benchmarks.py (aime24, aime25, hmmt25,
aime26, hmmt26, math500, amc23: each a Hub dataset at a pinned revision, read through the datasets cache; local
copies with `--dataset NAME=FILE,...`), each at its preset protocol unless a flag sets it, into OUT/NAME, with the
table per benchmark, the macro average and pass@k for k = 1..n in OUT/benchmarks.md (opsd/evaluation/suite.py).

A LoRA checkpoint is served by vLLM's LoRA support on a GPU and merged with peft first on vLLM's CPU
backend (LoRA serving there is slow and can crash); `--merge-adapter` / `--no-merge-adapter`
force either path; the transformers engine loads it with peft. vLLM streams: every missing sample is
submitted at once (at most `--max-in-flight` in the engine) and saved the moment it finishes; with
`--num-gpus N` the workers pull samples from a shared queue as they free up. Results go to `--out`:
samples.jsonl (resumable: rerun the same command after a crash; only samples in flight are lost),
eval_config.json, summary.json, per_problem.csv; see `opsd/evaluation/` for formats, seeding and the
resume rule. If the vLLM engine dies mid-run, the script prints one line and exits with status 2; the
finished samples are kept and a rerun resumes. Differences from the reference evaluation: per-sample
seeds, streaming generation, crash-safe resume, standard errors on every rate.
"""

from __future__ import annotations

import logging
import sys
import traceback

from opsd import errors
from opsd.evaluation.evaluate import RunFailed, run_evaluation


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    debug, argv = errors.split_debug(sys.argv[1:] if argv is None else argv)  # --debug / OPSD_DEBUG=1
    try:
        lines = run_evaluation(argv, script=__file__)
    except errors.UserError as e:  # training's and evaluation's mistakes alike
        if debug:
            traceback.print_exception(e)
        print(f"error: {errors.short_message(e)}", file=sys.stderr)
        return 2
    except RunFailed as e:  # EngineDied (the vLLM engine raised) exits with 2, other failures with 1
        print(f"failed: {errors.short_message(e)}", file=sys.stderr)
        return e.exit_code
    if lines:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    errors.exit_now(errors.printing(main))  # a closed stdout (`| head -1`) is a normal end
