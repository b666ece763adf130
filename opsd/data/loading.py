"""Training and evaluation data: loading, column checks, the docs/method.md §2 filters.

Training rows follow `siyanzhao/Openthoughts_math_30k_opsd`: `problem`, `solution`, `Answer`,
`COT_Reason`, `generated_token_count`. Evaluation rows follow `HuggingFaceH4/aime_2024`: `problem`,
`answer` (an `id` is used when present). Both load from a hub name, a local .json/.jsonl/.csv/.parquet
file, or a local directory of such files in one format (as `datasets.load_dataset(dir)` reads it: files
named after splits, such as `train.jsonl` and `test.jsonl`, are those splits; other names are `train`).
Local data is checked before any model loads, each problem naming the file (and line or row) and the fix:
paths that are not regular files (a device, a FIFO) or are over 20 GiB (`opsd.paths`), empty files,
a JSON or CSV line over 16 MiB (`MAX_ROW_BYTES`, found while streaming the file), malformed JSON lines, and rows whose `problem`, reference (`solution` or `COT_Reason`, the one the teacher
reads) or `answer` is missing, not text, or empty. An empty reference is refused rather than turned into an
empty teacher context.
The built-in sets (`opsd.data.builtin`) are chosen by name; an empty name is `builtin`, an unknown
`builtin:<x>` is an error that lists the names.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opsd.configuration.checks import check_choice
from opsd.configuration.switches import CHOICES, REFERENCE_COLUMNS
from opsd.data.builtin import BUILTIN, BUILTIN_SETS
from opsd.errors import InvalidValue, MissingPath
from opsd.paths import DATA_FILE, MIB, check_file, read_bytes, size_text

if TYPE_CHECKING:  # `datasets` is imported where tables are built, so the generators need only the stdlib
    from datasets import Dataset

logger = logging.getLogger(__name__)

TRAIN_COLUMNS = ("problem", "solution", "Answer", "COT_Reason", "generated_token_count")
EVAL_COLUMNS = ("problem", "answer")
HARD_MIN_TOKENS = 2000

_NUMERIC_ANSWER = re.compile(r"-?\d{1,6}")
_LOCAL_SUFFIXES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
_FORMATS = ".json, .jsonl, .csv or .parquet"
MAX_ROWS_NAMED = 5
# One row (a JSON line, a CSV line): a problem with a long reasoning trace is ~100 KiB; a line 100 times longer
# is a file that is not one row per line, refused while streaming rather than after datasets has parsed it.
MAX_ROW_BYTES = 16 * MIB


class DataError(InvalidValue):
    """A data file or table that cannot be trained or evaluated on; the message names where and the fix."""


def _lines(path: Path):
    """(line number, bytes without the line end) of a file, streamed; a line longer than MAX_ROW_BYTES is a
    DataError as soon as its first MAX_ROW_BYTES + 1 bytes are read, before the rest is."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(iter(lambda: f.readline(MAX_ROW_BYTES + 1), b""), start=1):
            line = raw.removesuffix(b"\n").removesuffix(b"\r")
            if len(line) > MAX_ROW_BYTES:
                raise DataError(
                    f"dataset file {str(path)!r}: line {lineno} is longer than {size_text(MAX_ROW_BYTES)}, the "
                    "limit of one row; check the file (one row per line), or shorten that row"
                )
            yield lineno, line


def _check_json_file(path: Path) -> None:
    """Refuse an empty, blank or malformed JSON/JSONL file with its name and line (datasets would raise a bare
    StopIteration or a parser error far from the cause). JSON lines are read one at a time, each at most
    MAX_ROW_BYTES; a file holding one JSON document (a list of rows) is parsed whole, as datasets reads it."""
    seen = False
    for lineno, raw in _lines(path):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise DataError(
                f"dataset file {str(path)!r}: line {lineno} is not UTF-8 text ({err.reason}); save it as UTF-8"
            ) from err
        if not line.strip():
            continue
        if not seen and line.lstrip().startswith("["):  # one JSON document: a list of rows
            _check_json_document(path)
            return
        seen = True
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(
                f"dataset file {str(path)!r}: line {lineno} is not valid JSON ({err.msg}, column {err.colno}); "
                "write one JSON object per line"
            ) from err
        if not isinstance(row, dict) and path.suffix.lower() == ".jsonl":
            raise DataError(
                f"dataset file {str(path)!r}: line {lineno} is a JSON {type(row).__name__}, not an object; "
                'write one object per line, such as {"problem": ..., "answer": ...}'
            )
    if not seen:
        raise DataError(f"dataset file {str(path)!r} holds only blank lines; give it one JSON object per row")


def _check_json_document(path: Path) -> None:
    try:
        text = read_bytes(path, DATA_FILE).decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"dataset file {str(path)!r} is not UTF-8 text ({err}); save it as UTF-8") from err
    try:
        json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(
            f"dataset file {str(path)!r}: invalid JSON at line {err.lineno}, column {err.colno} "
            f"({err.msg}); fix that line"
        ) from err


def _check_local_file(path: Path) -> None:
    # A regular file within DATA_FILE's cap (opsd.paths): a link to /dev/urandom or a FIFO named x.jsonl is
    # refused as what it is, not read without end.
    check_file(path, DATA_FILE)
    if path.stat().st_size == 0:
        raise DataError(f"dataset file {str(path)!r} is empty; give it a header and rows")
    if _LOCAL_SUFFIXES[path.suffix.lower()] == "json":
        _check_json_file(path)
    elif _LOCAL_SUFFIXES[path.suffix.lower()] == "csv":
        for _ in _lines(path):  # a row over the cap is refused before datasets holds it
            pass


def _cause(err: BaseException) -> str:
    """The innermost cause of a loading error on one line, cut to a readable length."""
    while err.__cause__ is not None or err.__context__ is not None:
        err = err.__cause__ or err.__context__
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 300 else text[:300] + "..."


def _read_local(source: str, fmt: str, path: str, **kw) -> Dataset:
    """`datasets.load_dataset(fmt, **kw)`, with a file datasets cannot parse (a CSV with an unclosed quote or a
    ragged row, a Parquet file that is not Parquet, JSON whose rows disagree in type) refused as a DataError
    naming it and the parser's own reason; datasets' own error log is silenced (the DataError says it)."""
    import datasets
    from datasets.exceptions import DatasetGenerationError

    quiet = logging.getLogger("datasets")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        return datasets.load_dataset(path, **kw)
    except (DatasetGenerationError, ArithmeticError, TypeError, KeyError) as err:
        raise DataError(f"{source} cannot be read as {fmt}: {_cause(err)}; fix the file") from err
    except ValueError as err:
        if "split" in str(err).lower():
            raise
        raise DataError(f"{source} cannot be read as {fmt}: {_cause(err)}; fix the file") from err
    except Exception as err:  # pyarrow errors that are not ValueErrors, such as ArrowIOError
        if type(err).__module__.startswith(("pyarrow", "pandas", "datasets")):
            raise DataError(f"{source} cannot be read as {fmt}: {_cause(err)}; fix the file") from err
        raise
    finally:
        quiet.setLevel(level)


def _load_local(path: Path, split: str) -> tuple[Dataset, str]:
    """A local file or directory as a table, with the name used in messages about it."""

    if path.is_dir():
        # Every data-named entry but directories, so that a FIFO or a device among them is refused rather
        # than skipped here and read by datasets.
        files = sorted(f for f in path.rglob("*") if not f.is_dir() and f.suffix.lower() in _LOCAL_SUFFIXES)
        if not files:
            raise MissingPath(
                f"dataset directory {str(path)!r} holds no {_FORMATS} files; put the data files in it "
                "or pass a file"
            )
        formats = sorted({_LOCAL_SUFFIXES[f.suffix.lower()] for f in files})
        if len(formats) > 1:
            # datasets would silently read only the most common format.
            raise DataError(
                f"dataset directory {str(path)!r} mixes {' and '.join(formats)} files; keep one format"
            )
        for f in files:
            _check_local_file(f)
        source = f"directory {str(path)!r} (split {split!r})"
        hint = "Name a split that exists (--dataset_split), or name files after splits"
        with _no_such_split(lambda err: f"{source}: {err} {hint}"):
            return _read_local(source, formats[0], str(path), split=split), source
    check_file(path, DATA_FILE)  # what the path is comes first: /dev/zero is a device, not a misnamed file
    if path.suffix.lower() not in _LOCAL_SUFFIXES:
        raise DataError(f"dataset file {str(path)!r} must end in {_FORMATS}")
    _check_local_file(path)
    fmt = _LOCAL_SUFFIXES[path.suffix.lower()]
    source = f"dataset file {str(path)!r}"
    return _read_local(source, fmt, fmt, data_files=str(path), split="train"), f"file {str(path)!r}"


@contextmanager
def _no_such_split(message: Callable[[ValueError], str]) -> Iterator[None]:
    """datasets' ValueError about a split that does not exist, as a DataError saying `message(err)`; other
    ValueErrors pass."""
    try:
        yield
    except ValueError as err:
        if "split" not in str(err).lower():
            raise
        raise DataError(message(err)) from err


def _load_hub(name: str, split: str) -> Dataset:
    """A hub dataset's split; one that cannot be reached offline, does not exist, or lacks the split is a
    DataError naming HF_HUB_OFFLINE, the cache and the local alternatives."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    offline = datasets.config.HF_HUB_OFFLINE
    hint = "name one it has with --dataset_split"
    try:
        with _no_such_split(lambda err: f"dataset {name!r} has no split {split!r} ({_cause(err)}); {hint}"):
            return datasets.load_dataset(name, split=split)
    except (ConnectionError, DatasetNotFoundError, FileNotFoundError) as err:
        reach = (
            "HF_HUB_OFFLINE=1 forbids downloading it"
            if offline
            else "the Hub cannot be reached or has no such dataset"
        )
        raise DataError(
            f"dataset {name!r} is not a local file or directory and is not in the datasets cache "
            f"({datasets.config.HF_DATASETS_CACHE}), and {reach} ({_cause(err)}); load it once where the Hub "
            "is reachable (unset HF_HUB_OFFLINE), or pass a local .json/.jsonl/.csv/.parquet file or directory"
        ) from err


def check_text_column(ds: Dataset, column: str, source: str, *, numbers: bool = False) -> None:
    """Refuse rows whose `column` is missing, not text (numbers too if `numbers`) or blank, naming them."""
    bad = []
    for i, value in enumerate(ds[column]):
        number = numbers and isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number and not (isinstance(value, str) and value.strip()):
            bad.append((i, value))
    if bad:
        kind = "text or a number" if numbers else "text"
        named = ", ".join(f"row {i + 1} has {v!r}"[:80] for i, v in bad[:MAX_ROWS_NAMED])
        more = f" and {len(bad) - MAX_ROWS_NAMED} more" if len(bad) > MAX_ROWS_NAMED else ""
        raise DataError(
            f"{source}: column {column!r} must be non-empty {kind} in every row (rows count from 1): "
            f"{named}{more}; fill in or drop those rows"
        )


def load_table(name_or_path: str, *, split: str = "train", required: tuple[str, ...]) -> Dataset:
    """Load a hub dataset, a local .json/.jsonl/.csv/.parquet file or a directory of them, and check that
    `required` columns exist and that there are rows."""
    path = Path(name_or_path).expanduser()
    if path.suffix.lower() in _LOCAL_SUFFIXES or path.exists():
        if not path.exists():
            raise MissingPath(
                f"dataset file {str(path)!r} does not exist; pass an existing {_FORMATS} file, a directory "
                "of them, or a hub dataset name"
            )
        ds, source = _load_local(path, split)
    else:
        ds = _load_hub(name_or_path, split)
        source = f"dataset {name_or_path!r} (split {split!r})"
    missing = [c for c in required if c not in ds.column_names]
    if missing:
        raise DataError(
            f"{source} lacks column(s) {missing}; it has {ds.column_names}. "
            f"Rename the columns or provide a table with {list(required)}."
        )
    if len(ds) == 0:
        raise DataError(f"{source} has no rows; add rows or pass other data")
    return ds


def is_local(name_or_path: str) -> bool:
    """Whether `name_or_path` names built-in data or a local file or directory (not a hub dataset)."""
    path = Path(name_or_path).expanduser()
    return _builtin_set(name_or_path) is not None or path.suffix.lower() in _LOCAL_SUFFIXES or path.exists()


def is_numeric_answer(answer: Any) -> bool:
    """True when `answer` is an integer of at most six digits with an optional minus sign."""
    return bool(_NUMERIC_ANSWER.fullmatch(str(answer).strip()))


def filter_rows(ds: Dataset, data_filter: str) -> Dataset:
    """Apply a docs/method.md §2 data filter and log the row counts before and after."""
    filters = CHOICES["data_filter"]
    if data_filter not in filters:
        raise ValueError(f"data_filter={data_filter!r}; choose one of {filters}")
    before = len(ds)
    if data_filter == "numeric":
        ds = ds.filter(lambda r: is_numeric_answer(r["Answer"]))
    elif data_filter == "hard_numeric":
        ds = ds.filter(
            lambda r: (
                is_numeric_answer(r["Answer"]) and int(r["generated_token_count"] or 0) >= HARD_MIN_TOKENS
            )
        )
    logger.info("data filter %s: %d -> %d rows", data_filter, before, len(ds))
    if len(ds) == 0:
        raise DataError(f"data_filter={data_filter!r} removed every row; use a weaker filter or other data")
    return ds


def _builtin_set(name: str):
    """(training-rows function, evaluation-rows function) of a built-in set, or None for other names."""
    if name == "":
        name = BUILTIN
    if name in BUILTIN_SETS:
        return BUILTIN_SETS[name]
    if name.startswith(BUILTIN + ":"):
        raise DataError(f"unknown built-in dataset {name!r}; the built-in sets are {list(BUILTIN_SETS)}")
    return None


def load_train_dataset(
    name_or_path: str, *, split: str = "train", data_filter: str = "none", seed: int = 0,
    teacher_ref: str = "solution",
) -> Dataset:  # fmt: skip
    """The training set: a built-in set by name (`BUILTIN_SETS`; empty = `builtin`), else a hub
    name, a file or a directory. `problem` and the reference column of `teacher_ref` must be non-empty text."""
    builtin = _builtin_set(name_or_path)
    if builtin is not None:
        from datasets import Dataset

        ds = Dataset.from_list(builtin[0](seed=seed))
    else:
        ds = load_table(name_or_path, split=split, required=TRAIN_COLUMNS)
        check_choice("teacher_ref", teacher_ref)
        for column in ("problem", REFERENCE_COLUMNS[teacher_ref]):
            # An answer-only reference may be a number (a JSON or CSV column of integers).
            check_text_column(ds, column, f"dataset {name_or_path!r}", numbers=column == "Answer")
    return filter_rows(ds, data_filter)


def load_eval_dataset(name_or_path: str, *, split: str = "train") -> list[dict[str, str]]:
    """Evaluation problems as dicts with `id`, `problem`, `answer` (strings)."""
    builtin = _builtin_set(name_or_path)
    if builtin is not None:
        return builtin[1]()
    ds = load_table(name_or_path, split=split, required=EVAL_COLUMNS)
    check_text_column(ds, "problem", f"dataset {name_or_path!r}")
    check_text_column(ds, "answer", f"dataset {name_or_path!r}", numbers=True)
    ids = ds["id"] if "id" in ds.column_names else list(range(len(ds)))
    return [
        {"id": str(i), "problem": str(p), "answer": str(a)}
        for i, p, a in zip(ids, ds["problem"], ds["answer"], strict=True)
    ]
