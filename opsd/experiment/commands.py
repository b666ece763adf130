"""`python -m opsd.experiment`: recipes x seeds under the capped budget, every checkpoint scored alike, a paired
verdict with its noise. Two commands: `run` (the default, so `run` may be left out) and `report`.

    python -m opsd.experiment run --out runs/exp/clip \\
        --arm published=configs/recipes/published.env --arm improved=recipe.env --seeds 42,43,44
    python -m opsd.experiment --out runs/exp/lr --arm default=recipe.env --arm lr2e5=LEARNING_RATE=2e-5 \\
        --profile demo --eval-flags "--dataset builtin:easy --n 4 --max-tokens 128 --max-model-len 1024 --no-thinking"
    python -m opsd.experiment --out runs/exp/clip --print-commands    # one line per cell, for a cluster scheduler
    python -m opsd.experiment report runs/exp/clip [--baseline published] [--target-diff 1]

Each cell (arm, seed) is one `train_capped.sh` run, unchanged (the budget is the harness's), then one
`eval_aime.py` evaluation of its checkpoint-100 (`--every-checkpoint`: all of its checkpoints) with the
experiment's evaluation flags (default: eval_aime.py's AIME 2024 avg@12 protocol) and `--seed SEED`, training seed
SEED's sampling seeds; the base model is scored once per seed the same way.
Rerunning the command resumes: finished cells are skipped, interrupted ones continue. Without `--arm` and
`--seeds` a rerun takes the directory's own. Results: DIR/report.md, DIR/summary.json, DIR/verdict.png,
DIR/curves.png, also written by `report` from whatever has finished. Bad input: one line, exit status 2.
SIGTERM and SIGHUP stop the command as Ctrl-C does: its jobs are stopped and its temporary files removed.
Paths (--model, --dataset, --recipe, recipe files, the paths inside --eval-flags and in recipes) are read
where the command is given and recorded absolute.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from opsd.errors import UserError, report, shown, split_debug, stop_signals
from opsd.experiment import spec as S
from opsd.experiment.arms import parse_arm

logger = logging.getLogger("opsd.experiment")
PROG = "python -m opsd.experiment"
COMMANDS = ("run", "report")
DEFAULT_COMMAND = "run"
DEFAULT_SEEDS = "42,43,44"
GPUS_PER_RUN = (1, 2, 4, 8)
MAX_REPS = (
    1_000_000  # bootstrap replicates: beyond this the report takes minutes and its interval moves < 0.01
)


class Parser(argparse.ArgumentParser):
    """argparse's own refusals (an unknown flag, `--stagger abc`) as one UserError line, like every other."""

    def error(self, message: str):
        raise UserError(f"{message}; see {self.prog} --help")


def parser() -> argparse.ArgumentParser:
    """`run` (the default: a command line without a command runs the experiment) and `report`."""
    p = Parser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", metavar="{run,report}", required=True)
    run_p = commands.add_parser("run", help="Run (or resume) the experiment, then write its verdict (the default).",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_run_flags(run_p)
    add_report_flags(run_p)
    run_p.set_defaults(func=run)
    report_p = commands.add_parser(
        "report", help="The verdict so far, from whatever has finished.", description="The verdict so far."
    )
    report_p.add_argument("directory")
    add_report_flags(report_p)
    report_p.set_defaults(func=report_command)
    return p


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="The experiment directory (one configuration per directory).")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=RECIPE|NAME=KEY=VALUE[,KEY=VALUE]",
                   help="An arm: a recipe file, or overrides on top of --recipe. Repeat for each arm.")  # fmt: skip
    p.add_argument(
        "--seeds", default=None, help=f"Training seeds, paired across arms (new experiment: {DEFAULT_SEEDS})."
    )
    p.add_argument("--recipe", default=str(S.ROOT / "recipe.env"), help="The recipe inline arms start from.")
    p.add_argument(
        "--profile", default=None, help="train_capped.sh --profile: full (default) | demo | smoke."
    )
    p.add_argument("--model", default=None, help="Model to train and score (default: the profile's).")
    p.add_argument("--dataset", default=None, help="Training data (default: the profile's).")
    p.add_argument("--eval-flags", default=None, metavar="FLAGS",
                   help="eval_aime.py flags of the protocol, one string (default: none, the AIME 2024 avg@12 "
                   "protocol), e.g. \"--dataset my_eval.jsonl --n 8\".")  # fmt: skip
    p.add_argument(
        "--gpus", default=None, help="GPUs to use, e.g. 0,1,2,3 (default: every visible GPU; none: CPU)."
    )
    p.add_argument(
        "--gpus-per-run",
        type=int,
        default=None,
        help="GPUs of one cell (default 1; train_capped.sh --num-gpus).",
    )
    p.add_argument("--accelerate-config", default=None,
                   help="train_capped.sh --accelerate-config for every cell (e.g. configs/accelerate/single_gpu.yaml "
                   "where DeepSpeed is not installed).")  # fmt: skip
    p.add_argument("--cells-per-gpu", type=int, default=1,
                   help="Jobs sharing one GPU slot at once (a small model); each vLLM engine then gets --kv-cache-gib.")  # fmt: skip
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="Fixed KV cache of every engine (default: 1.5 when --cells-per-gpu > 1, else vLLM's own sizing).")  # fmt: skip
    p.add_argument(
        "--stagger",
        type=float,
        default=None,
        help="Seconds between job starts (default: 10 when sharing a GPU, else 0).",
    )
    p.add_argument(
        "--every-checkpoint",
        action="store_true",
        help="Score every saved checkpoint, not only checkpoint-100.",
    )
    p.add_argument(
        "--retries", type=int, default=1, help="Retries of a failed job before it is reported (default 1)."
    )
    p.add_argument(
        "--print-commands", action="store_true", help="Write the plan, print each job's command, run nothing."
    )
    p.add_argument(
        "--status-every",
        type=float,
        default=30.0,
        help="Seconds between status tables (also on every change).",
    )


def add_report_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--baseline", default=None, help="The arm every other is compared with (default: the first)."
    )
    p.add_argument(
        "--target-diff", type=float, default=1.0, help="Points: how many seeds would detect this (default 1)."
    )
    p.add_argument(
        "--bootstrap-reps", type=int, default=10000, help="Replicates of the hierarchical bootstrap."
    )


def visible_gpus(requested: str | None) -> list[str]:
    if requested is not None:
        gpus = [g.strip() for g in requested.split(",")]
        if not all(g.isascii() and g.isdigit() and len(g) <= 3 for g in gpus) or len(set(gpus)) != len(gpus):
            raise UserError(
                f"--gpus {shown(requested)}: give distinct GPU indices separated by commas, e.g. --gpus 0,1,2,3 "
                "(to run on the CPU, set CUDA_VISIBLE_DEVICES='' and leave --gpus out)"
            )
        return gpus
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g.strip() for g in env.split(",") if g.strip() and g.strip() != "-1"]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def refuse_method_env(environ=os.environ) -> None:
    """OPSD_* method switches in the environment would apply to every arm unrecorded: they belong in an arm."""
    from opsd.configuration.sources import RESERVED_ENV
    from opsd.configuration.switches import ALIASES, CAPPED_KEYS, ENV_PREFIX

    found = sorted(k for k in environ if k.startswith(ENV_PREFIX) and k not in RESERVED_ENV)
    if found:
        # An arm's recipe takes the upper-case key (OPSD_learning_rate is LEARNING_RATE there).
        field = found[0].removeprefix(ENV_PREFIX).lower()
        field = ALIASES.get(field, field)
        if field in CAPPED_KEYS:
            fix = f"put the switch in an arm instead (--arm NAME={field.upper()}=VALUE)"
        else:
            fix = f"{field.upper()} is not a setting an arm's recipe may hold either"
        raise UserError(
            f"{', '.join(found)} set in the environment would change every arm without being recorded; unset "
            f"it and {fix}"
        )


def split_eval_flags(text: str) -> list[str]:
    """`--eval-flags` split into eval_aime.py's arguments as a shell splits them; one line for a quote or a
    backslash left open."""
    try:
        return shlex.split(text)
    except ValueError as err:  # shlex's own words: "No closing quotation", "No escaped character"
        raise UserError(
            f"--eval-flags {shown(text)}: {str(err).lower()}; close every quote and escape inside the one "
            "string, e.g. --eval-flags \"--dataset 'my eval.jsonl' --n 8\""
        ) from None


def make_spec(a: argparse.Namespace, old: S.Spec | None, gpus: list[str]) -> S.Spec:
    """The experiment's spec from the flags, each value not given kept from `old` (the recorded spec) or the
    default; every value is checked here, before anything runs."""
    from opsd.launch.capped import PROFILES

    profile = a.profile or (old.profile if old else "full")
    if profile not in PROFILES:
        raise UserError(f"--profile {profile!r}: choose one of {', '.join(sorted(PROFILES))}")
    eval_flags = _eval_flags(a, old)
    gpus_per_run = _gpus_per_run(a, old, gpus)
    arms = _arms(a, old)
    if a.model == "":
        raise UserError(
            "--model '': name a model (a hub id, a local directory, or `embedded` for the embedded "
            "SmolLM2-135M-Instruct), or leave --model out for the profile's"
        )
    seeds = (
        S.parse_seeds(a.seeds)
        if a.seeds is not None
        else (old.seeds if old else S.parse_seeds(DEFAULT_SEEDS))
    )
    prof = PROFILES[profile]
    for value, what in ((a.model, "--model"), (a.dataset, "--dataset")):
        if value is not None:
            S.check_text(value, what)  # before it is read as a path: a NUL byte is no path
    accelerate = _accelerate_config(a, old)
    return S.Spec(
        profile=profile,
        model=S.absolute_path(a.model) if a.model is not None else (old.model if old else prof.model),
        dataset=S.absolute_path(a.dataset, data=True) if a.dataset is not None else (old.dataset if old else prof.dataset),
        eval_flags=eval_flags, gpus_per_run=gpus_per_run, arms=arms or dict(old.arms), seeds=seeds,
        accelerate_config=accelerate,
    )  # fmt: skip


def _eval_flags(a: argparse.Namespace, old: S.Spec | None) -> list[str]:
    """The evaluation's flags, checked. Every path a user gives is read where it was given, and recorded
    absolute: the jobs run in the checkout."""
    eval_flags = (
        S.absolute_eval_flags(split_eval_flags(a.eval_flags))
        if a.eval_flags is not None
        else (old.eval_flags if old else [])
    )
    S.check_eval_flags(eval_flags, every_checkpoint=a.every_checkpoint)
    return eval_flags


def _gpus_per_run(a: argparse.Namespace, old: S.Spec | None, gpus: list[str]) -> int:
    """GPUs per cell: 1, 2, 4 or 8 dividing the visible GPUs, or 0 without GPUs (one CPU process per cell)."""
    gpus_per_run = (
        a.gpus_per_run if a.gpus_per_run is not None else (old.gpus_per_run if old else (1 if gpus else 0))
    )
    if gpus and gpus_per_run < 1 or not gpus and gpus_per_run:
        raise UserError(
            f"--gpus-per-run {gpus_per_run} with {len(gpus)} GPU(s): give 1, 2, 4 or 8 on a GPU machine; without "
            "GPUs leave it out (one CPU process per cell)"
        )
    if gpus and gpus_per_run not in GPUS_PER_RUN:
        raise UserError(f"--gpus-per-run {gpus_per_run}: give 1, 2, 4 or 8")
    if gpus and len(gpus) % gpus_per_run:
        raise UserError(
            f"--gpus-per-run {gpus_per_run} does not divide the {len(gpus)} GPU(s) {','.join(gpus)}"
        )
    return gpus_per_run


def _arms(a: argparse.Namespace, old: S.Spec | None) -> dict[str, dict]:
    """The arms the flags name ({name: {recipe, source}}; empty: the recorded ones stay), each parsed against
    --recipe; a new experiment needs two."""
    base_recipe = None
    if a.recipe:  # '' starts inline arms from the defaults
        from opsd.paths import RECIPE_FILE, check_file

        S.check_text(a.recipe, "--recipe")  # an inline arm's source names it
        base_recipe = check_file(a.recipe, RECIPE_FILE).absolute()
    if len(a.arm) > S.MAX_ARMS:
        raise UserError(f"{len(a.arm)} --arm flags: an experiment holds at most {S.MAX_ARMS} arms; split it")
    arms = {}
    for text in a.arm:
        S.check_text(text, "--arm")  # its text is recorded as the arm's source
        arm = parse_arm(text, base_recipe, Path.cwd())
        if arm.name.lower() in {n.lower() for n in arms}:
            raise UserError(
                f"--arm {arm.name} is given twice (names differ in case at most); every arm needs its own name"
            )
        arms[arm.name] = {"recipe": arm.recipe, "source": arm.source}
    if old is None and len(arms) < 2:
        raise UserError(
            f"a new experiment needs at least two arms, got {len(arms)}: --arm NAME=RECIPE_FILE or "
            "--arm NAME=KEY=VALUE, once per arm"
        )
    return arms


def _accelerate_config(a: argparse.Namespace, old: S.Spec | None) -> str:
    """The accelerate config file, resolved ('' for none), or the recorded one when the flag is not given."""
    accelerate = old.accelerate_config if old and a.accelerate_config is None else (a.accelerate_config or "")
    if accelerate:
        from opsd.paths import ACCELERATE_CONFIG, check_file

        accelerate = str(check_file(accelerate, ACCELERATE_CONFIG).resolve())
        S.check_text(accelerate, "--accelerate-config")
    return accelerate


def dry_run_argv(scratch: Path, spec: S.Spec, arm: str) -> list[str]:
    """The dry run of `arm`'s first cell, laid out under `scratch` as the experiment lays out its directory."""
    argv = S.train_argv(scratch, spec, arm, spec.seeds[0])
    argv.insert(2, "--dry-run")
    return argv


def dry_run_arms(directory: Path, spec: S.Spec, arms: list[str]) -> dict[str, dict]:
    """`train_capped.sh --dry-run` of each of `arms`: its recipe is checked exactly as a real run will check it,
    before the experiment directory is written. {arm: the settings its cells will train with (the dry run's
    resolved keys)}. Each dry run is a process group of its own, stopped whole when the command is (a signal, a
    Ctrl-C), and its temporary recipe removed; a refusal names the arm's own settings and the directory the
    cells will use, not the temporary copy."""
    import json
    import tempfile

    resolved = {}
    for arm in arms:
        with tempfile.TemporaryDirectory() as tmp:
            scratch = Path(tmp)
            text = spec.arm(arm).recipe_text()
            S.recipe_path(scratch, arm).parent.mkdir(parents=True)
            S.recipe_path(scratch, arm).write_text(text)
            env = {**os.environ, "PYTHON": sys.executable}
            rc, out, err = run_group(dry_run_argv(scratch, spec, arm), env=env, cwd=S.ROOT)
            if rc != 0:
                last = (err.strip().splitlines() or ["(no message)"])[-1]
                last = without_scratch(last, scratch, directory, arm, text)
                raise UserError(f"arm {arm!r} ({spec.arms[arm]['source']}): {last}")
        try:
            resolved[arm] = json.loads(out)["resolved"]
        except (ValueError, KeyError, TypeError):  # the dry run's own output: a bug if it is not its plan
            raise RuntimeError(
                f"arm {arm!r}: train_capped.sh --dry-run printed no plan: {out[-500:]!r}"
            ) from None
    return resolved


def run_group(argv: list[str], *, env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `argv`, run as a process group of its own: whatever stops this command
    (an exception, Ctrl-C, SIGTERM or SIGHUP raised as KeyboardInterrupt) stops the whole group, whatever the
    child started included, before it propagates."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                            start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate()
    except BaseException:
        stop_group(proc)
        raise
    return proc.returncode, out, err


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to `proc`'s process group, 10 s for its leader to end, then SIGKILL to whatever of the group is
    left (a grandchild that outlived it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue


def without_scratch(message: str, scratch: Path, directory: Path, arm: str, recipe_text: str) -> str:
    """A dry run's message with its temporary files named as the user knows them: a line of the temporary
    recipe by its setting (`--arm b's FIXED_ADVANTAGE=1.0`), the recipe as the arm's, and the scratch layout as
    the experiment directory, where the cells will write."""
    import re

    lines = recipe_text.splitlines()
    recipe = str(S.recipe_path(scratch, arm))

    def line(match: re.Match) -> str:
        n = int(match[1])
        return f"--arm {arm}'s {lines[n - 1]}" if 1 <= n <= len(lines) else f"--arm {arm}'s recipe"

    message = re.sub(re.escape(recipe) + r":([0-9]+)", line, message)
    return message.replace(recipe, f"--arm {arm}'s recipe").replace(str(scratch), str(directory))


def check_distinct_arms(spec: S.Spec, resolved: dict[str, dict], fresh: list[str]) -> None:
    """Refuse a new arm that trains exactly as another (its resolved settings equal once the fields they leave
    without effect are set aside: `arms.effective_recipe`), in one line naming the settings it sets that do
    nothing; log a warning for each such setting of an arm that differs all the same."""
    from dataclasses import fields

    from opsd.configuration.checks import inert_fields
    from opsd.configuration.config import OPSDConfig
    from opsd.experiment.arms import effective_recipe

    defaults = {f.name: f.default for f in fields(OPSDConfig)}
    effective = {arm: effective_recipe(settings) for arm, settings in resolved.items()}
    for arm in fresh:
        idle = inert_fields(resolved[arm])
        # The arm's own settings that do nothing (a recipe's line at the default says nothing either way).
        notes = [
            f"{k.upper()}={v} has no effect: {idle[k]}"
            for k, v in spec.arms[arm]["recipe"].items()
            if k in idle and resolved[arm].get(k) != defaults.get(k)
        ]
        for other in spec.arm_names:
            if other == arm or other not in effective:
                continue
            if other in fresh and spec.arm_names.index(other) > spec.arm_names.index(arm):
                continue  # a pair of new arms is named once, at the later one
            if effective[arm] == effective[other]:
                why = f": {'; '.join(notes)}" if notes else ""
                raise UserError(
                    f"arm {arm!r} ({spec.arms[arm]['source']}) trains exactly as arm {other!r}: their settings are "
                    f"equal once those without effect are set aside{why}; change a setting that acts, or drop the arm"
                )
        for note in notes:
            logger.warning("arm %s: %s", arm, note)


def print_commands(directory: Path, spec: S.Spec, every_checkpoint: bool) -> None:
    cells = [(arm, seed) for seed in spec.seeds for arm in spec.arm_names]
    print(f"# {directory}: {len(spec.arm_names)} arm(s) x {len(spec.seeds)} seed(s). Run the lines in any order "
          "and on any machine that sees this directory; a cell's line trains, then scores.")  # fmt: skip
    print("# the base model, once per seed (each seed's evaluations share their sampling seeds)")
    for seed in spec.seeds:
        print(S.shell(S.eval_argv(directory, spec, None, seed, every_checkpoint=False)))
    for arm, seed in cells:
        print(f"# cell {arm}/{seed}")
        train = S.shell(S.train_argv(directory, spec, arm, seed))
        print(
            f"{train} && {S.shell(S.eval_argv(directory, spec, arm, seed, every_checkpoint=every_checkpoint))}"
        )
    print("# the verdict, from whatever has finished")
    print(S.shell([sys.executable, "-m", "opsd.experiment", "report", str(directory)]))


def run(a: argparse.Namespace) -> int:
    from opsd.experiment import cells as C
    from opsd.experiment.schedule import Runner, RunSettings, make_slots
    from opsd.experiment.status import Display
    from opsd.paths import check_output_dir

    check_numbers(a)
    directory = check_output_dir(a.out, "--out").resolve()
    refuse_method_env()
    gpus = visible_gpus(a.gpus)
    old = S.load(directory)
    new = make_spec(a, old, gpus)
    spec = S.merge(old, new, directory)
    if a.cells_per_gpu > 1 and not gpus:
        raise UserError("--cells-per-gpu shares a GPU; without GPUs cells run one at a time")
    check_baseline(a.baseline, spec, directory)
    # The checks its jobs would make, so that no name they cannot use is recorded; a plan printed for another
    # machine does not depend on this one's model cache.
    S.check_spec_inputs(spec, fetch=not a.print_commands)
    if old is not None:
        C.check_directory(
            directory, spec
        )  # a damaged result or a link out is refused now, not after hours of jobs
    else:
        C.check_links(directory, spec)  # an existing --out may hold links already
    S.recordable(directory, spec)  # before the dry runs, which take seconds an arm
    fresh = [n for n in spec.arm_names if old is None or n not in old.arms]
    if fresh:  # the arms already there are dry-run too, to compare the new ones with
        check_distinct_arms(spec, dry_run_arms(directory, spec, spec.arm_names), fresh)
    S.save(directory, spec)
    if a.print_commands:
        print_commands(directory, spec, a.every_checkpoint)
        return 0
    sharing = a.cells_per_gpu > 1
    settings = RunSettings(
        every_checkpoint=a.every_checkpoint,
        kv_cache_gib=a.kv_cache_gib if a.kv_cache_gib is not None else (1.5 if sharing else 0.0),
        stagger_s=a.stagger if a.stagger is not None else (10.0 if sharing else 0.0),
        retries=a.retries, status_every_s=a.status_every,
    )  # fmt: skip
    runner = Runner(directory, spec, make_slots(gpus, spec.gpus_per_run or 1, a.cells_per_gpu), settings)
    runner.plan()
    logger.info("%s: %d arm(s) x %d seed(s), %d job(s) to run on %s", directory, len(spec.arm_names),
                len(spec.seeds), len(runner.progress.queued), ",".join(gpus) or "the CPU")  # fmt: skip
    runner.run(Display().show)
    write_report(directory, a)
    failed = C.read_failed(directory)
    return 1 if failed else 0


def _number(name: str, value: float, low: float, high: float, *, low_open: bool = False) -> None:
    ok = math.isfinite(value) and (value > low if low_open else value >= low) and value <= high
    if not ok:
        side = f"> {low:g}" if low_open else f">= {low:g}"
        raise UserError(f"{name} {value}: give a number {side} and <= {high:g}")


def check_report_flags(a: argparse.Namespace) -> None:
    _number("--target-diff", a.target_diff, 0, 100, low_open=True)  # points of a percentage
    _number("--bootstrap-reps", a.bootstrap_reps, 100, MAX_REPS)


def check_numbers(a: argparse.Namespace) -> None:
    """Every numeric flag within the range it makes sense in; one line naming the flag otherwise."""
    check_report_flags(a)
    _number("--cells-per-gpu", a.cells_per_gpu, 1, 64)
    _number("--retries", a.retries, 0, 10)
    _number("--status-every", a.status_every, 0, 86400, low_open=True)
    if a.kv_cache_gib is not None:
        _number("--kv-cache-gib", a.kv_cache_gib, 0, 1024)  # 0: vLLM sizes the cache itself
    if a.stagger is not None:
        _number("--stagger", a.stagger, 0, 3600)
    if a.out == "":
        raise UserError("--out '': name the experiment directory (it is created if missing)")


def check_baseline(baseline: str | None, spec: S.Spec, directory: Path) -> None:
    if baseline is not None and baseline not in spec.arms:
        raise UserError(
            f"--baseline {baseline!r} is not an arm of {directory}; its arms: {', '.join(spec.arm_names)}"
        )


def write_report(directory: Path, a: argparse.Namespace) -> None:
    from opsd.experiment.rendering import console_lines, write
    from opsd.experiment.stats import UnpairedCells

    try:
        result, paths = write(
            directory, baseline=a.baseline, target_diff=a.target_diff, reps=a.bootstrap_reps
        )
    except UnpairedCells as err:  # nothing was written: the report renders everything first
        problem = unpaired_evaluations(directory)
        if problem is None:  # the statistics were handed cells that the files do not hold: a bug
            raise
        raise UserError(problem) from err
    for line in console_lines(result):
        print(line)
    for path in paths:
        print(f"written: {path}")


def unpaired_evaluations(directory: Path) -> str | None:
    """The first two finished evaluations of one training seed (the base model's, each arm's at the reported
    step) whose samples cannot be paired, in one line naming both files and the fix; None when every pair can
    be. With `--benchmarks` in the evaluation flags each benchmark's evaluations are paired among themselves
    (`cells.read_evals`), as the verdict pairs them.

    Every evaluation of an experiment is scored with its --eval-flags, so any two share their problems and
    their sample count; one scored by hand with other flags (another dataset, another --n) breaks the pairing
    the verdict rests on. Read only after the statistics refused a pair (`stats.UnpairedCells`), which knows
    neither file."""
    from opsd.evaluation.samples import SAMPLES_FILE
    from opsd.experiment import cells as C
    from opsd.paths import shown

    spec = S.load(directory)
    if spec is None:
        return None
    fix = "delete that one's evaluation directory and rerun the experiment to score it again"
    step, benchmarks = C.declared_step(spec), C.spec_benchmarks(spec)
    for seed in spec.seeds:
        found = [S.base_eval_dir(directory, seed)] if C.base_scored(directory, seed) else []
        found += [
            where
            for arm in spec.arm_names
            if (where := C.scored_steps(S.eval_dir(directory, arm, seed)).get(step)) is not None
        ]
        # benchmark (None: the one table) -> (samples file, metrics, scores) of each evaluation found
        tables: dict[str | None, list] = {}
        for where in found:
            for name, (metrics, scores) in C.read_evals(where, benchmarks).items():
                samples = (where / name if name else where) / SAMPLES_FILE
                tables.setdefault(name, []).append((shown(samples), metrics, scores))
        for name, read in tables.items():
            what = f"seed {seed}'s samples of {name}" if name else f"seed {seed}'s samples"
            for i, (a_file, a_metrics, a_scores) in enumerate(read):
                for b_file, b_metrics, b_scores in read[i + 1 :]:
                    a_ids, b_ids = a_scores["correct"].keys(), b_scores["correct"].keys()
                    if not a_ids & b_ids:
                        return (
                            f"{a_file} and {b_file} share no problem id ({len(a_ids)} and {len(b_ids)} "
                            f"problems), so {what} cannot be paired: one was scored on other problems than the "
                            f"experiment's --eval-flags give; {fix}"
                        )
                    if a_metrics["n"] != b_metrics["n"]:
                        return (
                            f"{a_file} holds {a_metrics['n']} samples per problem and {b_file} "
                            f"{b_metrics['n']}, so {what} cannot be paired: one was scored with another --n "
                            f"than the experiment's --eval-flags give; {fix}"
                        )
    return None


def report_command(a: argparse.Namespace) -> int:
    """`report DIR`: the verdict from whatever has finished."""
    from opsd.paths import check_input_dir

    check_report_flags(a)
    directory = check_input_dir(a.directory, "report", "pass an experiment directory").resolve()
    if not (directory / S.EXPERIMENT_FILE).is_file():
        raise UserError(f"{a.directory} is not an experiment directory (no {S.EXPERIMENT_FILE})")
    write_report(directory, a)
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line; one without a command (`--out DIR --arm ...`, as the docs and scripts write it) is `run`."""
    if argv[:1] and not argv[0].startswith("-") and argv[0] not in COMMANDS:  # `run` takes no positional
        raise UserError(
            f"unknown command {shown(argv[0])}: use {' or '.join(COMMANDS)}, e.g. {PROG} report DIR (a command line "
            f"that starts with a flag runs the experiment)"
        )
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv = [DEFAULT_COMMAND, *argv]
    return parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The command line (`sys.argv` when None: the process's own, which keeps ignoring stop signals once stopped).

    SIGTERM and SIGHUP stop it as Ctrl-C does (`opsd.errors.stop_signals`): their default would end the process where
    it stands, leaving an arm's dry-run recipe in its temporary directory, its dry run orphaned and a half-written
    file behind. The first stop prints one line; a second one (`timeout` signals the command, then its group) adds
    nothing."""
    process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    debug, argv = split_debug(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with stop_signals(restore_after_stop=not process):
        try:
            a = parse(argv)
            return a.func(a)
        except UserError as err:
            return report(err, "opsd.experiment", debug=debug)
        except KeyboardInterrupt:
            print("opsd.experiment: stopped; rerun the same command to resume", file=sys.stderr)
            return 130
