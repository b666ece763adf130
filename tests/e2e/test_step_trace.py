"""The measured step path (`opsd.testing.step_trace`, docs/decisions.md): one generating optimizer step at the
published settings, with transformers rollouts and with the colocated vLLM engine, runs no more repo files, no more
switches between the repo and TRL/transformers' Trainer, and no more switches between the repo and the third-party
libraries (the grader's thread included) than docs/decisions.md quotes; a change that adds any must say so there."""

import threading

import pytest

from tests.conftest import colocated_rendezvous

# What docs/decisions.md quotes, per engine: repo files, switches, library switches.
CAPS = {"transformers": (7, 10, 43), "vllm": (11, 11, 63)}


@pytest.mark.parametrize("engine", CAPS)
def test_a_generating_step_stays_within_the_quoted_path(tiny_model_dir, tmp_path, engine):
    from opsd.testing.step_trace import trace_step

    with colocated_rendezvous():
        trace = trace_step(tiny_model_dir, tmp_path / "run", engine=engine)
    max_files, max_switches, max_library_switches = CAPS[engine]
    assert "opsd_trainer.py" in trace.files and trace.crossings >= len(trace.switches) > 0
    assert trace.library_crossings >= len(trace.library_switches) > 0
    assert trace.grader_switches, "the grader's thread was not traced"
    assert len(trace.files) <= max_files, trace.report()
    assert len(trace.switches) <= max_switches, trace.report()
    assert len(trace.library_switches) <= max_library_switches, trace.report()


def _calls_a_library():
    from packaging.version import Version

    return Version("1.0")


def test_the_library_count_takes_the_graders_thread_and_no_other():
    """The second count's sides (torch and the standard library transparent), and its tracing of the grader's
    thread, started while `trace_step` has `threading.setprofile` set, and of no other thread."""
    from opsd.run.step_watch import GRADER_THREAD
    from opsd.testing.step_trace import StepTrace, library_side, side

    site = "/venv/lib/python3.11/site-packages"
    assert (
        library_side(f"{site}/peft/peft_model.py")
        == library_side(f"{site}/vllm/entrypoints/llm.py")
        == "library"
    )
    assert (
        library_side(f"{site}/torch/nn/modules/module.py") is None
        and side(f"{site}/peft/peft_model.py") is None
    )
    assert library_side(threading.__file__) is None and library_side(__file__) == side(__file__) == "repo"

    trace = StepTrace(active=True)
    threading.setprofile(trace.thread_starts)
    try:
        for name in (f"{GRADER_THREAD}_0", "another"):
            thread = threading.Thread(target=_calls_a_library, name=name)
            thread.start()
            thread.join()
    finally:
        threading.setprofile(None)
    # Once: the other thread's call is not counted.
    edge = ("tests/e2e/test_step_trace.py:_calls_a_library", "packaging/version.py:Version.__init__")
    assert trace.grader_switches == {edge: 1}
    assert trace.library_switches == trace.grader_switches and not trace.switches
