#!/usr/bin/env bash
# The capped budget (docs/method.md §3): exactly 100 optimizer steps of 32 problems, seed 42, via accelerate.
#
#   bash train_capped.sh [--name NAME] [--seed 42] [--num-gpus 4] [--profile full|demo|smoke]
#                        [--model M] [--dataset D] [--recipe recipe.env] [--runs-dir DIR]
#                        [--accelerate-config FILE] [--dry-run]
#
# Tune the method only in recipe.env (KEY=VALUE, parsed never executed, whitelisted keys) and with OPSD_*
# variables; anything that would change the budget is refused before a model loads. Writes
# runs/<name>/capped_seed<seed>/checkpoint-100 and prints that path last. Rerunning the same command
# after an interruption resumes from the last complete checkpoint and still stops at step 100.
# --profile demo/smoke keep the 100 steps with 2 problems per step for CPU machines (see opsd/capped.py).
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
export TRL_EXPERIMENTAL_SILENCE=1
exec "$py" -m opsd.capped --root "$root" "$@"
