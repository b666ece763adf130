"""TRL/open-r1 YAML configs as they are written: keys transformers 5 removed, translated or ignored.

Recipes written for transformers 4 still carry `warmup_ratio`, `overwrite_output_dir`,
`evaluation_strategy` and the like, which transformers 5 removed. `translate_yaml` rewrites them before the
parser sees them, logging one note per key that says what was done:

- translated: `warmup_ratio` becomes `warmup_steps` (transformers 5 reads a value below 1 as the fraction
  of `max_steps`), `no_cuda` becomes `use_cpu`;
- ignored, because a training-only OPSD run does not use them: `overwrite_output_dir` (OPSD resumes from
  the newest complete checkpoint; a run directory belongs to one configuration), evaluation settings
  (`evaluation_strategy`, and `eval_strategy`/`do_eval` set to evaluate: OPSD trains on no evaluation set,
  `eval_aime.py` scores checkpoints), hub push names and other output-format switches;
- still errors: removed keys that would change the method or the budget (`per_gpu_train_batch_size`) and
  keys that are not config fields at all, each with a suggestion (`learnin_rate`: did you mean
  `learning_rate`?), instead of transformers' advice to set `fail_with_unknown_args=False`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from opsd.errors import InvalidValue, closest

logger = logging.getLogger(__name__)

# Removed key -> the field it becomes (the value is kept).
RENAMED = {"warmup_ratio": "warmup_steps", "no_cuda": "use_cpu"}
# Removed or evaluation-only keys that a training-only run can ignore, with why.
IGNORED = {
    "overwrite_output_dir": "OPSD resumes from the newest complete checkpoint in output_dir and refuses one "
    "of another configuration; use a new output_dir to start over",
    "evaluation_strategy": "OPSD trains on no evaluation set; score checkpoints with eval_aime.py",
    "logging_dir": "transformers 5 removed it; trackers choose their own directory",
    "push_to_hub_model_id": "transformers 5 removed it; use hub_model_id",
    "push_to_hub_organization": "transformers 5 removed it; use hub_model_id",
    "push_to_hub_token": "transformers 5 removed it; use hub_token",
    "save_safetensors": "checkpoints are always safetensors in transformers 5",
    "include_tokens_per_second": "OPSD logs rollout/tokens_per_s itself",
    "include_inputs_for_metrics": "OPSD computes no evaluation metrics",
    "fp16_backend": "transformers 5 removed it; precision follows bf16/fp16",
    "half_precision_backend": "transformers 5 removed it; precision follows bf16/fp16",
    "use_mps_device": "transformers 5 removed it; the device is chosen automatically",
}
# Fields that exist but would make a training-only run fail once the model has loaded (no evaluation set):
# field -> the value that turns them off.
EVALUATION_OFF = {"eval_strategy": "no", "do_eval": False}
# Removed keys that change the budget or the method: refused, naming what to use.
REFUSED = {
    "per_gpu_train_batch_size": "use per_device_train_batch_size",
    "per_gpu_eval_batch_size": "OPSD trains on no evaluation set; remove it",
}


def translate_yaml(config: Mapping[str, Any], known: Iterable[str], *, source: str) -> dict[str, Any]:
    """`config` (a YAML mapping) with removed keys translated or dropped, each with one logged note; raises
    InvalidValue naming every key that is refused or unknown, with a suggestion."""
    known = set(known)
    out: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in config.items():
        if key in RENAMED:
            target = RENAMED[key]
            if target in config:
                problems.append(f"{key} and {target} are both set; keep only {target}")
                continue
            logger.warning("%s: note: %s=%r is read as %s=%r (transformers 5 removed %s)", source, key, value,
                           target, value, key)  # fmt: skip
            out[target] = value
        elif key in IGNORED:
            logger.warning("%s: note: %s=%r is ignored: %s", source, key, value, IGNORED[key])
        elif key in EVALUATION_OFF and value not in (EVALUATION_OFF[key], None, "NO", "No"):
            logger.warning(
                "%s: note: %s=%r is ignored (set to %r): OPSD trains on no evaluation set; score checkpoints "
                "with eval_aime.py",
                source, key, value, EVALUATION_OFF[key],
            )  # fmt: skip
            out[key] = EVALUATION_OFF[key]
        elif key in REFUSED:
            problems.append(f"{key} was removed in transformers 5 and changes the run; {REFUSED[key]}")
        elif key not in known:
            near = closest(key, known)
            problems.append(f"{key} is not a config field" + (f" (did you mean {near}?)" if near else ""))
        else:
            out[key] = value
    if problems:
        raise InvalidValue(
            f"{source}: {'; '.join(problems)}; fix the YAML keys (every OPSDConfig field and TRL/transformers "
            "training argument is one: python opsd_train.py --help)"
        )
    return out
