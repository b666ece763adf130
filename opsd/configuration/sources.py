"""Where a setting comes from as text: a `recipe.env` line, an `OPSD_*` variable or a pass-through flag of the
capped harness, each checked against its field's type and written as the flag that sets it; and a field's older
names, read under the canonical one. opsd_train.py's command line and YAML (`opsd.launch.command_line`) append
these values after the user's flags, so they win (docs/configuration.md, Running and precedence: defaults < YAML <
flags < recipe.env < `OPSD_*`). Every problem is a `UserError` naming the source of the bad value. What each switch
is (its type, choices, role, `OPSD_*` name, older name) is read from its declaration in
`opsd.configuration.switches`; its range is checked once, by `OPSDConfig`.

* Older names (`canonical`, `canonical_keys`, `canonical_flags`): a recipe line (`JSD_TOKEN_CLIP=0.1`), an
  `OPSD_*` variable, a YAML key or a flag under a field's older name (its `formerly`) is read under the canonical
  name with a logged note (INFO); giving both names is refused. A run directory's `opsd_config.json` written under
  an older name is read the same way on resume. Everything else (`--help`, docs, errors) uses the canonical name.
* One value (`normalise`): a recipe line, an `OPSD_*` variable or a pass-through flag checked against its field's
  type and choices and rewritten in the form argparse parses back exactly; a problem is a `Bad` (why, and how to
  fix it), collected into one `RecipeError`.
* `recipe.env` (`parse_recipe`), `OPSD_*` (`env_overrides`), pass-through flags (`flag_overrides`), together
  `resolve_overrides`. The `recipe.env` format (it is parsed here, never sourced or executed by a shell):

  - A regular file of at most 1 MiB (`opsd.paths`: a device, FIFO or directory is refused before reading).
  - One `KEY=VALUE` per line, UTF-8; blank lines are skipped; whitespace around key and value is stripped.
  - KEY is the field's `OPSD_*` name, with or without the `OPSD_` prefix (`BETA` and `OPSD_BETA` are the same
    key; giving both is a duplicate). Only fields whose role is method or operational (`RECIPE_KEYS`,
    `OPERATIONAL_KEYS`) may be set; budget fields (`BUDGET_KEYS`) are refused.
  - `#` starts a comment at the start of a line or after whitespace: `BETA=0.5  # note` is `0.5`, while in
    `FILE=a#b` the `#` is part of the value.
  - A value may be wrapped in one pair of matching `'` or `"` quotes, which are removed; inside quotes `#`
    is literal. There are no escapes, no interpolation and no variable expansion. A quote inside an unquoted
    value is refused, as are control characters anywhere and lines over `MAX_LINE_CHARS`.
  - Booleans accept true/false/1/0/yes/no (any case) and become `true`/`false`; numbers must be plain ASCII
    decimals (no nan/inf); choice fields must name one of their choices exactly.
  - An older name of a field (`JSD_TOKEN_CLIP`) is read as its canonical name (`DIVERGENCE_CLIP`), with a note.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trl.experimental.sdft import SDFTConfig

from opsd.configuration.config import OPSDConfig
from opsd.configuration.switches import (
    ALIASES,
    BUDGET_KEYS,
    CAPPED_KEYS,
    ENV_PREFIX,
    KV_CACHE_ENV,
    OPERATIONAL_KEYS,
    RECIPE_KEYS,
    env_name,
    field_of_env,
)
from opsd.errors import DEBUG_ENV, InvalidValue, UserError, closest
from opsd.paths import RECIPE_FILE, read_bytes

logger = logging.getLogger(__name__)


# -- older names --------------------------------------------------------------------------------------------
# A field's older name is its declared `formerly` (`switches.ALIASES`: older name -> field).


def canonical(name: str, *, source: str) -> str:
    """The canonical field name for `name` (a note when `name` is an older one); other names unchanged."""
    if name not in ALIASES:
        return name
    # INFO: shown in training's log; the harness's one-line errors and JSON plan stay as they are (its plan
    # lists each override under the canonical name with its source).
    logger.info(
        "%s: note: %s is the older name of %s, the canonical name; read as %s", source, name, ALIASES[name],
        ALIASES[name],
    )  # fmt: skip
    return ALIASES[name]


def canonical_keys(mapping: Mapping[str, Any], *, source: str, quiet: bool = False) -> dict[str, Any]:
    """`mapping` (YAML keys, a saved config) with older names renamed; InvalidValue if both names are there."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        if key in ALIASES:
            if ALIASES[key] in mapping:
                raise InvalidValue(
                    f"{source}: {key} and {ALIASES[key]} are both set; keep only {ALIASES[key]}"
                )
            key = ALIASES[key] if quiet else canonical(key, source=source)
        out[key] = value
    return out


def canonical_flags(argv: Sequence[str]) -> list[str]:
    """Command-line arguments with `--old VALUE` / `--old=VALUE` written under the canonical name;
    InvalidValue if a field is given under both its older and its canonical name."""
    flags = {arg.partition("=")[0][2:].replace("-", "_") for arg in argv if arg.startswith("--")}
    for old, new in ALIASES.items():
        if old in flags and new in flags:
            raise InvalidValue(f"command line: --{old} and --{new} are both given; keep only --{new}")
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        field = name[2:].replace("-", "_")
        if name.startswith("--") and field in ALIASES:
            arg = f"--{canonical(field, source='command line')}{eq}{value}"
        out.append(arg)
    return out


# -- one value ----------------------------------------------------------------------------------------------
# One value as a recipe line, an `OPSD_*` variable or a pass-through flag gives it, against its field's type.

MAX_COMPLETION_CAP = 4096
SHOWN_CHARS = 80

# Names people carry over from older transformers releases; the hint beats a bare "unknown key".
RENAMED_KEYS = {
    "warmup_ratio": "transformers 5 removed warmup_ratio; a WARMUP_STEPS value below 1 is a ratio"
}

_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


@dataclass(frozen=True)
class FieldSpec:
    kind: str  # "bool" | "int" | "float" | "str" | "unsupported"
    choices: tuple[str, ...] | None = None


class Bad(Exception):
    """One problem with one line or variable: why it is wrong and how to fix it."""

    def __init__(self, why: str, fix: str) -> None:
        super().__init__(why)
        self.why, self.fix = why, fix


def _hint_args(hint) -> list:
    """The types a field's annotation allows, None aside (`X | None` -> [X])."""
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return [a for a in (typing.get_args(hint) if is_union else (hint,)) if a is not type(None)]


def _field_spec(f: dataclasses.Field, args: list, trl_args: list) -> FieldSpec:
    """`f`'s spec from the types its annotation allows (`args`) and those of TRL's annotation of the same field
    (`trl_args`): a field OPSD redeclares as plain `str` over TRL's enum (`lr_scheduler_type`) takes the enum's
    values, the names the trainer accepts."""
    enums = [a for a in dict.fromkeys(args + trl_args) if isinstance(a, type) and issubclass(a, enum.Enum)]
    literals = [v for a in args if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)]
    if f.name == "lora_target_modules":  # a list, written comma-separated on one line
        return FieldSpec("str")
    if any(typing.get_origin(a) is list or a is list for a in args):  # argparse nargs='+'
        return FieldSpec("unsupported")
    if bool in args:  # HfArgumentParser parses `str | bool` as a bool too
        return FieldSpec("bool")
    if args in ([int], [float]):
        return FieldSpec(args[0].__name__)
    if str in args or enums or literals:
        # A Literal beside a plain `str` (trackio_static_space_id) is one option among any string.
        choices = f.metadata.get("choices")
        allowed = choices or [m.value for e in enums for m in e] or (None if str in args else literals)
        return FieldSpec("str", tuple(str(c) for c in allowed) if allowed else None)
    return FieldSpec("unsupported")


@functools.cache
def field_specs() -> dict[str, FieldSpec]:
    """How each `OPSDConfig` field (inherited ones too) is typed, mirroring what HfArgumentParser accepts; the
    choices of OPSD's fields are those their declaration gives (`opsd.configuration.switches`)."""
    hints, trl_hints = typing.get_type_hints(OPSDConfig), typing.get_type_hints(SDFTConfig)
    return {
        f.name: _field_spec(
            f, _hint_args(hints[f.name]), _hint_args(trl_hints[f.name]) if f.name in trl_hints else []
        )
        for f in dataclasses.fields(OPSDConfig)
    }


def quoted(text: str) -> str:
    """`text` quoted and cut for an error message, so a hostile 100 kB line cannot flood the terminal."""
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "...")


def nearest(word: str, candidates: typing.Iterable[str], cutoff: float = 0.6) -> str | None:
    """The nearest candidate by edit distance if close enough to be a typo; any distance with cutoff=0."""
    return closest(word, candidates, any_distance=cutoff <= 0)


def bad_char(text: str, *, allow_tab: bool = False) -> str | None:
    """The first character a terminal would not show plainly (controls, NUL, bidi marks), if any."""
    for ch in text:
        if not ch.isprintable() and not (allow_tab and ch == "\t"):
            return f"U+{ord(ch):04X}"
    return None


def normalise(field: str, raw: str, *, capped: bool) -> str:
    """`raw` checked against the type of `field` and rewritten in the form argparse parses back exactly."""
    spec = field_specs()[field]
    bad = bad_char(raw)
    if bad:
        raise Bad(f"value of {field} contains the control character {bad}", "remove it")
    if spec.kind == "bool":
        if raw.lower() in _TRUE | _FALSE:
            return "true" if raw.lower() in _TRUE else "false"
        raise Bad(f"{field} expects true or false, got {quoted(raw)}", "write true or false (or 1/0, yes/no)")
    if spec.kind == "int":
        # A regex, not just int(): int() also takes fullwidth and other Unicode digits.
        if not _INT.fullmatch(raw):
            raise Bad(f"{field} expects an integer, got {quoted(raw)}", "write a plain ASCII integer like 64")
        value = int(raw)
        if field == "max_completion_length" and capped and not 1 <= value <= MAX_COMPLETION_CAP:
            raise Bad(
                f"max_completion_length={value} is outside 1..{MAX_COMPLETION_CAP}",
                f"the capped harness allows at most {MAX_COMPLETION_CAP} tokens per rollout",
            )
        return str(value)
    if spec.kind == "float":
        # The pattern already excludes nan/inf; the isfinite check catches overflow such as 1e999.
        if not _FLOAT.fullmatch(raw) or not math.isfinite(float(raw)):
            raise Bad(f"{field} expects a finite number, got {quoted(raw)}", "write a plain number like 1e-5")
        return repr(float(raw))
    if spec.kind == "str":
        if spec.choices is not None:
            if raw in spec.choices:
                return raw
            near = nearest(raw, spec.choices)
            hint = f"did you mean {near}? " if near else ""
            raise Bad(
                f"{field} does not accept {quoted(raw)}", f"{hint}choose one of {', '.join(spec.choices)}"
            )
        if "$" in raw or "`" in raw:
            # Nothing here expands variables, so `$HOME/p.txt` would silently name a literal `$HOME` folder.
            raise Bad(f"value of {field} contains $ or `", "nothing is expanded: write the literal path")
        return raw
    raise Bad(
        f"{field} takes a list or mapping", "set it in the YAML config (--config) or on the command line"
    )


def _key(field: str, prefix: str = "") -> str:
    """`field` as a recipe.env key (`prefix` "") or an `OPSD_*` variable (`prefix` OPSD_): its `OPSD_*` name,
    the prefix as asked."""
    return prefix + env_name(field).removeprefix(ENV_PREFIX)


def check_field(field: str, name: str, *, allowed: frozenset[str] | set[str] | None, where: str) -> None:
    """Refuse a field that `allowed` excludes, with the budget message for budget fields."""
    if allowed is None or field in allowed:
        return
    if field in BUDGET_KEYS:
        raise Bad(
            f"{name} is fixed by the capped harness (100 steps x 32 problems) and cannot be set in {where}",
            "remove it; see BUDGET_KEYS (role=BUDGET) in opsd/configuration/switches.py",
        )
    raise Bad(
        f"{name} is a config field but not tunable in {where}",
        f"remove it; tunable keys are {', '.join(sorted(_key(k) for k in allowed))}",
    )


def unknown_field(field: str, name: str, candidates: typing.Iterable[str], prefix: str) -> Bad:
    if field in RENAMED_KEYS:
        return Bad(f"{name} is not a config field", RENAMED_KEYS[field])
    near = nearest(field, candidates)
    if near:
        return Bad(f"{name} is not a config field", f"did you mean {_key(near, prefix)}?")
    anywhere = nearest(field, field_specs())  # a field the user could mean that is not settable here
    if anywhere:
        where = "fixed by the capped harness" if anywhere in BUDGET_KEYS else "not tunable here"
        return Bad(f"{name} is not a config field", f"did you mean {_key(anywhere, prefix)}? it is {where}")
    closest_one = nearest(field, candidates, cutoff=0.0)
    fix = (
        f"no field is close; the nearest is {_key(closest_one, prefix)} (all fields: python opsd_train.py --help, "
        "OPSD's in opsd/configuration/switches.py)"
    )
    return Bad(f"{name} is not a config field", fix)


# -- recipe.env, OPSD_* and pass-through flags --------------------------------------------------------------

# OPSD_* variables that configure the tooling (the model cache, tracebacks of user errors, a fixed KV cache for
# engines sharing a GPU) rather than the run.
RESERVED_ENV = frozenset({"OPSD_CACHE_DIR", DEBUG_ENV, KV_CACHE_ENV})
MAX_LINE_CHARS = 4096
# A recipe is a few dozen lines; anything far bigger is a wrong path, not a recipe (1 MiB, opsd.paths).
MAX_FILE_BYTES = RECIPE_FILE.max_bytes
MAX_REPORTED = 50

_KEY = re.compile(r"[A-Z][A-Z0-9_]*")
_COMMENT = re.compile(r"\s#")


class RecipeError(InvalidValue):
    """A recipe file or `OPSD_*` variable that cannot be applied; the message lists every problem."""


@dataclass(frozen=True)
class Override:
    """One validated setting: `value` is already normalised for argparse."""

    field: str
    value: str
    source: str  # e.g. "recipe.env:7" or "env OPSD_BETA"


def _unquote(text: str) -> str:
    """The value part of a line (everything after `=`) without its quotes or trailing comment."""
    body = text.strip()
    if body[:1] in ("'", '"'):
        quote = body[0]
        end = body.find(quote, 1)
        if end < 0:
            raise Bad(f"the value opens a {quote} quote that is never closed", f"close it with {quote}")
        rest = body[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            raise Bad(
                f"text {quoted(rest)} follows the closing quote", "put the whole value inside the quotes"
            )
        return body[1:end]
    comment = _COMMENT.search(text)
    if comment:
        text = text[: comment.start()]
    body = text.strip()
    if "'" in body or '"' in body:
        raise Bad("a quote inside an unquoted value", "quote the whole value or none of it")
    return body


def _case_fix(field: str) -> str:
    """The fix for a field written in lower case: its key, and whether recipe.env may set it at all."""
    key = _key(field)
    if field in CAPPED_KEYS:
        return f"did you mean {key}? keys are upper case"
    if field in BUDGET_KEYS:
        return f"{key} is the key, and it is fixed by the capped harness (100 steps x 32 problems): remove it"
    return f"{key} is the key, and it is not tunable in recipe.env: remove it"


def _parse_line(
    line: str, *, seen: dict[str, tuple[int, str]], lineno: int, source: str
) -> tuple[str, str] | None:
    """(field, value) from one decoded line, None for blank and comment lines; raises Bad."""
    bad = bad_char(line, allow_tab=True)
    if bad:
        raise Bad(f"the line contains the control character {bad}", "remove it (save the file as plain text)")
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return None
    if "=" not in stripped:
        raise Bad("the line has no '='", "write KEY=VALUE, or start the line with # to make it a comment")
    key, _, rest = stripped.partition("=")
    key = key.strip()
    if not key:
        raise Bad("the key before '=' is empty", "write KEY=VALUE")
    if key.startswith("export "):
        raise Bad("'export' is shell syntax", "drop 'export': this file is parsed, not sourced")
    field = field_of_env(key)
    if _KEY.fullmatch(key):
        field = canonical(field, source=source)
    if not _KEY.fullmatch(key):
        upper = key.upper()
        named = field_of_env(upper)
        if _KEY.fullmatch(upper) and named in field_specs():  # a field name in the wrong case: name the field
            raise Bad(f"{quoted(key)} is not a valid key", _case_fix(named))
        near = nearest(named, CAPPED_KEYS)
        hint = f"did you mean {_key(near)}? " if near else ""
        raise Bad(
            f"{quoted(key)} is not a valid key", f"{hint}keys are upper-case ASCII letters, digits and _"
        )
    if field not in field_specs():
        raise unknown_field(field, key, CAPPED_KEYS, "")
    check_field(field, key, allowed=CAPPED_KEYS, where="recipe.env")
    if field in seen:
        first_line, first_key = seen[field]
        if first_key.removeprefix(ENV_PREFIX) != key.removeprefix(
            ENV_PREFIX
        ):  # an older name and the new one
            raise Bad(
                f"{first_key} (line {first_line}) and {key} (line {lineno}) both set {_key(field)}, under its "
                "older and its canonical name",
                f"keep only {_key(field)}",
            )
        raise Bad(f"{_key(field)} is set twice, on lines {first_line} and {lineno}", "keep one of them")
    seen[field] = (lineno, key)
    return field, normalise(field, _unquote(rest), capped=True)


def _raise_all(problems: list[str], what: str) -> None:
    if not problems:
        return
    if len(problems) == 1:  # one line, as the entry points print user errors
        raise RecipeError(f"{what}: 1 problem(s): {problems[0]}")
    shown = problems[:MAX_REPORTED]
    more = len(problems) - len(shown)
    tail = [f"  ... and {more} more"] if more else []
    raise RecipeError(f"{what}: {len(problems)} problem(s):\n" + "\n".join(["  " + p for p in shown] + tail))


def parse_recipe(path: str | Path) -> list[Override]:
    """Validated overrides from a recipe file, in file order; raises RecipeError listing every bad line."""
    path = Path(path)
    try:
        # An existing regular file of at most MAX_FILE_BYTES (opsd.paths): a link to /dev/urandom is refused.
        data = read_bytes(path, RECIPE_FILE)
    except UserError as err:
        raise RecipeError(str(err)) from err
    overrides: list[Override] = []
    problems: list[str] = []
    seen: dict[str, tuple[int, str]] = {}  # field -> (line, key as written) of its first line
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        source = f"{path}:{lineno}"
        # Measured in bytes before decoding, so an oversized line is refused without further work.
        if len(raw) > MAX_LINE_CHARS:
            head = raw[:SHOWN_CHARS].decode("utf-8", errors="replace")
            why = f"line is {len(raw)} bytes long (limit {MAX_LINE_CHARS})"
            problems.append(f"{source}: {quoted(head)}: {why}; fix: shorten it")
            continue
        try:
            line = raw.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError:
            problems.append(f"{source}: not valid UTF-8; fix: save the file as UTF-8")
            continue
        if lineno == 1:
            line = line.removeprefix("\ufeff")  # editors on Windows add a byte-order mark
        try:
            parsed = _parse_line(line, seen=seen, lineno=lineno, source=source)
        except Bad as bad:
            problems.append(f"{source}: {quoted(line.strip())}: {bad.why}; fix: {bad.fix}")
            continue
        if parsed:
            overrides.append(Override(*parsed, source=source))
    _raise_all(problems, str(path))
    return overrides


def env_overrides(
    environ: Mapping[str, str], *, allowed: set[str] | frozenset[str] | None = None
) -> list[Override]:
    """Validated overrides from `OPSD_<FIELD>` variables, sorted by name; raises RecipeError on any bad one.

    `allowed` restricts the settable fields (the capped harness passes CAPPED_KEYS); without it every
    config field may be set. Names in RESERVED_ENV are skipped.
    """
    overrides: list[Override] = []
    problems: list[str] = []
    candidates = allowed if allowed is not None else field_specs().keys()
    named: dict[
        str, str
    ] = {}  # field -> the variable that set it, to refuse an older name beside the new one
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV:
            continue
        field = field_of_env(name)
        source = f"env {name}"
        if name == name.upper():
            field = canonical(field, source=source)
            if field in named:
                problems.append(
                    f"{source}: {named[field]} and {name} both set {field}, under its older and its canonical "
                    f"name; fix: keep only {env_name(field)}"
                )
                continue
            named[field] = name
        try:
            # Upper case only: OPSD_beta would otherwise pass here but look unset to everything else.
            if name != name.upper() or field not in field_specs():
                raise unknown_field(field, name, candidates, ENV_PREFIX)
            check_field(field, name, allowed=allowed, where="the capped harness's environment")
            # Spaces and tabs only: a newline stays in and is refused like any control character.
            value = normalise(field, environ[name].strip(" \t"), capped=allowed is not None)
        except Bad as bad:
            problems.append(f"{source}: {bad.why} (value {quoted(environ[name])}); fix: {bad.fix}")
            continue
        overrides.append(Override(field, value, source))
    _raise_all(problems, "OPSD_* environment")
    return overrides


def to_argv(overrides: typing.Iterable[Override]) -> list[str]:
    """`--field=value` entries; the single-token form keeps values like `-1e-5` from reading as flags."""
    return [f"--{o.field}={o.value}" for o in overrides]


def flag_overrides(args: typing.Sequence[str]) -> list[Override]:
    """Validated pass-through flags of the capped harness (`--key value`, `--key=value`, `--bool-key`).

    Only OPERATIONAL_KEYS pass: budget keys are refused as in recipe.env, and method keys belong in
    recipe.env or `OPSD_*` (the recipe is the record of the method). Raises RecipeError naming every bad flag.
    """
    overrides: list[Override] = []
    problems: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--") or arg == "--":
            problems.append(f"{quoted(arg)}: not a --flag; fix: write --key value or --key=value")
            continue
        name, has_value, value = arg[2:].partition("=")
        field = canonical(name.replace("-", "_"), source=f"flag --{name}")
        flag = f"--{name}"
        if not has_value and i < len(args) and not args[i].startswith("--"):
            value, has_value, i = args[i], True, i + 1
        try:
            if field not in field_specs():
                near = nearest(field, OPERATIONAL_KEYS)
                hint = f"did you mean --{near}? " if near else ""
                keys = ", ".join(sorted(OPERATIONAL_KEYS))
                raise Bad(f"{flag} is not a config field", f"{hint}pass-through flags take {keys}")
            if field in RECIPE_KEYS:
                raise Bad(
                    f"{flag} changes the method",
                    f"set {_key(field)} in recipe.env or {env_name(field)}, where the recipe records it",
                )
            check_field(field, flag, allowed=OPERATIONAL_KEYS, where="a pass-through flag")
            if not has_value:
                if field_specs()[field].kind != "bool":
                    raise Bad(f"{flag} needs a value", f"write {flag} VALUE or {flag}=VALUE")
                value = "true"  # a bare boolean flag, as argparse reads it
            overrides.append(Override(field, normalise(field, value, capped=True), f"flag {flag}"))
        except Bad as bad:
            problems.append(f"flag {flag}: {bad.why}; fix: {bad.fix}")
    _raise_all(problems, "pass-through flags")
    return overrides


def resolve_overrides(
    recipe_path: str | Path | None, environ: Mapping[str, str], *, capped: bool
) -> list[Override]:
    """Recipe overrides, then environment ones (which win); a field set by both keeps only the env value.

    Problems in the recipe and in the environment are reported together in one RecipeError.
    """
    return resolve_with_replaced(recipe_path, environ, capped=capped)[0]


def replaced_message(replaced: Override, by: Override) -> str:
    """How the dry run lists a recipe line that an `OPSD_*` variable replaces."""
    return f"{replaced.field}={replaced.value} ({replaced.source}) is replaced by {by.field}={by.value} ({by.source})"


def name_source(message: str, overrides: typing.Iterable[Override]) -> str:
    """A config error about a field that a recipe line or `OPSD_*` variable set, with that source named
    (`top_p=1.5 is out of range: ... (from recipe.env:3)`); other messages are returned unchanged."""
    for o in reversed(list(overrides)):
        if message.startswith(f"{o.field}="):
            return f"{message} (from {o.source})"
    return message


def resolve_with_replaced(
    recipe_path: str | Path | None, environ: Mapping[str, str], *, capped: bool
) -> tuple[list[Override], list[tuple[Override, Override]]]:
    """`resolve_overrides`, and the (recipe override, env override replacing it) pairs."""
    recipe: list[Override] = []
    env: list[Override] = []
    problems: list[str] = []
    if recipe_path is not None:
        try:
            recipe = parse_recipe(recipe_path)
        except RecipeError as err:
            problems.append(str(err))
    try:
        env = env_overrides(environ, allowed=CAPPED_KEYS if capped else None)
    except RecipeError as err:
        problems.append(str(err))
    if problems:
        raise RecipeError("\n".join(problems))
    found = recipe + env
    final = {o.field: o for o in found}  # later sources replace earlier ones
    replaced = [(o, final[o.field]) for o in found if final[o.field] is not o]
    for o, by in replaced:
        logger.info("override %s=%s (%s) is replaced by %s", o.field, o.value, o.source, by.source)
    applied = [o for o in found if final[o.field] is o]
    for o in applied:
        logger.info("override %s=%s (%s)", o.field, o.value, o.source)
    return applied, replaced
