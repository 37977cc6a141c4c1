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
