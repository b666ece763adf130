"""The run directory's layout (opsd.rundir): checkpoint names, the completion mark, step-log trimming."""

import json
import logging

from opsd import rundir


def test_checkpoint_names_parse_and_order(tmp_path):
    for step in (10, 2, 100):
        rundir.checkpoint_dir(tmp_path, step).mkdir()
    (tmp_path / "checkpoint-100-wavg5").mkdir()  # an average, not a checkpoint
    (tmp_path / "checkpoint-x").mkdir()
    (tmp_path / "checkpoint-7").write_text("a file")
    assert [p.name for p in rundir.checkpoints(tmp_path)] == [
        "checkpoint-2",
        "checkpoint-10",
        "checkpoint-100",
    ]
    assert rundir.checkpoint_step(tmp_path / "checkpoint-42") == 42
    assert rundir.checkpoint_step(tmp_path / "checkpoint-42-wavg3") is None
    assert rundir.step_in_path(tmp_path / "run" / "checkpoint-30" / "adapter") == 30
    assert rundir.step_in_path(tmp_path / "run") is None
    assert rundir.wavg_dir(tmp_path, 100, 5).name == "checkpoint-100-wavg5"


def test_latest_complete_checkpoint_skips_unmarked_ones(tmp_path):
    assert rundir.latest_complete_checkpoint(tmp_path) is None
    for step in (10, 20, 30):
        rundir.checkpoint_dir(tmp_path, step).mkdir()
    rundir.mark_complete(rundir.checkpoint_dir(tmp_path, 10))
    rundir.mark_complete(rundir.checkpoint_dir(tmp_path, 20))  # 30 was being written when the run died
    assert rundir.latest_complete_checkpoint(tmp_path) == rundir.checkpoint_dir(tmp_path, 20)
    assert not rundir.is_complete(rundir.checkpoint_dir(tmp_path, 30))


def test_trim_step_log_keeps_steps_up_to_the_checkpoint(tmp_path):
    log = tmp_path / rundir.METRICS_FILE
    lines = [json.dumps({"step": s, "loss": s / 10}) for s in (1, 2, 3, 4)]
    log.write_text("\n".join(lines) + '\n{"step": 5, "lo')  # a line cut by a kill
    rundir.trim_step_log(log, 2)
    assert log.read_text() == lines[0] + "\n" + lines[1] + "\n"
    rundir.trim_step_log(tmp_path / "absent.jsonl", 2)  # nothing to trim
    assert not (tmp_path / "absent.jsonl").exists()


# -- unreadable lines of the step logs ----------------------------------------------------------------------

GOOD = [{"step": s, "loss": s / 10} for s in (1, 2, 3, 4)]


def _line(record) -> bytes:
    return json.dumps(record).encode()


def _bad_log(path):
    """Steps 1-4 with an unreadable line of each kind between them, and a last line cut short."""
    lines = [
        _line(GOOD[0]),
        b"garbage appended by hand",  # line 2
        _line(GOOD[1]),
        b"[1, 2, 3]",  # line 4: JSON, not an object
        b"",  # line 5: blank, skipped silently
        b'{"step": "three", "loss": 0.3}',  # line 6: a step that is not a number
        b"\xff\xfe not utf-8",  # line 7
        _line(GOOD[2]),
        _line(GOOD[3]),
    ]
    path.write_bytes(b"\n".join(lines) + b'\n{"step": 5, "lo')  # line 10, no newline: a write cut short
    return lines


def test_read_step_log_skips_and_names_each_unreadable_line(tmp_path, caplog):
    log = tmp_path / rundir.METRICS_FILE
    _bad_log(log)
    with caplog.at_level(logging.WARNING, logger="opsd.rundir"):
        assert rundir.read_step_log(log) == GOOD
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 5 and all(m.startswith(f"{log} line ") for m in warned)
    assert "line 2 is not valid JSON (Expecting value); skipped: 'garbage appended by hand'" in warned[0]
    assert "line 4 is a JSON array, not an object; skipped: '[1, 2, 3]'" in warned[1]
    assert "line 6 is a JSON object whose step is a JSON string, not a number" in warned[2]
    assert "line 7 is not UTF-8 text; skipped" in warned[3]
    assert "line 10 is a partial last line (no newline at the end" in warned[4]
    assert warned[4].endswith("""skipped: '{"step": 5, "lo'""")


def test_read_step_log_excerpt_is_short_and_a_missing_log_is_empty(tmp_path, caplog):
    log = tmp_path / rundir.COMPLETIONS_FILE
    log.write_text("x" * 5000 + "\n" + json.dumps({"step": 1}) + "\n")
    with caplog.at_level(logging.WARNING, logger="opsd.rundir"):
        assert rundir.read_step_log(str(log)) == [{"step": 1}]
    (message,) = [r.getMessage() for r in caplog.records]
    assert "line 1 is not valid JSON" in message and len(message) < len(str(log)) + 200
    assert rundir.read_step_log(tmp_path / "absent.jsonl") == []


def test_trim_step_log_drops_unreadable_lines_into_rejected(tmp_path, caplog):
    log = tmp_path / rundir.METRICS_FILE
    lines = _bad_log(log)
    with caplog.at_level(logging.WARNING, logger="opsd.rundir"):
        rundir.trim_step_log(log, 2)
    # Steps past the checkpoint are still cut; what no reader can parse is gone from the log...
    assert log.read_bytes() == _line(GOOD[0]) + b"\n" + _line(GOOD[1]) + b"\n"
    # ... and kept, byte for byte, beside it.
    rejected = rundir.rejected_log(log)
    assert rejected == tmp_path / "metrics.jsonl.rejected"
    assert (
        rejected.read_bytes()
        == b"\n".join([lines[1], lines[3], lines[5], lines[6], b'{"step": 5, "lo']) + b"\n"
    )
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [m.split(" is ")[0] for m in warned] == [f"{log} line {n}" for n in (2, 4, 6, 7, 10)]
    assert all(f"dropped from the log on resume and kept in {rejected}" in m for m in warned)
    assert "'garbage appended by hand'" in warned[0]
    # A second resume appends to the rejected lines; a clean log is left as it is.
    with log.open("ab") as f:
        f.write(b"more garbage\n" + _line({"step": 3}) + b"\n")
    rundir.trim_step_log(log, 2)
    assert rejected.read_bytes().endswith(b'{"step": 5, "lo\nmore garbage\n')
    assert rundir.read_step_log(log) == GOOD[:2]
    caplog.clear()
    rundir.trim_step_log(log, 2)
    assert not caplog.records and log.read_bytes() == _line(GOOD[0]) + b"\n" + _line(GOOD[1]) + b"\n"


def test_trim_step_log_keeps_a_whole_last_record_without_its_newline(tmp_path):
    log = tmp_path / rundir.METRICS_FILE
    log.write_bytes(_line(GOOD[0]) + b"\n" + _line(GOOD[1]))
    rundir.trim_step_log(log, 2)
    assert log.read_bytes() == _line(GOOD[0]) + b"\n" + _line(GOOD[1]) + b"\n"
    assert not rundir.rejected_log(log).exists()


def test_training_curves_read_through_read_step_log(tmp_path, caplog):
    from opsd.run.curves import read_metrics

    (tmp_path / rundir.METRICS_FILE).write_text(
        json.dumps({"step": 1, "loss": 1.0}) + "\nnot json\n" + json.dumps({"step": 2, "loss": 0.5}) + "\n"
    )
    with caplog.at_level(logging.WARNING, logger="opsd.rundir"):
        assert read_metrics(tmp_path)["loss"] == [(1, 1.0), (2, 0.5)]  # a bad middle line no longer stops it
    assert "metrics.jsonl line 2 is not valid JSON" in caplog.text
