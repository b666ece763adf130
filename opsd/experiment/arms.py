"""An arm of an experiment: a recipe, named, as `--arm` gives it and as its cells train from it.

An arm is `NAME=FILE` (a recipe file, e.g. configs/recipes/published.env) or `NAME=KEY=VALUE[,KEY=VALUE]`
(overrides on top of `--recipe`, recipe.env by default). Either way the arm's whole recipe is written to
`DIR/recipes/NAME.env` (`Arm.recipe_text`) and every cell of the arm trains from that copy. Arms are compared
by their parsed settings (`opsd.configuration.sources.parse_recipe`), not by file text: comments and
key order do not matter.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from opsd.errors import UserError, shown

BASE = "base"  # the base model's evaluations live under DIR/evals/base: no arm may take the name
# An arm name becomes a directory and a file name: a plain name, short, starting with a letter or digit.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
MAX_NAME_CHARS = 64


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


def check_name(name: str, what: str) -> None:
    """An arm name: it names DIR/recipes/NAME.env, DIR/runs/NAME and DIR/evals/NAME, so it is a plain name."""
    if len(name) > MAX_NAME_CHARS or not _NAME.fullmatch(name) or name == BASE:
        raise UserError(
            f"{what}: the arm name {shown(name)} must be at most {MAX_NAME_CHARS} letters, digits, '_', '.', '-' (not "
            f"starting with '.' or '-') and not {BASE!r}, which names the base model's evaluation"
        )


# Recipe settings that name a file: read relative to the directory the command is given in (as train_capped.sh
# reads a recipe's paths), and recorded absolute, since the arm's cells run in the checkout.
PATH_SETTINGS = ("student_prompt_file", "teacher_prompt_file")


def overrides_to_recipe(overrides) -> dict[str, str]:
    return {o.field: o.value for o in overrides}


def absolute_paths(recipe: dict[str, str], cwd: Path) -> dict[str, str]:
    """`recipe` with each of its `PATH_SETTINGS` made absolute against `cwd` (an empty one is unset)."""
    import os

    return {
        k: os.path.abspath(cwd / Path(v).expanduser()) if k in PATH_SETTINGS and v else v
        for k, v in recipe.items()
    }


def effective_recipe(settings: dict[str, object]) -> dict[str, object]:
    """The method an arm trains: a dry run's resolved settings (field -> value) restricted to the method's keys
    (`RECIPE_KEYS`), less the fields those settings leave without effect
    (`opsd.configuration.checks.inert_fields`). Two arms with equal effective recipes train alike."""
    from opsd.configuration.checks import inert_fields
    from opsd.configuration.switches import RECIPE_KEYS

    idle = inert_fields(settings)
    return {k: v for k, v in sorted(settings.items()) if k in RECIPE_KEYS and k not in idle}


def parse_arm(text: str, base_recipe: Path | None, cwd: Path = Path()) -> Arm:
    """`NAME=FILE` or `NAME=KEY=VALUE[,KEY=VALUE...]` (on top of `base_recipe`, None: the defaults) into an Arm;
    UserError if bad, a missing `base_recipe` included. Paths (the file, `PATH_SETTINGS`) are read relative to
    `cwd` and recorded absolute."""
    from opsd.configuration.sources import RecipeError, parse_recipe

    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not rest.strip():
        raise UserError(
            f"--arm {text!r}: write NAME=RECIPE_FILE or NAME=KEY=VALUE[,KEY=VALUE], e.g. "
            "--arm published=configs/recipes/published.env or --arm lr1e5=LEARNING_RATE=1e-5"
        )
    check_name(name, f"--arm {text!r}")
    rest = rest.strip()
    try:
        if "=" not in rest:
            path = cwd / Path(rest).expanduser()
            if not path.is_file():
                raise UserError(
                    f"--arm {name}={rest}: no recipe file at {path}; give an existing recipe file or "
                    "KEY=VALUE overrides"
                )
            return Arm(
                name, absolute_paths(overrides_to_recipe(parse_recipe(path)), cwd), str(path.absolute())
            )
        recipe = overrides_to_recipe(parse_recipe(base_recipe)) if base_recipe is not None else {}
    except RecipeError as err:
        raise UserError(f"--arm {name}: {err}".replace("\n", " ")) from None

    # The overrides are parsed as recipe lines, by the parser every recipe goes through.
    with tempfile.TemporaryDirectory() as tmp:
        inline = Path(tmp) / "arm.env"
        inline.write_text("\n".join(item.strip() for item in rest.split(",")) + "\n")
        try:
            recipe.update(overrides_to_recipe(parse_recipe(inline)))
        except RecipeError as err:
            shown = str(err).replace(f"{inline}: ", "", 1).replace(f"{inline}:", "item ").replace("\n", " ")
            raise UserError(f"--arm {name}={rest}: {' '.join(shown.split())}") from None
    source = f"{(cwd / base_recipe).absolute()} + {rest}" if base_recipe is not None else rest
    return Arm(name, absolute_paths(recipe, cwd), source)
