"""Before any model loads: every input a training run reads, checked, and the dry run.

`opsd_train.py` calls `start`, then `check_run` (or, with `--dry-run`, `dry_run_report`, which is all a dry
run does); `train_capped.sh` validates its plan with `dry_run` in its own interpreter, so both refuse the
same inputs with the same one-line messages and no model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opsd.configuration.config import OPSDConfig
from opsd.launch.command_line import parse_config
from opsd.paths import check_output_dir

logger = logging.getLogger("opsd")


@dataclass
class CheckedRun:
    """What the checks leave for the run: the training rows (None for a hub dataset in a dry run), the record
    of their teacher pairing, and the run directory's config history (opsd/run/resume.py)."""

    dataset: Any
    pairing_record: Any
    history: list[dict[str, Any]]


def start(argv: list[str]):
    """(config, entry flags, accelerate's process state) from the command line, with logging set up (INFO on
    the main process)."""
    config, extra = parse_config(argv)
    from accelerate import PartialState

    state = PartialState()
    logging.basicConfig(
        level=logging.INFO if state.is_main_process else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return config, extra, state


def build_paired_dataset(config: OPSDConfig):
    """The trainer's table and the record of its teacher pairing (`opsd.method.pairing`; None unless shuffled).

    Columns: `prompt` (the problem), `privileged_context` (the reference its teacher reads), `answer` (the
    problem's own `Answer`, which grades its rollouts: `rollout/correct`) and, with `teacher_contrast`,
    `contrast_context` (the wrong hint of the contrastive teacher, `opsd.method.contrast`). The pairing and the
    wrong hints are drawn here, over the whole filtered table, before the probe hold-out and before the trainer
    splits rows over processes."""
    from opsd.data.loading import load_train_dataset
    from opsd.method.contrast import contrast_references
    from opsd.method.pairing import CONTRAST_COLUMN, apply_pairing
    from opsd.method.prompts import reference_text

    ds = load_train_dataset(
        config.dataset_name, split=config.dataset_split, data_filter=config.data_filter, seed=config.seed,
        teacher_ref=config.teacher_ref,
    )  # fmt: skip

    def to_trainer_row(row):
        answer = row["Answer"]
        return {
            "prompt": row["problem"],
            "privileged_context": reference_text(row, config.teacher_ref, config.teacher_ref_max_chars),
            "answer": "" if answer is None else str(answer).strip(),
        }

    table = ds.map(to_trainer_row, remove_columns=ds.column_names)
    answers = list(ds["Answer"])
    if config.teacher_contrast in ("shuffled", "wrong_answer"):  # own_wrong's hints are drawn in training
        wrong, record = contrast_references(
            list(table["privileged_context"]), answers, config.teacher_contrast, seed=config.seed
        )
        logger.info("contrastive teacher: %s", record)
        table = table.add_column(CONTRAST_COLUMN, wrong)
    return apply_pairing(table, config.teacher_ref_pairing, seed=config.seed, answers=answers)


def check_inputs(config: OPSDConfig, *, dry_run: bool = False):
    """Everything a run reads besides the model weights, checked before any model loads: the output
    directory (a directory or a path that can become one), prompt files, a local model directory, the data.
    Returns the training rows and their teacher pairing record (`build_paired_dataset`), or (None, None) for
    a hub dataset in a dry run (which reaches no hub). Raises `UserError`."""
    from opsd.data.loading import is_local
    from opsd.method.prompts import PromptBuilder
    from opsd.models import check_model_source

    check_output_dir(config.output_dir, "--output_dir")
    PromptBuilder(
        student_template_file=config.student_prompt_file, teacher_template_file=config.teacher_prompt_file
    )
    # The embedded model is converted, not checked; a local directory needs its config and tokenizer, a hub
    # id must be in the cache or downloadable (a dry run reaches no hub).
    check_model_source(config.model_name_or_path, config.model_revision, fetch=not dry_run)
    if dry_run and not is_local(config.dataset_name):
        logger.info("dry run: hub dataset %s is not loaded", config.dataset_name)
        return None, None
    return build_paired_dataset(config)


def check_run(config: OPSDConfig, extra: argparse.Namespace, *, num_processes: int | None) -> CheckedRun:
    """Every check before the model loads: the inputs (`check_inputs`), `OPSD_KV_CACHE_GIB`, and that a rerun in
    a run directory keeps its method and budget (opsd/run/resume.py; `num_processes` too, None in a dry run)
    and its teacher pairing (opsd/run/resume.py), refused before anything is written. Raises `UserError`."""
    from opsd.method.engine_env import kv_cache_gib
    from opsd.run.resume import check_saved_pairing, json_settings, resume_history

    dataset, pairing_record = check_inputs(config, dry_run=extra.dry_run)
    kv_cache_gib()  # a bad OPSD_KV_CACHE_GIB is refused here; a real run applies it when the engine starts
    processes = {} if num_processes is None else {"num_processes": num_processes}
    history = resume_history(
        Path(config.output_dir), {**json_settings(config), **processes}, allow=extra.allow_config_change
    )
    check_saved_pairing(Path(config.output_dir), pairing_record, allow=extra.allow_config_change)
    return CheckedRun(dataset, pairing_record, history)


def step_shape(count_per_step: int, budget_unit: str, generations: int) -> str:
    """A step's problems and rollouts, as both dry runs print them: `8 problems x 4 rollouts = 32 rollouts per
    step`. `count_per_step` (per_device_train_batch_size x gradient_accumulation_steps x processes) counts
    problems or rollouts, as `budget_unit` says; each problem is sampled `generations` (G) times."""
    G = generations
    problems = count_per_step // G if budget_unit == "rollouts" else count_per_step
    return f"{problems} problems x {G} rollout{'s' if G != 1 else ''} = {problems * G} rollouts per step"


def dry_run_report(config: OPSDConfig, extra: argparse.Namespace) -> dict[str, Any]:
    """`opsd_train.py --dry-run`: `check_run`, then the resolved config, the number of training rows, the
    micro-batch plan, the step's problems and rollouts over this launch's processes (`step_shape`) and the
    teacher pairing's summary (what the dry run prints as JSON)."""
    from opsd.method import pairing
    from opsd.speed import microbatch

    checked = check_run(config, extra, num_processes=None)
    # No model path: a dry run reads no GPU memory (train_capped.sh runs it in its own long-lived process,
    # which would keep a CUDA context on the first GPU through the whole run); a real run decides auto.
    config, plan = microbatch.resolve(
        config,
        checked.dataset,
        None,
        colocated_engine=config.use_vllm and config.vllm_mode == "colocate",
        prompt_builder=None,  # no model path: no plan reads the prompts
    )
    return {
        "config": config.to_dict(),
        "data_rows": None if checked.dataset is None else len(checked.dataset),
        "micro_batch": dataclasses.asdict(plan),
        "step": step_shape(
            config.per_device_train_batch_size * config.gradient_accumulation_steps * config.world_size,
            config.budget_unit,
            config.num_generations,
        ),
        "teacher_pairing": pairing.summary(checked.pairing_record),
    }


def dry_run(argv: list[str]) -> dict[str, Any]:
    """`dry_run_report` for a command line of opsd_train.py (its `--dry-run` implied)."""
    config, extra, _ = start([*argv, "--dry-run"])
    return dry_run_report(config, extra)
