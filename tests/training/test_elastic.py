"""Elastic training under torchrun: two agents of 2 ranks each (c10d rendezvous, --nnodes 1:2) train with --plan
auto; one agent is killed with its ranks (a node lost); the other's ranks fail fast, it restarts them on the
world that is left, they re-plan for 2 ranks, resume from the last torch_dist checkpoint and finish with exit 0,
their losses those of an uninterrupted run."""

import re
import subprocess
import time

import pytest

from benchmarks.elastic_restart import agent_command, free_port, kill_node, start_agent
from tests.dist_harness import run_distributed
from tests.training.test_pretrain import LOG_RE, iteration_lines
from tests.training.test_replan import CPU_CLUSTER, GPT, _train

DEADLINE_S = 150  # the whole scenario on a loaded 2-core machine (it takes about 30 s)


def elastic_agent(log_path: str, port: int, is_host: bool, argv: list[str]) -> subprocess.Popen:
    """One torchrun agent ('a node') of 2 ranks, its output into `log_path`."""
    with open(log_path, "w") as log:
        return start_agent(agent_command(port, is_host, 2, argv), log)


def _wait_for(condition, what: str, deadline: float, procs) -> None:
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if any(p.poll() is not None for p in procs):
            raise AssertionError(f"an agent stopped while waiting for {what}")
        time.sleep(0.2)


def _losses(text: str) -> dict[int, tuple[float, float]]:
    """iteration -> (lm loss, grad norm), the last line printed for each iteration."""
    out = {}
    for line in iteration_lines(text):
        m = LOG_RE.match(" [2000-01-01 00:00:00]" + line)
        if m:
            out[int(m.group(1))] = (float(m.group(7)), float(m.group(9)))
    return out


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def elastic_argv(tmp_path, iters: int, save_interval: int) -> list[str]:
    cluster = tmp_path / "cpu.yaml"
    cluster.write_text(CPU_CLUSTER)
    ckpt = str(tmp_path / "ckpt")
    base = [a for a in GPT if a not in ("--train-iters", "8")]
    return base + ["--train-iters", str(iters), "--plan", "auto", "--plan-cluster", str(cluster), "--plan-space",
                   "pp=2", "--save", ckpt, "--load", ckpt, "--ckpt-format", "torch_dist", "--save-interval",
                   str(save_interval), "--distributed-timeout-minutes", "0.5"]


@pytest.mark.slow
def test_a_lost_node_restarts_the_other_on_2_ranks_with_a_new_plan(tmp_path):
    iters, kill_after = 40, 8
    argv = elastic_argv(tmp_path, iters, save_interval=5)
    logs = [str(tmp_path / "agent_host.log"), str(tmp_path / "agent_lost.log")]
    port = free_port()
    deadline = time.monotonic() + DEADLINE_S
    host = lost = None
    try:
        lost = elastic_agent(logs[1], port, False, argv)  # started first: it waits for the host's store
        host = elastic_agent(logs[0], port, True, argv)  # it holds the rendezvous store, so it is the one to survive
        _wait_for(lambda: max(_losses(_read(logs[0]) + _read(logs[1])), default=0) >= kill_after,
                  f"iteration {kill_after} on 4 ranks", deadline, [host, lost])
        kill_node(lost)  # the node is gone: its agent and both its ranks
        host.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in (host, lost):
            if proc is not None:
                kill_node(proc)
    host_log, lost_log = _read(logs[0]), _read(logs[1])
    assert host.returncode == 0, host_log[-3000:]
    # the last 2-rank plan is the restart's (a round that closed before the other agent joined may have begun on 2)
    first, _, after = host_log.rpartition("> --plan auto: searched 2 ranks")
    first += lost_log
    assert after, host_log[-3000:]
    assert "> --plan auto: searched 4 ranks" in first and "> initialized data parallel with size 2" in first
    assert "lost contact with another rank" in first, first[-3000:]
    assert re.search(r"^> \* ranks\s+4\s+-> 2$", after, re.M), after[-3000:]
    resumed, before = _losses(after), _losses(first)
    start = min(resumed)
    assert start > 1 and (start - 1) % 5 == 0 and max(resumed) == iters  # from a checkpoint, to the end
    assert max(before) >= kill_after
    reference = {it: (loss, norm) for it, loss, norm in run_distributed(2, _train, _uninterrupted(argv))[-1][0]}
    for it, (loss, norm) in list(resumed.items()) + list(before.items()):
        assert loss == pytest.approx(reference[it][0], rel=1e-3, abs=0), it
        assert norm == pytest.approx(reference[it][1], rel=1e-3, abs=0), it


def _uninterrupted(argv: list[str]) -> list[str]:
    """The same run without its checkpoints (on the test's own gloo pool)."""
    out, skip = [], {"--save", "--load", "--save-interval", "--distributed-timeout-minutes"}
    i = 0
    while i < len(argv):
        if argv[i] in skip:
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out
