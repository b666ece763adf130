"""The EMA teacher (`teacher_mode=ema`): TRL's LoRA EMA callback, started, kept and resumed correctly.

teacher_t = decay * teacher_{t-1} + (1 - decay) * student_t over the trainable (LoRA) weights, starting from
the initial adapter (docs/method.md §1).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl.experimental.sdft.teacher_sync import PEFTAdapterEMACallback

logger = logging.getLogger(__name__)


class InitialisedAdapterEMA(PEFTAdapterEMACallback):
    """TRL's LoRA EMA teacher, but starting from the student's initial adapter instead of zeros, kept in
    float32, saved with every checkpoint and restored on resume.

    So the EMA teacher is the initial policy at step 0 and afterwards the exponential moving average of the
    trainable weights, teacher_t = decay * teacher_{t-1} + (1 - decay) * student_t (docs/method.md §1).
    The average lives in a float32 copy (`shadow_weights`) that is cast into the teacher adapter after each
    update: in bf16, 0.999 * x rounds back to x, so a bf16 average would barely move. A resumed run reloads
    that copy from `state_file` in the checkpoint instead of restarting the teacher from the student. A step
    for which `step_skipped()` is true (non-finite, no update) leaves the teacher as it is.
    """

    def __init__(self, *args, state_file: str, step_skipped=lambda: False, **kwargs):
        super().__init__(*args, **kwargs)
        self.state_file = state_file  # its name in a checkpoint (the run directory's layout: opsd.rundir)
        self.step_skipped = step_skipped
        self._resumed: dict[str, torch.Tensor] | None = None

    def _unwrapped(self):
        return self.accelerator.unwrap_model(self.model) if self.accelerator is not None else self.model

    def _initialize_teacher_adapter(self):
        if self._initialized:
            return
        super()._initialize_teacher_adapter()
        start = self._resumed if self._resumed is not None else self._get_student_state_dict()
        device = next(iter(self._get_student_state_dict().values())).device
        self.shadow_weights = {k: v.detach().to(device, torch.float32, copy=True) for k, v in start.items()}
        self._copy_to_teacher()

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
        if not self._initialized:
            self._initialize_teacher_adapter()
        for key, student in self._get_student_state_dict().items():
            self.shadow_weights[key].mul_(1 - self.update_rate).add_(student.float(), alpha=self.update_rate)
        self._copy_to_teacher()

    def on_save(self, args, state, control, **kwargs):
        ckpt = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if state.is_world_process_zero and ckpt.is_dir() and self._initialized:
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
        expected = self._get_student_state_dict().keys()
        if shadow.keys() != expected:
            raise ValueError(
                f"{path} holds an EMA teacher for other LoRA weights ({len(shadow)} tensors, {len(expected)} "
                "expected): resume with the LoRA settings (lora_r, lora_target_modules) the run started with"
            )
        self._resumed = shadow
        if self._initialized:
            device = next(iter(self.shadow_weights.values())).device
            self.shadow_weights = {k: v.to(device, torch.float32) for k, v in shadow.items()}
            self._copy_to_teacher()
