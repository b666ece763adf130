"""Configuration: every switch of training, its default, where a value can come from and how it is checked.

* `config`: `OPSDConfig`, the published recipe as defaults (which value source wins: docs/configuration.md)
  (the loss's settings are built from it beside the loss: `opsd.method.loss.loss_settings`);
  `config_docs`: docs/configuration.md's switch table, generated from it;
* `sources/`: where a value comes from: the command line (`cli`), `recipe.env` and `OPSD_*` (`recipe`), which
  keys each may set (`keys`), older field names (`aliases`) and removed TRL/open-r1 YAML keys (`legacy`);
* `checks/`: how a value is checked: its type (`values`), its choices (`choices`), its range and the checks
  across fields (`ranges`), the TRL fields OPSD sets itself (`trl_options`);
* `engine_env`: the environment every vLLM engine of the repo starts with.
"""
