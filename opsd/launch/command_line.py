"""opsd_train.py's command line: its flags and a `--config` YAML, read by TRL's parser into one checked
`OPSDConfig`, with `recipe.env` and `OPSD_*` values (`opsd.configuration.sources`) appended after them.

`parse_config` is the one parser of training's settings: `opsd_train.py` and `train_capped.sh`'s dry run both
call it (`opsd.launch.preflight`). The precedence (docs/configuration.md, Running and precedence: defaults < YAML
< flags < recipe.env < `OPSD_*`) holds because `recipe.env` and `OPSD_*` values are appended, as flags, after the
user's (argparse keeps the last occurrence). Every problem is a `UserError` naming the source of the bad value.

* YAML (`--config`): TRL/open-r1 configs as they are written. Keys transformers 5 removed are translated or
  ignored with one logged note each (`translate_yaml`: `warmup_ratio` becomes `warmup_steps`, a fraction of
  `max_steps`; `no_cuda` becomes `use_cpu`; `overwrite_output_dir`, evaluation settings and hub push names are
  ignored, since a training-only run does not use them); removed keys that would change the method or the budget
  (`per_gpu_train_batch_size`) and unknown keys are refused with a suggestion. A YAML value is bounded before
  anything walks it (`check_bounded`): PyYAML builds an alias (`*a`) as a second reference to its anchor's value,
  so a 300-byte file of nested aliases holds 9^8 leaves, which whatever walks the value (TRL's `str(value)` of
  `env`, a list of LoRA modules flattened) expands until the memory is gone; the whole document's nodes are
  counted, every alias as the copy it stands for, up to `MAX_NODES` (an open-r1 recipe has under a hundred).
  `check_yaml_numbers` refuses a value that is not a number for a numeric field in words that say so.
* The command line (`parse_config`, `opsd_help`): the entry flags, `--help` with OPSD's fields first, hints for
  unknown flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any

from trl import TrlParser

from opsd.configuration.config import OPSDConfig
from opsd.configuration.sources import (
    Override,
    canonical_flags,
    canonical_keys,
    field_specs,
    name_source,
    resolve_overrides,
    to_argv,
)
from opsd.configuration.switches import RANGES, Switches
from opsd.errors import InvalidValue, MissingPath, UserError, closest
from opsd.paths import DEEPSPEED_CONFIG, YAML_CONFIG, check_file, read_text

logger = logging.getLogger(__name__)


# -- YAML: keys transformers 5 removed ----------------------------------------------------------------------

# Removed key -> the field it becomes (the value is kept).
RENAMED = {"warmup_ratio": "warmup_steps", "no_cuda": "use_cpu"}
# Removed or evaluation-only keys that a training-only run can ignore, with why.
IGNORED = {
    "overwrite_output_dir": "OPSD resumes from the newest complete checkpoint in output_dir and refuses one "
    "of another configuration; use a new output_dir to start over",
    "evaluation_strategy": "OPSD trains on no evaluation set; score checkpoints with eval_aime.py",
    "logging_dir": "transformers 5 removed it; trackers choose their own directory",
    "push_to_hub_model_id": "transformers 5 removed it; use hub_model_id",
    "push_to_hub_organization": "transformers 5 removed it; use hub_model_id",
    "push_to_hub_token": "transformers 5 removed it; use hub_token",
    "save_safetensors": "checkpoints are always safetensors in transformers 5",
    "include_tokens_per_second": "OPSD logs rollout/tokens_per_s itself",
    "include_inputs_for_metrics": "OPSD computes no evaluation metrics",
    "fp16_backend": "transformers 5 removed it; precision follows bf16/fp16",
    "half_precision_backend": "transformers 5 removed it; precision follows bf16/fp16",
    "use_mps_device": "transformers 5 removed it; the device is chosen automatically",
}
# Fields that exist but would make a training-only run fail once the model has loaded (no evaluation set):
# field -> the value that turns them off.
EVALUATION_OFF = {"eval_strategy": "no", "do_eval": False}
# Removed keys that change the budget or the method: refused, naming what to use.
REFUSED = {
    "per_gpu_train_batch_size": "use per_device_train_batch_size",
    "per_gpu_eval_batch_size": "OPSD trains on no evaluation set; remove it",
}


def translate_yaml(config: Mapping[str, Any], known: Iterable[str], *, source: str) -> dict[str, Any]:
    """`config` (a YAML mapping) with removed keys translated or dropped, each with one logged note; raises
    InvalidValue naming every key that is refused or unknown, with a suggestion."""
    known = set(known)
    out: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in config.items():
        if key in RENAMED:
            target = RENAMED[key]
            if target in config:
                problems.append(f"{key} and {target} are both set; keep only {target}")
                continue
            logger.warning("%s: note: %s=%r is read as %s=%r (transformers 5 removed %s)", source, key, value,
                           target, value, key)  # fmt: skip
            out[target] = value
        elif key in IGNORED:
            logger.warning("%s: note: %s=%r is ignored: %s", source, key, value, IGNORED[key])
        elif key in EVALUATION_OFF and value not in (EVALUATION_OFF[key], None, "NO", "No"):
            logger.warning(
                "%s: note: %s=%r is ignored (set to %r): OPSD trains on no evaluation set; score checkpoints "
                "with eval_aime.py",
                source, key, value, EVALUATION_OFF[key],
            )  # fmt: skip
            out[key] = EVALUATION_OFF[key]
        elif key in REFUSED:
            problems.append(f"{key} was removed in transformers 5 and changes the run; {REFUSED[key]}")
        elif key not in known:
            near = closest(key, known)
            problems.append(f"{key} is not a config field" + (f" (did you mean {near}?)" if near else ""))
        else:
            out[key] = value
    if problems:
        raise InvalidValue(
            f"{source}: {'; '.join(problems)}; fix the YAML keys (every OPSDConfig field and TRL/transformers "
            "training argument is one: python opsd_train.py --help)"
        )
    return out


# -- YAML: values bounded, numbers checked ------------------------------------------------------------------

MAX_NODES = 10_000


def node_count(value: object, cap: int = MAX_NODES) -> int:
    """The nodes of `value` (scalars, lists, mappings with their keys), each alias counted as a copy, up to
    `cap + 1`: the walk stops there, so a value of billions of leaves, or one that holds itself, costs `cap`
    steps."""
    count, stack = 0, [value]
    while stack and count <= cap:
        node = stack.pop()
        count += 1
        if isinstance(node, Mapping):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple, set)):
            stack.extend(node)
    return count


def check_bounded(document: object, source: str) -> None:
    """InvalidValue naming the key whose value takes the document past `MAX_NODES` nodes."""
    if not isinstance(document, Mapping):
        return  # TRL refuses a document that is not a mapping in its own words
    total = 0
    for key, value in document.items():
        total += node_count(value, MAX_NODES - total)
        if total > MAX_NODES:
            raise InvalidValue(
                f"{source}: the value of {str(key)[:80]!r} takes the config past {MAX_NODES:,} YAML nodes (an "
                "alias counts as the copy it stands for); a config is a few dozen plain values: write them out"
            )


def check_yaml_numbers(values: Mapping[str, object], kinds: Mapping[str, str], source: str) -> None:
    """InvalidValue for the first value of a numeric field (`kinds`: field -> "int" or "float") that is not
    a number: a boolean, a list, a mapping; or, for an integer field, a number with a fraction."""
    for key, value in values.items():
        kind = kinds.get(key)
        if kind not in ("int", "float") or value is None or isinstance(value, str):
            continue
        example = "8" if kind == "int" else "0.5"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            # As YAML wrote it (`true`, not Python's True); a list or mapping by its type: its text may be huge.
            what = str(value).lower() if isinstance(value, bool) else f"a {type(value).__name__}"
            raise InvalidValue(f"{key}: {what} in {source} is not a number; write e.g. {key}: {example}")
        if kind == "int" and isinstance(value, float) and not value.is_integer():
            raise InvalidValue(
                f"{key}: {value!r} in {source} is not a whole number; write e.g. {key}: {example}"
            )


# -- the command line ---------------------------------------------------------------------------------------

SUMMARY = "Train a model with on-policy self-distillation (OPSD)."
ALLOW_HELP = (
    "resume a run directory with changed method or budget settings; the changes are appended to "
    "opsd_config.json's history (otherwise refused)"
)


class _Parser(TrlParser):
    """TRL's parser of `OPSDConfig` (flags and `--config` YAML) with one-line errors and the YAML read as
    TRL/open-r1 configs are written (module docstring)."""

    yaml_source = "the YAML config"
    yaml_keys: set[str] = set()

    def error(self, message: str):  # argparse would print the usage of ~200 flags, then exit
        raise InvalidValue(f"{message}; see python opsd_train.py --help")

    def set_defaults_with_config(self, **kwargs) -> list[str]:
        # Keys transformers 5 removed are translated or ignored with a note; unknown keys get a hint.
        known = {a.dest for a in self._actions}
        kwargs = canonical_keys(kwargs, source=self.yaml_source)
        translated = translate_yaml(kwargs, known, source=self.yaml_source)
        check_yaml_numbers(translated, {k: s.kind for k, s in field_specs().items()}, self.yaml_source)
        check_deepspeed_file(translated.get("deepspeed"))
        self.yaml_keys = set(translated)
        return super().set_defaults_with_config(**translated)


def _entry_parser() -> argparse.ArgumentParser:
    """The entry flags, read before the config's own."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe", default=None, help="recipe.env file with KEY=VALUE overrides")
    pre.add_argument("--capped", action="store_true", help="refuse overrides that change the budget")
    pre.add_argument(
        "--dry-run", action="store_true", help="check every input, print the config, train nothing"
    )
    pre.add_argument("--allow-config-change", action="store_true", help=ALLOW_HELP)
    return pre


def parse_config(argv: list[str], environ=os.environ) -> tuple[OPSDConfig, argparse.Namespace]:
    """CLI/YAML via TRL's parser, then recipe.env and OPSD_* overrides appended as flags (they win).

    Every problem is a `UserError`: bad flags, values, YAML files, recipe lines and `OPSD_*` variables.
    """
    pre = _entry_parser()
    extra, rest = pre.parse_known_args(argv)
    rest = canonical_flags(rest)
    parser = _Parser((OPSDConfig,))
    if "-h" in rest or "--help" in rest:
        print(opsd_help(pre) + "\n\nEvery TRL/transformers training argument (each also a YAML key):\n")
        parser.print_help()
        raise SystemExit(0)
    overrides = resolve_overrides(extra.recipe, environ, capped=extra.capped)
    if "--config" in rest[:-1]:
        parser.yaml_source = rest[rest.index("--config") + 1]
        # TRL opens the file itself: refuse what is not a regular YAML file of at most 1 MiB before it does, or
        # whose aliases expand past what any config holds (its `env` and unknown keys are str()-ed whole).
        check_yaml_file(parser.yaml_source)
    for value in flag_values(rest + to_argv(overrides), "--deepspeed"):
        check_deepspeed_file(value)
    try:
        (config,) = parser.parse_args_and_config(rest + to_argv(overrides))
    except UserError:
        raise
    except Exception as err:
        problem = _user_error(err, parser, rest, overrides)
        if problem is None:
            raise
        raise problem from err
    return config, extra


def _user_error(
    err: Exception, parser: _Parser, rest: list[str], overrides: list[Override]
) -> UserError | None:
    """The one-line `UserError` for what parsing the config raised, naming where the bad value came from; None
    for an exception that is no user's mistake."""
    import yaml

    if isinstance(err, FileNotFoundError):  # --config naming a missing YAML file
        return MissingPath(f"{err}; check the path")
    if isinstance(err, OSError):  # a --config path that cannot be read (too long, a directory, no permission)
        return MissingPath(f"cannot read the YAML config ({err.strerror}); check the path")
    if isinstance(err, yaml.YAMLError):  # a YAML syntax error: its location, on one line
        return InvalidValue(f"{parser.yaml_source} is not valid YAML: {' '.join(str(err).split())}")
    if not isinstance(err, ValueError):
        return None
    # OPSDConfig/TrainingArguments validation and unknown flags
    unknown = "not used by the HfArgumentParser" in str(err)
    hints = unknown_flag_hints(rest, {a.dest for a in parser._actions}) if unknown else ""
    message = (
        f"{err}{hints}; see python opsd_train.py --help" if unknown else name_source(str(err), overrides)
    )
    field = message.split("=", 1)[0]
    flagged = any(a == f"--{field}" or a.startswith(f"--{field}=") for a in rest)
    if message == str(err) and field in parser.yaml_keys and not flagged:  # the YAML set it, nothing later
        message = f"{message} (from {parser.yaml_source})"
    return InvalidValue(message)


def check_yaml_file(path: str) -> None:
    """`--config`'s file: a regular file within its cap (`opsd.paths`), valid YAML, and bounded
    (`check_bounded`) before TRL loads it and walks its values."""
    import yaml

    text = read_text(path, YAML_CONFIG)
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as err:  # its location, on one line
        raise InvalidValue(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    check_bounded(document, path)


def flag_values(argv: list[str], flag: str) -> list[str]:
    """The values given to `flag` in `argv`, as `--flag VALUE` or `--flag=VALUE`."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    return values + [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def check_deepspeed_file(value) -> None:
    """transformers reads a `deepspeed` value that names a file while parsing the arguments: it must be a
    regular file of at most 1 MiB (`opsd.paths`). A dict or an inline JSON string is left to transformers."""
    if isinstance(value, str) and value and os.path.lexists(os.path.expanduser(value)):
        check_file(value, DEEPSPEED_CONFIG)


def unknown_flag_hints(argv: list[str], known: set[str]) -> str:
    """`(--learnin_rate: did you mean --learning_rate?)` for the unknown flags of `argv`, by edit distance
    over the config's fields; removed transformers keys say what replaced them."""
    hints = []
    for arg in argv:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        if name in known or name == "config":
            continue
        if name in RENAMED:
            hints.append(f"--{name}: transformers 5 removed it; use --{RENAMED[name]} with the same value")
        elif name in IGNORED:
            hints.append(f"--{name}: transformers 5 removed it; leave it out ({IGNORED[name]})")
        elif near := closest(name, known):
            hints.append(f"--{name}: did you mean --{near}?")
    return f" ({'; '.join(hints)})" if hints else ""


def opsd_help(pre: argparse.ArgumentParser) -> str:
    """The top of `--help`: usage, the entry flags, then OPSD's own fields with their defaults, choices and
    ranges (their declarations, `opsd.configuration.switches`); the ~200 inherited TRL/transformers arguments
    follow it."""
    lines = [
        "usage: python opsd_train.py [--config FILE.yaml] [--recipe recipe.env] [--dry-run] [--debug]",
        "                            [--allow-config-change] [--FIELD VALUE ...]",
        "",
        SUMMARY,
        "Which setting wins when several give a field: docs/configuration.md (Running and precedence).",
        "",
        "entry flags:",
        "  --config FILE          YAML config (TRL/open-r1 shape); flags given after it win",
    ]
    for action in pre._actions:
        flag = action.option_strings[0] + (" FILE" if action.nargs is None and action.const is None else "")
        lines.append(f"  {flag:<22} {action.help}")
    lines.append(
        f"  {'--debug':<22} show the traceback of a user error (also OPSD_DEBUG=1); --debug VALUE is "
        "transformers' debug option"
    )
    lines += ["", "OPSD fields (--field VALUE, YAML key field, recipe.env key FIELD, variable OPSD_FIELD):"]
    for f in dataclasses.fields(Switches):  # in the order they are declared
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        extras = [f"default {default!r}"]
        if f.metadata.get("choices"):
            extras.append("one of " + "|".join(f.metadata["choices"]))
        if f.name in RANGES:
            extras.append(RANGES[f.name].rule())
        lines.append(f"  --{f.name:<36} {f.metadata.get('help', '')} [{'; '.join(extras)}]")
    return "\n".join(lines)
