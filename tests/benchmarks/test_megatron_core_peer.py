"""benchmarks/megatron_core_peer.py's bad input (its CPU run, both sides on the same tiny GPT, is the gpu_check dry
run's peer step: tests/tools/test_gpu_check.py)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "megatron_core_peer.py")
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--vocab-size", "512", "--micro-batch-size", "2", "--global-batch-size", "4"]


def _run(args, timeout=240):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)


@pytest.mark.parametrize("args, message", [
    (["--allow-cpu", "--", *TINY, "--swiglu"], "GPT-2 style models only"),
    (["--peers", "ours,deepspeed"], "--peers 'ours,deepspeed': choose from ours,mcore"),
])
def test_bad_input_is_one_line(args, message):
    run = _run(args, timeout=120)
    assert run.returncode == 2
    assert message in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr
