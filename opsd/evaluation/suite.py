"""`--benchmarks NAME,...`: every benchmark, for one model or for the base and every checkpoint of a sweep, scored
with one engine start, and the table across them.

    eval_aime.py --model M --benchmarks aime24,aime25,hmmt25 --out OUT
    eval_aime.py --model M --checkpoints RUN_DIR --benchmarks aime24,aime25,hmmt25 --out OUT [--step N]

What is scored. Each (model, benchmark) pair is an ordinary evaluation into DIR/NAME, DIR being --out for one
model and --out/base, --out/checkpoint-N, ... for a sweep (`opsd.evaluation.sweep`): samples.jsonl,
eval_config.json (with the benchmark, its pinned revision and the commit loaded), summary.json and
per_problem.csv, so --compare, --aggregate, --plot-steps and a resume work on each as on any run. Each benchmark
runs at its preset protocol unless a flag says otherwise (`opsd.evaluation.benchmarks`); its data is read once
for all models. Before any sample is drawn the protocols are logged, with a checkpoint's training settings
(thinking, length) beside them where they differ.

One engine. The evaluations run model by model, each model's benchmarks back to back: vLLM starts once and
holds one model's weights at a time (`sweep.SweepEngine`), so a sweep of C checkpoints on B benchmarks loads
weights C times, not C x B; the transformers engine loads each model once for its benchmarks.

The table (`benchmark_table`, in DIR/benchmarks.json and .md, with DIR/pass_at_k.png). Per benchmark:
avg@n ± SE, maj@n and format rate (± SE), mean length and truncation rate, and the unbiased pass@k for
k = 1..n (`metrics.pass_at_k_curve`), as a table and a curve. Over benchmarks: the macro average with its SE
(`metrics.macro_average`: the benchmarks are independent, SE = sqrt(sum SE_b^2) / B). Against the base model
(a sweep's base, or `--compare BASE DIR`): the paired difference per benchmark
(`metrics.paired_compare`) and its macro average (`metrics.macro_paired`). A sweep also writes --out/benchmarks.json
and .md (every model's rows), accuracy_vs_step.png (one line per benchmark and the macro average), and the
reported model's pass@k curves against the base's in --out/pass_at_k.png; the model reported is the one declared
before scoring (`sweep.declare_step`), printed last.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opsd.errors import UserError, shown
from opsd.evaluation.benchmarks import (
    BENCHMARKS,
    BENCHMARKS_FILE,
    benchmark_config,
    check_same_problems,
    load_benchmark,
    parse_benchmark_names,
    parse_local_copies,
    protocol_lines,
    training_settings,
)
from opsd.evaluation.eval_config import EvalConfig, given_flags
from opsd.evaluation.generate import NO_TIMINGS, generate_missing
from opsd.evaluation.job import EvalJob, resolve_job, resolve_model
from opsd.evaluation.plan import missing_requests, report_lines
from opsd.evaluation.requests import ListSource, Request
from opsd.evaluation.samples import SAMPLES_FILE, SUMMARY_FILE
from opsd.evaluation.sweep import (
    BASE,
    Entry,
    SweepEngine,
    _check_full_fine_tune,
    child_config,
    declare_step,
    entry_step,
    expand,
)

logger = logging.getLogger(__name__)

MACRO_KEYS = ("avg", "maj", "format_rate", "truncation_rate")
SINGLE = ""  # the entry of a run without --checkpoints: its benchmarks go straight into --out


@dataclass
class Unit:
    """One evaluation of the suite: a model (`entry`) on one benchmark."""

    entry: Entry
    benchmark: str
    job: EvalJob
    requests: list[Request]


def _entry_config(config: EvalConfig, entry: Entry) -> EvalConfig:
    if entry.name == SINGLE:
        return dataclasses.replace(config, benchmarks="", step=None)
    return child_config(config, entry)


def _log_protocols(config: EvalConfig, entries: list[Entry], units: list[Unit]) -> dict[str, Any]:
    """Log each benchmark's protocol, and a checkpoint's training settings where they differ, before anything is
    sampled; returns both for the table."""
    first = [u for u in units if u.entry is entries[0]]
    rows = [(u.benchmark, u.job.settings) for u in first]
    for line in protocol_lines(rows, None):
        logger.info("protocol: %s", line)
    trained: dict[str, dict[str, Any]] = {}
    for entry in entries:
        source = entry.source or (config.adapter if entry.name == SINGLE else "")
        found = training_settings(source, config.model if entry.name == SINGLE else "")
        if found and found["file"] not in {t["file"] for t in trained.values()}:
            trained[entry.name or "model"] = found
            for line in protocol_lines(rows, found)[len(rows) + 1 :]:
                logger.warning("%s", line)
    return {
        "protocol": {b: {"n": s.n, "max_tokens": s.max_tokens, "thinking": s.thinking} for b, s in rows},
        "training": trained,
    }


def plan_units(config: EvalConfig, argv: Sequence[str], entries: list[Entry]) -> list[Unit]:
    """Every (model, benchmark) evaluation, its inputs checked and its missing samples planned, before any engine
    starts; each benchmark's data read once."""
    names = parse_benchmark_names(config.benchmarks)
    copies = parse_local_copies(config.dataset, names, default=EvalConfig.dataset)
    loaded = {name: load_benchmark(BENCHMARKS[name], copies.get(name)) for name in names}
    given = given_flags(argv)
    units = []
    for entry in entries:
        base_cfg = _entry_config(config, entry)
        for name in names:
            cfg = benchmark_config(base_cfg, BENCHMARKS[name], given, Path(base_cfg.out) / name,
                                   loaded[name].source)  # fmt: skip
            job = resolve_job(cfg, loaded[name], benchmark=name)
            units.append(Unit(entry, name, job, []))
    return units


def _hf_engine(job: EvalJob):
    from opsd.evaluation.engines import build_engine

    return build_engine(job, job.out / ".merged-model")


def run_units(config: EvalConfig, units: list[Unit], base_path: str) -> tuple[list[str], dict[str, Any]]:
    """Generate what every unit lacks, model by model with one engine (module docstring), and write each
    summary; (the report lines, the engine counts)."""
    todo = [u for u in units if u.requests]
    logger.info("%d evaluation(s), %d to sample (%s)", len(units), len(todo),
                ", ".join(f"{u.entry.name or 'model'}/{u.benchmark}" for u in todo) or "none")  # fmt: skip
    vllm = units[0].job.settings.engine_used == "vllm"
    served = SweepEngine(config, base_path, [u.job for u in todo]) if vllm and todo else None
    hf: dict[str, Any] = {}
    lines: list[str] = []
    engine_start_s = 0.0
    for i, unit in enumerate(units, 1):
        job, requests = unit.job, unit.requests
        t_job = time.perf_counter()
        label = f"{unit.entry.name}/{unit.benchmark}" if unit.entry.name else unit.benchmark
        if not requests and (job.out / SUMMARY_FILE).is_file():
            logger.info("%d/%d: %s is complete; skipped", i, len(units), label)
            continue
        timings = dict(NO_TIMINGS)
        if requests:
            logger.info("%d/%d: %s: %d missing samples into %s", i, len(units), label,
                        sum(r.count for r in requests), job.out)  # fmt: skip
            t_load = time.perf_counter()
            if served is not None:
                started = served.starts
                engine = served.serve(job)
                if served.starts > started:
                    engine_start_s = time.perf_counter() - t_load
            else:
                if unit.entry.name not in hf:
                    hf = {unit.entry.name: _hf_engine(job)}  # one model in memory at a time
                engine = hf[unit.entry.name]
            timings = generate_missing(job, requests, ListSource(requests), job.out / SAMPLES_FILE,
                                       job.out / ".merged-model", served=engine)  # fmt: skip
            timings["engine_start_s"] = time.perf_counter() - t_load - timings["generation_s"]
        lines += [f"== {label}", *report_lines(job, timings, time.perf_counter() - t_job)]
    models = len({u.entry.name for u in todo})  # the transformers engine loads each model once
    counts = {
        "engine": units[0].job.settings.engine_used,
        "engine_starts": served.starts if served is not None else models,
        "weight_loads": served.loads if served is not None else models,
        "engine_start_s": engine_start_s,
    }
    return lines, counts


# -- the table --------------------------------------------------------------------------------------------------


def benchmark_row(name: str, summary: Mapping[str, Any], base: Mapping[str, Any] | None) -> dict[str, Any]:
    """One benchmark's row of the table from its summary.json (and the base model's, for the paired
    difference): rates in percent with SEs, the pass@k curve, the protocol and the data's revision."""
    from opsd.evaluation.metrics import (
        paired_compare,
        pass_at_k_curve,
        per_problem_accuracy,
        per_problem_format_rate,
    )

    m, cfg = summary["metrics"], summary.get("config", {})
    row: dict[str, Any] = {
        "benchmark": name, "n_problems": m["n_problems"], "n": m["n"], "label": m["labels"]["avg"],
        "max_tokens": cfg.get("max_tokens"), "thinking": cfg.get("thinking"),
        "source": cfg.get("dataset_source"), "revision": cfg.get("dataset_revision"),
        "commit": cfg.get("dataset_commit"), "step": summary.get("step"),
        "data_warnings": summary.get("data_warnings") or [],
    }  # fmt: skip
    for key in (*MACRO_KEYS, "mean_tokens"):
        row[key], row[f"{key}_se"] = m[key], m[f"{key}_se"]
    row["pass_at_k_curve"] = pass_at_k_curve([p["n_correct"] for p in m["problems"]], m["n"])
    row["vs_base"] = row["format_vs_base"] = None
    if base is not None:
        bm = base["metrics"]
        row["vs_base"] = paired_compare(per_problem_accuracy(bm), per_problem_accuracy(m))
        row["format_vs_base"] = paired_compare(per_problem_format_rate(bm), per_problem_format_rate(m))
    return row


def benchmark_table(
    summaries: Mapping[str, Mapping[str, Any]], base: Mapping[str, Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """One model's table over benchmarks ({benchmark: summary.json}): a row each (`benchmark_row`) and the macro
    average of avg@n, maj@n, format and truncation rates with their SEs; with `base` ({benchmark: the base
    model's summary.json}), the paired difference per benchmark and its macro average."""
    from opsd.evaluation.metrics import macro_average, macro_paired

    rows = [benchmark_row(b, s, None if base is None else base[b]) for b, s in summaries.items()]
    macro = {k: macro_average([(r[k], r[f"{k}_se"]) for r in rows]) for k in MACRO_KEYS}
    table: dict[str, Any] = {"benchmarks": [r["benchmark"] for r in rows], "rows": rows, "macro": macro}
    table["macro_vs_base"] = None if base is None else macro_paired([r["vs_base"] for r in rows])
    table["macro_format_vs_base"] = (
        None if base is None else macro_paired([r["format_vs_base"] for r in rows])
    )
    return table


def _fmt(v: Any, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _pm(value: float, se: float | None, digits: int = 2) -> str:
    return f"{value:.{digits}f}" + ("" if se is None else f" ± {se:.{digits}f}")


def _diff(d: Mapping[str, Any] | None) -> str:
    if not d:
        return ""
    return f"{d['mean_diff']:+.2f} [{_fmt(d['ci_low'])}, {_fmt(d['ci_high'])}]"


def table_lines(table: Mapping[str, Any], title: str = "") -> list[str]:
    """The table in markdown: one row per benchmark, the macro row, then the pass@k table."""
    lines = [f"### {title}", ""] if title else []
    lines += [
        "| benchmark | problems | revision | n | avg@n | maj@n | format % | mean length | truncated % | "
        "avg@n - base [95% CI] |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in table["rows"]:
        revision = (r["revision"] or "local")[:12]
        lines.append(
            f"| {r['benchmark']} | {r['n_problems']} | {revision} | {r['n']} | {_pm(r['avg'], r['avg_se'])} | "
            f"{_pm(r['maj'], r['maj_se'])} | {_pm(r['format_rate'], r['format_rate_se'], 1)} | "
            f"{_pm(r['mean_tokens'], r['mean_tokens_se'], 0)} | "
            f"{_pm(r['truncation_rate'], r['truncation_rate_se'], 1)} | {_diff(r['vs_base'])} |"
        )
    m = table["macro"]
    lines.append(
        f"| macro ({len(table['rows'])} benchmarks) | | | | {_pm(m['avg']['value'], m['avg']['se'])} | "
        f"{_pm(m['maj']['value'], m['maj']['se'])} | {_pm(m['format_rate']['value'], m['format_rate']['se'], 1)} | "
        f"| {_pm(m['truncation_rate']['value'], m['truncation_rate']['se'], 1)} | {_diff(table['macro_vs_base'])} |"
    )
    width = max(r["n"] for r in table["rows"])
    lines += ["", "| benchmark | " + " | ".join(f"pass@{k}" for k in range(1, width + 1)) + " |",
              "|---|" + "---:|" * width]  # fmt: skip
    for r in table["rows"]:
        cells = [f"{p['value']:.1f}" for p in r["pass_at_k_curve"]] + [""] * (width - r["n"])
        lines.append(f"| {r['benchmark']} | " + " | ".join(cells) + " |")
    warned = [w for r in table["rows"] for w in r.get("data_warnings") or []]
    return lines + (["", *(f"warning: {w}" for w in warned)] if warned else [])


def headline(table: Mapping[str, Any]) -> str:
    """One line: the macro average (and its difference to the base) and each benchmark's avg@n."""
    m = table["macro"]["avg"]
    parts = [f"{r['benchmark']} {r['label']} {_pm(r['avg'], r['avg_se'])}" for r in table["rows"]]
    vs = table["macro_vs_base"]
    diff = "" if not vs else f" ({_diff(vs)} vs base)"
    return f"macro avg {_pm(m['value'], m['se'])}{diff} | " + " | ".join(parts)


def _load(path: Path) -> dict[str, Any]:
    from opsd.evaluation.report import load_summary

    return load_summary(str(path))


def write_benchmark_table(directory: Path, table: dict[str, Any], extra: Mapping[str, Any], title: str,
                reference: Mapping[str, Any] | None = None) -> list[str]:  # fmt: skip
    """DIR/benchmarks.json, DIR/benchmarks.md and DIR/pass_at_k.png (against `reference`'s curves, the base
    model's table, where given); the markdown lines."""
    from opsd.evaluation.figures import pass_at_k_curves

    lines = table_lines(table, title)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / BENCHMARKS_FILE).write_text(json.dumps({**extra, **table}, indent=2) + "\n")
    (directory / "benchmarks.md").write_text("\n".join(lines) + "\n")
    curves = {r["benchmark"]: r["pass_at_k_curve"] for r in table["rows"]}
    ref = None if reference is None else {r["benchmark"]: r["pass_at_k_curve"] for r in reference["rows"]}
    pass_at_k_curves(curves, directory / "pass_at_k.png", title=title, reference=ref)
    return lines


def run_suite(config: EvalConfig, argv: Sequence[str]) -> list[str]:
    """Score every benchmark for one model or a sweep (module docstring); the lines to print."""
    t0 = time.perf_counter()
    out = Path(config.out).expanduser()
    sweep = bool(config.checkpoints)
    if sweep:
        entries = expand(config.checkpoints, config.base)
        declared, why = declare_step(entries, config.step)
    else:
        entries = [Entry(SINGLE, config.adapter, "lora" if config.adapter else "base")]
        declared, why = entries[0], "the one model scored"
    logger.info("reported result, declared before scoring: %s", why)
    units = plan_units(config, argv, entries)
    recorded = _log_protocols(config, entries, units)
    base_path = resolve_model(config.model)
    for unit in units:
        if unit.entry.kind == "full":
            _check_full_fine_tune(unit.job, base_path)
        unit.requests = missing_requests(unit.job)
    lines, counts = run_units(config, units, base_path)

    names = parse_benchmark_names(config.benchmarks)
    summaries = {(u.entry.name, u.benchmark): _load(u.job.out) for u in units}
    has_base = sweep and config.base
    base = {b: summaries[(BASE, b)] for b in names} if has_base else None
    tables = {}
    for entry in entries:
        mine = {b: summaries[(entry.name, b)] for b in names}
        vs = None if entry.kind == "base" else base
        tables[entry.name] = benchmark_table(mine, vs)
        where = out / entry.name if entry.name else out
        extra = {"model": entry.name or "model", "step": entry_step(entry) if sweep else None, **recorded}
        reference = tables.get(BASE) if entry.kind != "base" else None
        lines += [
            "",
            *write_benchmark_table(where, tables[entry.name], extra, entry.name or out.name, reference),
        ]
    head, who = tables[declared.name], declared.name or "model"
    if sweep:
        lines += _write_sweep(out, entries, tables, declared, why, counts, time.perf_counter() - t0, recorded)
    lines += [f"engine starts: {counts['engine_starts']}", f"reported: {who}, declared before scoring ({why})",
              "  " + headline(head)]  # fmt: skip
    return lines


def _write_sweep(out: Path, entries: list[Entry], tables: dict[str, dict[str, Any]], declared: Entry | None,
                 why: str, counts: Mapping[str, Any], wall_s: float, recorded: Mapping[str, Any]) -> list[str]:  # fmt: skip
    """--out/benchmarks.json and .md over every model, accuracy_vs_step.png, and the reported model's pass@k
    curves against the base's in --out/pass_at_k.png."""
    from opsd.evaluation.figures import benchmark_steps, pass_at_k_curves

    result = {
        "declared": {"name": declared.name if declared else None, "step": entry_step(declared) if declared else None,
                     "why": why},
        **counts, "wall_time_s": wall_s, **recorded,
        "models": [{"name": e.name, "step": entry_step(e), "kind": e.kind, **tables[e.name]} for e in entries],
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / BENCHMARKS_FILE).write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Benchmarks, every model (reported: {declared.name if declared else 'n/a'}, {why})", ""]
    for e in entries:
        lines += [*table_lines(tables[e.name], f"{e.name} (step {entry_step(e)})"), ""]
    (out / "benchmarks.md").write_text("\n".join(lines) + "\n")
    series: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        step = entry_step(e)
        if step is None:
            continue
        t = tables[e.name]
        for r in t["rows"]:
            series.setdefault(r["benchmark"], []).append(
                {"step": step, "avg": r["avg"], "avg_se": r["avg_se"]}
            )
        m = t["macro"]["avg"]
        series.setdefault("macro average", []).append({"step": step, "avg": m["value"], "avg_se": m["se"]})
    png = benchmark_steps(series, out / "accuracy_vs_step.png", title=out.name)
    if declared is not None and declared.name != BASE:
        ref = tables.get(BASE)
        curves = {r["benchmark"]: r["pass_at_k_curve"] for r in tables[declared.name]["rows"]}
        refs = None if ref is None else {r["benchmark"]: r["pass_at_k_curve"] for r in ref["rows"]}
        pass_at_k_curves(
            curves, out / "pass_at_k.png", title=f"{declared.name} against the base", reference=refs
        )
    return ["", f"table: {out / 'benchmarks.md'}, {out / BENCHMARKS_FILE}", f"plot: {png}"]


# -- --compare of two benchmark directories ------------------------------------------------------------------


def is_suite(path: str | Path) -> bool:
    """Whether `path` holds a --benchmarks result (benchmarks.json)."""
    return (Path(path).expanduser() / BENCHMARKS_FILE).is_file()


def suite_benchmarks(directory: Path) -> list[str]:
    """The benchmarks DIR/benchmarks.json of a --benchmarks result lists: names of the table (never paths: each
    names DIR/NAME), each once. One UserError line naming the file when it is no such result (over its cap, not
    UTF-8 JSON, no such list); a sweep's directory (models, no list) is named as one."""
    from opsd.evaluation.report import RESULT_KIND, read_result

    path = directory / BENCHMARKS_FILE
    data = read_result(path)
    listed = data.get("benchmarks")
    if listed is None and isinstance(data.get("models"), list):
        raise UserError(
            f"{directory} is a sweep's directory; compare two of its models instead (such as {directory}/base and "
            f"{directory}/checkpoint-N)"
        )
    good = isinstance(listed, list) and 0 < len(listed) <= len(BENCHMARKS)
    if not (
        good
        and all(isinstance(b, str) and b in BENCHMARKS for b in listed)
        and len(set(listed)) == len(listed)
    ):
        raise UserError(
            f"{shown(path)} is not a --benchmarks result: its field benchmarks is {shown(listed)}, not a list of "
            f"distinct benchmark names of the table ({', '.join(BENCHMARKS)}); {RESULT_KIND.fix}"
        )
    return listed


def run_suite_compare(config: EvalConfig) -> list[str]:
    """--compare A B of two --benchmarks results: the paired difference b - a per benchmark both hold, and its
    macro average, for accuracy and format rate; compare.json under --out when given."""
    from opsd.evaluation.report import TABLE_READS, check_summary

    a_dir, b_dir = (Path(d).expanduser() for d in config.compare)
    listed, b_listed = suite_benchmarks(a_dir), suite_benchmarks(b_dir)
    names = [b for b in listed if b in b_listed and (b_dir / b / SUMMARY_FILE).is_file()]
    if not names:
        raise UserError(
            f"{a_dir} and {b_dir} share no benchmark: a paired comparison needs the same benchmarks"
        )
    a, b_runs = {b: _load(a_dir / b) for b in names}, {b: _load(b_dir / b) for b in names}
    for b in names:
        check_same_problems(a[b], b_runs[b], str(a_dir / b), str(b_dir / b))
        for d, runs in ((a_dir, a), (b_dir, b_runs)):  # what the table reads beyond the pairing
            check_summary(runs[b], d / b / SUMMARY_FILE, TABLE_READS)
    table = benchmark_table(b_runs, a)
    lines = [f"b - a, paired per problem: a = {a_dir}, b = {b_dir} (points)"]
    for r in table["rows"]:
        d = r["vs_base"]
        lines.append(f"{r['benchmark']}: {d['mean_a']:.2f} -> {d['mean_b']:.2f}, {_diff(d)}, SE {_fmt(d['se'])}, "
                     f"over {d['n_problems']} problems")  # fmt: skip
    for label, d in (
        ("macro avg accuracy", table["macro_vs_base"]),
        ("macro format rate", table["macro_format_vs_base"]),
    ):
        lines.append(f"{label}: {d['mean_a']:.2f} -> {d['mean_b']:.2f}, {_diff(d)}, SE {_fmt(d['se'])}, "
                     f"Welch df {_fmt(d['df'], 1)}, over {d['n_benchmarks']} benchmarks")  # fmt: skip
    if config.out:
        out = Path(config.out).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        (out / "compare.json").write_text(
            json.dumps({"a": str(a_dir), "b": str(b_dir), **table}, indent=2) + "\n"
        )
        lines.append(f"written: {out / 'compare.json'}")
    return lines
