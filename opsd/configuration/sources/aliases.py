"""Older names of `OPSDConfig` fields, still accepted where users' recipes carry them.

A recipe line (`JSD_TOKEN_CLIP=0.1`), an `OPSD_*` variable, a YAML key or a flag (`--jsd_token_clip 0.1`)
under an older name is read as the field's canonical name, with a logged note (INFO) that names it; giving both
names is refused. A run directory's `opsd_config.json` written under an older name is read the same way on
resume. Everything else (the config, `--help`, docs/configuration.md, error messages) uses the canonical name.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from opsd.errors import InvalidValue

logger = logging.getLogger(__name__)

# older name -> canonical field name
ALIASES = {"jsd_token_clip": "divergence_clip"}


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
