"""The step path, measured: which repo files one optimizer step runs, and where it passes between the repo and
TRL/transformers, and between the repo and every third-party library.

    python -m opsd.testing.step_trace            # the published settings, vLLM colocated rollouts
    python -m opsd.testing.step_trace --engine transformers --gradient-accumulation 1

One OPSDTrainer optimizer step on the tiny model (`opsd.testing.tiny`) that starts a generation window, at the
published recipe's settings (configs/qwen3_1.7b_published.yaml: LoRA, fixed teacher, gradient accumulation 2,
gradient checkpointing, colocated vLLM; a tiny batch and completion length), traced with `sys.setprofile` from the
step's `on_step_begin` to its `on_step_end` (every micro-batch, the generation, the backward passes, the optimizer
step and the callbacks in between; logging and saving come after it).

Two counts, each with its own sides; a frame of neither side is transparent (a call through it is a call from
the nearest frame below it that has a side):

- `switches`: the repo (files under the repository root, outside site-packages, except this tool) against
  TRL/transformers (site-packages/trl, transformers' Trainer and its callback machinery); everything else
  (torch, peft, accelerate, vLLM, the rest of transformers, the standard library, C code) is transparent. The
  calling thread only.
- `library switches`: the repo against every third-party library (site-packages: TRL, transformers, peft,
  accelerate, vLLM, math-verify, ...) as one side; torch and the standard library stay transparent. The calling
  thread and the rollout grader's (`opsd.run.step_watch.GRADER_THREAD`, traced with `threading.setprofile`,
  its work during the step counted), so the grading's calls into the tokenizer and math-verify count too
  (math-verify's timed verification runs in a worker process, which is not traced).

Counted:

- repo files: the repo files with a function that ran during the step (the calling thread);
- a switch: a place where control passes between the two sides, i.e. a distinct (calling function, called
  function) pair whose caller is on one side and callee on the other. Each is counted once however often it
  runs (a loop over layers or micro-batches passes the same place again) and its return is not counted again;
  `crossings` is how many times such calls ran.

`--json` prints the counts as one JSON object instead of the listing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from opsd.errors import UserError, run_main

PROG = "python -m opsd.testing.step_trace"
REPO = Path(__file__).resolve().parents[2]
SELF = str(Path(__file__).resolve())
MICRO_BATCH = 2  # rows per micro-batch of the traced run
# TRL, and transformers' Trainer with its callback machinery: the code that calls the trainer's hooks.
TRAINER_CODE = re.compile(r"/site-packages/(trl/|transformers/trainer[^/]*\.py$)")
# Every third-party library but torch: what the second count takes as one side against the repo.
THIRD_PARTY = re.compile(r"/site-packages/(?!torch/)")


@functools.cache
def side(filename: str) -> str | None:
    """'repo', 'trl' (TRL or transformers' Trainer) or None (transparent) for a code object's file."""
    if TRAINER_CODE.search(filename):
        return "trl"
    return "repo" if _in_repo(filename) else None


@functools.cache
def library_side(filename: str) -> str | None:
    """'repo', 'library' (any third-party library but torch) or None (torch, the standard library: transparent)
    for a code object's file."""
    if THIRD_PARTY.search(filename):
        return "library"
    return "repo" if _in_repo(filename) else None


def _in_repo(filename: str) -> bool:
    return "/site-packages/" not in filename and filename != SELF and filename.startswith(str(REPO) + os.sep)


def _switch(frame, callee: str, side_of, switches: dict[tuple[str, str], int]) -> None:
    """Counts the call of `frame` (on side `callee`) in `switches` if its caller, the nearest frame below it that
    has a side, is on the other side."""
    caller = frame.f_back
    while caller is not None and side_of(caller.f_code.co_filename) is None:
        caller = caller.f_back
    if caller is None or side_of(caller.f_code.co_filename) == callee:
        return
    edge = (_name(caller.f_code), _name(frame.f_code))
    switches[edge] = switches.get(edge, 0) + 1


@dataclass
class StepTrace:
    """What one traced step ran: repo files, and for each count its switches (distinct crossing call sites) and
    crossings (calls): `switches` (repo <-> TRL/transformers' Trainer), `library_switches` (repo <-> every
    third-party library, the calling thread's and the grader thread's, `grader_switches`, together)."""

    files: set[str] = field(default_factory=set)
    switches: dict[tuple[str, str], int] = field(default_factory=dict)
    step_library_switches: dict[tuple[str, str], int] = field(default_factory=dict)
    grader_switches: dict[tuple[str, str], int] = field(default_factory=dict)
    active: bool = False  # between the step's start and end: the grader's thread counts only then

    @property
    def crossings(self) -> int:
        return sum(self.switches.values())

    @property
    def library_switches(self) -> dict[tuple[str, str], int]:
        both = dict(self.step_library_switches)
        for edge, n in self.grader_switches.items():
            both[edge] = both.get(edge, 0) + n
        return both

    @property
    def library_crossings(self) -> int:
        return sum(self.library_switches.values())

    def profile(self, frame, event, arg) -> None:
        """The calling thread's profile (`sys.setprofile`) while the step runs."""
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if (callee := side(filename)) is not None:
            if callee == "repo":
                self.files.add(_repo_path(filename))
            _switch(frame, callee, side, self.switches)
        if (callee := library_side(filename)) is not None:
            _switch(frame, callee, library_side, self.step_library_switches)

    def grader_profile(self, frame, event, arg) -> None:
        """The rollout grader's thread's profile: its calls while the step runs."""
        if event == "call" and self.active and (callee := library_side(frame.f_code.co_filename)) is not None:
            _switch(frame, callee, library_side, self.grader_switches)

    def thread_starts(self, frame, event, arg) -> None:
        """`threading.setprofile`'s hook, run first in every thread started while it is set: the grader's
        thread keeps `grader_profile`, any other thread runs unprofiled."""
        from opsd.run.step_watch import GRADER_THREAD

        grader = threading.current_thread().name.startswith(GRADER_THREAD)
        sys.setprofile(self.grader_profile if grader else None)
        if grader:
            self.grader_profile(frame, event, arg)

    def summary(self) -> dict:
        return {
            "repo_files": sorted(self.files),
            "switches": len(self.switches),
            "crossings": self.crossings,
            "library_switches": len(self.library_switches),
            "library_crossings": self.library_crossings,
            "grader_library_switches": len(self.grader_switches),
        }

    def report(self) -> str:
        lines = [f"repo files: {len(self.files)}"]
        lines += [f"  {f}" for f in sorted(self.files)]
        lines.append(
            f"switches (repo <-> TRL/transformers' Trainer): {len(self.switches)} (crossings: {self.crossings})"
        )
        lines += [f"  {a} -> {b} x{n}" for (a, b), n in self.switches.items()]
        lines.append(
            f"library switches (repo <-> every third-party library, the grader's thread included): "
            f"{len(self.library_switches)} (crossings: {self.library_crossings}; in the grader's thread: "
            f"{len(self.grader_switches)})"
        )
        lines += [f"  {a} -> {b} x{n}" for (a, b), n in self.library_switches.items()]
        return "\n".join(lines)


@functools.cache
def _repo_path(filename: str) -> str:
    return str(Path(filename).resolve().relative_to(REPO))


@functools.cache
def _name(code) -> str:
    path = Path(code.co_filename).resolve()
    where = _repo_path(code.co_filename) if _in_repo(code.co_filename) else path.parent.name + "/" + path.name
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
                trace.active = True
                sys.setprofile(trace.profile)

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            sys.setprofile(None)
            trace.active = False

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
        callbacks=[Start()],  # before OPSD's own callbacks, so their step-begin work is traced
    )  # fmt: skip
    trainer.add_callback(Stop())
    threading.setprofile(trace.thread_starts)  # the grader's thread starts at the first generation
    try:
        trainer.train()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        trace.active = False
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
    parser.add_argument("--json", action="store_true", help="Print the counts as one JSON object.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_trace_args(argv)
    from opsd.testing.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        trace = trace_step(
            model_dir, Path(tmp) / "run", engine=args.engine, gradient_accumulation=args.gradient_accumulation
        )
    print(json.dumps({"engine": args.engine, **trace.summary()}) if args.json else trace.report())


if __name__ == "__main__":
    sys.exit(run_main(main, PROG))
