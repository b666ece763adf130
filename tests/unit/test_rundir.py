"""The run directory's layout (opsd.rundir): checkpoint names, the completion mark, step-log trimming."""

import json

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
