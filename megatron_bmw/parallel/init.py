"""Deterministic, layout-independent parameter initialisation.

Every parameter is drawn in full from a generator seeded by (seed, parameter name); a tensor-parallel rank then
keeps its shard. The same seed therefore gives the same full weights for any tp, pp or dp.
"""

from __future__ import annotations

import math
import zlib

import torch


class ParamInit:
    def __init__(self, seed: int, std: float, num_layers: int) -> None:
        self.seed = seed
        self.std = std
        self.output_std = std / math.sqrt(2.0 * num_layers)  # Megatron's scaled init for output projections

    def _generator(self, name: str) -> torch.Generator:
        g = torch.Generator()
        g.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
        return g

    def normal(self, name: str, shape: tuple[int, ...], std: float | None = None) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        return t.normal_(0.0, self.std if std is None else std, generator=self._generator(name))

    @staticmethod
    def zeros(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.float32)

    @staticmethod
    def ones(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.ones(shape, dtype=torch.float32)


def shard(full: torch.Tensor, dim: int | None, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    """This rank's part of `full` along `dim`. With stride k the tensor is k blocks along dim (SwiGLU's fc1:
    [gate; up]), each split over the ranks, and a rank holds its part of every block, in order."""
    if dim is None or size == 1:
        return full
    if stride > 1:
        return torch.cat([b.chunk(size, dim=dim)[rank] for b in full.chunk(stride, dim=dim)], dim=dim).contiguous()
    return full.chunk(size, dim=dim)[rank].contiguous()
