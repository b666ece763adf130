"""opsd_train.py's command line: flags, YAML, `recipe.env` and `OPSD_*` into one checked `OPSDConfig`.

`parse_config` is the one parser of training's settings: `opsd_train.py` and `train_capped.sh`'s dry run
(`opsd.launch.preflight`) both call it. Every problem is a `UserError` naming the source of the bad value.
"""

from __future__ import annotations

import argparse
import os

from opsd.configuration.config import OPSDConfig
from opsd.configuration.sources.aliases import canonical_flags, canonical_keys
from opsd.configuration.sources.recipe import name_source, resolve_overrides, to_argv
from opsd.configuration.sources.yaml_bounds import check_bounded, check_yaml_numbers
from opsd.errors import InvalidValue, MissingPath, UserError
from opsd.paths import DEEPSPEED_CONFIG, YAML_CONFIG, check_file, read_text

SUMMARY = "Train a model with on-policy self-distillation (OPSD)."
ALLOW_HELP = (
    "resume a run directory with changed method or budget settings; the changes are appended to "
    "opsd_config.json's history (otherwise refused)"
)


def parse_config(argv: list[str], environ=os.environ) -> tuple[OPSDConfig, argparse.Namespace]:
    """CLI/YAML via TRL's parser, then recipe.env and OPSD_* overrides appended as flags (they win).

    Every problem is a `UserError`: bad flags, values, YAML files, recipe lines and `OPSD_*` variables.
    """
    from trl import TrlParser

    class Parser(TrlParser):
        yaml_source = "the YAML config"
        yaml_keys: set[str] = set()

        def error(self, message: str):  # argparse would print the usage of ~200 flags, then exit
            raise InvalidValue(f"{message}; see python opsd_train.py --help")

        def set_defaults_with_config(self, **kwargs) -> list[str]:
            # Keys transformers 5 removed are translated or ignored with a note; unknown keys get a hint.
            from opsd.configuration.checks.values import field_specs
            from opsd.configuration.sources.legacy import translate_yaml

            known = {a.dest for a in self._actions}
            kwargs = canonical_keys(kwargs, source=self.yaml_source)
            translated = translate_yaml(kwargs, known, source=self.yaml_source)
            check_yaml_numbers(translated, {k: s.kind for k, s in field_specs().items()}, self.yaml_source)
            check_deepspeed_file(translated.get("deepspeed"))
            self.yaml_keys = set(translated)
            return super().set_defaults_with_config(**translated)

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe", default=None, help="recipe.env file with KEY=VALUE overrides")
    pre.add_argument("--capped", action="store_true", help="refuse overrides that change the budget")
    pre.add_argument(
        "--dry-run", action="store_true", help="check every input, print the config, train nothing"
    )
    pre.add_argument("--allow-config-change", action="store_true", help=ALLOW_HELP)
    extra, rest = pre.parse_known_args(argv)
    rest = canonical_flags(rest)
    parser = Parser((OPSDConfig,))
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
    except FileNotFoundError as err:  # --config naming a missing YAML file
        raise MissingPath(f"{err}; check the path") from err
    except OSError as err:  # a --config path that cannot be read (too long, a directory, no permission)
        raise MissingPath(f"cannot read the YAML config ({err.strerror}); check the path") from err
    except ValueError as err:  # OPSDConfig/TrainingArguments validation and unknown flags
        unknown = "not used by the HfArgumentParser" in str(err)
        hints = unknown_flag_hints(rest, {a.dest for a in parser._actions}) if unknown else ""
        message = (
            f"{err}{hints}; see python opsd_train.py --help" if unknown else name_source(str(err), overrides)
        )
        field = message.split("=", 1)[0]
        flagged = any(a == f"--{field}" or a.startswith(f"--{field}=") for a in rest)
        if (
            message == str(err) and field in parser.yaml_keys and not flagged
        ):  # the YAML set it, nothing later
            message = f"{message} (from {parser.yaml_source})"
        raise InvalidValue(message) from err
    except Exception as err:
        import yaml

        if isinstance(err, yaml.YAMLError):  # a YAML syntax error: its location, on one line
            raise InvalidValue(
                f"{parser.yaml_source} is not valid YAML: {' '.join(str(err).split())}"
            ) from err
        raise
    return config, extra


def check_yaml_file(path: str) -> None:
    """`--config`'s file: a regular file within its cap (`opsd.paths`), valid YAML, and bounded
    (`yaml_bounds.check_bounded`) before TRL loads it and walks its values."""
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
    from opsd.configuration.sources.legacy import IGNORED, RENAMED
    from opsd.errors import closest

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
    ranges; the ~200 inherited TRL/transformers arguments follow it."""
    import dataclasses

    from opsd.configuration.checks.ranges import RANGES

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
    by_name = {f.name: f for f in dataclasses.fields(OPSDConfig)}
    for name in OPSDConfig.__dict__.get("__annotations__", {}):  # in the order the class declares them
        f = by_name[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        extras = [f"default {default!r}"]
        if f.metadata.get("choices"):
            extras.append("one of " + "|".join(f.metadata["choices"]))
        if f.name in RANGES:
            extras.append(RANGES[f.name].rule())
        lines.append(f"  --{f.name:<36} {f.metadata.get('help', '')} [{'; '.join(extras)}]")
    return "\n".join(lines)
