"""Paths the user names, checked before anything reads or writes them: files with a size cap per kind,
directories to read and directories to write into. Every problem is one `UserError` line naming the path,
what is wrong and the fix.

Files (`check_file`, `read_bytes`, `read_text`). Symlinks are followed first, so a link is judged by what it
points at. The path must exist and be a regular file: a directory, a character or block device (`/dev/zero`,
`/dev/urandom`), a FIFO or a socket is refused, since reading one never ends or blocks. Its size must be at
most the cap of its kind (`FileKind`):

    prompt template files, recipe files, YAML configs (--config, --accelerate-config),
    DeepSpeed configs (--deepspeed)                                                      1 MiB
    dataset files (.json/.jsonl/.csv/.parquet, training and evaluation)                20 GiB

The small kinds are written by hand and are a few kB; a file a thousand times bigger is a wrong path. Data
files are big for real, so their cap only bounds what a wrong path can cost (the JSON/JSONL check reads a
file whole): 20 GiB is far above a table of tens of thousands of problems with reasoning traces, and a
bigger table still loads when split into several files of one directory (each file is checked on its own). `read_bytes` also stops
reading one byte past the cap, so a file that grows after the check (or a `/proc` file, which reports
size 0) cannot make a read unbounded either.

Directories. `check_output_dir`: a directory a command writes into (`--output_dir`, `--out`,
`--runs-dir`) must be a directory, or not exist yet with a writable directory as its nearest existing
ancestor (it is created later). Writable means that an entry could be created there: a probe directory is
made and removed at once, because mode bits do not tell (root passes them on `/sys` or `/proc`, whose first
`mkdir` fails). `check_input_dir`: a directory a command reads (`--adapter`, `--compare`, `--aggregate`,
`--plot-steps`) must exist and be a directory.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from opsd.errors import SHOWN_CHARS, InvalidValue, MissingPath, cut, shown  # noqa: F401 (shown: paths quoted)

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
SHOWN_PATH_CHARS = SHOWN_CHARS  # a path in a message is cut as every echoed value is (opsd.errors.shown)


@dataclass(frozen=True)
class FileKind:
    """A kind of file the user names: what messages call one, its size cap (None: no cap) and the fixes."""

    name: str  # "prompt template file"
    plural: str  # "prompt template files", as in "... are limited to 1 MiB"
    max_bytes: int | None
    fix: str  # what to pass instead of a missing or unusable path
    too_big_fix: str  # what to do about a file over the cap


PROMPT_FILE = FileKind(
    "prompt template file", "prompt template files", 1 * MIB,
    "pass an existing, readable UTF-8 text file", "pass the template file itself (a template is a few kB)",
)  # fmt: skip
RECIPE_FILE = FileKind(
    "recipe file", "recipe files", 1 * MIB,
    "pass a text file of KEY=VALUE lines (such as recipe.env)",
    "check the path (a recipe is a few dozen lines)",
)  # fmt: skip
YAML_CONFIG = FileKind(
    "YAML config", "YAML configs", 1 * MIB,
    "pass a YAML file of settings (--config config.yaml)", "check the path (a config is a few kB)",
)  # fmt: skip
ACCELERATE_CONFIG = FileKind(
    "accelerate config", "accelerate configs", 1 * MIB,
    "pass an accelerate YAML config with --accelerate-config (configs/accelerate/ has examples)",
    "check the path (an accelerate config is a few dozen lines)",
)  # fmt: skip
DEEPSPEED_CONFIG = FileKind(
    "DeepSpeed config", "DeepSpeed configs", 1 * MIB,
    "pass a DeepSpeed JSON config (--deepspeed ds_config.json)",
    "check the path (a DeepSpeed config is a few kB)",
)  # fmt: skip
DATA_FILE = FileKind(
    "dataset file", "dataset files", 20 * GIB,
    "pass a .json, .jsonl, .csv or .parquet file, a directory of them, or a hub dataset name",
    "split it into several files in one directory (each file is checked on its own)",
)  # fmt: skip


def parse_json(text: str | bytes) -> object:
    """`json.loads`, with each way a damaged file fails it as a ValueError: not JSON (JSONDecodeError), a
    number of thousands of digits (ValueError), arrays nested past the parser's depth (RecursionError)."""
    import json

    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def json_error(err: ValueError) -> str:
    """Why `parse_json` failed, in a few words."""
    return getattr(err, "msg", None) or cut(str(err), 120)


def size_text(n: int) -> str:
    """`3.1 GiB`, `1 MiB`, `512 bytes`: a size in the largest binary unit it reaches."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= scale:
            value = f"{n / scale:.1f}".removesuffix(".0")
            return f"{value} {unit}"
    return f"{n} bytes"


def file_type(mode: int) -> str:
    """What a stat mode is, in words (`a directory`, `a character device`, ...)."""
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _named(p: Path) -> str:
    """The path as shown, with the file a symlink resolves to when that is another path."""
    try:
        real = Path(os.path.realpath(p))
    except (OSError, ValueError):
        return shown(p)
    return shown(p) if real == Path(os.path.abspath(p)) else f"{shown(p)} (a link to {shown(real)})"


def _target(p: Path) -> str:
    """Where a symlink points, fully resolved, as shown in messages."""
    return shown(os.path.realpath(p))


def _unusable(p: Path, kind: FileKind, err: OSError) -> MissingPath:
    if isinstance(err, FileNotFoundError):
        if os.path.islink(p):
            return MissingPath(
                f"{kind.name} {shown(p)} is a link to {_target(p)}, which does not exist; {kind.fix}"
            )
        return MissingPath(f"{kind.name} {shown(p)} does not exist; {kind.fix}")
    # A path too long for the system, a file where a directory should be, no permission, a link loop, ...
    why = err.strerror or type(err).__name__
    return MissingPath(f"{kind.name} {shown(p)} cannot be read ({why}); {kind.fix}")


def _check_stat(p: Path, st: os.stat_result, kind: FileKind) -> None:
    if not stat.S_ISREG(st.st_mode):
        what = file_type(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            raise MissingPath(f"{kind.name} {_named(p)} is a directory, not a file; {kind.fix}")
        raise MissingPath(f"{kind.name} {_named(p)} is {what}, not a regular file; {kind.fix}")
    if kind.max_bytes is not None and st.st_size > kind.max_bytes:
        raise InvalidValue(
            f"{kind.name} {_named(p)} is {size_text(st.st_size)} ({st.st_size:,} bytes); {kind.plural} are "
            f"limited to {size_text(kind.max_bytes)}; {kind.too_big_fix}"
        )


def check_file(path: str | Path, kind: FileKind) -> Path:
    """`path` (with `~` expanded) once it is an existing regular file within the cap of `kind`; otherwise a
    `MissingPath` (missing, unreadable, not a regular file) or `InvalidValue` (over the cap)."""
    p = Path(path).expanduser()
    try:
        st = os.stat(p)  # follows symlinks: a link to /dev/urandom is a character device
    except OSError as err:
        raise _unusable(p, kind, err) from None
    except ValueError as err:  # an embedded NUL byte
        raise MissingPath(f"{kind.name} {shown(p)} cannot be used ({err}); {kind.fix}") from None
    _check_stat(p, st, kind)
    return p


def read_bytes(path: str | Path, kind: FileKind) -> bytes:
    """The contents of a file the user named, after `check_file`; never more than the cap plus one byte."""
    p = check_file(path, kind)
    try:
        # Non-blocking, so a path swapped for a FIFO after the check cannot hang the open; judged again on
        # the open file, and read to one byte past the cap at most.
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            _check_stat(p, os.fstat(f.fileno()), kind)
            data = f.read() if kind.max_bytes is None else f.read(kind.max_bytes + 1)
    except OSError as err:
        raise _unusable(p, kind, err) from None
    if kind.max_bytes is not None and len(data) > kind.max_bytes:
        raise InvalidValue(
            f"{kind.name} {_named(p)} holds more than {size_text(kind.max_bytes)}; {kind.plural} are limited to "
            f"{size_text(kind.max_bytes)}; {kind.too_big_fix}"
        )
    return data


def read_text(path: str | Path, kind: FileKind) -> str:
    """`read_bytes` decoded as UTF-8; text that is not UTF-8 is an `InvalidValue` naming the byte."""
    data = read_bytes(path, kind)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidValue(
            f"{kind.name} {shown(Path(path).expanduser())} is not UTF-8 text ({err.reason} at byte "
            f"{err.start}); save it as UTF-8"
        ) from None


def _nearest_existing(p: Path) -> tuple[Path, os.stat_result | None]:
    """The nearest ancestor of `p` (itself included) that exists, with its stat (None if none does)."""
    for candidate in (p, *p.parents):
        try:
            return candidate, os.stat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            continue
    return p, None


PROBE_PREFIX = ".opsd-probe-"


def cannot_create_in(directory: str | Path) -> str | None:
    """Why nothing can be created in `directory` (the system's words), or None once a probe entry was created
    there and removed again."""
    try:
        probe = tempfile.mkdtemp(prefix=PROBE_PREFIX, dir=directory)
    except OSError as err:
        return err.strerror or type(err).__name__
    try:
        os.rmdir(probe)
    except OSError as err:  # made but not removable: writing there would not work as planned either
        return f"a probe entry {shown(probe)} could not be removed ({err.strerror or type(err).__name__})"
    return None


def check_output_dir(path: str | Path, what: str) -> Path:
    """`path` (with `~` expanded) once a command can write into it: an existing writable directory, or a
    path whose nearest existing ancestor is a writable directory (the command creates the rest). `what`
    names the argument (`--out`). Raises `MissingPath`."""
    p = Path(path).expanduser()
    fix = "pass a directory (it is created if missing)"
    try:
        st = os.stat(p)
    except ValueError as err:
        raise MissingPath(f"{what} {shown(p)} cannot be used ({err}); {fix}") from None
    except (FileNotFoundError, NotADirectoryError):
        if os.path.islink(p):
            raise MissingPath(
                f"{what} {shown(p)} is a link to {_target(p)}, which does not exist; {fix}"
            ) from None
        ancestor, anc_st = _nearest_existing(p.absolute())
        if anc_st is not None and not stat.S_ISDIR(anc_st.st_mode):
            raise MissingPath(
                f"{what} {shown(p)} cannot be created: {_named(ancestor)} is {file_type(anc_st.st_mode)}, not "
                "a directory; pass a path under a directory"
            ) from None
        why = cannot_create_in(ancestor) if anc_st is not None else None
        if why:
            raise MissingPath(
                f"{what} {shown(p)} cannot be created: {shown(ancestor)} is not writable ({why}); pass a "
                "directory you can write to"
            ) from None
        return p
    except OSError as err:  # a path too long for the system, a link loop, no permission
        raise MissingPath(f"{what} {shown(p)} cannot be used ({err.strerror}); {fix}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MissingPath(
            f"{what} {_named(p)} is {file_type(st.st_mode)}, not a directory; {fix}, or move the file away"
        )
    why = cannot_create_in(p)
    if why:
        raise MissingPath(f"{what} {shown(p)} is not writable ({why}); pass a directory you can write to")
    return p


def check_input_dir(path: str | Path, what: str, fix: str) -> Path:
    """`path` (with `~` expanded) once it is an existing directory; otherwise a `MissingPath` naming `what`
    (`adapter directory`), the problem and `fix`."""
    p = Path(path).expanduser()
    try:
        st = os.stat(p)
    except FileNotFoundError:
        if os.path.islink(p):
            raise MissingPath(
                f"{what} {shown(p)} is a link to {_target(p)}, which does not exist; {fix}"
            ) from None
        raise MissingPath(f"{what} {shown(p)} does not exist; {fix}") from None
    except (OSError, ValueError) as err:
        why = getattr(err, "strerror", None) or str(err)
        raise MissingPath(f"{what} {shown(p)} cannot be read ({why}); {fix}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise MissingPath(f"{what} {_named(p)} is {file_type(st.st_mode)}, not a directory; {fix}")
    return p


def staged_write(path: Path, data: bytes) -> Path:
    """`data` in a new temporary file beside `path` (the same directory, so that `os.replace` onto `path` is
    atomic), made with the mode a plain write would give it; its path. Nothing is left when writing fails."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` by `data` whole: a reader, or a run stopped mid-write, sees the old file or the new one,
    never part of one."""
    tmp = staged_write(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
