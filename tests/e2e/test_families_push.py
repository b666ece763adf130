"""Weights pushed into a running vLLM engine (the CPU build, in a process of its own) are what it samples from, on
the held-out families of `opsd.testing.families` this vLLM runs: the engine started as the trainer starts it (at the
trainer's dtype, `opsd.method.engine.engine_arguments`), `push_weights` as the trainer's sync calls it, then the
log-probs of the engine's samples, drawn with the recipe's sampling settings (temperature, top-k, top-p), against
the same processing of transformers' logits for the same weights (`opsd.run.logprob_gap`, what the trainer logs
as `rollout/logprob_gap`). Tied heads (qwen3's lm_head shares the embedding's weight; gemma2's and cohere's vLLM
classes have none and take their logits from the embedding), MoE experts (which vLLM 0.32 leaves unpacked for its
CPU kernel after a reload) and MLA attention (deepseek_v3) all take the push.

Every family has its own result: one measuring process runs them in turn and records each, and a family that fails
ends that process, so that the rest are measured in a fresh one (a crash loses only the family it happened in).
deepseek_v3 is measured a second time as on a CPU with AMX (torch's AMX probe answering yes from then on, after the
other families), where vLLM would pick its AMX MLA backend: the engine runs it on CPU_MLA, and vLLM's own choice is refused in one
line naming the kernel and the head dimension (at float32), or takes the model and then fails on the weight push
(at bfloat16, a layout it accepts), in one line too. The two-step runs through opsd_train.py:
tests/e2e/test_families_vllm.py.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from opsd.testing.families import build_family, build_tiny
from opsd.testing.tiny import build_tokenizer

pytest.importorskip("vllm")

# The held-out families this vLLM runs, and qwen3 (tied, with an lm_head that shares the embedding's weight).
PUSHED = ("llama", "granite", "cohere", "cohere2", "gemma2", "falcon_h1", "phi3", "deepseek_v3", "qwen3_moe",
          "qwen3")  # fmt: skip
AMX = "deepseek_v3@amx"  # measured as on a CPU with AMX
# A DeepSeek-V3 layout vLLM's AMX MLA kernel takes (qk_nope_head_dim a multiple of 32), in bfloat16 (its only dtype)
AMX_LAYOUT = {"qk_nope_head_dim": 32}
ROOT = Path(__file__).resolve().parents[2]


def _recipe_sampling() -> dict:
    """The recipe's rollout sampling settings (OPSDConfig's defaults)."""
    from opsd.configuration.config import OPSDConfig

    return {f.name: f.default for f in fields(OPSDConfig) if f.name in ("temperature", "top_k", "top_p")}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pushed-families")
    tok = build_tokenizer(root / "tokenizer")
    dirs = {name: build_family(name, root / name, tokenizer=tok) for name in PUSHED}
    dirs["amx_layout"] = build_tiny("deepseek_v3", root / "amx_layout", tok, **AMX_LAYOUT)
    return dirs


def _engine(model_dir, arguments: dict):
    from vllm import LLM

    from opsd.method.engine_env import single_node_engine_env

    single_node_engine_env()
    # As TRL starts the trainer's engine: the log-probs returned are those of the distribution sampled from.
    return LLM(
        model=str(model_dir), max_model_len=256, seed=0, logprobs_mode="processed_logprobs", **arguments
    )


def _sampled_logprobs(llm, model, prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine, trainer) log-probs (N,) of the engine's sampled tokens (the recipe's sampling settings): the
    engine's own, and the same processing of `model`'s logits (`sampling_logprobs`)."""
    from vllm import SamplingParams

    from opsd.run.logprob_gap import sampling_logprobs

    sampling = _recipe_sampling()
    params = SamplingParams(max_tokens=6, seed=3, logprobs=0, **sampling)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine, trainer = [], []
    for prompt, output in zip(prompts, outputs, strict=True):
        sample = output.outputs[0]
        engine += [lp[t].logprob for lp, t in zip(sample.logprobs, sample.token_ids, strict=True)]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(sample.token_ids)])).logits[0]
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(sample.token_ids))
        trainer.append(sampling_logprobs(logits[at], torch.tensor(sample.token_ids), **sampling))
    return torch.tensor(engine), torch.cat(trainer)


def _engine_gap(llm, model, prompts) -> dict[str, float]:
    """`logprob_gap_stats` of the engine's samples against `model`."""
    from opsd.run.logprob_gap import logprob_gap_stats

    engine_N, trainer_N = _sampled_logprobs(llm, model, prompts)
    return logprob_gap_stats(engine_N, trainer_N, torch.ones_like(engine_N, dtype=torch.bool))


def _windows(model, width: int) -> None:
    """Cohere2's sliding-window layers of `model` set to `width` keys."""
    model.config.sliding_window = width
    for layer in model.model.layers:
        if layer.self_attn.sliding_window is not None:
            layer.self_attn.sliding_window = width


def _mla_impls(llm) -> list[str]:
    """The attention implementations of the engine's MLA layers (the backend vLLM picked)."""
    return llm.apply_model(
        lambda m: sorted({type(x.impl).__name__ for x in m.modules() if type(x).__name__ == "MLAAttention"})
    )[0]


def measure(family: str, model_dir: str) -> dict:
    """The engine started as the trainer's (its dtype, `engine_arguments`) takes new weights through `push_weights`,
    as the trainer's sync does: the gaps of its samples' log-probs to transformers' for the old weights before the
    push, and for the new and the old weights after it; the engine's dtype; for cohere2 also the gap to
    transformers at its own window, with the trainer's warning (`LogprobGap`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.method.engine import engine_arguments, merged_named_weights, push_weights
    from opsd.models import resolve_dtype
    from opsd.run.logprob_gap import LogprobGap

    dtype = resolve_dtype("auto")  # what training loads the model in here
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(text)["input_ids"] for text in ("What is 2 + 3? Say it twice.", "Add 5 and 9, then 7.")]
    old = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    new = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():  # every weight moves: embedding, tied or untied head, experts, norms
            p.add_(torch.randn_like(p) * 0.05)
        new.get_input_embeddings().weight.mul_(4.0)  # sharper logits, which a stale head would miss
    record = {}
    llm = _engine(model_dir, engine_arguments(old))
    try:
        record["dtype"] = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
        record["trainer_dtype"] = str(dtype).removeprefix("torch.")
        if family.startswith("deepseek_v3"):
            record["mla"] = _mla_impls(llm)
        if family == "cohere2":
            # vLLM's Cohere2 attends to sliding_window + 1 keys (its reading of Cohere's training convention),
            # transformers' to sliding_window: what the trainer logs, and the reference at the engine's window
            gap = LogprobGap(dtype)
            engine_N, trainer_N = _sampled_logprobs(llm, old, prompts)
            record["at_window"] = gap.metrics(
                engine_N, trainer_N, torch.ones_like(engine_N, dtype=torch.bool)
            )
            record["warned"] = gap.warned
            for m in (old, new):
                _windows(m, m.config.sliding_window + 1)
        record["before"] = _engine_gap(llm, old, prompts)
        push_weights(
            llm,
            merged_named_weights(new),
            tie_word_embeddings=new.config.get_text_config().tie_word_embeddings,
        )
        record["new"] = _engine_gap(llm, new, prompts)
        record["old"] = _engine_gap(llm, old, prompts)
        return record
    finally:
        del llm
        gc.collect()


def amx_refusals(model_dir: str, amx_layout_dir: str, log_dir: str) -> dict[str, str]:
    """As on a CPU with AMX, vLLM's own backend choice (AMX_MLA, no CPU_MLA asked for): the tiny layout refused at
    start-up (float32); a layout the kernel takes, in bfloat16, started and then refused on the first push. Each
    the one line the trainer raises (the start's and the push's refusal contexts)."""
    from transformers import AutoModelForCausalLM

    from opsd.errors import UnsupportedModel
    from opsd.method.engine import merged_named_weights, push_weights
    from opsd.method.engine_classes import engine_failure, engine_start_refusal

    lines = {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    try:
        with engine_start_refusal(True, model, log_dir):
            _engine(model_dir, {"dtype": "float32"})
    except UnsupportedModel as refused:
        lines["start"] = str(refused)
    model = AutoModelForCausalLM.from_pretrained(amx_layout_dir, dtype=torch.bfloat16)
    llm = _engine(amx_layout_dir, {"dtype": "bfloat16"})
    lines["mla"] = ",".join(_mla_impls(llm))
    try:
        with engine_failure(model, log_dir, failed="on a weight push"):
            push_weights(llm, merged_named_weights(model), tie_word_embeddings=False)
    except UnsupportedModel as refused:
        lines["push"] = str(refused)
    return lines


# The measuring process: runs the cases named on its command line in turn, appending to the results file a line
# "START case" before each and "RESULT case {json}" after it. A case that raises records its error and ends the
# process (exit 3): the rest run in a fresh one, as after a crash. The cases named "...@amx" come last: from the
# first of them on, torch's AMX probe answers yes, and vLLM chooses its attention backends afresh.
MEASURER = """
import json, sys, traceback
import torch
results, dirs, cases = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3:]
from tests.e2e.test_families_push import amx_refusals, measure

def write(line):
    with open(results, "a") as f:
        f.write(line + "\\n")

amx = False
for case in cases:
    write("START " + case)
    family, _, isa = case.partition("@")
    if isa == "amx" and not amx:
        from vllm.v1.attention import selector

        torch.cpu._is_amx_tile_supported = amx = lambda: True
        selector._cached_get_attn_backend.cache_clear()
    try:
        if family == "amx_refusals":
            record = amx_refusals(dirs["deepseek_v3"], dirs["amx_layout"], results + ".logs")
        else:
            record = measure(family, dirs[family])
    except Exception as err:
        write("RESULT " + case + " " + json.dumps({"error": "".join(traceback.format_exception(err))[-3000:]}))
        sys.exit(3)
    write("RESULT " + case + " " + json.dumps(record))
"""


def _run_cases(cases: list[str], dirs: dict, results: Path) -> dict[str, dict]:
    """Every case's record, each from the measuring process (`MEASURER`), a fresh one after a case that failed."""
    from tests.conftest import ENV

    records: dict[str, dict] = {}
    while remaining := [c for c in cases if c not in records]:
        proc = subprocess.run([sys.executable, "-c", MEASURER, str(results), json.dumps(dirs), *remaining],
                              cwd=ROOT, env={**os.environ, **ENV}, capture_output=True, text=True,
                              timeout=900)  # fmt: skip
        started = None
        for line in results.read_text().splitlines():
            kind, case, *rest = line.split(" ", 2)
            if kind == "START":
                started = case
            else:
                records[case], started = json.loads(rest[0]), None
        if started is not None or not any(c in records for c in remaining):  # it died inside a case
            died = started or remaining[0]
            records[died] = {"error": f"the measuring process ended (status {proc.returncode}) in {died}: "
                                      f"{proc.stderr[-3000:]}"}  # fmt: skip
    return records


@pytest.fixture(scope="module")
def records(family_dirs, tmp_path_factory) -> dict[str, dict]:
    """Every case's record, measured in a process of its own (tearing an in-process engine down destroys vLLM's
    distributed state, which the session's other in-process engines, tests/conftest.py's `vllm_tiny`, need)."""
    dirs = {f: str(d) for f, d in family_dirs.items()}
    results = tmp_path_factory.mktemp("push-results") / "results.txt"
    return _run_cases([*PUSHED, AMX, "amx_refusals@amx"], dirs, results)


def _record(records, case) -> dict:
    got = records[case]
    assert "error" not in got, got["error"]
    return got


@pytest.mark.parametrize("case", [*PUSHED, AMX])
def test_pushed_weights_are_what_the_engine_samples_from(case, records):
    """After `push_weights` the engine's samples' log-probs are transformers' for the new weights (and far from
    those of the old: larger, or tokens the old weights would not sample at all); before it, the engine runs the
    family as transformers does. The engine runs at the trainer's dtype (float32 on a CPU: vLLM's CPU backend
    would otherwise run bfloat16)."""
    got = _record(records, case)
    assert got["dtype"] == got["trainer_dtype"] == "float32"
    for when in (
        "before",
        "new",
    ):  # the engine runs the family as transformers does, with its sampling settings
        assert got[when]["outside"] == 0.0 and got[when]["max"] <= 1e-4, (when, got)
    assert got["old"]["outside"] > 0 or got["old"]["max"] > 1e-2  # the push changed what it samples from
    if case.startswith("deepseek_v3"):  # vLLM's reference MLA backend, also where it would pick AMX_MLA
        assert got["mla"] == ["CPUMLAImpl"], got["mla"]


def test_cohere2s_wider_window_shows_in_the_logprob_gap(records):
    """vLLM's Cohere2 windows are one key wider than transformers': against transformers at its own window the
    rollouts come from another model, which `rollout/logprob_gap` shows and warns about (at the engine's window
    the two agree, above)."""
    got = _record(records, "cohere2")
    logged = got["at_window"]  # as `rollout/logprob_gap/*`
    assert logged["rollout/logprob_gap/mean"] > 1e-3 or logged["rollout/logprob_gap/outside"] > 1e-3, logged
    assert got["warned"]


def test_amx_mla_refusals_are_one_line(records):
    """vLLM's AMX MLA backend, where the trainer does not ask for CPU_MLA: the tiny layout (qk_nope_head_dim 16)
    refused at start-up naming the kernel and the dimension; a layout it takes (32, bfloat16) refused on the push,
    which its packing left no room for (it frees kv_b_proj)."""
    got = _record(records, "amx_refusals@amx")
    assert (
        got["start"].startswith("the colocated vLLM ")
        and " failed to start for DeepseekV3ForCausalLM" in got["start"]
    )
    assert "vLLM's AMX MLA kernel (AMX_MLA, picked on a CPU with AMX)" in got["start"]
    assert "refuses qk_nope_head_dim 16" in got["start"]
    assert "AMXMLAImpl" in got["mla"]
    assert " failed on a weight push for DeepseekV3ForCausalLM" in got["push"]
    assert "The size of tensor a (0) must match the size of tensor b (512)" in got["push"]
    assert "\n" not in got["start"] + got["push"]
