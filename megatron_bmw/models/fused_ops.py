"""SwiGLU and rope as fused operators (Megatron's bias_swiglu_fusion and apply_rope_fusion, on unless
--no-bias-swiglu-fusion / --no-rope-fusion): each an autograd Function that saves only what its backward
cannot cheaply rebuild, its forward and backward one pointwise body each (`fused.cuda_compiled`: one inductor
kernel on CUDA, the same body eagerly on the CPU).

  swiglu(z)          z = fc1's output [..., 2f]: [gate; up] (a rank's local halves). Forward silu(gate) * up; saves
                     z only (the unfused ops also keep silu(gate)); backward recomputes s = sigmoid(gate) for
                     dz = [g up s (1 + gate (1 - s)); g silu(gate)]: compiled, one kernel in fp32 math; eagerly, in
                     place in the halves of one new tensor (16-bit: rounded at each step). Either way it holds
                     nothing beside the incoming gradient and dz.
  rope(x, angles)    x [b, heads, s, d], angles [s, r] (models/rotary.py): forward exactly as `apply_rotary` (fp32
                     math for 16-bit inputs, the first r dims rotated as two halves, the rest passed through);
                     saves only the angles (one tensor for q and k; the unfused ops keep cos and sin per call);
                     backward rotates the gradient back (rotate_half's transpose) and passes the rest through.

`fused_bodies()` counts the compiled bodies run (models/op_count.py takes each as one operator, as the GPU runs
it).
cuda_compiled compiles for fixed shapes, so the MoE experts' SwiGLU, over a number of received rows that changes
from step to step, runs its bodies eagerly (`swiglu(z, compiled=False)`: the same saved tensor, several kernels).
The compiled bodies are checked on the CPU only: dynamo traces them whole, and inductor's CPU kernels equal the
eager bodies, with the same output strides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..fused import cuda_compiled

_BODIES = {"depth": 0, "run": 0}  # inside a fused body now; bodies run so far


def fused_bodies() -> tuple[int, int]:
    """(nesting depth inside a fused body now, fused bodies run so far)."""
    return _BODIES["depth"], _BODIES["run"]


def _run(body, *args):
    _BODIES["run"] += 1
    _BODIES["depth"] += 1
    try:
        return body(*args)
    finally:
        _BODIES["depth"] -= 1


@cuda_compiled
def _swiglu_forward(z: torch.Tensor) -> torch.Tensor:
    gate, up = z.chunk(2, dim=-1)
    return F.silu(gate) * up


@cuda_compiled
def _swiglu_backward(g: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():  # inductor: one kernel of plain expressions (fp32 math), no temporaries
        gate, up = z.float().chunk(2, dim=-1)
        s, gf = torch.sigmoid(gate), g.float()
        return torch.cat((gf * up * s * (1 + gate * (1 - s)), gf * gate * s), dim=-1).to(z.dtype)
    # eagerly: in place in dz's halves (dynamo refuses out= views), holding nothing beside g and dz; a 16-bit dz
    # rounds at each step
    gate, up = z.chunk(2, dim=-1)
    dz = torch.empty_like(z, memory_format=torch.contiguous_format)
    dgate, dup = dz.chunk(2, dim=-1)
    torch.sigmoid(gate, out=dgate)  # s
    torch.neg(dgate, out=dup).add_(1).mul_(gate).add_(1)  # 1 + gate (1 - s): silu's derivative over s
    dgate.mul_(dup).mul_(up).mul_(g)
    torch._C._nn.silu(gate, out=dup).mul_(g)
    return dz


class SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z: torch.Tensor, compiled: bool) -> torch.Tensor:
        ctx.save_for_backward(z)
        ctx.compiled = compiled
        return _run(_swiglu_forward, z) if compiled else _swiglu_forward.fn(z)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (z,) = ctx.saved_tensors
        return (_run(_swiglu_backward, g, z) if ctx.compiled else _swiglu_backward.fn(g, z)), None


def swiglu(z: torch.Tensor, compiled: bool = True) -> torch.Tensor:
    """silu(gate) * up of z = [gate; up] (last dimension), saving z only; `compiled` False: the bodies eagerly
    (shapes that change from call to call)."""
    return SwiGLU.apply(z, compiled)


@cuda_compiled
def _rope_forward(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    rot = angles.size(-1)
    head, rest = x[..., :rot], x[..., rot:]
    h = head.float()
    x1, x2 = h.chunk(2, dim=-1)
    turned = (h * angles.cos() + torch.cat((-x2, x1), dim=-1) * angles.sin()).to(x.dtype)
    return torch.cat((turned, rest), dim=-1) if rest.size(-1) else turned


@cuda_compiled
def _rope_backward(g: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    rot = angles.size(-1)
    head, rest = g[..., :rot], g[..., rot:]
    h = head.float()
    y1, y2 = (h * angles.sin()).chunk(2, dim=-1)
    turned = (h * angles.cos() + torch.cat((y2, -y1), dim=-1)).to(g.dtype)  # rotate_half^T (g sin)
    return torch.cat((turned, rest), dim=-1) if rest.size(-1) else turned


class Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(angles)
        return _run(_rope_forward, x, angles)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (angles,) = ctx.saved_tensors
        return _run(_rope_backward, g, angles), None


def rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """`rotary.apply_rotary(x, angles)` saving only `angles` (x: [b, heads, s, d]; angles: [s, r], no gradient)."""
    return Rope.apply(x, angles)
