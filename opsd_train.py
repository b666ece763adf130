"""Train a model with on-policy self-distillation (OPSD).

    accelerate launch --config_file accelerate.yaml opsd_train.py --model_name_or_path Qwen/Qwen3-1.7B \
        --dataset_name siyanzhao/Openthoughts_math_30k_opsd --output_dir runs/qwen3
    python opsd_train.py --max_steps 2          # embedded SmolLM2-135M and built-in data, CPU is fine

Every `OPSDConfig` field is a flag (`--beta 0.5`), a YAML key (`--config cfg.yaml`), a `recipe.env` key
(`--recipe recipe.env`) and an `OPSD_<FIELD>` environment switch; later sources win in that order.
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

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

# Colocated vLLM must run in this process (the trainer pushes weights into it), binds to loopback and, on a
# CPU, needs a bounded KV cache (opsd.configuration.engine_env.SINGLE_NODE_ENGINE_ENV); users can still override each.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from opsd.configuration.engine_env import fixed_kv_cache, kv_cache_gib, single_node_engine_env  # noqa: E402

single_node_engine_env()

from opsd.configuration.config import OPSDConfig  # noqa: E402
from opsd.configuration.recipe import name_source, resolve_overrides, to_argv  # noqa: E402
from opsd.errors import InvalidValue, MissingPath, UserError, run_main  # noqa: E402
from opsd.paths import DEEPSPEED_CONFIG, YAML_CONFIG, check_file, check_output_dir  # noqa: E402

ALLOW_HELP = (
    "resume a run directory with changed method or budget settings; the changes are appended to "
    "opsd_config.json's history (otherwise refused)"
)

logger = logging.getLogger("opsd")


def parse_config(argv: list[str], environ=os.environ) -> tuple[OPSDConfig, argparse.Namespace]:
    """CLI/YAML via TRL's parser, then recipe.env and OPSD_* overrides appended as flags (they win).

    Every problem is a `UserError`: bad flags, values, YAML files, recipe lines and `OPSD_*` variables.
    """
    from trl import TrlParser

    class Parser(TrlParser):
        yaml_source = "the YAML config"
        yaml_keys: set[str] = set()

        def error(self, message: str):  # argparse would print the usage of ~200 flags, then exit
            raise InvalidValue(f"{message}; see python opsd_train.py --help")

        def set_defaults_with_config(self, **kwargs) -> list[str]:
            # Keys transformers 5 removed are translated or ignored with a note; unknown keys get a hint.
            from opsd.configuration.legacy import translate_yaml

            known = {a.dest for a in self._actions}
            translated = translate_yaml(kwargs, known, source=self.yaml_source)
            check_deepspeed_file(translated.get("deepspeed"))
            self.yaml_keys = set(translated)
            return super().set_defaults_with_config(**translated)

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe", default=None, help="recipe.env file with KEY=VALUE overrides")
    pre.add_argument("--capped", action="store_true", help="refuse overrides that change the budget")
    pre.add_argument(
        "--dry-run", action="store_true", help="check every input, print the config, train nothing"
    )
    pre.add_argument("--allow-config-change", action="store_true", help=ALLOW_HELP)
    extra, rest = pre.parse_known_args(argv)
    parser = Parser((OPSDConfig,))
    if "-h" in rest or "--help" in rest:
        print(opsd_help(pre) + "\n\nEvery TRL/transformers training argument (each also a YAML key):\n")
        parser.print_help()
        raise SystemExit(0)
    overrides = resolve_overrides(extra.recipe, environ, capped=extra.capped)
    if "--config" in rest[:-1]:
        parser.yaml_source = rest[rest.index("--config") + 1]
        # TRL opens the file itself: refuse what is not a regular YAML file of at most 1 MiB before it does.
        check_file(parser.yaml_source, YAML_CONFIG)
    for value in flag_values(rest + to_argv(overrides), "--deepspeed"):
        check_deepspeed_file(value)
    try:
        (config,) = parser.parse_args_and_config(rest + to_argv(overrides))
    except UserError:
        raise
    except FileNotFoundError as err:  # --config naming a missing YAML file
        raise MissingPath(f"{err}; check the path") from err
    except OSError as err:  # a --config path that cannot be read (too long, a directory, no permission)
        raise MissingPath(f"cannot read the YAML config ({err.strerror}); check the path") from err
    except ValueError as err:  # OPSDConfig/TrainingArguments validation and unknown flags
        unknown = "not used by the HfArgumentParser" in str(err)
        hints = unknown_flag_hints(rest, {a.dest for a in parser._actions}) if unknown else ""
        message = (
            f"{err}{hints}; see python opsd_train.py --help" if unknown else name_source(str(err), overrides)
        )
        field = message.split("=", 1)[0]
        flagged = any(a == f"--{field}" or a.startswith(f"--{field}=") for a in rest)
        if (
            message == str(err) and field in parser.yaml_keys and not flagged
        ):  # the YAML set it, nothing later
            message = f"{message} (from {parser.yaml_source})"
        raise InvalidValue(message) from err
    except Exception as err:
        import yaml

        if isinstance(err, yaml.YAMLError):  # a YAML syntax error: its location, on one line
            raise InvalidValue(
                f"{parser.yaml_source} is not valid YAML: {' '.join(str(err).split())}"
            ) from err
        raise
    return config, extra


def flag_values(argv: list[str], flag: str) -> list[str]:
    """The values given to `flag` in `argv`, as `--flag VALUE` or `--flag=VALUE`."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    return values + [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def check_deepspeed_file(value) -> None:
    """transformers reads a `deepspeed` value that names a file while parsing the arguments: it must be a
    regular file of at most 1 MiB (`opsd.paths`). A dict or an inline JSON string is left to transformers."""
    if isinstance(value, str) and value and os.path.lexists(os.path.expanduser(value)):
        check_file(value, DEEPSPEED_CONFIG)


def unknown_flag_hints(argv: list[str], known: set[str]) -> str:
    """`(--learnin_rate: did you mean --learning_rate?)` for the unknown flags of `argv`, by edit distance
    over the config's fields; removed transformers keys say what replaced them."""
    from opsd.configuration.legacy import IGNORED, RENAMED, closest

    hints = []
    for arg in argv:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg[2:].split("=", 1)[0].replace("-", "_")
        if name in known or name == "config":
            continue
        if name in RENAMED:
            hints.append(f"--{name}: transformers 5 removed it; use --{RENAMED[name]} with the same value")
        elif name in IGNORED:
            hints.append(f"--{name}: transformers 5 removed it; leave it out ({IGNORED[name]})")
        elif near := closest(name, known):
            hints.append(f"--{name}: did you mean --{near}?")
    return f" ({'; '.join(hints)})" if hints else ""


def opsd_help(pre: argparse.ArgumentParser) -> str:
    """The top of `--help`: usage, the entry flags, then OPSD's own fields with their defaults, choices and
    ranges; the ~200 inherited TRL/transformers arguments follow it."""
    import dataclasses

    from opsd.configuration.ranges import RANGES

    lines = [
        "usage: python opsd_train.py [--config FILE.yaml] [--recipe recipe.env] [--dry-run] [--debug]",
        "                            [--allow-config-change] [--FIELD VALUE ...]",
        "",
        (__doc__ or "").strip().splitlines()[0],
        "Which setting wins when several give a field: docs/configuration.md (Running and precedence).",
        "",
        "entry flags:",
        "  --config FILE          YAML config (TRL/open-r1 shape); flags given after it win",
    ]
    for action in pre._actions:
        flag = action.option_strings[0] + (" FILE" if action.nargs is None and action.const is None else "")
        lines.append(f"  {flag:<22} {action.help}")
    lines.append(
        f"  {'--debug':<22} show the traceback of a user error (also OPSD_DEBUG=1); --debug VALUE is "
        "transformers' debug option"
    )
    lines += ["", "OPSD fields (--field VALUE, YAML key field, recipe.env key FIELD, variable OPSD_FIELD):"]
    by_name = {f.name: f for f in dataclasses.fields(OPSDConfig)}
    for name in OPSDConfig.__dict__.get("__annotations__", {}):  # in the order the class declares them
        f = by_name[name]
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        extras = [f"default {default!r}"]
        if f.metadata.get("choices"):
            extras.append("one of " + "|".join(f.metadata["choices"]))
        if f.name in RANGES:
            extras.append(RANGES[f.name].rule())
        lines.append(f"  --{f.name:<36} {f.metadata.get('help', '')} [{'; '.join(extras)}]")
    return "\n".join(lines)


def build_dataset(config: OPSDConfig):
    """The trainer's table: `prompt` (the problem) and `privileged_context` (the reference its teacher reads)."""
    return build_paired_dataset(config)[0]


def build_paired_dataset(config: OPSDConfig):
    """`build_dataset`'s table and the record of its teacher pairing (`opsd.method.pairing`; None unless shuffled).

    The pairing is drawn here, over the whole filtered table, before the probe hold-out and before the
    trainer splits rows over processes."""
    from opsd.data.loading import load_train_dataset
    from opsd.method.pairing import apply_pairing
    from opsd.method.prompts import reference_text

    ds = load_train_dataset(
        config.dataset_name, split=config.dataset_split, data_filter=config.data_filter, seed=config.seed,
        teacher_ref=config.teacher_ref,
    )  # fmt: skip

    def to_trainer_row(row):
        return {
            "prompt": row["problem"],
            "privileged_context": reference_text(row, config.teacher_ref, config.teacher_ref_max_chars),
        }

    table = ds.map(to_trainer_row, remove_columns=ds.column_names)
    return apply_pairing(table, config.teacher_ref_pairing, seed=config.seed, answers=list(ds["Answer"]))


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


def main(argv: list[str] | None = None) -> Path | None:
    config, extra = parse_config(sys.argv[1:] if argv is None else argv)
    from accelerate import PartialState

    state = PartialState()
    logging.basicConfig(
        level=logging.INFO if state.is_main_process else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Before any model: bad input fails fast.
    dataset, pairing_record = check_inputs(config, dry_run=extra.dry_run)
    kv_cache_gib()  # a bad OPSD_KV_CACHE_GIB is refused here; a real run applies it below
    from opsd.method import pairing
    from opsd.models import resolve_model_path
    from opsd.run import microbatch
    from opsd.run.resume import json_settings, resume_history

    # A rerun in a run directory must keep its method and budget (opsd/run/resume.py) and its teacher pairing
    # (opsd/method/pairing.py); refused before writing.
    processes = {} if extra.dry_run else {"num_processes": state.num_processes}
    history = resume_history(
        Path(config.output_dir), {**json_settings(config), **processes}, allow=extra.allow_config_change
    )
    pairing.check_saved(Path(config.output_dir), pairing_record, allow=extra.allow_config_change)
    if extra.dry_run:
        # No model path: a dry run reads no GPU memory (train_capped.sh runs it in its own long-lived process,
        # which would keep a CUDA context on the first GPU through the whole run); a real run decides auto.
        config, plan = microbatch.resolve(
            config,
            dataset,
            None,
            colocated_engine=config.rollout_engine != "transformers" and config.vllm_mode == "colocate",
        )
        rows = None if dataset is None else len(dataset)
        out = {"config": config.to_dict(), "data_rows": rows, "micro_batch": dataclasses.asdict(plan),
               "teacher_pairing": pairing.summary(pairing_record)}  # fmt: skip
        print(json.dumps(out, default=str))
        return None
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from opsd.models import load_tokenizer, resolve_attn_implementation, resolve_dtype
    from opsd.run.callbacks import CompleteMark, MetricsJSONL, TailWeightAverage
    from opsd.run.probe import Probe, split_probe
    from opsd.run.provenance import provenance
    from opsd.run.rundir import (
        CONFIG_FILE,
        STEP_LOGS,
        checkpoint_dir,
        checkpoint_step,
        is_complete,
        latest_complete_checkpoint,
        mark_complete,
        trim_step_log,
    )
    from opsd_trainer import OPSDTrainer

    model_path = resolve_model_path(config.model_name_or_path)
    choose_rollout_engine(config)
    config, plan = microbatch.resolve(
        config, dataset, model_path, colocated_engine=config.use_vllm and config.vllm_mode == "colocate"
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
        pairing.save(out, pairing_record)
        logger.info(
            "resolved config (also in %s):\n%s",
            out / CONFIG_FILE,
            json.dumps(resolved, indent=1, default=str),
        )

    tokenizer = load_tokenizer(model_path, config.trust_remote_code, revision=config.model_revision)
    model = AutoModelForCausalLM.from_pretrained(
        model_path,
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
            target_modules=(
                "all-linear" if config.lora_target_modules == ["all-linear"] else config.lora_target_modules
            ),
            task_type="CAUSAL_LM",
        )
    elif config.teacher_mode == "fixed":
        logger.info(
            "full fine-tuning with teacher_mode=fixed: the teacher is a frozen copy of the initial model"
        )

    if config.use_vllm and fixed_kv_cache():  # the colocated engine starts inside the trainer
        logger.info("vLLM KV cache fixed at %s GiB (OPSD_KV_CACHE_GIB)", kv_cache_gib())
    trainer = OPSDTrainer(
        model=model, args=config, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    if probe_rows:
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
    sys.exit(run_main(main, "opsd_train.py"))
