"""The capped budget (docs/method.md §3): the launch plan that `train_capped.sh` runs.

100 optimizer steps of 32 problems each (one rollout per problem), seed 42 unless `--seed` says otherwise.
The per-device batch is 4 as published; gradient accumulation makes up the rest of the 32 from the
number of processes. With `BUDGET_UNIT=rollouts` in the recipe (or `OPSD_BUDGET_UNIT`) the 32 count rollouts:
method=grpo or hybrid with G rollouts per problem then trains 32 / G problems per step, and the per-device batch
is whole groups of G rollouts, at most 4 problems' (`split_batch`); the 100 steps and the 32 stay fixed. How
each process splits its share into micro-batches is memory, not method (`opsd.speed.microbatch`): the harness
passes `micro_batch_size=auto` (the largest that fits beside the engine on a GPU, the plan above without one), and
`MICRO_BATCH_SIZE` in recipe.env, `OPSD_MICRO_BATCH_SIZE` or `-- --micro_batch_size N` choose another divisor of
the problems per process. Researchers change the method only through `recipe.env` and `OPSD_*` switches, which
`opsd_train.py --capped` checks against the whitelist (the roles declared in `opsd.configuration.switches`).

Profiles keep the 100 steps and shrink the rest for machines without GPUs:
- `full`: the published setting (Qwen3-1.7B, the OPSD dataset, 32 problems per step);
- `demo`: the embedded SmolLM2-135M on the `builtin:easy` problems, 4 problems per step and 64-token
  rollouts, sized for a 2-core CPU (scripts/demo.sh adds configs/recipes/demo.env);
- `smoke`: 2 problems per step, 8-token rollouts and the probe at steps 0, 50 and 100, for CI on a tiny model.

    python -m opsd.launch.capped --num-gpus 4 --name myrun --seed 42 [--profile full] [--model M] \
        [--dataset D] [--dry-run] [--debug] [-- --report_to wandb --run_name x]

prints the launch command as a JSON plan (`train_capped.sh` executes it). Before launching, and in a dry run,
it runs training's dry run (`opsd.launch.preflight`, what `opsd_train.py --dry-run` runs) on the planned
arguments, in this interpreter: the configuration is validated by the code a real run uses, with no model
loaded. `--allow-config-change` is passed on to
training (resuming a run whose recipe changed, recorded in its history). Flags after `--` pass through to
training; only `OPERATIONAL_KEYS` (trackers, logging, memory) are accepted there, budget keys are refused
and method keys belong in `recipe.env`. Without `--num-gpus` the plan is 4 GPU processes where a GPU is present and one CPU process
elsewhere; an explicit `--num-gpus N` always plans N GPU processes (a real run without them is refused).
User errors print one line and exit with status 2 (`--debug` or `OPSD_DEBUG=1` adds the traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opsd.errors import UserError, exit_now, printing, report, split_debug
from opsd.paths import ACCELERATE_CONFIG, check_file, check_output_dir

STEPS = 100
PROBLEMS_PER_STEP = 32
PER_DEVICE_BATCH = 4
SAVE_EVERY = 10
DEFAULT_GPUS = 4


@dataclass(frozen=True)
class Profile:
    model: str
    dataset: str
    problems_per_step: int
    max_completion_length: int | None  # None = the recipe's value
    extra: tuple[str, ...] = ()


PROFILES = {
    "full": Profile("Qwen/Qwen3-1.7B", "siyanzhao/Openthoughts_math_30k_opsd", PROBLEMS_PER_STEP, None),
    "demo": Profile(
        "", "builtin:easy", 4, 64,
        ("--gradient_checkpointing=false", "--lora_r=16", "--lora_alpha=32", "--vllm_max_model_length=1024"),
    ),
    "smoke": Profile(
        "", "builtin", 2, 8,
        ("--gradient_checkpointing=false", "--lora_r=8", "--lora_alpha=16", "--vllm_max_model_length=1024",
         "--probe_steps=50"),
    ),
}  # fmt: skip


@dataclass
class Plan:
    name: str
    seed: int
    profile: str
    num_processes: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    problems_per_step: int  # the step's count, in budget_unit (problems, or rollouts)
    max_steps: int
    output_dir: str
    final_checkpoint: str
    accelerate_config: str
    command: list[str] = field(default_factory=list)
    budget_unit: str = "problems"


def split_batch(per_step: int, num_processes: int, group: int = 1) -> tuple[int, int]:
    """(per-device batch, accumulation steps) with batch × accumulation × processes = per_step. `group` > 1:
    `per_step` counts rollouts, G = `group` per problem (budget_unit=rollouts), and the batch is whole groups, at
    most PER_DEVICE_BATCH problems' (the rollouts of a problems-unit micro-batch)."""
    unit = "problems" if group == 1 else "rollouts"
    if num_processes < 1 or per_step % num_processes:
        raise ValueError(
            f"{per_step} {unit} per step cannot be split over {num_processes} processes; use 1, 2, 4 or 8 GPUs"
        )
    per_process = per_step // num_processes
    if per_process % group:
        raise ValueError(
            f"budget_unit=rollouts: {per_step} rollouts per step over {num_processes} process(es) is {per_process} "
            f"per process, not a multiple of num_generations={group}; use fewer processes, a num_generations "
            f"that divides {per_process}, or budget_unit=problems"
        )
    problems = per_process // group
    batch = min(PER_DEVICE_BATCH, problems)
    while problems % batch:
        batch -= 1
    return batch * group, problems // batch


def budget_shape(overrides) -> tuple[str, int]:
    """(budget_unit, rollouts per problem G) as the recipe's and `OPSD_*` overrides set them (validated values;
    the config's own checks refuse a G the method cannot take): what the plan's split keeps whole."""
    from opsd.configuration.checks import default_generations

    values = {o.field: o.value for o in overrides}
    unit = values.get("budget_unit", "problems")
    generations = int(values.get("num_generations", 0)) or default_generations(values.get("method", "opsd"))
    return unit, max(generations, 1)


def accelerate_config_for(num_processes: int, gpu: bool, root: Path) -> Path:
    if not gpu:
        return root / "configs" / "accelerate" / "cpu.yaml"
    if num_processes == 4:
        return root / "accelerate.yaml"
    return root / "configs" / "accelerate" / f"zero2_{num_processes}gpu.yaml"


def make_plan(
    *, name: str, seed: int, num_gpus: int, profile: str, model: str | None, dataset: str | None,
    root: Path, gpu: bool, recipe: Path, runs_dir: Path | None = None, accelerate_config: Path | None = None,
    budget_unit: str = "problems", generations: int = 1,
) -> Plan:  # fmt: skip
    """The launch plan; `budget_unit` and `generations` (G) as the recipe sets them (`budget_shape`): with
    rollouts, the step's count is rollouts and each per-device batch whole groups of G."""
    if profile not in PROFILES:
        raise ValueError(f"profile {profile!r}; choose one of {sorted(PROFILES)}")
    prof = PROFILES[profile]
    procs = num_gpus if gpu else 1
    batch, accum = split_batch(prof.problems_per_step, procs, generations if budget_unit == "rollouts" else 1)
    out = (runs_dir or root / "runs") / name / f"capped_seed{seed}"
    if accelerate_config is not None:
        # accelerate reads it: a regular YAML file of at most 1 MiB (opsd.paths), not a device or a FIFO.
        cfg = check_file(accelerate_config, ACCELERATE_CONFIG)
    else:
        cfg = accelerate_config_for(procs, gpu, root)
        if not cfg.is_file():
            raise FileNotFoundError(
                f"no accelerate config for {procs} process(es): {cfg}; pass one with --accelerate-config"
            )
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), "--num_processes", str(procs),
        str(root / "opsd_train.py"), "--capped", "--recipe", str(recipe),
        f"--model_name_or_path={model if model is not None else prof.model}",
        f"--dataset_name={dataset if dataset is not None else prof.dataset}",
        f"--output_dir={out}", f"--seed={seed}", f"--max_steps={STEPS}",
        f"--per_device_train_batch_size={batch}", f"--gradient_accumulation_steps={accum}",
        f"--save_steps={SAVE_EVERY}", "--save_strategy=steps",
        "--micro_batch_size=auto", *prof.extra,
    ]  # fmt: skip
    if prof.max_completion_length is not None:
        # Placed before the recipe's overrides only in precedence terms: opsd_train appends recipe/env
        # values after these flags, so a recipe may still shorten completions further.
        cmd.append(f"--max_completion_length={prof.max_completion_length}")
    return Plan(
        name=name, seed=seed, profile=profile, num_processes=procs, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum, problems_per_step=prof.problems_per_step, max_steps=STEPS,
        output_dir=str(out), final_checkpoint=str(out / f"checkpoint-{STEPS}"), accelerate_config=str(cfg),
        command=cmd, budget_unit=budget_unit,
    )  # fmt: skip


def check_config(plan: Plan, root: Path, *, debug: bool) -> dict:
    """The dry run of training (`opsd.launch.preflight.dry_run`) on the planned arguments: the checks a real
    run makes before loading a model (config values, recipe and `OPSD_*`, prompt files, local model and data).
    Returns its report (resolved config, data rows, micro-batch plan, teacher pairing).

    It runs in this interpreter, so the training stack is imported once, not a second time in a child process
    (docs/performance.md h). Its log and progress output is kept out of the plan's terminal; under `--debug`
    it is shown."""
    import contextlib
    import io
    import logging

    from opsd.method.engine_env import training_process_env

    training_process_env()  # as opsd_train.py sets it, before TRL loads
    from opsd.launch.preflight import dry_run

    script = str(root / "opsd_train.py")
    args = plan.command[plan.command.index(script) + 1 :]
    out, err = io.StringIO(), io.StringIO()
    handlers = list(logging.getLogger().handlers)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            return dry_run(args)
    except BaseException:
        if debug:
            sys.stderr.write(err.getvalue())
        raise
    finally:
        for handler in set(logging.getLogger().handlers) - set(handlers):  # the dry run's, bound to `err`
            logging.getLogger().removeHandler(handler)


def main(argv: list[str] | None = None) -> int:
    """Plan the capped run, check it as training will, print the plan; then (not in a dry run) train."""
    argv, passthrough = _split_passthrough(list(sys.argv[1:] if argv is None else argv))
    debug, argv = split_debug(argv)
    a = _parser().parse_args(argv)
    visible, gpu, num_gpus = _gpu_processes(a)
    root = Path(a.root)
    # Absolute, not resolved: a message about the recipe names the file given, not where a link leads.
    recipe = Path(a.recipe).expanduser().absolute() if a.recipe else root / "recipe.env"
    try:
        if a.runs_dir:  # runs/<name>/capped_seed<seed> is created under it: it must be or become a directory
            check_output_dir(a.runs_dir, "--runs-dir")
        notes = _machine_notes(a, visible, gpu, num_gpus)
        from opsd.configuration.sources import resolve_with_replaced

        overrides, replaced = resolve_with_replaced(recipe, os.environ, capped=True)
        plan = _launch_plan(a, num_gpus, gpu, root, recipe, passthrough, budget_shape(overrides))
        checked = check_config(plan, root, debug=debug)
    except (UserError, ValueError, FileNotFoundError) as err:
        return report(err, "train_capped", debug=debug)
    out = _printed_plan(plan, overrides, replaced, checked, notes)
    print(json.dumps(out, indent=1, default=str), file=sys.stderr if not a.dry_run else sys.stdout)
    if a.dry_run:
        return 0
    return _train(plan)


def _split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the harness's own flags, the flags after `--`): everything after `--` goes to opsd_train.py
    (operational keys only)."""
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    return argv, passthrough


def _parser() -> argparse.ArgumentParser:
    """The harness's flags (the module docstring's synopsis)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--name", default="opsd")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--num-gpus",
        type=int,
        default=None,
        help=f"GPU processes: 1, 2, 4 or 8 (default: {DEFAULT_GPUS} where a GPU is present, else one CPU "
        "process). An explicit N always plans N GPU processes; without the GPUs a dry run still prints "
        "that plan and a real run refuses.",
    )
    p.add_argument("--profile", default="full", choices=sorted(PROFILES))
    p.add_argument("--model", default=None, help="model instead of the profile's (a hub name or a directory)")
    p.add_argument("--dataset", default=None, help="training data instead of the profile's")
    p.add_argument("--recipe", default=None, help="recipe file (default: recipe.env in the repo root)")
    p.add_argument("--root", default=str(Path(__file__).resolve().parents[2]))
    p.add_argument("--runs-dir", default=None, help="where runs/<name> go (default: runs/ in the repo root)")
    p.add_argument(
        "--accelerate-config",
        default=None,
        help="accelerate config instead of the one chosen by --num-gpus (accelerate.yaml for 4 GPUs, "
        "configs/accelerate/zero2_<N>gpu.yaml otherwise); --num-gpus still sets the process count",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="check the configuration as a real run does, print the plan and the budget arithmetic; train nothing",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a run whose recipe changed; the changes go to its opsd_config.json history",
    )
    return p


def _gpu_processes(a: argparse.Namespace) -> tuple[int, bool, int]:
    """(GPUs visible, whether the plan is for GPUs, processes planned): an explicit --num-gpus plans GPU
    processes whatever this machine has; without it, DEFAULT_GPUS where a GPU is present, else one CPU process."""
    import torch

    visible = torch.cuda.device_count()
    gpu = a.num_gpus is not None or visible > 0
    num_gpus = a.num_gpus if a.num_gpus is not None else (DEFAULT_GPUS if visible else 1)
    return visible, gpu, num_gpus


def _machine_notes(a: argparse.Namespace, visible: int, gpu: bool, num_gpus: int) -> list[str]:
    """More GPU processes planned than this machine has: a note in a dry run (the plan for a bigger machine),
    else a refusal that says what to pass."""
    notes = []
    if gpu and visible < num_gpus:
        problem = f"{num_gpus} GPU process(es) planned, and this machine has {visible} GPU(s)"
        if a.dry_run:
            notes.append(f"{problem}: this is the plan for a machine with {num_gpus}")
        elif visible == 0:
            raise UserError(
                f"{problem}; run on a machine with {num_gpus} GPUs, or leave out --num-gpus to train in one "
                "CPU process (--profile demo or smoke fit a CPU)"
            )
        else:
            raise UserError(
                f"{problem}; pass --num-gpus {visible} (the same budget) or run where there are more"
            )
    return notes


def _launch_plan(
    a: argparse.Namespace, num_gpus: int, gpu: bool, root: Path, recipe: Path, passthrough: list[str],
    shape: tuple[str, int] = ("problems", 1),
) -> Plan:  # fmt: skip
    """The plan (`make_plan`, for `shape`: budget_unit and G, `budget_shape`), its command extended with the
    pass-through flags (operational keys only) and --allow-config-change."""
    plan = make_plan(
        name=a.name, seed=a.seed, num_gpus=num_gpus, profile=a.profile, model=a.model,
        dataset=a.dataset, root=root, gpu=gpu, recipe=recipe,
        runs_dir=Path(a.runs_dir).resolve() if a.runs_dir else None,
        accelerate_config=Path(a.accelerate_config).resolve() if a.accelerate_config else None,
        budget_unit=shape[0], generations=shape[1],
    )  # fmt: skip
    from opsd.configuration.sources import flag_overrides, to_argv

    plan.command += to_argv(flag_overrides(passthrough))
    plan.command += ["--allow-config-change"] if a.allow_config_change else []
    return plan


def _printed_plan(plan: Plan, overrides, replaced, checked: dict, notes: list[str]) -> dict:
    """The plan as printed: the command, the recipe's overrides (and the lines an OPSD_* value replaces), the
    values training will use for every key the harness fixes or lets you tune, the step's problems and rollouts,
    and the budget arithmetic."""
    from opsd.configuration.sources import replaced_message
    from opsd.configuration.switches import BUDGET_KEYS, CAPPED_KEYS
    from opsd.launch.preflight import step_shape

    out = asdict(plan)
    out["overrides"] = [f"{o.field}={o.value} ({o.source})" for o in overrides]
    out["replaced"] = [replaced_message(o, by) for o, by in replaced]  # recipe lines an OPSD_* value replaces
    # The values training will use for every key the harness fixes or lets you tune.
    out["resolved"] = {k: v for k, v in sorted(checked["config"].items()) if k in CAPPED_KEYS | BUDGET_KEYS}
    out["data_rows"] = checked["data_rows"]
    out["notes"] = notes
    micro = checked["micro_batch"]
    out["micro_batch"] = micro
    config = checked["config"]
    out["step"] = step_shape(plan.problems_per_step, config["budget_unit"], config["num_generations"])
    out["budget"] = (
        f"{plan.max_steps} steps x {plan.problems_per_step} {plan.budget_unit} = {micro['micro_batch']} per "
        f"micro-batch x {micro['accumulation']} accumulation x {plan.num_processes} process(es) ({micro['reason']})"
    )
    out["shell"] = shlex.join(plan.command)
    return out


def _train(plan: Plan) -> int:
    """Run the planned command; a run that stops before its final checkpoint is complete says how to resume."""
    rc = subprocess.run(plan.command).returncode
    final = Path(plan.final_checkpoint)
    if rc != 0 or not (final / ".complete").is_file():
        print(
            f"train_capped: training stopped (exit {rc}) before {final} was complete; rerun the same "
            "command to resume from the last complete checkpoint",
            file=sys.stderr,
        )
        return rc or 1
    print(final)
    return 0


if __name__ == "__main__":
    exit_now(printing(main))  # a closed stdout (`--dry-run | head -1`) is a normal end
