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
    assert overrides == set(OPSDTrainer.TRL_HOOKS) | set(OPSDTrainer.OWN_CALLS)
    assert set(STEP_ORDER + RESUME_ORDER) == set(OPSDTrainer.TRL_HOOKS)
