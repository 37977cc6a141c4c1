"""Autograd-aware collectives for tensor and sequence parallelism.

Each mapping is a pair (forward op, backward op) over the tensor-parallel group; a group of size 1 (or None)
makes all of them the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import group_rank, group_size


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = group_size(group)
    if n == 1:
        return x
    if x.size(dim) % n:
        raise ValueError(f"dimension {dim} of size {x.size(dim)} is not divisible by the tensor-parallel size {n}")
    return owned(x.chunk(n, dim=dim)[group_rank(group)].contiguous())  # not a view keeping the whole of `x`


def gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather `x` over `group` along `dim` (not autograd-aware)."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `x` over `group` and keep this rank's part along `dim` (not autograd-aware)."""
    n = group_size(group)
    if n == 1:
        return x
    if dist.get_backend(group) == "nccl" and dim == 0:
        out = torch.empty((x.size(0) // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out
    return _split(_all_reduce(x, group), dim, group)  # gloo has no reduce-scatter


def owned(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied where it is a view into a larger buffer (a part of an all-reduced sum, padded rows), so that
    whatever keeps it keeps only its own bytes."""
    return t.clone() if t.untyped_storage().nbytes() > t.nbytes else t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, g):
        return _split(g, -1, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, g):
        return gather_along(g, 0, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    """All-gather along the sequence; backward reduce-scatters (the consumer is tensor-parallel) or splits."""

    @staticmethod
    def forward(ctx, x, group, tp_output_grad):
        ctx.group, ctx.tp_output_grad = group, tp_output_grad
        return gather_along(x, 0, group)

    @staticmethod
    def backward(ctx, g):
        if ctx.tp_output_grad:
            return reduce_scatter_along(g, 0, ctx.group), None, None
        return _split(g, 0, ctx.group), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_along(x, 0, group)

    @staticmethod
    def backward(ctx, g):
        return gather_along(g, 0, ctx.group), None


class _Adjoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, there, back, operands):
        ctx.back, ctx.operands = back, operands
        return there(x, *operands)

    @staticmethod
    def backward(ctx, g):
        return ctx.back(g, *ctx.operands), None, None, None


def with_adjoint(x: torch.Tensor, there, back, *operands) -> torch.Tensor:
    """there(x, *operands), whose gradient is back(g, *operands): a linear exchange and its adjoint (an all-to-all and its
    reverse, a gather and its reduce-scatter)."""
    return _Adjoint.apply(x, there, back, operands)


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x, group):
    return _GatherFromTP.apply(x, group)


def scatter_to_sp(x, group):
    return _ScatterToSP.apply(x, group)


def gather_from_sp(x, group, tp_output_grad: bool = True):
    return _GatherFromSP.apply(x, group, tp_output_grad)


def reduce_scatter_to_sp(x, group):
    return _ReduceScatterToSP.apply(x, group)
