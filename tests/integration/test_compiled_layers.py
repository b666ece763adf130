"""compile_layers on the tiny model: two OPSD steps with compiled decoder layers give the eager run's adapters,
the layers share their graphs, generation stays eager, and the switch reaches the trainer.

The compiled runs use dynamo's `aot_eager` backend (the same graph capture, autograd split and recompute as
inductor, without inductor's C++ build of ~45 s per run on 2 cores), so the comparison is exact; inductor is
what the GPU benchmark runs (docs/performance.md c.5)."""

import pytest
import torch

from tests.conftest import make_trainer


def _adapters(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" in n}


def _train(tiny_model_dir, out, compiled: bool):
    from opsd.speed.compiled_layers import compile_decoder_layers

    torch.manual_seed(0)
    trainer = make_trainer(tiny_model_dir, out, gradient_checkpointing=True, teacher_mode="fixed")
    if compiled:
        assert compile_decoder_layers(trainer.model, backend="aot_eager") == 2  # the tiny model's 2 layers
        trainer.args.compile_layers = True  # what the switch sets besides: the compile/graphs metric
    result = trainer.train()
    return trainer, result.training_loss


def test_compiled_layers_train_as_the_eager_layers_do(tiny_model_dir, tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, eager_loss = _train(tiny_model_dir, tmp_path / "eager", compiled=False)
    assert counters["stats"]["unique_graphs"] == 0
    compiled, compiled_loss = _train(tiny_model_dir, tmp_path / "compiled", compiled=True)

    # Rollouts (eager generation), student and teacher forwards, recompute and backward: the same numbers.
    assert compiled_loss == eager_loss
    want, got = _adapters(eager), _adapters(compiled)
    assert want.keys() == got.keys() and len(want) == 8  # LoRA A and B on q and v of 2 layers
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)

    # Captured: the student's forward (with and without the recompute) and the teacher's (adapter off); the
    # two layers share each graph rather than compiling one apiece.
    graphs = counters["stats"]["unique_graphs"]
    assert 2 <= graphs <= 6, dict(counters["stats"])
    # Each step logs how many graphs the process has compiled so far (recompilations show as increments).
    logged = [r["compile/graphs"] for r in compiled.state.log_history if "compile/graphs" in r]
    assert len(logged) == 2 and logged[-1] == graphs and logged == sorted(logged)
    assert not any("compile/graphs" in r for r in eager.state.log_history)

    # Generation passes a KV cache and keeps the eager forward: nothing new is captured.
    model = compiled.model
    model.eval()
    prompt = compiled.processing_class("What is 3 + 4?", return_tensors="pt")
    with torch.no_grad():
        model.generate(**prompt, max_new_tokens=6, do_sample=False)
    assert counters["stats"]["unique_graphs"] == graphs


def test_compile_layers_switch_reaches_the_trainer(tiny_model_dir, tmp_path):
    from opsd.speed import compiled_layers

    trainer = make_trainer(tiny_model_dir, tmp_path / "run", compile_layers=True)
    layers = [m for m in trainer.model.modules() if type(m).__name__ == "Qwen3DecoderLayer"]
    assert len(layers) == 2
    assert all(layer.forward.func is compiled_layers._cache_free for layer in layers)
    assert not any(getattr(m.forward, "func", None) for m in make_trainer(tiny_model_dir, tmp_path / "off").model.modules()
                   if type(m).__name__ == "Qwen3DecoderLayer")  # fmt: skip


def test_a_model_without_decoder_layers_is_refused():
    from opsd.speed.compiled_layers import compile_decoder_layers

    with pytest.raises(ValueError, match="compile_layers found no decoder layer"):
        compile_decoder_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
