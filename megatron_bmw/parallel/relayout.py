"""Re-layout of the hidden state [s, b, h] between units of different hybrid strategies.

Under a strategy (tp t, dp d) the rank at stage position `local` holds the batch rows of its dp shard
(strategy.samples), replicated over its tp group. Moving to another strategy either keeps a sub-range of the rows
held already (a local slice), or gathers every rank's shard over the stage and takes the new rows.

Gradients of a tensor replicated over a tp group are whole and equal on its ranks (Megatron's tp regions make them
so), so the backward of a move a -> b is the move b -> a of the gradient: a slice's backward gathers the other
rows' gradients, a gather's backward takes this rank's rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..strategy import UnitStrategy, local_slice  # noqa: F401 - local_slice is part of this module's API

BATCH_DIM = 1


def move(x: torch.Tensor, src: UnitStrategy, dst: UnitStrategy, local: int, stage_group) -> torch.Tensor:
    """Rows of `x` (this rank's shard under `src`) -> this rank's shard under `dst`; no autograd."""
    b = x.size(BATCH_DIM) * src.dp  # the stage micro-batch
    s0, s1 = src.samples(local, b)
    d0, d1 = dst.samples(local, b)
    if local_slice(src, dst):
        return x.narrow(BATCH_DIM, d0 - s0, d1 - d0).contiguous()
    width = src.width
    parts = [torch.empty_like(x) for _ in range(width)]
    dist.all_gather(parts, x.contiguous(), group=stage_group)
    owner = {}  # dp shard index -> a stage position holding it
    for pos in range(width):
        owner.setdefault(src.coords(pos)[1], pos)
    full = torch.cat([parts[owner[j]] for j in range(src.dp)], BATCH_DIM)
    return full.narrow(BATCH_DIM, d0, d1 - d0).contiguous()


def same_rows(src: UnitStrategy, dst: UnitStrategy) -> bool:
    return src.dp == dst.dp and all(src.coords(p)[1] == dst.coords(p)[1] for p in range(src.width))


class _Relayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, src, dst, local, group):
        ctx.args = (src, dst, local, group)
        return move(x, src, dst, local, group)

    @staticmethod
    def backward(ctx, g):
        src, dst, local, group = ctx.args
        return move(g, dst, src, local, group), None, None, None, None


def relayout(x: torch.Tensor, src: UnitStrategy, dst: UnitStrategy, local: int, stage_group) -> torch.Tensor:
    """The hidden state of this rank under `src` as it is under `dst` (identity when they hold the same rows)."""
    if same_rows(src, dst):
        return x
    return _Relayout.apply(x, src, dst, local, stage_group)
