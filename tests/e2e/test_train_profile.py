"""bench/train_profile.py on the CPU and the tiny model, smallest settings: the JSON's shape, positive phase
times that add up, a non-empty op table sorted by time, family shares that add up to 1, the fixed rollouts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import EVAL_ENV

ROOT = Path(__file__).resolve().parents[2]


def test_train_profile_on_the_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "profile.json"
    argv = [sys.executable, str(ROOT / "bench" / "train_profile.py"), "--model", str(tiny_model_dir),
            "--device", "cpu", "--lengths", "8", "--problems", "4", "--micro", "2", "--steps", "1",
            "--out", str(out)]  # fmt: skip
    proc = subprocess.run(argv, cwd=ROOT, env=EVAL_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"benchmark", "machine", "config", "rows"} <= set(result) and "torch" in result["machine"]
    config = result["config"]
    assert set(config["families"]) == {"GEMM", "attention", "elementwise+norm+rotary+activation", "LoRA",
                                       "loss chunk", "optimizer", "other"}  # fmt: skip
    assert config["family_patterns"] and config["family_ranges"]

    (row,) = result["rows"]
    assert row["status"] == "ok" and row["length"] == 8
    assert (row["micro_batch"], row["accumulation"]) == (2, 2)
    assert row["recipe"]["lora_r"] == 64 and row["recipe"]["gradient_checkpointing"] is True
    assert [r["kind"] for r in row["steps"]] == ["warmup", "timed", "profiled"]
    # Every completion is exactly LENGTH tokens: 4 rows x 8 tokens per step, in two micro-batches.
    assert all(r["tokens"]["completion"] == 4 * 8 for r in row["steps"])

    for phases in (row["timed"]["phases_s"], row["profile"]["phases_s"]):
        assert all(phases[k] > 0 for k in phases), phases
        student, backward = phases["student_forward_s"], phases["backward_s"]
        parts = student + phases["teacher_forward_s"] + phases["loss_s"] + backward
        assert phases["train_half_s"] == pytest.approx(parts, abs=1e-3)
        assert phases["student_s"] == pytest.approx(student + backward, abs=1e-3)
    assert row["timed"]["train_tflop"] > 0 and row["timed"]["train_tflop_per_s"] > 0

    profile = row["profile"]
    assert profile["unit"].startswith("CPU ops") and profile["total_ms"] > 0
    top = profile["top"]
    assert 0 < len(top) <= 25 and all(t["calls"] > 0 and t["name"] for t in top)
    totals = [t["total_ms"] for t in top]
    assert totals == sorted(totals, reverse=True)
    families = profile["families"]
    assert set(families) == set(config["families"])
    assert sum(f["share"] for f in families.values()) == pytest.approx(1.0, abs=1e-2)
    # The ranges put the adapters' products and the chunked loss in their own families.
    assert all(families[f]["share"] > 0 for f in ("GEMM", "LoRA", "loss chunk", "attention"))
    assert {t["family"] for t in top} <= set(families)
