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
# CPU, needs a bounded KV cache (opsd.configuration.engine_env); users can still override each.
from opsd.configuration.engine_env import fixed_kv_cache, kv_cache_gib, training_process_env

training_process_env()

from opsd.configuration.config import OPSDConfig  # noqa: E402
from opsd.errors import exit_now, run_main  # noqa: E402
from opsd.launch import preflight  # noqa: E402

logger = logging.getLogger("opsd")


def choose_rollout_engine(config: OPSDConfig) -> None:
    if config.rollout_engine == "transformers":
        config.use_vllm = False
        return
    try:
        import vllm  # noqa: F401
    except ImportError:
        if config.rollout_engine == "vllm":
            raise ImportError(
                "rollout_engine=vllm but vLLM is not installed: `pip install opsd[vllm]` (GPU) or "
                "`pip install opsd[cpu]`; or use --rollout_engine transformers"
            ) from None
        logger.warning("vLLM is not installed; rollouts use transformers.generate (much slower)")
        config.use_vllm = False
        return
    config.use_vllm = True


def rl_trainers() -> dict:
    """The trainers of the other methods (opsd.rl), beside OPSDTrainer: method -> class, each built alike."""
    from opsd.rl.grpo import GRPOTrainer
    from opsd.rl.hybrid import HybridTrainer

    return {"grpo": GRPOTrainer, "hybrid": HybridTrainer}


def main(argv: list[str] | None = None) -> Path | None:
    config, extra, state = preflight.start(sys.argv[1:] if argv is None else argv)
    if extra.dry_run:  # every check below, then the resolved config as JSON; no model loads
        print(json.dumps(preflight.dry_run_report(config, extra), default=str))
        return None
    # Before any model: bad input fails fast.
    processes = {"num_processes": state.num_processes}
    checked = preflight.check_run(config, extra, num_processes=state.num_processes)
    dataset, pairing_record, history = checked.dataset, checked.pairing_record, checked.history
    from peft import LoraConfig

    from opsd.method import lora_targets
    from opsd.method.prompts import PromptBuilder
    from opsd.models import (
        load_model,
        load_tokenizer,
        resolve_attn_implementation,
        resolve_dtype,
        resolve_model_path,
    )
    from opsd.run.callbacks import CompleteMark, MetricsJSONL, TailWeightAverage
    from opsd.run.probe import Probe, split_probe
    from opsd.run.provenance import provenance
    from opsd.run.resume import save_pairing
    from opsd.rundir import (
        CONFIG_FILE,
        STEP_LOGS,
        checkpoint_dir,
        checkpoint_step,
        is_complete,
        latest_complete_checkpoint,
        mark_complete,
        trim_step_log,
    )
    from opsd.speed import microbatch
    from opsd_trainer import OPSDTrainer

    trainer_class = {"opsd": OPSDTrainer, **rl_trainers()}[config.method]

    model_path = resolve_model_path(config.model_name_or_path)
    choose_rollout_engine(config)
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
    out = Path(config.output_dir)
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        resolved = {
            **config.to_dict(),
            "resolved_model_path": model_path,
            "micro_batch": dataclasses.asdict(plan),
            "recipe": extra.recipe,
            "provenance": provenance(),
            **processes,
            "history": history,
        }
        (out / CONFIG_FILE).write_text(json.dumps(resolved, indent=2, default=str))
        save_pairing(out, pairing_record)
        logger.info(
            "resolved config (also in %s):\n%s",
            out / CONFIG_FILE,
            json.dumps(resolved, indent=1, default=str),
        )

    model = load_model(
        model_path,
        allow_missing_weights=config.allow_missing_weights,
        revision=config.model_revision,
        dtype=resolve_dtype(config.dtype),
        attn_implementation=resolve_attn_implementation(config.attn_implementation),
        trust_remote_code=config.trust_remote_code,
    )
    peft_config = None
    if config.use_peft:
        peft_config = LoraConfig(
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            **lora_targets.resolve_targets(
                model, config.lora_target_modules, lora_dropout=config.lora_dropout
            ),
            task_type="CAUSAL_LM",
        )
    elif config.teacher_mode == "fixed":
        logger.info(
            "full fine-tuning with teacher_mode=fixed: the teacher is a frozen copy of the initial model"
        )

    if config.use_vllm and fixed_kv_cache():  # the colocated engine starts inside the trainer
        logger.info("vLLM KV cache fixed at %s GiB (OPSD_KV_CACHE_GIB)", kv_cache_gib())
    with lora_targets.peft_refusal(config.lora_target_modules, model):
        trainer = trainer_class(
            model=model,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            prompt_builder=prompt_builder,
        )
    if config.use_peft and state.is_main_process:
        lora_targets.log_coverage(trainer.accelerator.unwrap_model(trainer.model))
    if (
        probe_rows and config.method == "opsd"
    ):  # the probe scores OPSD's teacher; the hold-out is every method's
        trainer.add_callback(Probe(trainer, probe_rows, config.probe_steps))
    trainer.add_callback(MetricsJSONL())
    wavg = None
    if config.wavg_last:
        wavg = TailWeightAverage(trainer.model, config.wavg_last)
        trainer.add_callback(wavg)
    trainer.add_callback(CompleteMark())

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
    if not is_complete(final):
        trainer._save_checkpoint(trainer.model, trial=None)
        if state.is_main_process:
            mark_complete(final)
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
