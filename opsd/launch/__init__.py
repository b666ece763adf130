"""Launching a training run: its inputs checked before any model loads, and the capped budget's plan.

* `preflight`: every input of a run checked before any model loads, and the dry run (opsd_train.py,
  train_capped.sh);
* `capped`: the 100-step budget's launch plan (`train_capped.sh`, `python -m opsd.launch.capped`), checked by
  `preflight`'s dry run before it starts.
"""
