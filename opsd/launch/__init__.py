"""Launching a training run: its command line, its inputs checked before any model loads, and the capped budget's
plan.

* `command_line`: opsd_train.py's flags and `--config` YAML (keys transformers 5 removed, values bounded), read
  by TRL's parser into one `OPSDConfig` with the `recipe.env` and `OPSD_*` values after them (`parse_config`),
  and `--help`;
* `preflight`: every input of a run checked before any model loads, and the dry run (opsd_train.py,
  train_capped.sh);
* `capped`: the 100-step budget's launch plan (`train_capped.sh`, `python -m opsd.launch.capped`), checked by
  `preflight`'s dry run before it starts.
"""
