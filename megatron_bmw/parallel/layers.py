"""Tensor-parallel layers. Each takes the full initial weight and keeps this rank's shard.

Parameter attributes read by gradient sync, the optimizer and checkpoint tools:
  tensor_model_parallel (bool) and partition_dim: the parameter is a shard along that dim; partition_stride
    (SwiGLU's fc1): the full tensor is that many blocks along the dim, and the shard a part of each;
  sequence_parallel (bool): replicated, but its gradient is partial per sequence shard (all-reduced over tp);
  wgrad_fusable (bool): only a linear layer uses it, so its weight gradient may go straight into main_grad.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .init import shard
from .deferred_wgrad import linear
from .mappings import copy_to_tp, gather_from_tp, reduce_from_tp, reduce_scatter_to_sp
from .view import ParallelView


def _param(full: torch.Tensor, state: ParallelView, dim: int | None, dtype: torch.dtype,
           stride: int = 1) -> nn.Parameter:
    p = nn.Parameter(shard(full, dim, state.tp_rank, state.tp_size, stride).to(device=state.device, dtype=dtype))
    p.tensor_model_parallel = dim is not None and state.tp_size > 1
    p.partition_dim = dim
    if stride > 1:
        p.partition_stride = stride
    return p


def sequence_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             state: ParallelView) -> torch.Tensor:
    """Linear on the tensor-parallel input: all-gathered over the sequence with SP (saving only this rank's part;
    the backward gathers it again), else copied to tp. Its weight gradient may be deferred (deferred_wgrad)."""
    if state.sequence_parallel and state.tp_size > 1:
        return linear(x, weight, bias, state.tp_group)
    return linear(copy_to_tp(x, state.tp_group), weight, bias)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by rows (output features). Output stays split unless gather_output."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, state: ParallelView,
                 gather_output: bool = False, dtype: torch.dtype = torch.float32, stride: int = 1) -> None:
        """stride: the output rows are `stride` blocks each split over tp (SwiGLU's [gate; up])."""
        super().__init__()
        self.state = state
        self.gather_output = gather_output
        self.weight = _param(weight, state, 0, dtype, stride)
        self.weight.wgrad_fusable = True
        self.bias = _param(bias, state, 0, dtype, stride) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = sequence_parallel_linear(x, self.weight, self.bias, self.state)
        return gather_from_tp(y, self.state.tp_group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by columns (input features); the input arrives split."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, state: ParallelView,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.state = state
        self.weight = _param(weight, state, 1, dtype)
        self.weight.wgrad_fusable = True
        self.bias = _param(bias, state, None, dtype) if bias is not None else None
        if self.bias is not None:
            self.bias.sequence_parallel = state.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, None)
        group = self.state.tp_group
        y = reduce_scatter_to_sp(y, group) if self.state.sequence_parallel else reduce_from_tp(y, group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; ids outside this rank's range contribute zeros."""

    def __init__(self, weight: torch.Tensor, state: ParallelView, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.state = state
        self.weight = _param(weight, state, 0, dtype)
        self.vocab_start = state.tp_rank * self.weight.size(0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.state.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.size(0))
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.state.tp_group)


def parallel_lm_logits(hidden: torch.Tensor, weight: torch.Tensor, state: ParallelView) -> torch.Tensor:
    """Logits split over the vocabulary: [s, b, h] x [v/t, h] -> [s, b, v/t]."""
    return sequence_parallel_linear(hidden, weight, None, state)
