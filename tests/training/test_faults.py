"""A flaky cluster: hung ranks, ranks that fail alone, outputs that cannot be written. Real processes, one line each."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_bmw.device import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
        "--make-vocab-size-divisible-by", "4"]


def _launch(world: int, args: list[str], tmp_path) -> list[subprocess.Popen]:
    """`world` pretrain_gpt.py processes wired as torchrun would, each logging to its own files."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        out = open(tmp_path / f"out{rank}.txt", "w")
        err = open(tmp_path / f"err{rank}.txt", "w")
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *args], env=env,
                                      stdout=out, stderr=err, cwd=str(tmp_path)))
    return procs


def _wait_for(path, needle: str, timeout: float) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if path.exists() and needle in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} never appeared in {path}")


def _kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def _errors(tmp_path, rank: int) -> list[str]:
    return [line for line in (tmp_path / f"err{rank}.txt").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("layout", [["--pipeline-model-parallel-size", "2"], []], ids=["pp2", "dp2"])
def test_a_hung_rank_fails_the_job_within_the_timeout(tmp_path, layout):
    timeout_min = 0.25
    procs = _launch(2, TINY + layout + ["--train-iters", "1000000", "--distributed-timeout-minutes",
                                        str(timeout_min)], tmp_path)
    try:
        last = 1  # the loss is logged by the last rank
        _wait_for(tmp_path / f"out{last}.txt", " iteration        3/", 120)
        procs[1].send_signal(signal.SIGSTOP)
        stopped = time.time()
        rc = procs[0].wait(timeout=timeout_min * 60 + 60)
        waited = time.time() - stopped
    finally:
        _kill_all(procs)
    assert rc == 1
    assert waited < timeout_min * 60 + 30, waited
    lines = _errors(tmp_path, 0)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: lost contact with another rank"), lines
    assert "--distributed-timeout-minutes" in lines[0]
