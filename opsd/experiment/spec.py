"""What an experiment is: its arms (recipes), seeds and the settings every cell shares, saved in its directory.

An arm is a recipe: `NAME=FILE` (a recipe file, e.g. configs/recipes/published.env) or `NAME=KEY=VALUE[,KEY=VALUE]`
(overrides on top of `--recipe`, recipe.env by default). Either way the arm's whole recipe is written to
`DIR/recipes/NAME.env` and every cell of the arm trains from that copy, so editing recipe.env later cannot change
a running experiment. Arms are compared by their parsed settings (`opsd.configuration.recipe.parse_recipe`), not by file text:
comments and key order do not matter.

`DIR/experiment.json` holds the shared settings (profile, model, training data, evaluation flags, GPUs per run),
the arms and the seeds. A rerun must agree with it: a different shared setting or a changed arm is refused with
one line; new arms and new seeds are added and recorded under `history`.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opsd.errors import UserError

ROOT = Path(__file__).resolve().parents[2]  # the checkout: train_capped.sh and eval_aime.py live here
EXPERIMENT_FILE = "experiment.json"
RECIPES = "recipes"
RUNS = "runs"
EVALS = "evals"
LOGS = "logs"
BASE = "base"
STEPS = 100  # the capped budget's steps (opsd.run.capped.STEPS); the final checkpoint is checkpoint-100
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# eval_aime.py flags the experiment sets itself: what is scored, where, and how adapters are applied.
OWNED_EVAL_FLAGS = (
    "model", "adapter", "checkpoints", "base", "out", "merge_adapter", "compare", "aggregate", "plot_steps",
    "shard", "num_gpus",
)  # fmt: skip


@dataclass(frozen=True)
class Arm:
    name: str
    recipe: dict[str, str]  # field -> normalised value: the arm's identity
    source: str  # what the user gave: a file path or the inline overrides

    def recipe_text(self) -> str:
        """The recipe file the arm's cells train from; parsing it back gives `recipe` exactly."""
        lines = [f"# Arm {self.name} of an opsd experiment, from: {self.source}"]
        return "\n".join(lines + [f"{k.upper()}={_quoted(v)}" for k, v in sorted(self.recipe.items())]) + "\n"


def _quoted(value: str) -> str:
    """A recipe value as a line must hold it: quoted when it has spaces, `#` or quotes (a parsed value never
    holds both kinds of quote)."""
    if re.fullmatch(r"[^\s'\"#]*", value):
        return value
    return f'"{value}"' if '"' not in value else f"'{value}'"


@dataclass
class Spec:
    """The settings every cell shares; two runs of `python -m opsd.experiment` on one directory must agree."""

    profile: str
    model: str
    dataset: str
    eval_flags: list[str]
    gpus_per_run: int
    accelerate_config: str = ""  # train_capped.sh --accelerate-config ("" = the harness's choice)
    arms: dict[str, dict] = field(default_factory=dict)  # name -> {"recipe": {...}, "source": str}
    seeds: list[int] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)

    SHARED = ("profile", "model", "dataset", "eval_flags", "gpus_per_run", "accelerate_config")

    def arm(self, name: str) -> Arm:
        return Arm(name, dict(self.arms[name]["recipe"]), self.arms[name]["source"])

    @property
    def arm_names(self) -> list[str]:
        return list(self.arms)


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UserError(
            f"--seeds {text!r}: write integers separated by commas, e.g. --seeds 42,43,44"
        ) from None
    if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise UserError(f"--seeds {text!r}: give distinct non-negative integers, e.g. --seeds 42,43,44")
    return seeds


def _overrides_to_recipe(overrides) -> dict[str, str]:
    return {o.field: o.value for o in overrides}


def parse_arm(text: str, base_recipe: Path, cwd: Path = Path()) -> Arm:
    """`NAME=FILE` or `NAME=KEY=VALUE[,KEY=VALUE...]` (on top of `base_recipe`) into an Arm; UserError if bad."""
    from opsd.configuration.recipe import RecipeError, parse_recipe

    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not rest.strip():
        raise UserError(
            f"--arm {text!r}: write NAME=RECIPE_FILE or NAME=KEY=VALUE[,KEY=VALUE], e.g. "
            "--arm published=configs/recipes/published.env or --arm lr1e5=LEARNING_RATE=1e-5"
        )
    if not _NAME.fullmatch(name) or name == BASE:
        raise UserError(
            f"--arm {text!r}: the arm name {name!r} must be letters, digits, '_', '.', '-' (not starting with "
            f"'.' or '-') and not {BASE!r}, which names the base model's evaluation"
        )
    rest = rest.strip()
    try:
        if "=" not in rest:
            path = (cwd / rest).expanduser()
            if not path.is_file():
                raise UserError(
                    f"--arm {name}={rest}: no recipe file at {path}; give an existing recipe file or "
                    "KEY=VALUE overrides"
                )
            return Arm(name, _overrides_to_recipe(parse_recipe(path)), str(rest))
        recipe = _overrides_to_recipe(parse_recipe(base_recipe)) if base_recipe.is_file() else {}
    except RecipeError as err:
        raise UserError(f"--arm {name}: {err}".replace("\n", " ")) from None
    import tempfile

    # The overrides are parsed as recipe lines, by the parser every recipe goes through.
    with tempfile.TemporaryDirectory() as tmp:
        inline = Path(tmp) / "arm.env"
        inline.write_text("\n".join(item.strip() for item in rest.split(",")) + "\n")
        try:
            recipe.update(_overrides_to_recipe(parse_recipe(inline)))
        except RecipeError as err:
            shown = str(err).replace(f"{inline}: ", "", 1).replace(f"{inline}:", "item ").replace("\n", " ")
            raise UserError(f"--arm {name}={rest}: {' '.join(shown.split())}") from None
    return Arm(name, recipe, f"{base_recipe} + {rest}" if base_recipe.is_file() else rest)


def check_eval_flags(flags: list[str]) -> None:
    """The evaluation flags must parse as eval_aime.py's, without the ones the experiment sets itself."""
    import contextlib
    import io

    from opsd.evaluation.config import EvalConfig, parse_config

    placeholder = "(the experiment's)"
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            config = parse_config(["--out", placeholder, *flags])
    except (UserError, ValueError) as err:
        raise UserError(f"--eval-flags: {err}") from None
    except SystemExit:  # argparse's own refusal (a value of the wrong type, an unknown flag): its last line
        last = (usage.getvalue().strip().splitlines() or ["cannot be parsed"])[-1]
        raise UserError(
            f"--eval-flags: {last.split('error: ', 1)[-1]}; see python eval_aime.py --help"
        ) from None
    default = EvalConfig(out=placeholder)
    owned = [f for f in OWNED_EVAL_FLAGS if getattr(config, f) != getattr(default, f)]
    if owned:
        raise UserError(
            f"--eval-flags sets {', '.join('--' + f.replace('_', '-') for f in owned)}, which the experiment sets "
            "itself (the model is --model, results go under the experiment directory, adapters are merged)"
        )


def load(directory: Path) -> Spec | None:
    path = directory / EXPERIMENT_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return Spec(**data)
    except (json.JSONDecodeError, TypeError) as err:
        raise UserError(
            f"{path} cannot be read ({err}); it was not written by opsd.experiment, or it was edited"
        ) from None


def save(directory: Path, spec: Spec) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / (EXPERIMENT_FILE + ".tmp")
    tmp.write_text(json.dumps(asdict(spec), indent=1) + "\n")
    tmp.replace(directory / EXPERIMENT_FILE)
    (directory / RECIPES).mkdir(exist_ok=True)
    from opsd.configuration.recipe import parse_recipe

    for name in spec.arms:
        path = recipe_path(directory, name)
        text = spec.arm(name).recipe_text()
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
        if _overrides_to_recipe(parse_recipe(path)) != spec.arms[name]["recipe"]:
            raise RuntimeError(f"{path} does not read back as arm {name}'s recipe")  # a bug, not a user error


def merge(old: Spec | None, new: Spec, directory: Path) -> Spec:
    """`new` checked against the directory's `old`: shared settings equal, arms unchanged; additions recorded."""
    if old is None:
        new.history = [
            {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "arms": new.arm_names, "seeds": new.seeds}
        ]
        return new
    for key in Spec.SHARED:
        if getattr(old, key) != getattr(new, key):
            raise UserError(
                f"{directory} is an experiment with {key}={getattr(old, key)!r}; this command asks for "
                f"{getattr(new, key)!r}. An experiment directory holds one configuration: use a new --out, "
                "or the same settings to add arms or seeds"
            )
    for name, arm in new.arms.items():
        if name in old.arms and old.arms[name]["recipe"] != arm["recipe"]:
            was, now = old.arms[name]["recipe"], arm["recipe"]
            changed = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
            shown = ", ".join(
                f"{k.upper()} {was.get(k, '(unset)')} -> {now.get(k, '(unset)')}" for k in changed
            )
            raise UserError(
                f"arm {name!r} of {directory} was trained with another recipe ({shown}); give the new recipe "
                "another arm name, or restore the old one"
            )
    added_arms = [n for n in new.arms if n not in old.arms]
    added_seeds = [s for s in new.seeds if s not in old.seeds]
    merged = Spec(
        **{k: getattr(old, k) for k in Spec.SHARED},
        arms={**old.arms, **{n: new.arms[n] for n in added_arms}},
        seeds=old.seeds + added_seeds,
        history=list(old.history),
    )
    if added_arms or added_seeds:
        merged.history.append(
            {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "added_arms": added_arms, "added_seeds": added_seeds}
        )
    return merged


# -- the directory's layout and each cell's commands ------------------------------------------------------------


def recipe_path(directory: Path, arm: str) -> Path:
    return directory / RECIPES / f"{arm}.env"


def run_dir(directory: Path, arm: str, seed: int) -> Path:
    """Where train_capped.sh writes the cell (`--runs-dir DIR/runs --name ARM --seed S`)."""
    return directory / RUNS / arm / f"capped_seed{seed}"


def eval_dir(directory: Path, arm: str, seed: int) -> Path:
    """The cell's sweep: one subdirectory per scored checkpoint (checkpoint-N)."""
    return directory / EVALS / arm / f"seed{seed}"


def base_eval_dir(directory: Path) -> Path:
    return directory / EVALS / BASE


def final_checkpoint(directory: Path, arm: str, seed: int) -> Path:
    return run_dir(directory, arm, seed) / f"checkpoint-{STEPS}"


def train_argv(directory: Path, spec: Spec, arm: str, seed: int, extra: list[str] = ()) -> list[str]:
    """One capped run, exactly as a user would start it by hand."""
    argv = [
        "bash", str(ROOT / "train_capped.sh"), "--name", arm, "--seed", str(seed), "--profile", spec.profile,
        "--model", spec.model, "--dataset", spec.dataset, "--recipe", str(recipe_path(directory, arm)),
        "--runs-dir", str(directory / RUNS),
    ]  # fmt: skip
    if spec.gpus_per_run:
        argv += ["--num-gpus", str(spec.gpus_per_run)]
    if spec.accelerate_config:
        argv += ["--accelerate-config", spec.accelerate_config]
    return argv + (["--", *extra] if extra else [])


def eval_argv(directory: Path, spec: Spec, arm: str | None, seed: int | None, *, every_checkpoint: bool,
              extra: list[str] = ()) -> list[str]:  # fmt: skip
    """The base model (arm None) or one cell's checkpoints, scored with the experiment's evaluation flags. Every
    evaluation uses the same sampling seeds (eval_aime.py's --seed), so arms are paired per (problem, sample);
    adapters are merged, whose samples are reproducible run to run (LoRA serving on a GPU is not)."""
    argv = [sys.executable, str(ROOT / "eval_aime.py"), "--model", spec.model, *spec.eval_flags, *extra]
    if arm is None:
        return argv + ["--out", str(base_eval_dir(directory))]
    target = run_dir(directory, arm, seed) if every_checkpoint else final_checkpoint(directory, arm, seed)
    return argv + ["--checkpoints", str(target), "--no-base", "--merge-adapter",
                   "--out", str(eval_dir(directory, arm, seed))]  # fmt: skip


def shell(argv: list[str]) -> str:
    return shlex.join(argv)
