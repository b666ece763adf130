"""The probe (opsd/run/probe.py): its per-token numbers against a naive computation, the held-out split, the
warnings, and training runs on the tiny model where the probe must see the student approach its teacher."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from opsd.method.loss import LossSettings
from opsd.run.probe import PROBE_FILE, Probe, probe_token_sums, split_probe


def _naive_sums(h_s, h_t, w_s, w_t, beta, tau, ids):
    """Divergence, top-1 agreement, teacher-token log-prob and |log p_T(y) - log p_S(y)| from full logits, one
    token at a time."""
    div = agree = logp = adv = 0.0
    for i in range(h_s.shape[0]):
        s = (h_s[i] @ w_s.T).double() / tau
        t = (h_t[i] @ w_t.T).double() / tau
        ps, pt = s.softmax(-1), t.softmax(-1)
        if beta == 0.0:
            d = (pt * (pt.log() - ps.log())).sum()
        elif beta == 1.0:
            d = (ps * (ps.log() - pt.log())).sum()
        else:
            m = beta * pt + (1 - beta) * ps
            d = beta * (pt * (pt / m).log()).sum() + (1 - beta) * (ps * (ps / m).log()).sum()
        div += float(d)
        agree += float(s.argmax() == t.argmax())
        logp += float(ps.log()[t.argmax()])
        adv += abs(float(pt.log()[ids[i]] - ps.log()[ids[i]]))
    return torch.tensor([div, agree, logp, adv], dtype=torch.float64)


def _settings(*, beta, temperature, chunk_size=1024):
    """The loss's settings the probe reads (beta, temperature, chunk size); the clip and support do not apply."""
    return LossSettings(
        beta=beta, temperature=temperature, clip=0.05, clip_mode="element", teacher_support_k=0, loss_type="jsd",
        chunk_size=chunk_size,
    )  # fmt: skip


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_probe_sums_match_naive(beta, chunk):
    g = torch.Generator().manual_seed(0)
    n, h, v = 7, 6, 11
    h_s, h_t = torch.randn(n, h, generator=g), torch.randn(n, h, generator=g)
    w_s, w_t = torch.randn(v, h, generator=g), torch.randn(v, h, generator=g)
    ids = torch.randint(0, v, (n,), generator=g)
    got = probe_token_sums(
        h_s, h_t, w_s, w_t, settings=_settings(beta=beta, temperature=1.3, chunk_size=chunk), target_ids_N=ids
    )
    want = _naive_sums(h_s, h_t, w_s, w_t, beta, 1.3, ids)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_probe_sums_of_identical_roles():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(5, 4, generator=g), torch.randn(9, 4, generator=g)
    ids = torch.arange(5)
    sums = probe_token_sums(h, h, w, w, settings=_settings(beta=0.0, temperature=1.0), target_ids_N=ids)
    div, agree, logp, adv = sums.tolist()
    assert abs(div) < 1e-6 and agree == 5.0 and abs(adv) < 1e-6
    assert logp == pytest.approx(float(F.log_softmax(h @ w.T, -1).max(-1).values.sum()), rel=1e-5)


def test_split_probe_holds_rows_out():
    from datasets import Dataset

    ds = Dataset.from_list([{"prompt": f"p{i}", "privileged_context": f"r{i}"} for i in range(50)])
    train, probe = split_probe(ds, 8, seed=3)
    assert len(train) == 42 and len(probe) == 8
    assert not {r["prompt"] for r in probe} & set(train["prompt"])
    assert split_probe(ds, 8, seed=3)[1] == probe
    assert split_probe(ds, 8, seed=4)[1] != probe
    assert split_probe(ds, 0, seed=3) == (ds, [])
    with pytest.raises(ValueError, match="probe_size=50 would hold out all 50"):
        split_probe(ds, 50, seed=0)


def _fake_probe(first=None):
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(num_processes=1, is_main_process=True),
        args=SimpleNamespace(clip_mode="element", learning_rate=1e-4, output_dir="/nonexistent"),
    )
    probe = Probe(trainer, [], every=10)
    probe.first = first
    probe._save = lambda: None
    return probe


def test_warns_once_when_probe_divergence_rises(caplog):
    probe = _fake_probe(first=0.10)
    with caplog.at_level(logging.WARNING, logger="opsd.run.probe"):
        probe._check(10, {"probe/divergence": 0.105})  # within 10%: no warning
        assert not caplog.records
        probe._check(20, {"probe/divergence": 0.2})
        probe._check(30, {"probe/divergence": 0.3})
    assert len(caplog.records) == 1
    assert "rose from 0.1000 at step 0 to 0.2000 at step 20" in caplog.text


def test_warns_once_after_ten_negative_loss_steps(caplog):
    probe = _fake_probe()
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    losses = [0.1, -0.1, -0.2, 0.05] + [-0.01] * 12
    with caplog.at_level(logging.WARNING, logger="opsd.run.probe"):
        for step, loss in enumerate(losses, start=1):
            state.global_step = step
            probe.on_log(None, state, None, logs={"loss": loss})
            if step < 4 + 10:  # the negative run starting at step 5 reaches 10 steps at step 14
                assert not caplog.records, step
    assert len(caplog.records) == 1
    assert "negative for 10 steps (steps 5-14)" in caplog.text


# --- training on the tiny model ------------------------------------------------------------------------------


def _probe_run(model_dir, out, *, clip_mode, probe=True, steps=6, lr=1e-2):
    """LoRA OPSD on the tiny model (transformers rollouts) with a student put off its teacher.

    A random tiny model barely reads its context, so student and teacher start almost equal: random lora_B
    values (they start at zero) move the student off the fixed teacher (adapters disabled), which gives it
    something to come back from. Rollouts are one token long, so the probe's frozen tokens and the training
    tokens are scored at the same position (the first completion token, whose distribution does not depend on
    what was sampled): what training learns there must show on the held-out problems.
    """
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.configuration.config import OPSDConfig
    from opsd.launch.preflight import build_paired_dataset
    from opsd_trainer import OPSDTrainer

    cfg = OPSDConfig(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=2, gradient_accumulation_steps=1,
        max_completion_length=1, use_vllm=False, learning_rate=lr, save_strategy="no",
        gradient_checkpointing=False, clip_mode=clip_mode, probe_steps=3, probe_size=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train_rows, probe_rows = split_probe(build_paired_dataset(cfg)[0], cfg.probe_size, seed=cfg.seed)
    trainer = OPSDTrainer(
        model=model, args=cfg, train_dataset=train_rows, processing_class=AutoTokenizer.from_pretrained(model_dir),
        peft_config=LoraConfig(
            r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], task_type="CAUSAL_LM"
        ),
    )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    if probe:
        trainer.add_callback(Probe(trainer, probe_rows, cfg.probe_steps))
    trainer.train()
    curve = [(r["step"], r["probe/divergence"]) for r in trainer.state.log_history if "probe/divergence" in r]
    return trainer, curve


def test_clip_none_training_lowers_probe_divergence(tiny_model_dir, tmp_path):
    trainer, curve = _probe_run(tiny_model_dir, tmp_path / "none", clip_mode="none")
    assert [s for s, _ in curve] == [0, 3, 6]
    first, last = curve[0][1], curve[-1][1]
    assert first > 0.01, "the random adapter should put the student off its teacher"
    assert last < 0.5 * first, curve  # measured: 0.0180 -> 0.0093 -> 0.0043
    saved = json.loads((tmp_path / "none" / PROBE_FILE).read_text())
    assert len(saved["rows"]) == 4 and saved["step0_divergence"] == pytest.approx(first)
    assert all(r["completion_ids"] for r in saved["rows"])


def test_probe_set_is_frozen_and_does_not_change_training(tiny_model_dir, tmp_path):
    """The probe's rollouts draw no training randomness (same final weights without it), and a second
    trainer on the same output directory reloads the frozen set and scores identical weights identically."""
    with_probe, curve = _probe_run(tiny_model_dir, tmp_path / "a", clip_mode="none", steps=3)
    without, _ = _probe_run(tiny_model_dir, tmp_path / "b", clip_mode="none", steps=3, probe=False)
    for (n, p), (_, q) in zip(
        with_probe.model.named_parameters(), without.model.named_parameters(), strict=True
    ):
        if p.requires_grad:
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=n)
    frozen = json.loads((tmp_path / "a" / PROBE_FILE).read_text())["rows"]
    again = Probe(with_probe, [], every=3)
    again.rows = frozen  # the held-out rows; freeze() must load, not resample
    again.freeze()
    assert again.frozen == frozen
    assert again.score()["probe/divergence"] == pytest.approx(curve[-1][1], rel=1e-5)


def test_the_probes_rollouts_are_booked_in_the_ledgers_own_column(tiny_model_dir, tmp_path):
    """The probe's frozen rollouts are in step 1's `probe_tokens` (and its `ledger/probe_tokens` metric), apart
    from the training rollouts' `generated_tokens`; a trainer that reloads the set books none."""
    from opsd.run.ledger import ledger_totals

    trainer, _ = _probe_run(tiny_model_dir, tmp_path, clip_mode="none", steps=2)
    frozen = json.loads((tmp_path / PROBE_FILE).read_text())["rows"]
    sampled = sum(len(r["completion_ids"]) for r in frozen)
    assert sampled == 4  # four probe rows of one token (max_completion_length=1)
    rows = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [(r["step"], r["probe_tokens"]) for r in rows] == [(1, sampled), (2, 0)]
    assert all(r["generated_tokens"] == 2 for r in rows)  # two training rollouts of one token a step
    assert ledger_totals(rows)["probe_tokens"] == sampled
    # A run from before the column has no probe total; where some row has it, a row without it counts 0.
    older = [{k: v for k, v in r.items() if k != "probe_tokens"} for r in rows]
    assert "probe_tokens" not in ledger_totals(older)
    assert ledger_totals([older[0], rows[1]])["probe_tokens"] == 0
    logged = [r["ledger/probe_tokens"] for r in trainer.state.log_history if "ledger/probe_tokens" in r]
    assert logged == [sampled, 0]
    again = Probe(trainer, frozen, every=3)
    again.freeze()  # loads the saved set: nothing sampled, nothing booked
    assert trainer.ledger.counts["probe_tokens"] == 0
