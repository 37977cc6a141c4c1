import pytest
import torch
import torch.distributed as dist

from tests.dist_harness import run_distributed


def _allreduce(rank, world_size, value):
    t = torch.tensor([float(rank + value)])
    dist.all_reduce(t)
    return t.item()


def _fail(rank, world_size):
    if rank == 1:
        raise ValueError("boom")
    return rank


@pytest.mark.slow
def test_pool_reused_and_collectives_work():
    for ws in (1, 2):
        out = run_distributed(ws, _allreduce, 1)
        assert out == [float(sum(range(ws)) + ws)] * ws


@pytest.mark.slow
def test_failure_reports_rank():
    import pytest

    with pytest.raises(AssertionError, match="rank 1"):
        run_distributed(2, _fail)
    assert run_distributed(2, _allreduce, 0) == [1.0, 1.0]


def _pid(rank, world_size):
    import os

    return os.getpid()


@pytest.mark.slow
def test_a_failed_case_gets_a_fresh_pool():
    import pytest

    before = run_distributed(2, _pid)
    with pytest.raises(AssertionError, match="rank 1"):
        run_distributed(2, _fail)
    after = run_distributed(2, _pid)
    assert set(before).isdisjoint(after)


def _build_and_train_once(rank, world_size):
    """A ParallelState with every group kind, and a pipeline step with gradient hooks, left to the harness."""
    from megatron_bmw.config import ParallelConfig
    from megatron_bmw.parallel.grad_sync import GradSync
    from megatron_bmw.parallel.state import ParallelState
    from megatron_bmw.models.chunk import ModelChunk, build_units
    from tests.reference import SEED, make_batch, small_config

    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=world_size))
    cfg = small_config()
    model = ModelChunk(build_units(cfg, st, SEED))
    sync = GradSync(list(model.parameters()), st)
    model(None, make_batch(cfg, 2, 0)).backward()
    sync.finish()


@pytest.mark.slow
def test_worker_threads_do_not_grow_across_tasks():
    from tests.dist_harness import worker_threads

    run_distributed(2, _build_and_train_once)
    first = sum(worker_threads()[2].values())
    for _ in range(3):
        run_distributed(2, _build_and_train_once)
    assert sum(worker_threads()[2].values()) <= first


@pytest.mark.slow
def test_workers_leave_when_the_session_dies_without_stopping_them(tmp_path):
    """A session that leaves by os._exit (as a pytest-xdist worker does, skipping atexit) orphans no workers: each
    notices its parent is gone and exits."""
    import os
    import subprocess
    import sys
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = ("import os, sys; sys.path.insert(0, sys.argv[1]); from tests.dist_harness import run_distributed; "
             "from tests.test_harness import _pid; print(*run_distributed(2, _pid), flush=True); os._exit(0)")
    log = tmp_path / "child.log"  # a file, not a pipe: orphans holding a pipe would keep run() waiting
    with open(log, "w") as f:
        subprocess.run([sys.executable, "-c", child, root], stdout=f, stderr=subprocess.STDOUT, timeout=120,
                       env=dict(os.environ, MBMW_TEST_TIER="full"))
    lines = log.read_text().splitlines()
    pids = [int(x) for x in lines[-1].split()] if lines else []
    assert len(pids) == 2, log.read_text()

    def alive(pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split()[2] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(alive(p) for p in pids)
