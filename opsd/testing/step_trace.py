"""The step path, measured: which repo files one optimizer step runs, and where it passes between the repo and
TRL/transformers.

    python -m opsd.testing.step_trace            # the published settings, vLLM colocated rollouts
    python -m opsd.testing.step_trace --engine transformers --gradient-accumulation 1

One OPSDTrainer optimizer step on the tiny model (`opsd.testing.tiny`) that starts a generation window, at the
published recipe's settings (configs/qwen3_1.7b_published.yaml: LoRA, fixed teacher, gradient accumulation 2,
gradient checkpointing, colocated vLLM; a tiny batch and completion length), traced with `sys.setprofile` from the
step's `on_step_begin` to its `on_step_end` (every micro-batch, the generation, the backward passes, the optimizer
step and the callbacks in between; logging and saving come after it).

Every Python frame is on one of three sides by its file: the repo (files under the repository root, outside
site-packages, except this tool), TRL/transformers (site-packages/trl, site-packages/transformers), or other
(torch, peft, accelerate, vLLM, the standard library, C code): other frames are transparent, a call through them
is a call from the nearest repo or TRL/transformers frame below. Counted:

- repo files: the repo files with a function that ran during the step;
- a switch: a place where control passes between the repo and TRL/transformers, i.e. a distinct (calling
  function, called function) pair whose caller is on one side and callee on the other. Each is counted once
  however often it runs (a loop over layers or micro-batches passes the same place again) and its return is
  not counted again; `crossings` is how many times such calls ran. The calling thread only (the rollout
  grading runs on its own thread, off the step's path).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from opsd.errors import UserError, run_main

PROG = "python -m opsd.testing.step_trace"
REPO = Path(__file__).resolve().parents[2]
SELF = str(Path(__file__).resolve())
MICRO_BATCH = 2  # rows per micro-batch of the traced run
# TRL, and transformers' Trainer with its callback machinery: the code that calls the trainer's hooks.
TRAINER_CODE = re.compile(r"/site-packages/(trl/|transformers/trainer[^/]*\.py$)")


def side(filename: str) -> str | None:
    """'repo', 'trl' (TRL or transformers' Trainer) or None (transparent) for a code object's file."""
    if TRAINER_CODE.search(filename):
        return "trl"
    if "/site-packages/" in filename or filename == SELF:
        return None
    if filename.startswith(str(REPO) + os.sep):
        return "repo"
    return None


@dataclass
class StepTrace:
    """What one traced step ran: repo files, switches (distinct crossing call sites) and crossings (calls)."""

    files: set[str] = field(default_factory=set)
    switches: dict[tuple[str, str], int] = field(default_factory=dict)

    @property
    def crossings(self) -> int:
        return sum(self.switches.values())

    def profile(self, frame, event, arg) -> None:
        if event != "call":
            return
        callee = side(frame.f_code.co_filename)
        if callee is None:
            return
        if callee == "repo":
            self.files.add(str(Path(frame.f_code.co_filename).resolve().relative_to(REPO)))
        caller_frame = frame.f_back
        while caller_frame is not None and side(caller_frame.f_code.co_filename) is None:
            caller_frame = caller_frame.f_back
        if caller_frame is None or side(caller_frame.f_code.co_filename) == callee:
            return
        edge = (_name(caller_frame), _name(frame))
        self.switches[edge] = self.switches.get(edge, 0) + 1

    def report(self) -> str:
        lines = [f"repo files: {len(self.files)}"]
        lines += [f"  {f}" for f in sorted(self.files)]
        lines.append(f"switches: {len(self.switches)} (crossings: {self.crossings})")
        lines += [f"  {a} -> {b} x{n}" for (a, b), n in self.switches.items()]
        return "\n".join(lines)


def _name(frame) -> str:
    code = frame.f_code
    path = Path(code.co_filename).resolve()
    where = (
        str(path.relative_to(REPO))
        if side(code.co_filename) == "repo"
        else path.parent.name + "/" + path.name
    )
    return f"{where}:{code.co_qualname}"


def trace_step(
    model_dir: Path, out_dir: Path, *, engine: str = "vllm", gradient_accumulation: int = 2, step: int = 1
) -> StepTrace:
    """Trains the tiny model at `model_dir` up to global step `step` and returns that step's trace."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from opsd.configuration.config import OPSDConfig
    from opsd.launch.preflight import build_paired_dataset
    from opsd_trainer import OPSDTrainer

    trace = StepTrace()

    class Start(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step:
                sys.setprofile(trace.profile)

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            sys.setprofile(None)

    cfg = OPSDConfig(
        output_dir=str(out_dir), max_steps=step + 1, per_device_train_batch_size=MICRO_BATCH,
        max_completion_length=8, gradient_accumulation_steps=gradient_accumulation,
        gradient_checkpointing=True, teacher_mode="fixed", beta=0.0, divergence_clip=0.05,
        clip_mode="element", temperature=1.1, top_p=0.95, top_k=20, learning_rate=5e-6,
        lr_scheduler_type="constant", max_grad_norm=0.1, save_strategy="no", report_to=[],
        use_vllm=engine == "vllm", vllm_mode="colocate", vllm_max_model_length=1024,
    )  # fmt: skip
    rows = build_paired_dataset(cfg)[0]
    # TRL's sampler drops a generation window it cannot fill: no step would run and nothing be measured.
    if len(rows) < MICRO_BATCH * gradient_accumulation:
        raise UserError(
            f"--gradient-accumulation {gradient_accumulation}: a step of {gradient_accumulation} "
            f"micro-batches of {MICRO_BATCH} rows needs more than the {len(rows)} training rows; give at "
            f"most {len(rows) // MICRO_BATCH}"
        )
    trainer = OPSDTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args=cfg,
        train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )  # fmt: skip
    trainer.callback_handler.callbacks.insert(0, Start())
    trainer.add_callback(Stop())
    try:
        trainer.train()
    finally:
        sys.setprofile(None)
    return trace


def max_accumulation() -> int:
    """The most micro-batches one traced step may take: its generation window of MICRO_BATCH x accumulation
    rows must fit in the built-in training set the trace trains on, as TRL's sampler drops a window it cannot
    fill (then no step runs and nothing is measured)."""
    from opsd.data.builtin import BUILTIN, BUILTIN_SETS

    return len(BUILTIN_SETS[BUILTIN][0](seed=0)) // MICRO_BATCH


def accumulation_steps(text: str) -> int:
    """`--gradient-accumulation`: a whole number from 1 to `max_accumulation()`; else one line saying so."""
    try:
        value = int(text)
    except ValueError:
        value = None
    most = max_accumulation()
    if value is None or not 1 <= value <= most:
        raise argparse.ArgumentTypeError(
            f"{text[:40]!r}: give a whole number from 1 to {most} (a step's micro-batches of {MICRO_BATCH} rows "
            f"must fit in the trace's {most * MICRO_BATCH} training rows, or no step runs)"
        )
    return value


class _OneLineParser(argparse.ArgumentParser):
    """argparse's refusals (a value out of range, an unknown flag) as one UserError line, not a usage."""

    def error(self, message: str):
        raise UserError(f"{message}; see {self.prog} --help")


def parse_trace_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _OneLineParser(prog=PROG, description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--engine", choices=("vllm", "transformers"), default="vllm")
    parser.add_argument(
        "--gradient-accumulation", type=accumulation_steps, default=2, metavar="N",
        help="Micro-batches of the traced step (default 2, the published recipe's).",
    )  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_trace_args(argv)
    from opsd.testing.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        trace = trace_step(
            model_dir, Path(tmp) / "run", engine=args.engine, gradient_accumulation=args.gradient_accumulation
        )
    print(trace.report())


if __name__ == "__main__":
    sys.exit(run_main(main, PROG))
