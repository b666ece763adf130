"""A fixed-seed tiny run (3 steps: transformers rollouts, LoRA, gradient accumulation over 2 micro-batches, the
completions log) against the values it gave when they were recorded (`tests/data/fixed_run.json`): per-step
loss, gradient norm and divergence, and every adapter tensor's sum, bit for bit where the machine is the one they
were recorded on (sha256 of the adapter bytes) and within float rounding elsewhere. A change that should leave
the method alone (moving code, renaming, restructuring the trainer) must leave this test green; to record new
values after a deliberate change of the method: OPSD_RECORD_FIXED_RUN=1 pytest tests/integration/test_fixed_run.py."""

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.conftest import make_trainer

RECORD = Path(__file__).resolve().parents[1] / "data" / "fixed_run.json"
LOGGED = ("loss", "grad_norm", "opsd/divergence", "completions/mean_length")


def fixed_run(tiny_model_dir, out) -> dict:
    import torch

    torch.manual_seed(0)
    trainer = make_trainer(
        tiny_model_dir, out, max_steps=3, gradient_accumulation_steps=2, logging_steps=1, completions_steps=2,
        max_completion_length=12,
    )  # fmt: skip
    trainer.train()
    steps = [{k: r[k] for k in LOGGED} for r in trainer.state.log_history if "loss" in r]
    adapters = {n: p.detach().cpu() for n, p in sorted(trainer.model.named_parameters()) if ".lora_" in n}
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in adapters.values())).hexdigest()
    return {
        "steps": steps,
        "adapter_sums": {n: float(t.double().sum()) for n, t in adapters.items()},
        "adapter_sha256": digest,
        "torch": torch.__version__,
    }


def test_fixed_seed_run_gives_the_recorded_loss_and_adapters(tiny_model_dir, tmp_path):
    got = fixed_run(tiny_model_dir, tmp_path / "run")
    if os.environ.get("OPSD_RECORD_FIXED_RUN") == "1":
        RECORD.write_text(json.dumps(got, indent=1) + "\n")
    want = json.loads(RECORD.read_text())
    assert len(got["steps"]) == len(want["steps"]) == 3
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True), start=1):
        for key in LOGGED:
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), (step, key)
    assert got["adapter_sums"].keys() == want["adapter_sums"].keys()
    for name, value in want["adapter_sums"].items():
        assert got["adapter_sums"][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    if got["torch"] == want["torch"] and os.environ.get("OPSD_FIXED_RUN_EXACT") == "1":
        assert got["adapter_sha256"] == want["adapter_sha256"]
