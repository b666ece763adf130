"""Benchmark: levers on the training half of the OPSD step, each against no lever in the same process.

    python bench/train_levers.py --out bench/results/train_levers_h200.json [--lengths 1024,2048] \
        [--levers none,compile,liger,liger+compile] [--steps 4]

Each (lever, length) row is `bench/train_profile.py`'s (fixed random rollouts, the published recipe on the
random-weight Qwen3-1.7B, `micro_batch_size=auto` as beside vLLM at 0.6, phases by CUDA events) with:

- `liger`: transformers' own switch `use_liger_kernel=True` (a `TrainingArguments` field, so also
  `--use_liger_kernel` on `opsd_train.py`) with Liger's RMSNorm, RoPE and SwiGLU kernels and neither of its
  cross-entropy losses: the loss stays `opsd.method.loss`;
- `compile`: `compile_layers=True` (`opsd.speed.compiled_layers`: every decoder layer compiled, LoRA and
  checkpointing inside, for the passes without a KV cache), after a warm-up step. The committed JSONs were
  measured before that switch existed, with `Module.compile()` of each decoder layer (no generation runs here,
  so the same passes were compiled).

Every row's `ratio_to_none` is its steady (else timed) training half over the `none` row's of that length,
measured in this process. Before the first Liger row, `liger_check` scores one padded batch (ragged prompts
and completions, LoRA with non-zero B) with and without the Liger kernels, for both roles, and computes the
production chunked loss and its LoRA gradient in every clip mode: relative differences in the JSON (bf16).
Liger patches some functions module-wide, so the rows run in the order given with `none` first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import traceback
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

from common import machine, qwen3_1p7b_dir, write
from train_profile import run_length

LIGER_KERNELS = {
    "rms_norm": True,
    "rope": True,
    "swiglu": True,
    "cross_entropy": False,
    "fused_linear_cross_entropy": False,
}


LIGER = {"use_liger_kernel": True, "liger_kernel_config": LIGER_KERNELS}
# Lever -> the OPSDConfig fields it sets.
LEVERS = {
    "none": {},
    "compile": {"compile_layers": True},
    "liger": LIGER,
    "liger+compile": {**LIGER, "compile_layers": True},
}


def _lora_layers(model) -> dict[str, int]:
    from peft.tuners.lora import LoraLayer

    counts: dict[str, int] = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer) and hasattr(m, "base_layer"):
            key = name.rsplit(".", 1)[-1]
            counts[key] = counts.get(key, 0) + 1
    return counts


def liger_check(model_dir: Path, seed: int = 0) -> dict:
    """The production scoring and loss on one ragged batch, without and then with the Liger kernels."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.integrations.liger import apply_liger_kernel

    from opsd.configuration.config import OPSDConfig
    from opsd.configuration.switches import CHOICES
    from opsd.method.hidden import completion_hidden, left_pad, lm_head_weight, right_pad
    from opsd.method.lora_targets import resolve_targets
    from opsd.method.loss import chunked_opsd_loss, loss_settings

    clip_modes = CHOICES["clip_mode"]

    work = tempfile.mkdtemp(prefix="liger-check-")
    cfg = OPSDConfig(output_dir=work, model_name_or_path=str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda()
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                      **resolve_targets(model, cfg.lora_target_modules), task_type="CAUSAL_LM")  # fmt: skip
    model = get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    vocab = model.config.vocab_size - 1000

    def ids(lengths):
        return [torch.randint(vocab, (n,), generator=gen).tolist() for n in lengths]

    student, teacher = ids([40, 64, 17, 55]), ids([90, 128, 70, 101])
    completion = ids([256, 131, 200, 64])
    dev = torch.device("cuda")
    s_ids, s_mask = left_pad(student, 0, dev)
    t_ids, t_mask = left_pad(teacher, 0, dev)
    c_ids, c_mask = right_pad(completion, 0, dev)

    def score() -> dict:
        out = {}
        for mode in clip_modes:
            model.zero_grad(set_to_none=True)
            h_s = completion_hidden(
                model, s_ids, s_mask, c_ids, c_mask, fix_positions=True, pad_token_id=None
            )
            with torch.no_grad():
                h_t = completion_hidden(
                    model, t_ids, t_mask, c_ids, c_mask, fix_positions=True, pad_token_id=None
                )
            w = lm_head_weight(model)
            settings = dataclasses.replace(loss_settings(cfg), clip_mode=mode)
            loss, _ = chunked_opsd_loss(
                h_s, h_t, w, w.detach(), settings=settings, target_ids_N=c_ids[c_mask.bool()]
            )
            loss.backward()
            grad = torch.cat(
                [p.grad.flatten().float() for n, p in model.named_parameters() if p.grad is not None]
            )
            out[mode] = {
                "loss": float(loss),
                "grad": torch.nan_to_num(grad),
                "finite": bool(grad.isfinite().all()),
                "h_s": h_s.detach().float(),
                "h_t": h_t.float(),
            }
        return out

    before_layers = _lora_layers(model)
    before = score()
    apply_liger_kernel(model, LIGER_KERNELS)
    after_layers = _lora_layers(model)
    after = score()
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp(min=1e-12))  # noqa: E731
    modes = {
        mode: {
            "loss_without": before[mode]["loss"],
            "loss_with": after[mode]["loss"],
            "grad_finite": [before[mode]["finite"], after[mode]["finite"]],
            "loss_rel_diff": abs(after[mode]["loss"] - before[mode]["loss"])
            / max(abs(before[mode]["loss"]), 1e-12),
            "lora_grad_rel_diff": rel(after[mode]["grad"], before[mode]["grad"]),
            "lora_grad_cosine": float(
                torch.nn.functional.cosine_similarity(after[mode]["grad"], before[mode]["grad"], dim=0)
            ),
        }
        for mode in clip_modes
    }
    first = clip_modes[0]
    return {
        "batch": {
            "rows": 4,
            "student_prompts": [len(x) for x in student],
            "teacher_prompts": [len(x) for x in teacher],
            "completions": [len(x) for x in completion],
            "dtype": "bfloat16",
        },  # fmt: skip
        "lora_layers_without": before_layers,
        "lora_layers_with": after_layers,
        "student_hidden_rel_diff": rel(after[first]["h_s"], before[first]["h_s"]),
        "teacher_hidden_rel_diff": rel(after[first]["h_t"], before[first]["h_t"]),
        "clip_modes": modes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default="bench/results/train_levers.json")
    ap.add_argument("--lengths", default="1024,2048", help="comma-separated completion lengths")
    ap.add_argument(
        "--levers", default="none,compile,liger,liger+compile", help=f"in order, from {list(LEVERS)}"
    )
    ap.add_argument("--micro", default="auto", help="rows per micro-batch, or auto (as beside vLLM at 0.6)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per row")
    ap.add_argument("--problems", type=int, default=32, help="problems per optimizer step")
    ap.add_argument(
        "--model", default="/tmp/qwen3-1.7b-random", help="model directory (built there if empty)"
    )
    a = ap.parse_args()
    levers = a.levers.split(",")
    if levers[0] != "none" or not set(levers) <= set(LEVERS):
        raise SystemExit(f"--levers must start with none and name levers from {list(LEVERS)}")
    if not torch.cuda.is_available():
        raise SystemExit("needs a GPU (Liger's kernels are Triton kernels)")
    a.device, a.trace = "cuda", False
    out, model_dir = Path(a.out), qwen3_1p7b_dir(a.model)
    result = {"benchmark": "train_levers", "machine": machine(), "rows": [], "liger_check": None,
              "config": {"model": str(model_dir), "problems_per_step": a.problems, "micro": a.micro,
                         "timed_steps": a.steps, "levers": levers, "liger_kernels": LIGER_KERNELS}}  # fmt: skip
    base: dict[int, float] = {}
    for lever in levers:
        if lever.startswith("liger") and result["liger_check"] is None:
            try:
                result["liger_check"] = liger_check(model_dir)
            except Exception as err:
                traceback.print_exc()
                result["liger_check"] = {"status": "failed", "error": f"{type(err).__name__}: {err}"[:2000]}
            write(result, out)
            print("liger_check", result["liger_check"], flush=True)
        for length in (int(x) for x in a.lengths.split(",")):
            try:
                row = run_length(a, length, model_dir, None, LEVERS[lever])
            except Exception as err:
                traceback.print_exc()
                row = {"length": length, "status": "failed", "error": f"{type(err).__name__}: {err}"[:2000]}
            row = {"lever": lever, **row}
            if row["status"] == "ok":
                half = (row["steady"] or row["timed"])["phases_s"]["train_half_s"]
                if lever == "none":
                    base[length] = half
                row["ratio_to_none"] = round(half / base[length], 4) if length in base else None
            row.pop("steps", None)
            result["rows"].append(row)
            write(result, out)
            print({k: row.get(k) for k in ("lever", "length", "status", "ratio_to_none", "peak_gib")},
                  (row.get("steady") or row.get("timed") or {}).get("phases_s"), flush=True)  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
