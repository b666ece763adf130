"""What OPSDTrainer does itself where TRL's SDFTTrainer has code of its own, against TRL's code run on the same
inputs: the window's split into micro-batches, and the teacher's weights in its forwards (the base for a fixed
teacher of a LoRA student, the EMA adapter for an EMA teacher)."""

import pytest
import torch
from trl.experimental.sdft import SDFTTrainer
from trl.trainer.utils import split_tensor_dict

from opsd.method.hidden import left_pad
from opsd_trainer import split_rows
from tests.conftest import make_trainer


def test_split_rows_cuts_a_window_as_trls_split(tiny_model_dir):
    ids, mask = left_pad([[1, 2], [3], [4, 5, 6], [7], [8, 9], [10]], 0, "cpu")
    batch = {
        "prompt_ids": ids,
        "prompt_mask": mask,
        "completion_ids": ids.flip(1),
        "problems": list("abcdef"),
    }
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
    trainer = make_trainer(
        tiny_model_dir, tmp_path, teacher_mode=teacher_mode, max_steps=2, completions_steps=0
    )
    trainer.train()  # the student's adapter (and an EMA teacher's) have moved away from their start
    ids = torch.tensor([trainer.prompt_builder.student_ids("What is 2 + 3?")])
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.eval()
    with torch.no_grad():
        student = _last_hidden(trainer, ids)
        with trainer.teacher_context():
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
