"""Rotary position embeddings (RoPE) as Megatron applies them: the first `rotary_dim` dimensions of every query
and key head rotated by position (the two halves of that part as the pair, not interleaved), the rest passed
through; positions divided by the interpolation factor when one is given."""

from __future__ import annotations

import torch


def rotary_angles(seq_length: int, rotary_dim: int, base: float, factor: float | None,
                  device: torch.device, positions: torch.Tensor | None = None) -> torch.Tensor:
    """[seq, rotary_dim] angles, the frequencies repeated over the two halves; at `positions` ([seq] global
    positions: a context-parallel rank's chunks) where given, else at 0 .. seq-1."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    if positions is None:
        positions = torch.arange(seq_length, dtype=torch.float32, device=device)
    positions = positions.to(device=device, dtype=torch.float32)
    if factor is not None:
        positions = positions / factor
    angles = torch.outer(positions, inv_freq)
    return torch.cat((angles, angles), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, seq, head_dim]; angles: [seq, rotary_dim]."""
    rot = angles.size(-1)
    head, rest = x[..., :rot], x[..., rot:]
    cos, sin = angles.cos(), angles.sin()
    turned = (head.float() * cos + _rotate_half(head.float()) * sin).to(x.dtype)
    return torch.cat((turned, rest), dim=-1) if rest.size(-1) else turned
