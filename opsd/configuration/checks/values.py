"""One value of an `OPSDConfig` field as a recipe line, an `OPSD_*` variable or a pass-through flag gives it:
checked against the field's type and choices, and rewritten in the form argparse parses back exactly.

The type and the allowed values come from the field itself (its annotation, and the `choices` in its metadata
from `opsd.configuration.checks.choices`); ranges are checked once, by `OPSDConfig.__post_init__`. A problem
is a `Bad`: why the value is wrong and how to fix it; `opsd.configuration.sources.recipe` collects them into
one error.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import types
import typing
from dataclasses import dataclass

from transformers.trainer_utils import SchedulerType

from opsd.configuration.config import OPSDConfig
from opsd.configuration.sources.keys import BUDGET_KEYS
from opsd.errors import closest

MAX_COMPLETION_CAP = 4096
SHOWN_CHARS = 80

# Names people carry over from older transformers releases; the hint beats a bare "unknown key".
RENAMED_KEYS = {
    "warmup_ratio": "transformers 5 removed warmup_ratio; a WARMUP_STEPS value below 1 is a ratio"
}

# Inherited choice fields typed plain `str` upstream; OPSD's own choice fields carry their allowed values in
# their metadata (opsd.configuration.checks.choices).
INHERITED_CHOICES: dict[str, tuple[str, ...]] = {
    # The enum holds the names the trainer accepts.
    "lr_scheduler_type": tuple(s.value for s in SchedulerType),
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


@functools.cache
def field_specs() -> dict[str, FieldSpec]:
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
        if f.name in INHERITED_CHOICES:
            specs[f.name] = FieldSpec("str", INHERITED_CHOICES[f.name])
        elif f.name == "lora_target_modules":  # a list, written comma-separated on one line
            specs[f.name] = FieldSpec("str")
        elif any(typing.get_origin(a) is list or a is list for a in args):  # argparse nargs='+'
            specs[f.name] = FieldSpec("unsupported")
        elif bool in args:  # HfArgumentParser parses `str | bool` as a bool too
            specs[f.name] = FieldSpec("bool")
        elif args in ([int], [float]):
            specs[f.name] = FieldSpec(args[0].__name__)
        elif str in args or enums or literals:
            # A Literal beside a plain `str` (trackio_static_space_id) is one option among any string.
            allowed = choices or [m.value for e in enums for m in e] or (None if str in args else literals)
            specs[f.name] = FieldSpec("str", tuple(str(c) for c in allowed) if allowed else None)
        else:
            specs[f.name] = FieldSpec("unsupported")
    return specs


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


def check_field(field: str, name: str, *, allowed: frozenset[str] | set[str] | None, where: str) -> None:
    """Refuse a field that `allowed` excludes, with the budget message for budget fields."""
    if allowed is None or field in allowed:
        return
    if field in BUDGET_KEYS:
        raise Bad(
            f"{name} is fixed by the capped harness (100 steps x 32 problems) and cannot be set in {where}",
            "remove it; see BUDGET_KEYS in opsd/configuration/sources/keys.py",
        )
    raise Bad(
        f"{name} is a config field but not tunable in {where}",
        f"remove it; tunable keys are {', '.join(sorted(k.upper() for k in allowed))}",
    )


def unknown_field(field: str, name: str, candidates: typing.Iterable[str], prefix: str) -> Bad:
    if field in RENAMED_KEYS:
        return Bad(f"{name} is not a config field", RENAMED_KEYS[field])
    near = nearest(field, candidates)
    if near:
        return Bad(f"{name} is not a config field", f"did you mean {prefix}{near.upper()}?")
    anywhere = nearest(field, field_specs())  # a field the user could mean that is not settable here
    if anywhere:
        where = "fixed by the capped harness" if anywhere in BUDGET_KEYS else "not tunable here"
        return Bad(f"{name} is not a config field", f"did you mean {prefix}{anywhere.upper()}? it is {where}")
    closest_one = nearest(field, candidates, cutoff=0.0)
    fix = f"no field is close; the nearest is {prefix}{closest_one.upper()} (all fields: opsd/configuration/config.py)"
    return Bad(f"{name} is not a config field", fix)
