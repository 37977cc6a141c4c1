"""relayout: every pair of 4-rank strategies moves the hidden state's rows and its gradient as the serial
tensor says (gradients of replicated shards whole and equal on their tp ranks)."""

import pytest
import torch

from megatron_bmw.parallel.relayout import local_slice, relayout, same_rows
from megatron_bmw.strategy import parse_strategy, stage_strategies
from tests.dist_harness import run_distributed


def _all_pairs(rank, world_size):
    strategies = stage_strategies(world_size)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(3, 8, 5, generator=g)  # [s, b, h], b = 8 rows
    weight = torch.randn(3, 8, 5, generator=g)  # d loss / d full
    kinds = set()
    for src in strategies:
        for dst in strategies:
            a0, a1 = src.samples(rank, 8)
            b0, b1 = dst.samples(rank, 8)
            x = full[:, a0:a1].clone().requires_grad_()
            y = relayout(x, src, dst, rank, None)
            torch.testing.assert_close(y, full[:, b0:b1], rtol=0, atol=0)
            y.backward(weight[:, b0:b1])
            torch.testing.assert_close(x.grad, weight[:, a0:a1], rtol=0, atol=0)
            kinds.add("same" if same_rows(src, dst) else "slice" if local_slice(src, dst) else "gather")
    return sorted(kinds)


@pytest.mark.slow
def test_relayout_all_pairs_on_four_ranks():
    assert run_distributed(4, _all_pairs) == [["gather", "same", "slice"]] * 4


def test_decisions():
    s = parse_strategy
    assert same_rows(s("tp2-dp2"), s("tp2-sdp2"))
    assert not same_rows(s("tp2-dp2"), s("dp2-tp2"))  # same dp degree, other ranks per shard
    assert local_slice(s("tp4"), s("dp4")) and local_slice(s("tp2-dp2"), s("dp4"))
    assert not local_slice(s("dp2-tp2"), s("dp4"))  # position 1 holds rows 4..7 but needs rows 2..3
    assert not local_slice(s("dp4"), s("tp4"))
