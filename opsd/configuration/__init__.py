"""Configuration: every switch of training, its default, where a value can come from and how it is checked.

* `switches`: every switch declared once, in its field's metadata (default, help, choices or range, which
  sources may set it under the capped harness, its `OPSD_*` name, any older name), and the views the rest of
  the repo reads (`CHOICES`, `RANGES`, `RECIPE_KEYS`, ...); TRL-free, so any module can import it;
* `config`: `OPSDConfig`, the switches on TRL's `SDFTConfig`, with the fields derived from others set once
  (the rollout engine, TRL's generation window, ...) and every check run (which value source wins:
  docs/configuration.md; the loss's settings are built from it beside the loss: `opsd.method.loss.loss_settings`);
* `checks`: how a value is checked: its choices and range, the rules across fields, the switches each method
  reads, the switches the others leave without effect, TRL's options OPSD ignores, the generation window;
* `sources`: where a value given as text comes from: `recipe.env`, `OPSD_*` and the harness's pass-through
  flags, each checked against its field's type; older field names (opsd_train.py's command line and its YAML,
  which append these values after the user's flags, are `opsd.launch.command_line`);
* `docs`: docs/configuration.md's switch table, generated from the switches.
"""
