"""Benchmark: where the training half of one OPSD optimizer step spends its time, by phase and by kernel, with
no rollout engine (docs/performance.md c: 2.65-2.73 s at 32 x 1024 on one H200).

    python bench/train_profile.py --out bench/results/train_profile_h200.json [--lengths 1024,2048] \
        [--micro auto] [--steps 5] [--trace]

Per LENGTH the step is `opsd_train.py`'s with the published recipe (random-weight Qwen3-1.7B, bf16, LoRA r64
on q,k,v,o,gate,up,down, fixed teacher, beta 0, per-entry clip 0.05, gradient checkpointing, 32 problems split
as `micro_batch_size=auto` splits them beside vLLM at 0.6 of the GPU, or `--micro N`) but for the rollout:
the injected engine `FixedRollouts` (the trainer's rollout engine) returns LENGTH random
non-special token ids per problem. A warm-up step, `--steps` steps timed by CUDA events, one profiled step:
- phases (medians): student forward, teacher forward, loss (the rest of `compute_loss`), backward (student
  recompute and backward); their sum is the training half (`time/train_micro_s` without the rollout);
  `steady`: medians of the steps whose padded student and teacher widths all came in an earlier step (on
  the H200 at 1024, a student width new to the process cost up to 1.8 s more, a new teacher width 0.9 s);
- the profiled step's top 25 kernels by GPU time, and the families all its kernels fall in: LoRA (peft's
  LoRA layers less their base linears), loss chunk (`compute_loss` less both forwards) and optimizer by
  profiler range (backward work by its forward op's), the others by kernel name (the JSON lists both);
- the half's matrix FLOPs (bench/opsd_step.py's estimate on the step's padded rows), TFLOP/s, peak memory.
The JSON is rewritten after each length; `--trace` saves the first length's profiled step (Chrome trace) next
to it. On a CPU (`--device cpu --model DIR`, the tests) the table lists CPU ops by self time instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import shutil
import statistics
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
from torch.autograd import DeviceType
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback

from common import machine, qwen3_1p7b_dir, write
from opsd.method.rollouts import TransformersRolloutEngine
from opsd_step import BF16_DENSE_FLOPS
from opsd_trainer import OPSDTrainer

# A kernel's (CPU op's) family: by the nearest of these profiler ranges around the op that launched it (for
# backward work, around the forward op that recorded its node), else by the first name pattern that matches.
RANGES, BACKWARD = ("opsd/", "Optimizer."), "autograd::engine::evaluate_function"
RANGE_FAMILIES = {"opsd/lora": "LoRA", "opsd/score_loss": "loss chunk", "Optimizer.": "optimizer"}
NAME_FAMILIES = {
    "attention": r"flash|fmha|attention|sdpa|_attn",
    "GEMM": r"gemm|gemv|nvjet|cutlass|cublas|xmma|splitk|^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$",
    "optimizer": r"multi_tensor_apply|adam|_foreach_",
    "elementwise+norm+rotary+activation": r"elementwise|reduce|norm|rotary|silu|softmax|at::native|triton|^aten::",
}
FAMILIES = [*NAME_FAMILIES, "LoRA", "loss chunk", "other"]
SPANS = ("student_forward", "teacher_forward", "score_loss", "backward")
PHASES = ["train_half_s", "student_forward_s", "teacher_forward_s", "loss_s", "backward_s", "student_s"]
CLOCK = ["time/train_micro_s", "time/score_loss_s", "time/rollout_s", "time/optimizer_s", "time/step_s"]


class Spans:
    """Named spans of the current step, each also a profiler range `opsd/<name>`: seconds by CUDA events (read
    in `take`, which synchronises) or, on a CPU, by the wall clock."""

    def __init__(self, cuda: bool):
        self.cuda, self.open, self.done = cuda, {}, []

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        (event := torch.cuda.Event(enable_timing=True)).record()
        return event

    def start(self, name: str) -> None:
        self.open[name] = (torch.profiler.record_function(f"opsd/{name}").__enter__(), self._now())

    def stop(self, name: str) -> None:
        rf, t0 = self.open.pop(name)
        self.done.append((name, t0, self._now()))
        rf.__exit__(None, None, None)

    def take(self) -> dict[str, float]:
        if self.cuda:
            torch.cuda.synchronize()
        out = dict.fromkeys(SPANS, 0.0)
        for name, a, b in self.done:
            out[name] += a.elapsed_time(b) / 1000 if self.cuda else b - a
        self.done = []
        return out


class FixedRollouts(TransformersRolloutEngine):
    """A rollout engine that returns `length` random non-special token ids per prompt, seeded by the step."""

    def __init__(self, length: int):
        super().__init__()
        self.length = length

    def generate(self, prompt_ids, *, step: int, num_generations: int):
        t = self.trainer
        tok, vocab = t.processing_class, t.accelerator.unwrap_model(t.model).config.vocab_size
        allowed = torch.tensor(sorted(set(range(min(len(tok), vocab))) - set(tok.all_special_ids)))
        gen = torch.Generator().manual_seed(t.args.seed + step)
        pick = torch.randint(len(allowed), (len(prompt_ids), self.length), generator=gen)
        return allowed[pick].tolist(), None


class _TimedForwards:
    """The scoring core's forwards (`opsd.method.scoring`), each timed as the student's or the teacher's span."""

    def __init__(self, forwards, trainer):
        self.forwards, self.trainer = forwards, trainer

    @property
    def transform(self):
        return self.forwards.transform

    def __call__(self, model, *args, **kwargs):
        name = "student_forward" if torch.is_grad_enabled() else "teacher_forward"
        self.trainer.spans.start(name)
        out = self.forwards(model, *args, **kwargs)
        self.trainer.spans.stop(name)
        return out


class FixedRolloutTrainer(OPSDTrainer):
    """OPSDTrainer with the training half's spans timed (its rollouts: `FixedRollouts`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.core.forwards = _TimedForwards(self.core.forwards, self)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        completion = inputs["completion_ids"]  # every row LENGTH tokens: no padding
        self.tokens["student"] += completion.size(0) * inputs["prompt_ids"].size(1) + completion.numel()
        self.tokens["teacher"] += inputs["teacher_input_ids"].numel()
        self.tokens["completion"] += completion.numel()
        self.widths |= {
            ("student", inputs["prompt_ids"].size(1)),
            ("teacher", inputs["teacher_input_ids"].size(1)),
        }
        self.spans.start("score_loss")
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.spans.stop("score_loss")
        self.spans.start("backward")  # stopped once TRL's training_step has run the backward
        return loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        out = super().training_step(model, inputs, num_items_in_batch)
        self.spans.stop("backward")
        return out


def annotate(model) -> list:
    """Profiler ranges around each LoRA layer (`opsd/lora`), the base linear inside it (`opsd/base`) and each
    decoder layer (`opsd/layer`), recomputation included; returns the hook handles."""
    from peft.tuners.lora import LoraLayer

    def ranged(module, name):
        stack = []
        # Kept out of torch.compile's graphs (bench/train_levers.py compiles the decoder layers).
        enter = torch.compiler.disable(
            lambda *_: stack.append(torch.profiler.record_function(name).__enter__())
        )
        leave = torch.compiler.disable(lambda *_: stack.pop().__exit__(None, None, None))
        # always_call: checkpointing's recomputation stops a layer's forward early by raising.
        return [
            module.register_forward_pre_hook(enter),
            module.register_forward_hook(leave, always_call=True),
        ]

    handles = []
    for m in model.modules():
        if isinstance(m, LoraLayer) and hasattr(m, "base_layer"):
            handles += ranged(m, "opsd/lora") + ranged(m.base_layer, "opsd/base")
        elif type(m).__name__.endswith("DecoderLayer"):
            handles += ranged(m, "opsd/layer")
    return handles


def family(name: str, tag: str | None) -> str:
    for prefix, fam in RANGE_FAMILIES.items():
        if tag is not None and tag.startswith(prefix):
            return fam
    return next((f for f, pattern in NAME_FAMILIES.items() if re.search(pattern, name, re.I)), "other")


def op_table(prof, cuda: bool, top: int = 25) -> dict:
    """The profiled step's kernels (CUDA) or CPU ops (self time): the top ones and every family's share."""
    events = sorted(prof.events(), key=lambda e: (e.time_range.start, -e.time_range.end))
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]

    def nearest(e, forward):  # nearest range, or for backward work the range of the forward op that made it
        while e is not None:
            if e.name.startswith(RANGES):
                return e.name
            if e.scope == 1 or e.name.startswith(BACKWARD):  # a node's (sequence nr, thread) in `forward`
                return forward.get((e.sequence_nr, e.fwd_thread))
            e = e.cpu_parent
        return None

    forward = {}  # in start order, the last op to see a sequence number is the one that made that node
    for e in cpu:
        if e.sequence_nr >= 0 and (tag := nearest(e, {})) is not None:
            forward[(e.sequence_nr, e.thread)] = tag
    items = defaultdict(lambda: [0, 0.0])  # (family, name) -> [calls, microseconds]
    for e in cpu:
        if cuda:
            work = [(k.name, k.duration) for k in e.kernels if k.name != e.name]
        elif not (e.is_user_annotation or e.name.startswith(RANGES)):
            work = [(e.name, e.self_cpu_time_total)]
        else:
            work = []
        for name, us in work:
            item = items[(family(name, nearest(e, forward)), name)]
            item[0], item[1] = item[0] + 1, item[1] + us
    if cuda:  # GPU work that no op launched, which the profiler's own table counts too
        gpu = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        if (rest := sum(e.time_range.elapsed_us() for e in gpu) - sum(us for _, us in items.values())) > 1:
            items[("other", "(GPU work with no launching op)")] = [0, rest]
    total = sum(us for _, us in items.values()) or 1.0
    ranked = sorted(items.items(), key=lambda kv: -kv[1][1])
    fams = Counter()
    for (fam, _), (_, us) in ranked:
        fams[fam] += us
    return {
        "unit": "CUDA kernels (GPU time)" if cuda else "CPU ops (self CPU time)",
        "total_ms": round(total / 1000, 3),
        "distinct": len(items),
        "top": [
            {
                "name": name[:200],
                "family": fam,
                "calls": calls,
                "total_ms": round(us / 1000, 3),
                "share": round(us / total, 4),
            }
            for (fam, name), (calls, us) in ranked[:top]
        ],  # fmt: skip
        "families": {
            f: {"ms": round(fams[f] / 1000, 3), "share": round(fams[f] / total, 4)} for f in FAMILIES
        },
    }


def train_flops(model_config, tokens: Counter, checkpointing: bool) -> float:
    """bench/opsd_step.py's `bounds` estimate: 2 x body weights per token and pass (student forward, its recompute
    with checkpointing, activation backward with frozen base weights; teacher forward) and three lm_head
    products per completion token; attention scores and LoRA left out."""
    from opsd.speed.microbatch import ModelShape

    s = ModelShape.from_config(model_config)
    body = s.params - s.vocab * s.hidden * (1 if getattr(model_config, "tie_word_embeddings", False) else 2)
    student = (3 if checkpointing else 2) * tokens["student"]
    return 2 * body * (student + tokens["teacher"]) + 6 * s.hidden * s.vocab * tokens["completion"]


def summary(rows: list[dict]) -> dict:
    """Medians over `rows` (steps) of the phases and of the FLOP rate."""
    median = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {
        "steps": len(rows),
        "phases_s": {k: round(median(k), 4) for k in PHASES},
        "train_tflop": float(f"{median('train_tflop'):.4g}"),
        "train_tflop_per_s": float(f"{median('train_tflop_per_s'):.4g}"),
    }


class Driver(TrainerCallback):
    """Step 0 warms up, steps 1..n are timed, step n+1 runs under the profiler; records each step's phases."""

    def __init__(self, trainer: FixedRolloutTrainer, steps: int, cuda: bool):
        self.trainer, self.steps, self.cuda = trainer, steps, cuda
        self.records, self.prof, self.hooks, self.seen = [], None, [], set()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.tokens.clear()
        self.trainer.widths.clear()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        if len(self.records) == self.steps + 1:
            self.hooks = annotate(self.trainer.model)
            acts = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * self.cuda
            self.prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=False)
            self.prof.start()

    def on_step_end(self, args, state, control, **kwargs):
        s, n, tokens = self.trainer.spans.take(), len(self.records), dict(self.trainer.tokens)
        if n == self.steps + 1:
            self.prof.stop()
            for h in self.hooks:
                h.remove()
        student, teacher, back = s["student_forward"], s["teacher_forward"], s["backward"]
        half, loss = s["score_loss"] + back, s["score_loss"] - student - teacher
        flops = train_flops(self.trainer.model.config, tokens, args.gradient_checkpointing)
        phases = [half, student, teacher, loss, back, student + back]
        self.records.append(
            {
                "kind": "warmup" if n == 0 else "timed" if n <= self.steps else "profiled",
                **{k: round(v, 5) for k, v in zip(PHASES, phases, strict=True)},
                "tokens": tokens,
                "new_width": not self.trainer.widths <= self.seen,
                "train_tflop": flops / 1e12,
                "train_tflop_per_s": flops / half / 1e12,
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if self.cuda else None,
            }
        )
        self.seen |= self.trainer.widths


def run_length(a, length: int, model_dir: Path, trace: Path | None, lever: dict | None = None) -> dict:
    """One length's row; `lever` (bench/train_levers.py) adds config fields."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from opsd.configuration.config import OPSDConfig
    from opsd.launch.preflight import build_paired_dataset
    from opsd.method.lora_targets import resolve_targets
    from opsd.method.prompts import PromptBuilder
    from opsd.models import load_tokenizer, resolve_attn_implementation
    from opsd.speed import microbatch

    cuda, work = a.device == "cuda", tempfile.mkdtemp(prefix="train-profile-")
    config = OPSDConfig(
        output_dir=work, model_name_or_path=str(model_dir), dataset_name="builtin", max_steps=a.steps + 2,
        per_device_train_batch_size=a.problems, gradient_accumulation_steps=1, micro_batch_size=a.micro,
        max_completion_length=length, gradient_checkpointing=True, rollout_engine="transformers", use_vllm=False,
        use_cpu=not cuda, bf16=cuda, dtype="bfloat16" if cuda else "float32", save_strategy="no",
        logging_steps=1, report_to="none", probe_steps=0, completions_steps=0, disable_tqdm=True,
        **(lever or {}),
    )  # fmt: skip
    dataset, _ = build_paired_dataset(config)
    if cuda:  # as opsd_train.py decides it before the model loads, beside a colocated engine
        builder = PromptBuilder.from_config(load_tokenizer(str(model_dir), False), config)
        config, plan = microbatch.resolve(
            config, dataset, str(model_dir), colocated_engine=True, prompt_builder=builder
        )
    else:
        config = microbatch.apply(config, plan := microbatch.plan_for(config))
    attention = resolve_attn_implementation("auto") if cuda else "sdpa"
    dtype = torch.bfloat16 if cuda else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attention)
    lora = LoraConfig(r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                      **resolve_targets(model, config.lora_target_modules, lora_dropout=config.lora_dropout), task_type="CAUSAL_LM")  # fmt: skip
    trainer = FixedRolloutTrainer(model=model, args=config, train_dataset=dataset, engine=FixedRollouts(length),
                                  processing_class=load_tokenizer(str(model_dir)), peft_config=lora)  # fmt: skip
    trainer.spans, trainer.tokens, trainer.widths = Spans(cuda), Counter(), set()
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(driver := Driver(trainer, a.steps, cuda))
    try:
        trainer.train()
        timed = [r for r in driver.records if r["kind"] == "timed"]
        steady = [r for r in timed if not r["new_width"]]
        logs = [r for r in trainer.state.log_history if 2 <= r.get("step", 0) <= a.steps + 1]
        if trace is not None:
            driver.prof.export_chrome_trace(str(trace))
        recipe = ("lora_r", "lora_alpha", "lora_target_modules", "teacher_mode", "beta", "clip_mode",
                  "divergence_clip", "loss_chunk_size", "gradient_checkpointing", "bf16")  # fmt: skip
        row = {
            "length": length, "status": "ok", "micro_batch": plan.micro_batch, "accumulation": plan.accumulation,
            "micro_batch_plan": dataclasses.asdict(plan), "recipe": {k: getattr(config, k) for k in recipe},
            "attn_implementation": model.config._attn_implementation, "dtype": str(model.dtype),
            "timed": summary(timed), "steady": summary(steady) if steady else None,
            "peak_gib": max(r["peak_gib"] for r in timed) if cuda else None,
            "trainer_clock_s": {k: round(statistics.median(r[k] for r in logs if k in r), 4)
                                for k in CLOCK if any(k in r for r in logs)},
            "steps": driver.records,
            "profile": {"phases_s": {k: driver.records[-1][k] for k in PHASES}, **op_table(driver.prof, cuda)},
        }  # fmt: skip
        if cuda:
            best = (row["steady"] or row["timed"])["train_tflop_per_s"]
            row["share_of_bf16_dense_peak"] = round(best * 1e12 / BF16_DENSE_FLOPS, 3)
        return row
    finally:
        driver.trainer = driver.prof = trainer = model = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default="bench/results/train_profile.json")
    ap.add_argument("--lengths", default="1024,2048", help="comma-separated completion lengths")
    ap.add_argument("--micro", default="auto", help="rows per micro-batch, or auto (as beside vLLM at 0.6)")
    ap.add_argument(
        "--steps", type=int, default=5, help="timed steps (after a warm-up, before the profiled one)"
    )
    ap.add_argument("--problems", type=int, default=32, help="problems per optimizer step")
    ap.add_argument("--model", default="/tmp/qwen3-1.7b-random", help="model directory (without config.json: "
                    "the random-weight Qwen3-1.7B is built there)")  # fmt: skip
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--trace", action="store_true", help="save the first length's profiled step (large)")
    a = ap.parse_args()
    if a.steps < 1 or (a.device == "cuda" and not torch.cuda.is_available()):
        raise SystemExit("needs --steps >= 1 and, without a GPU, --device cpu (and a small --model)")
    out, model_dir = Path(a.out), qwen3_1p7b_dir(a.model)
    config = {"model": str(model_dir), "device": a.device, "problems_per_step": a.problems, "micro": a.micro,
              "timed_steps": a.steps, "rollout": "fixed: LENGTH random non-special token ids per problem",
              "micro_auto": "as opsd_train.py picks it beside a vLLM engine at gpu_memory_utilization 0.6",
              "families": FAMILIES, "family_ranges": RANGE_FAMILIES, "family_patterns": NAME_FAMILIES,
              "bf16_dense_peak_flops": BF16_DENSE_FLOPS}  # fmt: skip
    result = {"benchmark": "train_profile", "machine": machine(), "config": config, "rows": []}
    for i, length in enumerate(int(x) for x in a.lengths.split(",")):
        trace = out.with_name(f"{out.stem}_trace_{length}.json") if a.trace and i == 0 else None
        try:
            row = run_length(a, length, model_dir, trace)
        except Exception as err:  # e.g. out of memory: the other lengths still run
            traceback.print_exc()
            row = {"length": length, "status": "failed", "error": f"{type(err).__name__}: {err}"[:2000]}
        result["rows"].append(row)
        write(result, out)  # after every length: a run cut short keeps what it measured
        fams = {f: v["share"] for f, v in row.get("profile", {}).get("families", {}).items()}
        print({k: row.get(k) for k in ("length", "status", "timed", "steady")}, fams, flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
