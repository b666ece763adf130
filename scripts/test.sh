#!/usr/bin/env bash
# Sets up ./.venv if needed, then runs lint and the whole test suite (vLLM engine tests included).
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1
.venv/bin/ruff check .
.venv/bin/python -m pytest -ra "$@"
