"""A new method is one module and one registry entry (`opsd.methods`): a toy method registered here, from the
test, runs one CPU step through `opsd_train.py`, with the registry's checks (the switches it does not read, its
rollouts per problem) and without any method-name branch to edit."""

import json
import os

import pytest
import torch

from opsd import methods
from opsd.rundir import CONFIG_FILE
from opsd_trainer import OPSDTrainer
from tests.conftest import ENV, in_process
from tests.e2e.test_train_cli import tiny_args


class SelfImitation(OPSDTrainer):
    """The toy method: the negative log-likelihood of the student's own rollouts under the student (no teacher),
    averaged over the step's loss tokens: OPSD's trainer with its own loss, scored by the shared core's masks
    and forwards."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        hidden_NH = self.core.student_hidden(model, inputs)
        ids_BC, mask_BC = inputs["completion_ids"], inputs["completion_mask"]
        keep_N = self.core.token_mask(ids_BC, mask_BC)[mask_BC.bool()].bool()
        weight_VH = self.model.get_output_embeddings().weight
        logits_NV = self.logit_transform(hidden_NH[keep_N] @ weight_VH.T)
        nll_N = -torch.log_softmax(logits_NV.float(), -1).gather(1, ids_BC[mask_BC.bool()][keep_N, None])[
            :, 0
        ]
        self.record_metrics({"toy/nll_per_token": float(nll_N.detach().mean())})
        return nll_N.sum() / inputs["num_loss_tokens"][0].clamp(min=1)


TOY = methods.Method("self_imitation", SelfImitation, "the toy method trains on its own rollouts' likelihood")


@pytest.fixture
def toy():
    methods.register(TOY)
    yield TOY
    methods.unregister(TOY.name)


def test_a_registered_method_trains_one_step_through_opsd_train(toy, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(
        tiny_model_dir, out, "--method", toy.name, "--max_steps", "1", "--gradient_accumulation_steps", "1"
    )
    proc = in_process_run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss" in r]
    assert len(logged) == 1 and logged[0]["toy/nll_per_token"] > 0
    # The loss TRL logged is the toy's: the mean NLL per loss token (one micro-batch per step).
    assert logged[0]["loss"] == pytest.approx(logged[0]["toy/nll_per_token"], rel=1e-4)
    assert "opsd/divergence" not in logged[0]  # none of OPSD's loss ran
    assert logged[0]["grad_norm"] > 0 and (out / "checkpoint-1" / "adapter_model.safetensors").is_file()
    assert json.loads((out / CONFIG_FILE).read_text())["method"] == toy.name


def in_process_run(args, tmp_path):
    """`opsd_train.py ARGS` in this process (the toy is registered in this process only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPSD_")}
    env.update(ENV)
    return in_process("opsd_train.py", args, env=env, cwd=tmp_path)


def test_the_registry_checks_a_new_method_without_a_name_branch(toy, tmp_path):
    # It reads none of the method-specific switches: each of them set is refused naming who reads it.
    refused = in_process_run(["--method", toy.name, "--clip_mode", "rescale", "--dry-run"], tmp_path)
    assert refused.returncode == 2
    assert (
        f"clip_mode='rescale' is read by method=opsd and hybrid only, and method={toy.name} never reads it"
        in refused.stderr
    )
    # One rollout per problem, as it declared.
    refused = in_process_run(["--method", toy.name, "--num_generations", "4", "--dry-run"], tmp_path)
    assert refused.returncode == 2 and f"num_generations=4 with method={toy.name}" in refused.stderr
    assert in_process_run(["--method", toy.name, "--dry-run"], tmp_path).returncode == 0


def test_an_unregistered_method_is_refused_with_the_registered_ones(tmp_path):
    proc = in_process_run(["--method", "self_imitation", "--dry-run"], tmp_path)
    assert proc.returncode == 2 and "self_imitation" in proc.stderr, proc.stderr
    assert all(name in proc.stderr for name in methods.BUILT_IN), proc.stderr
