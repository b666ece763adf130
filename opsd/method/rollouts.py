"""OPSDTrainer's rollout side: TRL's generation hooks with per-row seeds, the weights pushed into the engine, the
probe's rollouts, and the teacher's `[teacher prompt ; completion]` rows (docs/method.md §1).

`RolloutHooks` is mixed into `opsd_trainer.OPSDTrainer` ahead of TRL's `SDFTTrainer`, whose methods it overrides
and calls through `super()`. It reads the trainer's `args`, `accelerator`, `vllm_generation`, `seeds`
(`opsd.method.seeds.RolloutSeeds`), `clock` (`opsd.run.callbacks.PhaseClock`) and `_metrics`.
"""

from __future__ import annotations

import torch

from opsd.method.hidden import eval_mode, left_pad
from opsd.method.seeds import SeededLLM, row_seed
from opsd.method.weights import merged_named_weights, push_weights


class RolloutHooks:
    """`_generate` (phase `rollout`) -> `_generate_vllm`: `_sync_rollout_weights` when the weights changed (phase
    `weight_sync`: merged LoRA weights pushed into the colocated engine), then TRL's generate with one seed per
    row (`_first_rollout_row`); or `_generate_transformers` in eval mode. `sample_probe_rollouts` for the probe."""

    def _generate(self, prompt_ids):
        with self.clock.phase("rollout") as timed:
            out = super()._generate(prompt_ids)
        n_tokens = sum(len(c) for c in out[1])
        self._metrics["train"]["rollout/tokens_per_s"].append(n_tokens / max(timed.seconds, 1e-9))
        return out

    def _generate_vllm(self, prompt_ids):
        if self.state.global_step != self._last_loaded_step:
            with self.clock.phase("weight_sync"):
                self._sync_rollout_weights()
            self._last_loaded_step = self.state.global_step
        gen = self.vllm_generation
        if gen.mode == "colocate":
            if not isinstance(gen.llm, SeededLLM):
                gen.llm = self.seeds.seeded(gen.llm, self._first_rollout_row)
        else:
            # The server samples the whole batch from one seed (its i-th sample of a prompt from seed + i).
            rank = self.accelerator.process_index // self.args.vllm_tensor_parallel_size
            gen.generation_kwargs = {
                **(gen.generation_kwargs or {}),
                "seed": row_seed(self.args.seed, self.seeds.step, rank),
            }
        return super()._generate_vllm(prompt_ids)

    def _first_rollout_row(self, num_rows: int) -> int:
        """Global position in the step's batch of the first of this process's `num_rows` colocated prompts.

        Each process generates its contiguous share of the step's global generation batch (TRL's sampler),
        and a tensor-parallel group generates the shares of its ranks in rank order, so the position is the
        group's first rank x rows per rank. Hence every row of a step has its own seed (repeated prompts get
        different samples), a resumed run draws the same rollouts, and the rollouts do not depend on how many
        processes share the step.
        """
        tp = self.args.vllm_tensor_parallel_size
        first = self.accelerator.process_index // tp * tp
        return first * (num_rows // tp)

    def _sync_rollout_weights(self) -> None:
        gen = self.vllm_generation
        if (
            gen.mode != "colocate"
            or self.is_deepspeed_enabled
            and self.accelerator.state.deepspeed_plugin.zero_stage == 3
        ):
            gen.sync_weights()  # TRL's path: server mode, sharded parameters
            return
        # Merged weights are computed out of place: TRL's merge_adapter/unmerge_adapter round trip perturbs
        # the base weights by rounding error, which would slowly move the fixed teacher.
        weights = list(merged_named_weights(self.accelerator.unwrap_model(self.model)))
        llm = gen.llm
        if self.accelerator.device.type == "cpu":
            # vLLM's CPU backend packs float32 linear weights for oneDNN, so per-parameter `load_weights`
            # fails; reloading in checkpoint format re-runs that packing, and a tied lm_head is rebuilt.
            tied = self.model.config.get_text_config().tie_word_embeddings
            push_weights(llm, weights, tie_word_embeddings=tied)
        else:
            if gen.enable_sleep_mode:
                llm.wake_up(tags=["weights"])
                gen._llm_weights_sleeping = False
            llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights(weights)
            llm.reset_prefix_cache()

    def _generate_transformers(self, prompt_ids):
        # Rollouts come from the policy without dropout, as the vLLM engine's do.
        with eval_mode(self.accelerator.unwrap_model(self.model)):
            return super()._generate_transformers(prompt_ids)

    def sample_probe_rollouts(self, prompt_ids: list[list[int]]) -> list[list[int]]:
        """One completion per prompt from the current student, for the probe (`opsd.run.probe`).

        Sampled like a training rollout but from seeds no training step uses, with the global random state
        restored afterwards (the transformers engine draws from it), and kept out of the step's timing and
        rollout metrics: a run with the probe draws the same training rollouts as one without.
        """
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with self.seeds.probe(), torch.random.fork_rng(devices=devices):
            _, completions_ = super()._generate(prompt_ids)
        return [list(c) for c in completions_]


class TeacherRowBuilder:
    """Builds the `[teacher prompt ; completion]` rows of a batch (SDFTTrainer's teacher-context hook) with the
    trainer's `prompt_builder` (`opsd.method.prompts`); `num_truncated` counts the teacher prompts cut to their cap."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.num_truncated = 0

    def select_generation_prompts(self, prompts, privileged_contexts):
        return prompts

    def build(self, prompts, privileged_contexts, completion_ids, completion_mask):
        built = [
            self.trainer.prompt_builder.teacher_ids(p, c)
            for p, c in zip(prompts, privileged_contexts, strict=True)
        ]
        self.num_truncated = sum(t.truncated for t in built)
        ids, mask = left_pad(
            [t.ids for t in built], self.trainer.processing_class.pad_token_id, completion_ids.device
        )
        return {
            "teacher_input_ids": torch.cat([ids, completion_ids], dim=1),
            "teacher_attention_mask": torch.cat([mask, completion_mask], dim=1),
        }
