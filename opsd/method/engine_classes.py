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

`engine_start_refusal` turns an engine that cannot start on an architecture (vLLM's CPU build cannot import its
Qwen3.5 module without torchvision, say) into one line naming the engine, its version, the family and the
engine that works.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from opsd.errors import UnsupportedModel, raised_inside

# The base class vLLM's decorator appends (vllm.compilation.wrapper); matched by name so this module needs no vLLM.
ENGINE_WRAPPER = "TorchCompileWithNoGuardsWrapper"
PINNED = ("__call__", "forward")
ENGINE_PACKAGE = "/vllm/"
OWN_CLASS_FLAG = "_opsd_own_class"


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
def engine_start_refusal(colocated: bool, model):
    """Inside the block, an error raised from vLLM's own code while the colocated engine starts becomes one line
    naming the engine, its version, the model type and the engine that trains every family (transformers)."""
    try:
        yield
    except Exception as err:
        if not colocated or not raised_inside(err, ENGINE_PACKAGE):
            raise
        import vllm

        config = getattr(model, "config", None)
        model_type = getattr(config, "model_type", type(model).__name__)
        first = " ".join(str(err).split())[:300]
        raise UnsupportedModel(
            f"the colocated vLLM {vllm.__version__} engine failed to start for model type {model_type!r} "
            f"({type(err).__name__}: {first}); if this vLLM cannot run the architecture, train with "
            "--rollout_engine transformers, or run vLLM in server mode where it runs it (docs/families.md)"
        ) from err
