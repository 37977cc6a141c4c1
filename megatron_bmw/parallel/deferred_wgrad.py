"""Weight gradients of the linear layers, optionally deferred (zero-bubble pipelining's B/W split).

Every linear layer of the model (column- and row-parallel, the vocab-parallel output layer) runs through
`linear`. Its backward returns the input gradient right away; inside `deferring(key)` it does not compute the
weight gradient but stashes (input, output gradient) under `key`, and `run_deferred(key)` later computes those
gradients and accumulates them through autograd, so `main_grad` hooks (parallel/grad_sync.py) fire as usual.
A weight with a `main_grad_sink` (gradient-accumulation fusion, wgrad_accum.py) skips autograd: its gradient,
deferred or not, goes into `main_grad` in one GEMM and the sink tells the gradient sync.
Bias, norm and embedding gradients are not deferred: they stay in the input-gradient pass.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from .mappings import gather_along, reduce_scatter_along
from .wgrad_accum import accumulate_into

# Not thread-local: on CUDA the autograd engine runs backward functions on its own device threads.
_active: list | None = None
_stash: dict[Hashable, list] = {}


@contextmanager
def deferring(key: Hashable) -> Iterator[None]:
    """Backward passes run inside stash their linear layers' weight gradients under `key`."""
    global _active
    if key in _stash:
        raise RuntimeError(f"weight gradients of {key} are already deferred and not yet run")
    previous, _active = _active, _stash.setdefault(key, [])
    try:
        yield
    finally:
        _active = previous


def pending() -> list[Hashable]:
    """Keys whose weight gradients are still deferred."""
    return list(_stash)


def stashed(key: Hashable) -> list[torch.Tensor]:
    """The tensors kept for `key`'s weight gradients: every deferred layer's input and output gradient."""
    return [t for x, g, _, _ in _stash.get(key, ()) for t in (x, g)]


def run_deferred(key: Hashable) -> None:
    """Compute and accumulate the weight gradients stashed under `key` (in the order they were stashed)."""
    items = _stash.pop(key, None)
    if items is None:
        raise RuntimeError(f"no deferred weight gradients for {key}")
    weights, grads = [], []
    for x, g, weight, group in items:
        total = gather_along(x, 0, group) if group is not None else x
        if accumulate_into(weight, g, total):
            continue
        grads.append(_weight_grad(g, total))
        weights.append(weight.view_as(weight))  # a node whose backward reaches the weight's AccumulateGrad
    if weights:
        torch.autograd.backward(weights, grads)


def discard() -> None:
    """Drop every stashed weight gradient (an iteration that failed midway)."""
    _stash.clear()


def _weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return g.reshape(-1, g.size(-1)).t().matmul(x.reshape(-1, x.size(-1)))


class _Linear(torch.autograd.Function):
    """Y = X A^T + b; with `group`, X is first all-gathered over the sequence (saving only this rank's part) and
    X's gradient reduce-scattered back (Megatron's sequence-parallel linear)."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias, ctx.shape = group, bias is not None, x.shape
        # The Parameter itself, for a deferred gradient: under activation recomputation saved_tensors gives back
        # a recomputed alias, through which the gradient need not reach the Parameter (it did not, with dropout).
        ctx.param = weight
        if group is not None:
            ctx.save_for_backward(x, weight)
            return F.linear(gather_along(x, 0, group), weight, bias)
        flat = x.reshape(-1, x.size(-1))  # a copy when x is not viewable so, as F.linear's matmul saves it
        ctx.save_for_backward(flat, weight)
        return F.linear(flat, weight, bias).view(*x.shape[:-1], weight.size(0))

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        if ctx.group is not None:
            grad_x = reduce_scatter_along(g.matmul(weight), 0, ctx.group)
        else:
            grad_x = g.matmul(weight).view(ctx.shape)
        grad_b = g.reshape(-1, g.size(-1)).sum(0) if ctx.has_bias else None
        if not ctx.needs_input_grad[1]:
            return grad_x, None, grad_b, None
        if _active is not None:
            _active.append((x, g, ctx.param, ctx.group))
            return grad_x, None, grad_b, None
        total = gather_along(x, 0, ctx.group) if ctx.group is not None else x
        if accumulate_into(ctx.param, g, total):
            return grad_x, None, grad_b, None
        return grad_x, _weight_grad(g, total), grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gather_group=None) -> torch.Tensor:
    """F.linear whose weight gradient may be deferred; `gather_group` all-gathers x over the sequence first."""
    return _Linear.apply(x, weight, bias, gather_group)
