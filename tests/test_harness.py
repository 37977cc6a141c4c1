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


def test_pool_reused_and_collectives_work():
    for ws in (1, 2):
        out = run_distributed(ws, _allreduce, 1)
        assert out == [float(sum(range(ws)) + ws)] * ws


def test_failure_reports_rank():
    import pytest

    with pytest.raises(AssertionError, match="rank 1"):
        run_distributed(2, _fail)
    assert run_distributed(2, _allreduce, 0) == [1.0, 1.0]
