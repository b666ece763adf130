"""The EMA teacher (`teacher_mode=ema`): TRL's LoRA EMA callback, started, kept and resumed correctly.

teacher_t = decay * teacher_{t-1} + (1 - decay) * student_t over the trainable (LoRA) weights, starting from
the initial adapter (docs/method.md §1).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.experimental.sdft.teacher_sync import PEFTAdapterEMACallback

logger = logging.getLogger(__name__)


class InitialisedAdapterEMA(TrainerCallback):
    """TRL's LoRA EMA teacher, but starting from the student's initial adapter instead of zeros, kept in
    float32, saved with every checkpoint and restored on resume.

    So the EMA teacher is the initial policy at step 0 and afterwards the exponential moving average of the
    trainable weights, teacher_t = decay * teacher_{t-1} + (1 - decay) * student_t (docs/method.md §1).
    The average lives in a float32 copy (`shadow_weights`) that is cast into the teacher adapter after each
    update: in bf16, 0.999 * x rounds back to x, so a bf16 average would barely move. A resumed run reloads
    that copy from `state_file` in the checkpoint instead of restarting the teacher from the student. A step
    for which `step_skipped()` is true (non-finite, no update) leaves the teacher as it is.
    """

    def __init__(
        self, *, model, teacher_adapter_name: str, update_rate: float, state_file: str, sync_steps: int = 1,
        accelerator=None, step_skipped=lambda: False,
    ):  # fmt: skip
        self.model = model
        self.teacher_adapter_name = teacher_adapter_name
        self.update_rate = update_rate
        self.sync_steps = sync_steps
        self.accelerator = accelerator
        self.state_file = state_file  # its name in a checkpoint (the run directory's layout: opsd.rundir)
        self.step_skipped = step_skipped
        self.shadow_weights: dict[str, torch.Tensor] | None = None
        self.initialized = False
        self._resumed: dict[str, torch.Tensor] | None = None

    def _unwrapped(self):
        return self.accelerator.unwrap_model(self.model) if self.accelerator is not None else self.model

    def _student_state(self) -> dict[str, torch.Tensor]:
        """The student adapter's weights under peft's keys (without the adapter name)."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self._unwrapped())

    def initialize_teacher_adapter(self) -> None:
        """The teacher adapter added beside the student's with its config (zeros first, as TRL's callback makes
        it), then set to the resumed average or to the student's initial weights."""
        from peft import set_peft_model_state_dict

        if self.initialized:
            return
        model = self._unwrapped()
        student = model.active_adapter or "default"
        zeros = {k: torch.zeros_like(v) for k, v in self._student_state().items()}
        model.add_adapter(self.teacher_adapter_name, model.peft_config.get(student))
        model.set_adapter(self.teacher_adapter_name)
        set_peft_model_state_dict(model, zeros, adapter_name=self.teacher_adapter_name)
        model.set_adapter(student)
        self.initialized = True
        logger.info("Initialized PEFT adapter EMA teacher with adapter name: %s", self.teacher_adapter_name)
        start = self._resumed if self._resumed is not None else self._student_state()
        device = next(iter(self._student_state().values())).device
        self.shadow_weights = {k: v.detach().to(device, torch.float32, copy=True) for k, v in start.items()}
        self._copy_to_teacher()

    def on_train_begin(self, args, state, control, **kwargs):
        if self.accelerator is None and "accelerator" in kwargs:
            self.accelerator = kwargs["accelerator"]
        self.initialize_teacher_adapter()

    def _copy_to_teacher(self) -> None:
        from peft import set_peft_model_state_dict

        # load_state_dict copies into the existing parameters, casting to their dtype.
        set_peft_model_state_dict(
            self._unwrapped(), self.shadow_weights, adapter_name=self.teacher_adapter_name
        )

    @torch.no_grad()
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.sync_steps != 0 or self.step_skipped():
            return
        if not self.initialized:
            self.initialize_teacher_adapter()
        for key, student in self._student_state().items():
            self.shadow_weights[key].mul_(1 - self.update_rate).add_(student.float(), alpha=self.update_rate)
        self._copy_to_teacher()

    def on_save(self, args, state, control, **kwargs):
        ckpt = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and ckpt.is_dir() and self.initialized:
            shadow = {k: v.cpu() for k, v in self.shadow_weights.items()}
            torch.save({"shadow": shadow, "update_rate": self.update_rate}, ckpt / self.state_file)

    def restore(self, checkpoint_dir: str | Path) -> None:
        """Continue the average saved in `checkpoint_dir` (call before or after the teacher adapter exists)."""
        path = Path(checkpoint_dir) / self.state_file
        if not path.is_file():
            logger.warning(
                "%s has no %s (written before the EMA teacher was checkpointed): the EMA teacher restarts "
                "from the resumed student",
                checkpoint_dir,
                self.state_file,
            )
            return
        shadow = torch.load(path, map_location="cpu")["shadow"]
        expected = self._student_state().keys()
        if shadow.keys() != expected:
            raise ValueError(
                f"{path} holds an EMA teacher for other LoRA weights ({len(shadow)} tensors, {len(expected)} "
                "expected): resume with the LoRA settings (lora_r, lora_target_modules) the run started with"
            )
        self._resumed = shadow
        if self.initialized:
            device = next(iter(self.shadow_weights.values())).device
            self.shadow_weights = {k: v.to(device, torch.float32) for k, v in shadow.items()}
            self._copy_to_teacher()


def own_ema_teacher(trainer, *, step_skipped) -> str | None:
    """TRL's EMA teacher callback (the one SDFTTrainer's `__init__` adds) replaced, at the same place in the
    trainer's callbacks, by `InitialisedAdapterEMA` (`step_skipped`: whether the optimizer step just taken was
    skipped). Done after the trainer's `__init__` rather than inside TRL's teacher set-up, which runs before the
    trainer's own state exists. Returns the EMA teacher's adapter name (None without one)."""
    from opsd.rundir import EMA_TEACHER_FILE

    ema = [cb for cb in trainer.callback_handler.callbacks if type(cb) is PEFTAdapterEMACallback]
    for cb in ema:
        trainer.callback_handler.remove_callback(cb)
        trainer.add_callback(
            InitialisedAdapterEMA(
                model=cb.model,
                teacher_adapter_name=cb.teacher_adapter_name,
                update_rate=cb.update_rate,
                sync_steps=cb.sync_steps,
                accelerator=cb.accelerator,
                step_skipped=step_skipped,
                state_file=EMA_TEACHER_FILE,
            )
        )
    return ema[0].teacher_adapter_name if ema else None


def save_student_adapter(model, output_dir: str, args, processing_class, state_dict=None) -> None:
    """transformers' `_save` of a peft model with two adapters (the student's and an EMA teacher's), writing the
    active (student) adapter alone at the checkpoint's root: peft would write each adapter to a subfolder, and
    transformers' resume then loads the subfolders only, so the student would restart from its init."""
    import os

    from transformers.trainer import TRAINING_ARGS_NAME

    os.makedirs(output_dir, exist_ok=True)
    model.save_pretrained(output_dir, state_dict=state_dict, selected_adapters=[model.active_adapter])
    if args.should_save:
        processing_class.save_pretrained(output_dir)
        torch.save(args, os.path.join(output_dir, TRAINING_ARGS_NAME))
