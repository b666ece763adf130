"""Train a model with on-policy self-distillation (OPSD).

    accelerate launch --config_file accelerate.yaml opsd_train.py --model_name_or_path Qwen/Qwen3-1.7B \
        --dataset_name siyanzhao/Openthoughts_math_30k_opsd --output_dir runs/qwen3
    python opsd_train.py --max_steps 2          # embedded SmolLM2-135M and built-in data, CPU is fine

Every `OPSDConfig` field is a flag (`--beta 0.5`), a YAML key (`--config cfg.yaml`), a `recipe.env` key
(`--recipe recipe.env`) and an `OPSD_<FIELD>` environment switch; which one wins: docs/configuration.md.
Compared with training TRL's `SDFTTrainer` directly: OPSD prompts and loss (see opsd_trainer.py), the
data filters and references of docs/method.md §2, exact resume from the last complete checkpoint,
`metrics.jsonl`, `completions.jsonl`, and the resolved config with package versions and the git revision
saved as `opsd_config.json` in the output directory.

Bad input (config values, recipe lines, prompt files, model paths, data files) is refused before any model
loads, as one line on stderr with exit status 2; `--debug` or `OPSD_DEBUG=1` adds the traceback.
`--dry-run` runs exactly those checks, prints the resolved configuration as JSON, and loads no model.
A rerun in an output directory with a complete checkpoint resumes it and refuses other method or budget
settings than the run's `opsd_config.json` (opsd/run/resume.py); `--allow-config-change` continues with them
and records the change in the file's history. `--help` lists the entry flags and OPSD's fields first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

# Colocated vLLM must run in this process (the trainer pushes weights into it), binds to loopback and, on a
# CPU, needs a bounded KV cache (opsd.method.engine_env); users can still override each.
from opsd.method.engine_env import kv_cache_bytes, kv_cache_gib, training_process_env

training_process_env()

from opsd import methods  # noqa: E402
from opsd.configuration.config import OPSDConfig  # noqa: E402
from opsd.errors import exit_now, run_main  # noqa: E402
from opsd.launch import preflight  # noqa: E402

logger = logging.getLogger("opsd")


@dataclasses.dataclass
class PreparedRun:
    """What a run has before its model loads: the config with its micro-batch plan applied, the model's path, the
    tokenizer, the run's one PromptBuilder, the training rows less the probe's hold-out, and the probe's rows."""

    config: OPSDConfig
    plan: object
    model_path: str
    tokenizer: object
    prompt_builder: object
    dataset: object
    probe_rows: list


def main(argv: list[str] | None = None) -> Path | None:
    config, extra, state = preflight.start(sys.argv[1:] if argv is None else argv)
    if extra.dry_run:  # every check below, then the resolved config as JSON; no model loads
        print(json.dumps(preflight.dry_run_report(config, extra), default=str))
        return None
    checked = preflight.check_run(config, extra, num_processes=state.num_processes)  # before any model
    run = prepare_run(config, checked.dataset)
    if state.is_main_process:
        save_resolved_config(run, extra, checked, num_processes=state.num_processes)
    trainer, wavg = build_trainer(run, state)
    return run_training(trainer, Path(run.config.output_dir), wavg, state)


def prepare_run(config: OPSDConfig, dataset) -> PreparedRun:
    """The model's path and tokenizer, the run's prompts, the micro-batch plan (which may change the config's
    split of each step) and the probe's hold-out."""
    from opsd.method.prompts import PromptBuilder
    from opsd.models import load_tokenizer, resolve_model_path
    from opsd.run.probe import split_probe
    from opsd.speed import microbatch

    model_path = resolve_model_path(config.model_name_or_path)
    tokenizer = load_tokenizer(model_path, config.trust_remote_code, revision=config.model_revision)
    # One PromptBuilder for the run: it resolves thinking_switch against the template (and warns when the
    # template has none) once, for the micro-batch plan's prompt lengths and for the trainer.
    prompt_builder = PromptBuilder.from_config(tokenizer, config)
    config, plan = microbatch.resolve(
        config,
        dataset,
        model_path,
        colocated_engine=config.use_vllm and config.vllm_mode == "colocate",
        prompt_builder=prompt_builder,
    )
    logger.info("%s", plan.describe())
    probe_rows = []
    if config.probe_steps:
        dataset, probe_rows = split_probe(dataset, config.probe_size, seed=config.seed)
    return PreparedRun(config, plan, model_path, tokenizer, prompt_builder, dataset, probe_rows)


def save_resolved_config(
    run: PreparedRun, extra, checked: preflight.CheckedRun, *, num_processes: int
) -> None:
    """The output directory's `opsd_config.json` (the resolved config, the model path, the micro-batch plan, the
    recipe, the provenance, the process count and the config history) and the teacher pairing."""
    from opsd.run.provenance import provenance
    from opsd.run.resume import save_pairing
    from opsd.rundir import CONFIG_FILE

    out = Path(run.config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    resolved = {
        **run.config.to_dict(),
        "resolved_model_path": run.model_path,
        "micro_batch": dataclasses.asdict(run.plan),
        "recipe": extra.recipe,
        "provenance": provenance(),
        "num_processes": num_processes,
        "history": checked.history,
    }
    (out / CONFIG_FILE).write_text(json.dumps(resolved, indent=2, default=str))
    save_pairing(out, checked.pairing_record)
    logger.info(
        "resolved config (also in %s):\n%s",
        out / CONFIG_FILE,
        json.dumps(resolved, indent=1, default=str),
    )


def load_model_and_lora(run: PreparedRun):
    """The model, and its LoRA config (None for full fine-tuning)."""
    from peft import LoraConfig

    from opsd.method import lora_targets
    from opsd.models import load_model, resolve_attn_implementation, resolve_dtype

    config = run.config
    model = load_model(
        run.model_path,
        allow_missing_weights=config.allow_missing_weights,
        revision=config.model_revision,
        dtype=resolve_dtype(config.dtype),
        attn_implementation=resolve_attn_implementation(config.attn_implementation),
        trust_remote_code=config.trust_remote_code,
    )
    if not config.use_peft:
        if config.teacher_mode == "fixed":
            logger.info(
                "full fine-tuning with teacher_mode=fixed: the teacher is a frozen copy of the initial model"
            )
        return model, None
    targets = lora_targets.resolve_targets(
        model, config.lora_target_modules, lora_dropout=config.lora_dropout
    )
    lora = LoraConfig(
        r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout, **targets,
        task_type="CAUSAL_LM",
    )  # fmt: skip
    return model, lora


def build_trainer(run: PreparedRun, state):
    """The method's trainer on the loaded model, with the run's callbacks: the probe (OPSD's teacher), the
    metrics log, the tail weight average (returned too, None when off) and the completion mark, last."""
    from opsd.method import lora_targets
    from opsd.method.rollouts import build_rollout_engine
    from opsd.run.callbacks import CompleteMark, FinalCheckpoint, MetricsJSONL, TailWeightAverage
    from opsd.run.probe import Probe

    config = run.config
    model, peft_config = load_model_and_lora(run)
    # The rollout engine, with its settings; the trainer starts a colocated one inside its `__init__`.
    engine = build_rollout_engine(config, kv_cache_bytes=kv_cache_bytes())
    if config.use_vllm and kv_cache_gib() is not None:
        logger.info("vLLM KV cache fixed at %s GiB (OPSD_KV_CACHE_GIB)", kv_cache_gib())
    # The trainer, and what the harness adds to it, by the method's entry in the registry (opsd.methods).
    method = methods.get(config.method)
    trainer_class = method.trainer_class()
    with lora_targets.peft_refusal(config.lora_target_modules, model):
        trainer = trainer_class(
            model=model,
            args=config,
            train_dataset=run.dataset,
            processing_class=run.tokenizer,
            peft_config=peft_config,
            prompt_builder=run.prompt_builder,
            engine=engine,
        )
    if config.use_peft and state.is_main_process:
        lora_targets.log_coverage(trainer.accelerator.unwrap_model(trainer.model))
    if run.probe_rows and method.probe:  # the probe scores OPSD's teacher; the hold-out is every method's
        trainer.add_callback(Probe(trainer, run.probe_rows, config.probe_steps))
    trainer.add_callback(MetricsJSONL())
    wavg = None
    if config.wavg_last:
        wavg = TailWeightAverage(trainer.model, config.wavg_last)
        trainer.add_callback(wavg)
    trainer.add_callback(FinalCheckpoint())
    trainer.add_callback(CompleteMark())
    return trainer, wavg


def run_training(trainer, out: Path, wavg, state) -> Path:
    """Train from the newest complete checkpoint in `out` (if any), save the final one and the tail average;
    the final checkpoint's directory."""
    from opsd.rundir import (
        STEP_LOGS,
        checkpoint_dir,
        checkpoint_step,
        is_complete,
        latest_complete_checkpoint,
        trim_step_log,
    )

    resume = latest_complete_checkpoint(out)
    if resume is not None:
        logger.info("resuming from %s", resume)
        if state.is_main_process:
            for log in STEP_LOGS:
                trim_step_log(out / log, checkpoint_step(resume))
        if wavg is not None:
            wavg.restore(resume)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    final = checkpoint_dir(out, trainer.state.global_step)
    if not is_complete(final):  # `FinalCheckpoint` saves the last step whatever save_strategy says
        raise RuntimeError(
            f"training ended at step {trainer.state.global_step} without its checkpoint {final}"
        )
    if wavg is not None:  # on every process: saving may be collective (DeepSpeed)
        wavg.save_average(trainer, trainer.state.global_step)
    if state.is_main_process:
        logger.info(
            "done: %d steps; final checkpoint %s; metrics %s",
            trainer.state.global_step,
            final,
            out / "metrics.jsonl",
        )
    return final


if __name__ == "__main__":
    exit_now(run_main(main, "opsd_train.py"))
