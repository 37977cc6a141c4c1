"""scripts/*.sh: an environment variable the launch scripts take that is not a number they can use is one
`error:` line and exit code 2, before torchrun (whose own message is a traceback)."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.parametrize("script", ["pretrain_gpt_distributed.sh", "pretrain_bert_distributed.sh"])
@pytest.mark.parametrize("env,message", [
    ({"GPUS_PER_NODE": "abc"}, "GPUS_PER_NODE=abc: must be an integer >= 1"),
    ({"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE=0: must be an integer >= 1"),
    ({"NNODES": "0"}, "NNODES=0: must be an integer >= 1"),
    ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2: must be below NNODES=2"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT=99999: must be a port in [1, 65535]"),
])
def test_bad_launch_variables_are_one_line(script, env, message):
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", script), "--mock-data"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "GPUS_PER_NODE": "1", **env})
    assert run.returncode == 2 and run.stderr == f"error: {message}\n", run.stderr


@pytest.mark.slow
@pytest.mark.parametrize("iters", ["abc", "1e3", "0", "-5"])
def test_quickstart_iterations_are_checked_first(iters, tmp_path):
    """Checked before anything is fetched or trained (setup.sh, which comes first, finds .venv ready)."""
    run = subprocess.run(["bash", os.path.join(ROOT, "scripts", "quickstart.sh")], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "QUICKSTART_ITERS": iters}, cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == \
        f"error: QUICKSTART_ITERS={iters}: must be an integer >= 1", run.stderr
