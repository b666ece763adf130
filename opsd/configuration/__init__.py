"""Configuration: every switch of training, its default, its check and where a value can come from.

* `choices`: the allowed values of every choice switch; `ranges`: the allowed range of every numeric one
  (training's `RANGES`, eval_aime.py's `EVAL_RANGES`);
* `config`: `OPSDConfig`, the published recipe as defaults (which value source wins: docs/configuration.md);
* `recipe`: `recipe.env` files and `OPSD_*` variables, validated into command-line flags;
* `legacy`: TRL/open-r1 YAML keys that transformers 5 removed, translated or ignored;
* `engine_env`: the environment every vLLM engine of the repo starts with;
* `config_docs`: docs/configuration.md's switch table, generated from `OPSDConfig`.
"""
