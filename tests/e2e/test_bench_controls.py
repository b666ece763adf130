"""bench/learning.py --preset controls end to end on the tiny model and the CPU: two runs of 2 steps (matched
and shuffled), the matched one continued to 4 steps as the horizon, two sweeps on builtin:easy-disjoint,
the paired comparisons, the JSON and the figure; a rerun trains and compares nothing again, and
--compare-only remakes a missing comparison from the evaluations on disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EVAL_ENV, PNG_SIGNATURE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def bench(model_dir: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(ROOT / "bench" / "learning.py"), "--preset", "controls", "--model", str(model_dir),
            "--arms", "rescale:0:1e-4:matched,rescale:0:1e-4:shuffled", "--seeds", "42", "--steps", "2",
            "--problems", "4", "--horizon-arms", "rescale:0:1e-4", "--horizon-steps", "4", "--horizon-every", "2",
            "--max-tokens", "8", "--probe-steps", "2", "--eval-n", "2", "--eval-limit", "3", "--parallel", "2",
            "--stagger", "0", "--warmup", "0", "--kv-gib", "0", "--sweep-kv-gib", "0", "--rollout-engine",
            "transformers", "--eval-engine", "transformers", "--poll", "0.5", "--workdir", str(root / "work"),
            "--out", str(root / "controls.json"), "--plot-dir", str(root / "plots"), *extra]  # fmt: skip
    env = {k: v for k, v in EVAL_ENV.items() if not k.startswith("OPSD_")}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_controls_preset_on_the_tiny_model(tiny_model_dir, tmp_path):
    first = bench(tiny_model_dir, tmp_path)
    result = json.loads((tmp_path / "controls.json").read_text())
    assert {"machine", "config", "rows", "arms", "horizon", "wall_s", "failed"} <= set(result)
    assert result["failed"] == [] and result["config"]["eval_dataset"] == "builtin:easy-disjoint"
    assert "python" in result["machine"] and "torch" in result["machine"]
    matched, shuffled = result["rows"]
    assert (matched["teacher_ref_pairing"], shuffled["teacher_ref_pairing"]) == ("matched", "shuffled")
    assert (matched["steps_done"], shuffled["steps_done"]) == (4, 2) and matched["parts"] == [
        "main",
        "horizon",
    ]
    assert [s for s, _ in matched["probe_divergence"]] == [0, 2, 4]

    base = matched["base"]
    assert [e["step"] for e in matched["evals"]] == [2, 4] and [e["step"] for e in shuffled["evals"]] == [2]
    for e in matched["evals"] + shuffled["evals"]:
        # Paired over the same problems, the mean difference is the difference of the means.
        assert e["diff"]["mean"] == pytest.approx(e["trained"]["avg"] - base["avg"])
        assert e["diff_format"]["mean"] == pytest.approx(e["trained"]["format"] - base["format"])
    vs = shuffled["evals"][0]["vs_matched"]
    assert vs["diff"]["mean"] == pytest.approx(
        shuffled["evals"][0]["trained"]["avg"] - matched["evals"][0]["trained"]["avg"]
    )
    assert "diff_format" in vs and "vs_matched" not in matched["evals"][0]
    assert [(h["teacher_ref_pairing"], h["step"]) for h in result["horizon"]] == [
        ("matched", 2),
        ("matched", 4),
    ]

    work = tmp_path / "work"
    cfg = json.loads((work / "arms" / shuffled["name"] / "opsd_config.json").read_text())
    assert cfg["teacher_ref_pairing"] == "shuffled" and cfg["dataset_name"] == "builtin:easy"
    assert (work / "arms" / shuffled["name"] / "teacher_pairing.json").is_file()
    assert not (work / "arms" / matched["name"] / "teacher_pairing.json").exists()
    # One engine per sweep over the shared directory; the horizon sweep lists its run's every checkpoint.
    horizon_log = (work / "logs" / "sweep-horizon.log").read_text()
    assert all(f"{matched['name']}/checkpoint-{s}" in horizon_log for s in (2, 4))
    sweep = json.loads((work / "evals" / "sweep" / "sweep.json").read_text())
    assert all(ev["dir"].startswith(str(work / "evals" / "sweep")) for ev in sweep["evaluations"])
    assert (tmp_path / "plots" / "controls.png").read_bytes().startswith(PNG_SIGNATURE)
    assert "start train-" in first.stdout

    again = bench(tiny_model_dir, tmp_path)
    assert "start train-" not in again.stdout and "start compare" not in again.stdout
    assert json.loads((tmp_path / "controls.json").read_text())["rows"] == result["rows"]

    # --compare-only finishes what a cut run left: a missing comparison is made again from the evaluations on
    # disk (sweep.json, which lists only the last sweep's, is not needed); nothing trains or samples.
    [against_matched] = (work / "evals" / "sweep").glob("*/compare-matched/compare.json")  # shuffled's only
    against_matched.unlink()
    (work / "evals" / "sweep" / "sweep.json").unlink()
    finish = bench(tiny_model_dir, tmp_path, "--compare-only")
    assert "start train-" not in finish.stdout and "start sweep" not in finish.stdout
    assert finish.stdout.count("start compare") == 1, finish.stdout
    finished = json.loads((tmp_path / "controls.json").read_text())
    assert finished["rows"] == result["rows"] and finished["machine"] == result["machine"]
    assert "compared_on" in finished
