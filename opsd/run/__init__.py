"""A training run's bookkeeping: its logs, checkpoints, resume and held-out probe (its directory's layout is
`opsd.rundir`). Launching a run is `opsd.launch`; its speed and memory settings are `opsd.speed`.

* `provenance`: package versions and the git revision saved beside the checkpoints;
* `resume`: a run directory belongs to one configuration; resuming checks it;
* `callbacks`: metrics.jsonl, step timing, tail weight averaging, non-finite steps;
* `probe`: the held-out probe (is the student moving towards its teacher?);
* `rollout_grades`: every generation's rollouts graded like the evaluation, in the background
  (`rollout/correct`, `rollout/boxed`, `rollout/length`);
* `curves`: the training curves of a run as one PNG (`python -m opsd.run.curves DIR`).
"""
