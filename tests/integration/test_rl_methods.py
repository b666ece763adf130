"""method=grpo and method=hybrid on the tiny model (transformers rollouts, LoRA r4): the GRPO loss is TRL's and
scores exact positions under the sampler's distribution (against an unpadded forward of each row and a plain-Python
top-k/top-p), the hybrid's two limits (sd_weight=0 is TRL's
GRPO loss; no GRPO signal is OPSD's loss), the compute ledger against the batch it counts, and a bit-exact resume."""

import json
import math

import pytest
import torch
import trl

from opsd.method.hidden import left_pad, right_pad
from opsd.method.prompts import teacher_rows
from opsd.rl.grpo import GRPOTrainer
from opsd.rl.hybrid import HybridTrainer
from tests.conftest import make_trainer

pytestmark = pytest.mark.integration

PROBLEMS = [
    "What is 2 + 3?",
    "A train leaves at noon and travels 40 km per hour. How far has it gone by 3 pm?",
]
REFERENCES = ["2 + 3 = 5, so \\boxed{5}.", "Three hours at 40 km/h: 120 km. \\boxed{120}"]
G = 2


def _batch(trainer, advantages, *, teacher: bool) -> dict:
    """Two problems x G completions of different lengths (random tokens), laid out as TRL's GRPO batch (left-padded
    prompts, right-padded completions), with the teacher rows and denominators OPSD and the hybrid read."""
    gen = torch.Generator().manual_seed(7)
    vocab = trainer.model.config.vocab_size
    problems = [p for p in PROBLEMS for _ in range(G)]
    references = [r for r in REFERENCES for _ in range(G)]
    prompts = [trainer.prompt_builder.student_ids(p) for p in problems]
    completions = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in (5, 9, 3, 7)]
    pad = trainer.processing_class.pad_token_id
    prompt_ids, prompt_mask = left_pad(prompts, pad, "cpu")
    completion_ids, completion_mask = right_pad(completions, pad, "cpu")
    n_tokens = completion_mask.sum()
    batch = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "advantages": torch.tensor(advantages, dtype=torch.float32),
        "num_items_in_batch": n_tokens, "sd_num_tokens": n_tokens,
        "num_loss_tokens": n_tokens.repeat(len(problems)), "problems": problems, "references": references,
        "sd_rows": torch.ones(len(problems), dtype=torch.bool),
    }  # fmt: skip
    if teacher:
        rows, _ = teacher_rows(
            trainer.prompt_builder, problems, references, completion_ids, completion_mask, pad
        )
        batch.update(rows)
    return batch, prompts, completions


def kept_tokens(row: list[float], top_k: int, top_p: float) -> set[int]:
    """The tokens vLLM's sampler keeps from one row of temperature-scaled logits, in plain Python: top-k keeps every
    token at least as large as the k-th largest; top-p, over the kept tokens' renormalised probabilities from the
    least likely up, drops each token while the running sum is <= 1 - p, never the most likely."""
    kept = set(range(len(row)))
    if 0 < top_k < len(row):
        kth = sorted(row, reverse=True)[top_k - 1]
        kept = {i for i in kept if row[i] >= kth}
    if top_p < 1.0:
        top = max(row[i] for i in kept)
        total = sum(math.exp(row[i] - top) for i in kept)
        running = 0.0
        for i in sorted(kept, key=lambda i: row[i])[:-1]:
            running += math.exp(row[i] - top) / total
            if running <= 1 - top_p:
                kept.discard(i)
    return kept


def sampler_logp(
    logits_TV: torch.Tensor, completion: list[int], temperature: float, top_k: int, top_p: float
):
    """(T,) float64 log p(y_t) under the sampler's renormalised kept set (the sampled token always counted in it),
    with the gradient of the kept logits."""
    x_TV = logits_TV.double() / temperature
    out = []
    for t, y in enumerate(completion):
        kept = sorted(kept_tokens(x_TV[t].tolist(), top_k, top_p) | {y})
        out.append(x_TV[t, y] - torch.logsumexp(x_TV[t, kept], 0))
    return torch.stack(out)


def naive_grpo_loss(model, prompts, completions, advantages, args) -> torch.Tensor:
    """TRL's default GRPO loss (dapo, one iteration: every ratio is 1 with the gradient of log p) from an unpadded
    forward of each row, log p under the rollout sampler's distribution (`sampler_logp`): -sum_i A_i sum_t
    ratio_it / (the batch's completion tokens)."""
    total = sum(len(c) for c in completions)
    loss = 0.0
    for prompt, completion, a in zip(prompts, completions, advantages, strict=True):
        ids = torch.tensor([prompt + completion])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
        logp = sampler_logp(logits, completion, args.temperature, args.top_k or 0, args.top_p)
        loss = loss - (a * torch.exp(logp - logp.detach())).sum()
    return loss / total


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        scale = 1.0 + float(b[name].abs().max())
        assert float((a[name] - b[name]).abs().max()) <= tol * scale, name


def _perturbed(trainer):
    """LoRA B away from its zero init, so the adapters change the forward (seeded)."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    trainer.model.train()
    # What transformers' training loop sets before the first micro-batch, and TRL's loss reads.
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return trainer


def test_grpo_is_trls_trainer_with_the_harness_overrides_only():
    """The advantages and the loss are TRL's code: the class is TRL's GRPOTrainer and overrides none of the
    methods that compute them; each override it has calls TRL's own, except the scoring of the sampled tokens,
    which it replaces (TRL's applies the temperature only, not the sampler's top-k and top-p)."""
    import inspect

    assert issubclass(GRPOTrainer, trl.GRPOTrainer)
    # The harness's classes above TRL's (the trainer and its logging mixin, `opsd.run.step_watch.WindowLogging`).
    own = GRPOTrainer.__mro__[: GRPOTrainer.__mro__.index(trl.GRPOTrainer)]
    defined = {n: member for cls in reversed(own) for n, member in vars(cls).items()}
    overridden = {n for n, member in defined.items() if callable(member) and hasattr(trl.GRPOTrainer, n)}
    assert overridden == {
        "__init__", "training_step", "_tokenize_prompts", "_generate_single_turn",
        "_generate_and_score_completions", "_get_per_token_logps_and_entropies", "log",
    }  # fmt: skip
    for name in overridden - {"_tokenize_prompts", "_get_per_token_logps_and_entropies"}:
        assert "super()." in inspect.getsource(defined[name]), name
    for name in ("_compute_loss", "compute_loss", "_calculate_rewards"):
        assert name not in defined


def test_grpo_loss_matches_unpadded_rows(tiny_model_dir, tmp_path):
    """TRL's loss through the harness: value and LoRA gradients equal the naive loss of unpadded rows (exact
    positions, the rollout temperature), 1e-5."""
    trainer = _perturbed(make_trainer(tiny_model_dir, tmp_path, method="grpo", num_generations=G))
    advantages = [0.7, -0.7, 1.2, -1.2]
    batch, prompts, completions = _batch(trainer, advantages, teacher=False)
    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    ours = _grads(trainer.model)
    ref = naive_grpo_loss(trainer.model, prompts, completions, advantages, trainer.args)
    ref.backward()
    assert abs(float(loss) - float(ref)) <= 1e-6
    _close(ours, _grads(trainer.model), 1e-5)


def test_hybrid_limits(tiny_model_dir, tmp_path):
    """sd_weight=0 is TRL's GRPO loss (the naive one, and TRL's own method on the same batch); with the GRPO term
    switched off (zero advantages) the hybrid's loss and gradients are OPSDTrainer's on the same rows (1e-6); in
    between, the loss is GRPO's + sd_weight x OPSD's."""
    advantages = [0.5, -0.5, 1.0, -1.0]
    off = _perturbed(
        make_trainer(tiny_model_dir, tmp_path / "h0", method="hybrid", num_generations=G, sd_weight=0)
    )
    batch, prompts, completions = _batch(off, advantages, teacher=True)
    loss0 = off._compute_loss(off.model, batch)
    trl_loss = trl.GRPOTrainer._compute_loss(off, off.model, batch)
    naive = naive_grpo_loss(off.model, prompts, completions, advantages, off.args)
    assert float(loss0) == float(trl_loss) and abs(float(loss0) - float(naive)) <= 1e-6

    hybrid = _perturbed(make_trainer(tiny_model_dir, tmp_path / "h1", method="hybrid", num_generations=G))
    opsd = make_trainer(tiny_model_dir, tmp_path / "o", completions_steps=0)
    opsd.model.load_state_dict(hybrid.model.state_dict())
    opsd.model.train()
    zero, _, _ = _batch(hybrid, [0.0] * 4, teacher=True)
    h = hybrid._compute_loss(hybrid.model, zero)
    h.backward()
    o = opsd.compute_loss(opsd.model, zero)
    o.backward()
    assert abs(float(h) - float(o)) <= 1e-6 and float(o) != 0.0
    _close(_grads(hybrid.model), _grads(opsd.model), 1e-6)

    hybrid.sd_weight = 0.5
    mixed = float(hybrid._compute_loss(hybrid.model, batch))
    sd = float(opsd.compute_loss(opsd.model, batch))
    grpo = float(naive_grpo_loss(hybrid.model, prompts, completions, advantages, hybrid.args))
    assert abs(mixed - (grpo + 0.5 * sd)) <= 1e-6


def _ledger(out):
    return [json.loads(line) for line in (out / "ledger.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", ["grpo", "hybrid"])
def test_methods_train_log_and_resume_bit_exactly(tiny_model_dir, tmp_path, method):
    """Two steps straight, and one step then a resume from its checkpoint, give the same adapter bytes and the
    same second step's logs; every step logs rollout/correct and its ledger row, whose generated tokens are the
    rollouts' lengths (TRL's completions/mean_length x rows) and whose teacher tokens are the hybrid's only."""
    settings = dict(
        method=method, num_generations=G, max_steps=2, logging_steps=1, save_strategy="steps", save_steps=1,
        max_completion_length=6,
    )  # fmt: skip
    straight = make_trainer(tiny_model_dir, tmp_path / "a", **settings)
    straight.train()
    first = make_trainer(tiny_model_dir, tmp_path / "b", **{**settings, "max_steps": 1})
    first.train()
    resumed = make_trainer(tiny_model_dir, tmp_path / "b", **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-1"))
    for a, b in zip(straight.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert a[0] == b[0] and torch.equal(a[1], b[1]), a[0]
    logs = [r for r in straight.state.log_history if "loss" in r]
    again = [r for r in resumed.state.log_history if "loss" in r]
    keys = ("loss", "grad_norm", "rollout/correct", "rollout/length", "ledger/generated_tokens")
    assert [logs[1][k] for k in keys] == [again[-1][k] for k in keys]
    rows = _ledger(tmp_path / "a")
    assert [r["step"] for r in rows] == [1, 2]
    for row, log in zip(rows, logs, strict=True):
        n_rows = 2 * G  # 2 problems per step
        assert row["generated_tokens"] == round(log["completions/mean_length"] * n_rows)
        assert row["trained_tokens"] == row["generated_tokens"]
        assert (row["teacher_tokens"] > row["generated_tokens"]) == (method == "hybrid")
        assert row["step_s"] > 0 and "rollout_s" in row
    assert isinstance(straight, HybridTrainer) == (method == "hybrid")


def test_hybrid_own_wrong_hints_and_modulation_against_unpadded_forwards(tiny_model_dir, tmp_path):
    """RLCSD in the hybrid on a batch of known rollouts, graded by the real grader: each row's hints are its
    siblings' texts (or the reference), and each token's modulated advantage is the hand formula applied to
    log p_T(y|c) - log mean_j p_T(y|c~_j) from an unpadded forward of every [hint prompt ; completion] row."""
    import math

    from opsd.method.scoring import token_rows

    g = 4
    trainer = _perturbed(make_trainer(tiny_model_dir, tmp_path, method="hybrid", num_generations=g,
                                      teacher_contrast="own_wrong", contrast_rl_tau=0.5, sd_weight=1.0))  # fmt: skip
    problems = [p for p in PROBLEMS for _ in range(g)]
    references = [r for r in REFERENCES for _ in range(g)]
    answers = ["5"] * g + ["120"] * g
    texts = [
        "so \\boxed{5}",
        "\\boxed{7}",
        "\\boxed{8}",
        "none",
        "\\boxed{3}",
        "\\boxed{4}",
        "hmm",
        "\\boxed{120}",
    ]
    tok = trainer.processing_class
    completions = [tok(t, add_special_tokens=False).input_ids for t in texts]
    assert trainer.reward(problems, texts, completions, answer=answers) == [1.0, 0, 0, 0, 0, 0, 0, 1.0]
    inputs = [{"prompt": p, "privileged_context": r} for p, r in zip(problems, references, strict=True)]
    hints, wrongs = trainer._hints(inputs)
    assert hints[0] == REFERENCES[0] and hints[1] == texts[0] and sorted(wrongs[0]) == sorted(texts[1:3])
    assert (
        hints[4:7] == [texts[7]] * 3 and hints[7] == REFERENCES[1]
    )  # the sole correct rollout: the reference
    assert wrongs[4] == [texts[5]] and sorted(wrongs[7]) == sorted(texts[4:6])  # boxed wrong siblings only
    pad = tok.pad_token_id
    prompt_ids, prompt_mask = left_pad([trainer.prompt_builder.student_ids(p) for p in problems], pad, "cpu")
    completion_ids, completion_mask = right_pad(completions, pad, "cpu")
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
             "completion_mask": completion_mask, "advantages": torch.tensor([0.9, -0.3, -0.3, -0.3, -0.5, -0.5,
                                                                              -0.5, 1.5])}  # fmt: skip
    batch.update(
        teacher_rows(trainer.prompt_builder, problems, hints, completion_ids, completion_mask, pad)[0]
    )
    batch.update(trainer._wrong_hint_rows(problems, hints, wrongs, completion_ids))
    teacher = trainer.core.teacher_hidden(batch)
    assert teacher.has_contrast_B.tolist() == [True] * g + [
        True,
        True,
        True,
        True,
    ]  # every row here has a pair
    got = trainer._modulated_advantages(batch, teacher)

    model = trainer.accelerator.unwrap_model(trainer.model)
    tau = trainer.core.settings.temperature

    def logp(hint_text: str, problem: str, completion: list[int]) -> torch.Tensor:
        prompt = trainer.prompt_builder.teacher_ids(problem, hint_text).ids
        with torch.no_grad(), model.disable_adapter():
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        return torch.log_softmax(logits.float() / tau, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]

    model.eval()
    for b, completion in enumerate(completions):
        lp_c = logp(hints[b], problems[b], completion)
        lp_w = torch.stack([logp(w, problems[b], completion) for w in wrongs[b]])
        e = lp_c - torch.log(lp_w.exp().mean(0))
        a = float(batch["advantages"][b])
        for t in range(len(completion)):
            r = max(-2.0, min(2.0, 0.5 * math.tanh(float(e[t]) / 0.5)))
            raw = a + (r if abs(r) > 0.02 else 0.0)
            want = max(raw, 0.0) if a > 0 else min(raw, 0.0)
            assert float(got[b, t]) == pytest.approx(want, abs=2e-5), (b, t)
    assert (
        float((got[completion_mask.bool()] - batch["advantages"][token_rows(completion_mask)]).abs().max())
        > 1e-3
    )
    model.train()
    window = trainer.logged.modes["train"]
    assert window["contrast/rows_with_pair"][-1] == 1.0 and window["contrast/hints_per_row"][-1] > 1.0
    loss = trainer._compute_loss(trainer.model, {**batch, "num_items_in_batch": completion_mask.sum(),
                                                 "sd_num_tokens": completion_mask.sum(),
                                                 "sd_rows": torch.ones(2 * g, dtype=torch.bool)})  # fmt: skip
    assert torch.isfinite(loss) and window["opsd/contrast_kl"][-1] > 0 and "opsd/eos_target" in window


def _rows(batch: dict, rows: list[int]) -> dict:
    """The batch's rows `rows` (tensors and lists with one entry per row; the step's denominators kept)."""
    n = len(batch["problems"])
    out = {}
    for key, value in batch.items():
        if isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in rows]
        elif torch.is_tensor(value) and value.dim() and value.size(0) == n:
            out[key] = value[rows]
        else:
            out[key] = value
    return out


def _routed_hybrid(tiny_model_dir, tmp_path, route):
    """A hybrid on `route`, and an OPSDTrainer with the same weights (its teacher: the same initial policy)."""
    hybrid = _perturbed(make_trainer(tiny_model_dir, tmp_path / route, method="hybrid", num_generations=G,
                                     hybrid_route=route))  # fmt: skip
    opsd = make_trainer(tiny_model_dir, tmp_path / f"{route}_opsd", completions_steps=0)
    opsd.model.load_state_dict(hybrid.model.state_dict())
    opsd.model.train()
    return hybrid, opsd


@pytest.mark.parametrize(
    ("route", "rewards", "advantages"),
    [
        ("group", [1.0, 0.0, 0.0, 1.0], [0.7, -0.7, -1.0, 1.0]),  # every group mixed: no row for OPSD
        ("group", [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]),  # no group with signal: every row for OPSD
        ("sample", [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]),  # every rollout right: no row for OPSD
        ("sample", [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]),  # every rollout wrong: every row for OPSD
        ("sample", [1.0, 0.0, 0.0, 1.0], [0.7, -0.7, -1.0, 1.0]),  # mixed: rows 1 and 2 for OPSD
    ],
)
def test_hybrid_routes_against_the_pure_methods(tiny_model_dir, tmp_path, route, rewards, advantages):
    """A routed hybrid's loss and gradients: GRPO's (the float64 naive loss of unpadded rows) on the rollouts the
    route leaves to it, with the advantages of the others 0, plus OPSD's (OPSDTrainer's loss on those rows, over
    the step's tokens of every row); a route with no eligible row is GRPO's loss exactly, one with every row
    eligible OPSD's. 1e-6 on the loss, 1e-5 on the gradients."""
    from opsd.rl.routes import sd_rows

    hybrid, opsd = _routed_hybrid(tiny_model_dir, tmp_path, route)
    rows = sd_rows(rewards, G, route)
    routed = [0.0 if sd else a for a, sd in zip(advantages, rows, strict=True)]
    batch, prompts, completions = _batch(hybrid, routed, teacher=True)
    batch["sd_rows"] = torch.tensor(rows)
    loss = hybrid._compute_loss(hybrid.model, batch)
    loss.backward()
    ours = _grads(hybrid.model)

    grpo = naive_grpo_loss(hybrid.model, prompts, completions, routed, hybrid.args)
    grpo.backward()
    want, picked = float(grpo), [i for i, sd in enumerate(rows) if sd]
    if picked:
        sd = opsd.compute_loss(opsd.model, _rows(batch, picked))
        sd.backward()
        want += float(sd)
        for name, grad in _grads(opsd.model).items():
            for p_name, p in hybrid.model.named_parameters():
                if p_name == name:
                    p.grad = grad if p.grad is None else p.grad + grad
    assert abs(float(loss) - want) <= 1e-6
    _close(ours, _grads(hybrid.model), 1e-5)
    if not picked:  # GRPO's loss exactly: the same TRL loss as a hybrid with no OPSD term
        assert float(loss) == float(trl.GRPOTrainer._compute_loss(hybrid, hybrid.model, batch))
    if all(rows):
        assert abs(float(loss) - float(opsd.compute_loss(opsd.model, batch))) <= 1e-6
