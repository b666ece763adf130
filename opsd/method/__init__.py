"""The method (docs/method.md §1): one OPSD step, from the rollout to the loss.

Modules, in the order a step uses them:

* `lora_targets`: which modules get LoRA adapters (`auto`: every layer kind's projections), logged per layer kind;
* `engine_classes`: the trainer's model classes kept out of the colocated engine's in-place decoration, and an
  engine that cannot start on a family refused in one line;
* `seeds`: per-row rollout seeds, the same for any number of processes and on resume;
* `weights`: the student's weights pushed into the running vLLM engine before each rollout;
* `prompts`: the student's and the teacher's prompts (the teacher reads the reference solution);
* `pairing`: whose reference each problem's teacher reads (`teacher_ref_pairing`);
* `ema_teacher`: the EMA teacher (`teacher_mode=ema`);
* `hidden`: rows laid out for one role (positions, padding) and the final hidden states of completion tokens;
* `logits`: what turns a hidden state into the model's logits (the lm_head, then the model's own scale or
  soft-cap, found against its logits);
* `loss`: the divergence per token, its clip and its reduction, chunked over the vocabulary projection (its
  arguments: `LossSettings`, built by `OPSDConfig.loss_settings`);
* `rollouts`: the trainer's rollout side (TRL's generation hooks, seeded, weights pushed into the engine) and
  its `[teacher prompt ; completion]` rows;
* `loss_step`: the trainer's loss side (both roles' hidden states, the loss over the step's tokens, metrics,
  the completions log);
* `completions`: the completions log, a few rows of what the student wrote and where its teacher disagreed;
* `trl_compat`: the narrow patches where TRL's trainer does something OPSD must not.
"""
