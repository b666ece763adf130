"""OPSDTrainer in-process on the tiny model with the real vLLM engine: positions, weight sync, teacher, loss."""

import pytest
import torch

from opsd.method.hidden import lm_head_weight, positions
from opsd.method.prompts import teacher_rows
from tests.conftest import colocated_rendezvous


def _naive_positions(prompt_mask, completion_width):
    rows = []
    for m in prompt_mask.tolist():
        n_pad, n_real = m.count(0), m.count(1)
        prompt = [0] * n_pad + list(range(n_real))
        rows.append(prompt + list(range(n_real, n_real + completion_width)))
    return torch.tensor(rows)


def test_positions_against_naive():
    # fix_position_ids=False scores other rows (tests/integration/test_positions_and_first_token.py).
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert torch.equal(positions(mask, 4), _naive_positions(mask, 4))


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """Two optimizer steps of LoRA OPSD with vLLM rollouts, both rolled out in one generation
    (steps_per_rollout=2); returns the trainer and the initial weights."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.configuration.config import OPSDConfig
    from opsd.launch.preflight import build_paired_dataset
    from opsd_trainer import OPSDTrainer

    cfg = OPSDConfig(
        output_dir=str(tmp_path_factory.mktemp("run")),
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_completion_length=16,
        use_vllm=True,
        vllm_max_model_length=1024,
        learning_rate=5e-2,
        save_strategy="no",
        gradient_checkpointing=False,
        max_teacher_prompt_length=60,
        steps_per_rollout=2,
    )
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with colocated_rendezvous():  # the colocated engine's, restored on exit
        trainer = OPSDTrainer(
            model=model,
            args=cfg,
            train_dataset=build_paired_dataset(cfg)[0],
            processing_class=tok,
            peft_config=LoraConfig(
                r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM"
            ),
        )
    lora_init = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    batch = _scoring_batch(trainer, tok)
    teacher_before = _teacher_hidden(trainer, batch)
    generate, trainer.engine_calls = trainer._sample, []

    def recorded(prompt_ids):
        out = generate(prompt_ids)
        trainer.engine_calls.append((trainer.state.global_step, len(prompt_ids), len(out[1])))
        return out

    trainer._sample = recorded
    trainer.train()
    return trainer, tok, initial, lora_init, batch, teacher_before


def _scoring_batch(trainer, tok):
    """Prompts of different lengths with fixed completions, laid out like a training batch."""
    from opsd.method.hidden import left_pad

    problems = [
        "What is 2 + 3?",
        "A rectangle is 4 units wide and 7 units tall. What is its perimeter plus area?",
    ]
    prompt_ids = [trainer.prompt_builder.student_ids(p) for p in problems]
    completions = [
        tok("I add them: 5.", add_special_tokens=False)["input_ids"],
        tok("The answer is 50", add_special_tokens=False)["input_ids"],
    ]
    p_ids, p_mask = left_pad(prompt_ids, tok.pad_token_id, "cpu")
    width = max(len(c) for c in completions)
    c_ids = torch.full((2, width), tok.pad_token_id)
    c_mask = torch.zeros((2, width), dtype=torch.long)
    for i, c in enumerate(completions):
        c_ids[i, : len(c)] = torch.tensor(c)
        c_mask[i, : len(c)] = 1
    teacher, _ = teacher_rows(trainer.prompt_builder, problems, ["5", "50"], c_ids, c_mask, tok.pad_token_id)
    return dict(
        prompt_ids=p_ids,
        prompt_mask=p_mask,
        completion_ids=c_ids,
        completion_mask=c_mask,
        raw_prompts=prompt_ids,
        completions=completions,
        **teacher,
    )


def _teacher_hidden(trainer, b):
    width = b["teacher_input_ids"].size(1) - b["completion_ids"].size(1)
    with torch.no_grad(), trainer.teacher_context():
        return trainer.forwards(
            trainer.teacher_model,
            b["teacher_input_ids"][:, :width],
            b["teacher_attention_mask"][:, :width],
            b["completion_ids"],
            b["completion_mask"],
        )


def _student_logprobs(trainer, b):
    with torch.no_grad():
        h = trainer.forwards(
            trainer.model, b["prompt_ids"], b["prompt_mask"], b["completion_ids"], b["completion_mask"]
        )
        logits = h @ lm_head_weight(trainer.model).T
    return logits.log_softmax(-1).gather(-1, b["completion_ids"][b["completion_mask"].bool()][:, None])[:, 0]


def _engine_logprobs(trainer, b):
    """The rollout engine's log-probs of the same completions (prompt logprobs of prompt+completion)."""
    from vllm import SamplingParams

    llm = trainer.engine.generation.llm
    out = []
    for p, c in zip(b["raw_prompts"], b["completions"], strict=True):
        res = llm.generate(
            [{"prompt_token_ids": p + c}],
            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
            use_tqdm=False,
        )[0]
        out += [res.prompt_logprobs[len(p) + j][tok].logprob for j, tok in enumerate(c)]
    return torch.tensor(out)


def test_lora_trained_base_unchanged(trained):
    trainer, _, initial, lora_init, _, _ = trained
    params = dict(trainer.model.named_parameters())
    assert any(not torch.equal(params[n], v) for n, v in lora_init.items()), "LoRA weights did not move"
    base = trainer.model.get_base_model().state_dict()
    for name, value in initial.items():
        key = (
            name.replace("q_proj.weight", "q_proj.base_layer.weight")
            .replace("v_proj.weight", "v_proj.base_layer.weight")
            .replace("down_proj.weight", "down_proj.base_layer.weight")
        )
        assert torch.equal(base[key], value), name
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in logs)
    for key in (
        "opsd/divergence",
        "opsd/clipped_frac",
        "opsd/top1_agree",
        "rollout/tokens_per_s",
        "time/rollout_s",
        "time/score_loss_s",
        "time/weight_sync_s",
        "completions/mean_length",
        "completions/clipped_ratio",
        "prompts/teacher_truncated",
    ):
        assert key in logs[0], key
    # max_teacher_prompt_length=60 is shorter than the built-in teacher prompts: cuts are counted.
    assert logs[0]["prompts/teacher_truncated"] > 0


def test_one_engine_call_serves_both_steps(trained):
    trainer = trained[0]
    # 2 problems x 2 micro-batches x 2 steps, rolled out once with the initial weights.
    assert trainer.engine_calls == [(0, 8, 8)]
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert [r["rollout/staleness_steps"] for r in logs] == [0.0, 1.0]
    assert "time/rollout_s" in logs[0] and "time/rollout_s" not in logs[1]


def test_fixed_teacher_is_the_initial_model(trained):
    trainer, _, _, _, batch, teacher_before = trained
    torch.testing.assert_close(_teacher_hidden(trainer, batch), teacher_before, atol=0, rtol=0)


def test_engine_logprobs_equal_trainer_after_update(trained):
    trainer, _, _, _, batch, _ = trained
    trainer.engine.generation.sync_weights()
    engine = _engine_logprobs(trainer, batch)
    student = _student_logprobs(trainer, batch)
    torch.testing.assert_close(student, engine, atol=2e-3, rtol=1e-3)
    # The engine serves the updated student, not the initial weights.
    with trainer.teacher_context():
        base = _student_logprobs(trainer, batch)
    assert (base - engine).abs().max() > 1e-2
    # The reference code's positions disagree with the engine on the shorter (left-padded) prompt.
    trainer.forwards.fix_positions = False  # as a run with fix_position_ids=False builds its forwards
    try:
        shifted = _student_logprobs(trainer, batch)
    finally:
        trainer.forwards.fix_positions = True
    assert (shifted - engine).abs().max() > 1e-3


def test_student_prompt_keeps_chat_template_tokens(trained):
    trainer, tok, *_ = trained
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": trainer.prompt_builder.student_text("What is 2 + 3?")}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    ids = trainer.prompt_builder.student_ids("What is 2 + 3?")
    assert ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_all_masked_batch_gives_connected_zero_loss(trained):
    trainer, _, _, _, batch, _ = trained
    b = {
        **batch,
        "completion_mask": torch.zeros_like(batch["completion_mask"]),
        "num_loss_tokens": torch.zeros(2, dtype=torch.long),
    }
    n = b["completion_ids"].size(1)
    b["teacher_attention_mask"] = b["teacher_attention_mask"].clone()
    b["teacher_attention_mask"][:, -n:] = 0
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, b)
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    grads = [p.grad for p in trainer.model.parameters() if p.requires_grad and p.grad is not None]
    assert all(torch.isfinite(g).all() for g in grads)
    trainer.model.zero_grad()
