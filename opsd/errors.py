"""User errors: mistakes in a command or its inputs, reported in one line with exit status 2.

A `UserError` names the problem and the fix (bad config values, recipe lines, data files, missing paths).
The entry points (`opsd_train.py`, `train_capped.sh`, `eval_aime.py`) print it as one line without a
traceback (a recipe with several bad lines gets one line per problem) and exit with status 2. A bare
`--debug` flag or `OPSD_DEBUG=1` prints the traceback first. Every other exception is a bug and keeps its
traceback.

`exit_now` ends an entry point whose work is done without the interpreter's slow teardown.

`closest` finds the name a user probably meant (a typo of a field, key or flag) for the "did you mean" hints.

`InvalidValue` and `MissingPath` are also a `ValueError` and a `FileNotFoundError`, so code that catches
those still catches them.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NoReturn

DEBUG_FLAG = "--debug"
DEBUG_ENV = "OPSD_DEBUG"
USER_ERROR_EXIT = 2


class UserError(Exception):
    """A mistake in the command or its inputs; the message names the problem and the fix."""


class InvalidValue(UserError, ValueError):
    """A config value, recipe line or data row that cannot be used."""


class MissingPath(UserError, FileNotFoundError):
    """A file or directory named by the user that does not exist or is not of the right kind."""


def raised_inside(err: BaseException, package: str) -> bool:
    """Whether `err` was raised from the code of `package` (a path part such as "/vllm/"): what turns a
    library's refusal of a model into one line, while every other error keeps its traceback."""
    return any(package in frame.filename for frame in traceback.extract_tb(err.__traceback__))


class UnsupportedModel(UserError, ValueError):
    """A model (or a model with the chosen engine) that opsd cannot train exactly; the message names the fix."""


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


_debug_run = False


def debug_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process runs under `--debug` (an entry point's `run_main`) or `OPSD_DEBUG=1`: code that keeps a
    library's own output back (a failed engine start's) shows it then."""
    return _debug_run or split_debug([], environ)[0]


def run_main(main: Callable[[list[str]], object], prog: str, argv: Sequence[str] | None = None) -> int:
    """Call `main(argv)`; a `UserError` becomes one line on stderr and exit status 2, anything else raises."""
    global _debug_run
    debug, rest = split_debug(sys.argv[1:] if argv is None else argv)
    _debug_run = debug
    try:
        main(rest)
    except UserError as err:
        return report(err, prog, debug=debug)
    return 0


def exit_now(status: int | None) -> NoReturn:
    """`sys.exit(status)` for an entry point whose work is done and written, without the interpreter's teardown.

    The exit handlers run as at any exit (logging's flush, a tracker such as wandb finishing its upload, vLLM's
    engine shutdown, multiprocessing's children), the standard streams are flushed, and the process ends. What
    is skipped is the interpreter freeing every module and object one by one, whose garbage collections walk
    all that torch, transformers, vLLM and sympy created: about 1.3 s after the imports alone and 8 s after a
    training run with a colocated engine, on the 2-core machine (docs/decisions.md, Structure). The objects
    are frozen out of the collector first, so the handlers' own collections (vLLM's shutdown runs one) skip
    them too. An exception or an interrupt never gets here: it ends the process the usual way.
    """
    import atexit
    import gc

    gc.freeze()
    atexit._run_exitfuncs()  # what the interpreter runs at exit; CPython has no public name for it
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(status or 0)


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance with adjacent transpositions counted as one edit."""
    prev2: list[int] | None = None
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        row = [i]
        for j, cb in enumerate(b, 1):
            cost = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ca != cb))
            if prev2 is not None and i > 1 and j > 1 and ca == b[j - 2] and a[i - 2] == cb:
                cost = min(cost, prev2[j - 2] + 1)
            row.append(cost)
        prev2, prev = prev, row
    return prev[-1]


def closest(word: str, candidates: Iterable[str], *, any_distance: bool = False) -> str | None:
    """The candidate nearest to `word` by edit distance (case-insensitive), if it is close enough to be a
    typo (at most a third of the word's length, at least 2 edits), or at any distance with `any_distance`."""
    lowered = word.lower()
    best = min(sorted(candidates), key=lambda c: edit_distance(lowered, c.lower()), default=None)
    if best is None or any_distance:
        return best
    return best if edit_distance(lowered, best.lower()) <= max(2, len(word) // 3) else None
