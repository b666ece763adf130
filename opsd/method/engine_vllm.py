"""The vLLM rollout engine of training (`VLLMRolloutEngine`), imported only when a run uses vLLM.

`VLLMRolloutEngine` is built by the entry point with its settings (seeds, the batch cap, the KV-cache size) and handed to
the trainer, and starts once the trainer exists (`bind`): it builds its `OPSDGeneration` itself, from the trainer's
model, accelerator, tokenizer and TRL config, with the arguments TRL's trainers give their engine and OPSD's
settings. The trainers build no engine of their own (`OPSDTrainer`, `opsd.rl.grpo.GRPOTrainer`: TRL's `use_vllm`
reads false while TRL's `__init__` runs). Nothing of vLLM is replaced: the colocated engine is a `SeededLLM` (a
`vllm.LLM` subclass) built with TRL's arguments and OPSD's.

One name of TRL's is stood in for, once, while the engine is built: TRL's `VLLMGeneration` starts its colocated
engine by the name `LLM` read from its own module (`trl.generation.vllm_generation`), with fixed arguments and no
setting for the class. `OPSDGeneration.__init__` makes that name the `SeededLLM` with OPSD's arguments for the
duration of TRL's constructor (`_replaced`, a context manager: the name is TRL's again however the block ends).
docs/decisions.md ("The engine's construction") says why the other ways cost more.

`OPSDGeneration` is TRL's `VLLMGeneration` with every OPSD difference in a public method or constructor argument:

- `max_num_seqs` > 0 caps the colocated engine's batch (TRL sizes it from the batch with no setting of its own).
  On vLLM's CPU backend a decode step's numerics depend on how many sequences it holds, so one at a time makes
  seeded rollouts independent of how the batch is split across processes;
- a colocated engine does not detokenise: training reads token ids only, and vLLM would otherwise detokenise
  every sequence at every decode step in this process, between GPU steps;
- the colocated engine starts with the trainer's dtype, vLLM's CPU_MLA backend for an MLA model on a CPU
  (`opsd.method.engine.engine_arguments`) and a fixed KV cache when one is asked for (`kv_cache_bytes`);
- every generation returns the sampled tokens' log-probs (as processed for sampling: temperature, top-k, top-p),
  for `rollout/logprob_gap`;
- the colocated engine draws one seed per row (`SeededLLM`); a server samples the whole batch from one seed per
  step and process group (its i-th sample of a prompt from seed + i), in `generation_kwargs`;
- `sync_weights` pushes the merged weights out of place (`opsd.method.engine.sync_colocated_engine`); a server
  and ZeRO-3's sharded parameters take TRL's path. With sleep mode the weights are discarded after every
  generation, and TRL's `generate` pushes them again before the next: the trainer then pushes nothing itself;
- the colocated engine starts with the process's output captured, and a failure to start is one line
  (`opsd.method.engine_classes.engine_start_refusal`); a failure in a push or a generation (and the sleep and
  wake-up inside them) is one line too, its traceback kept in `log_dir`, with nothing captured
  (`opsd.method.engine_classes.engine_failure`).
"""

from __future__ import annotations

import functools
import logging
import sys
from contextlib import contextmanager, nullcontext

import torch
import vllm
from trl.generation.vllm_generation import VLLMGeneration

from opsd.method.engine import (
    RolloutSeeds,
    engine_arguments,
    first_rollout_row,
    prefill_groups,
    row_seed,
    sync_colocated_engine,
)

logger = logging.getLogger(__name__)


class SeededLLM(vllm.LLM):
    """A `vllm.LLM` whose `generate` gives every prompt its own seed (`seeds_for(n)`: one seed per prompt; None:
    vLLM's own, one `SamplingParams` for the call, as a reference measurement samples).

    On vLLM's CPU backend a seeded request whose prefill is split over scheduler steps makes the engine rewind its
    generator, which the CPU generator cannot do ("CPU Generator does not use offset"): a call whose prompts do not
    prefill together in one step (`max_num_batched_tokens`, 4096 as TRL starts it) runs as consecutive calls of
    prompts that do (`prefill_groups`), each row with its own seed as before."""

    def __init__(self, *args, seeds_for, **kwargs):
        from vllm.platforms import current_platform

        self.seeds_for = seeds_for
        super().__init__(*args, **kwargs)
        sched = self.llm_engine.vllm_config.scheduler_config
        # (prompt tokens, prompts) that prefill in one scheduler step on the CPU backend; None elsewhere
        self.prefill_step = (
            (int(sched.max_num_batched_tokens), int(sched.max_num_seqs))
            if current_platform.is_cpu()
            else None
        )

    def generate(self, prompts, sampling_params=None, **kwargs):
        if (
            self.seeds_for is not None
            and sampling_params is not None
            and not isinstance(sampling_params, list | tuple)
        ):
            sampling_params = per_row_params(sampling_params, self.seeds_for(len(prompts)))
        groups = self._prefill_groups(prompts)
        if len(groups) <= 1:
            return super().generate(prompts, sampling_params=sampling_params, **kwargs)
        per_row = isinstance(sampling_params, list | tuple)
        out = []
        for rows in groups:
            params = sampling_params[rows] if per_row else sampling_params
            out += super().generate(prompts[rows], sampling_params=params, **kwargs)
        return out

    def _prefill_groups(self, prompts) -> list[slice]:
        if self.prefill_step is None or not isinstance(prompts, list):
            return [slice(0, None)]
        lengths = [len(p["prompt_token_ids"]) if isinstance(p, dict) and "prompt_token_ids" in p else 0
                   for p in prompts]  # fmt: skip
        return prefill_groups(lengths, *self.prefill_step)


def per_row_params(sampling_params, seeds: list[int]) -> list:
    """One copy of `sampling_params` (vLLM's `SamplingParams`) per seed, each with its seed."""
    per_row = []
    for seed in seeds:
        sp = sampling_params.clone()
        sp.seed = seed
        per_row.append(sp)
    return per_row


@contextmanager
def _replaced(module, name: str, value):
    """`module.name` is `value` inside the block and its own again after it, however the block ends."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


class OPSDGeneration(VLLMGeneration):
    """TRL's `VLLMGeneration` as OPSD drives it (module docstring); `settings` is the `VLLMRolloutEngine` that built
    it, `trl_arguments` TRL's constructor arguments (`VLLMRolloutEngine.generation_arguments`)."""

    def __init__(self, *, settings: VLLMRolloutEngine, **trl_arguments):
        self.settings = settings
        self.generations = 0
        colocated = trl_arguments.get("mode") == "colocate"
        model = trl_arguments["accelerator"].unwrap_model(trl_arguments["model"])
        arguments = settings.llm_arguments(model)
        llm = functools.partial(SeededLLM, seeds_for=settings.seeds_for, **arguments)
        trl_module = sys.modules[VLLMGeneration.__module__]  # where TRL's `_init_vllm` reads `LLM`
        with _replaced(trl_module, "LLM", llm) if colocated else nullcontext():
            super().__init__(**trl_arguments)
        if colocated:
            logger.info(
                "the colocated vLLM engine runs %s",
                ", ".join(f"{k}={v}" for k, v in arguments.items()),
            )

    @property
    def generation_kwargs(self) -> dict:
        if self.mode == "colocate":
            return self.fixed_generation_kwargs
        seeds = self.settings.seeds
        return {
            **self.fixed_generation_kwargs,
            "seed": row_seed(seeds.seed, seeds.step, self.settings.rank_in_batch),
        }

    @generation_kwargs.setter
    def generation_kwargs(self, value: dict) -> None:  # TRL's `__init__` sets it
        self.fixed_generation_kwargs = value

    def _failure(self, failed: str):
        from opsd.method.engine_classes import engine_failure

        if self.mode != "colocate":
            return nullcontext()
        return engine_failure(self.accelerator.unwrap_model(self.model), self.settings.log_dir, failed=failed)

    def generate(self, *args, **kwargs):
        # The first generation is the first forward: a kernel may refuse the model's shapes there.
        failed = "on its first generation" if self.generations == 0 else "on a generation"
        with self._failure(failed):
            out = super().generate(*args, **kwargs)
        self.generations += 1
        return out

    def sync_weights(self) -> None:
        clock = self.settings.clock
        with clock.phase("weight_sync") if clock else nullcontext(), self._failure("on a weight push"):
            plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
            if self.mode != "colocate" or (plugin is not None and plugin.zero_stage == 3):
                super().sync_weights()
                return
            on_cpu = self.accelerator.device.type == "cpu"
            sync_colocated_engine(self, self.accelerator.unwrap_model(self.model), on_cpu=on_cpu)


class VLLMRolloutEngine:
    """Training's vLLM rollouts: TRL's engine (colocated, or a server) with OPSD's seeds, weight pushes and
    settings, every setting a constructor argument.

    `seeds`: the run's rollout seeds; `max_num_seqs`: the colocated engine's batch cap (0: TRL's sizing);
    `kv_cache_bytes`: a fixed KV cache (None: vLLM's own sizing); `tensor_parallel_size` and `process_index` place
    this process's rows in the global batch; `log_dir`: where a failed engine's output is kept. The trainer it
    serves (`bind`) times the weight pushes on its clock (phase `weight_sync`). `generation` is the engine once
    `bind` has started it."""

    name = "vllm"

    def __init__(
        self,
        *,
        seeds: RolloutSeeds,
        max_num_seqs: int = 0,
        kv_cache_bytes: int | None = None,
        tensor_parallel_size: int = 1,
        process_index: int = 0,
        colocated: bool = True,
        log_dir: str | None = None,
    ):
        self.seeds = seeds
        self.colocated = colocated
        self.max_num_seqs = max_num_seqs
        self.kv_cache_bytes = kv_cache_bytes
        self.tensor_parallel_size = tensor_parallel_size
        self.process_index = process_index
        self.rank_in_batch = process_index // tensor_parallel_size
        self.log_dir = log_dir
        self.clock = None  # the trainer's phase clock (`bind`)
        self.generation: OPSDGeneration | None = None
        self.weights_step: int | None = None  # the step whose weights the engine holds (None: as loaded)

    def bind(self, trainer) -> None:
        """Starts the engine for `trainer`, a TRL trainer whose `__init__` is done and built no engine of its own;
        its phase clock times the weight pushes. A colocated engine starts with the trainer's models in classes of
        their own, out of reach of the engine's in-place decoration, and with the process's output captured until
        it is up; a start-up failure is refused in one line (`opsd.method.engine_classes`)."""
        from opsd.method.engine_classes import engine_start_refusal, own_classes

        self.clock = trainer.clock
        if self.generation is not None:
            return
        arguments = self.generation_arguments(trainer)
        model = arguments["accelerator"].unwrap_model(arguments["model"])
        if self.colocated:
            for held in (model, getattr(trainer, "teacher_model", None), getattr(trainer, "ref_model", None)):
                if isinstance(held, torch.nn.Module):
                    own_classes(held)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        with engine_start_refusal(self.colocated, base, self.log_dir):
            self.generation = OPSDGeneration(settings=self, **arguments)

    def generation_arguments(self, trainer) -> dict:
        """`VLLMGeneration`'s constructor arguments for `trainer`: those TRL's trainers pass from their config
        (SDFTTrainer's and GRPOTrainer's `__init__`), with OPSD's settings (`with_settings`)."""
        a = trainer.args
        return self.with_settings(
            dict(
                model=trainer.model, accelerator=trainer.accelerator, processing_class=trainer.processing_class,
                mode=a.vllm_mode, structured_outputs_regex=getattr(a, "vllm_structured_outputs_regex", None),
                server_base_url=a.vllm_server_base_url, server_host=a.vllm_server_host,
                server_port=a.vllm_server_port, group_port=a.vllm_group_port, server_timeout=a.vllm_server_timeout,
                tensor_parallel_size=a.vllm_tensor_parallel_size,
                gpu_memory_utilization=a.vllm_gpu_memory_utilization, max_model_length=a.vllm_max_model_length,
                max_num_seqs=a.per_device_train_batch_size * a.vllm_tensor_parallel_size * a.steps_per_generation,
                enable_sleep_mode=a.vllm_enable_sleep_mode, model_impl=a.vllm_model_impl,
                trust_remote_code=a.trust_remote_code, repetition_penalty=a.repetition_penalty,
                temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
                max_completion_length=a.max_completion_length, generation_kwargs=a.generation_kwargs,
            )
        )  # fmt: skip

    def with_settings(self, trl_arguments: dict) -> dict:
        """TRL's engine arguments with OPSD's: the batch cap where one is set, no detokenisation in a colocated
        engine, and every generation's log-prob of each sampled token (`logprobs=0`: that token's only;
        SDFTTrainer asks for none)."""
        arguments = {**trl_arguments, "logprobs": 0}
        if self.max_num_seqs > 0:
            arguments["max_num_seqs"] = self.max_num_seqs
        if arguments.get("mode") == "colocate":
            fixed = arguments.get("generation_kwargs") or {}
            arguments["generation_kwargs"] = {"detokenize": False, **fixed}
        return arguments

    def probe(self):
        """Inside the block, rollouts are seeded as the probe's (`opsd.method.engine.PROBE_STEP`)."""
        return self.seeds.probe()

    def seeds_for(self, n: int) -> list[int]:
        """One seed per row of this process's `n` colocated prompts (`opsd.method.engine.first_rollout_row`)."""
        return self.seeds.for_rows(first_rollout_row(self.process_index, self.tensor_parallel_size, n), n)

    def llm_arguments(self, model) -> dict:
        """What the colocated `vllm.LLM` starts with beside TRL's arguments."""
        arguments = engine_arguments(model)
        if self.kv_cache_bytes is not None:
            arguments["kv_cache_memory_bytes"] = self.kv_cache_bytes
        return arguments

    def generate(self, prompt_ids, *, step: int, num_generations: int):
        """(completion ids, the sampled tokens' log-probs) of one rollout per prompt, seeded by `step`; the
        current weights are pushed first when the engine holds another step's (`push_weights`)."""
        self.push_weights(step)
        self.seeds.at_step(step)
        _, completion_ids, logprobs, _ = self.generation.generate(
            prompts=prompt_ids, images=None, num_generations=num_generations
        )
        return completion_ids, logprobs

    def push_weights(self, step: int) -> None:
        """The trainer's weights into the engine, once per step that generates; with sleep mode TRL's `generate`
        pushes them before every generation instead (the engine discards them when it sleeps)."""
        if self.weights_step == step or self.generation.enable_sleep_mode:
            return
        self.generation.sync_weights()
        self.weights_step = step

    def sleep(self, level: int = 1) -> None:
        self.generation.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.generation.llm.wake_up()
