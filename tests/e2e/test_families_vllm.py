"""opsd_train.py with its default rollout engine (colocated vLLM, the CPU build here) on the architecture families of
`opsd.testing.families`: two optimizer steps where this vLLM runs the family, one line naming engine, version,
family, the model type, the cause and the fix where it does not, with vLLM's own output (tracebacks included) kept
in the run directory and off both streams. The engine runs at the trainer's dtype (float32 here), so that its
log-probs of the sampled tokens are the trainer's (`rollout/logprob_gap`, ~1e-7) on every family but cohere2,
whose windows vLLM makes one key wider: there the gap shows, with its warning.

One family per engine path: olmo3 goes through vLLM 0.32's Transformers backend, which decorates the transformers
decoder class in place when the engine starts (without `opsd.method.engine_classes` the trainer's own model of
that class then fails: 'Olmo3Model' object has no attribute 'do_not_compile'; smollm3 takes the same path);
gemma3 native with sliding windows and a soft-cap; lfm2 native with short convolutions; granitemoehybrid native
with Mamba layers (as nemotron_h), MoE weights that transformers renames on load, and logits divided by 8; cohere2
native and tied with no lm_head in vLLM's class (its logits come from the embedding module, as Gemma 2's do), with
logits scaled by 4 and sliding windows that vLLM makes one key wider (gemma2, the other family whose vLLM class
has no lm_head, is checked with its attention soft-cap where it takes the push: tests/e2e/test_families_push.py). The
CPU build cannot import its Qwen3.5 module (it needs torchvision), and no longer runs Bamba, so those get the one
line; so do a rendezvous port already in use, a DeepSeek-V3 config.json without the router fields vLLM reads
(naming them), and a failure after the engine started (a prompt longer than its context, on the first generation).

Weights pushed into a running engine, family by family: tests/e2e/test_families_push.py. Every family with the
transformers engine, in process: tests/integration/test_families_training.py; every family on vLLM 0.26 at its
released shape: bench/families_gpu.py (docs/families.md).
"""

from __future__ import annotations

import json
import socket

import pytest

from opsd.testing.families import build_family
from opsd.testing.tiny import build_tokenizer
from tests.e2e.test_train_cli import run_train

pytest.importorskip("vllm")

VLLM_FAMILIES = ("olmo3", "gemma3", "lfm2", "granitemoehybrid", "cohere2")
GAP = "rollout/logprob_gap/mean"
REFUSED = {  # family: the cause its one line gives
    "qwen3_5": "vLLM's module for it (vllm.model_executor.models.qwen3_5) imports 'torchvision', which is not "
    "installed here (ModuleNotFoundError)",
    "bamba": "Model architecture BambaForCausalLM was supported in vLLM until v0.23.0",
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-families")
    tok = build_tokenizer(root / "tokenizer")
    names = {*VLLM_FAMILIES, *REFUSED, "llama"}
    dirs = {name: build_family(name, root / name, tokenizer=tok) for name in sorted(names)}
    # DeepSeek-V3 as transformers writes its config.json: without the router's topk_method and scoring_func
    bare = build_family("deepseek_v3", root / "deepseek_v3_bare", tokenizer=tok)
    config = json.loads((bare / "config.json").read_text())
    for name in ("topk_method", "scoring_func"):
        del config[name]
    (bare / "config.json").write_text(json.dumps(config))
    return {**dirs, "deepseek_v3_bare": bare}


def _args(model_dir, out, context=512):
    return [
        "--model_name_or_path", str(model_dir), "--output_dir", str(out), "--max_steps", "2",
        "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1",
        "--max_completion_length", "8", "--lora_r", "4", "--lora_alpha", "8", "--save_strategy", "no",
        "--vllm_max_model_length", str(context), "--gradient_checkpointing", "false", "--rollout_engine", "vllm",
    ]  # fmt: skip


@pytest.mark.parametrize("family", VLLM_FAMILIES)
def test_two_steps_with_colocated_vllm(family, family_dirs, tmp_path):
    out = tmp_path / "run"
    proc = run_train(_args(family_dirs[family], out), tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in steps if "loss" in r]
    assert len(losses) == 2 and all(abs(v) < 1e6 for v in losses), steps
    assert (out / "checkpoint-2" / "adapter_model.safetensors").is_file()
    assert "logit transform after the lm_head, checked against the model's logits" in proc.stderr
    if family == "granitemoehybrid":  # vLLM samples from logits / 8; the loss must use the same distribution
        assert "checked against the model's logits: scaled by 0.125" in proc.stderr
    # The engine samples from the trainer's model, at its dtype; cohere2's wider windows show in the gap.
    assert "the colocated vLLM engine runs dtype=float32" in proc.stderr
    gaps = [r[GAP] for r in steps if GAP in r]
    assert len(gaps) == 2, steps
    warning = "rollout/logprob_gap: the rollout engine's log-probs of its sampled tokens differ"
    if family == "cohere2":
        assert min(gaps) > 1e-3 and warning in proc.stderr
        assert "a sliding window one key wider: Cohere2" in proc.stderr
    else:
        assert max(gaps) < 1e-4 and warning not in proc.stderr


def _refused_in_one_line(proc, run_dir, log_name="vllm_engine_start.log", kept="vLLM's output") -> str:
    """The run's one line (exit status 2), after checking that no traceback reached either stream and that the log
    the line names (vLLM's output at start-up, the traceback after it) is in the run directory, with the
    traceback."""
    assert proc.returncode == 2, proc.stderr[-4000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("opsd_train.py: error: the colocated vLLM "), proc.stderr[-4000:]
    assert "Traceback" not in proc.stdout and "Traceback" not in proc.stderr
    log = run_dir / log_name
    assert last.endswith(f"{kept}: {log}") and "Traceback" in log.read_text()
    return last


@pytest.mark.parametrize("family", REFUSED)
def test_a_family_this_vllm_cannot_start_is_one_line(family, family_dirs, tmp_path):
    proc = run_train(_args(family_dirs[family], tmp_path / "run"), tmp_path, timeout=600)
    last = _refused_in_one_line(proc, tmp_path / "run")
    model_type = json.loads((family_dirs[family] / "config.json").read_text())["model_type"]
    assert f"(model type {model_type!r})" in last and REFUSED[family] in last
    assert "--rollout_engine transformers" in last


def test_a_rendezvous_port_in_use_is_one_line_naming_it(family_dirs, tmp_path):
    """The colocated engine's torch.distributed init binds MASTER_PORT (TRL starts it with the external launcher,
    init method env://); taken by another process, the line names the port and the variable, not the model."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_train(
            _args(family_dirs["llama"], tmp_path / "run"), tmp_path, {"MASTER_PORT": str(port)}, timeout=600
        )
    last = _refused_in_one_line(proc, tmp_path / "run")
    assert f"its rendezvous port {port} (MASTER_PORT) is already in use" in last
    assert "set MASTER_PORT to a free port" in last and "--rollout_engine" not in last


def test_a_deepseek_config_without_its_router_fields_is_one_line_naming_them(family_dirs, tmp_path):
    """transformers' DeepseekV3Config writes no topk_method or scoring_func; vLLM then builds another router and fails
    while loading the checkpoint's weights. The line names the fields and the values to add; the progress bar of
    that loading stays in the log (no fragment of it after the line)."""
    proc = run_train(_args(family_dirs["deepseek_v3_bare"], tmp_path / "run"), tmp_path, timeout=600)
    last = _refused_in_one_line(proc, tmp_path / "run")
    assert "its config.json has no topk_method or scoring_func, so vLLM built another router" in last
    assert 'add "topk_method": "noaux_tc", "scoring_func": "sigmoid" to config.json' in last
    assert "Loading safetensors" not in proc.stderr + proc.stdout
    assert "Loading safetensors" in (tmp_path / "run" / "vllm_engine_start.log").read_text()


def test_a_failure_after_the_engine_started_is_one_line(family_dirs, tmp_path):
    """The engine is up, and its first generation fails (the prompts are longer than its context): one line naming
    what failed and the fix, the trainer's progress bar ended before it, the traceback kept in the run directory's
    vllm_engine_error.log."""
    run = tmp_path / "run"
    proc = run_train(_args(family_dirs["llama"], run, context=48), tmp_path, timeout=600)
    last = _refused_in_one_line(proc, run, "vllm_engine_error.log", kept="its traceback")
    assert "engine failed on its first generation for LlamaForCausalLM (model type 'llama')" in last
    assert "maximum context length is 48 tokens" in last
    assert "raise --vllm_max_model_length" in last and "--rollout_engine" not in last
