"""An MoE layer's experts as stacked weights, run as one grouped GEMM, and its shared experts.

`experts.fc1.weight` [E/ep, rows/etp, h] and `experts.fc2.weight` [E/ep, h, F/etp] (rows = 2F with SwiGLU, whose
[gate; up] are each split over etp: stride 2) are this rank's box of the serial [E, rows, h] and [E, h, F]
(docs/moe.md). The experts run on rows sorted by local expert as `torch._grouped_mm` where this torch has it for
the device and dtype (probed once) and the sizes are 16-byte aligned, else as a loop of GEMMs: one code path.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..parallel.init import ParamInit, shard
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear
from ..parallel.view import ParallelView
from .gpt import mlp_activation

_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


class _Contiguous(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (the grouped GEMM's backward needs one)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _grouped(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _Contiguous.apply(torch._grouped_mm(x, w, offs=offsets))


def _offsets(counts: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The grouped GEMM's end row of each group (int32)."""
    return torch.cumsum(counts, 0).to(device=device, dtype=torch.int32)


def _grouped_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs forward and backward here (a tiny probe, once per device type and dtype, out
    of sight of any saved-tensor hooks around the caller: what it saves is not the model's)."""
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                # identity hooks: a caller's saved-tensor hooks (the profiler's saved bytes) never see the probe
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                    x = torch.ones((4, 16), device=device, dtype=dtype, requires_grad=True)
                    w = torch.ones((2, 16, 16), device=device, dtype=dtype, requires_grad=True)
                    _grouped(x, w, _offsets(torch.tensor([1, 3]), device)).sum().backward()
            except (RuntimeError, NotImplementedError):
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor,
               offsets: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of `x` [N, k] sorted by group (counts[g] rows for group g) times that group's w[g] [k, n]: [N, n].
    `offsets`: `_offsets(counts)` if the caller has them (a grouped GEMM keeps them for backward: one tensor for
    both of an expert's GEMMs)."""
    if uses_grouped(x.size(0), x.size(-1), w.size(-1), x.device, x.dtype):
        return _grouped(x.contiguous(), w, _offsets(counts, x.device) if offsets is None else offsets)
    parts = x.split(counts.tolist())
    return torch.cat([p @ w[g] for g, p in enumerate(parts)]) if parts else x.new_zeros((0, w.size(-1)))


def uses_grouped(rows: int, k: int, n: int, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `grouped_mm` of [rows, k] by [groups, k, n] runs as torch._grouped_mm (16-byte aligned sizes, rows
    to multiply, the probe passed) rather than as a loop."""
    return all(d * dtype.itemsize % 16 == 0 for d in (k, n)) and rows > 0 and _grouped_available(device, dtype)


class _Stacked(nn.Module):
    """One stacked projection of the experts: `weight` [E/ep, ...] (and `bias`), expert parameters."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, state: ParallelView, dtype: torch.dtype,
                 dim: int | None, bias_dim: int | None, stride: int = 1) -> None:
        super().__init__()
        self.weight = _expert_param(weight, state, dtype, dim, stride)
        self.bias = _expert_param(bias, state, dtype, bias_dim, stride) if bias is not None else None


def _expert_param(full: torch.Tensor, state: ParallelView, dtype: torch.dtype, dim: int | None,
                  stride: int) -> nn.Parameter:
    """This rank's box of a serial expert tensor: dim 0 over ep, `dim` over etp (docs/moe.md's attributes)."""
    mine = full.chunk(state.ep_size, dim=0)[state.ep_rank]
    p = nn.Parameter(shard(mine, dim, state.etp_rank, state.etp_size, stride).to(device=state.device, dtype=dtype))
    p.expert_parallel, p.expert_dim = True, 0
    p.tensor_model_parallel = dim is not None and state.etp_size > 1
    p.partition_dim = dim
    if stride > 1:
        p.partition_stride = stride
    return p


class Experts(nn.Module):
    """This rank's E/ep experts (its etp shard of each): fc1, the dense MLP's activation, fc2. Called on rows
    sorted by local expert, it returns their outputs, partial over etp (the dispatcher sums them)."""

    def __init__(self, cfg: ModelConfig, state: ParallelView, init: ParamInit, name: str) -> None:
        super().__init__()
        n, h, f = cfg.moe.num_experts, cfg.hidden_size, cfg.moe_ffn_hidden_size
        rows, stride, bias = (2 * f if cfg.swiglu else f), (2 if cfg.swiglu else 1), cfg.add_bias_linear
        self.swiglu, self.squared, self.fused = cfg.swiglu, cfg.squared_relu, cfg.bias_swiglu_fusion
        self.fc1 = _Stacked(init.normal(f"{name}.experts.fc1.weight", (n, rows, h)),
                            init.zeros((n, rows)) if bias else None, state, cfg.torch_dtype, 1, 1, stride)
        self.fc2 = _Stacked(init.normal(f"{name}.experts.fc2.weight", (n, h, f), init.output_std),
                            init.zeros((n, h)) if bias else None, state, cfg.torch_dtype, 2, None)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        expert_of_row = None
        if self.fc1.bias is not None:
            expert_of_row = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts)
        (_, f1, h), f2 = self.fc1.weight.shape, self.fc2.weight.size(2)
        offsets = None
        if any(uses_grouped(rows.size(0), k, n, rows.device, rows.dtype) for k, n in ((h, f1), (f2, h))):
            offsets = _offsets(counts, rows.device)
        # each weight transposed just before its GEMM: its gradient reaches `.grad` (and GradSync's hook, which
        # frees it) as soon as that GEMM's backward is done, not after the other GEMM's
        z = grouped_mm(rows, self.fc1.weight.transpose(1, 2), counts, offsets)
        if expert_of_row is not None:
            z = z + self.fc1.bias[expert_of_row]
        a = mlp_activation(z, self.swiglu, self.squared, self.fused, compiled=False)  # the rows received vary
        y = grouped_mm(a, self.fc2.weight.transpose(1, 2), counts, offsets)
        if expert_of_row is not None:
            y = y + self.fc2.bias[expert_of_row]
        return y


class SharedExpert(nn.Module):
    """The shared experts: a dense MLP of --moe-shared-expert-intermediate-size over tp, as the dense MLP's."""

    def __init__(self, cfg: ModelConfig, state: ParallelView, init: ParamInit, name: str) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.moe.shared_expert_intermediate_size
        rows, bias = (2 * f if cfg.swiglu else f), cfg.add_bias_linear
        self.swiglu, self.squared, self.fused = cfg.swiglu, cfg.squared_relu, cfg.bias_swiglu_fusion
        self.fc1 = ColumnParallelLinear(init.normal(f"{name}.shared_expert.fc1.weight", (rows, h)),
                                        init.zeros((rows,)) if bias else None, state, dtype=cfg.torch_dtype,
                                        stride=2 if cfg.swiglu else 1)
        self.fc2 = RowParallelLinear(init.normal(f"{name}.shared_expert.fc2.weight", (h, f), init.output_std),
                                     init.zeros((h,)) if bias else None, state, dtype=cfg.torch_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(mlp_activation(self.fc1(x), self.swiglu, self.squared, self.fused))
