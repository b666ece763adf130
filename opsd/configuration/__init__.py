"""Configuration: every switch of training, its default, its check and where a value can come from.

* `choices`: the allowed values of every choice switch; `ranges`: the allowed range of every numeric one
  (training's `RANGES`, eval_aime.py's `EVAL_RANGES`);
* `config`: `OPSDConfig`, the published recipe as defaults (which value source wins: docs/configuration.md)
  (the loss's settings are built from it beside the loss: `opsd.method.loss.loss_settings`);
* `trl_options`: TRL's SDFT fields OPSD ignores or derives (refused when set otherwise), and its generation
  window, set from `steps_per_rollout`;
* `aliases`: older names of fields, still accepted (`jsd_token_clip` is `divergence_clip`);
* `keys`: which fields `recipe.env`, `OPSD_*` and the harness's flags may set (method, operational, budget);
* `values`: one value from those sources checked against its field's type and choices;
* `recipe`: `recipe.env` files, `OPSD_*` variables and pass-through flags, validated into command-line flags;
* `legacy`: TRL/open-r1 YAML keys that transformers 5 removed, translated or ignored;
* `cli`: opsd_train.py's command line (flags, YAML, recipe, environment) into one checked `OPSDConfig`;
* `engine_env`: the environment every vLLM engine of the repo starts with;
* `config_docs`: docs/configuration.md's switch table, generated from `OPSDConfig`.
"""
