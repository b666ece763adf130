"""TRL calls every hook OPSDTrainer overrides (`TRL_HOOKS`), in the order one optimizer step runs them, and on
resume: a TRL that renamed a hook or stopped calling it would otherwise silently change the method. Beside it,
that TRL still defines each name and every override is listed."""

import inspect
import sys

from tests.conftest import make_trainer

# One generating optimizer step with transformers rollouts, as TRL calls the hooks (first call of each), then a
# checkpoint; a resume restores it before training.
STEP_ORDER = ["training_step", "_prepare_inputs", "compute_loss", "_save"]
RESUME_ORDER = ["_load_optimizer_and_scheduler", "training_step"]


def _record_trl_calls(trainer) -> list[str]:
    """Wraps every hook of `trainer` so that a call whose caller is TRL's or transformers' code is recorded."""
    calls = []
    for name in type(trainer).TRL_HOOKS:
        method = getattr(trainer, name)

        def recorded(*args, _name=name, _method=method, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "/trl/" in caller or "/transformers/" in caller:
                calls.append(_name)
            return _method(*args, **kwargs)

        setattr(trainer, name, recorded)
    return calls


def _first_calls(calls: list[str]) -> list[str]:
    return list(dict.fromkeys(calls))


def test_trl_calls_every_override_in_step_order_and_on_resume(tiny_model_dir, tmp_path):
    save = dict(max_steps=1, save_strategy="steps", save_steps=1, completions_steps=0)
    trainer = make_trainer(tiny_model_dir, tmp_path / "run", **save)
    calls = _record_trl_calls(trainer)
    trainer.train()
    assert _first_calls(calls) == STEP_ORDER
    # TRL's EMA teacher callback (its _setup_teacher_model, inside SDFTTrainer.__init__) is replaced by OPSD's
    # where TRL put it, the last of TRL's, before the step timer and the non-finite guard: a TRL that renamed
    # or stopped adding it would leave the EMA teacher without OPSD's start, state file and skipped steps.
    ema = make_trainer(tiny_model_dir, tmp_path / "ema", teacher_mode="ema", max_steps=1)
    names = [type(cb).__name__ for cb in ema.callback_handler.callbacks]
    assert names[-3:] == ["InitialisedAdapterEMA", "StepTimer", "NonFiniteGuard"], names
    assert "PEFTAdapterEMACallback" not in names

    resumed = make_trainer(tiny_model_dir, tmp_path / "run", **{**save, "max_steps": 2})
    calls = _record_trl_calls(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-1"))
    assert _first_calls(calls)[:2] == RESUME_ORDER
    assert set(calls) >= set(STEP_ORDER) - {"_save"}


def test_every_listed_hook_is_overridden_and_still_defined_by_trl():
    """Every TRL method OPSDTrainer overrides (TRL_HOOKS) is still defined by TRL's SDFTTrainer under that
    name, and every override in the class is listed."""
    from trl.experimental.sdft import SDFTTrainer

    from opsd_trainer import OPSDTrainer

    own = OPSDTrainer.__mro__[: OPSDTrainer.__mro__.index(SDFTTrainer)]
    defined = {name: member for cls in reversed(own) for name, member in vars(cls).items()}
    for name in OPSDTrainer.TRL_HOOKS:
        assert name in defined, f"{name} is listed but not overridden"
        assert callable(getattr(SDFTTrainer, name, None)), f"TRL's SDFTTrainer no longer has {name}"
    overrides = {
        name
        for name, member in defined.items()
        if inspect.isfunction(member) and name != "__init__" and hasattr(SDFTTrainer, name)
    }
    assert overrides == set(OPSDTrainer.TRL_HOOKS)
    assert set(STEP_ORDER + RESUME_ORDER) == set(OPSDTrainer.TRL_HOOKS)


# The files of OPSD's path: its trainer, its engines and its callbacks (the GRPO arms, opsd/rl, hook into TRL's
# GRPOTrainer: theirs are another trainer's names).
OPSD_PATH = [
    "opsd_trainer.py",
    *(f"opsd/{d}/*.py" for d in ("method", "run", "speed", "data", "configuration")),
]


def library_private_names() -> set[str]:
    """Private names (`_x`, not dunder) that TRL's and transformers' classes under OPSD define or set on
    themselves: SDFTTrainer's whole hierarchy (transformers' Trainer included), TRL's vLLM engine, its EMA
    callback."""
    import re

    from trl.experimental.sdft import SDFTTrainer
    from trl.experimental.sdft.teacher_sync import PEFTAdapterEMACallback
    from trl.generation.vllm_generation import VLLMGeneration

    names = set()
    for base in (SDFTTrainer, VLLMGeneration, PEFTAdapterEMACallback):
        for cls in base.__mro__[:-1]:
            names |= {n for n in vars(cls) if n.startswith("_") and not n.startswith("__")}
            names |= set(re.findall(r"self\.(_[a-z]\w*)\s*=", inspect.getsource(cls)))
    return names


def private_uses(source: str, library: set[str]) -> set[str]:
    """The library's private names that `source` overrides (a method of that name in a class with a base from a
    library), reads, writes or calls (an attribute of that name on any object), leaving out names the module
    itself defines for its own objects (a method of a class of its own, a module-level function)."""
    import ast

    tree = ast.parse(source)
    own, used = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            # A class with a base may override a library's method (its own classes count as such too: a name
            # both define is counted, never hidden).
            for item in node.body:
                names = [item.name] if isinstance(item, ast.FunctionDef) else []
                if isinstance(item, ast.Assign):
                    names = [t.id for t in item.targets if isinstance(t, ast.Name)]
                for name in names:
                    (used if node.bases and name in library else own).add(name)
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            own.add(node.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in library and node.attr not in own:
            used.add(node.attr)
    return used & library


def test_the_private_trl_names_are_the_listed_ones():
    """Every private TRL/transformers name OPSD's path overrides, calls or reads is in
    `OPSDTrainer.PRIVATE_TRL_NAMES` (at most 5, each with its reason) or is one of the model card's declarations;
    and the finder finds each kind of use in a snippet."""
    from pathlib import Path

    from opsd_trainer import OPSDTrainer

    root = Path(__file__).resolve().parents[2]
    library = library_private_names()
    assert {"_prepare_inputs", "_save", "_metrics", "_generate_transformers", "_init_vllm"} <= library
    found = set()
    for pattern in OPSD_PATH:
        for path in sorted(root.glob(pattern)):
            found |= private_uses(path.read_text(), library)
    listed = OPSDTrainer.PRIVATE_TRL_NAMES
    assert len(listed) <= 5 and all(len(why) > 40 for why in listed.values())
    assert found == set(listed) | set(OPSDTrainer.MODEL_CARD_NAMES), found
    # The finder: an override, a call through super(), a read on another object; not a name of the module's own.
    snippet = (
        "class T(SDFTTrainer):\n    def _generate(self): return super()._generate_transformers([])\n"
        "class Own:\n    def _save(self): pass\n"
        "def f(trainer): return trainer._metrics\n"
    )
    assert private_uses(snippet, library) == {"_generate", "_generate_transformers", "_metrics"}
