"""eval_aime.py's flags (`EvalConfig`) and their parsing, one evaluation's resolved settings (`EvalSettings`,
eval_config.json: the flags but the mode ones, then `Resolved`), and the run failures the entry point
reports (a user's mistake is `opsd.errors.UserError`, as in training).
The numeric flags' ranges are declared in `opsd.configuration.checks.EVAL_RANGES`."""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from typing import Any

from opsd.configuration.checks import EVAL_RANGES, KV_CACHE_DTYPES, check_table
from opsd.configuration.switches import CHOICES
from opsd.errors import UserError

_MERGE_WORDS = {
    "auto": "auto", "true": "true", "yes": "true", "y": "true", "t": "true", "1": "true", "on": "true",
    "false": "false", "no": "false", "n": "false", "f": "false", "0": "false", "off": "false",
}  # fmt: skip


class RunFailed(Exception):
    """The run could not finish (a worker died); what was sampled is kept and a rerun resumes (exit 1)."""

    exit_code = 1


class EngineDied(RunFailed):
    """vLLM raised during generation; the finished samples are kept and a rerun resumes (one line, exit 2)."""

    exit_code = 2


def _arg(default: Any, help: str) -> Any:
    """A config field with its --help text; a list default becomes a fresh list per instance."""
    if isinstance(default, list):
        return field(default_factory=list, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class EvalConfig:
    """Flags of eval_aime.py (`--top-p` and `--top_p` both work). Defaults are the docs/method.md §4 protocol."""

    # What to evaluate
    model: str = _arg("", "Hub name or model directory; empty = the embedded SmolLM2-135M.")
    adapter: str = _arg(
        "", "LoRA checkpoint dir from training (has adapter_config.json), or a Hub adapter id."
    )
    checkpoints: list[str] = _arg(
        [],
        "Sweep: RUN_DIR (its complete checkpoint-N, by N) or CKPT ... (LoRA or full fine-tune dirs, Hub "
        "adapter ids), each scored into --out/NAME with one engine start; the base model into --out/base.",
    )
    base: bool = _arg(True, "Sweep: also score the base model (--no-base: only the checkpoints).")
    step: int | None = _arg(
        None,
        "Sweep: the checkpoint step reported as the result, declared before scoring (default: the final "
        "checkpoint). Every step is still scored and tabled; there is no best step per benchmark.",
    )
    benchmarks: str = _arg(
        "",
        "NAME,...: score each benchmark of docs/evaluation.md's table (aime24, aime25, hmmt25, aime26, hmmt26, "
        "math500, amc23) into --out/NAME with one engine start, each at its preset n, max tokens and thinking "
        "(a flag given sets it for all); --dataset NAME=FILE,... gives local copies.",
    )
    merge_adapter: str = field(
        default="auto",
        metadata={
            "help": "auto: merge the adapter with peft first on vLLM's CPU backend, serve it as a LoRA with "
            "vLLM on a GPU | true (--merge-adapter): always merge | false (--no-merge-adapter): never.",
            "nargs": "?",
            "const": "true",
            "metavar": "{auto,true,false}",
        },
    )
    dataset: str = _arg(
        "HuggingFaceH4/aime_2024",
        "Hub dataset, .json/.jsonl/.parquet file, or builtin; with --benchmarks, NAME=FILE,... (local copies).",
    )
    split: str = _arg("train", "Split of a hub dataset.")
    limit: int = _arg(0, "Evaluate only the first L problems (smoke runs); 0 = all.")
    # Sampling
    n: int = _arg(12, "Samples per problem.")
    k: int | None = _arg(None, "k of pass@k; default n.")
    temperature: float = _arg(1.0, "Sampling temperature (0 = greedy).")
    top_p: float = _arg(0.95, "Top-p.")
    top_k: int = _arg(0, "Top-k; 0 = off.")
    min_p: float = _arg(0.0, "Min-p; 0 = off.")
    max_tokens: int = _arg(38912, "New-token cap per sample (cut to fit max_model_len).")
    max_model_len: int = _arg(
        40960, "Prompt + completion tokens; lowered to the model's max_position_embeddings."
    )
    thinking: bool = _arg(
        True,
        "Render prompts with the template's thinking switch on (--no-thinking: off); also spelled as training's "
        "--student-thinking / --no-student-thinking.",
    )
    thinking_switch: str = _arg(
        "auto",
        "The template variable --thinking sets: auto (enable_thinking if the template reads it) | none | a name.",
    )
    prompt_file: str = _arg(
        "",
        "Student template file (with {problem}), the same as training's; also spelled --student-prompt-file.",
    )
    seed: int = _arg(0, "Base seed; each sample's seed derives from (seed, problem, sample index).")
    # Engine and output
    engine: str = _arg("auto", "auto (vLLM if installed, else transformers) | vllm | transformers.")
    gpu_memory_utilization: float = _arg(0.9, "vLLM's share of GPU memory.")
    kv_cache_dtype: str = _arg(
        "auto",
        "vLLM's KV cache: auto (the model's dtype) | fp8 (8-bit floats: half the cache's reads at long lengths; "
        "a GPU only; docs/evaluation.md says what it did to scores).",
    )
    tensor_parallel_size: int = _arg(1, "GPUs per vLLM engine.")
    num_gpus: int = _arg(1, "Data parallel: N worker processes that pull samples from a shared queue.")
    stream: bool = _arg(
        True,
        "vLLM: keep up to --max-in-flight samples in the engine and save each as it finishes "
        "(--no-stream: chunks of --chunk-size problems, each waiting for its longest sample).",
    )
    max_in_flight: int = _arg(
        0,
        "vLLM: most samples in one engine at once; 0 = auto (the engine's max_num_seqs on a GPU; on "
        "the CPU backend as many as prefill in one step, which a seeded request needs there).",
    )
    chunk_size: int = _arg(8, "Problems per generate call with --no-stream and with the transformers engine.")
    out: str = _arg("", "Result directory (required unless --compare/--aggregate).")
    plot: bool = _arg(False, "Also write per_problem.png.")
    # Other modes
    compare: list[str] = _arg([], "A B: paired per-problem difference b - a of two result dirs.")
    aggregate: list[str] = _arg([], "R1 R2 ...: mean ± SE across runs of avg@n, pass@k, maj@n, format.")
    plot_steps: list[str] = _arg([], "DIR ...: avg@n vs training step (checkpoint-N; none = 0) into --out.")
    shard: str = _arg("", "Internal: r/N, set by --num-gpus for its workers.")

    def __post_init__(self):
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r} is invalid: {allowed}")

        check_table(self, EVAL_RANGES, verdict="is invalid")  # declared in opsd/configuration/checks.py
        if self.k is not None and not 1 <= self.k <= self.n:
            raise ValueError(f"k={self.k} is invalid: pass@k needs 1 <= k <= n={self.n}")
        if self.engine not in CHOICES["rollout_engine"]:
            raise bad("engine", f"choose one of {CHOICES['rollout_engine']}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"choose one of {KV_CACHE_DTYPES}")
        # Canonical auto|true|false; bools and None (= auto) are accepted from Python callers.
        value = {True: "true", False: "false", None: "auto"}.get(self.merge_adapter, self.merge_adapter)
        if not isinstance(value, str) or value.lower() not in _MERGE_WORDS:
            raise bad("merge_adapter", "choose auto, true (--merge-adapter) or false (--no-merge-adapter)")
        self.merge_adapter = _MERGE_WORDS[value.lower()]
        if self.merge_adapter == "true" and not (self.adapter or self.checkpoints):
            raise ValueError("--merge-adapter needs --adapter CHECKPOINT (or --checkpoints)")
        if self.checkpoints and self.adapter:
            raise ValueError(
                "--adapter and --checkpoints are separate: a sweep takes its adapters from --checkpoints"
            )
        if self.checkpoints and self.num_gpus > 1:
            raise ValueError(
                f"num_gpus={self.num_gpus} is invalid with --checkpoints: a sweep runs one engine; use "
                "--tensor-parallel-size for a large model, or one --num-gpus run per checkpoint"
            )
        if self.step is not None and (isinstance(self.step, bool) or self.step < 0):
            raise bad("step", "give a checkpoint step (a whole number >= 0)")
        if self.step is not None and not self.checkpoints:
            raise ValueError(
                f"step={self.step} is invalid without --checkpoints: --step declares which checkpoint of a sweep "
                "is reported"
            )
        if self.benchmarks:
            from opsd.evaluation.benchmarks import parse_benchmark_names

            parse_benchmark_names(self.benchmarks)  # an unknown name is refused here, before anything loads
            if self.num_gpus > 1:
                raise ValueError(
                    f"num_gpus={self.num_gpus} is invalid with --benchmarks: the benchmarks share one engine; use "
                    "--tensor-parallel-size for a large model, or one --num-gpus run per benchmark"
                )
        if self.compare and len(self.compare) != 2:
            raise ValueError(f"compare={self.compare} is invalid: pass exactly two result directories A B")
        modes = [m for m in ("checkpoints", "compare", "aggregate", "plot_steps") if getattr(self, m)]
        if self.benchmarks and modes and modes[0] != "checkpoints":
            modes = ["benchmarks", *modes]
        if len(modes) > 1:
            raise ValueError(f"--{modes[0]} and --{modes[1]} are separate modes; use one at a time")
        if self.mode in ("eval", "sweep", "plot_steps") and not self.out:
            raise ValueError(f"out='' is invalid: --out DIR is required for {self.mode}")
        if self.shard:
            m = re.fullmatch(r"(\d+)/(\d+)", self.shard)
            if not m or not int(m.group(1)) < int(m.group(2)):
                raise bad("shard", "expected r/N with 0 <= r < N")

    @property
    def mode(self) -> str:
        if self.checkpoints:
            return "sweep"
        for m in ("compare", "aggregate", "plot_steps"):
            if getattr(self, m):
                return m
        return "eval"

    @property
    def shard_rank(self) -> tuple[int, int] | None:
        if not self.shard:
            return None
        r, world = self.shard.split("/")
        return int(r), int(world)


# Training's names for two eval flags (`OPSDConfig.student_thinking`, `student_prompt_file`): the same setting,
# so a command copied from a training recipe works. The fields keep eval's names, which eval_config.json and
# its resume check (`opsd.evaluation.samples.RESUME_KEYS`) are written under.
TRAINING_NAMES = {
    "thinking": ("student_thinking", "no_student_thinking"),
    "prompt_file": ("student_prompt_file",),
}


def _flag_names(argv: Sequence[str]) -> set[str]:
    """The flags of `argv` as written, without their dashes and with underscores: `--no-thinking` -> no_thinking."""
    return {arg.partition("=")[0][2:].replace("-", "_") for arg in argv if arg.startswith("--")}


def given_flags(argv: Sequence[str]) -> set[str]:
    """The `EvalConfig` fields `argv` sets, whatever name it uses (`--no-thinking`, `--student-thinking` and
    `--no-student-thinking` all set ``thinking``). A benchmark's preset protocol yields to these."""
    given = _flag_names(argv)
    fields_ = {f.name for f in fields(EvalConfig)}
    out = {name for name in given if name in fields_}
    out |= {name[3:] for name in given if name.startswith("no_") and name[3:] in fields_}
    for dest, training in TRAINING_NAMES.items():
        if set(training) & given:
            out.add(dest)
    return out


def _refuse_both_names(argv: Sequence[str]) -> None:
    """One setting given under eval's name and training's is refused, as training refuses an older name given
    beside the canonical one (`opsd.configuration.sources.canonical_flags`)."""
    given = _flag_names(argv)
    for dest, training in TRAINING_NAMES.items():
        ours = {dest, f"no_{dest}"} & given
        theirs = set(training) & given
        if ours and theirs:
            raise UserError(
                f"command line: --{min(ours)} and --{min(theirs)} are both given (one setting); keep only one"
            )


def parse_eval_args(argv: Sequence[str]) -> EvalConfig:
    """Flags (underscores or dashes) into an `EvalConfig`; invalid values raise `UserError`, and so does what
    argparse refuses (an unknown flag, a value of the wrong type), in one line with a pointer to --help instead
    of the whole usage. No flag may be abbreviated (`allow_abbrev=False`): `--no-thinking` cannot pass as
    `--no-th`, and an abbreviation cannot slip past the refusal of one setting under both names."""
    from transformers import HfArgumentParser
    from transformers.hf_argparser import string_to_bool

    class Parser(HfArgumentParser):
        def error(self, message: str):
            raise UserError(f"{message}; see python eval_aime.py --help")

    parser = Parser(
        EvalConfig, description="Score a model or LoRA checkpoint on AIME-style problems.", allow_abbrev=False
    )
    # merge_adapter is a three-way str (HfArgumentParser adds --no_X only for bools defaulting to True).
    parser.add_argument(
        "--no_merge_adapter", "--no-merge-adapter", dest="merge_adapter", action="store_const",
        const="false", default=argparse.SUPPRESS, help="Same as --merge-adapter false.",
    )  # fmt: skip
    parser.add_argument(
        "--student_thinking", "--student-thinking", dest="thinking", type=string_to_bool, nargs="?",
        const=True, default=argparse.SUPPRESS, metavar="BOOL", help="Training's name for --thinking.",
    )  # fmt: skip
    parser.add_argument(
        "--no_student_thinking", "--no-student-thinking", dest="thinking", action="store_false",
        default=argparse.SUPPRESS, help="Training's name for --no-thinking.",
    )  # fmt: skip
    parser.add_argument(
        "--student_prompt_file", "--student-prompt-file", dest="prompt_file", type=str,
        default=argparse.SUPPRESS, metavar="FILE", help="Training's name for --prompt-file.",
    )  # fmt: skip
    _refuse_both_names(argv)
    for action in parser._actions:  # set by --num-gpus for its own workers, not a user flag
        if action.dest == "shard":
            action.help = argparse.SUPPRESS
    _, unknown = parser.parse_known_args(list(argv))
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        (config,) = parser.parse_args_into_dataclasses(args=list(argv))
    except ValueError as e:
        raise UserError(str(e)) from None
    return config


# EvalConfig's fields that choose another mode or the members of a sweep, not settings of one evaluation.
# A sweep's declared step and the benchmark list choose what is run and reported, not how one evaluation samples.
MODE_FIELDS = ("compare", "aggregate", "plot_steps", "checkpoints", "base", "step", "benchmarks")


@dataclass(frozen=True)
class Resolved:
    """What `opsd.evaluation.job.resolve_job` found from the flags: the last fields of `EvalSettings`."""

    model_path: str  # a local model directory made absolute, or what `opsd.models.resolve_model_path` gave
    adapter_path: str  # the adapter directory, absolute; "" without an adapter
    adapter_rank: int | None  # the adapter's LoRA rank r (adapter_config.json)
    adapter_mode: str | None  # merged | vllm-lora | peft; None without an adapter
    engine_used: str  # vllm | transformers
    dataset_source: str  # --dataset, a local file made absolute
    student_template: str  # the prompt template the problems are rendered with
    max_model_len_used: int  # --max-model-len, lowered to the model's max_position_embeddings
    step: int | None  # N of a checkpoint-N in the adapter or model path; None without one
    benchmark: str | None  # the --benchmarks name this evaluation scores; None for --dataset alone
    dataset_revision: (
        str | None
    )  # the benchmark's pinned revision (its table's); None for a local or unpinned set
    dataset_commit: str | None  # the commit `datasets` loaded (a 40-digit sha), where it says; else None


class _Settings:
    @classmethod
    def of(cls, config: EvalConfig, **resolved: Any) -> EvalSettings:
        """`config`'s flags (but `MODE_FIELDS`) and the `resolved` values."""
        flags = {f.name: getattr(config, f.name) for f in fields(config) if f.name not in MODE_FIELDS}
        return cls(**flags, **resolved)

    def to_json(self) -> dict[str, Any]:
        """The contents of eval_config.json (and summary.json's ``config``)."""
        return asdict(self)


# One evaluation's settings once its inputs are checked: the flags of `EvalConfig` but `MODE_FIELDS`, as given
# (merge_adapter canonical: auto | true | false), then the `Resolved` fields, each declared once over there.
# Frozen. Saved as eval_config.json, whose keys are these fields in this order (the order every run has
# written them); a resumed run must match it in `opsd.evaluation.samples.RESUME_KEYS`.
EvalSettings = make_dataclass(
    "EvalSettings",
    [(f.name, f.type) for f in fields(EvalConfig) if f.name not in MODE_FIELDS]
    + [(f.name, f.type) for f in fields(Resolved)],
    bases=(_Settings,),
    namespace={
        "__module__": __name__,
        "__doc__": "One evaluation's settings: `EvalConfig`'s flags but `MODE_FIELDS`, then `Resolved`'s "
        "fields; saved as eval_config.json.",
    },
    frozen=True,
)
