"""Weight gradients added straight into the fp32 `main_grad` (Megatron's --gradient-accumulation-fusion).

Unfused, a linear layer's weight gradient is written in the parameter's dtype, autograd hands it to
`AccumulateGrad`, and GradSync's hook adds it into `main_grad` (read e, read and write 4 bytes per parameter per
micro-batch). Fused, the backward computes `main_grad += g^T x` in one GEMM with fp32 accumulation and tells the
gradient sync through the parameter's `main_grad_sink`; no `.grad` is made.

Kernels, best first: fp32 parameters use `addmm_` on `main_grad` itself; 16-bit ones use apex's
`fused_weight_gradient_mlp_cuda` when importable, else `torch.addmm(..., out_dtype=torch.float32)` where this
torch has it for the device (checked once against the unfused sum), else the unfused GEMM and add, inside the
backward. Only parameters marked `wgrad_fusable` (used by exactly one linear layer per backward, so no other
gradient of theirs goes through autograd) take part.
"""

from __future__ import annotations

import weakref

import torch

try:
    import fused_weight_gradient_mlp_cuda as _apex_wgrad  # apex's Megatron kernel
except ImportError:  # pragma: no cover - apex is an optional accelerator
    _apex_wgrad = None

_out_dtype_ok: dict[tuple[str, torch.dtype], bool] = {}


def kernel(dtype: torch.dtype, device: torch.device) -> str:
    """Which accumulation runs for weights of `dtype` on `device`: addmm, apex, addmm_out_dtype or unfused."""
    if dtype == torch.float32:
        return "addmm"
    if device.type == "cuda" and _apex_wgrad is not None and dtype in (torch.float16, torch.bfloat16):
        return "apex"
    return "addmm_out_dtype" if _has_out_dtype(dtype, device) else "unfused"


def _has_out_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    key = (device.type, dtype)
    if key not in _out_dtype_ok:
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            a = torch.randn(32, 16, device=device, generator=gen).to(dtype)
            b = torch.randn(16, 8, device=device, generator=gen).to(dtype)
            acc = torch.ones(32, 8, device=device)
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            want = 1 + a.float() @ b.float()
            _out_dtype_ok[key] = bool(torch.allclose(acc, want, rtol=1e-2, atol=1e-2))
        except Exception:  # noqa: BLE001 - whatever this torch says, the unfused add stays right
            _out_dtype_ok[key] = False
    return _out_dtype_ok[key]


@torch.no_grad()
def accumulate(main_grad: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> None:
    """main_grad [out, in] += g^T x for g [..., out] and x [..., in] (no graph: a deferred W runs with grad on)."""
    g2, x2 = g.reshape(-1, g.size(-1)), x.reshape(-1, x.size(-1))
    how = kernel(g.dtype, g.device)
    if how == "addmm":
        main_grad.addmm_(g2.t(), x2)
    elif how == "apex":  # pragma: no cover - needs apex on CUDA
        _apex_wgrad.wgrad_gemm_accum_fp32(x2.contiguous(), g2.contiguous(), main_grad)
    elif how == "addmm_out_dtype":
        torch.addmm(main_grad, g2.t(), x2, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.add_(g2.t().matmul(x2))


def set_sinks(owner, params: list, method: str | None) -> None:
    """Give each `wgrad_fusable` parameter a sink calling `owner.<method>(p)` (through a weak reference) once its
    weight gradient is in `main_grad`; `method` None takes the sinks away (unfused: autograd and hooks)."""
    ref = weakref.ref(owner)

    def sink(p: torch.Tensor) -> None:
        live = ref()
        if live is not None:
            getattr(live, method)(p)

    for p in params:
        if method is not None and getattr(p, "wgrad_fusable", False):
            p.main_grad_sink = sink
        elif hasattr(p, "main_grad_sink"):
            del p.main_grad_sink


def accumulate_into(weight: torch.Tensor, g: torch.Tensor, x: torch.Tensor) -> bool:
    """Add g^T x into `weight.main_grad` and tell its sink, where it has one; False: autograd's path is its."""
    sink = getattr(weight, "main_grad_sink", None)
    if sink is None:
        return False
    accumulate(weight.main_grad, g, x)
    sink(weight)
    return True
