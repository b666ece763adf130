"""The reinforcement-learning methods beside OPSD (docs/method.md §6), run by the same harness: same model, LoRA,
data, prompts, rollout engine and seeds, budget, checkpoints and metrics, so that `method` is the one difference.

* `reward`: the reward of a rollout, the evaluation's own grader (1 for a correct boxed answer, else 0);
* `grpo`: `GRPOTrainer`, TRL's GRPO (its advantages, loss and defaults) with the harness's prompts, engine, reward,
  exact positions, the sampled tokens scored as the engine sampled them (`opsd.method.sampler`) and the compute
  ledger; `grpo_args`, the TRL config a run's `OPSDConfig` gives (GRPO's own switches included);
* `routes`: which rollouts the hybrid's OPSD term trains on (`hybrid_route`: mix, group, sample), and the `rl/*`
  sums;
* `hybrid`: `HybridTrainer`, TRL's GRPO loss plus `sd_weight` x the OPSD loss on the routed rollouts, one student
  forward for both.

`opsd_trainer.OPSDTrainer` is the third method; `opsd_train.py` picks the trainer by `method` (`TRAINERS`).
"""
