"""device.batch_p2p: a work per operation, whether the backend returns one per operation (gloo) or coalesces the
batch into one (NCCL)."""

import pytest
import torch
import torch.distributed as dist

from megatron_bmw.device import batch_p2p
from tests.dist_harness import run_distributed


class _Work:
    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1


def test_a_coalesced_batch_gives_every_operation_its_work(monkeypatch):
    coalesced = _Work()
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: [coalesced])
    works = batch_p2p(["send a", "send b", "recv c"])
    assert works == [coalesced] * 3  # the engine waits on each: no None among them
    for w in works:
        w.wait()
    assert coalesced.waits == 3
    per_op = [_Work(), _Work()]
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: per_op)
    assert batch_p2p(["a", "b"]) == per_op
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: per_op)
    with pytest.raises(RuntimeError, match="2 works for 3 operations"):
        batch_p2p(["a", "b", "c"])


def _exchange(rank, world_size):
    peer = 1 - rank
    out = [torch.full((4,), float(10 * rank + k)) for k in range(2)]
    into = [torch.zeros(4) for _ in range(2)]
    ops = [dist.P2POp(dist.isend, t, peer) for t in out] if rank == 0 else \
        [dist.P2POp(dist.irecv, t, peer) for t in into]
    works = batch_p2p(ops)
    assert len(works) == 2
    for w in works:
        w.wait()
    return [t.tolist() for t in into]


@pytest.mark.slow
def test_two_operations_to_one_peer_in_a_batch_on_gloo():
    received = run_distributed(2, _exchange)[1]
    assert received == [[0.0] * 4, [1.0] * 4]
