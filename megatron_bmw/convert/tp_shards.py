"""Tensor-parallel sharding of a full (serial) state dict by parameter name, for the GPT and BERT unit lists:
what the checkpoint converters use to write and read per-tp-rank files.

Llama-family layers shard by the same names: grouped QKV rows are laid out group by group, so contiguous chunks
hold whole groups; SwiGLU's fc1 [gate; up] has stride 2 (`swiglu=True`): a rank holds [gate_r; up_r], as
parallel/layers.py builds it.

An MoE unit's stacked experts (docs/moe.md) split over the expert-tensor-parallel ranks along their own dims
(`experts.fc1` [E, rows, h] on dim 1, with SwiGLU's stride 2; `experts.fc2.weight` [E, h, F] on dim 2), here with
etp = tp; their expert-parallel split (dim 0) is `split_experts` / `join_experts`. The router and the shared
experts' gate are replicated, the shared experts split as the dense MLP."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..config import llama_features
from ..errors import UsageError

_SPLIT_ROWS = re.compile(r"(\.qkv\.(weight|bias)|\.fc1\.(weight|bias)|word_embeddings\.weight|head\.output_weight|"
                         r"head\.lm_bias)$")
_SPLIT_COLS = re.compile(r"\.(proj|fc2)\.weight$")
_FC1 = re.compile(r"\.fc1\.(weight|bias)$")
_EXPERTS = re.compile(r"\.experts\.(fc1|fc2)\.(weight|bias)$")
_EXPERT_TP_DIM = {("fc1", "weight"): 1, ("fc1", "bias"): 1, ("fc2", "weight"): 2, ("fc2", "bias"): None}


def is_expert(name: str) -> bool:
    """Whether `name` is an MoE unit's stacked expert tensor (dim 0: the experts, split over ep ranks)."""
    return _EXPERTS.search(name) is not None


def partition_dim(name: str) -> int | None:
    """The dim along which the parameter `name` is split over tp ranks (None: replicated); for the stacked
    experts, over the expert-tensor-parallel ranks."""
    m = _EXPERTS.search(name)
    if m:
        return _EXPERT_TP_DIM[m.group(1), m.group(2)]
    if _SPLIT_ROWS.search(name):
        return 0
    if _SPLIT_COLS.search(name):
        return 1
    return None


def partition_stride(name: str, swiglu: bool = False) -> int:
    """Blocks along the split dim that are each divided over the tp ranks: 2 for SwiGLU's fc1, else 1."""
    return 2 if swiglu and _FC1.search(name) else 1


def _chunks(t: torch.Tensor, tp: int, dim: int, stride: int) -> list[torch.Tensor]:
    """The tp shards of `t` along `dim` (with `stride` blocks, each rank a part of every block)."""
    if stride == 1:
        return list(t.chunk(tp, dim))
    blocks = [b.chunk(tp, dim) for b in t.chunk(stride, dim)]
    return [torch.cat([b[r] for b in blocks], dim) for r in range(tp)]


def shard_state_dict(full_sd: Mapping[str, torch.Tensor], tp: int, tp_rank: int,
                     swiglu: bool = False) -> dict[str, torch.Tensor]:
    """The state dict of tp rank `tp_rank`: split parameters keep chunk `tp_rank` of `tp` (own storage); with
    `swiglu`, fc1 keeps its part of the gate and of the up projection."""
    if tp < 1 or not 0 <= tp_rank < tp:
        raise UsageError(f"--tensor-model-parallel-size {tp}: invalid tp rank {tp_rank}")
    out: dict[str, torch.Tensor] = {}
    for name, t in full_sd.items():
        dim = partition_dim(name)
        if dim is None or tp == 1:
            out[name] = t.contiguous().clone()
            continue
        stride = partition_stride(name, swiglu)
        if t.size(dim) % (tp * stride):
            raise UsageError(f"--tensor-model-parallel-size {tp} does not divide dim {dim} of {name} {tuple(t.shape)}")
        out[name] = _chunks(t, tp, dim, stride)[tp_rank].contiguous().clone()  # clone: torch.save keeps the storage
    return out


def merge_shards(shards: list[Mapping[str, torch.Tensor]], swiglu: bool = False) -> dict[str, torch.Tensor]:
    """Inverse of `shard_state_dict`: concatenate split parameters in tp-rank order (with `swiglu`, fc1's gate
    parts, then its up parts); replicated ones from rank 0."""
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
        elif partition_stride(name, swiglu) == 1:
            full[name] = torch.cat([sd[name] for sd in shards], dim=dim)
        else:
            halves = [sd[name].chunk(2, dim) for sd in shards]
            full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
    return full


def split_experts(sd: Mapping[str, torch.Tensor], ep: int, ep_rank: int) -> dict[str, torch.Tensor]:
    """The state dict of expert-parallel rank `ep_rank` of `ep`: each stacked expert tensor keeps its experts
    ep_rank * E/ep ... (ep_rank + 1) * E/ep - 1 (own storage); every other tensor is the same on all ep ranks."""
    if ep < 1 or not 0 <= ep_rank < ep:
        raise UsageError(f"--expert-model-parallel-size {ep}: invalid ep rank {ep_rank}")
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if ep == 1 or not is_expert(name):
            out[name] = t
            continue
        if t.size(0) % ep:
            raise UsageError(f"--expert-model-parallel-size {ep} does not divide the {t.size(0)} experts of {name}")
        out[name] = t.chunk(ep, 0)[ep_rank].clone()
    return out


def join_experts(per_ep: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Inverse of `split_experts`: the stacked expert tensors concatenated in ep-rank order, the rest from rank 0
    (checked to hold the same names)."""
    if not per_ep:
        raise UsageError("no expert-parallel shards to join")
    names = list(per_ep[0])
    for r, sd in enumerate(per_ep[1:], 1):
        if set(sd) != set(names):
            diff = sorted(set(sd) ^ set(names))
            raise UsageError(f"ep rank {r} holds different parameters than ep rank 0: {diff[:3]}")
    return {name: torch.cat([sd[name] for sd in per_ep]) if is_expert(name) and len(per_ep) > 1
            else per_ep[0][name] for name in names}


def refuse_llama(values: Mapping, where: str, instead: str = "tools/checkpoint/convert_hf_llama.py") -> None:
    """A converter of GPT-2-style layers refuses a checkpoint of Llama-family layers in one line."""
    found = llama_features(values)
    if found:
        raise UsageError(f"{where}: a model with {', '.join(found)}; this converter takes GPT-2-style layers only "
                         f"(Llama-family models: {instead})")
