"""What an experiment is: its arms (recipes), seeds and the settings every cell shares, saved in its directory.

An arm is a recipe (`opsd.experiment.arms`); each arm's whole recipe is copied to `DIR/recipes/NAME.env` and every
cell of the arm trains from that copy, so editing recipe.env later cannot change a running experiment.

`DIR/experiment.json` holds the shared settings (profile, model, training data, evaluation flags, GPUs per run),
the arms and the seeds. A rerun must agree with it: a different shared setting or a changed arm is refused with
one line; new arms and new seeds are added and recorded under `history`. It is checked field by field when read
(`load`), so a hand-edited file cannot name an arm that escapes the directory, and `save` writes only what `load`
accepts: at most `MAX_SEEDS` seeds and `MAX_ARMS` arms, every text one line of at most `MAX_TEXT_CHARS`, the file
within its 16 MiB cap.

Before anything is written, `check_spec_inputs` checks the model, the training data and the evaluation's flags
with the checks its jobs make (`opsd.models.check_model_source`, the data loaders' own names and files), so
that a name no job could use is refused at once rather than in every cell.

Sampling seeds. Every evaluation of training seed s (each arm's cell, and the base model scored for that seed)
runs `eval_aime.py --seed s` (`sampling_seed`): within a seed the arms and the base draw sample i of problem p
with the same seed, so their difference is paired; across seeds the evaluation noise is drawn afresh, so it
averages out over seeds like the training noise does (one set of sampling seeds for every training seed would
repeat the same evaluation noise in each seed's difference, which no number of seeds averages away).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from opsd.errors import MissingPath, UserError, cut, shown
from opsd.experiment.arms import BASE, Arm, check_name, overrides_to_recipe
from opsd.launch.capped import STEPS
from opsd.paths import MIB, RECIPE_FILE, FileKind, json_error, parse_json, size_text, write_atomically
from opsd.rundir import checkpoint_dir

if TYPE_CHECKING:  # eval_config imports transformers' argument parser: loaded where flags are parsed
    from opsd.evaluation.eval_config import EvalConfig

ROOT = Path(__file__).resolve().parents[2]  # the checkout: train_capped.sh and eval_aime.py live here
EXPERIMENT_FILE = "experiment.json"
RECIPES = "recipes"
RUNS = "runs"
EVALS = "evals"
LOGS = "logs"
MAX_SEED = 2**31 - 1  # numpy and torch seed generators take 32-bit seeds
# An experiment's size. Every seed is a capped run per arm (an hour or more on a GPU): a thousand seeds is far
# beyond any experiment, and a list longer than that is a mistake (a range typed out, a generated list).
MAX_SEEDS = 1000
MAX_ARMS = 64
# A recorded text (a model, a dataset, a path, an evaluation flag, an arm's source): one line, as long as a path
# may be; report.md quotes them in its lines.
MAX_TEXT_CHARS = 4096
# The layout of experiment.json and the directory; 1 (no field): every cell scored with eval_aime.py's default
# sampling seeds and the base model scored once.
LAYOUT = 2
# eval_aime.py flags the experiment sets itself: what is scored, where, and how adapters are applied.
OWNED_EVAL_FLAGS = (
    "model", "adapter", "checkpoints", "base", "out", "merge_adapter", "compare", "aggregate", "plot_steps",
    "shard", "num_gpus", "seed",
)  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """The settings every cell shares, its arms and seeds: `DIR/experiment.json`, fixed while the experiment runs;
    two runs of `python -m opsd.experiment` on one directory must agree."""

    profile: str
    model: str
    dataset: str
    eval_flags: list[str]
    gpus_per_run: int
    accelerate_config: str = ""  # train_capped.sh --accelerate-config ("" = the harness's choice)
    arms: dict[str, dict] = field(default_factory=dict)  # name -> {"recipe": {...}, "source": str}
    seeds: list[int] = field(default_factory=list)
    history: list[dict] = field(default_factory=list)
    layout: int = LAYOUT

    SHARED = ("profile", "model", "dataset", "eval_flags", "gpus_per_run", "accelerate_config")

    def arm(self, name: str) -> Arm:
        return Arm(name, dict(self.arms[name]["recipe"]), self.arms[name]["source"])

    @property
    def arm_names(self) -> list[str]:
        return list(self.arms)


def plain_line(value: object, max_chars: int = MAX_TEXT_CHARS) -> bool:
    """One line of printable text (no newline, tab or other control character) of at most `max_chars`."""
    return isinstance(value, str) and len(value) <= max_chars and value.isprintable()


def check_text(value: str, what: str) -> None:
    """A text the experiment records and quotes (`plain_line`); UserError naming `what` otherwise."""
    if not plain_line(value):
        raise UserError(
            f"{what} {shown(value)} is not one line of printable text of at most {MAX_TEXT_CHARS} characters; "
            "give it without newlines, tabs or other control characters"
        )


def parse_seeds(text: str) -> list[int]:
    quoted = shown(text)
    if text.count(",") >= MAX_SEEDS:  # before splitting a list of millions
        raise UserError(
            f"--seeds {quoted}: at most {MAX_SEEDS} seeds (got {text.count(',') + 1} items); an experiment of "
            "more is a mistake, each seed is a capped run per arm"
        )
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items or not all(re.fullmatch(r"[0-9]{1,10}", s) for s in items):
        raise UserError(
            f"--seeds {quoted}: write integers separated by commas, e.g. --seeds 42,43,44"
        ) from None
    seeds = [int(s) for s in items]
    if len(set(seeds)) != len(seeds) or max(seeds) > MAX_SEED:
        raise UserError(
            f"--seeds {quoted}: give distinct integers from 0 to {MAX_SEED}, e.g. --seeds 42,43,44"
        )
    return seeds


def check_eval_flags(flags: list[str], *, every_checkpoint: bool | None = None) -> EvalConfig:
    """The evaluation's `EvalConfig` once the flags parse as eval_aime.py's, without the ones the experiment sets
    itself, and their `--step` is one the experiment scores (`check_step`); UserError otherwise."""
    for flag in flags:
        check_text(flag, "--eval-flags item")
    config = _parse_eval_flags(without_step(flags))
    check_step(flags, every_checkpoint=every_checkpoint)
    return config


STEP_FLAG = "--step"


def without_step(flags: list[str]) -> list[str]:
    """`flags` less `--step N` (`--step=N`): the verdict step is the experiment's to check (`check_step`) and the
    cells' evaluations' to declare (each a sweep of its checkpoints); the base model's evaluation has no
    checkpoints to declare one of. A `--step` without its value stays, for eval_aime.py's parser to refuse."""
    out, i = [], 0
    while i < len(flags):
        if flags[i] == STEP_FLAG and i + 1 < len(flags):
            i += 2
            continue
        if not flags[i].startswith(STEP_FLAG + "="):
            out.append(flags[i])
        i += 1
    return out


def saved_steps() -> list[int]:
    """The steps of the capped harness's checkpoints: every `SAVE_EVERY` (its save_steps) up to the final step."""
    from opsd.launch.capped import SAVE_EVERY

    return list(range(SAVE_EVERY, STEPS + 1, SAVE_EVERY))


def check_step(flags: list[str], *, every_checkpoint: bool | None = None) -> int:
    """The verdict step `--step N` of the evaluation flags declares (the final step without it): a step the
    experiment scores, checkpoint-100 alone unless `every_checkpoint` (None: not known here, any saved step).
    UserError in one line naming the steps it may be otherwise."""
    value = eval_flag_value(flags, STEP_FLAG)
    if value is None:
        return STEPS
    saved = saved_steps()
    step = int(value) if value.isascii() and value.isdigit() and len(value) <= 10 else None
    if step not in saved:
        raise UserError(
            f"--eval-flags --step {shown(value)}: the capped run saves checkpoints at steps "
            f"{', '.join(map(str, saved))} only; give one of them as the verdict step, or leave --step out for the "
            f"final one, {STEPS}"
        )
    if step != STEPS and every_checkpoint is False:
        raise UserError(
            f"--eval-flags --step {step}: the experiment scores each cell's final checkpoint only, "
            f"checkpoint-{STEPS}; add --every-checkpoint to score every saved step and report step {step}, or leave "
            "--step out"
        )
    return step


def _parse_eval_flags(flags: list[str]) -> EvalConfig:
    """The evaluation flags must parse as eval_aime.py's, without the ones the experiment sets itself."""
    import contextlib
    import io

    from opsd.evaluation.eval_config import EvalConfig, parse_eval_args

    placeholder = "(the experiment's)"
    usage = io.StringIO()
    try:
        with contextlib.redirect_stderr(usage):
            config = parse_eval_args(["--out", placeholder, *flags])
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
    return config


# eval_aime.py's flags that name a file or directory, by each of their spellings, and the EvalConfig field each
# sets: `absolute_eval_flags` records them absolute.
PATH_EVAL_FLAGS = {
    "--dataset": "dataset", "--prompt-file": "prompt_file", "--prompt_file": "prompt_file",
    "--student-prompt-file": "prompt_file", "--student_prompt_file": "prompt_file",
}  # fmt: skip


def absolute_path(value: str, *, data: bool = False, always: bool = False) -> str:
    """`value` as every job must read it, whatever directory it runs in: a local path, given relative to the
    directory of this command, made absolute. A built-in set (`data`: `builtin`, `builtin:NAME`, "") and the
    embedded model ("", `embedded`) are kept, and so is a hub id: a name that is no local path here (a data
    name with a data file's suffix is local either way). `always`: a path whatever exists (a prompt file)."""
    import os

    from opsd.data.builtin import BUILTIN, BUILTIN_SETS
    from opsd.data.loading import is_local

    if value in ("", "embedded") or (data and (value in BUILTIN_SETS or value.startswith(BUILTIN + ":"))):
        return value
    path = Path(value).expanduser()
    local = always or path.is_absolute() or value.startswith((".", "~")) or path.exists()
    if local or (data and is_local(value)):
        return os.path.abspath(path)
    return value


def eval_flag_value(flags: list[str], name: str) -> str | None:
    """What the last `NAME VALUE` or `NAME=VALUE` of `flags` gives (argparse's rule: the last one wins); None
    when absent."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.partition("=")[2]
    return value


def absolute_copies(value: str) -> str:
    """`--dataset` beside `--benchmarks`, NAME=FILE[,NAME=FILE...], with each FILE made absolute as a path
    whatever exists (a local copy is a file) and each NAME= kept; an item of another form is kept as it is, for
    `check_spec_inputs` to refuse (`benchmarks.parse_local_copies`)."""
    items = []
    for item in value.split(","):
        name, eq, path = item.partition("=")
        items.append(f"{name}={absolute_path(path.strip(), always=True)}" if eq and path.strip() else item)
    return ",".join(items)


def absolute_eval_flags(flags: list[str]) -> list[str]:
    """`--eval-flags` with the value of every path flag (`PATH_EVAL_FLAGS`, as `--flag VALUE` or `--flag=VALUE`)
    made absolute (`absolute_path`); with `--benchmarks`, `--dataset`'s local copies NAME=FILE,... each have their
    FILE made absolute (`absolute_copies`). eval_aime.py takes no shortened flag (`--data x`), which would pass
    here unchanged: every path it reads is one of these."""
    for flag in flags:  # before any is read as a path: a NUL byte is no path
        check_text(flag, "--eval-flags item")
    copies = bool(eval_flag_value(flags, "--benchmarks"))
    out, i = [], 0
    while i < len(flags):
        name, eq, value = flags[i].partition("=")
        field = PATH_EVAL_FLAGS.get(name)
        if field is not None and (eq or i + 1 < len(flags)):
            value = value if eq else flags[i + 1]
            if field == "dataset" and copies:
                value = absolute_copies(value)
            else:
                value = absolute_path(value, data=field == "dataset", always=field == "prompt_file")
            out += [f"{name}={value}"] if eq else [name, value]
            i += 1 if eq else 2
        else:
            out.append(flags[i])
            i += 1
    return out


def _check_hub_id(name: str, what: str) -> None:
    """A name that is neither built-in nor local is a hub id, which no job could load unless it has the hub's
    form (`org/name` of letters, digits, `-_.`); whether the hub has it, a job on the machine that runs it
    finds out."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise MissingPath(
            f"{what} {shown(name)} is not a local file or directory, a built-in set or a hub id (org/name of "
            "letters, digits, '-', '_', '.'); give one of those"
        ) from None


def check_spec_inputs(spec: Spec, *, fetch: bool) -> None:
    """The model, the training data and the evaluation's data and prompt file, checked as the jobs will check
    them, before anything is written; UserError otherwise.

    The model as training and eval_aime.py check it before loading (`check_model_source`: a local directory
    with its config and tokenizer, or a hub id; with `fetch`, in the cache or downloadable, since the jobs run
    here; without, for `--print-commands`, only its form, the plan being for another machine). The training
    data: a built-in set, an existing local path (its rows are checked by each new arm's dry run) or a hub id of
    a valid form. The evaluation's problems: a local or built-in set is loaded and checked as eval_aime.py loads
    it (`load_problems`); a hub id is checked for its form. With `--benchmarks`, each benchmark as eval_aime.py
    reads it (`check_benchmarks`). Its prompt file as eval_aime.py checks it."""
    from opsd.evaluation.job import load_problems
    from opsd.models import check_model_source, resolve_model_path
    from opsd.paths import PROMPT_FILE, check_file

    for value, what in ((spec.model, "--model"), (spec.dataset, "--dataset")):
        check_text(value, what)
    try:
        check_model_source(spec.model, fetch=fetch)
    except MissingPath as err:  # its fix names training's flag; here the model is --model
        raise MissingPath(f"--model: {err}".replace("--model_name_or_path", "--model")) from None
    if spec.model not in ("", "embedded") and not Path(resolve_model_path(spec.model)).is_dir():
        _check_hub_id(spec.model, "--model")
    _check_data_name(spec.dataset, "--dataset")
    config = check_eval_flags(spec.eval_flags)
    if config.prompt_file:
        check_file(config.prompt_file, PROMPT_FILE)
    if config.benchmarks:
        check_benchmarks(config, fetch=fetch)
    elif _check_data_name(config.dataset, "--eval-flags --dataset"):
        try:
            load_problems(config)
        except UserError as err:
            raise UserError(f"--eval-flags --dataset: {err}") from None


def check_benchmarks(config: EvalConfig, *, fetch: bool) -> None:
    """The benchmarks of `--eval-flags --benchmarks` and `--dataset`'s local copies, read as eval_aime.py reads
    them before its engine starts (`benchmarks.load_benchmark`): every name known and listed once, every copy an
    existing file with the benchmark's columns and rows. A benchmark without a copy is read from the datasets
    cache, or the Hub, only with `fetch` (the jobs run here); a plan printed for another machine does not depend
    on this one's cache. UserError in one line otherwise."""
    import datasets

    from opsd.evaluation.benchmarks import (
        BENCHMARKS,
        load_benchmark,
        parse_benchmark_names,
        parse_local_copies,
    )
    from opsd.evaluation.eval_config import EvalConfig

    try:
        names = parse_benchmark_names(config.benchmarks)
        copies = parse_local_copies(config.dataset, names, default=EvalConfig.dataset)
    except UserError as err:
        raise UserError(f"--eval-flags {err}") from None
    for name, copy in copies.items():  # every copy there before any is read
        if not Path(copy).expanduser().exists():
            raise MissingPath(
                f"--eval-flags --dataset {name}={copy}: {shown(copy)} does not exist; give an existing local copy "
                f"of {name} (.json/.jsonl/.csv/.parquet with its columns), or drop it to read the datasets cache"
            )
    bars_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # a refusal is one line: no progress bar of the sets read before it
    try:
        for name in names:
            if name in copies or fetch:
                load_benchmark(BENCHMARKS[name], copies.get(name))
    except UserError as err:
        raise UserError(f"--eval-flags: {err}") from None
    finally:
        if not bars_off:
            datasets.enable_progress_bars()


def _check_data_name(name: str, what: str) -> bool:
    """Whether `name` is built-in or local data (an unknown built-in name or a missing local path refused);
    otherwise it must be a hub id of a valid form."""
    from opsd.data.builtin import BUILTIN_SETS
    from opsd.data.loading import is_local

    try:
        local = is_local(name)
    except UserError as err:  # builtin:<unknown>
        raise UserError(f"{what}: {err}") from None
    if not local:
        _check_hub_id(name, what)
    elif name and name not in BUILTIN_SETS and not Path(name).expanduser().exists():
        raise MissingPath(f"{what} {shown(name)} does not exist; pass an existing data file or directory")
    return local


def load(directory: Path) -> Spec | None:
    """The directory's Spec, None where it has none; UserError for a file that is damaged, hand-edited into
    something no run wrote, or written by an older layout."""
    from opsd.paths import read_text

    path = directory / EXPERIMENT_FILE
    if not path.is_file():
        return None
    try:
        data = parse_json(read_text(path, EXPERIMENT_KIND))
    except UserError as err:  # over its cap, not UTF-8, unreadable: named with its cap, not as bad JSON
        raise UserError(f"{err}; {_REWRITE}") from None
    except ValueError as err:
        raise UserError(f"{path} is not valid JSON ({json_error(err)}); {_REWRITE}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a JSON {type(data).__name__}, not an object; {_REWRITE}")
    if data.get("layout") != LAYOUT:
        raise UserError(
            f"{path} was written by an older opsd.experiment, which scored every seed with one set of sampling "
            "seeds and the base model once; its intervals would be too narrow: run the experiment again into a "
            "new --out"
        )
    problem = _check_data(data)
    if problem:
        raise UserError(f"{path}: {problem}; {_REWRITE}")
    return Spec(**data)


EXPERIMENT_KIND = FileKind(
    "experiment file", "experiment files", 16 * MIB,
    "let opsd.experiment write it", "it was not written by opsd.experiment: use a new --out",
)  # fmt: skip
_REWRITE = "it was edited or damaged: restore it, or run the experiment again into a new --out"


def _check_data(data: dict) -> str | None:
    """What is wrong with experiment.json's content, in words; None when every field is as a run writes it."""
    from opsd.configuration.sources import RecipeError, parse_recipe
    from opsd.launch.capped import PROFILES

    names = [f.name for f in fields(Spec)]
    unknown = sorted(set(data) - set(names))
    missing = sorted(set(names) - set(data))
    if unknown or missing:
        return f"unknown field(s) {unknown}, missing field(s) {missing}"
    for key in ("profile", "model", "dataset", "accelerate_config"):
        if not plain_line(data[key]):
            return f"{key} is {shown(data[key])}, not one line of text"
    if data["profile"] not in PROFILES:
        return f"profile {data['profile']!r} is not one of {', '.join(sorted(PROFILES))}"
    if not isinstance(data["eval_flags"], list) or not all(plain_line(f) for f in data["eval_flags"]):
        return "eval_flags is not a list of one-line strings"
    if type(data["gpus_per_run"]) is not int or not 0 <= data["gpus_per_run"] <= 8:
        return f"gpus_per_run is {shown(data['gpus_per_run'])}, not a count of GPUs from 0 to 8"
    seeds = data["seeds"]
    if (not isinstance(seeds, list) or not 0 < len(seeds) <= MAX_SEEDS
            or any(type(s) is not int or not 0 <= s <= MAX_SEED for s in seeds)
            or len(set(seeds)) != len(seeds)):  # fmt: skip
        return f"seeds must be 1 to {MAX_SEEDS} distinct integers from 0 to {MAX_SEED}, got {shown(seeds)}"
    if not isinstance(data["history"], list) or not all(isinstance(h, dict) for h in data["history"]):
        return "history is not a list of records"
    arms = data["arms"]
    if not isinstance(arms, dict) or not 0 < len(arms) <= MAX_ARMS:
        return f"arms is not a mapping of 1 to {MAX_ARMS} arm names"
    if len({name.lower() for name in arms}) != len(arms):
        return "two arm names differ only in case (one directory each on a case-insensitive disk)"
    for name, arm in arms.items():
        try:
            check_name(name, "arms")
        except UserError as err:
            return str(err)
        if not isinstance(arm, dict) or set(arm) != {"recipe", "source"} or not plain_line(arm["source"]):
            return f"arm {name!r} is not {{'recipe': ..., 'source': one line of text}}"
        recipe = arm["recipe"]
        if not isinstance(recipe, dict) or not all(isinstance(v, str) for v in recipe.values()):
            return f"arm {name!r}'s recipe is not a mapping of settings to strings"
        # The arm's cells train from its recipe file: it must read back as this recipe.
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / "arm.env"
            copy.write_text(Arm(name, recipe, arm["source"]).recipe_text())
            try:
                parsed = overrides_to_recipe(parse_recipe(copy))
            except RecipeError as err:  # its lines named by their text: the copy is gone when this is read
                why = re.sub(re.escape(str(copy)) + r":([0-9]+)", r"line \1", str(err))
                why = " ".join(why.replace(f"{copy}: ", "").replace(str(copy), "the recipe").split())
                return f"arm {name!r}'s recipe does not parse ({cut(why)})"
        if parsed != recipe:
            return f"arm {name!r}'s recipe is not in the normalised form a run writes"
    return None


def recordable(directory: Path, spec: Spec) -> tuple[str, dict[str, str]]:
    """(experiment.json's text, {arm: its recipe file's text}) once `load` would read them back: at most
    `MAX_SEEDS` seeds and `MAX_ARMS` arms, every text one line, each file within its cap; UserError otherwise.
    Cheap: `run` asks before the arms' dry runs, `save` again before writing."""
    data = asdict(spec)
    problem = _check_data(data)
    if problem:
        raise UserError(f"this experiment cannot be recorded: {problem}")
    text = json.dumps(data, indent=1) + "\n"
    size = len(text.encode())
    if size > EXPERIMENT_KIND.max_bytes:
        raise UserError(
            f"{directory / EXPERIMENT_FILE} would be {size_text(size)}, over the {size_text(EXPERIMENT_KIND.max_bytes)} "
            "an experiment file is limited to; run fewer arms or seeds, or split them into several experiments"
        )
    recipes = {name: spec.arm(name).recipe_text() for name in spec.arms}
    for name, recipe in recipes.items():
        if len(recipe.encode()) > RECIPE_FILE.max_bytes:
            raise UserError(
                f"arm {name!r}'s recipe would be over the {size_text(RECIPE_FILE.max_bytes)} recipe files are limited "
                "to; give it fewer or shorter settings"
            )
    return text, recipes


def save(directory: Path, spec: Spec) -> None:
    """experiment.json and each arm's recipe file (`recordable`), each replaced whole."""
    text, recipes = recordable(directory, spec)
    directory.mkdir(parents=True, exist_ok=True)
    write_atomically(directory / EXPERIMENT_FILE, text.encode())
    (directory / RECIPES).mkdir(exist_ok=True)
    from opsd.configuration.sources import parse_recipe

    for name, recipe in recipes.items():
        path = recipe_path(directory, name)
        if not path.is_file() or path.read_text() != recipe:
            write_atomically(path, recipe.encode())
        if overrides_to_recipe(parse_recipe(path)) != spec.arms[name]["recipe"]:
            raise RuntimeError(f"{path} does not read back as arm {name}'s recipe")  # a bug, not a user error


def merge(old: Spec | None, new: Spec, directory: Path) -> Spec:
    """`new` checked against the directory's `old`: shared settings equal, arms unchanged; additions recorded."""
    if old is None:
        return replace(
            new,
            history=[{"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "arms": new.arm_names, "seeds": new.seeds}],
        )
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
    for what, count, cap in (("seeds", len(old.seeds) + len(added_seeds), MAX_SEEDS),
                             ("arms", len(old.arms) + len(added_arms), MAX_ARMS)):  # fmt: skip
        if count > cap:
            raise UserError(
                f"{directory} would hold {count} {what} with these added, over the {cap} an experiment may hold; "
                "start another experiment (a new --out) for the rest"
            )
    added = [
        {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "added_arms": added_arms, "added_seeds": added_seeds}
    ]
    return Spec(
        **{k: getattr(old, k) for k in Spec.SHARED},
        arms={**old.arms, **{n: new.arms[n] for n in added_arms}},
        seeds=old.seeds + added_seeds,
        history=old.history + (added if added_arms or added_seeds else []),
    )


# -- the directory's layout and each cell's commands ------------------------------------------------------------


def recipe_path(directory: Path, arm: str) -> Path:
    return directory / RECIPES / f"{arm}.env"


def run_dir(directory: Path, arm: str, seed: int) -> Path:
    """Where train_capped.sh writes the cell (`--runs-dir DIR/runs --name ARM --seed S`)."""
    return directory / RUNS / arm / f"capped_seed{seed}"


def eval_dir(directory: Path, arm: str, seed: int) -> Path:
    """The cell's sweep: one subdirectory per scored checkpoint (checkpoint-N)."""
    return directory / EVALS / arm / f"seed{seed}"


def base_eval_dir(directory: Path, seed: int) -> Path:
    """The base model scored with training seed `seed`'s sampling seeds (one evaluation per seed)."""
    return directory / EVALS / BASE / f"seed{seed}"


def sampling_seed(seed: int) -> int:
    """eval_aime.py's --seed for every evaluation paired with training seed `seed` (the module docstring says
    why each training seed gets its own)."""
    return seed


def final_checkpoint(directory: Path, arm: str, seed: int) -> Path:
    return checkpoint_dir(run_dir(directory, arm, seed), STEPS)


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
    """The base model (arm None) or one cell's checkpoints, scored with the experiment's evaluation flags and
    training seed `seed`'s sampling seeds, so that the arms and the base are paired per (problem, sample) within
    a seed; adapters are merged, whose samples are reproducible run to run (LoRA serving on a GPU is not)."""
    flags = (
        without_step(spec.eval_flags) if arm is None else spec.eval_flags
    )  # the base: no checkpoint to declare
    argv = [sys.executable, str(ROOT / "eval_aime.py"), "--model", spec.model, *flags, *extra,
            "--seed", str(sampling_seed(seed))]  # fmt: skip
    if arm is None:
        return argv + ["--out", str(base_eval_dir(directory, seed))]
    target = run_dir(directory, arm, seed) if every_checkpoint else final_checkpoint(directory, arm, seed)
    return argv + ["--checkpoints", str(target), "--no-base", "--merge-adapter",
                   "--out", str(eval_dir(directory, arm, seed))]  # fmt: skip


def shell(argv: list[str]) -> str:
    return shlex.join(argv)
