r"""The benchmarks `--benchmarks NAME,...` scores: one table of public datasets, each pinned to a revision, with its
columns, answer kind and preset protocol; loading them through `datasets` (and its cache) or from a local copy.

| name | dataset | problems | answers |
|---|---|---|---|
| aime24 | HuggingFaceH4/aime_2024 | 30 | integers 0-999 (zero-padded text: ``"025"``) |
| aime25 | MathArena/aime_2025 | 30 | integers 0-999 |
| hmmt25 | MathArena/hmmt_feb_2025 | 30 | LaTeX expressions (``\frac{9\sqrt{23}}{23}``, ``2^{25} \cdot 26!``) |
| aime26 | MathArena/aime_2026 | 30 | integers 0-999 |
| hmmt26 | MathArena/hmmt_feb_2026 | 33 | LaTeX expressions |
| math500 | HuggingFaceH4/MATH-500 | 500 | LaTeX: numbers, fractions, radicals, intervals, tuples, text, units |
| amc23 | zwhe99/amc23 | 40 | numbers (stored as floats: ``27.0``) |

`BENCHMARKS` holds each one's exact revision (a commit sha: docs/evaluation.md says where each was read), its split
and its columns; every answer is graded by `opsd.grading` (math-verify, then the normalised string fallback), so
an expression answer counts when it equals the gold one in value: ``\frac{1}{\sqrt 2}`` for ``\frac{\sqrt2}{2}``.

Protocol. Each benchmark has a preset (`Protocol`: samples per problem n, new-token cap, thinking on or off).
The AIME-style sets (AIME, HMMT, AMC) take eval_aime.py's AIME 2024 protocol (n = 12, 38,912 new tokens,
thinking on); MATH-500, 500 problems, takes n = 4 at the same length and thinking. A flag given on the command
line (`--n`, `--max-tokens`, `--thinking` / `--no-thinking` or training's names for it) sets that setting for
every benchmark instead (`benchmark_config`).

Data. A benchmark is read with `datasets.load_dataset(id, revision=REV, split=...)`, through its cache
(``HF_DATASETS_CACHE``); the commit it loaded is recorded beside the pinned revision. Offline without the cached
copy, or when the Hub has no such dataset, the run is refused in one line before any engine starts, naming the
dataset and the two ways to give it: a local copy (``--dataset NAME=FILE``, a .json/.jsonl/.csv/.parquet file
with the benchmark's own column names) or a datasets cache that holds it.

Local copies, checked against the table. A copy must hold the benchmark's id column (aime25's ``problem_idx``,
MATH-500's ``unique_id``): without it its problems would be numbered by row and paired with other problems of a
Hub run, so it is refused. A copy (or a Hub table) of another row count than the table's is scored, with one
warning line, logged and recorded in summary.json (``data_warnings``) and in the benchmark table's row. Two
evaluations of a benchmark are paired (--compare) only over one problem set: different sets are refused
(`check_same_problems`), not compared over their common problems.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opsd.errors import UserError, shown

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Protocol:
    """How a benchmark is sampled by default: n samples per problem, the new-token cap, the thinking switch."""

    n: int
    max_tokens: int
    thinking: bool


# eval_aime.py's AIME 2024 protocol (docs/method.md §4): the default of every AIME-style set.
AIME_PROTOCOL = Protocol(n=12, max_tokens=38912, thinking=True)
# 500 problems: the SE of avg@4 over them is at most 0.5 / sqrt(500) = 2.2 points.
MATH500_PROTOCOL = Protocol(n=4, max_tokens=38912, thinking=True)


@dataclass(frozen=True)
class Benchmark:
    """One row of the benchmark table: where the problems are, in which columns, and how they are scored."""

    name: str
    title: str
    dataset: str  # Hub dataset id
    revision: str  # the commit read (40 hex digits)
    split: str
    problem_column: str
    answer_column: str
    id_column: str | None  # None: the row index is the problem id
    size: int  # problems at that revision
    answer_kind: str
    protocol: Protocol


BENCHMARKS: dict[str, Benchmark] = {
    b.name: b
    for b in (
        Benchmark("aime24", "AIME 2024", "HuggingFaceH4/aime_2024", "2fe88a2f1091d5048c0f36abc874fb997b3dd99a",
                  "train", "problem", "answer", "id", 30, "integer 0-999", AIME_PROTOCOL),
        Benchmark("aime25", "AIME 2025", "MathArena/aime_2025", "c94da77eb22bbd6439e62a323bec18493a421302",
                  "train", "problem", "answer", "problem_idx", 30, "integer 0-999", AIME_PROTOCOL),
        Benchmark("hmmt25", "HMMT February 2025", "MathArena/hmmt_feb_2025",
                  "6fdc4277120810ff75aa22d2d5489b91f7a262a1", "train", "problem", "answer", "problem_idx", 30,
                  "expression", AIME_PROTOCOL),
        Benchmark("aime26", "AIME 2026", "MathArena/aime_2026", "d2de22f3c656b4f56cf8981212186377d1e23bc3",
                  "train", "problem", "answer", "problem_idx", 30, "integer 0-999", AIME_PROTOCOL),
        Benchmark("hmmt26", "HMMT February 2026", "MathArena/hmmt_feb_2026",
                  "02fba4f74d8e68e73e66a02d540fd979c05c274c", "train", "problem", "answer", "problem_idx", 33,
                  "expression", AIME_PROTOCOL),
        Benchmark("math500", "MATH-500", "HuggingFaceH4/MATH-500", "ff5b20257d8185524591543f8ff5993951537bb8",
                  "test", "problem", "answer", "unique_id", 500, "expression", MATH500_PROTOCOL),
        Benchmark("amc23", "AMC 2023", "zwhe99/amc23", "f9810c0439cd3c670ec885d328a2f06a87f3694a", "test",
                  "question", "answer", "id", 40, "number", AIME_PROTOCOL),
    )
}  # fmt: skip
# The table of a --benchmarks evaluation (opsd.evaluation.suite), in its directory: written once every benchmark is.
BENCHMARKS_FILE = "benchmarks.json"
# The protocol settings a preset sets, as `EvalConfig` fields.
PROTOCOL_FIELDS = ("n", "max_tokens", "thinking")
_SHA = re.compile(r"[0-9a-f]{40}")


def parse_benchmark_names(text: str) -> list[str]:
    """`--benchmarks aime24,hmmt25` as a list of names in the order given; UserError for an unknown or repeated
    name, or an empty list."""
    names = [part.strip() for part in str(text).split(",")]
    if not any(names) or not all(names):
        raise UserError(
            f"--benchmarks {shown(text)}: give names separated by commas, e.g. --benchmarks aime24,aime25,hmmt25"
        )
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise UserError(
            f"--benchmarks: unknown benchmark {shown(unknown[0])}; the benchmarks are {', '.join(BENCHMARKS)} "
            "(docs/evaluation.md)"
        )
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"--benchmarks names {twice[0]} twice; list each benchmark once")
    return names


def parse_local_copies(text: str, names: Sequence[str], default: str) -> dict[str, str]:
    """`--dataset` beside `--benchmarks`: NAME=FILE[,NAME=FILE...], each a local copy of a listed benchmark
    ({} when --dataset is left at its `default`). UserError for any other form or name."""
    if text == default or not text:
        return {}
    copies: dict[str, str] = {}
    for item in text.split(","):
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise UserError(
                f"--dataset {text!r}: with --benchmarks, --dataset gives local copies as NAME=FILE[,NAME=FILE], "
                "e.g. --dataset hmmt25=data/hmmt25.parquet"
            )
        if name not in names:
            raise UserError(
                f"--dataset {name}={path}: {name!r} is not among --benchmarks ({', '.join(names)}); list it there "
                "or drop its copy"
            )
        if name in copies:
            raise UserError(f"--dataset gives two copies of {name}; give one")
        copies[name] = path
    return copies


def _answer_text(value: Any) -> Any:
    """An answer cell as text: an integral float (AMC's ``27.0``) as ``27``; other values unchanged."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


@dataclass(frozen=True)
class Loaded:
    """A benchmark's problems (`id`, `problem`, `answer` as text, dataset `index`) and where they came from."""

    problems: list[dict[str, Any]]
    source: str  # the Hub id, or the local file made absolute
    revision: str | None  # the pinned revision read; None for a local copy
    commit: str | None  # the commit `datasets` loaded, where it says
    warnings: tuple[str, ...] = ()  # one line each: a row count other than the table's (`size_warning`)


def _hub_table(bench: Benchmark):
    """The benchmark's split at its revision through `datasets` and its cache, and the commit loaded; one
    UserError line, naming the dataset and the local alternatives, when it cannot be had."""
    import datasets

    try:
        builder = datasets.load_dataset_builder(bench.dataset, revision=bench.revision)
        builder.download_and_prepare()
        table = builder.as_dataset(split=bench.split)
    except Exception as err:  # offline, no such dataset or revision, a damaged cache: all mean "cannot load"
        cause = " ".join(str(err).split())[:200] or type(err).__name__
        reach = (
            "HF_HUB_OFFLINE=1 forbids downloading it"
            if datasets.config.HF_HUB_OFFLINE
            else "the Hub cannot be reached or has no such dataset"
        )
        raise UserError(
            f"benchmark {bench.name}: dataset {bench.dataset} (revision {bench.revision[:12]}) is not in the "
            f"datasets cache ({datasets.config.HF_DATASETS_CACHE}) and {reach} ({type(err).__name__}: {cause}); "
            f"give a local copy with --dataset {bench.name}=FILE (.jsonl/.parquet with columns "
            f"{bench.problem_column}, {bench.answer_column}), or set HF_DATASETS_CACHE to a cache that holds it "
            "(load it once where the Hub is reachable)"
        ) from None
    commit = getattr(builder, "hash", None)
    return table, commit if isinstance(commit, str) and _SHA.fullmatch(commit) else None


def _local_table(bench: Benchmark, local: str):
    """A local copy's table and its absolute path: the benchmark's problem, answer and id columns required. A
    copy without the id column is refused: its problems would be numbered by row (0, 1, ...) where the Hub's
    ids are the benchmark's own (AIME's 1-15), so --compare, a sweep's base or a resume would pair a problem
    with another one."""
    from opsd.data.loading import load_table

    path = Path(local).expanduser()
    try:
        table = load_table(str(path), required=(bench.problem_column, bench.answer_column))
    except UserError as err:
        raise UserError(f"benchmark {bench.name}: {err}") from None
    if bench.id_column is not None and bench.id_column not in table.column_names:
        raise UserError(
            f"benchmark {bench.name}: the local copy {path} lacks the id column {bench.id_column!r} (it has "
            f"{table.column_names}); without it its problems would be numbered by row and paired with other "
            f"problems of a Hub run; keep the column {bench.id_column!r} of {bench.dataset} in the copy"
        )
    return table, str(path.resolve())


def size_warning(bench: Benchmark, rows: int, source: str) -> str | None:
    """One line when `source` holds another number of problems than the table gives for `bench`; None when
    they agree."""
    if rows == bench.size:
        return None
    return (
        f"benchmark {bench.name}: {source} holds {rows} problems where the table gives {bench.size} "
        f"({bench.dataset} at {bench.revision[:12]}); its scores are not those of the published set"
    )


def load_benchmark(bench: Benchmark, local: str | None = None) -> Loaded:
    """The benchmark's problems, from the Hub at its revision or from `local` (a file with its columns, the id
    column included), each row checked as eval_aime.py checks --dataset rows (non-empty problem text, an answer
    of text or a number); a row count other than the table's is warned about and recorded (`Loaded.warnings`)."""
    from opsd.data.loading import check_text_column

    if local:
        table, source = _local_table(bench, local)
        revision, commit = None, None
    else:
        table, commit = _hub_table(bench)
        source, revision = bench.dataset, bench.revision
        missing = [c for c in (bench.problem_column, bench.answer_column) if c not in table.column_names]
        if missing:
            raise UserError(
                f"benchmark {bench.name}: {bench.dataset} at {bench.revision[:12]} lacks column(s) {missing}; it has "
                f"{table.column_names}"
            )
    where = f"benchmark {bench.name} ({source})"
    check_text_column(table, bench.problem_column, where)
    check_text_column(table, bench.answer_column, where, numbers=True)
    has_ids = bench.id_column is not None and bench.id_column in table.column_names
    ids = [str(i) for i in table[bench.id_column]] if has_ids else [str(i) for i in range(len(table))]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise UserError(f"{where} has duplicate problem ids {twice[:5]} in column {bench.id_column!r}")
    answers = [_answer_text(a) for a in table[bench.answer_column]]
    problems = [
        {"id": pid, "problem": str(p), "answer": str(a).strip(), "index": i}
        for i, (pid, p, a) in enumerate(zip(ids, table[bench.problem_column], answers, strict=True))
    ]
    warning = size_warning(bench, len(problems), source)
    if warning:
        logger.warning("%s", warning)
    return Loaded(problems, source, revision, commit, (warning,) if warning else ())


def benchmark_config(config, bench: Benchmark, given: set[str], out: Path, source: str):
    """The single evaluation of `bench` that `config` (an `EvalConfig`) stands for: its preset protocol but for
    the settings the command line `given` (`eval_config.given_flags`), its data `source` and split, into `out`."""
    preset = {f: getattr(bench.protocol, f) for f in PROTOCOL_FIELDS if f not in given}
    k = config.k
    n = preset.get("n", config.n)
    if k is not None and k > n:
        raise UserError(
            f"--k {k} is invalid for {bench.name}: pass@k needs k <= n={n}; lower --k or raise --n"
        )
    return dataclasses.replace(
        config, **preset, benchmarks="", step=None, dataset=source, split=bench.split, out=str(out)
    )


def scored_benchmark(config: Mapping[str, Any]) -> str | None:
    """The table's benchmark an evaluation scored (its summary's ``config``): the one it names, or the one
    whose Hub dataset it read as plain --dataset; None for other data."""
    if config.get("benchmark"):
        return str(config["benchmark"])
    source = config.get("dataset_source")
    return next((b.name for b in BENCHMARKS.values() if b.dataset == source), None)


def check_same_problems(a: Mapping[str, Any], b: Mapping[str, Any], a_where: str, b_where: str) -> None:
    """Two evaluations (summary.json each) about to be paired per problem: when either scored a benchmark of
    the table, from the Hub or a local copy, their problem sets must be the same; else one UserError line
    naming both (pairing the common problems of a 12-row copy and the 30-problem Hub set is not a comparison
    of the benchmark). Other data keep `metrics.paired_compare`'s warning."""
    ca, cb = a.get("config", {}), b.get("config", {})
    name = scored_benchmark(ca) or scored_benchmark(cb)
    if name is None:
        return
    ids_a = {str(p["id"]) for p in a["metrics"]["problems"]}
    ids_b = {str(p["id"]) for p in b["metrics"]["problems"]}
    if ids_a == ids_b:
        return
    raise UserError(
        f"{a_where} and {b_where} scored different problems of {name}: {len(ids_a)} from "
        f"{ca.get('dataset_source')} and {len(ids_b)} from {cb.get('dataset_source')}, {len(ids_a & ids_b)} in "
        "common; a paired comparison needs one problem set: score both on the same data (the Hub's or one "
        "local copy, with the same --limit)"
    )


# -- what the checkpoint was trained with, beside what it is scored with ------------------------------------------


def training_settings(*paths: str) -> dict[str, Any] | None:
    """The training settings that matter to scoring, from the run that wrote a checkpoint (`opsd_config.json`
    beside checkpoint-N, or in the directory given): thinking on or off (``student_thinking``) and the length
    trained at (``max_completion_length``); None when no path has such a file."""
    from opsd.rundir import CONFIG_FILE

    for raw in paths:
        if not raw:
            continue
        path = Path(raw).expanduser()
        for candidate in (path / CONFIG_FILE, path.parent / CONFIG_FILE):
            if candidate.is_file():
                try:
                    saved = json.loads(candidate.read_text(encoding="utf-8"))
                except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                    return None
                if not isinstance(saved, dict):
                    return None
                return {
                    "file": str(candidate),
                    "thinking": saved.get("student_thinking"),
                    "max_tokens": saved.get("max_completion_length"),
                }
    return None


def protocol_lines(rows: Sequence[tuple[str, Any]], trained: dict[str, Any] | None) -> list[str]:
    """The protocol of each benchmark as it will be scored ((name, `EvalConfig`) rows), and where training used
    other settings, training's beside them: the lines logged before any sample is drawn."""
    lines = ["benchmark | n | max tokens | thinking"]
    for name, cfg in rows:
        lines.append(f"{name} | {cfg.n} | {cfg.max_tokens} | {'on' if cfg.thinking else 'off'}")
    if trained:
        for name, cfg in rows:
            differ = []
            if trained["thinking"] is not None and bool(trained["thinking"]) != bool(cfg.thinking):
                differ.append(
                    f"thinking: trained {'on' if trained['thinking'] else 'off'}, scored "
                    f"{'on' if cfg.thinking else 'off'}"
                )
            if trained["max_tokens"] is not None and trained["max_tokens"] != cfg.max_tokens:
                differ.append(f"length: trained {trained['max_tokens']} tokens, scored {cfg.max_tokens}")
            if differ:
                lines.append(
                    f"{name}: training and evaluation differ ({trained['file']}): {'; '.join(differ)}"
                )
    return lines
