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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from transformers.trainer_utils import SchedulerType

from opsd.configuration.config import OPSDConfig
from opsd.configuration.engine_env import KV_CACHE_ENV
from opsd.configuration.legacy import closest
from opsd.errors import DEBUG_ENV, InvalidValue, UserError
from opsd.paths import RECIPE_FILE, read_bytes

logger = logging.getLogger(__name__)

ENV_PREFIX = "OPSD_"
# OPSD_* variables that configure the tooling (the model cache, tracebacks of user errors, a fixed KV cache for
# engines sharing a GPU) rather than the run.
RESERVED_ENV = frozenset({"OPSD_CACHE_DIR", DEBUG_ENV, KV_CACHE_ENV})
MAX_COMPLETION_CAP = 4096
MAX_LINE_CHARS = 4096
# A recipe is a few dozen lines; anything far bigger is a wrong path, not a recipe (1 MiB, opsd.paths).
MAX_FILE_BYTES = RECIPE_FILE.max_bytes
MAX_REPORTED = 50
SHOWN_CHARS = 80

# Method and optimiser switches a researcher may tune under the capped budget.
RECIPE_KEYS = frozenset({
    # optimiser and schedule
    "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "adam_beta1",
    "adam_beta2",
    # rollouts
    "temperature", "top_p", "top_k", "max_completion_length",
    # loss
    "beta", "loss_temperature", "jsd_token_clip", "clip_mode", "top_k_loss", "loss_type", "fix_position_ids",
    "num_loss_tokens_to_skip",
    # LoRA
    "lora_r", "lora_alpha", "lora_dropout",
    # teacher and data
    "teacher_mode", "ema_decay", "data_filter", "teacher_ref", "teacher_ref_pairing", "teacher_ref_max_chars",
    "max_teacher_prompt_length", "student_thinking", "teacher_thinking", "student_prompt_file",
    "teacher_prompt_file",
    # budget helpers that spend no extra compute; the probe's cadence (a few forwards every N steps)
    "wavg_last", "probe_steps",
    # safety: how many non-finite (skipped) steps in a row end the run; a skipped step costs nothing extra
    "max_nonfinite_steps",
})  # fmt: skip

# Settings that change neither the budget nor the method (trackers, logging, memory): the capped harness
# takes them from recipe.env, OPSD_* variables and its pass-through flags (`train_capped.sh -- --report_to
# wandb`). Gradient checkpointing, the loss chunk size and the micro-batch (opsd.run.microbatch) trade memory for
# time on identical arithmetic.
OPERATIONAL_KEYS = frozenset({
    "report_to", "run_name", "logging_steps", "logging_first_step", "log_level", "disable_tqdm",
    "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode", "gradient_checkpointing", "loss_chunk_size",
    "completions_steps", "completions_rows", "vllm_max_num_seqs", "micro_batch_size",
})  # fmt: skip
# Everything recipe.env (and OPSD_* under the harness) may set.
CAPPED_KEYS = RECIPE_KEYS | OPERATIONAL_KEYS

# Fields that change how much compute or data a run gets, or what it is measured on: the capped harness
# fixes them (100 steps x 32 problems on one model and dataset), so recipe.env must not move them.
BUDGET_KEYS = frozenset({
    # steps
    "max_steps", "num_train_epochs",
    # problems per step
    "per_device_train_batch_size", "gradient_accumulation_steps", "auto_find_batch_size",
    # rollouts per problem and reuse of each rollout
    "num_generations", "generation_batch_size", "steps_per_generation", "num_iterations",
    # what is trained, on what, in which order
    "model_name_or_path", "dataset_name", "dataset_split", "seed", "data_seed", "probe_size",
    # where results land and resuming (a resumed run would get more than the budget)
    "output_dir", "save_steps", "save_strategy", "resume_from_checkpoint",
})  # fmt: skip

# Names people carry over from older transformers releases; the hint beats a bare "unknown key".
_RENAMED = {"warmup_ratio": "transformers 5 removed warmup_ratio; a WARMUP_STEPS value below 1 is a ratio"}

# Inherited choice fields typed plain `str` upstream; OPSD's own choice fields carry their allowed values in
# their metadata (opsd.configuration.choices).
_CHOICES: dict[str, tuple[str, ...]] = {
    # The enum holds the names the trainer accepts.
    "lr_scheduler_type": tuple(s.value for s in SchedulerType),
}

_KEY = re.compile(r"[A-Z][A-Z0-9_]*")
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_COMMENT = re.compile(r"\s#")
_TRUE, _FALSE = {"true", "1", "yes"}, {"false", "0", "no"}


class RecipeError(InvalidValue):
    """A recipe file or `OPSD_*` variable that cannot be applied; the message lists every problem."""


@dataclass(frozen=True)
class Override:
    """One validated setting: `value` is already normalised for argparse."""

    field: str
    value: str
    source: str  # e.g. "recipe.env:7" or "env OPSD_BETA"


@dataclass(frozen=True)
class _Spec:
    kind: str  # "bool" | "int" | "float" | "str" | "unsupported"
    choices: tuple[str, ...] | None = None


class _Bad(Exception):
    """One problem with one line or variable: why it is wrong and how to fix it."""

    def __init__(self, why: str, fix: str) -> None:
        super().__init__(why)
        self.why, self.fix = why, fix


@functools.cache
def _specs() -> dict[str, _Spec]:
    """How each `OPSDConfig` field (inherited ones too) is typed, mirroring what HfArgumentParser accepts."""
    hints = typing.get_type_hints(OPSDConfig)
    specs = {}
    for f in dataclasses.fields(OPSDConfig):
        hint = hints[f.name]
        is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        args = [a for a in (typing.get_args(hint) if is_union else (hint,)) if a is not type(None)]
        enums = [a for a in args if isinstance(a, type) and issubclass(a, enum.Enum)]
        literals = [v for a in args if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)]
        choices = f.metadata.get("choices")
        if f.name in _CHOICES:
            specs[f.name] = _Spec("str", _CHOICES[f.name])
        elif f.name == "lora_target_modules":  # a list, written comma-separated on one line
            specs[f.name] = _Spec("str")
        elif any(typing.get_origin(a) is list or a is list for a in args):  # argparse nargs='+'
            specs[f.name] = _Spec("unsupported")
        elif bool in args:  # HfArgumentParser parses `str | bool` as a bool too
            specs[f.name] = _Spec("bool")
        elif args in ([int], [float]):
            specs[f.name] = _Spec(args[0].__name__)
        elif str in args or enums or literals:
            # A Literal beside a plain `str` (trackio_static_space_id) is one option among any string.
            allowed = choices or [m.value for e in enums for m in e] or (None if str in args else literals)
            specs[f.name] = _Spec("str", tuple(str(c) for c in allowed) if allowed else None)
        else:
            specs[f.name] = _Spec("unsupported")
    return specs


def _shown(text: str) -> str:
    """`text` quoted and cut for an error message, so a hostile 100 kB line cannot flood the terminal."""
    return repr(text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "...")


def _closest(word: str, candidates: typing.Iterable[str], cutoff: float = 0.6) -> str | None:
    """The nearest candidate by edit distance if close enough to be a typo; any distance with cutoff=0."""
    return closest(word, candidates, any_distance=cutoff <= 0)


def _bad_char(text: str, *, allow_tab: bool = False) -> str | None:
    """The first character a terminal would not show plainly (controls, NUL, bidi marks), if any."""
    for ch in text:
        if not ch.isprintable() and not (allow_tab and ch == "\t"):
            return f"U+{ord(ch):04X}"
    return None


def _normalise(field: str, raw: str, *, capped: bool) -> str:
    """`raw` checked against the type of `field` and rewritten in the form argparse parses back exactly."""
    spec = _specs()[field]
    bad = _bad_char(raw)
    if bad:
        raise _Bad(f"value of {field} contains the control character {bad}", "remove it")
    if spec.kind == "bool":
        if raw.lower() in _TRUE | _FALSE:
            return "true" if raw.lower() in _TRUE else "false"
        raise _Bad(
            f"{field} expects true or false, got {_shown(raw)}", "write true or false (or 1/0, yes/no)"
        )
    if spec.kind == "int":
        # A regex, not just int(): int() also takes fullwidth and other Unicode digits.
        if not _INT.fullmatch(raw):
            raise _Bad(
                f"{field} expects an integer, got {_shown(raw)}", "write a plain ASCII integer like 64"
            )
        value = int(raw)
        if field == "max_completion_length" and capped and not 1 <= value <= MAX_COMPLETION_CAP:
            raise _Bad(
                f"max_completion_length={value} is outside 1..{MAX_COMPLETION_CAP}",
                f"the capped harness allows at most {MAX_COMPLETION_CAP} tokens per rollout",
            )
        return str(value)
    if spec.kind == "float":
        # The pattern already excludes nan/inf; the isfinite check catches overflow such as 1e999.
        if not _FLOAT.fullmatch(raw) or not math.isfinite(float(raw)):
            raise _Bad(
                f"{field} expects a finite number, got {_shown(raw)}", "write a plain number like 1e-5"
            )
        return repr(float(raw))
    if spec.kind == "str":
        if spec.choices is not None:
            if raw in spec.choices:
                return raw
            near = _closest(raw, spec.choices)
            hint = f"did you mean {near}? " if near else ""
            raise _Bad(
                f"{field} does not accept {_shown(raw)}", f"{hint}choose one of {', '.join(spec.choices)}"
            )
        if "$" in raw or "`" in raw:
            # Nothing here expands variables, so `$HOME/p.txt` would silently name a literal `$HOME` folder.
            raise _Bad(f"value of {field} contains $ or `", "nothing is expanded: write the literal path")
        return raw
    raise _Bad(
        f"{field} takes a list or mapping", "set it in the YAML config (--config) or on the command line"
    )


def _check_field(field: str, name: str, *, allowed: frozenset[str] | set[str] | None, where: str) -> None:
    """Refuse a field that `allowed` excludes, with the budget message for budget fields."""
    if allowed is None or field in allowed:
        return
    if field in BUDGET_KEYS:
        raise _Bad(
            f"{name} is fixed by the capped harness (100 steps x 32 problems) and cannot be set in {where}",
            "remove it; see BUDGET_KEYS in opsd/configuration/recipe.py",
        )
    raise _Bad(
        f"{name} is a config field but not tunable in {where}",
        f"remove it; tunable keys are {', '.join(sorted(k.upper() for k in allowed))}",
    )


def _unknown(field: str, name: str, candidates: typing.Iterable[str], prefix: str) -> _Bad:
    if field in _RENAMED:
        return _Bad(f"{name} is not a config field", _RENAMED[field])
    near = _closest(field, candidates)
    if near:
        return _Bad(f"{name} is not a config field", f"did you mean {prefix}{near.upper()}?")
    anywhere = _closest(field, _specs())  # a field the user could mean that is not settable here
    if anywhere:
        where = "fixed by the capped harness" if anywhere in BUDGET_KEYS else "not tunable here"
        return _Bad(
            f"{name} is not a config field", f"did you mean {prefix}{anywhere.upper()}? it is {where}"
        )
    nearest = _closest(field, candidates, cutoff=0.0)
    fix = f"no field is close; the nearest is {prefix}{nearest.upper()} (all fields: opsd/configuration/config.py)"
    return _Bad(f"{name} is not a config field", fix)


def _unquote(text: str) -> str:
    """The value part of a line (everything after `=`) without its quotes or trailing comment."""
    body = text.strip()
    if body[:1] in ("'", '"'):
        quote = body[0]
        end = body.find(quote, 1)
        if end < 0:
            raise _Bad(f"the value opens a {quote} quote that is never closed", f"close it with {quote}")
        rest = body[end + 1 :].strip()
        if rest and not rest.startswith("#"):
            raise _Bad(
                f"text {_shown(rest)} follows the closing quote", "put the whole value inside the quotes"
            )
        return body[1:end]
    comment = _COMMENT.search(text)
    if comment:
        text = text[: comment.start()]
    body = text.strip()
    if "'" in body or '"' in body:
        raise _Bad("a quote inside an unquoted value", "quote the whole value or none of it")
    return body


def _case_fix(field: str) -> str:
    """The fix for a field written in lower case: its key, and whether recipe.env may set it at all."""
    key = field.upper()
    if field in CAPPED_KEYS:
        return f"did you mean {key}? keys are upper case"
    if field in BUDGET_KEYS:
        return f"{key} is the key, and it is fixed by the capped harness (100 steps x 32 problems): remove it"
    return f"{key} is the key, and it is not tunable in recipe.env: remove it"


def _parse_line(line: str, *, seen: dict[str, int], lineno: int) -> tuple[str, str] | None:
    """(field, value) from one decoded line, None for blank and comment lines; raises _Bad."""
    bad = _bad_char(line, allow_tab=True)
    if bad:
        raise _Bad(
            f"the line contains the control character {bad}", "remove it (save the file as plain text)"
        )
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return None
    if "=" not in stripped:
        raise _Bad("the line has no '='", "write KEY=VALUE, or start the line with # to make it a comment")
    key, _, rest = stripped.partition("=")
    key = key.strip()
    if not key:
        raise _Bad("the key before '=' is empty", "write KEY=VALUE")
    if key.startswith("export "):
        raise _Bad("'export' is shell syntax", "drop 'export': this file is parsed, not sourced")
    field = (key[len(ENV_PREFIX) :] if key.startswith(ENV_PREFIX) else key).lower()
    if not _KEY.fullmatch(key):
        upper = key.upper()
        named = upper.removeprefix(ENV_PREFIX).lower()
        if _KEY.fullmatch(upper) and named in _specs():  # a field name in the wrong case: name the field
            raise _Bad(f"{_shown(key)} is not a valid key", _case_fix(named))
        near = _closest(named, CAPPED_KEYS)
        hint = f"did you mean {near.upper()}? " if near else ""
        raise _Bad(
            f"{_shown(key)} is not a valid key", f"{hint}keys are upper-case ASCII letters, digits and _"
        )
    if field not in _specs():
        raise _unknown(field, key, CAPPED_KEYS, "")
    _check_field(field, key, allowed=CAPPED_KEYS, where="recipe.env")
    if field in seen:
        raise _Bad(f"{field.upper()} is set twice, on lines {seen[field]} and {lineno}", "keep one of them")
    seen[field] = lineno
    return field, _normalise(field, _unquote(rest), capped=True)


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
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        source = f"{path}:{lineno}"
        # Measured in bytes before decoding, so an oversized line is refused without further work.
        if len(raw) > MAX_LINE_CHARS:
            head = raw[:SHOWN_CHARS].decode("utf-8", errors="replace")
            why = f"line is {len(raw)} bytes long (limit {MAX_LINE_CHARS})"
            problems.append(f"{source}: {_shown(head)}: {why}; fix: shorten it")
            continue
        try:
            line = raw.removesuffix(b"\r").decode("utf-8")
        except UnicodeDecodeError:
            problems.append(f"{source}: not valid UTF-8; fix: save the file as UTF-8")
            continue
        if lineno == 1:
            line = line.removeprefix("\ufeff")  # editors on Windows add a byte-order mark
        try:
            parsed = _parse_line(line, seen=seen, lineno=lineno)
        except _Bad as bad:
            problems.append(f"{source}: {_shown(line.strip())}: {bad.why}; fix: {bad.fix}")
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
    candidates = allowed if allowed is not None else _specs().keys()
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in RESERVED_ENV:
            continue
        field = name[len(ENV_PREFIX) :].lower()
        source = f"env {name}"
        try:
            # Upper case only: OPSD_beta would otherwise pass here but look unset to everything else.
            if name != name.upper() or field not in _specs():
                raise _unknown(field, name, candidates, ENV_PREFIX)
            _check_field(field, name, allowed=allowed, where="the capped harness's environment")
            # Spaces and tabs only: a newline stays in and is refused like any control character.
            value = _normalise(field, environ[name].strip(" \t"), capped=allowed is not None)
        except _Bad as bad:
            problems.append(f"{source}: {bad.why} (value {_shown(environ[name])}); fix: {bad.fix}")
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
            problems.append(f"{_shown(arg)}: not a --flag; fix: write --key value or --key=value")
            continue
        name, has_value, value = arg[2:].partition("=")
        field = name.replace("-", "_")
        flag = f"--{name}"
        if not has_value and i < len(args) and not args[i].startswith("--"):
            value, has_value, i = args[i], True, i + 1
        try:
            if field not in _specs():
                near = _closest(field, OPERATIONAL_KEYS)
                hint = f"did you mean --{near}? " if near else ""
                keys = ", ".join(sorted(OPERATIONAL_KEYS))
                raise _Bad(f"{flag} is not a config field", f"{hint}pass-through flags take {keys}")
            if field in RECIPE_KEYS:
                raise _Bad(
                    f"{flag} changes the method",
                    f"set {field.upper()} in recipe.env or OPSD_{field.upper()}, where the recipe records it",
                )
            _check_field(field, flag, allowed=OPERATIONAL_KEYS, where="a pass-through flag")
            if not has_value:
                if _specs()[field].kind != "bool":
                    raise _Bad(f"{flag} needs a value", f"write {flag} VALUE or {flag}=VALUE")
                value = "true"  # a bare boolean flag, as argparse reads it
            overrides.append(Override(field, _normalise(field, value, capped=True), f"flag {flag}"))
        except _Bad as bad:
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
