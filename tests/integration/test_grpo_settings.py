"""GRPO's settings (rl_loss_type, epsilon_high, mask_truncated_completions, scale_rewards: TRL's GRPOConfig through
`opsd.rl.grpo.grpo_args`) on the tiny model, against the formulas: TRL's `_compute_loss` on a batch that TRL's own
`_generate_and_score_completions` built from known completions (one cut at max_completion_length without EOS), with
ratios away from 1 on both sides of each clip, against a naive float64 loss of unpadded forwards (DAPO arXiv
2503.14476: clip-higher, truncated completions left out, token-level loss; Dr. GRPO arXiv 2503.20783)."""

import math

import pytest
import torch

from tests.conftest import make_trainer

pytestmark = pytest.mark.integration

PROBLEMS = ["What is 2 + 3?", "What is 7 + 5?"]
ANSWERS = ["5", "12"]
REFERENCES = ["2 + 3 = 5, so \\boxed{5}.", "7 + 5 = 12, so \\boxed{12}."]
G = 2
MAX_COMPLETION = 8
EPSILON, EPSILON_HIGH = 0.2, 0.28
# Each token's ratio pi / pi_old, in turn: below 1 - epsilon, inside, between 1 + epsilon and 1 + epsilon_high
# (where clip-higher differs from the symmetric clip), and above both.
RATIOS = (0.7, 0.9, 1.1, 1.24, 1.5)
ADVANTAGES = (0.8, -0.6, 1.1, -1.3)


def test_grpo_args_hands_the_settings_to_trl(tmp_path):
    """Unset, every GRPO setting is TRL's default (epsilon_high 0 is TRL's None); set, each reaches TRL's
    GRPOConfig under TRL's name, and OPSD's own beta and loss_type (its divergence) do not; budget_unit=rollouts
    passes per_device_train_batch_size as TRL's micro-batch of rollouts, problems multiplies it by G."""
    from dataclasses import fields

    import trl

    from opsd.configuration.config import OPSDConfig
    from opsd.rl.grpo import grpo_args

    trl_default = {f.name: f.default for f in fields(trl.GRPOConfig)}
    base = dict(output_dir=str(tmp_path), num_generations=4, rollout_engine="transformers")
    unset = grpo_args(OPSDConfig(**base, method="grpo"))
    for name in (
        "loss_type",
        "beta",
        "epsilon",
        "epsilon_high",
        "mask_truncated_completions",
        "scale_rewards",
    ):
        assert getattr(unset, name) == trl_default[name], name
    assert unset.per_device_train_batch_size == 4 * 4 and unset.num_generations == 4

    settings = dict(rl_loss_type="bnpo", epsilon_high=0.28, mask_truncated_completions=True, scale_rewards="batch",
                    rl_beta=0.04, budget_unit="rollouts", per_device_train_batch_size=8)  # fmt: skip
    for method, opsd in (("grpo", {}), ("hybrid", {"beta": 0.5, "loss_type": "sampled_token"})):
        args = grpo_args(OPSDConfig(**base, **settings, **opsd, method=method))
        got = (
            args.loss_type,
            args.epsilon_high,
            args.mask_truncated_completions,
            args.scale_rewards,
            args.beta,
        )
        assert got == ("bnpo", 0.28, True, "batch", 0.04), method
        assert (args.per_device_train_batch_size, args.num_generations, args.epsilon) == (8, 4, 0.2)


def _completions(tok, vocab: int) -> list[list[int]]:
    """Row 0 answers problem 0 correctly; rows 0, 2 and 3 end with EOS, row 1 is cut at max_completion_length
    without one (truncated)."""
    gen = torch.Generator().manual_seed(11)
    special = {tok.eos_token_id, tok.pad_token_id}

    def words(n: int) -> list[int]:
        ids = [i for i in torch.randint(10, vocab, (3 * n,), generator=gen).tolist() if i not in special]
        return ids[:n]

    boxed = tok("\\boxed{5}", add_special_tokens=False).input_ids
    assert len(boxed) < MAX_COMPLETION
    return [boxed + [tok.eos_token_id], words(MAX_COMPLETION), words(3) + [tok.eos_token_id],
            words(6) + [tok.eos_token_id]]  # fmt: skip


def _scored_batch(trainer, completions):
    """TRL's `_generate_and_score_completions` on the two problems x G, with the rollouts replaced by
    `completions` (TRL decodes, grades, masks and normalises them as it does a real rollout's)."""
    trainer._generate_single_turn = lambda prompt_ids, *args, **kwargs: (
        [list(c) for c in completions[: len(prompt_ids)]],
        None,
    )
    inputs = [
        {"prompt": p, "privileged_context": r, "answer": a}
        for p, r, a in zip(PROBLEMS, REFERENCES, ANSWERS, strict=True)
        for _ in range(G)
    ]
    return trainer._generate_and_score_completions(inputs)


def _naive_logps(model, prompts, completions, temperature: float) -> list[torch.Tensor]:
    """Each row's float64 log p(y_t) from an unpadded forward (top_k=0, top_p=1: the sampler keeps every token)."""
    out = []
    for prompt, completion in zip(prompts, completions, strict=True):
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        logp = torch.log_softmax(logits.double() / temperature, -1)
        out.append(logp.gather(1, torch.tensor(completion)[:, None])[:, 0])
    return out


def naive_loss(logps, old, advantages, completions, eos: int, loss_type: str) -> torch.Tensor:
    """The clipped surrogate from its formulas, float64: per token -min(r A, clip(r, 1 - eps, 1 + eps_high) A),
    r = exp(log p - log p_old); rows without EOS (cut at max_completion_length) out of the loss; then dapo and bnpo
    divide by the kept tokens (one micro-batch on one process: the step's and the micro-batch's are the same),
    dr_grpo by rows x max_completion_length, grpo averages each row over its tokens, then over rows."""
    rows, total, kept_tokens = [], 0.0, 0
    for logp, old_row, a, completion in zip(logps, old, advantages, completions, strict=True):
        ratio = torch.exp(logp - old_row)
        term = torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPSILON, 1 + EPSILON_HIGH) * a)
        keep = completion[-1] == eos
        rows.append(-term.sum() / len(completion) if keep else torch.zeros((), dtype=torch.float64))
        if keep:
            total = total - term.sum()
            kept_tokens += len(completion)
    if loss_type in ("dapo", "bnpo"):
        return total / kept_tokens
    if loss_type == "dr_grpo":
        return total / (len(completions) * MAX_COMPLETION)
    return torch.stack(rows).mean()


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize(
    ("loss_type", "scale_rewards"),
    [("dapo", "group"), ("dr_grpo", "none"), ("grpo", "batch"), ("bnpo", "group")],
)
def test_grpo_loss_settings_against_the_formulas(tiny_model_dir, tmp_path, loss_type, scale_rewards):
    """rl_loss_type, epsilon_high=0.28 and mask_truncated_completions=true as TRL's loss reads them: its value and
    LoRA gradients equal the naive loss's (1e-6 and 1e-5 of the gradient's scale); TRL's advantages are the
    scale_rewards formula of the graded rewards."""
    trainer = make_trainer(
        tiny_model_dir, tmp_path, method="grpo", num_generations=G, max_completion_length=MAX_COMPLETION,
        top_k=0, top_p=1.0, rl_loss_type=loss_type, epsilon_high=EPSILON_HIGH, mask_truncated_completions=True,
        scale_rewards=scale_rewards,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # LoRA B away from its zero init: the adapters change the forward
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    args = trainer.args
    assert (args.loss_type, args.epsilon, args.epsilon_high) == (loss_type, EPSILON, EPSILON_HIGH)
    assert args.mask_truncated_completions and args.scale_rewards == scale_rewards and args.beta == 0.0
    tok = trainer.processing_class
    completions = _completions(tok, trainer.model.config.vocab_size)
    batch = _scored_batch(trainer, completions)

    # TRL's advantages from the graded rewards [1, 0 | 0, 0]: centred on the group's mean, then divided by the
    # group's (or the batch's) unbiased std + 1e-4, or not at all.
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    centred = rewards - rewards.view(-1, G).mean(1).repeat_interleave(G)
    std = {"group": rewards.view(-1, G).std(1).repeat_interleave(G), "batch": rewards.std().expand(4)}
    want = centred / (std[scale_rewards] + 1e-4) if scale_rewards != "none" else centred
    assert torch.allclose(batch["advantages"].double(), want, atol=1e-5)
    # The truncated row is out of TRL's loss mask, and out of the tokens dapo divides by.
    kept = [int(c[-1] == tok.eos_token_id) for c in completions]
    assert kept == [1, 0, 1, 1]
    assert batch["completion_mask"].sum(1).tolist() == [
        len(c) * k for c, k in zip(completions, kept, strict=True)
    ]
    assert int(batch["num_items_in_batch"]) == sum(len(c) * k for c, k in zip(completions, kept, strict=True))

    prompts = [
        batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist() for i in range(len(completions))
    ]
    with torch.no_grad():
        logps = _naive_logps(trainer.model, prompts, completions, args.temperature)
    old_padded = torch.zeros(batch["completion_ids"].shape, dtype=torch.float32)
    for i, lp in enumerate(logps):
        old_padded[i, : len(lp)] = lp - torch.tensor(
            [math.log(RATIOS[t % len(RATIOS)]) for t in range(len(lp))]
        )
    old = [old_padded[i, : len(c)].double() for i, c in enumerate(completions)]  # as TRL reads them
    batch.update(advantages=torch.tensor(ADVANTAGES), old_per_token_logps=old_padded)

    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    ours = _grads(trainer.model)
    ref = naive_loss(
        _naive_logps(trainer.model, prompts, completions, args.temperature),
        old, ADVANTAGES, completions, tok.eos_token_id, loss_type,
    )  # fmt: skip
    ref.backward()
    theirs = _grads(trainer.model)
    assert abs(float(loss) - float(ref)) <= 1e-6, (float(loss), float(ref))
    assert ours.keys() == theirs.keys() and ours
    for name in ours:
        scale = 1.0 + float(theirs[name].abs().max())
        assert float((ours[name] - theirs[name].float()).abs().max()) <= 1e-5 * scale, name


@pytest.mark.parametrize(("budget_unit", "rows"), [("problems", 2 * G), ("rollouts", 2)])
def test_a_step_samples_the_rollouts_its_budget_unit_counts(tiny_model_dir, tmp_path, budget_unit, rows):
    """per_device_train_batch_size=2: two problems x G rollouts per step (problems), or two rollouts, one
    problem's group (rollouts)."""
    trainer = make_trainer(
        tiny_model_dir, tmp_path, method="grpo", num_generations=G, max_steps=1, max_completion_length=4,
        budget_unit=budget_unit,
    )  # fmt: skip
    trainer.train()
    assert trainer.args.per_device_train_batch_size == trainer.args.generation_batch_size == rows
    assert trainer.reward.sums[3] == rows  # the rollouts the step's reward graded
