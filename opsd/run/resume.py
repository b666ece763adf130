"""A run directory belongs to one configuration: resuming checks the settings against `opsd_config.json`.

Rerunning a command in an output directory that holds a complete checkpoint resumes from it. Before that,
the resolved settings are compared with the ones saved in `<output_dir>/opsd_config.json`:

- `MAY_CHANGE` keys may differ: operational settings (trackers, logging, memory, micro-batch: they change
  neither the budget nor the arithmetic of the method), checkpoint cadence, and `max_steps` (continuing a
  run for longer). Each change is logged and appended to the file's `history`.
- Any other difference in a method or budget setting (`compared_keys`) is refused with one line naming
  each changed key, saved and new value, and the two ways out: a new `--output_dir`, or
  `--allow-config-change`, which continues the run with the new settings and records the change in
  `history` too.

`opsd_config.json` always holds the settings of the latest segment, and its `history` lists every change
with the step it took effect at, so the first configuration can be read back from the file. A key missing
on either side (a file written by an older release, the process count in a dry run) is not compared. An
output directory without a complete checkpoint is a fresh start: nothing was trained, and the file is
rewritten.

`eval_aime.py` makes the same refusal for evaluation directories (`opsd/evaluation/samples.py`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from opsd.configuration.switches import BUDGET_KEYS, OPERATIONAL_KEYS, RECIPE_KEYS, Switches
from opsd.errors import InvalidValue
from opsd.rundir import ALLOW_FLAG, CONFIG_FILE, PAIRING_FILE, latest_complete_checkpoint

logger = logging.getLogger(__name__)

HISTORY_KEY = "history"
# How a process splits its problems per step into micro-batches (opsd/speed/microbatch.py: memory, not
# method): these may change on resume as long as PROBLEMS_PER_PROCESS, their product, does not.
SPLIT_KEYS = frozenset({
    "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size", "steps_per_generation",
})  # fmt: skip
PROBLEMS_PER_PROCESS = "problems_per_process_per_step"
# Settings that may change when a run resumes. `micro_batch_size` is operational (memory for time on the
# same arithmetic), whether or not this release has the field. `use_vllm` is the machine's answer to
# `rollout_engine` (which is compared): with rollout_engine=auto, whether vLLM is installed.
MAY_CHANGE = OPERATIONAL_KEYS | SPLIT_KEYS | {
    "micro_batch_size", "use_vllm", "max_steps", "save_steps", "save_strategy", "save_total_limit", "output_dir",
    "resume_from_checkpoint", "logging_dir", "logging_strategy", "push_to_hub", "hub_model_id",
    "hub_strategy", "hub_private_repo", "dataloader_num_workers", "dataloader_prefetch_factor",
}  # fmt: skip
# Inherited settings that change what is trained or how, beyond RECIPE_KEYS and BUDGET_KEYS.
METHOD_KEYS = frozenset({
    "bf16", "fp16", "tf32", "optim", "optim_args", "adam_epsilon", "lr_scheduler_kwargs",
    "label_smoothing_factor", "neftune_noise_alpha", "min_p", "repetition_penalty", "generation_kwargs",
    "teacher_sync_steps", "vllm_max_model_length", "max_prompt_length", "num_processes",
})  # fmt: skip
# Written into opsd_config.json beside the settings; never compared.
NOT_SETTINGS = frozenset({"resolved_model_path", "recipe", "provenance", "micro_batch", HISTORY_KEY})
SHOWN_CHARS = 60


def compared_keys() -> frozenset[str]:
    """Every setting whose change on resume is refused: the recipe, the budget, OPSD's own fields and the
    inherited method settings, less what may change."""
    # OPSD's own fields and those it redeclares (published defaults for TRL arguments) are OPSD settings.
    own = {f.name for f in dataclasses.fields(Switches)}
    return frozenset(
        (RECIPE_KEYS | BUDGET_KEYS | own | METHOD_KEYS | {PROBLEMS_PER_PROCESS}) - MAY_CHANGE - NOT_SETTINGS
    )


def _with_problems_per_process(settings: Mapping[str, Any]) -> dict[str, Any]:
    """`settings` plus the product that the micro-batch split must keep (where both factors are there)."""
    out = dict(settings)
    batch, accumulation = out.get("per_device_train_batch_size"), out.get("gradient_accumulation_steps")
    if isinstance(batch, int) and isinstance(accumulation, int):
        out[PROBLEMS_PER_PROCESS] = batch * accumulation
    return out


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def config_changes(saved: Mapping[str, Any], current: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (saved, current)} for every setting present on both sides whose value differs."""
    return {
        k: (saved[k], current[k])
        for k in sorted(set(saved) & set(current) - NOT_SETTINGS)
        if saved[k] != current[k]
    }


def check_resume(
    saved: Mapping[str, Any], current: Mapping[str, Any], *, allow: bool, where: str, at_step: int
) -> list[dict[str, Any]]:
    """The run's history with this resume's changes appended; raises InvalidValue for a refused change.

    `saved` is the run's opsd_config.json, `current` the resolved settings of this command (JSON values),
    `where` the output directory, `at_step` the step of the checkpoint being resumed. A setting saved under
    an older name (`opsd.configuration.sources.canonical_keys`) is compared under its canonical one.
    """
    # With the command line's parser, which imports TRL: here, when a run resumes.
    from opsd.configuration.sources import canonical_keys

    saved = canonical_keys(saved, source=where, quiet=True)
    history = list(saved.get(HISTORY_KEY) or [])
    changes = config_changes(_with_problems_per_process(saved), _with_problems_per_process(current))
    if not changes:
        return history
    compared = compared_keys()
    refused = {k: v for k, v in changes.items() if k in compared}
    if refused and not allow:
        named = ", ".join(f"{k} {_shown(a)} -> {_shown(b)}" for k, (a, b) in refused.items())
        raise InvalidValue(
            f"{where} holds a run with other settings ({len(refused)} changed: {named}); a run directory "
            f"belongs to one configuration: use a new --output_dir (train_capped.sh: a new --name), or rerun "
            f"with {ALLOW_FLAG} to continue "
            f"this run from step {at_step} with the new settings (recorded in {CONFIG_FILE}'s history)"
        )
    for k, (a, b) in changes.items():
        how = f"allowed by {ALLOW_FLAG}" if k in refused else "allowed on resume"
        logger.warning("resume at step %d: %s %s -> %s (%s; kept in the history)", at_step, k, _shown(a),
                       _shown(b), how)  # fmt: skip
    history.append({
        "at_step": at_step,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "changed": {k: {"from": a, "to": b} for k, (a, b) in changes.items()},
        "allowed_by": ALLOW_FLAG if refused else "operational or max_steps",
    })  # fmt: skip
    return history


def resume_history(out: Path, current: Mapping[str, Any], *, allow: bool) -> list[dict[str, Any]]:
    """Check this command's settings against the run in `out` (when it holds a complete checkpoint) and
    return the history to save with them. Reads only; raises InvalidValue for a refused change."""
    from opsd.rundir import checkpoint_step, latest_complete_checkpoint

    cfg_path = out / CONFIG_FILE
    resume = latest_complete_checkpoint(out)
    if resume is None or not cfg_path.is_file():
        return []
    saved = _read_saved(cfg_path, "settings")
    if not isinstance(saved, dict):
        raise InvalidValue(f"{cfg_path} is not a JSON object; restore the file or use a new --output_dir")
    at_step = checkpoint_step(resume)
    return check_resume(saved, current, allow=allow, where=str(out), at_step=at_step)


def _read_saved(path: Path, what: str):
    """A run's saved JSON file, refused in one line when it cannot be read (before anything is resumed)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidValue(
            f"{path} cannot be read ({err}), so this run's {what} cannot be checked before resuming; "
            "restore the file or use a new --output_dir"
        ) from err


def json_settings(config) -> dict[str, Any]:
    """The config's settings as they are saved in opsd_config.json (JSON values, so they compare equal)."""
    return json.loads(json.dumps(config.to_dict(), default=str))


# -- the teacher pairing of a run (opsd.method.pairing draws it) ------------------------------------------
def check_saved_pairing(out: Path, record: dict[str, Any] | None, *, allow: bool) -> None:
    """Refuse to resume a run in `out` whose saved pairing differs from `record` (reads only).

    Checked only when `out` holds a complete checkpoint (a resume) and a saved pairing; `allow`
    (--allow-config-change) lets the run continue with the new one, which is then saved.
    """
    path = out / PAIRING_FILE
    if record is None or latest_complete_checkpoint(out) is None or not path.is_file():
        return
    saved = _read_saved(path, "teacher pairing")
    keys = ("problems_sha256", "reference_of_sha256")
    if not isinstance(saved, dict) or any(saved.get(k) != record[k] for k in keys):
        if allow:
            return
        raise InvalidValue(
            f"{out} holds a run whose teachers read other references ({path} differs from the pairing drawn "
            "now: the training table or the pairing changed); use a new --output_dir, or rerun with "
            f"{ALLOW_FLAG} to continue with the new pairing"
        )


def save_pairing(out: Path, record: dict[str, Any] | None) -> None:
    """Write the pairing of a shuffled run to `out`; remove a stale one when the run has none."""
    path = out / PAIRING_FILE
    if record is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_suffix(".json.partial")
    # The header one field a line, the permutation on one line.
    head = json.dumps({**record, "reference_of": None}, indent=1)
    body = head.replace('"reference_of": null', f'"reference_of": {json.dumps(record["reference_of"])}')
    tmp.write_text(body + "\n", encoding="utf-8")
    tmp.replace(path)
