"""Benchmark: one `python -m opsd.experiment` run end to end, timed, with its verdict, in one JSON.

    python bench/experiment_run.py --out bench/results/experiment_h200.json  # one H200, the clip preset
    python bench/experiment_run.py --preset study --out bench/results/study_h200.json  # the teacher study
    python bench/experiment_run.py --preset rl --out bench/results/rl_h200.json  # OPSD, GRPO, the hybrid x2
    python bench/experiment_run.py --out X.json -- --out runs/exp/mine --arm ...  # experiment flags after --

The presets (no flags after `--`) train the embedded SmolLM2-135M-Instruct under the capped harness (100 steps
x 32 `builtin:easy` problems, 128-token rollouts, learning rate 1e-4, probe every 10 steps), seeds 42, 43, 44,
every cell side by side on one GPU (7 jobs at once, a fixed 1.5 GiB KV cache per engine, no DeepSpeed), each final
checkpoint scored on all 100 `builtin:easy-disjoint` problems x 8 samples at 128 tokens; the first arm is the
baseline.
- `clip` (default): the published `element` clip against `rescale`.
- `study`: where the teacher's gain comes from and which tokens should count (docs/method.md §1.10-1.12), each
  arm one switch on the recipe that learns on this model (`rescale`): `opsd` (the baseline), `answer_only`
  (teacher_ref=answer), `ref_half` (teacher_ref_fraction=0.5), `contrast_shuffled`, `contrast_wrong` (RLCSD's
  target with those hints), `contrast_own` (RLCSD with its own wrong sibling rollouts: the hybrid, 4 rollouts per
  problem), `fixed_advantage` (no teacher, |a| = 0.025), `empty_ref` (teacher_ref_pairing=empty) and the four
  `token_weight` arms `weight_early`, `weight_late`, `weight_entropy`, `weight_positive`.
- `rl`: four arms on the study's baseline recipe (`rescale`, as above): `opsd` (the baseline), `grpo` (TRL's
  GRPO, 4 rollouts per problem, no teacher; its clip is TRL's), and the hybrid (GRPO + 1 x OPSD's loss on the same
  4 rollouts) by its route, `hybrid_group` (HYBRID_ROUTE=group) and `hybrid_sample` (HYBRID_ROUTE=sample). The RL
  arms count the step's 32 in rollouts (BUDGET_UNIT=rollouts: 8 problems x 4), so each arm generates about the
  tokens OPSD's 32 rollouts do; compare them per generated token and per GPU-hour as well as per step (the report's compute ledger, docs/experiments.md), and read each arm's take-off (GRPO's
  seeds may take off or not: the report shows such an arm's seeds first). The shipped
  configs/recipes/demo_grpo.env and demo_hybrid.env are GRPO and the hybrid for the CPU demo profile.

Output: {"machine", "command", "wall_s", "timing" (per kind of job: attempts, summed and wall-clock seconds),
"verdict" (per comparison: the reported interval, the bootstrap, variance components, minimum detectable
difference, seeds needed for `--target-diff` points, the arms bimodal over its seeds), "arms" (per seed and mean,
the gain over the base model, the compute ledger: tokens, hours and gain per million generated tokens, the
take-off: each seed's first step with half its training rollouts correct), "failed"}; the experiment's
own report.md, summary.json and figures are in its directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import machine, write

ROOT = Path(__file__).resolve().parents[1]

ARM = "CLIP_MODE={},LEARNING_RATE=1e-4,MAX_COMPLETION_LENGTH=128,PROBE_STEPS=10,VLLM_GPU_MEMORY_UTILIZATION=0.12"
# Scoring and sharing the GPU, the same in every preset.
SHARED = [
    "--seeds", "42,43,44",
    "--eval-flags", "--dataset builtin:easy-disjoint --n 8 --max-tokens 128 --max-model-len 1024 --no-thinking "
    "--gpu-memory-utilization 0.12",
    "--cells-per-gpu", "7", "--kv-cache-gib", "1.5", "--accelerate-config", "configs/accelerate/single_gpu.yaml",
    "--status-every", "60",
]  # fmt: skip
COMMON = ["--profile", "full", "--model", "embedded", "--dataset", "builtin:easy", "--recipe", "", *SHARED]
# The methods, each one switch set on the recipe that learns on the embedded model (`ARM` with `rescale`): the
# same learning rate, rollouts and held-out probe problems in every arm; GRPO's clip is TRL's (no CLIP_MODE).
# The hybrid twice, by how it routes a problem's rollouts between its two terms (HYBRID_ROUTE, read by
# method=hybrid only; docs/configuration.md): per group and per sample.
# The RL arms count the step's 32 in rollouts (BUDGET_UNIT=rollouts: 8 problems x 4), so every arm generates about
# the same tokens per step as OPSD's 32 single rollouts.
RL = {
    "opsd": "",
    "grpo": "METHOD=grpo,NUM_GENERATIONS=4,BUDGET_UNIT=rollouts",
    "hybrid_group": "METHOD=hybrid,NUM_GENERATIONS=4,SD_WEIGHT=1,HYBRID_ROUTE=group,BUDGET_UNIT=rollouts",
    "hybrid_sample": "METHOD=hybrid,NUM_GENERATIONS=4,SD_WEIGHT=1,HYBRID_ROUTE=sample,BUDGET_UNIT=rollouts",
}
# The study's arms: one switch each on top of the recipe that learns on the embedded model.
STUDY = {
    "opsd": "",
    "answer_only": "TEACHER_REF=answer",
    "ref_half": "TEACHER_REF_FRACTION=0.5",
    "contrast_shuffled": "TEACHER_CONTRAST=shuffled",
    "contrast_wrong": "TEACHER_CONTRAST=wrong_answer",
    # RLCSD with its own hints: 4 rollouts per problem, the hybrid (GRPO + OPSD's term on RLCSD's target)
    "contrast_own": "METHOD=hybrid,NUM_GENERATIONS=4,TEACHER_CONTRAST=own_wrong",
    # a tenth of the embedded model's step-0 probe/abs_advantage: -0.25 at this learning rate destroyed the model
    "fixed_advantage": "LOSS_TYPE=fixed_advantage,FIXED_ADVANTAGE=-0.025",
    "empty_ref": "TEACHER_REF_PAIRING=empty",
    "weight_early": "TOKEN_WEIGHT=position_early",
    "weight_late": "TOKEN_WEIGHT=position_late",
    "weight_entropy": "TOKEN_WEIGHT=entropy_gate",
    "weight_positive": "TOKEN_WEIGHT=positive_only",
}
PRESETS = {
    "clip": ["--out", "runs/experiment_h200", "--arm", "element=" + ARM.format("element"),
             "--arm", "rescale=" + ARM.format("rescale"), *COMMON],
    "study": ["--out", "runs/study_h200",
              *[x for name, switch in STUDY.items()
                for x in ("--arm", f"{name}={ARM.format('rescale')}{',' * bool(switch)}{switch}")], *COMMON],
}  # fmt: skip


def rl_flags() -> list[str]:
    """The `rl` preset: the study's baseline recipe under each method (grpo without CLIP_MODE, which it refuses)."""
    arms = []
    for name, switch in RL.items():
        recipe = ARM.format("rescale") if name != "grpo" else ARM.replace("CLIP_MODE={},", "")
        arms += ["--arm", f"{name}={recipe}{',' * bool(switch)}{switch}"]
    return ["--out", "runs/rl_h200", *arms, *COMMON]


# Presets whose flags are made when they run.
MADE = {"rl": rl_flags}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="The result JSON.")
    p.add_argument(
        "--preset", default="clip", choices=[*PRESETS, *MADE], help="The experiment, without flags after --."
    )
    p.add_argument("--target-diff", default="1", help="Points: the seeds needed to detect this.")
    a = p.parse_args(own)
    if "--" in argv:
        flags = argv[argv.index("--") + 1 :]
    else:
        flags = MADE[a.preset]() if a.preset in MADE else PRESETS[a.preset]
    directory = Path(flags[flags.index("--out") + 1]).resolve()
    command = [sys.executable, "-m", "opsd.experiment", *flags, "--target-diff", a.target_diff]
    t0 = time.time()
    rc = subprocess.run(command, cwd=ROOT).returncode
    wall = time.time() - t0
    summary = json.loads((directory / "summary.json").read_text())
    verdict = {
        f"{arm} - {summary['baseline']}": {
            what: {
                k: c[k]
                for k in (
                    "seeds",
                    "per_seed",
                    "interval",
                    "bootstrap",
                    "variance",
                    "mde_80",
                    "target_diff",
                    "seeds_needed",
                    "plan",
                    "planning",
                    "verdict",
                    "bimodal",
                    "bimodal_note",
                )
            }  # fmt: skip
            for what, c in comp.items()
        }
        for arm, comp in summary["comparisons"].items()
    }
    arms = {
        arm: {k: e.get(k) for k in ("per_seed", "mean", "missing", "variance", "ledger", "take_off")}
        for arm, e in summary["arms"].items()
    }
    for arm, e in summary["arms"].items():
        arms[arm]["vs_base"] = {w: c["interval"] for w, c in e.get("vs_base", {}).items()}
    failed = (
        json.loads((directory / "failed.json").read_text()) if (directory / "failed.json").is_file() else {}
    )
    result = {"machine": machine(), "command": command, "exit": rc, "wall_s": wall, "timing": summary["timing"],
              "base": summary["base"], "base_per_seed": summary["base_per_seed"], "labels": summary["labels"], "verdict": verdict, "arms": arms,
              "settings": summary["settings"], "failed": failed}  # fmt: skip
    print(write(result, a.out))
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
