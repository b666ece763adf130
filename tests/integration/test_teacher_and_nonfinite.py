"""Teacher fidelity and non-finite steps on the tiny model: the EMA teacher survives a resume and is kept in
float32, every teacher forward is deterministic under LoRA dropout, and a step whose loss or gradient is not
finite changes nothing (weights, Adam state, LR schedule) and N of them in a row stop the run."""

import copy
import json

import pytest
import torch
from transformers import TrainerCallback, TrainerControl, TrainerState

from tests.conftest import make_trainer, stop_at
from tests.e2e.test_trainer import _scoring_batch, _teacher_hidden


def _adapters(trainer):
    """Student (`.default.`) and EMA teacher (`.teacher.`) LoRA weights, cloned."""
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" in n}


# -- EMA teacher: resume and float32 ---------------------------------------------------------------------------
def _ema_trainer(tiny_model_dir, out, *callbacks):
    from opsd.run.callbacks import CompleteMark

    # decay 0.5 makes the teacher follow the student visibly within 4 steps.
    trainer = make_trainer(
        tiny_model_dir,
        out,
        teacher_mode="ema",
        ema_decay=0.5,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
    )
    for cb in callbacks:
        trainer.add_callback(cb)
    trainer.add_callback(CompleteMark())  # last, as in opsd_train.py
    return trainer


def test_ema_resume_matches_uninterrupted_run(tiny_model_dir, tmp_path):
    from opsd.rundir import latest_complete_checkpoint

    whole = _ema_trainer(tiny_model_dir, tmp_path / "whole")
    whole.train()
    expected = _adapters(whole)
    assert any(".teacher." in n for n in expected) and any(".default." in n for n in expected)

    first = _ema_trainer(tiny_model_dir, tmp_path / "cut", stop_at(2))
    first.train()
    ckpt = latest_complete_checkpoint(tmp_path / "cut")
    assert ckpt.name == "checkpoint-2" and (ckpt / "ema_teacher.pt").is_file()
    at_2 = _adapters(first)
    # At step 2 the teacher is not the student: a resume that restarted it from the student would show.
    assert any(
        not torch.allclose(at_2[n], at_2[n.replace(".teacher.", ".default.")])
        for n in at_2
        if ".teacher." in n
    )
    resumed = _ema_trainer(tiny_model_dir, tmp_path / "cut")
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == 4
    got = _adapters(resumed)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-6, rtol=1e-5, msg=name)


def test_ema_teacher_is_kept_in_float32_under_bf16(tiny_model_dir):
    """With bf16 adapters and decay 0.999 the teacher still moves, exactly as a float32 EMA cast to bf16."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from opsd.method.ema_teacher import InitialisedAdapterEMA

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    rate, steps = 1e-3, 50
    ema = InitialisedAdapterEMA(
        model=model, teacher_adapter_name="teacher", update_rate=rate, state_file="ema_teacher.pt"
    )
    state, control = TrainerState(), TrainerControl()
    # peft keeps adapters in float32; DeepSpeed's bf16 engine (and QLoRA) casts them to bf16, as done here.
    model.to(torch.bfloat16)
    ema.on_train_begin(None, state, control)
    model.to(torch.bfloat16)
    student = {n: p for n, p in model.named_parameters() if ".default." in n}
    start = {n: p.detach().clone() for n, p in student.items()}
    with torch.no_grad():
        for p in student.values():
            p.mul_(1.5)
    for step in range(1, steps + 1):
        state.global_step = step
        ema.on_step_end(None, state, control)

    params = dict(model.named_parameters())
    moved = total = stays_in_bf16 = 0
    for name, s0 in start.items():
        shadow = s0.float()
        naive = s0.clone()
        for _ in range(steps):
            shadow = (1 - rate) * shadow + rate * student[name].detach().float()
            naive = (1 - rate) * naive + rate * student[name].detach()  # the update done in bf16
        teacher = params[name.replace(".default.", ".teacher.")]
        assert teacher.dtype == torch.bfloat16
        torch.testing.assert_close(
            teacher.detach().float(), shadow.to(torch.bfloat16).float(), atol=0, rtol=2**-8
        )
        if "lora_A" in name:
            moved += (teacher.detach() != s0).sum().item()
            stays_in_bf16 += (naive == s0).sum().item()
            total += s0.numel()
    # The float32 EMA moved each lora_A entry x by (1 - 0.999**50) * 0.5 * x ~ 0.024 x, three bf16 steps;
    # in bf16 each update, 0.0005 x, is below half a bf16 step (0.002 x) and rounds away.
    assert moved > 0.9 * total
    assert stays_in_bf16 > 0.5 * total
    assert all(v.dtype == torch.float32 for v in ema.shadow_weights.values())


# -- dropout: the student trains with it, every teacher forward runs without --------------------------------------
@pytest.mark.parametrize("mode", ["fixed", "ema", "dynamic"])
def test_teacher_forward_is_deterministic_with_lora_dropout(tiny_model_dir, tmp_path, mode):
    trainer = make_trainer(tiny_model_dir, tmp_path, teacher_mode=mode, lora_dropout=0.5, max_steps=1)
    trainer.train()  # one step: LoRA B is no longer zero, so dropout on the LoRA input shows in the output
    batch = _scoring_batch(trainer, trainer.processing_class)
    trainer.model.train()
    first, second = _teacher_hidden(trainer, batch), _teacher_hidden(trainer, batch)
    assert torch.equal(first, second)
    assert trainer.model.training, "the teacher forward must leave the student in training mode"
    # lora_dropout applies to the student's training forward, as in peft.
    with torch.no_grad():
        args = (batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"])
        a, b = (
            trainer.forwards(trainer.model, *args),
            trainer.forwards(trainer.model, *args),
        )
    assert not torch.equal(a, b)


def test_transformers_rollouts_ignore_lora_dropout(tiny_model_dir, tmp_path):
    """Rollouts come from the policy without dropout, as the vLLM engine's do."""
    trainer = make_trainer(tiny_model_dir, tmp_path, lora_dropout=0.5, max_steps=1)
    trainer.train()
    trainer.model.train()
    prompts = [trainer.prompt_builder.student_ids(p) for p in ["What is 2 + 3?", "What is 7 * 6?"]]
    torch.manual_seed(0)
    with_dropout = trainer.engine.generate(prompts, step=0, num_generations=1)[0]
    for module in trainer.model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    torch.manual_seed(0)
    without = trainer.engine.generate(prompts, step=0, num_generations=1)[0]
    assert with_dropout == without


# -- non-finite steps ---------------------------------------------------------------------------------------------
class NaNAt(TrainerCallback):
    """Makes the student's final hidden states NaN on the first micro-batch of the chosen optimizer steps.

    Only forwards with gradients are hit: the rollouts and the teacher forward run under no_grad.
    """

    def __init__(self, trainer, steps):
        self.steps, self.armed = set(steps), False
        # On the final norm's input: its output is what the loss reads (`completion_hidden`).
        trainer.model.get_base_model().model.norm.register_forward_pre_hook(self._hook)

    def _hook(self, module, inputs):
        if self.armed and torch.is_grad_enabled():
            self.armed = False
            return (inputs[0] * float("nan"),)
        return None

    def on_step_begin(self, args, state, control, **kwargs):
        self.armed = state.global_step + 1 in self.steps


class Snapshots(TrainerCallback):
    """Trainable weights, optimizer state and LR scheduler state before and after every optimizer step."""

    def __init__(self, trainer):
        self.trainer, self.before, self.after = trainer, {}, {}

    def _take(self):
        weights = {n: p.detach().clone() for n, p in self.trainer.model.named_parameters() if p.requires_grad}
        schedule = {
            "scheduler": copy.deepcopy(self.trainer.lr_scheduler.state_dict()),
            "rates": [group["lr"] for group in self.trainer.optimizer.param_groups],
        }
        return weights, copy.deepcopy(self.trainer.optimizer.state_dict()["state"]), schedule

    def on_step_begin(self, args, state, control, **kwargs):
        self.before[state.global_step + 1] = self._take()

    def on_step_end(self, args, state, control, **kwargs):
        self.after[state.global_step] = self._take()


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _assert_same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_nonfinite_step_is_skipped(tiny_model_dir, tmp_path):
    from opsd.run.callbacks import MetricsJSONL

    # Two micro-batches per step: only the first is NaN, the step must still be skipped as a whole.
    trainer = make_trainer(
        tiny_model_dir, tmp_path, max_steps=3, gradient_accumulation_steps=2, lr_scheduler_type="linear"
    )
    trainer.add_callback(NaNAt(trainer, steps=[2]))
    snaps = Snapshots(trainer)
    trainer.add_callback(snaps)
    trainer.add_callback(MetricsJSONL())
    trainer.train()

    before, after = snaps.before[2], snaps.after[2]
    _assert_same(after[0], before[0])  # weights
    assert after[1], "Adam has state from step 1"
    _assert_same(after[1], before[1])  # moments and step counts
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert any(not torch.equal(snaps.after[3][0][n], before[0][n]) for n in before[0]), "step 3 trained"
    assert all(s["step"].item() == 2 for s in snaps.after[3][1].values())  # Adam counted steps 1 and 3
    _assert_same(after[2], before[2])  # the scheduler and the optimizer's rates stand where they stood
    assert snaps.after[3][2]["scheduler"]["last_epoch"] == 2  # stepped after steps 1 and 3 only
    assert snaps.after[3][2]["scheduler"]["_step_count"] == 3

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "train/nonfinite_skipped" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["train/nonfinite_skipped"] for r in train] == [0.0, 1.0, 0.0]
    # The LR schedule does not advance on a skipped step: step 3 runs at step 2's rate.
    lrs = [r["learning_rate"] for r in train]
    assert lrs[0] > lrs[1] == lrs[2]


def test_consecutive_nonfinite_steps_abort_keeping_the_last_checkpoint(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from opsd.run.callbacks import CompleteMark
    from opsd.rundir import latest_complete_checkpoint

    trainer = make_trainer(
        tiny_model_dir, tmp_path, max_steps=6, save_strategy="steps", save_steps=2, max_nonfinite_steps=2
    )
    trainer.add_callback(NaNAt(trainer, steps=[3, 4, 5, 6]))
    snaps = Snapshots(trainer)
    trainer.add_callback(snaps)
    trainer.add_callback(CompleteMark())
    with pytest.raises(RuntimeError, match=r"step 4\b.*2 consecutive.*checkpoint-2"):
        trainer.train()
    assert latest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-2"
    assert not (tmp_path / "checkpoint-4").exists()
    saved = load_file(str(tmp_path / "checkpoint-2" / "adapter_model.safetensors"))
    weights_at_2 = snaps.after[2][0]
    assert len(saved) == len(weights_at_2)
    for name, value in weights_at_2.items():
        assert torch.equal(saved[name.replace(".default", "")], value), name
        # Steps 3 and 4 were skipped: the live weights are still those of step 2.
        assert torch.equal(dict(trainer.model.named_parameters())[name], value), name


def test_max_nonfinite_steps_must_be_positive(tmp_path):
    from opsd.configuration.config import OPSDConfig

    with pytest.raises(ValueError, match="max_nonfinite_steps=0"):
        OPSDConfig(output_dir=str(tmp_path), max_nonfinite_steps=0)


def test_the_final_checkpoint_of_a_run_that_saves_none_holds_the_ema_teacher(tiny_model_dir, tmp_path):
    """With save_strategy=no, opsd_train.py writes the final checkpoint itself after training; its callbacks'
    `on_save` run as after every checkpoint, so it holds the EMA teacher's state (a run extended later resumes the
    teacher, not the student) and is marked complete."""
    import os

    from opsd.rundir import is_complete
    from tests.conftest import ENV, in_process
    from tests.e2e.test_train_cli import tiny_args

    out = tmp_path / "run"
    args = tiny_args(tiny_model_dir, out, "--max_steps", "1", "--teacher_mode", "ema", "--ema_decay", "0.5",
                     "--save_strategy", "no", "--rollout_engine", "transformers")  # fmt: skip
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("OPSD_")}, **ENV}
    proc = in_process("opsd_train.py", args, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = out / "checkpoint-1"
    assert is_complete(final) and (final / "ema_teacher.pt").is_file()
    shadow = torch.load(final / "ema_teacher.pt", map_location="cpu")["shadow"]
    assert shadow and all(torch.isfinite(t).all() for t in shadow.values())
