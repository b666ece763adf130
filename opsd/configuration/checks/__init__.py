"""How a value is checked: its type, its choices, its range, and the TRL fields OPSD sets itself.

* `values`: one value from any source checked against its field's type and choices;
* `choices`: the allowed values of every choice switch, declared once;
* `ranges`: the allowed range of every numeric switch (training's `RANGES`, eval_aime.py's `EVAL_RANGES`) and
  the checks across fields;
* `inert`: switches the other settings leave without effect (a warning line each; the experiment's arms are
  compared without them);
* `trl_options`: TRL's SDFT fields OPSD ignores or derives (refused when set otherwise), and its generation
  window, set from `steps_per_rollout`.
"""
