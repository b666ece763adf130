"""Where a value comes from: the command line, YAML, `recipe.env`, `OPSD_*` variables and the harness's flags.

* `cli`: opsd_train.py's command line (flags, YAML, recipe, environment) into one checked `OPSDConfig`;
* `recipe`: `recipe.env` files, `OPSD_*` variables and pass-through flags, validated into command-line flags;
* `keys`: which fields `recipe.env`, `OPSD_*` and the harness's flags may set (method, operational, budget);
* `aliases`: older names of fields, still accepted (`jsd_token_clip` is `divergence_clip`);
* `legacy`: TRL/open-r1 YAML keys that transformers 5 removed, translated or ignored;
* `yaml_bounds`: a YAML config's nodes counted (aliases expanded) before anything walks them, its numbers checked.
"""
