"""Reference positions (`fix_position_ids=false`), the first completion token, and refused SDFT options.

The reference rows are built by hand here, the way the reference code builds them: prompts padded on the
right with the pad token, completions appended, attention mask = (id != pad id), no position ids.
"""

from __future__ import annotations

import pytest
import torch

from opsd.configuration.checks import IGNORED_SDFT_OPTIONS
from opsd.configuration.config import OPSDConfig
from opsd.method.hidden import completion_hidden, left_pad, loss_token_mask, positions, right_pad
from opsd.method.loss import loss_settings
from opsd.testing.reference_loss import token_divergence
from tests.conftest import make_trainer


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    return make_trainer(tiny_model_dir, tmp_path_factory.mktemp("first_token"))


def _batch(tok):
    """Prompts of three lengths (one with the pad id inside) and completions of three lengths."""
    pad = tok.pad_token_id
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [
        enc("What is 2 + 3?"),
        enc("A rectangle is 4 units wide and 7 units tall. What is its perimeter plus area?"),
        enc("Add 5 and") + [pad] + enc(" 9."),
    ]
    completions = [enc("I add them: 5."), enc("The answer is 50"), enc("14") + [pad] + enc(" done")]
    return prompts, completions


def _hand_reference_logprobs(model, prompts, completions, pad):
    """Log-probs of every completion token under the reference code's rows, built one list at a time."""
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    rows = [
        p + [pad] * (width_p - len(p)) + c + [pad] * (width_c - len(c))
        for p, c in zip(prompts, completions, strict=True)
    ]
    ids = torch.tensor(rows)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=(ids != pad).long()).logits
    out = []
    for i, c in enumerate(completions):
        for j, token in enumerate(c):
            # Column width_p - 1 + j predicts completion token j; for j = 0 on a short prompt that is a pad.
            out.append(logits[i, width_p - 1 + j].log_softmax(-1)[token])
    return torch.stack(out)


def _our_logprobs(model, prompts, completions, pad, fix):
    p_ids, p_mask = left_pad(prompts, pad, "cpu")
    c_ids, c_mask = right_pad(completions, pad, "cpu")
    with torch.no_grad():
        hidden = completion_hidden(model, p_ids, p_mask, c_ids, c_mask, fix_positions=fix, pad_token_id=pad)
        logp = (hidden @ model.get_output_embeddings().weight.T).log_softmax(-1)
    return logp.gather(-1, c_ids[c_mask.bool()][:, None])[:, 0]


def test_reference_positions_match_hand_built_reference_rows(tiny):
    model, tok = tiny
    prompts, completions = _batch(tok)
    pad = tok.pad_token_id
    reference = _hand_reference_logprobs(model, prompts, completions, pad)
    ours = _our_logprobs(model, prompts, completions, pad, fix=False)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)
    # The comparison has teeth: correct positions give another first token on the padded rows.
    first = [0, len(completions[0]), len(completions[0]) + len(completions[1])]
    fixed = _our_logprobs(model, prompts, completions, pad, fix=True)
    assert (fixed[first[0]] - reference[first[0]]).abs() > 1e-3
    assert (fixed[first[2]] - reference[first[2]]).abs() > 1e-3


def test_reference_positions_need_the_pad_token_id(tiny):
    model, tok = tiny
    p_ids, p_mask = left_pad([[5, 6]], tok.pad_token_id, "cpu")
    c_ids, c_mask = right_pad([[7]], tok.pad_token_id, "cpu")
    with pytest.raises(ValueError, match="pad_token_id"):
        completion_hidden(model, p_ids, p_mask, c_ids, c_mask, fix_positions=False, pad_token_id=None)


def test_trainer_scores_reference_rows_when_positions_are_not_fixed(trainer, tiny):
    model, tok = tiny
    prompts, completions = _batch(tok)
    pad = tok.pad_token_id
    p_ids, p_mask = left_pad(prompts, pad, "cpu")
    c_ids, c_mask = right_pad(completions, pad, "cpu")
    # The trainer's forwards as a run with fix_position_ids=False builds them.
    trainer.forwards.fix_positions = False
    try:
        with torch.no_grad(), trainer.teacher_context():
            hidden = trainer.forwards(trainer.teacher_model, p_ids, p_mask, c_ids, c_mask)
    finally:
        trainer.forwards.fix_positions = True
    logp = (hidden @ model.get_output_embeddings().weight.T).log_softmax(-1)
    ours = logp.gather(-1, c_ids[c_mask.bool()][:, None])[:, 0]
    # The fixed teacher is the initial model, which `tiny` loaded from the same files.
    torch.testing.assert_close(
        ours, _hand_reference_logprobs(model, prompts, completions, pad), atol=1e-5, rtol=0
    )


def test_loss_token_mask_skips_leading_tokens_and_keeps_tokens_equal_to_the_pad_id():
    pad = 0
    ids = torch.tensor([[4, 5, 6, 7], [8, 0, 9, 0], [3, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]])
    # Every real token is in the loss whatever its id: a sampled token equal to the pad id (SmolLM2's
    # <|im_end|>, its stop token) too, where the reference's labels drop it (docs/method.md §1.2).
    assert loss_token_mask(ids, mask, skip=0).tolist() == mask.tolist()
    assert ids[1, 1] == pad and loss_token_mask(ids, mask, skip=0)[1, 1] == 1
    assert loss_token_mask(ids, mask, skip=2).tolist() == [
        [0, 0, 1, 1],
        [0, 0, 1, 0],
        [0, 0, 0, 0],
    ]


@pytest.mark.parametrize("fix", [True, False])
def test_the_sampled_stop_token_is_trained_on_the_embedded_model(
    embedded_cache_dir, tmp_path, monkeypatch, fix
):
    """The embedded SmolLM2 pads with its stop token <|im_end|>. In both layouts (fix_position_ids on, and off:
    the reference's rows) the stop token that ends each completion is in the loss mask and its denominator, and
    the loss has a gradient at the hidden state that predicts it. (The hybrid's self-distillation term is scored
    by the same core, `opsd.method.scoring`.)"""
    from opsd.models import EMBEDDED_NAME

    trainer = make_trainer(
        embedded_cache_dir / EMBEDDED_NAME, tmp_path, fix_position_ids=fix, clip_mode="none",
        probe_size=0, probe_steps=0, completions_steps=0,
    )  # fmt: skip
    tok = trainer.processing_class
    eos = tok.eos_token_id
    assert tok.pad_token_id == eos, "the embedded model pads with its stop token"
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    completions = [enc("The answer is \\boxed{7}.") + [eos], enc("7") + [eos]]
    monkeypatch.setattr(trainer, "_sample", lambda prompt_ids: (prompt_ids, completions))
    batch = trainer.rollout_batch([trainer.train_dataset[i] for i in range(2)])
    c_ids, c_mask = batch["completion_ids"], batch["completion_mask"]
    last_B = c_mask.sum(1) - 1
    assert (c_ids[torch.arange(2), last_B] == eos).all()
    keep_BC = trainer.core.token_mask(c_ids, c_mask)
    assert keep_BC.tolist() == c_mask.tolist() and int(batch["num_loss_tokens"][0]) == int(c_mask.sum())

    captured = {}
    scored = trainer.completion_hidden_states

    def keep_grad(*args, **kwargs):
        hidden, teacher = scored(*args, **kwargs)
        hidden.student_hidden_NH.retain_grad()
        captured["h"] = hidden.student_hidden_NH
        return hidden, teacher

    monkeypatch.setattr(trainer, "completion_hidden_states", keep_grad)
    trainer.compute_loss(trainer.model, batch).backward()
    # The hidden states are flattened over completion_mask, row by row: each row's stop is its last real token.
    stop_rows = c_mask.sum(1).cumsum(0) - 1
    grad_NH = captured["h"].grad
    assert grad_NH is not None and (grad_NH[stop_rows].abs().sum(-1) > 0).all(), (
        "no gradient at the stop token"
    )


@pytest.mark.parametrize("skip", [0, 2])
def test_skipped_tokens_leave_loss_denominator_and_metrics(trainer, skip):
    """compute_loss on a real rollout batch equals the hand-computed mean over tokens j >= skip."""
    a = trainer.args
    a.num_loss_tokens_to_skip, a.clip_mode = skip, "none"
    try:
        torch.manual_seed(0)
        rows = [trainer.train_dataset[i] for i in range(2)]
        batch = trainer.rollout_batch(rows)
        c_ids, c_mask = batch["completion_ids"], batch["completion_mask"]
        cols = torch.arange(c_mask.size(1)).expand_as(c_mask)
        kept_BC = c_mask.bool() & (cols >= skip)
        assert int(batch["num_loss_tokens"][0]) == int(kept_BC.sum()) > 0
        for m in trainer.logged.modes.values():
            m.clear()
        loss = trainer.compute_loss(trainer.model, batch)

        width = batch["teacher_input_ids"].size(1) - c_ids.size(1)
        with torch.no_grad():
            h_s = trainer.forwards(trainer.model, batch["prompt_ids"], batch["prompt_mask"], c_ids, c_mask)
            with trainer.teacher_context():
                h_t = trainer.forwards(
                    trainer.teacher_model,
                    batch["teacher_input_ids"][:, :width],
                    batch["teacher_attention_mask"][:, :width],
                    c_ids,
                    c_mask,
                )
        w = trainer.model.get_output_embeddings().weight
        loss_N, stats = token_divergence(h_s @ w.T, h_t @ w.T, settings=loss_settings(a), target_ids_N=None)
        keep_N = kept_BC[c_mask.bool()]
        expected = loss_N[keep_N].sum() / keep_N.sum()
        torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-5)
        divergence = trainer.logged.modes["train" if trainer.model.training else "eval"]["opsd/divergence"][
            -1
        ]
        assert divergence == pytest.approx(float(stats["divergence"][keep_N].mean()), rel=1e-4, abs=1e-6)
    finally:
        a.num_loss_tokens_to_skip, a.clip_mode = 0, "element"


def test_teacher_thinking_off_ends_with_the_students_closed_think_block(tiny):
    from opsd.method.prompts import PromptBuilder

    _, tok = tiny
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    closing = tok("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    student = PromptBuilder(tok).student_ids("What is 2 + 3?")
    closed = PromptBuilder(tok, teacher_thinking=False).teacher_ids("What is 2 + 3?", "5").ids
    opened = PromptBuilder(tok).teacher_ids("What is 2 + 3?", "5").ids
    assert student[-len(closing) :] == closed[-len(closing) :] == closing
    # The published teacher stops at the assistant header, where its next token is `<think>`.
    assert opened[-len(header) :] == header and closing[: len(header)] == header


@pytest.mark.parametrize(
    "name, value",
    [
        ("generate_from_teacher", True),
        ("distillation_alpha", 1.0),
        ("distillation_mode", "full_logits"),
        ("distillation_topk", 20),
        ("distillation_is_clip", None),
        ("distillation_add_tail", True),
        ("teacher_prompt_template", "{privileged_context}\n{prompt}"),
        ("use_teacher_server", True),
        ("chat_template_kwargs", {"enable_thinking": True}),
    ],
)
def test_ignored_sdft_options_are_refused(tmp_path, name, value):
    with pytest.raises(ValueError, match=rf"^{name}=.*OPSDTrainer ignores; .+"):
        OPSDConfig(output_dir=str(tmp_path), **{name: value})


def test_every_ignored_sdft_option_is_tested_and_defaults_pass(tmp_path):
    tested = {
        "generate_from_teacher", "distillation_alpha", "distillation_mode", "distillation_topk",
        "distillation_is_clip", "distillation_add_tail", "teacher_prompt_template", "use_teacher_server",
        "chat_template_kwargs",
    }  # fmt: skip
    assert set(IGNORED_SDFT_OPTIONS) == tested
    assert OPSDConfig(output_dir=str(tmp_path)).num_loss_tokens_to_skip == 0
    with pytest.raises(ValueError, match="num_loss_tokens_to_skip=-1 is out of range"):
        OPSDConfig(output_dir=str(tmp_path), num_loss_tokens_to_skip=-1)


@pytest.mark.parametrize("wrap", ["plain", "peft"])
def test_completion_hidden_is_the_models_last_hidden_state(tiny, wrap):
    """The decoder hook gives what `output_hidden_states` would (its last entry), through peft too."""
    from peft import LoraConfig, get_peft_model

    model, tok = tiny
    if wrap == "peft":
        model = get_peft_model(
            type(model).from_pretrained(model.name_or_path, dtype=torch.float32).eval(),
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
        )
    prompts, completions = _batch(tok)
    p_ids, p_mask = left_pad(prompts, tok.pad_token_id, "cpu")
    c_ids, c_mask = right_pad(completions, tok.pad_token_id, "cpu")
    with torch.no_grad():
        got = completion_hidden(model, p_ids, p_mask, c_ids, c_mask, fix_positions=True, pad_token_id=None)
        full = model(
            input_ids=torch.cat([p_ids, c_ids], 1),
            attention_mask=torch.cat([p_mask, c_mask], 1),
            position_ids=positions(p_mask, c_ids.size(1)),
            output_hidden_states=True,
        )
    width = p_ids.size(1)
    want = full.hidden_states[-1][:, width - 1 : width - 1 + c_ids.size(1)][c_mask.bool()]
    assert got.shape == (int(c_mask.sum()), model.config.hidden_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and these are the states the model's own lm_head turns into its logits
    logits = full.logits[:, width - 1 : width - 1 + c_ids.size(1)][c_mask.bool()]
    torch.testing.assert_close(got @ model.get_output_embeddings().weight.T, logits, atol=1e-4, rtol=1e-4)
