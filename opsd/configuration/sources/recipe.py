"""Overrides from a `recipe.env` file and `OPSD_*` environment variables, validated into argv flags.

The precedence (docs/configuration.md, Running and precedence) holds because the entry point appends
`to_argv(resolve_overrides(...))` after the user's CLI arguments (argparse keeps the last occurrence). Every value is checked against the type of its `OPSDConfig` field before it reaches argparse,
so a bad recipe fails with one message naming every bad line instead of a traceback mid-run.

`recipe.env` format (it is parsed here, never sourced or executed by a shell):

- A regular file of at most 1 MiB (`opsd.paths`: a device, FIFO or directory is refused before reading).
- One `KEY=VALUE` per line, UTF-8; blank lines are skipped; whitespace around key and value is stripped.
- KEY is the upper-case field name, with or without the `OPSD_` prefix (`BETA` and `OPSD_BETA` are the same
  key; giving both is a duplicate). Only `RECIPE_KEYS` (the method) and `OPERATIONAL_KEYS` (logging and
  memory, neither budget nor method) may be set; `BUDGET_KEYS` are refused.
- `#` starts a comment at the start of a line or after whitespace: `BETA=0.5  # note` is `0.5`, while in
  `FILE=a#b` the `#` is part of the value.
- A value may be wrapped in one pair of matching `'` or `"` quotes, which are removed; inside quotes `#`
  is literal. There are no escapes, no interpolation and no variable expansion. A quote inside an unquoted
  value is refused, as are control characters anywhere and lines over `MAX_LINE_CHARS`.
- Booleans accept true/false/1/0/yes/no (any case) and become `true`/`false`; numbers must be plain ASCII
  decimals (no nan/inf); choice fields must name one of their choices exactly.
- An older name of a field (`opsd.configuration.sources.aliases`: `JSD_TOKEN_CLIP`) is read as its canonical
  name (`DIVERGENCE_CLIP`), with a note.

Which keys each source may set is `opsd.configuration.sources.keys`; how one value is checked,
`opsd.configuration.checks.values`.
"""

from __future__ import annotations

import logging
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from opsd.configuration.checks.values import (
    SHOWN_CHARS,
    Bad,
    bad_char,
    check_field,
    field_specs,
    nearest,
    normalise,
    quoted,
    unknown_field,
)
from opsd.configuration.engine_env import KV_CACHE_ENV
from opsd.configuration.sources.aliases import canonical
from opsd.configuration.sources.keys import BUDGET_KEYS, CAPPED_KEYS, OPERATIONAL_KEYS, RECIPE_KEYS
from opsd.errors import DEBUG_ENV, InvalidValue, UserError
from opsd.paths import RECIPE_FILE, read_bytes

logger = logging.getLogger(__name__)

ENV_PREFIX = "OPSD_"
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
    key = field.upper()
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
    field = (key[len(ENV_PREFIX) :] if key.startswith(ENV_PREFIX) else key).lower()
    if _KEY.fullmatch(key):
        field = canonical(field, source=source)
    if not _KEY.fullmatch(key):
        upper = key.upper()
        named = upper.removeprefix(ENV_PREFIX).lower()
        if _KEY.fullmatch(upper) and named in field_specs():  # a field name in the wrong case: name the field
            raise Bad(f"{quoted(key)} is not a valid key", _case_fix(named))
        near = nearest(named, CAPPED_KEYS)
        hint = f"did you mean {near.upper()}? " if near else ""
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
                f"{first_key} (line {first_line}) and {key} (line {lineno}) both set {field.upper()}, under its "
                "older and its canonical name",
                f"keep only {field.upper()}",
            )
        raise Bad(f"{field.upper()} is set twice, on lines {first_line} and {lineno}", "keep one of them")
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
        field = name[len(ENV_PREFIX) :].lower()
        source = f"env {name}"
        if name == name.upper():
            field = canonical(field, source=source)
            if field in named:
                problems.append(
                    f"{source}: {named[field]} and {name} both set {field}, under its older and its canonical "
                    f"name; fix: keep only {ENV_PREFIX}{field.upper()}"
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
                    f"set {field.upper()} in recipe.env or OPSD_{field.upper()}, where the recipe records it",
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
