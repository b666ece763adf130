"""User errors: mistakes in a command or its inputs, reported in one line with exit status 2.

A `UserError` names the problem and the fix (bad config values, recipe lines, data files, missing paths).
The entry points (`opsd_train.py`, `train_capped.sh`, `eval_aime.py`) print it as one line without a
traceback (a recipe with several bad lines gets one line per problem) and exit with status 2. A bare
`--debug` flag or `OPSD_DEBUG=1` prints the traceback first. Every other exception is a bug and keeps its
traceback.

`InvalidValue` and `MissingPath` are also a `ValueError` and a `FileNotFoundError`, so code that catches
those still catches them.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence

DEBUG_FLAG = "--debug"
DEBUG_ENV = "OPSD_DEBUG"
USER_ERROR_EXIT = 2


class UserError(Exception):
    """A mistake in the command or its inputs; the message names the problem and the fix."""


class InvalidValue(UserError, ValueError):
    """A config value, recipe line or data row that cannot be used."""


class MissingPath(UserError, FileNotFoundError):
    """A file or directory named by the user that does not exist or is not of the right kind."""


def split_debug(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> tuple[bool, list[str]]:
    """(debug requested, argv without our `--debug`).

    Only a bare `--debug` is ours: `--debug VALUE` and `--debug=VALUE` are transformers' own `debug`
    training argument and stay in argv.
    """
    rest: list[str] = []
    debug = environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
    for i, arg in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if arg == DEBUG_FLAG and (nxt is None or nxt.startswith("-")):
            debug = True
        else:
            rest.append(arg)
    return debug, rest


def report(err: BaseException, prog: str, *, debug: bool) -> int:
    """Print a user error (its traceback first under debug) and return the exit status for it."""
    if debug:
        traceback.print_exception(err)
    print(f"{prog}: error: {err}", file=sys.stderr)
    return USER_ERROR_EXIT


def run_main(main: Callable[[list[str]], object], prog: str, argv: Sequence[str] | None = None) -> int:
    """Call `main(argv)`; a `UserError` becomes one line on stderr and exit status 2, anything else raises."""
    debug, rest = split_debug(sys.argv[1:] if argv is None else argv)
    try:
        main(rest)
    except UserError as err:
        return report(err, prog, debug=debug)
    return 0
