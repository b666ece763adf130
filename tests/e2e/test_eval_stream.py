"""Streaming generation and the data-parallel claim queue of eval_aime.py (opsd/evaluation/).

References are independent of the code under test: vLLM's own batched `LLM.generate` (one request of n
samples per problem, the schedule eval_aime.py used before streaming), and a single-process run for the
data-parallel one.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from test_eval import load_script, ok, read_jsonl, run_eval

from opsd.evaluation.samples import sample_seed


class CountingEngine:
    """vLLM's LLMEngine, counting the requests in it as the engine itself reports them."""

    def __init__(self, engine):
        self.engine = engine
        self.added: list[str] = []
        self.peak = 0

    def add_request(self, request_id, *args, **kwargs):
        self.added.append(request_id)
        out = self.engine.add_request(request_id, *args, **kwargs)
        self.peak = max(self.peak, self.engine.get_num_unfinished_requests())
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.slow
def test_stream_window_bounds_requests_in_flight_and_matches_batched_generate(vllm_tiny):
    from vllm import SamplingParams

    from opsd.evaluation.eval_config import EvalConfig
    from opsd.evaluation.generate import stream, vllm_params
    from opsd.evaluation.requests import ListSource, plan_requests

    tok = vllm_tiny.llm.get_tokenizer()
    texts = ["What is 2 + 3?", "Compute 7 * 6.", "x"]
    problems = [{"id": f"q{i}", "index": i, "problem": t} for i, t in enumerate(texts)]
    prompts = [tok(t).input_ids for t in texts]
    config = EvalConfig(out="unused", n=4, max_tokens=12, seed=5)
    requests = plan_requests(
        problems, set(), config.n, config.seed, lambda p, _start: (prompts[p["index"]], config.max_tokens),
        per_sample=True, sample_major=True,
    )  # fmt: skip
    assert all(r.prompt_ids == prompts[r.problem["index"]] and r.max_tokens == 12 for r in requests)
    assert len(requests) == 12 and [r.problem["id"] for r in requests[:4]] == ["q0", "q1", "q2", "q0"]

    counting = CountingEngine(vllm_tiny.llm.llm_engine)
    finished: list[list[tuple[str, int]]] = []
    got: dict[tuple[str, int], list[int]] = {}

    def on_finished(done):
        finished.append([(r.problem["id"], r.start) for r, _ in done])
        for r, outputs in done:
            [o] = outputs
            got[(r.problem["id"], r.start)] = list(o.token_ids)

    stream(SimpleNamespace(llm_engine=counting), ListSource(requests), window=5,
           params=lambda r: vllm_params(config, r), on_finished=on_finished)  # fmt: skip
    assert counting.peak == 5  # the bound, as vLLM counts its unfinished requests, and reached
    assert len(counting.added) == 12 and len(got) == 12
    assert vllm_tiny.llm.llm_engine.get_num_unfinished_requests() == 0

    # The reference: one request of n samples per problem, seeded with sample 0's seed; vLLM seeds its
    # j-th sample with seed + j = sample_seed(seed, p, j).
    params = [
        SamplingParams(n=4, max_tokens=12, temperature=1.0, top_p=0.95, seed=sample_seed(5, p, 0))
        for p in range(3)
    ]
    outs = vllm_tiny.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    for p, out in enumerate(outs):
        for o in out.outputs:
            assert got[(f"q{p}", o.index)] == list(o.token_ids), (p, o.index)


def test_claim_queue_fair_share_and_a_dead_worker(tmp_path):
    from opsd.evaluation.requests import plan_requests
    from opsd.evaluation.workers import ClaimQueue, write_queue

    problems = [{"id": f"q{i}", "index": i} for i in range(5)]

    def prompt(p, _start):
        return [p["index"]], 3

    requests = plan_requests(problems, {("q0", 1)}, 2, 7, prompt, per_sample=True, sample_major=True)
    assert len(requests) == 9
    write_queue(tmp_path, requests, world=2)
    a, b = (ClaimQueue(tmp_path, r, problems, 7, prompt) for r in (0, 1))

    def keys(rs):
        return [(r.problem["id"], r.start) for r in rs]

    # The first worker up takes half, not the whole run, however much room its engine has.
    first = a.take(100)
    assert keys(first) == [("q0", 0), ("q1", 0), ("q2", 0), ("q3", 0), ("q4", 0)]
    assert [r.seed for r in first] == [sample_seed(7, i, 0) for i in range(5)]
    assert a.take(100) == []  # refused until one of its own requests finishes
    second = b.take(2)  # room for 2
    assert keys(second) == [("q1", 1), ("q2", 1)]
    # One of a's finishes: 2 unclaimed + 4 + 2 in flight, the share is ceil(8 / 2) = 4; a holds 4, b 2.
    a.finished(1)
    assert a.take(100) == []
    assert keys(b.take(100)) == [("q3", 1), ("q4", 1)]
    # b dies holding 4; a finishes its own and there is nothing left to take.
    a.finished(4)
    assert a.take(100) == []
    state = json.loads((tmp_path / "queue-state.json").read_text())
    assert state == {"next": 9, "in_flight": [0, 4]}

    # A worker that never starts leaves its share to the other one.
    write_queue(tmp_path, requests, world=2)
    alone = ClaimQueue(tmp_path, 0, problems, 7, prompt)
    taken = []
    while batch := alone.take(100):
        taken += keys(batch)
        alone.finished(len(batch))
    assert taken == keys(requests)
    # each worker rebuilt the requests whole: the same prompt ids, caps and seeds as planned
    assert ClaimQueue(tmp_path, 1, problems, 7, prompt).requests == requests


@pytest.mark.slow
def test_num_gpus_2_vllm_workers_draw_the_single_process_samples(
    vllm_tiny, tiny_model_dir, tmp_path, monkeypatch
):
    """Two CPU workers, each with its own vLLM engine, pulling from the queue, against one process."""
    import opsd.evaluation.generate as generate

    args = ["--model", tiny_model_dir, "--dataset", "builtin", "--limit", 5, "--n", 3, "--max-tokens", 12]
    args = [*map(str, args), "--max-model-len", "512", "--max-in-flight", "4"]
    monkeypatch.setattr(generate, "build_engine", lambda job, scratch: (vllm_tiny, None))
    assert load_script().main([*args, "--out", str(tmp_path / "one")]) == 0
    monkeypatch.undo()
    proc = ok(run_eval(*args, "--num-gpus", 2, "--out", tmp_path / "two", timeout=600))
    assert "avg@3" in proc.stdout

    def by_key(out):
        rows = read_jsonl(out / "samples.jsonl")
        keys = [(r["id"], r["idx"]) for r in rows]
        assert len(keys) == len(set(keys)) == 15
        return {(r["id"], r["idx"]): r for r in rows}

    one, two = by_key(tmp_path / "one"), by_key(tmp_path / "two")
    assert set(one) == {(f"builtin-{p:03d}", i) for p in range(5) for i in range(3)}
    for key, r in one.items():
        assert (two[key]["text"], two[key]["request_seed"]) == (r["text"], r["request_seed"]), key
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    # Who drew how many depends on which engine started first (here the first may drain the queue alone).
    assert len(summary["worker_samples"]) == 2 and sum(summary["worker_samples"]) == 15
    assert not (tmp_path / "two" / "shards").exists()
