"""The teacher pairing inside the trainer (tiny model): it is handed the whole paired table, drawn before the
trainer splits rows over processes, and its teacher rows read the paired or the empty reference."""

import torch

from opsd.data.loading import load_train_dataset
from opsd.method.pairing import answer_groups, derangement
from opsd.method.prompts import TEACHER_TEMPLATE, teacher_rows
from tests.conftest import make_trainer


def test_the_trainer_gets_the_whole_table_with_the_derangement_applied(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, dataset_name="builtin:easy", seed=3,
                           teacher_ref_pairing="shuffled")  # fmt: skip
    rows = load_train_dataset("builtin:easy", seed=3)
    perm = derangement(len(rows), 3, answer_groups(rows["Answer"]))
    got = trainer.train_dataset
    assert len(got) == len(rows) == 1438  # every row: what TRL's sampler then splits over processes
    assert list(got["prompt"]) == list(rows["problem"])
    assert list(got["privileged_context"]) == [rows[j]["solution"] for j in perm]
    assert all(rows[j]["Answer"] != rows[i]["Answer"] for i, j in enumerate(perm))


def test_empty_teacher_rows_are_the_template_rendered_by_hand(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, teacher_ref_pairing="empty")
    row = trainer.train_dataset[0]
    assert row["privileged_context"] == ""
    head, tail = TEACHER_TEMPLATE.split("{reference}")
    text = head.replace("{problem}", row["prompt"]) + tail
    tok = trainer.processing_class
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=True)  # fmt: skip
    completion = torch.tensor([[5, 6, 7]])
    built, _ = teacher_rows(
        trainer.prompt_builder, [row["prompt"]], [row["privileged_context"]], completion,
        torch.ones_like(completion), tok.pad_token_id,
    )  # fmt: skip
    expected = tok(chat, add_special_tokens=False)["input_ids"] + [5, 6, 7]
    assert built["teacher_input_ids"][0].tolist() == expected
    assert "=== BEGIN REFERENCE ===\n\n=== END REFERENCE ===" in tok.decode(built["teacher_input_ids"][0])
