"""Optional accelerators, detected at import. Without them everything runs on plain PyTorch."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

try:  # apex is optional
    from apex.normalization import FusedLayerNorm as _ApexLayerNorm  # type: ignore

    HAVE_APEX = True
except Exception:  # noqa: BLE001 - any import failure means "not available"
    _ApexLayerNorm = None
    HAVE_APEX = False

try:  # transformer-engine is optional; detected for reporting, its kernels are not wired in yet
    import transformer_engine  # type: ignore  # noqa: F401

    HAVE_TE = True
except Exception:  # noqa: BLE001
    HAVE_TE = False


def layer_norm(hidden: int, eps: float, device: torch.device, dtype: torch.dtype) -> nn.Module:
    if HAVE_APEX and device.type == "cuda":
        return _ApexLayerNorm(hidden, eps=eps).to(device=device, dtype=dtype)
    return nn.LayerNorm(hidden, eps=eps, device=device, dtype=dtype)


def flash_attention_available() -> bool:
    return hasattr(torch.nn.functional, "scaled_dot_product_attention")


@functools.cache
def _triton_available() -> bool:
    try:
        import triton  # type: ignore  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


class CudaCompiled:
    """A pointwise function run through torch.compile (inductor: one generated kernel) when its first tensor is on
    CUDA and triton is importable, eagerly otherwise (the CPU, or no compiler). A compile that fails is reported
    once and the eager function runs from then on, so a missing or broken compiler never fails a run."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self._compiled = None
        self._broken = False
        self.__name__ = getattr(fn, "__name__", "fused")

    def compiles(self, first: torch.Tensor) -> bool:
        return first.device.type == "cuda" and not self._broken and _triton_available()

    def __call__(self, first: torch.Tensor, *rest):
        if not self.compiles(first):
            return self.fn(first, *rest)
        if self._compiled is None:
            self._compiled = torch.compile(self.fn, dynamic=False, fullgraph=True)
        try:
            return self._compiled(first, *rest)
        except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the same eager function
            self._broken = True
            print(f"[megatron_bmw] torch.compile of {self.__name__} failed ({type(err).__name__}: "
                  f"{str(err).splitlines()[0] if str(err) else ''}); running it eagerly", flush=True)
            return self.fn(first, *rest)


def cuda_compiled(fn) -> CudaCompiled:
    """Decorator form of CudaCompiled."""
    return CudaCompiled(fn)


def sdpa_backends(cudnn_first: bool):
    """A context that makes scaled_dot_product_attention try cuDNN's fused kernel first (then flash, memory
    efficient, math: whichever runs the inputs), or a no-op context. Where cuDNN's kernel does not run (the CPU,
    an older GPU, an unsupported shape) torch takes the next in the list."""
    if not cudnn_first:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)
