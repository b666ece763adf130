"""Shared fixtures (a tiny Qwen3 with a locally trained tokenizer, built once per test session) and the tiers.

Tests live in three folders, and each test gets its folder's marker:
- `tests/unit`: no model (losses against a naive oracle, grading, metrics, recipes, prompts, data);
- `tests/integration`: a tiny model in this process (scoring, the trainer's pieces, the probe);
- `tests/e2e`: real engines, subprocess CLIs, the harness, several processes.
`make test-fast` runs the first two; `bash scripts/test.sh` runs all three (what CI runs).
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# Set before vLLM or the hub client is imported anywhere in the session.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# vLLM's own switch for CPU test runs: the model is traced once and run eagerly, the warmup pass is skipped,
# instead of an inductor compile at every engine start (~80 s for the embedded model on 2 cores: vLLM 0.32's
# compile cache fails to load on the CPU, so every start pays it). A test can set it to "0" to compile.
os.environ.setdefault("VLLM_CPU_CI_ENV", "1")
# One OpenMP thread per process, for the test processes and every subprocess they start: the suite runs two
# workers on two cores, and training and engine subprocesses beside them; OpenMP threads of parallel processes
# spin against each other (eval_aime.py subprocesses measured orders of magnitude slower with one per core).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

TIERS = ("unit", "integration", "e2e")


# The test files that run longest, longest first (their times: docs/results.md). `scripts/test.sh` keeps this
# order (`--no-loadscope-reorder`: pytest-xdist would otherwise start the files with the most tests first), so
# its two workers, which each take whole files, start on these and end together on the many short files instead
# of one of them running a long file alone at the end.
SLOWEST_FIRST = (
    "e2e/test_experiment_cli.py",
    "e2e/test_multiprocess.py",
    "e2e/test_eval.py",
    "e2e/test_bench_controls.py",
    "e2e/test_families_vllm.py",
    "e2e/test_train_cli.py",
    "e2e/test_sweep.py",
    "e2e/test_capped.py",
    "e2e/test_resume_config.py",
    "e2e/test_families_push.py",
)


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).resolve().parent
    missing = [name for name in SLOWEST_FIRST if not (tests / name).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py SLOWEST_FIRST names files that do not exist: {missing}")
    rank = {name: n for n, name in enumerate(SLOWEST_FIRST)}
    for item in items:
        tier = Path(str(item.fspath)).parent.name
        if tier in TIERS:
            item.add_marker(tier)
    # A stable sort: the other files, and the tests inside each file, keep their order.
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).relative_to(tests).as_posix(), len(rank)))


ENV = {
    k: os.environ[k]
    for k in (
        "HF_HUB_OFFLINE",
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "TRL_EXPERIMENTAL_SILENCE",
        "VLLM_CPU_CI_ENV",
        "OMP_NUM_THREADS",
    )
}


ROOT = Path(__file__).resolve().parents[1]
EVAL_SCRIPT = ROOT / "eval_aime.py"
# For eval_aime.py subprocesses. One thread per process: on a small CPU machine, OpenMP threads of parallel
# processes spin against each other and slow everything down by orders of magnitude.
EVAL_ENV = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "VLLM_CPU_CI_ENV": os.environ["VLLM_CPU_CI_ENV"],
    "OMP_NUM_THREADS": "1",
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def free_port() -> int:
    """A TCP port free now, for the torch.distributed rendezvous (MASTER_PORT) of one training process. TRL's
    colocated vLLM engine otherwise takes 29500 whenever it looks free: two runs started together both take
    it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def colocated_rendezvous():
    """The environment of a one-process torch.distributed rendezvous, for building (or training) a trainer
    whose engine is colocated: its own free MASTER_PORT, and RANK 0, LOCAL_RANK 0, WORLD_SIZE 1, MASTER_ADDR
    127.0.0.1. TRL's engine set-up writes this rendezvous into os.environ; set here, all five are restored on
    exit, so nothing of it is inherited by the processes later tests start (a later harness dry run in the
    same worker otherwise took itself for one rank of a distributed job)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MASTER_PORT", str(free_port()))
        for name, value in (
            ("RANK", "0"),
            ("LOCAL_RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
        ):
            patch.setenv(name, value)
        yield


def eval_argv(*args) -> list[str]:
    """The command line of `python eval_aime.py ARGS` (run it with cwd=EVAL_SCRIPT.parent, env=EVAL_ENV)."""
    return [sys.executable, str(EVAL_SCRIPT), *map(str, args)]


def run_eval(*args, timeout: int = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(eval_argv(*args), cwd=EVAL_SCRIPT.parent, env=env or EVAL_ENV,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def kill_eval_at(
    args, log_path: Path, watched: Path, lines: int, *, seconds: float, poll: float = 0.02
) -> None:
    """Start `python eval_aime.py ARGS` (output to `log_path`) and SIGKILL it once `watched` holds `lines` lines;
    fails if it exits first or `seconds` pass."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            eval_argv(*args), cwd=EVAL_SCRIPT.parent, env=EVAL_ENV, stdout=log, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + seconds
        while not (watched.is_file() and watched.read_bytes().count(b"\n") >= lines):
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{watched} got fewer than {lines} lines in time"
            time.sleep(poll)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


# The entry points `in_process` runs: script -> a call of its `main` as the script's command line makes it.
def _opsd_train(args):
    import opsd_train
    from opsd.errors import run_main

    return run_main(opsd_train.main, "opsd_train.py", args)


def _eval_aime(args):
    import eval_aime

    return eval_aime.main(args)


def _train_capped(args):
    from opsd.launch import capped

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"  # as train_capped.sh exports it and execs the module
    return capped.main(["--root", str(ROOT), *args])


IN_PROCESS = {"opsd_train.py": _opsd_train, "eval_aime.py": _eval_aime, "train_capped.sh": _train_capped}


def in_process(script: str, args, *, env: dict, cwd: Path | str) -> subprocess.CompletedProcess:
    """`script ARGS` (opsd_train.py, eval_aime.py or train_capped.sh) run in this process as its command line
    runs it, with exactly the environment `env` and the working directory `cwd`, its output and exit status
    captured as `subprocess.run` captures them; os.environ, the working directory, sys.argv and the root
    logger's handlers are restored afterwards.

    For the refusals and dry runs, whose subject is the checks before any model loads: a fresh interpreter
    would add ~7 s of imports to each. Log records go to pytest's capture, not to the captured stderr. What
    depends on the interpreter itself (settings read at import such as HF_HUB_CACHE, a launcher, a real
    run) runs the script as a subprocess instead."""
    import contextlib
    import io
    import logging
    import traceback

    args = [str(a) for a in args]
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    root_logger = logging.getLogger()
    saved_handlers = list(root_logger.handlers)
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.argv = [script, *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = IN_PROCESS[script](args)
            except SystemExit as stop:  # argparse's usage errors, as the interpreter would exit
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if not isinstance(stop.code, int | None):
                    print(stop.code, file=sys.stderr)
            except Exception:  # an uncaught exception: the interpreter's traceback and status 1
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        for handler in set(root_logger.handlers) - set(saved_handlers):
            root_logger.removeHandler(handler)
    return subprocess.CompletedProcess([script, *args], code or 0, out.getvalue(), err.getvalue())


def eval_in_process(*args) -> subprocess.CompletedProcess:
    """`run_eval(*args)` in this process (`in_process`), for evaluation refusals that come before any model
    loads."""
    return in_process("eval_aime.py", args, env=EVAL_ENV, cwd=EVAL_SCRIPT.parent)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """`proc` after checking it exited 0 (its stderr tail otherwise)."""
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture
def first_inert_lines(monkeypatch):
    """The config logs each inert-switch line once per process; a test that reads the log starts from a process
    that has said none (another test in the same worker may have said the same line first)."""
    from opsd.configuration import checks

    monkeypatch.setattr(checks, "_logged", set())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from opsd.testing.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"))


@pytest.fixture(scope="session")
def embedded_cache_dir(tmp_path_factory):
    """An OPSD_CACHE_DIR holding the embedded model, converted from its GGUF once per session: the conversion
    test checks it against the GGUF, the CLI run on the embedded model reads it (never the user's cache)."""
    from filelock import FileLock

    from opsd import models

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # one conversion for all the workers of a pytest-xdist run
    root = base / "opsd-cache"
    with FileLock(f"{root}.lock"), pytest.MonkeyPatch.context() as patch:
        root.mkdir(exist_ok=True)
        patch.setenv("OPSD_CACHE_DIR", str(root))
        models.resolve_model_path("")
    return root


@pytest.fixture(scope="session")
def vllm_tiny(tiny_model_dir):
    """One real vLLM engine on the tiny model, shared by the engine tests."""
    from opsd.evaluation.sampling import VLLMEngine

    return VLLMEngine(str(tiny_model_dir), max_model_len=512, dtype="float32")


def make_trainer(
    model_dir,
    out_dir,
    *,
    use_peft: bool = True,
    targets=("q_proj", "v_proj"),
    prompt_builder=None,
    **overrides,
):
    """The trainer of `method` (an override; opsd: OPSDTrainer) on the tiny model with transformers rollouts: 2
    problems per step, LoRA r4 on `targets` (q/v; `["auto"]` resolves them on the model as opsd_train.py does);
    `prompt_builder` as opsd_train.py passes the run's own."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.configuration.config import OPSDConfig
    from opsd.launch.preflight import build_paired_dataset
    from opsd.method.lora_targets import resolve_targets

    settings = dict(
        output_dir=str(out_dir), max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_completion_length=8, use_vllm=False, learning_rate=5e-2, save_strategy="no",
        gradient_checkpointing=False,
    )  # fmt: skip
    cfg = OPSDConfig(**{**settings, **overrides})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft = (
        LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=cfg.lora_dropout,
            **resolve_targets(model, list(targets), lora_dropout=cfg.lora_dropout),
            task_type="CAUSAL_LM",
        )  # fmt: skip
        if use_peft
        else None
    )
    from opsd import methods

    trainer_class = methods.get(cfg.method).trainer_class()
    return trainer_class(
        model=model, args=cfg, train_dataset=build_paired_dataset(cfg)[0],
        processing_class=AutoTokenizer.from_pretrained(model_dir), peft_config=peft, prompt_builder=prompt_builder,
    )  # fmt: skip


# Three problems and the three endings the "boxer" checkpoints learn for each (eval and sweep tests).
BOXER_PROBLEMS = [
    ("p0", "What is 3 + 4?", "7"),
    ("p1", "What is 2 * 4?", "8"),
    ("p2", "What is 18 / 2?", "9"),
]
BOXER_COMPLETIONS = ["\\boxed{7}", "\\boxed{8}", "I am not sure."]


def train_boxer(model_dir, base_dir, save: dict) -> float:
    """Writes a base model to `base_dir` and fine-tunes LoRA on it to end every problem's prompt with one of
    BOXER_COMPLETIONS; the adapter is saved to `save[step]` after each listed step. Returns the last loss.

    The random model's logits are nearly flat (tied embeddings of std 0.02) and LoRA cannot change the final
    norm, so the base gets a larger final-norm gain; it stays a random model that never boxes.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.method.prompts import PromptBuilder

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight.mul_(10.0)
    model.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)

    builder = PromptBuilder(tok, student_thinking=True)  # the eval script's default rendering (thinking on)
    rows = []
    for _, problem, _ in BOXER_PROBLEMS:
        prompt = builder.student_ids(problem)
        for text in BOXER_COMPLETIONS:
            rows.append((prompt, tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]))
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        mask[i, : len(p) + len(c)] = 1

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])  # fmt: skip
    peft_model = get_peft_model(model, lora)
    opt = torch.optim.Adam([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(1, max(save) + 1):
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step in save:
            peft_model.save_pretrained(save[step])
    torch.set_num_threads(threads)
    return loss.item()


def stop_at(step: int):
    """A trainer callback that ends training after optimizer step `step`, as a killed run would have (the
    step's save still runs)."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step:
                control.should_training_stop = True

    return StopAt()
