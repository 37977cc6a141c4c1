"""Optional accelerators, detected at import. Without them everything runs on plain PyTorch."""

from __future__ import annotations

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
