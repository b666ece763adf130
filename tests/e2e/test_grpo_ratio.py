"""GRPO's importance ratio on the real vLLM CPU engine: at the first step the trainer's weights are the engine's, so
the trainer must score each sampled token as the engine sampled it (temperature, then top-k and top-p,
renormalised: vLLM's processed log-probs) and every ratio is 1 up to rounding. The tiny model, the shipped
sampling (T 1.1, top-k 20, top-p 0.95), 128-token rollouts, float32. TRL's own scoring (temperature only) of the
same batch is measured beside it and must fail the same bounds: the check sees the bias it guards against."""

import math

import pytest
import torch
import trl

from tests.conftest import colocated_rendezvous

LENGTH = 128


@pytest.fixture(scope="module")
def grpo_step(tiny_model_dir, tmp_path_factory):
    """One GRPO step (2 problems x 2 rollouts of up to 128 tokens) with vLLM rollouts; the first generation's batch
    and TRL's temperature-only log-probs of it, taken before the step."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.configuration.config import OPSDConfig
    from opsd.launch.preflight import build_paired_dataset
    from opsd.rl.grpo import GRPOTrainer

    cfg = OPSDConfig(
        output_dir=str(tmp_path_factory.mktemp("grpo")), method="grpo", num_generations=2, max_steps=1,
        per_device_train_batch_size=2, gradient_accumulation_steps=1, max_completion_length=LENGTH,
        use_vllm=True, vllm_max_model_length=512, save_strategy="no", gradient_checkpointing=False,
        logging_steps=1,
    )  # fmt: skip
    assert (cfg.temperature, cfg.top_k, cfg.top_p) == (1.1, 20, 0.95)  # the shipped sampling
    with colocated_rendezvous():
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), args=cfg,
            train_dataset=build_paired_dataset(cfg)[0], processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
        )  # fmt: skip
        seen = {}
        generate = trainer._generate_and_score_completions

        def recorded(inputs):
            out = generate(inputs)
            if not seen:
                ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
                mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
                with torch.no_grad():
                    trl_logps, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
                        trainer, trainer.model, ids, mask, out["completion_ids"].size(1)
                    )
                seen.update(out, trl_logps=trl_logps)
            return out

        trainer._generate_and_score_completions = recorded
        trainer.train()
    return trainer, seen


def _log_ratios(trainer_BT, engine_BT, mask_BT):
    """(per-token |log ratio| over the sampled tokens, per-rollout sequence ratio) of the trainer's log-probs to
    the engine's."""
    mask = mask_BT.bool()
    diff_BT = (trainer_BT.double() - engine_BT.double()).masked_fill(~mask, 0.0)
    return diff_BT.abs()[mask], diff_BT.sum(1).exp()


def test_the_ratio_is_one_at_the_first_step(grpo_step):
    trainer, batch = grpo_step
    mask = batch["completion_mask"]
    assert int(mask.sum(1).max()) == LENGTH  # a rollout of the full 128 tokens is in the batch
    per_token, sequence = _log_ratios(batch["old_per_token_logps"], batch["sampling_per_token_logps"], mask)
    assert float(per_token.mean()) < 1e-3
    full = mask.sum(1) == LENGTH
    assert all(0.99 <= float(r) <= 1.01 for r in sequence[full]), sequence.tolist()
    assert all(0.99 <= float(r) <= 1.01 for r in sequence), sequence.tolist()
    log = next(r for r in trainer.state.log_history if "sampling/importance_sampling_ratio/mean" in r)
    for key in ("min", "mean", "max"):
        assert abs(log[f"sampling/importance_sampling_ratio/{key}"] - 1.0) <= 0.01, (key, log)
    assert log["rollout/logprob_gap/mean"] < 1e-3 and log["rollout/logprob_gap/outside"] == 0.0
    for key in ("rl/zero_signal_groups", "rl/positive_rollouts", "rl/sd_token_share"):
        assert key in log and math.isfinite(log[key])
    assert log["rl/sd_token_share"] == 0.0  # GRPO has no self-distillation term


def test_trls_temperature_only_scoring_fails_the_same_bounds(grpo_step):
    """What the trainer computed before: TRL's forward divides by the temperature only, so every token's ratio to
    the engine's truncated, renormalised log-prob is below 1 and a 128-token rollout's is far below 0.99."""
    _, batch = grpo_step
    mask = batch["completion_mask"]
    per_token, sequence = _log_ratios(batch["trl_logps"], batch["sampling_per_token_logps"], mask)
    diff = (batch["trl_logps"] - batch["sampling_per_token_logps"])[mask.bool()]
    assert float(diff.max()) <= 1e-5  # <= 1 at every token
    assert float(per_token.mean()) > 1e-3
    assert float(sequence[mask.sum(1) == LENGTH].max()) < 0.99
