"""Benchmark: does OPSD make the embedded model better, which clip mode does it, and what does the reference do?

    python bench/learning.py --max-tokens 256                        # preset learning: one GPU, cells side by side
    python bench/learning.py --preset controls                       # the reference controls, one GPU
    python bench/learning.py --plot bench/results/learning_h200.json # the figures again, from a JSON
    python bench/learning.py --preset controls -- --stagger 5        # flags after -- go to python -m opsd.experiment

A preset is one experiment (`python -m opsd.experiment --out WORKDIR/PRESET`, docs/experiments.md). An arm is an
inline recipe on the defaults (`--recipe ''`: CLIP_MODE, BETA, LEARNING_RATE, TEACHER_REF_PAIRING, with
MAX_COMPLETION_LENGTH `--max-tokens`, PROBE_STEPS `--probe-steps`, VLLM_GPU_MEMORY_UTILIZATION `--gpu-share`); a
cell (arm, seed) is a capped run (`train_capped.sh --profile full --dataset builtin:easy`, the embedded
SmolLM2-135M-Instruct) whose checkpoint-100 `eval_aime.py` scores like every other (`--n 8 --max-tokens
<max-tokens> --max-model-len 1024 --no-thinking`, each training seed's sampling seeds, adapter merged). All jobs share one GPU
(`--cells-per-gpu`; every vLLM engine gets a fixed KV cache, `--kv-cache-gib`, as OPSD_KV_CACHE_GIB; no
DeepSpeed). The experiment resumes a cut run, retries a failed job once and names what is missing.

The capped harness fixes what this bench's earlier direct `opsd_train.py` runs set themselves: 100 steps x 32
problems, the probe's 16 problems and the micro-batch split (`auto`: the largest that fits; the sums of 4 x 8 up
to rounding); it also saves every 10 steps, with gradient checkpointing on and vLLM's own maximum model length.
New numbers can differ slightly from the committed JSONs, measured by that earlier version.

Presets (`--preset`; the flags override them):
- `learning` (default): the clip modes and betas of docs/results.md (Does training make the model better?),
  seeds 42 and 43, scored on the held-out `builtin:easy` problems. Output: `bench/results/learning_h200.json`, `docs/learning_*.png`.
- `controls`: docs/method.md §1.8: `rescale` and `element` at 1e-4, each with `teacher_ref_pairing` matched,
  shuffled and empty, seeds 42 and 43, scored on `builtin:easy-disjoint` (held out by arithmetic); every arm
  against the base model, each control against the matched arm of its mode. Output:
  `bench/results/controls_h200.json`, `docs/controls.png`. The committed JSON's 300-step horizon (past the
  harness's 100 steps, docs/results.md: Where does the gain come from? The reference controls) is not run any
  more; `--plot` still draws it.

Verdicts: one report per baseline B, the first arm (the experiment's default: its own report, just written)
and the matched arm of each control (`python -m opsd.experiment report DIR --baseline B`); each report's
summary.json and report.md are copied to `DIR/summary-vs-B.json`, `DIR/report-vs-B.md` as soon as written (DIR's
own are the last one's). Each holds every arm against the base model (`arms[ARM]["vs_base"]`). `--compare-only`
runs nothing but the reports (the first arm's too), the JSON and the figures, from DIR on disk.

Output: {"machine", "command", "config", "rows", "arms", "timing", "wall_s", "failed"}. A row (a cell): its
settings, `probe_divergence` (the summary's curve), `base` and `evals` (step 100: `trained` avg and format; `diff`,
`diff_format` against the base model and, for a control, `vs_matched`: the seed's difference paired over problems
with its 95% t interval, from the scored samples), repeated at its top level. An arm: the experiment's per-seed
differences, seed-paired t interval and verdict (`vs_base`, `vs_matched`). Figures (`--plot-dir`) are drawn
from the rows: probe divergence and gains (`learning`), gains, divergence and the committed horizon (`controls`);
the drawing is bench/learning_figures.py.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common import machine, write
from learning_figures import plot
from opsd.configuration.switches import CHOICES
from opsd.experiment import cells as C
from opsd.experiment import rendering as R
from opsd.experiment import spec as S
from opsd.experiment import stats
from opsd.experiment.commands import main as experiment_main

ROOT = Path(__file__).resolve().parents[1]
CLIP_MODES, TEACHER_REF_PAIRINGS = CHOICES["clip_mode"], CHOICES["teacher_ref_pairing"]

MATCHED = TEACHER_REF_PAIRINGS[0]
# clip_mode:beta:learning_rate[:teacher_ref_pairing]. The four clip modes at the published beta = 0, beta = 0.5
# with the two modes that keep a gradient on every token, and the published mode at a ten times smaller rate.
DEFAULT_ARMS = (
    "element:0:1e-4,token:0:1e-4,rescale:0:1e-4,none:0:1e-4,none:0.5:1e-4,rescale:0.5:1e-4,element:0:1e-5"
)
CONTROL_ARMS = ",".join(f"{m}:0:1e-4:{p}" for m in ("rescale", "element") for p in TEACHER_REF_PAIRINGS)
PRESETS = {
    "learning": {"out": "bench/results/learning_h200.json", "arms": DEFAULT_ARMS, "eval_dataset": "builtin:easy"},
    "controls": {"out": "bench/results/controls_h200.json", "arms": CONTROL_ARMS,
                 "eval_dataset": "builtin:easy-disjoint"},
}  # fmt: skip
COMPARED = (("correct", "diff"), ("has_box", "diff_format"))  # per-sample field, its key in a row


@dataclass(frozen=True)
class Arm:
    clip_mode: str
    beta: float
    learning_rate: float
    teacher_ref_pairing: str = MATCHED

    @property
    def name(self) -> str:
        name = f"{self.clip_mode}-b{self.beta:g}-lr{self.learning_rate:g}"
        return name if self.teacher_ref_pairing == MATCHED else f"{name}-{self.teacher_ref_pairing}"

    @property
    def matched(self) -> str:
        """The arm this one is a control of: the same setting with the matched reference."""
        return Arm(self.clip_mode, self.beta, self.learning_rate).name

    def recipe(self, a: argparse.Namespace) -> str:
        return (f"CLIP_MODE={self.clip_mode},BETA={self.beta:g},LEARNING_RATE={self.learning_rate:g},"
                f"TEACHER_REF_PAIRING={self.teacher_ref_pairing},MAX_COMPLETION_LENGTH={a.max_tokens},"
                f"PROBE_STEPS={a.probe_steps},VLLM_GPU_MEMORY_UTILIZATION={a.gpu_share:g}")  # fmt: skip


def parse_arms(text: str) -> list[Arm]:
    """Arms from `clip_mode:beta:learning_rate[:teacher_ref_pairing],...`."""
    arms = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        pairing = parts[3] if len(parts) == 4 else MATCHED
        ok = len(parts) in (3, 4) and parts[0] in CLIP_MODES and pairing in TEACHER_REF_PAIRINGS
        try:
            arms.append(Arm(parts[0], float(parts[1]), float(parts[2]), pairing))
        except (ValueError, IndexError):
            ok = False
        if not ok:
            raise SystemExit(f"--arms item {item!r}: write clip_mode:beta:learning_rate[:teacher_ref_pairing], "
                             f"clip_mode one of {list(CLIP_MODES)}, teacher_ref_pairing one of "
                             f"{list(TEACHER_REF_PAIRINGS)}")  # fmt: skip
    if not arms or len({x.name for x in arms}) < len(arms):
        raise SystemExit(f"--arms {text!r}: give at least one arm, each once")
    return arms


def eval_flags(a: argparse.Namespace) -> str:
    flags = ["--dataset", a.eval_dataset, "--n", str(a.eval_n), "--max-tokens", str(a.max_tokens),
             "--max-model-len", "1024", "--no-thinking", "--gpu-memory-utilization", f"{a.gpu_share:g}"]  # fmt: skip
    flags += ["--limit", str(a.eval_limit)] if a.eval_limit else []
    return shlex.join(flags + (["--engine", a.eval_engine] if a.eval_engine else []))


def experiment_argv(a: argparse.Namespace, arms: list[Arm], directory: Path) -> list[str]:
    argv = [sys.executable, "-m", "opsd.experiment", "--out", str(directory), "--profile", a.profile,
            "--model", a.model, "--dataset", a.dataset, "--recipe", ""]  # fmt: skip
    for arm in arms:
        argv += ["--arm", f"{arm.name}={arm.recipe(a)}"]
    argv += ["--seeds", a.seeds, "--eval-flags", eval_flags(a), "--cells-per-gpu", str(a.cells_per_gpu),
             "--kv-cache-gib", f"{a.kv_cache_gib:g}", "--status-every", "60"]  # fmt: skip
    if a.accelerate_config:
        argv += ["--accelerate-config", a.accelerate_config]
    return argv + a.experiment_flags


def baselines(arms: list[Arm]) -> list[str]:
    """The reports to write: the first arm's (the experiment's default baseline), then each control's matched arm."""
    names = {x.name for x in arms}
    matched = [x.matched for x in arms if x.teacher_ref_pairing != MATCHED and x.matched in names]
    return list(dict.fromkeys([arms[0].name, *matched]))


def report_args(directory: Path, baseline: str) -> list[str]:
    """`python -m opsd.experiment`'s arguments for the report against `baseline`."""
    return ["report", str(directory), "--baseline", baseline]


def report_argv(directory: Path, baseline: str) -> list[str]:
    return [sys.executable, "-m", "opsd.experiment", *report_args(directory, baseline)]


def reports(directory: Path, names: list[str], written: bool = False) -> dict[str, dict]:
    """{baseline: its summary}, each report copied aside once written (the next overwrites it); `written`: DIR's
    report is the experiment's own, just written, copied and not made again."""
    have = json.loads((directory / R.SUMMARY_JSON).read_text())["baseline"] if written else None
    out = {}
    for b in sorted(names, key=lambda name: name != have):
        # `report_argv`, run in this process: the report's imports (TRL's config, for the arms' recipes) are
        # already loaded here, where a new interpreter spent ~10 s on them.
        rc = experiment_main(report_args(directory, b)) if b != have else 0
        if rc:
            raise SystemExit(f"{shlex.join(report_argv(directory, b))} failed (exit {rc})")
        shutil.copyfile(directory / R.REPORT_FILE, directory / f"report-vs-{b}.md")
        shutil.copyfile(directory / R.SUMMARY_JSON, directory / f"summary-vs-{b}.json")
        out[b] = json.loads((directory / f"summary-vs-{b}.json").read_text())
    return out


def paired(a: dict, b: dict) -> dict:
    """b - a of one seed in accuracy (`diff`) and format (`diff_format`), paired per (problem, sample), with the
    95% t interval over problems."""
    out = {}
    for field, key in COMPARED:
        iv = stats.paired_over_problems(a[field], b[field])
        out[key] = {"mean": iv.estimate, "se": iv.se, "ci_low": iv.low, "ci_high": iv.high}
    return out


def read_scores(eval_dir: Path) -> dict[str, dict[str, list[float]]]:
    """{per-sample field: {problem id: values by sample index}} of one evaluation directory (checked)."""
    return C.read_eval(eval_dir)[1]


def build_rows(directory: Path, arms: list[Arm], summary: dict) -> list[dict]:
    """One row per cell, from the summary of the first arm's report and the samples it scored."""
    base = {int(s): read_scores(S.base_eval_dir(directory, int(s))) for s in summary["base_per_seed"]}
    scores = {}
    for arm in arms:
        for seed in summary["arms"][arm.name]["per_seed"]:
            where = C.scored_steps(S.eval_dir(directory, arm.name, int(seed)))[S.STEPS]
            scores[arm.name, seed] = read_scores(where)
    rows = []
    for arm in arms:
        entry = summary["arms"][arm.name]
        for seed in map(str, summary["seeds_planned"]):
            curve = summary["curves"].get(arm.name, {}).get(seed, {})
            row = {"name": f"{arm.name}-s{seed}", "arm": arm.name, **asdict(arm), "seed": int(seed),
                   "steps": S.STEPS, "parts": ["main"], "probe_divergence": curve.get("probe/divergence", []),
                   "steps_done": max((step for step, _ in curve.get("loss", [])), default=0)}  # fmt: skip
            if seed in summary["base_per_seed"]:
                b = summary["base_per_seed"][seed]
                row["base"] = {"avg": b["avg"], "format": b["format_rate"]}
            rows.append(row)
            if (arm.name, seed) not in scores:
                row["missing"] = entry["missing"].get(seed, "not scored")
                continue
            m = entry["per_seed"][seed]
            ev = {"step": S.STEPS, "trained": {"avg": m["avg"], "format": m["format_rate"], **m}}
            ev.update(paired(base[int(seed)], scores[arm.name, seed]) if int(seed) in base else {})
            if arm.teacher_ref_pairing != MATCHED and (arm.matched, seed) in scores:
                ev["vs_matched"] = paired(scores[arm.matched, seed], scores[arm.name, seed])
            row["evals"] = [ev]
            row.update({k: ev[k] for k in ("trained", "diff", "diff_format") if k in ev})
    return rows


def arm_entries(arms: list[Arm], rows: list[dict], summaries: dict[str, dict]) -> list[dict]:
    """Per arm: the experiment's per-seed differences, seed-paired t interval and verdict, against the base
    model and (a control) against its matched arm; the probe divergence at the first and last step."""

    def verdicts(comp: dict) -> dict:
        return {what: {k: c[k] for k in ("per_seed", "interval", "verdict")} for what, c in comp.items()}

    out = []
    for arm in arms:
        mine = [r for r in rows if r["arm"] == arm.name]
        entry = {"arm": arm.name, **asdict(arm), "seeds": [r["seed"] for r in mine if "evals" in r],
                 "vs_base": verdicts(summaries[arms[0].name]["arms"][arm.name].get("vs_base", {}))}  # fmt: skip
        vs = summaries.get(arm.matched, {}).get("comparisons", {}).get(arm.name)
        if arm.teacher_ref_pairing != MATCHED and vs:
            entry["vs_matched"] = verdicts(vs)
        divs = [r["probe_divergence"] for r in mine if len(r["probe_divergence"]) > 1]
        if divs:
            entry["probe_divergence_first_last"] = [statistics.mean(d[0][1] for d in divs),
                                                    statistics.mean(d[-1][1] for d in divs)]  # fmt: skip
        out.append(entry)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="learning", choices=list(PRESETS))
    p.add_argument("--out", default=None, help="Result JSON (default: the preset's, in bench/results).")
    p.add_argument("--plot", default="", help="Only redraw the figures from this JSON.")
    p.add_argument("--plot-dir", default=str(ROOT / "docs"))
    p.add_argument("--workdir", default="runs/bench", help="The experiment goes to WORKDIR/PRESET.")
    p.add_argument(
        "--model", default="embedded", help="embedded (default) = the embedded SmolLM2-135M-Instruct."
    )
    p.add_argument("--dataset", default="builtin:easy", help="Training problems.")
    p.add_argument("--profile", default="full", help="train_capped.sh --profile (smoke: CI on a tiny model).")
    p.add_argument("--eval-dataset", default=None, help="Held-out problems (preset's).")
    p.add_argument("--arms", default=None, help="clip_mode:beta:learning_rate[:teacher_ref_pairing],...")
    p.add_argument("--seeds", default="42,43")
    p.add_argument("--max-tokens", type=int, default=128, help="Rollout and evaluation length cap.")
    p.add_argument("--probe-steps", type=int, default=10)
    p.add_argument("--eval-n", type=int, default=8)
    p.add_argument("--eval-limit", type=int, default=0, help="Score only the first N held-out problems.")
    p.add_argument("--eval-engine", default="", help="eval_aime.py --engine (default: its own).")
    p.add_argument("--gpu-share", type=float, default=0.12, help="vLLM memory share of each engine.")
    p.add_argument("--cells-per-gpu", type=int, default=16, help="Jobs on the GPU at once (1 on a CPU).")
    p.add_argument("--kv-cache-gib", type=float, default=1.5, help="Fixed KV cache per engine (0 = vLLM's).")
    p.add_argument("--accelerate-config", default="configs/accelerate/single_gpu.yaml",
                   help="train_capped.sh --accelerate-config ('' = the harness's choice).")  # fmt: skip
    p.add_argument("--compare-only", action="store_true", help="Train and score nothing: the reports, JSON and "
                   "figures from the experiment on disk; the JSON keeps --out's machine and wall time.")  # fmt: skip
    a = p.parse_args(argv[:cut])
    for key, value in PRESETS[a.preset].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.experiment_flags = argv[cut + 1 :]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.plot:
        for path in plot(json.loads(Path(a.plot).read_text()), Path(a.plot_dir)):
            print(path)
        return 0
    arms = parse_arms(a.arms)
    directory = (Path(a.workdir) / a.preset).resolve()
    command = experiment_argv(a, arms, directory)
    t0, rc, earlier = time.time(), 0, {}
    if a.compare_only:
        earlier = json.loads(Path(a.out).read_text()) if Path(a.out).is_file() else {}
    else:
        rc = subprocess.run(command, cwd=ROOT).returncode
    wall, spec = time.time() - t0, S.load(directory)
    unknown = [x.name for x in arms if spec is None or x.name not in spec.arms]
    if unknown:
        print(f"{directory}: no experiment with the arms {', '.join(unknown)}", file=sys.stderr)
        return rc or 2
    done = directory / R.SUMMARY_JSON  # the experiment's own report, when this run wrote it
    fresh = not a.compare_only and done.is_file() and done.stat().st_mtime >= t0
    summaries = reports(directory, baselines(arms), written=fresh)
    summary = summaries[arms[0].name]
    rows = build_rows(directory, arms, summary)
    config = {k: v for k, v in vars(a).items() if k not in ("plot", "compare_only")}
    result = {
        "machine": earlier.get("machine") or machine(), "command": command,
        "config": {**config, "figure": a.preset, "steps": S.STEPS, "experiment": str(directory)},
        "rows": rows, "arms": arm_entries(arms, rows, summaries), "timing": summary["timing"],
        "wall_s": earlier.get("wall_s", wall), "failed": C.read_failed(directory),
    }  # fmt: skip
    if a.compare_only:
        result["compared_on"] = machine()
    print(write(result, a.out))
    for path in plot(result, Path(a.plot_dir)):
        print(path)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
