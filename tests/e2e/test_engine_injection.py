"""The rollout engine is one object built outside the trainer and handed to it: its settings are constructor
arguments, it is the only vLLM engine the process starts (TRL's trainer builds none of its own), and building a
trainer with it (the colocated vLLM engine on the tiny model) and tearing it down leaves vLLM's and TRL's modules as
they were."""

import gc
import inspect
import os

import pytest
import torch

from tests.conftest import colocated_rendezvous


def _module_state():
    """Every attribute of the modules whose names TRL's trainers read their engine by, and vLLM's `LLM`."""
    import trl.experimental.sdft.sdft_trainer as sdft
    import trl.generation.vllm_generation as generation
    import trl.trainer.grpo_trainer as grpo
    import vllm

    return {
        "vllm": dict(vars(vllm)),
        "vllm.LLM": dict(vars(vllm.LLM)),
        "vllm.LLM.__init__": vllm.LLM.__init__,
        "trl.generation.vllm_generation": dict(vars(generation)),
        "trl.trainer.grpo_trainer": dict(vars(grpo)),
        "trl.experimental.sdft.sdft_trainer": dict(vars(sdft)),
    }


def _streams() -> tuple:
    """The files the process's stdout and stderr (descriptors 1 and 2) are, as (device, inode) pairs."""
    return tuple((os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in (1, 2))


def _watched(method, seen: list):
    def watched(*args, **kwargs):
        seen.append(_streams())
        return method(*args, **kwargs)

    return watched


def test_an_injected_engine_runs_and_leaves_no_patch(tiny_model_dir, tmp_path):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from opsd.configuration.config import OPSDConfig
    from opsd.launch.preflight import build_paired_dataset
    from opsd.method.engine import RolloutSeeds
    from opsd.method.engine_vllm import SeededLLM, VLLMRolloutEngine
    from opsd_trainer import OPSDTrainer

    before = _module_state()
    cfg = OPSDConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, max_completion_length=8,
        use_vllm=True, vllm_max_model_length=512, save_strategy="no", gradient_checkpointing=False,
        max_teacher_prompt_length=60,
    )  # fmt: skip
    kv_bytes = 64 * 2**20
    engine = VLLMRolloutEngine(
        seeds=RolloutSeeds(cfg.seed), max_num_seqs=1, kv_cache_bytes=kv_bytes, log_dir=str(tmp_path)
    )
    with colocated_rendezvous(), pytest.MonkeyPatch.context() as patch:
        # vLLM's CPU platform would size the cache from this variable over the engine's argument.
        patch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        trainer = OPSDTrainer(
            model=AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), args=cfg,
            train_dataset=build_paired_dataset(cfg)[0], processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
            peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
            engine=engine,
        )  # fmt: skip
        llm = engine.generation.llm
        assert trainer.engine is engine and isinstance(llm, SeededLLM)
        # TRL's trainer built no engine of its own (SDFTTrainer keeps the one it builds as `vllm_generation`).
        assert not hasattr(trainer, "vllm_generation")
        # The constructor's settings reached the engine vLLM runs.
        assert llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes == kv_bytes
        assert llm.llm_engine.vllm_config.scheduler_config.max_num_seqs == 1
        assert str(llm.llm_engine.vllm_config.model_config.dtype) == "torch.float32"
        # The process's output is captured while the engine starts only: a push and a generation write where the
        # process writes (a logging handler's and the rollout grader's lines are not held back meanwhile).
        streams = {"before": _streams()}
        for name in ("generate", "collective_rpc"):  # a generation; a push (vLLM's reload on the CPU backend)
            streams[name] = []
            setattr(llm, name, _watched(getattr(llm, name), streams[name]))
        trainer.train()
        assert engine.weights_step == 0 and engine.generation.generations == 1
        assert streams["generate"] and streams["collective_rpc"]
        assert set(streams["generate"] + streams["collective_rpc"]) == {streams["before"]}
        del llm.generate, llm.collective_rpc
        del trainer, llm
        gc.collect()
    after = _module_state()
    assert after["vllm.LLM.__init__"] is before["vllm.LLM.__init__"]
    for name, attributes in before.items():
        if name == "vllm.LLM.__init__":
            continue
        changed = [key for key, value in attributes.items() if after[name].get(key) is not value]
        # What the run may add to a module: its submodules, imported on first use.
        added = [
            key for key in after[name].keys() - attributes.keys() if not inspect.ismodule(after[name][key])
        ]
        assert not changed and not added, (name, changed, added)


def test_a_trainer_refuses_an_engine_of_the_other_kind(tmp_path):
    from opsd.configuration.config import OPSDConfig
    from opsd.method.rollouts import TransformersRolloutEngine
    from opsd_trainer import OPSDTrainer

    cfg = OPSDConfig(output_dir=str(tmp_path), use_vllm=True)
    with pytest.raises(ValueError, match="a transformers engine was given to a run with use_vllm=True"):
        OPSDTrainer(model=None, args=cfg, engine=TransformersRolloutEngine())
