"""A training run's bookkeeping: its logs, checkpoints, resume and held-out probe (its directory's layout is
`opsd.rundir`). Launching a run is `opsd.launch`; its speed and memory settings are `opsd.speed`.

* `provenance`: package versions and the git revision saved beside the checkpoints;
* `resume`: a run directory belongs to one configuration; resuming checks it;
* `step_watch`: what watches each optimizer step: its phase times, its non-finite loss or gradients (skipped),
  its rollouts graded like the evaluation, in the background (`rollout/correct`, `rollout/boxed`,
  `rollout/length`), and their lengths (`completions/*`); `MetricsWindow`, the trainers' own logging window,
  averaged into TRL's public `log`;
* `ledger`: the compute ledger (tokens and seconds per step, every method; ledger.jsonl) and a run's totals;
* `callbacks`: metrics.jsonl, the final checkpoint whatever the save strategy, checkpoint marks, tail weight
  averaging;
* `probe`: the held-out probe (is the student moving towards its teacher?);
* `logprob_gap`: `rollout/logprob_gap`, the rollout engine's log-probs of its samples against the trainer's;
* `curves`: the training curves of a run as one PNG (`python -m opsd.run.curves DIR`).
"""
