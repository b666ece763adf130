"""What OPSDTrainer does itself where TRL's SDFTTrainer has code of its own, against TRL's code run on the same
inputs: the `completions/*` metrics of a generation, the window's split into micro-batches, and the teacher's
weights in its forwards (the base for a fixed teacher of a LoRA student, the EMA adapter for an EMA teacher)."""

import pytest
import torch
from trl.experimental.sdft import SDFTTrainer
from trl.trainer.utils import split_tensor_dict

from opsd.method.hidden import left_pad, right_pad
from opsd_trainer import split_rows
from tests.conftest import make_trainer


def test_completion_metrics_are_trls(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path)
    eos, pad = trainer.eos_token_ids[0], trainer.processing_class.pad_token_id
    for rollouts in (
        [[5, 6, eos], [7, 8, 9, 10], [11, pad]],  # ended, clipped, ended on padding
        [[5, 6, 7], [8, 9, 10, 11]],  # every one clipped: TRL's terminated lengths are zeros
        [[eos], [5, eos]],
    ):
        ids, mask = right_pad(rollouts, pad, "cpu")
        batch = {
            "completion_ids": ids,
            "completion_mask": mask,
            "raw_completion_lengths": torch.tensor([len(r) for r in rollouts]),
        }
        trainer._metrics["train"].clear()
        SDFTTrainer._record_completion_metrics(trainer, "train", batch)
        trls = {key: values[0] for key, values in trainer._metrics["train"].items()}
        assert trainer._completion_metrics(rollouts) == trls, rollouts


def test_split_rows_cuts_a_window_as_trls_split(tiny_model_dir):
    ids, mask = left_pad([[1, 2], [3], [4, 5, 6], [7], [8, 9], [10]], 0, "cpu")
    batch = {"prompt_ids": ids, "prompt_mask": mask, "completion_ids": ids.flip(1), "problems": list("abcdef")}
    for parts in (1, 2, 3, 6):
        ours, trls = split_rows(batch, parts), split_tensor_dict(batch, parts)
        assert len(ours) == len(trls) == parts
        for mine, theirs in zip(ours, trls, strict=True):
            assert mine.keys() == theirs.keys()
            assert mine["problems"] == theirs["problems"]
            for key in ("prompt_ids", "prompt_mask", "completion_ids"):
                assert torch.equal(mine[key], theirs[key])


def _last_hidden(trainer, ids):
    model = trainer.accelerator.unwrap_model(trainer.teacher_model)
    return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]


@pytest.mark.parametrize("teacher_mode", ["fixed", "ema"])
def test_the_teacher_context_runs_the_weights_trls_routing_picks(tiny_model_dir, tmp_path, teacher_mode):
    trainer = make_trainer(tiny_model_dir, tmp_path, teacher_mode=teacher_mode, max_steps=2, completions_steps=0)
    trainer.train()  # the student's adapter (and an EMA teacher's) have moved away from their start
    ids = torch.tensor([trainer.prompt_builder.student_ids("What is 2 + 3?")])
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    with torch.no_grad():
        student = _last_hidden(trainer, ids)
        with trainer._get_teacher_context_for_self_distillation():
            ours = _last_hidden(trainer, ids)
        with SDFTTrainer._get_teacher_context_for_self_distillation(trainer):
            trls = _last_hidden(trainer, ids)
        again = _last_hidden(trainer, ids)
    assert torch.equal(ours, trls)
    assert not torch.allclose(ours, student)  # the routing changed the weights the forward ran
    assert torch.equal(again, student)  # and gave the student's back
    assert model.active_adapter == "default"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".default." in n for n in trainable)
