"""Tensor-parallel sharding of a full (serial) state dict by parameter name, for the GPT and BERT unit lists:
what the checkpoint converters use to write and read per-tp-rank files."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..config import llama_features
from ..errors import UsageError

_SPLIT_ROWS = re.compile(r"(\.qkv\.(weight|bias)|\.fc1\.(weight|bias)|word_embeddings\.weight|head\.output_weight|"
                         r"head\.lm_bias)$")
_SPLIT_COLS = re.compile(r"\.(proj|fc2)\.weight$")


def partition_dim(name: str) -> int | None:
    """The dim along which the parameter `name` is split over tp ranks (None: replicated)."""
    if _SPLIT_ROWS.search(name):
        return 0
    if _SPLIT_COLS.search(name):
        return 1
    return None


def shard_state_dict(full_sd: Mapping[str, torch.Tensor], tp: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """The state dict of tp rank `tp_rank`: split parameters keep chunk `tp_rank` of `tp` (own storage)."""
    if tp < 1 or not 0 <= tp_rank < tp:
        raise UsageError(f"--tensor-model-parallel-size {tp}: invalid tp rank {tp_rank}")
    out: dict[str, torch.Tensor] = {}
    for name, t in full_sd.items():
        dim = partition_dim(name)
        if dim is None or tp == 1:
            out[name] = t.contiguous().clone()
            continue
        if t.size(dim) % tp:
            raise UsageError(f"--tensor-model-parallel-size {tp} does not divide dim {dim} of {name} {tuple(t.shape)}")
        out[name] = t.chunk(tp, dim)[tp_rank].contiguous().clone()  # clone: torch.save would keep the full storage
    return out


def merge_shards(shards: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of `shard_state_dict`: concatenate split parameters in tp-rank order; replicated ones from rank 0."""
    if not shards:
        raise UsageError("no tensor-parallel shards to merge")
    names = list(shards[0])
    for r, sd in enumerate(shards[1:], 1):
        if set(sd) != set(names):
            diff = sorted(set(sd) ^ set(names))
            raise UsageError(f"tp rank {r} holds different parameters than rank 0: {diff[:3]}")
    full: dict[str, torch.Tensor] = {}
    for name in names:
        dim = partition_dim(name)
        if dim is None or len(shards) == 1:
            full[name] = shards[0][name]
        else:
            full[name] = torch.cat([sd[name] for sd in shards], dim=dim)
    return full


def refuse_llama(values: Mapping, where: str) -> None:
    """The converters map GPT-2-style layers only: a checkpoint of Llama-family layers is one line."""
    found = llama_features(values)
    if found:
        raise UsageError(f"{where}: a model with {', '.join(found)}; the converters take GPT-2-style layers only "
                         "(Llama-family conversion is not built yet)")
