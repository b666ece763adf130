"""bench/learning.py --preset controls end to end on the tiny model and the CPU: one experiment of two arms
(`rescale` with the matched and the shuffled reference), seed 42, real capped runs of the smoke profile on
builtin:easy (8-token rollouts, the probe every 50 steps), real evaluations of 3 builtin:easy-disjoint problems x
2 samples, the reports, the JSON and the figure; a rerun trains and scores nothing again, and --compare-only
remakes a lost report from the evaluations on disk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EVAL_ENV, PNG_SIGNATURE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
MATCHED, SHUFFLED = "rescale-b0-lr0.0001", "rescale-b0-lr0.0001-shuffled"


def bench(model_dir: Path, root: Path, *extra: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(ROOT / "bench" / "learning.py"), "--preset", "controls", "--model", str(model_dir),
            "--profile", "smoke", "--arms", "rescale:0:1e-4:matched,rescale:0:1e-4:shuffled", "--seeds", "42",
            "--max-tokens", "8", "--probe-steps", "50", "--eval-n", "2", "--eval-limit", "3", "--eval-engine",
            "transformers", "--cells-per-gpu", "1", "--kv-cache-gib", "0", "--accelerate-config", "", "--workdir",
            str(root / "work"), "--out", str(root / "controls.json"), "--plot-dir", str(root / "plots"), *extra]  # fmt: skip
    env = {k: v for k, v in EVAL_ENV.items() if not k.startswith("OPSD_")}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def jobs(directory: Path) -> list[str]:
    return (directory / "jobs.jsonl").read_text().splitlines()


def test_controls_preset_on_the_tiny_model(tiny_model_dir, tmp_path):
    bench(tiny_model_dir, tmp_path)
    result = json.loads((tmp_path / "controls.json").read_text())
    assert {"machine", "command", "config", "rows", "arms", "timing", "wall_s", "failed"} <= set(result)
    assert result["failed"] == {} and result["config"]["eval_dataset"] == "builtin:easy-disjoint"
    assert "python" in result["machine"] and "torch" in result["machine"]
    matched, shuffled = result["rows"]
    assert (matched["arm"], shuffled["arm"]) == (MATCHED, SHUFFLED)
    assert (matched["teacher_ref_pairing"], shuffled["teacher_ref_pairing"]) == ("matched", "shuffled")
    assert matched["steps_done"] == shuffled["steps_done"] == 100
    assert [s for s, _ in matched["probe_divergence"]] == [0, 50, 100]

    base = matched["base"]
    for row in (matched, shuffled):
        (e,) = row["evals"]
        assert e["step"] == 100 and row["diff"] == e["diff"]
        # Paired over the same problems, the mean difference is the difference of the means.
        assert e["diff"]["mean"] == pytest.approx(e["trained"]["avg"] - base["avg"])
        assert e["diff_format"]["mean"] == pytest.approx(e["trained"]["format"] - base["format"])
    vs = shuffled["evals"][0]["vs_matched"]
    assert vs["diff"]["mean"] == pytest.approx(shuffled["trained"]["avg"] - matched["trained"]["avg"])
    assert "diff_format" in vs and "vs_matched" not in matched["evals"][0]
    # The arms carry the experiment's verdicts; with one seed its interval is the rows' one, over problems.
    m_arm, s_arm = result["arms"]
    assert "vs_matched" not in m_arm and s_arm["seeds"] == [42]
    against = s_arm["vs_matched"]["format rate"]
    assert against["per_seed"]["42"] == pytest.approx(vs["diff_format"]["mean"])
    assert [against["interval"][k] for k in ("low", "high")] == pytest.approx(
        [vs["diff_format"]["ci_low"], vs["diff_format"]["ci_high"]]
    )
    assert s_arm["vs_base"]["accuracy"]["per_seed"]["42"] == pytest.approx(shuffled["diff"]["mean"])

    d = tmp_path / "work" / "controls"
    recipe = (d / "recipes" / f"{SHUFFLED}.env").read_text()
    assert "TEACHER_REF_PAIRING=shuffled" in recipe and "MAX_COMPLETION_LENGTH=8" in recipe
    run = d / "runs" / SHUFFLED / "capped_seed42"
    cfg = json.loads((run / "opsd_config.json").read_text())
    assert cfg["teacher_ref_pairing"] == "shuffled" and cfg["dataset_name"] == "builtin:easy"
    assert cfg["max_completion_length"] == 8 and cfg["max_steps"] == 100
    assert (run / "teacher_pairing.json").is_file()
    assert not (d / "runs" / MATCHED / "capped_seed42" / "teacher_pairing.json").exists()
    scored = json.loads(
        (d / "evals" / SHUFFLED / "seed42" / "checkpoint-100" / "eval_config.json").read_text()
    )
    assert (scored["dataset"], scored["n"], scored["limit"]) == ("builtin:easy-disjoint", 2, 3)
    # One report per baseline, kept under its name; the matched arm is the first, so DIR/summary.json is its.
    kept = json.loads((d / f"summary-vs-{MATCHED}.json").read_text())
    assert kept["baseline"] == MATCHED and SHUFFLED in kept["comparisons"]
    assert json.loads((d / "summary.json").read_text())["baseline"] == MATCHED
    assert (d / f"report-vs-{MATCHED}.md").is_file()
    assert (tmp_path / "plots" / "controls.png").read_bytes().startswith(PNG_SIGNATURE)

    ran = jobs(d)
    assert len(ran) == 5  # the base model, then train and score each cell
    bench(tiny_model_dir, tmp_path)
    assert jobs(d) == ran
    assert json.loads((tmp_path / "controls.json").read_text())["rows"] == result["rows"]

    # --compare-only remakes a lost report from the evaluations on disk; nothing trains or scores.
    (d / f"summary-vs-{MATCHED}.json").unlink()
    bench(tiny_model_dir, tmp_path, "--compare-only")
    assert jobs(d) == ran and (d / f"summary-vs-{MATCHED}.json").is_file()
    finished = json.loads((tmp_path / "controls.json").read_text())
    assert finished["rows"] == result["rows"] and finished["machine"] == result["machine"]
    assert "compared_on" in finished
