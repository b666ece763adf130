"""The trainer's model keeps classes of its own, out of reach of what a colocated rollout engine does to classes.

vLLM runs an architecture it has no implementation of (and any model with `vllm_model_impl=transformers`)
through its Transformers backend, which prepares the transformers decoder class for its compiler *in place*: it
appends a base class and replaces the class's `__init__` and `__call__`. The trainer's model is an instance of
that same class, built before the engine starts, so afterwards its decoder fails ("object has no attribute
'do_not_compile'"), and the replaced `__call__` calls `forward` directly, so module hooks (the hidden-state
capture of `opsd.method.hidden`) no longer run.

`own_classes` gives every transformers model class in the trainer's module tree a private subclass of the same
name that pins `__call__` and `forward` to the class's own (undecorated) ones. isinstance checks, class names
in saved configs and the engine's own model (an instance of the original class) are unaffected.

`engine_start_refusal` turns an engine that cannot start (vLLM's CPU build cannot import its Qwen3.5 module
without torchvision, say) into one line naming the engine, its version, the family, the model type the checkpoint
declares, the cause and the fix. vLLM reports such failures on its own first, with tracebacks, through a logger
that writes to the process's stdout; so the engine starts with the process's output (file descriptors 1 and 2,
which vLLM's logger, its C++ code and progress bars all write to) going to files, in the run directory's
`vllm_engine_start.partial/` while it starts (where a slow start can be followed). Once the engine is up, that
output is replayed to its streams; when it fails, it is kept in the run directory (`vllm_engine_start.log`), the
one line names that file, and nothing of it reaches the terminal unless `--debug` (or `OPSD_DEBUG=1`) is given.
A progress bar vLLM opened meanwhile (its checkpoint loading's) is closed into the kept output, so that no fragment
of it reaches the terminal after the line.

The capture is the start's alone: it swaps the process's file descriptors, so everything the process writes meanwhile
(a logging handler, the rollout grader's thread) is held back with vLLM's output. A started engine's operations (a
weight push, a generation, and the sleep and wake-up inside them) run with the streams as they are, and vLLM's lines
about them (the reload's, its progress bar) show as they happen. `engine_failure` makes a failure there (a kernel
that refuses the model's shapes only once it runs, a reload that cannot take the weights) one line too, with its
traceback kept in `vllm_engine_error.log`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from opsd.errors import UnsupportedModel, debug_requested, raised_inside

logger = logging.getLogger(__name__)

# The base class vLLM's decorator appends (vllm.compilation.wrapper); matched by name so this module needs no vLLM.
ENGINE_WRAPPER = "TorchCompileWithNoGuardsWrapper"
PINNED = ("__call__", "forward")
ENGINE_PACKAGE = "/vllm/"
OWN_CLASS_FLAG = "_opsd_own_class"
ENGINE_LOG = "vllm_engine_start.log"
ENGINE_ERROR_LOG = "vllm_engine_error.log"
# The variable that moves the rendezvous port of the colocated engine's torch.distributed init: TRL starts it with
# distributed_executor_backend="external_launcher", whose init method is env:// (MASTER_ADDR:MASTER_PORT), and
# sets MASTER_PORT to 29500 when that looks free and the variable is unset.
PORT_VARIABLE = "MASTER_PORT"
ENGINE_FIX = (
    "train with --rollout_engine transformers, or run vLLM in server mode where it runs it (docs/families.md)"
)
# A cause's length in a refusal line: enough for the message of a library, short enough for one line or two.
CAUSE_CHARS = 300
SLEEP_FIX = (
    "drop --vllm_enable_sleep_mode (or set it to false): sleep mode frees GPU memory between generations, and vLLM "
    "has it on a GPU only"
)


def clipped(text: str, limit: int = CAUSE_CHARS) -> str:
    """`text` on one line, cut to at most `limit` characters at the last space before the limit, with " [...]" after
    it, so that no identifier or number is cut midway (a word longer than half the limit is cut at the limit)."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    space = text.rfind(" ", 0, limit + 1)
    return (text[:space] if space > limit // 2 else text[:limit]) + " [...]"


def decorated(cls: type) -> bool:
    """Whether the engine's decorator has changed `cls` in place already."""
    return any(base.__name__ == ENGINE_WRAPPER for base in cls.__bases__)


def undecorated(cls: type, name: str):
    """`cls.name` as it resolved before any engine decoration: the decorator's own entries and base skipped."""
    for klass in cls.__mro__:
        if klass.__name__ == ENGINE_WRAPPER or (decorated(klass) and name in ("__init__", "__call__")):
            continue
        if name in klass.__dict__:
            return klass.__dict__[name]
    raise AttributeError(f"{cls.__name__} has no {name}")


def own_classes(model: torch.nn.Module) -> int:
    """Moves every module of `model` whose class is a transformers `PreTrainedModel` (the classes the engine
    decorates) to a private subclass with `__call__` and `forward` pinned; returns how many modules moved.
    Idempotent; call it before the engine starts and again on any model built after."""
    from transformers import PreTrainedModel

    own: dict[type, type] = {}
    moved = 0
    for module in model.modules():
        cls = type(module)
        if not isinstance(module, PreTrainedModel) or cls.__dict__.get(OWN_CLASS_FLAG):
            continue
        if cls not in own:
            attrs = {name: undecorated(cls, name) for name in PINNED}
            attrs.update(__module__=cls.__module__, __qualname__=cls.__qualname__, **{OWN_CLASS_FLAG: True})
            own[cls] = type(cls.__name__, (cls,), attrs)
        module.__class__ = own[cls]
        moved += 1
    return moved


@contextmanager
def engine_start_refusal(colocated: bool, model, log_dir: str | Path | None = None):
    """Inside the block, the colocated engine starts with the process's output captured (module docstring), and
    an error raised from vLLM's own code becomes one line (`refusal_line`); the captured output is kept in
    `log_dir` (the run directory; a temporary file without one). Other errors keep their traceback, after the
    captured output is replayed."""
    if not colocated:
        yield
        return
    with _capture_folder(log_dir) as folder:
        logger.info(
            "starting the colocated vLLM engine; its output goes to %s until it is up, then follows here",
            folder,
        )
        with _refused(model, _Capture(folder), lambda: _engine_log_path(log_dir), "to start"):
            yield


@contextmanager
def engine_failure(model, log_dir: str | Path | None, *, failed: str):
    """Inside the block (an operation of a started engine: a weight push, a generation), an error raised from vLLM's
    own code becomes one line as at start-up, naming what failed (`failed`: "on a weight push", ...), with the
    traceback kept in `log_dir`/vllm_engine_error.log (a temporary file without one). Nothing is captured: the
    process's output, vLLM's included, goes where it goes as it is written."""
    log = functools.partial(_engine_log_path, log_dir, ENGINE_ERROR_LOG)
    with _refused(model, _Uncaptured(), log, failed):
        yield


@contextmanager
def _refused(model, capture: _Capture | _Uncaptured, log: Callable[[], Path], failed: str):
    """The block's output captured; an error from vLLM's code becomes `refusal_line` with the output and the
    traceback written to `log()`, others keep their traceback after the output is replayed."""
    try:
        with capture:
            yield
    except Exception as err:
        if not raised_inside(err, ENGINE_PACKAGE):
            capture.replay()
            raise
        if debug_requested():
            capture.replay()
        for bar in _progress_bars():  # the trainer's own: its last state ends its line, before the refusal's
            bar.close()
        path = log()
        path.write_text(
            capture.text() + "\n== the error ==\n" + "".join(traceback.format_exception(err)),
            errors="replace",
        )
        line = refusal_line(err, model, capture.text(), path, failed=failed, kept=capture.kept)
        raise UnsupportedModel(line) from err
    capture.replay()


@contextmanager
def _capture_folder(log_dir: str | Path | None):
    """Where the start-up output goes while the engine starts: a folder in the run directory, where a slow or hung
    start can be followed (`tail -f`), removed afterwards; a temporary folder without a run directory."""
    if log_dir is None:
        with tempfile.TemporaryDirectory(prefix="opsd-engine-start-") as tmp:
            yield Path(tmp)
        return
    folder = _engine_log_path(log_dir).with_suffix(".partial")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class _Capture:
    """File descriptors 1 and 2 redirected to files in `folder` while inside; `replay` writes what they got to the
    streams they were meant for."""

    kept = "vLLM's output"  # what a failure's log holds, as its one line names it

    def __init__(self, folder: Path):
        self.paths = {fd: folder / name for fd, name in ((1, "stdout"), (2, "stderr"))}
        self.saved: dict[int, int] = {}
        self.bars: set[int] = set()

    def __enter__(self):
        _flush()
        self.bars = {id(bar) for bar in _progress_bars()}
        for fd, path in self.paths.items():
            self.saved[fd] = os.dup(fd)
            with open(path, "wb") as f:
                os.dup2(f.fileno(), fd)
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is not None:
            # A bar opened inside (vLLM's checkpoint loading) stays open in the error's frames and would draw itself
            # on the terminal when they are freed, after the one line: it closes here, into the captured output.
            for bar in _progress_bars():
                if id(bar) not in self.bars:
                    bar.close()
        _flush()
        for fd, saved in self.saved.items():
            os.dup2(saved, fd)
            os.close(saved)
        return False

    def text(self) -> str:
        parts = []
        for fd, name in ((1, "stdout"), (2, "stderr")):
            parts.append(f"== {name} ==\n" + self.paths[fd].read_text(errors="replace"))
        return "\n".join(parts)

    def replay(self) -> None:
        for fd, path in self.paths.items():
            data = path.read_bytes()
            while data:
                data = data[os.write(fd, data) :]


class _Uncaptured:
    """No capture: the output went where the process writes as it was written; nothing to replay or keep."""

    kept = "its traceback"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def text(self) -> str:
        return ""

    def replay(self) -> None:
        """Nothing was held back."""


def _progress_bars() -> list:
    """The tqdm progress bars open in this process (none if tqdm was never imported)."""
    std = sys.modules.get("tqdm.std")
    return list(std.tqdm._instances) if std is not None else []


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError):  # a closed or replaced stream
            pass


def _engine_log_path(log_dir: str | Path | None, name: str = ENGINE_LOG) -> Path:
    """Where a failed engine's output is kept: `log_dir`/`name` (one file per rank beyond the first), or a
    temporary file."""
    if log_dir is None:
        fd, path = tempfile.mkstemp(prefix=name.removesuffix(".log") + "-", suffix=".log")
        os.close(fd)
        return Path(path)
    rank = int(os.environ.get("RANK", "0") or 0)
    path = Path(log_dir) / (name if rank == 0 else name.replace(".log", f".rank{rank}.log"))
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def refusal_line(
    err: BaseException, model, output: str, log: Path | None, *, failed: str = "to start",
    kept: str = "vLLM's output",
) -> str:  # fmt: skip
    """The one line for an engine that failed `failed` (to start, on a weight push, on a generation): engine and
    version, the architecture and the model type the checkpoint declares (and the one it was loaded as, where they
    differ), the cause in a few words, the fix, and the file `log` that keeps what `kept` says (when one was
    written)."""
    import vllm

    config = getattr(model, "config", None)
    loaded_type = getattr(config, "model_type", type(model).__name__)
    declared = _declared(config)
    model_type = declared.get("model_type") or loaded_type
    what = f"model type {model_type!r}"
    if model_type != loaded_type:
        what += f", loaded as {loaded_type!r}"
    arch = (declared.get("architectures") or [type(model).__name__])[0]
    port = _port_in_use(err)
    if port is not None:
        cause = f"its rendezvous port {port} ({PORT_VARIABLE}) is already in use by another process"
        fix = f"set {PORT_VARIABLE} to a free port (e.g. {PORT_VARIABLE}={_free_port()}) or stop what holds {port}"
    else:
        cause, fix = _cause(err, output, config, declared)
        cause = cause.rstrip(". ")
    where = f"; {kept}: {log}" if log is not None else ""
    return f"the colocated vLLM {vllm.__version__} engine failed {failed} for {arch} ({what}): {cause}; {fix}{where}"


def _declared(config) -> dict:
    """The checkpoint's own config.json (its declared model type and architectures), where it is a directory."""
    path = Path(str(getattr(config, "_name_or_path", "") or "")) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _chain(err: BaseException) -> list[BaseException]:
    seen = []
    while err is not None and err not in seen:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def _port_in_use(err: BaseException) -> str | None:
    for e in _chain(err):
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            found = re.search(r"port:? (\d+)", text)
            return found.group(1) if found else os.environ.get(PORT_VARIABLE, "?")
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# DeepSeek-V3's router as its released config.json declares it; transformers' DeepseekV3Config does not write these.
ROUTER_FIELDS = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def _cause(err: BaseException, output: str, config=None, declared: dict | None = None) -> tuple[str, str]:
    """(the real cause in a few words, the fix): a module vLLM failed to import (reported only in its logged
    output: the error raised is a later, vaguer one), a router vLLM built without the checkpoint's fields, a
    kernel that refuses the model's shapes, sleep mode where vLLM has none, the reason in a validation error, else
    the innermost error. Library messages are cut at a word boundary (`clipped`)."""
    chain = _chain(err)
    imports = [e for e in chain if isinstance(e, ImportError)]
    if imports:
        return _missing_module(type(imports[-1]).__name__, str(imports[-1]), output), ENGINE_FIX
    # vLLM logs an import failure of a model module line by line behind its own prefix
    logged = re.findall(r"\b(ModuleNotFoundError|ImportError): (.+)$", output, flags=re.MULTILINE)
    if logged:
        return _missing_module(*logged[-1], output), ENGINE_FIX
    inner = chain[-1]
    message = " ".join(str(inner).split())
    missing = [name for name in ROUTER_FIELDS if name not in (declared or {})]
    if "e_score_correction_bias" in message and missing:
        fields = ", ".join(f'"{name}": "{ROUTER_FIELDS[name]}"' for name in missing)
        cause = (
            f"its config.json has no {' or '.join(missing)}, so vLLM built another router than the checkpoint's, "
            f"with no place for its e_score_correction_bias ({type(inner).__name__}: {clipped(message, 120)})"
        )
        return cause, f"add {fields} to config.json, as the released DeepSeek-V3 config.json files have them"
    kernel = _amx_mla_refusal(message, config) or _mla_head_refusal(message, config)
    if kernel:
        return kernel
    if "maximum context length" in message or "maximum model length" in message:
        return (
            f"{type(inner).__name__}: {clipped(message)}",
            "raise --vllm_max_model_length (the engine's context) to the longest prompt plus max_completion_length",
        )
    for e in chain:
        reason = re.search(r"Value error, (.+?)(?: \[type=|$)", " ".join(str(e).split()))
        if reason and "Sleep mode is not supported" in reason.group(1):
            return f"vLLM has no sleep mode on this platform ({clipped(reason.group(1), 80)})", SLEEP_FIX
        if reason:
            return clipped(reason.group(1)), ENGINE_FIX
    return f"{type(inner).__name__}: {clipped(message)}", ENGINE_FIX


# What runs MLA on the CPU instead of AMX_MLA: the trainer's engine asks for it (`engine_env.cpu_mla_backend`).
CPU_MLA_FIX = (
    'start vLLM with attention_backend="CPU_MLA", as the trainer\'s colocated engine and eval_aime.py do on a CPU, '
    "or train with --rollout_engine transformers"
)


def _amx_mla_refusal(message: str, config) -> tuple[str, str] | None:
    """(cause, fix) of vLLM's AMX MLA kernel refusing a model (its choice for MLA on a CPU with AMX, unless CPU_MLA
    is asked for: `opsd.method.engine_env.cpu_mla_backend`), naming the kernel and the dimension: a head dimension
    it cannot pack at start-up, float32 weights, or a weight push into the kv_b_proj it freed once it packed it."""
    kernel = "vLLM's AMX MLA kernel (AMX_MLA, picked on a CPU with AMX)"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    features = re.search(r"invalid weight input features (\d+)", message)
    if features:
        dim = getattr(text, "qk_nope_head_dim", None)
        named = f"qk_nope_head_dim {dim}" if dim is not None else f"{features.group(1)} input features"
        cause = f"{kernel} packs its weights in tiles of 32 input features and refuses {named} ({clipped(message, 80)})"
        return cause, CPU_MLA_FIX
    if message.startswith("expect weight to be bfloat16"):
        return f"{kernel} takes bfloat16 weights only ({clipped(message, 80)})", CPU_MLA_FIX
    rank = getattr(text, "kv_lora_rank", None)
    pushed = re.search(r"size of tensor a \(0\) must match the size of tensor b \((\d+)\)", message)
    if pushed and rank is not None:
        cause = (
            f"{kernel} frees kv_b_proj once it has packed it (into W_UK and W_UV, qk_nope_head_dim "
            f"{getattr(text, 'qk_nope_head_dim', '?')}), so a weight push finds no room for its kv_lora_rank {rank} "
            f"input features ({clipped(message, 80)})"
        )
        return cause, CPU_MLA_FIX
    return None


def _mla_head_sizes() -> list[int]:
    """The MLA head dimensions this vLLM takes here: its CPU kernel's on a CPU (576 only), its common ones
    elsewhere."""
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend as Backend
        else:
            from vllm.model_executor.layers.attention.mla_attention import MLACommonBackend as Backend
        return list(Backend.get_supported_head_sizes())
    except Exception:  # another vLLM, where these moved: the released layout's, which every version takes
        return [576]


def _mla_head_refusal(message: str, config) -> tuple[str, str] | None:
    """(cause, fix) of vLLM's MLA refusing the model's head dimension, kv_lora_rank + qk_rope_head_dim, with the
    sizes it takes."""
    found = re.search(r"Head dimension (\d+) is not supported by MLA", message)
    if not found:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rank, rope = getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)
    parts = (
        f" = kv_lora_rank {rank} + qk_rope_head_dim {rope}" if rank is not None and rope is not None else ""
    )
    sizes = " or ".join(map(str, _mla_head_sizes()))
    cause = (
        f"vLLM's MLA attention here takes a head dimension (kv_lora_rank + qk_rope_head_dim) of {sizes} only, and "
        f"this model's is {found.group(1)}{parts}"
    )
    return cause, (
        f"give the model a kv_lora_rank + qk_rope_head_dim of {sizes} (the released DeepSeek-V3's 512 + 64 = 576), "
        "or train with --rollout_engine transformers"
    )


def _missing_module(kind: str, message: str, output: str) -> str:
    """An import failure in a few words, naming vLLM's model module where its traceback shows it."""
    modules = [m for m in re.findall(r"vllm/model_executor/models/(\w+)\.py", output) if m != "registry"]
    module = (
        f"vLLM's module for it (vllm.model_executor.models.{modules[0]})"
        if modules
        else "vLLM's module for it"
    )
    name = re.search(r"No module named '([^']+)'", message)
    if name:
        return f"{module} imports {name.group(1)!r}, which is not installed here ({kind})"
    return f"{module} does not import here ({kind}: {clipped(message, 200)})"
