#!/usr/bin/env bash
# The capped budget (docs/method.md §3): exactly 100 optimizer steps of 32 problems (BUDGET_UNIT=rollouts in the
# recipe: 32 rollouts, for method=grpo or hybrid), seed 42, via accelerate.
#
#   bash train_capped.sh [--name NAME] [--seed 42] [--num-gpus N] [--profile full|demo|smoke]
#                        [--model M] [--dataset D] [--recipe recipe.env] [--runs-dir DIR]
#                        [--accelerate-config FILE] [--dry-run] [--debug] [-- TRAINING FLAGS]
#
# Tune the method only in recipe.env (KEY=VALUE, parsed never executed, whitelisted keys) and with OPSD_*
# variables; anything that would change the budget is refused before a model loads. Operational keys
# (REPORT_TO, RUN_NAME, LOGGING_STEPS, VLLM_GPU_MEMORY_UTILIZATION, VLLM_ENABLE_SLEEP_MODE, ...: OPERATIONAL_KEYS
# in opsd/configuration/switches.py) may also be set there or passed after `--`: `-- --report_to wandb --run_name x`.
# --num-gpus N plans N GPU processes (default: 4 with GPUs, one CPU process without); a dry run prints
# that plan on any machine, a real run without the GPUs is refused. --dry-run checks the configuration
# exactly as a real run does (no model loads). Bad input: one line on stderr, exit status 2; --debug or
# OPSD_DEBUG=1 adds the traceback. Writes
# runs/<name>/capped_seed<seed>/checkpoint-100 and prints that path last. Rerunning the same command
# after an interruption resumes from the last complete checkpoint and still stops at step 100.
# --profile demo/smoke keep the 100 steps with 4/2 problems per step for CPU machines
# (see opsd/launch/capped.py).
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
export TRL_EXPERIMENTAL_SILENCE=1
exec "$py" -m opsd.launch.capped --root "$root" "$@"
