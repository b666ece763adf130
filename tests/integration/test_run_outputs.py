"""What a run leaves for its user, on a tiny model in this process: the model card, the completions log, and
the upstream evaluation prompt rendered by the tiny tokenizer."""

import json
from pathlib import Path

import pytest

from tests.conftest import make_trainer

ROOT = Path(__file__).resolve().parents[2]


# -- the model card ----------------------------------------------------------------------------------------


def test_model_card_cites_opsd_not_sdft(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=1)
    trainer.create_model_card()
    card = (tmp_path / "README.md").read_text()
    assert "2601.18734" in card and "Self-Distilled Reasoner" in card
    assert "2601.19897" not in card


# -- the completions log -----------------------------------------------------------------------------------


def test_completions_log_rows_agree_with_the_logged_divergence(tiny_model_dir, tmp_path):
    trainer = make_trainer(
        tiny_model_dir, tmp_path, max_steps=3, completions_steps=2, completions_rows=2, beta=0.5
    )
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in rows}) == [0, 2]  # every 2nd step, counted from 0
    tok = trainer.processing_class
    logged = {h["step"]: h["opsd/divergence"] for h in trainer.state.log_history if "opsd/divergence" in h}
    for step in (0, 2):
        step_rows = [r for r in rows if r["step"] == step]
        assert len(step_rows) == 2  # the whole micro-batch: its token-weighted mean is the logged metric
        total = sum(r["divergence_mean"] * r["num_tokens"] for r in step_rows)
        n = sum(r["num_tokens"] for r in step_rows)
        assert total / n == pytest.approx(logged[step + 1], rel=1e-4, abs=1e-6)
        for r in step_rows:
            assert r["problem"] and r["reference"] and r["completion"]
            assert len(tok(r["completion"], add_special_tokens=False).input_ids) >= 1
            worst = r["top_tokens"][0]
            assert worst[2] == pytest.approx(r["divergence_max"])
            assert r["divergence_max"] >= r["divergence_mean"] >= 0


def test_completions_log_off(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path, max_steps=1, completions_steps=0)
    trainer.train()
    assert not (tmp_path / "completions.jsonl").exists()


# -- the upstream evaluation prompt ------------------------------------------------------------------------


def test_upstream_eval_prompt_file_renders_the_problem_first(tiny_model_dir):
    from transformers import AutoTokenizer

    from opsd.method.prompts import PromptBuilder

    path = ROOT / "configs" / "prompts" / "upstream_eval.txt"
    builder = PromptBuilder(AutoTokenizer.from_pretrained(tiny_model_dir), student_template_file=str(path))
    text = builder.tokenizer.decode(builder.student_ids("What is 2+3?"))
    assert text.index("What is 2+3?") < text.index("Please reason step by step")
    assert "\\boxed{}" in text
