"""The repo as a user meets it, through subprocesses: single-node engines bind to loopback, and the GPU
setup script refuses a CPU torch. The static rules live in tests/unit/test_repo_rules.py."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_single_node_engines_bind_to_loopback_unless_the_user_says_otherwise():
    code = "import os, opsd_train; print(os.environ['VLLM_HOST_IP'])"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_HOST_IP"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "127.0.0.1", out.stderr[-2000:]
    env["VLLM_HOST_IP"] = "10.1.2.3"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "10.1.2.3", out.stderr[-2000:]


def test_gpu_setup_refuses_a_cpu_torch_with_one_clear_line():
    res = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup_gpu.sh"), "--dry-run"],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
    )
    if torch.version.cuda:
        assert res.returncode == 0 and "pip install -e .[gpu,dev]" in res.stdout
    else:
        assert res.returncode == 2
        assert "CPU build" in res.stderr and "scripts/setup.sh" in res.stderr
        assert "Traceback" not in res.stderr
