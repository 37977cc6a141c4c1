"""Which rank's copy of a parameter a world-wide sum (a norm) counts over tp."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: arguments.py reaches this module (expert_params) and stays torch-free
    import torch


def counted_once(param: torch.Tensor, tp_rank: int) -> bool:
    """Whether this rank's copy of `param` is the one counted in world-wide norms over tp: never the tied output
    copy of the embedding, always a tensor-parallel shard, a tp-replicated parameter on tp rank 0."""
    if getattr(param, "shared_embedding_copy", False):
        return False
    return getattr(param, "tensor_model_parallel", False) or tp_rank == 0
