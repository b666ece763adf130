"""User errors: mistakes in a command or its inputs, reported in one line with exit status 2.

A `UserError` names the problem and the fix (bad config values, recipe lines, data files, missing paths).
The entry points (`opsd_train.py`, `train_capped.sh`, `eval_aime.py`) print it as one line without a
traceback (a recipe with several bad lines gets one line per problem) and exit with status 2. A bare
`--debug` flag or `OPSD_DEBUG=1` prints the traceback first. Every other exception is a bug and keeps its
traceback.

`exit_now` ends an entry point whose work is done without the interpreter's slow teardown.

`closest` finds the name a user probably meant (a typo of a field, key or flag) for the "did you mean" hints.

`shown` quotes a value a message echoes, cut at `SHOWN_CHARS` (200) characters: the one cut every message uses, so a
value of any length (a 100,000-character name) stays one short line; `short_message` applies the same cut to any
quoted value of a message that did not go through it, where the entry points print their refusals.

`stop_signals` makes SIGTERM and SIGHUP stop a command as Ctrl-C (SIGINT) does, each once: the first raises
KeyboardInterrupt, and the later ones are ignored while the command stops its jobs and says so in one line.

`printing` runs an entry point that prints: a closed stdout (its reader stopped reading, as `| head -1` does) is a
normal end, status 141 as a shell reports a command its reader stopped, with no traceback.

`InvalidValue` and `MissingPath` are also a `ValueError` and a `FileNotFoundError`, so code that catches
those still catches them.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import NoReturn

DEBUG_FLAG = "--debug"
DEBUG_ENV = "OPSD_DEBUG"
USER_ERROR_EXIT = 2
# The exit status of a command whose stdout was closed under it (128 + SIGPIPE): what a shell reports for a command
# killed by the signal, which Python ignores to raise BrokenPipeError instead.
PIPE_CLOSED_EXIT = 141
# Characters of a value a message echoes (a name, a path, a value read from a file): enough to tell it, short enough
# that the message stays one line of a terminal or two.
SHOWN_CHARS = 200


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


def cut(text: str, max_chars: int = SHOWN_CHARS) -> str:
    """`text` cut after `max_chars` characters with `...`: a library's message or a line of a file, quoted as it is."""
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def shown(value: object, max_chars: int = SHOWN_CHARS) -> str:
    """`value` as a message quotes it: a text (or a path) in quotes, any other value as its repr, cut after
    `max_chars` characters with `...` (inside the quotes for a text)."""
    if isinstance(value, str | os.PathLike):
        return repr(cut(os.fspath(value), max_chars))
    return cut(repr(value), max_chars)


# A quoted value longer than `shown` leaves one: 'x...' or "x..." with backslash escapes inside.
# A quote is one when no letter or digit touches it from outside: the apostrophe of "vLLM's" opens or closes nothing.
_LONG_QUOTED = re.compile(
    "|".join(rf"(?<!\w){q}(?:[^{q}\\\n]|\\.){{{SHOWN_CHARS + 4},}}{q}(?!\w)" for q in ("'", '"'))
)


def short_message(message: object) -> str:
    """`message` with every quoted value longer than `shown` leaves one cut as `shown` cuts it: the printers' guard
    for a refusal that echoes a value without `shown`."""

    def cut_quoted(match: re.Match) -> str:
        quote, inner = match[0][0], match[0][1:-1]
        return f"{quote}{inner[:SHOWN_CHARS]}...{quote} ({len(inner):,} characters)"

    lines = _LONG_QUOTED.sub(cut_quoted, str(message)).split("\n")
    return "\n".join(_short_line(line) for line in lines)


# A line of a message longer than this (an unquoted value echoed whole, such as argparse's "unrecognized arguments:
# ...") keeps its start and its end, where the fix is.
MAX_LINE_CHARS = 2000


def _short_line(line: str) -> str:
    if len(line) <= MAX_LINE_CHARS:
        return line
    head, tail = line[: MAX_LINE_CHARS // 4], line[-MAX_LINE_CHARS // 4 :]
    return f"{head}... ({len(line) - len(head) - len(tail):,} characters cut) ...{tail}"


def report(err: BaseException, prog: str, *, debug: bool) -> int:
    """Print a user error (its traceback first under debug) and return the exit status for it."""
    if debug:
        traceback.print_exception(err)
    print(f"{prog}: error: {short_message(err)}", file=sys.stderr)
    return USER_ERROR_EXIT


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a test's StringIO), no poll
        return False


def printing(call: Callable[[], int | None]) -> int:
    """`call()`'s exit status (None: 0) with its output flushed; a BrokenPipeError of a closed stdout (its reader
    stopped reading, as `| head -1` does) is a normal end: stdout goes to /dev/null, so that nothing written later
    (the interpreter's last flush included) raises again, and the status is `PIPE_CLOSED_EXIT`. What the command
    wrote to files before it printed stays written; a broken pipe of anything else is a bug and raises."""
    try:
        try:
            status = call()
        except SystemExit:  # argparse's --help and usage errors: what they printed is flushed here too
            sys.stdout.flush()
            raise
        sys.stdout.flush()
    except BrokenPipeError:
        if not stdout_dropped():
            raise
        return PIPE_CLOSED_EXIT
    return status or 0


def stdout_dropped() -> bool:
    """After a BrokenPipeError: whether it was stdout's, its reader gone; if so stdout now writes to /dev/null (what
    is still buffered and whatever is printed later go nowhere, without raising)."""
    if not _stdout_closed():
        return False
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return True


_debug_run = False


def debug_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process runs under `--debug` (an entry point's `run_main`) or `OPSD_DEBUG=1`: code that keeps a
    library's own output back (a failed engine start's) shows it then."""
    return _debug_run or split_debug([], environ)[0]


def run_main(main: Callable[[list[str]], object], prog: str, argv: Sequence[str] | None = None) -> int:
    """Call `main(argv)`; a `UserError` becomes one line on stderr and exit status 2, a closed stdout status 141
    (`printing`), anything else raises."""
    global _debug_run
    debug, rest = split_debug(sys.argv[1:] if argv is None else argv)
    _debug_run = debug

    def call() -> int:
        try:
            main(rest)
        except UserError as err:
            return report(err, prog, debug=debug)
        return 0

    return printing(call)


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


# Signals that stop a command as Ctrl-C does: SIGINT (Ctrl-C), SIGTERM (a scheduler, `kill`, `timeout`) and SIGHUP (the
# terminal or SSH session closed).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_stops = 0  # stop signals taken by this process


def _stop(signum, frame) -> None:
    """The first stop signal: KeyboardInterrupt, as Ctrl-C. The later ones are ignored from here on: `timeout` sends
    its signal to the command and then to the command's group, a terminal's Ctrl-C reaches every process of the
    group, and one landing while the command stops its jobs (or after it has restored the default handlers, as the
    interpreter exits) would add a second message, a traceback or a "Terminated" line to the one it prints."""
    global _stops
    _stops += 1
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextlib.contextmanager
def stop_signals(*, restore_after_stop: bool = True) -> Iterator[None]:
    """Within the block every stop signal raises KeyboardInterrupt, once (`_stop`). A signal this process was told to
    ignore (SIGHUP under nohup, SIGINT of a job started in the background) stays ignored. On leaving, the previous
    handlers come back, unless a stop came and not `restore_after_stop`: a process ending on its stop keeps ignoring
    the later ones; an enclosing block or a caller in the same process (a test) restores them."""
    stops = _stops
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _stop)
    try:
        yield
    finally:
        if _stops == stops or restore_after_stop:
            for sig, handler in previous.items():
                if handler is not None:  # None: a handler not set from Python, which cannot be set back
                    signal.signal(sig, handler)


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
