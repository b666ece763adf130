"""The method (docs/method.md §1): what one OPSD step computes, as functions and classes that take what they need
as arguments. `opsd_trainer.OPSDTrainer` calls them, in the order of a step, from its TRL overrides; nothing here
reads the trainer or knows the run directory's file names (the trainer passes them in).

Modules, in the order a step uses them:

* `lora_targets`: which modules get LoRA adapters (`auto`: every layer kind's projections), logged per layer kind;
* `engine_classes`: the trainer's model classes kept out of the colocated engine's in-place decoration, and an
  engine that cannot start on a family refused in one line;
* `rollouts`: the rollout engine, one object built by the entry point and handed to the trainer
  (`build_rollout_engine`): transformers' generate on the trained model, or `engine_vllm`'s `VLLMRolloutEngine`
  (TRL's vLLM engine with OPSD's seeds, weight pushes and settings, imported only with vLLM);
* `engine`: what every engine shares: per-row seeds (the same rollouts for any number of processes and on
  resume), and the student's merged weights pushed into it before each generation; `engine_env`: the
  environment every vLLM engine of the repo starts with, and the fixed KV cache's size;
* `prompts`: the student's and the teacher's prompts (the teacher reads the reference solution), and the
  `[teacher prompt ; completion]` rows;
* `pairing`: whose reference each problem's teacher reads (`teacher_ref_pairing`);
* `contrast`: the hints of the contrastive teacher (`teacher_contrast`: another problem's reference, the
  problem's own with its final answer replaced, or the model's own correct and wrong sibling rollouts);
* `ema_teacher`: the EMA teacher (`teacher_mode=ema`), a callback of its own, and a checkpoint of the student's
  adapter alone;
* `hidden`: rows laid out for one role (positions, padding), the final hidden states of completion tokens
  (`CompletionHiddenStates`: both roles'), and what turns them into the model's logits (the lm_head, then the
  model's own scale or soft-cap, found against its logits);
* `contrast_target`: RLCSD's target (anchored on the teacher, on its top-k plus a tail bucket, KL-weighted) and
  its modulation of GRPO advantages;
* `token_weights`: the per-token loss weights (`token_weight`);
* `sampler`: the rollout sampler's distribution (temperature, top-k, top-p, renormalised) and the sampled tokens'
  log-probs under it, with a gradient (GRPO's ratio, `rollout/logprob_gap`);
* `loss`: the divergence per token, its clip and its reduction, chunked over the vocabulary projection (its
  arguments: `LossSettings`, built from the config by `loss_settings`), against the teacher or the contrastive
  target, the teacher-free fixed advantage;
* `scoring`: the scoring core every self-distilling method calls (OPSD's trainer, the hybrid's OPSD term): the
  loss tokens, the teacher's forwards under its weights (`TeacherWeights`), the loss of a micro-batch, its
  `opsd/*` metrics and the teacher's ledger tokens;
* `completions`: the completions log, a few rows of what the student wrote and where its teacher disagreed;
* `trl_compat`: the narrow patches where TRL's trainer does something OPSD must not.
"""
