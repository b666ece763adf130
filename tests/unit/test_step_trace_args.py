"""`python -m opsd.testing.step_trace`'s command line: a `--gradient-accumulation` below 1, or so large that no
step's window fits in the rows the trace trains on (TRL's sampler drops a window it cannot fill, so no step would
run and the trace would print "repo files: 0"), is refused in one line with exit status 2 before any model is
built. Argument parsing only: the trace itself is tests/e2e/test_step_trace.py."""

from __future__ import annotations

import pytest

from opsd.errors import run_main
from opsd.testing import step_trace


@pytest.fixture
def no_trace(monkeypatch):
    """Parsing only: a command line that gets past it fails the test instead of building a model."""
    monkeypatch.delenv("OPSD_DEBUG", raising=False)

    def started(*args, **kwargs):
        raise AssertionError("the trace started")

    monkeypatch.setattr("opsd.testing.tiny.build_tiny_model", started)
    monkeypatch.setattr(step_trace, "trace_step", started)


@pytest.mark.parametrize("value", ["0", "-1", "1000000", "abc", "2.5", ""])
def test_a_gradient_accumulation_that_measures_nothing_is_one_line(value: str, capsys, no_trace) -> None:
    rc = run_main(step_trace.main, step_trace.PROG, ["--gradient-accumulation", value])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1, err
    most = step_trace.max_accumulation()
    assert lines[0].startswith(f"{step_trace.PROG}: error: argument --gradient-accumulation: {value!r}: ")
    assert f"give a whole number from 1 to {most}" in lines[0], lines[0]


def test_the_bound_is_the_largest_step_the_traces_rows_can_fill(capsys, no_trace) -> None:
    from opsd.data.loading import load_train_dataset

    # The trace trains on the built-in set (OPSDConfig's default dataset); one step's window takes
    # MICRO_BATCH x accumulation of its rows.
    most = len(load_train_dataset("builtin")) // step_trace.MICRO_BATCH
    assert step_trace.max_accumulation() == most
    assert step_trace.parse_trace_args(["--gradient-accumulation", str(most)]).gradient_accumulation == most
    assert step_trace.parse_trace_args(["--gradient-accumulation", "1"]).gradient_accumulation == 1
    assert step_trace.parse_trace_args([]).gradient_accumulation == 2
    assert step_trace.parse_trace_args(["--json"]).json and not step_trace.parse_trace_args([]).json
    assert run_main(step_trace.main, step_trace.PROG, ["--gradient-accumulation", str(most + 1)]) == 2
    assert f"'{most + 1}': give a whole number from 1 to {most}" in capsys.readouterr().err
    # A prefix of a flag is not taken for the flag.
    assert run_main(step_trace.main, step_trace.PROG, ["--gradient-acc", "2"]) == 2
    assert "unrecognized arguments: --gradient-acc 2" in capsys.readouterr().err
