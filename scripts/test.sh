#!/usr/bin/env bash
# Sets up ./.venv if needed, then runs lint and the whole test suite (vLLM engine tests included), in two
# pytest-xdist workers that each take whole test files (module fixtures run once; about half the wall time of
# one process on a 2-core machine, where most tests wait on one single-threaded subprocess), the longest files
# first (tests/conftest.py, SLOWEST_FIRST).
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRL_EXPERIMENTAL_SILENCE=1
.venv/bin/ruff check .
.venv/bin/python -m pytest -ra -n 2 --dist loadfile --no-loadscope-reorder "$@"
