"""An evaluation's resolved settings (opsd.evaluation.eval_config.EvalSettings, eval_config.json) and its
requests, built whole (opsd.evaluation.requests): no model, a stand-in prompt builder."""

import dataclasses
import json
import logging
from types import SimpleNamespace

import pytest

from opsd.errors import UserError
from opsd.evaluation.eval_config import EvalConfig, EvalSettings
from opsd.evaluation.plan import missing_requests
from opsd.evaluation.requests import Prompts, plan_requests
from opsd.evaluation.samples import CONFIG_FILE, RESUME_KEYS, check_eval_resume, sample_seed
from opsd.evaluation.workers import ClaimQueue, write_queue

# eval_config.json's keys in the order every run has written them: the flags but the mode ones, then the
# resolved values. A directory written before must still resume.
SAVED_KEYS = [
    "model", "adapter", "merge_adapter", "dataset", "split", "limit", "n", "k", "temperature", "top_p",
    "top_k", "min_p", "max_tokens", "max_model_len", "thinking", "thinking_switch", "prompt_file", "seed", "engine",
    "gpu_memory_utilization", "kv_cache_dtype", "tensor_parallel_size", "num_gpus", "stream", "max_in_flight", "chunk_size",
    "out", "plot", "shard", "model_path", "adapter_path", "adapter_rank", "adapter_mode", "engine_used",
    "dataset_source", "student_template", "max_model_len_used", "step", "benchmark", "dataset_revision",
    "dataset_commit",
]  # fmt: skip


def settings(out="runs/x", **changes) -> EvalSettings:
    config = EvalConfig(out=str(out), n=3, max_tokens=10, seed=7, temperature=0.5)
    resolved = dict(
        model_path="/models/m", adapter_path="", adapter_rank=None, adapter_mode=None, engine_used="vllm",
        dataset_source="builtin", student_template="{problem}", max_model_len_used=20, step=None, benchmark=None,
        dataset_revision=None, dataset_commit=None,
    )  # fmt: skip
    return dataclasses.replace(EvalSettings.of(config, **resolved), **changes)


def test_settings_are_the_saved_config_key_for_key():
    s = settings()
    assert list(s.to_json()) == SAVED_KEYS
    assert (s.n, s.seed, s.temperature, s.max_model_len_used, s.merge_adapter) == (3, 7, 0.5, 20, "auto")
    assert set(RESUME_KEYS) <= set(SAVED_KEYS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.n = 4


def test_every_eval_range_refuses_with_the_flag_the_value_and_the_range():
    from opsd.configuration.checks import EVAL_RANGES

    assert set(EVAL_RANGES) <= {f.name for f in dataclasses.fields(EvalConfig)}
    for name, allowed in EVAL_RANGES.items():
        default = getattr(EvalConfig(out="x"), name)
        assert allowed.contains(default), name
        outside = type(default)(allowed.lo if allowed.lo_open else allowed.lo - 1)
        with pytest.raises(ValueError) as refused:
            EvalConfig(out="x", **{name: outside})
        assert str(refused.value) == f"{name}={outside!r} is invalid: {allowed.rule()}"
    with pytest.raises(ValueError, match=r"^top_p=1\.5 is invalid: must be in \(0, 1\]$"):
        EvalConfig(out="x", top_p=1.5)


def test_resume_check_writes_accepts_and_refuses(tmp_path):
    s = settings(tmp_path)
    check_eval_resume(tmp_path, s)
    saved = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert saved == s.to_json()
    check_eval_resume(tmp_path, dataclasses.replace(s, num_gpus=2, limit=5))  # not resume keys
    with pytest.raises(UserError, match=r"temperature: saved 0.5, now 1.0"):
        check_eval_resume(tmp_path, dataclasses.replace(s, temperature=1.0))
    merged = dataclasses.replace(s, adapter_path="/a", adapter_mode="merged")
    (tmp_path / CONFIG_FILE).write_text(json.dumps(merged.to_json()))
    with pytest.raises(UserError, match="--merge-adapter resumes it"):
        check_eval_resume(tmp_path, dataclasses.replace(merged, adapter_mode="vllm-lora"))


def test_resume_of_a_run_saved_before_the_kv_cache_flag(tmp_path):
    s = settings(tmp_path)
    old = s.to_json()
    del old["kv_cache_dtype"]  # eval_config.json as written before the flag existed: it ran at auto
    (tmp_path / CONFIG_FILE).write_text(json.dumps(old))
    check_eval_resume(tmp_path, s)
    with pytest.raises(UserError, match=r"kv_cache_dtype: saved 'auto', now 'fp8'"):
        check_eval_resume(tmp_path, dataclasses.replace(s, kv_cache_dtype="fp8"))


def test_resume_of_a_run_saved_before_benchmark_revisions(tmp_path):
    s = settings(tmp_path)
    old = s.to_json()
    for key in ("benchmark", "dataset_revision", "dataset_commit"):  # written before --benchmarks existed
        del old[key]
    (tmp_path / CONFIG_FILE).write_text(json.dumps(old))
    check_eval_resume(tmp_path, s)
    pinned = dataclasses.replace(
        s, benchmark="aime24", dataset_revision="2fe88a2f1091d5048c0f36abc874fb997b3dd99a"
    )
    with pytest.raises(UserError, match=r"dataset_revision: saved None, now '2fe88a2f"):
        check_eval_resume(tmp_path, pinned)


class Builder:
    """A prompt builder whose prompt of a problem is one token per character; counts its renders."""

    def __init__(self):
        self.rendered: list[str] = []

    def student_ids(self, text: str) -> list[int]:
        self.rendered.append(text)
        return list(range(len(text)))


PROBLEMS = [
    {"id": "a", "index": 0, "problem": "xy", "answer": "1"},  # 2 tokens: the full cap of 10
    {"id": "b", "index": 1, "problem": "x" * 15, "answer": "2"},  # 15 tokens: 5 left under 20
]


def job(tmp_path, problems=PROBLEMS, **changes):
    return SimpleNamespace(settings=settings(tmp_path, **changes), builder=Builder(), problems=problems,
                           out=tmp_path)  # fmt: skip


def test_requests_are_built_whole_with_each_prompt_rendered_once(tmp_path):
    j = job(tmp_path)
    requests = plan_requests(PROBLEMS, {("a", 1)}, 3, 7, Prompts(j), per_sample=True, sample_major=True)
    assert [(r.problem["id"], r.start) for r in requests] == [
        ("a", 0),
        ("b", 0),
        ("b", 1),
        ("a", 2),
        ("b", 2),
    ]
    for r in requests:
        length = len(r.problem["problem"])
        assert r.prompt_ids == list(range(length)) and r.max_tokens == min(10, 20 - length)
        assert r.seed == sample_seed(7, r.problem["index"], r.start) and r.count == 1
    assert j.builder.rendered == ["xy", "x" * 15]
    # One request per run of missing samples (transformers), with the same prompts.
    [a] = plan_requests(PROBLEMS[:1], set(), 3, 7, Prompts(j))
    assert (a.start, a.count, a.max_tokens, a.seed) == (0, 3, 10, sample_seed(7, 0, 0))


def test_a_workers_queue_hands_out_the_parents_requests(tmp_path):
    j = job(tmp_path)
    planned = plan_requests(PROBLEMS, set(), 3, 7, Prompts(j), per_sample=True, sample_major=True)
    write_queue(tmp_path, planned, world=1)
    assert ClaimQueue(tmp_path, 0, PROBLEMS, 7, Prompts(j)).take(100) == planned


def test_missing_requests_saves_the_settings_cuts_the_cap_and_refuses_a_prompt_without_room(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="opsd.evaluation.plan"):
        requests = missing_requests(job(tmp_path / "ok"))
    assert len(requests) == 6 and (tmp_path / "ok" / CONFIG_FILE).is_file()
    assert "max_tokens cut to fit max_model_len 20 for 3 request(s)" in caplog.text
    long = [{"id": "c", "index": 0, "problem": "x" * 20, "answer": "3"}]
    with pytest.raises(
        UserError, match=r"problem 'c': its prompt has 20 tokens, no room left under max_model_len 20"
    ):
        missing_requests(job(tmp_path / "long", problems=long))
