"""A run directory belongs to one configuration: a resume with other method or budget settings is refused,
operational keys and max_steps may change, and every change is kept in opsd_config.json's history."""

from __future__ import annotations

import json

import pytest

from opsd.errors import InvalidValue
from opsd.run.resume import ALLOW_FLAG, HISTORY_KEY, check_resume, compared_keys
from tests.e2e.test_bad_input import one_line
from tests.e2e.test_train_cli import run_train, tiny_args

SAVED = {"beta": 0.0, "clip_mode": "element", "max_steps": 2, "report_to": [], "learning_rate": 5e-6,
         "micro_batch_size": "", "provenance": {"git": "a"}, "history": []}  # fmt: skip


def test_method_and_budget_changes_are_refused_naming_each_key():
    current = {**SAVED, "beta": 0.5, "clip_mode": "rescale", "learning_rate": 0.1, "provenance": {"git": "b"}}
    with pytest.raises(InvalidValue) as info:
        check_resume(SAVED, current, allow=False, where="runs/x", at_step=2)
    message = str(info.value)
    assert "\n" not in message and "3 changed" in message
    assert 'beta 0.0 -> 0.5, clip_mode "element" -> "rescale", learning_rate 5e-06 -> 0.1' in message
    assert "new --output_dir" in message and ALLOW_FLAG in message and "from step 2" in message
    assert "provenance" not in message  # versions and the git revision may differ between segments


def test_operational_keys_and_max_steps_may_change_and_are_recorded(caplog):
    current = {**SAVED, "max_steps": 4, "report_to": ["tensorboard"], "micro_batch_size": "auto"}
    history = check_resume(SAVED, current, allow=False, where="runs/x", at_step=2)
    assert len(history) == 1 and history[0]["at_step"] == 2
    assert history[0]["changed"] == {
        "max_steps": {"from": 2, "to": 4},
        "micro_batch_size": {"from": "", "to": "auto"},
        "report_to": {"from": [], "to": ["tensorboard"]},
    }
    assert "resume at step 2: max_steps 2 -> 4" in caplog.text
    # No change: the history stays as it was.
    assert (
        check_resume({**current, HISTORY_KEY: history}, current, allow=False, where="x", at_step=4) == history
    )


def test_the_micro_batch_split_may_change_but_not_the_problems_per_process():
    saved = {**SAVED, "per_device_train_batch_size": 32, "gradient_accumulation_steps": 1}
    # auto chose 32 x 1 when the run started; this command plans 4 x 8: the same 32 problems per process
    same = {**saved, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 8}
    history = check_resume(saved, same, allow=False, where="runs/x", at_step=2)
    assert set(history[0]["changed"]) == {"per_device_train_batch_size", "gradient_accumulation_steps"}
    fewer = {**saved, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 4}
    with pytest.raises(InvalidValue, match=r"problems_per_process_per_step 32 -> 16"):
        check_resume(saved, fewer, allow=False, where="runs/x", at_step=2)


def test_allowed_method_change_is_appended_to_the_history():
    earlier = [{"at_step": 1, "changed": {"max_steps": {"from": 1, "to": 2}}}]
    saved = {**SAVED, HISTORY_KEY: earlier}
    history = check_resume(saved, {**SAVED, "beta": 1.0}, allow=True, where="x", at_step=2)
    assert history[0] == earlier[0]
    assert (
        history[1]["changed"] == {"beta": {"from": 0.0, "to": 1.0}} and history[1]["allowed_by"] == ALLOW_FLAG
    )


def test_keys_missing_on_one_side_are_not_compared():
    # A file from an older release, or the process count a dry run does not know.
    assert (
        check_resume({"beta": 0.0}, {"beta": 0.0, "num_processes": 2}, allow=False, where="x", at_step=1)
        == []
    )


def test_compared_keys_cover_the_method_and_not_the_operational_keys():
    keys = compared_keys()
    assert {"beta", "clip_mode", "learning_rate", "teacher_mode", "seed", "problems_per_process_per_step",
            "model_name_or_path", "dataset_name", "lora_r", "bf16", "num_processes"} <= keys  # fmt: skip
    assert not keys & {
        "max_steps",
        "report_to",
        "run_name",
        "logging_steps",
        "micro_batch_size",
        "output_dir",
    }


def test_rerun_with_other_settings_is_refused_and_the_flag_records_it(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    base = [*tiny_args(tiny_model_dir, out), "--rollout_engine", "transformers", "--per_device_train_batch_size",
            "1", "--gradient_accumulation_steps", "1"]  # fmt: skip
    first = run_train([*base, "--max_steps", "1"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = (out / "opsd_config.json").read_bytes()
    assert json.loads(saved)[HISTORY_KEY] == []

    changed = ["--max_steps", "2", "--beta", "0.5", "--clip_mode", "rescale", "--learning_rate", "0.1",
               "--teacher_mode", "dynamic"]  # fmt: skip
    for extra in ([], ["--dry-run"]):  # the dry run refuses it too, as the real run would
        res = run_train([*base, *changed, *extra], tmp_path)
        one_line(res, "opsd_train.py: error:", "4 changed", "beta 0.0 -> 0.5", 'clip_mode "element" -> "rescale"',
                 "learning_rate", 'teacher_mode "fixed" -> "dynamic"', "--output_dir", ALLOW_FLAG)  # fmt: skip
        assert "max_steps" not in res.stderr.splitlines()[-1]  # continuing a run is allowed
    assert (out / "opsd_config.json").read_bytes() == saved and not (out / "checkpoint-2").exists()

    res = run_train([*base, *changed, "--run_name", "longer", ALLOW_FLAG], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "checkpoint-2" / ".complete").is_file()
    cfg = json.loads((out / "opsd_config.json").read_text())
    assert cfg["beta"] == 0.5 and cfg["teacher_mode"] == "dynamic" and cfg["max_steps"] == 2
    (entry,) = cfg[HISTORY_KEY]
    assert entry["at_step"] == 1 and entry["allowed_by"] == ALLOW_FLAG
    assert entry["changed"]["beta"] == {"from": 0.0, "to": 0.5}
    assert entry["changed"]["max_steps"] == {"from": 1, "to": 2}
    assert entry["changed"]["run_name"]["to"] == "longer"
    assert set(entry["changed"]) == {
        "beta",
        "clip_mode",
        "learning_rate",
        "teacher_mode",
        "max_steps",
        "run_name",
        "teacher_model_kind",  # TRL's field that OPSD derives from teacher_mode: recorded, not compared
    }
    assert "resume at step 1: beta 0.0 -> 0.5" in res.stderr
    # Continuing the run for longer with another run name needs no flag: both changes are recorded.
    res = run_train([*base, *changed[2:], "--max_steps", "3", "--run_name", "again"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "checkpoint-3" / ".complete").is_file()
    history = json.loads((out / "opsd_config.json").read_text())[HISTORY_KEY]
    assert len(history) == 2 and history[0] == entry
    assert history[1]["at_step"] == 2 and history[1]["allowed_by"] == "operational or max_steps"
    assert history[1]["changed"] == {
        "max_steps": {"from": 2, "to": 3},
        "run_name": {"from": "longer", "to": "again"},
    }


def test_a_changed_teacher_pairing_is_refused_like_any_method_key():
    assert "teacher_ref_pairing" in compared_keys()
    saved = {**SAVED, "teacher_ref_pairing": "shuffled"}
    with pytest.raises(InvalidValue, match=r'1 changed: teacher_ref_pairing "shuffled" -> "empty"'):
        check_resume(saved, {**saved, "teacher_ref_pairing": "empty"}, allow=False, where="runs/x", at_step=1)


def test_shuffled_run_resumes_with_its_saved_pairing(tiny_model_dir, tmp_path):
    """A shuffled run stopped after step 1 and rerun to step 2: the same pairing, read by every teacher of both
    segments; another pairing on resume is refused, and so is a pairing file that no longer matches."""
    from opsd.data.loading import load_train_dataset

    out = tmp_path / "run"
    yaml_config = tmp_path / "pairing.yaml"
    yaml_config.write_text("teacher_ref_pairing: shuffled\ndataset_name: builtin:easy\n")
    base = [*tiny_args(tiny_model_dir, out), "--config", str(yaml_config), "--rollout_engine", "transformers",
            "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--completions_steps",
            "1", "--completions_rows", "2", "--seed", "7"]  # fmt: skip
    first = run_train([*base, "--max_steps", "1"], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    pairing_file = out / "teacher_pairing.json"
    saved = pairing_file.read_bytes()
    res = run_train([*base, "--max_steps", "2"], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "checkpoint-2" / ".complete").is_file() and pairing_file.read_bytes() == saved

    # An independent view: the table by name, and the saved permutation over it.
    record = json.loads(saved)
    table = load_train_dataset("builtin:easy", seed=7)
    assert record["rows"] == len(table) and record["seed"] == 7
    perm = record["reference_of"]
    assert sorted(perm) == list(range(len(table))) and all(table[j]["Answer"] != r["Answer"]
                                                           for r, j in zip(table, perm, strict=True))  # fmt: skip
    paired = {table[i]["problem"]: table[perm[i]]["solution"] for i in range(len(table))}
    logged = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    # Logged at the global step before the update: 0 by the first segment, 1 by the resumed one.
    assert sorted(r["step"] for r in logged) == [0, 0, 1, 1]
    for row in logged + json.loads((out / "probe_set.json").read_text())["rows"]:
        assert row["reference"] == paired[row["problem"]], row["problem"]

    # Another pairing on resume: refused by the config check, before anything is written.
    res = run_train([*base, "--max_steps", "3", "--teacher_ref_pairing", "empty"], tmp_path)
    one_line(res, "opsd_train.py: error:", 'teacher_ref_pairing "shuffled" -> "empty"', ALLOW_FLAG)
    # The same settings but a pairing file that no longer matches (other data under the same name, say).
    tampered = {**record, "reference_of": perm[1:] + perm[:1]}
    tampered["reference_of_sha256"] = "0" * 64
    pairing_file.write_text(json.dumps(tampered))
    res = run_train([*base, "--max_steps", "3", "--dry-run"], tmp_path)
    one_line(
        res, "opsd_train.py: error:", "teacher_pairing.json differs from the pairing drawn now", ALLOW_FLAG
    )
    assert not (out / "checkpoint-3").exists()
