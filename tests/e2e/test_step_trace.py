"""The measured step path (`opsd.testing.step_trace`, docs/decisions.md): one generating optimizer step at the
published settings, with the colocated vLLM engine, runs no more repo files and no more switches between the repo
and TRL/transformers' Trainer than docs/decisions.md quotes; a change that adds either must say so there."""

import pytest

from tests.conftest import free_port

# What docs/decisions.md quotes (6 files and 12 switches, then 8 files with the engine's one-line failures and the
# engine-trainer log-prob gap).
MAX_FILES, MAX_SWITCHES = 8, 12


def test_a_generating_step_stays_within_the_quoted_path(tiny_model_dir, tmp_path):
    from opsd.testing.step_trace import trace_step

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MASTER_PORT", str(free_port()))
        for name, value in (
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
        ):
            patch.setenv(name, value)
        trace = trace_step(tiny_model_dir, tmp_path / "run")
    assert "opsd_trainer.py" in trace.files and trace.crossings >= len(trace.switches) > 0
    assert len(trace.files) <= MAX_FILES, trace.report()
    assert len(trace.switches) <= MAX_SWITCHES, trace.report()
