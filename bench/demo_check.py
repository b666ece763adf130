"""Keeps the demo's published numbers true: runs `bash scripts/demo.sh SEED` in a fresh clone of this commit and
compares its paired differences (accuracy and format rate, trained − base, with their 95% CIs) with the ones
README.md and docs/results.md quote (`bench/results/demo_published_cpu.json`).

    python bench/demo_check.py --seed 42                      # ~20 min on a 2-core CPU machine, no GPU needed
    python bench/demo_check.py --seed 42 --venv .venv         # reuse this checkout's environment (no set-up)
    python bench/demo_check.py --seeds 42,43,44 --record      # re-measure and rewrite the published numbers

Writes `bench/results/demo_check_cpu.json` (machine, versions, commit, each seed's numbers and whether they
match). Exit status 1 when a seed's numbers differ from the published ones by more than `--tolerance` points.
On the machine that recorded them the demo is bit-for-bit reproducible (docs/results.md), so the default
tolerance is the rounding of the quoted figures; on another CPU the float rounding moves the LoRA weights and the
numbers move within the spread of the seeds (docs/results.md: "What made fresh clones disagree").
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import machine

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "bench" / "results" / "demo_published_cpu.json"
KEYS = ("mean_a", "mean_b", "mean_diff", "ci_low", "ci_high")


def run_demo(seed: int, venv: Path | None) -> tuple[dict, float]:
    """The demo's compare.json at `seed` from a fresh clone of HEAD, and the wall time (set-up included)."""
    with tempfile.TemporaryDirectory(prefix="opsd-demo-") as tmp:
        clone = Path(tmp) / "opsd"
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        if venv is not None:  # the set-up script keeps a .venv that has the pinned set
            os.symlink(venv.resolve(), clone / ".venv")
        start = time.monotonic()
        subprocess.run(["bash", "scripts/demo.sh", str(seed)], cwd=clone, check=True)
        wall = time.monotonic() - start
        result = json.loads((clone / "runs" / "demo" / f"compare_seed{seed}" / "compare.json").read_text())
    return result, wall


def numbers(compare: dict) -> dict:
    """Accuracy and format rate, each base (a), trained (b), difference and CI, in points, 2 decimals."""
    return {
        "accuracy": {k: round(compare[k], 2) for k in KEYS},
        "format_rate": {k: round(compare["format_rate"][k], 2) for k in KEYS},
    }


def differences(got: dict, want: dict, tolerance: float) -> list[str]:
    return [
        f"{metric}.{key}: {got[metric][key]} (published {want[metric][key]})"
        for metric in ("accuracy", "format_rate")
        for key in KEYS
        if abs(got[metric][key] - want[metric][key]) > tolerance
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", "--seed", default="42", help="Comma-separated training seeds (default 42).")
    p.add_argument("--venv", type=Path, help="An existing .venv to use instead of the clone's own set-up.")
    p.add_argument("--tolerance", type=float, default=0.01, help="Points a number may differ (default 0.01).")
    p.add_argument("--record", action="store_true", help="Write the numbers as the published ones instead.")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "demo_check_cpu.json")
    a = p.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    published = json.loads(PUBLISHED.read_text())["seeds"] if PUBLISHED.is_file() else {}
    if not a.record and (missing := [s for s in seeds if str(s) not in published]):
        sys.exit(f"no published numbers for seed(s) {missing} in {PUBLISHED}; run with --record first")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    rows, failed = {}, False
    for seed in seeds:
        compare, wall = run_demo(seed, a.venv)
        got = numbers(compare)
        differ = [] if a.record else differences(got, published[str(seed)], a.tolerance)
        failed |= bool(differ)
        rows[str(seed)] = {**got, "wall_s": round(wall, 1), "differs": differ}
        verdict = "recorded" if a.record else "matches" if not differ else "DIFFERS: " + "; ".join(differ)
        print(f"seed {seed}: {json.dumps(got)}: {verdict}", flush=True)
        # Written after every seed: a stopped check keeps what it measured.
        record = {
            "benchmark": "demo_check",
            "machine": machine(),
            "commit": commit.stdout.strip(),
            "seeds": rows,
        }
        if a.record:
            kept = {
                s: {k: v for k, v in r.items() if k in ("accuracy", "format_rate")} for s, r in rows.items()
            }
            PUBLISHED.write_text(json.dumps({**record, "seeds": {**published, **kept}}, indent=1) + "\n")
        a.out.write_text(json.dumps(record, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    shutil.which("git") or sys.exit("git is needed to clone this commit")
    raise SystemExit(main())
