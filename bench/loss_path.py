"""Benchmark: the loss path of one micro-batch, project vs reference, in the same process.

    python bench/loss_path.py                      # GPU: Qwen3-1.7B shape, random bf16 weights
    python bench/loss_path.py --tiny --device cpu  # a smoke run of the script itself

One micro-batch = student forward+backward on [prompt 256 ; completion C], teacher forward (adapters off) on
[teacher prompt 1024 ; completion C], and the clipped-JSD loss (docs/method.md §1, published settings), with LoRA r64
on all projections and gradient checkpointing, as in training.
- reference: both roles' logits materialised over the whole vocabulary (`model(...).logits`, as the
  reference code does) and the loss computed from them (`opsd.testing.reference_loss.opsd_loss_from_logits`, the
  unchunked function that the tests check against the naive oracle);
- project: final hidden states only, and `opsd.method.loss.chunked_opsd_loss` (logits in chunks of 1024 tokens,
  gradient computed in the forward, never all at once).
Writes bench/results/loss_path_<gpu>.json: machine, versions, config, peak memory and median time per size.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from opsd.method.hidden import completion_hidden, lm_head_weight
from opsd.method.loss import LossSettings, chunked_opsd_loss, loss_settings
from opsd.testing.reference_loss import opsd_loss_from_logits

SIZES = [(4, 1024), (8, 1024), (4, 2048), (8, 2048), (4, 4096), (16, 2048), (4, 8192)]


@functools.cache
def published_loss() -> LossSettings:
    """The published recipe's loss settings (OPSDConfig's defaults)."""
    from opsd.configuration.config import OPSDConfig

    return loss_settings(OPSDConfig(report_to="none"))


def build_model(tiny: bool, device: str):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opsd.testing.tiny import qwen3_1p7b_shape, tiny_qwen3_shape

    shape = dict(tiny_qwen3_shape(), vocab_size=512) if tiny else qwen3_1p7b_shape()
    dtype = torch.float32 if tiny else torch.bfloat16
    torch.manual_seed(0)
    cfg = Qwen3Config(**shape)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).to(dtype=dtype, device=device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    lora = LoraConfig(
        r=64,
        lora_alpha=128,
        task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    model = get_peft_model(model, lora)
    model.train()
    return model, shape["vocab_size"]


def batch(b: int, c: int, prompt: int, teacher_prompt: int, vocab: int, device: str, seed: int):
    g = torch.Generator().manual_seed(seed)

    def rows(width: int, min_len: int, left: bool):
        ids = torch.randint(10, vocab, (b, width), generator=g)
        mask = torch.ones(b, width, dtype=torch.long)
        for i in range(b):  # ragged lengths, padded on the given side
            n = int(torch.randint(min_len, width + 1, (1,), generator=g))
            if left:
                mask[i, : width - n] = 0
            else:
                mask[i, n:] = 0
        return ids.to(device), mask.to(device)

    p, pm = rows(prompt, prompt // 2, True)
    t, tm = rows(teacher_prompt, teacher_prompt // 2, True)
    cids, cm = rows(c, c // 2, False)
    return p, pm, t, tm, cids, cm


def reference_step(model, p, pm, t, tm, cids, cm):
    """Materialised logits for both roles, then the unchunked loss."""
    from opsd.method.hidden import positions

    def logits(prompt_ids, prompt_mask):
        ids = torch.cat([prompt_ids, cids], 1)
        out = model(
            input_ids=ids,
            attention_mask=torch.cat([prompt_mask, cm], 1),
            position_ids=positions(prompt_mask, cids.size(1)),
            use_cache=False,
        )
        w = prompt_ids.size(1)
        return out.logits[:, w - 1 : w - 1 + cids.size(1)]

    student = logits(p, pm)
    with torch.no_grad(), model.disable_adapter():
        teacher = logits(t, tm)
    loss, _ = opsd_loss_from_logits(student, teacher, cm, settings=published_loss(), target_ids_BT=cids)
    (loss / cm.sum()).backward()


def project_step(model, p, pm, t, tm, cids, cm):
    hs = completion_hidden(model, p, pm, cids, cm, fix_positions=True, pad_token_id=None)
    with torch.no_grad(), model.disable_adapter():
        ht = completion_hidden(model, t, tm, cids, cm, fix_positions=True, pad_token_id=None)
    w = lm_head_weight(model)
    loss, _ = chunked_opsd_loss(
        hs, ht, w, w.detach(), settings=published_loss(), target_ids_N=cids[cm.bool()]
    )
    (loss / cm.sum()).backward()


def measure(step, model, inputs, device: str, repeats: int) -> dict:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    try:
        for i in range(repeats + 1):  # the first run warms up kernels and the allocator
            model.zero_grad(set_to_none=True)
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            step(model, *inputs)
            sync()
            if i:
                times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        return {"status": "ok", "peak_gib": peak, "median_s": statistics.median(times), "times_s": times}
    except torch.OutOfMemoryError as e:
        return {"status": "oom", "error": str(e).splitlines()[0]}
    finally:
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--teacher-prompt", type=int, default=1024)
    ap.add_argument("--sizes", default=",".join(f"{b}x{c}" for b, c in SIZES))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    model, vocab = build_model(a.tiny, a.device)
    base_gib = torch.cuda.memory_allocated() / 2**30 if a.device == "cuda" else None
    rows = []
    for spec in a.sizes.split(","):
        b, c = map(int, spec.split("x"))
        inputs = batch(b, c, a.prompt, a.teacher_prompt, vocab, a.device, seed=b * 100003 + c)
        row = {"batch": b, "completion": c}
        for name, step in (("project", project_step), ("reference", reference_step)):
            row[name] = measure(step, model, inputs, a.device, a.repeats)
        if row["project"]["status"] == row["reference"]["status"] == "ok":
            row["time_ratio"] = row["project"]["median_s"] / row["reference"]["median_s"]
            if base_gib is not None:
                row["memory_ratio"] = row["project"]["peak_gib"] / row["reference"]["peak_gib"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    gpu = torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or "cpu"
    import peft
    import transformers

    result = {
        "benchmark": "loss_path",
        "machine": {"gpu": gpu, "host": platform.node(), "python": platform.python_version()},
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
        "config": {
            "model": "tiny" if a.tiny else "Qwen3-1.7B shape, random weights, bf16",
            "lora_r": 64,
            "gradient_checkpointing": True,
            "prompt": a.prompt,
            "teacher_prompt": a.teacher_prompt,
            "loss": dataclasses.asdict(published_loss()),
            "chunk_size": 1024,
            "repeats": a.repeats,
            "weights_gib": base_gib,
        },
        "rows": rows,
    }
    out = Path(a.out or Path(__file__).parent / "results" / f"loss_path_{gpu.replace(' ', '_')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"{'size':>9} {'proj GiB':>9} {'ref GiB':>9} {'proj s':>8} {'ref s':>8} {'t ratio':>8}")
    for r in rows:
        pj, rf = r["project"], r["reference"]
        print(
            f"{r['batch']}x{r['completion']:<7} {pj.get('peak_gib') or 0:9.1f} {rf.get('peak_gib') or 0:9.1f} "
            f"{pj.get('median_s', float('nan')):8.3f} {rf.get('median_s', float('nan')):8.3f} "
            f"{r.get('time_ratio', float('nan')):8.2f}  {pj['status']}/{rf['status']}"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
