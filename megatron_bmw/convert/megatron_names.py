"""Megatron-LM's parameter names <-> ours, one model chunk of one tensor-parallel rank at a time.

megatron-core names the layers of each model chunk from 0 (`decoder.layers.N.<module>`), in either layer spec's
names (Transformer Engine's fused norms, or local ones); ours names units globally (`units.attn_i...`,
`units.mlp_i...`). The tensors themselves are the same on both sides (convert/megatron.py). `_extra_state` entries
(None without FP8) are dropped reading and written back for the modules of the spec that carry them. MoE layers'
router, experts and shared experts: convert/megatron_moe.py.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import UsageError
from .gpt2 import POSITION_EMBEDDING
from .megatron_moe import is_ours_moe, moe_layer_to_megatron, moe_layer_to_ours, split_moe_items

MEGATRON_SPECS = ("transformer_engine", "local")
WORD_EMBEDDING = "units.embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "units.head.output_weight"
EXTRA_STATE = "_extra_state"

# (our unit kind, our parameter, Megatron's name under decoder.layers.N with the TE spec, with the local spec)
_LAYER_PARAMS = (
    ("attn", "input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"),
    ("attn", "input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias", "input_layernorm.bias"),
    ("attn", "qkv.weight", "self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight"),
    ("attn", "qkv.bias", "self_attention.linear_qkv.bias", "self_attention.linear_qkv.bias"),
    ("attn", "q_layernorm.weight", "self_attention.q_layernorm.weight", "self_attention.q_layernorm.weight"),
    ("attn", "q_layernorm.bias", "self_attention.q_layernorm.bias", "self_attention.q_layernorm.bias"),
    ("attn", "k_layernorm.weight", "self_attention.k_layernorm.weight", "self_attention.k_layernorm.weight"),
    ("attn", "k_layernorm.bias", "self_attention.k_layernorm.bias", "self_attention.k_layernorm.bias"),
    ("attn", "proj.weight", "self_attention.linear_proj.weight", "self_attention.linear_proj.weight"),
    ("attn", "proj.bias", "self_attention.linear_proj.bias", "self_attention.linear_proj.bias"),
    ("mlp", "post_attention_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
    ("mlp", "post_attention_layernorm.bias", "mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"),
    ("mlp", "fc1.weight", "mlp.linear_fc1.weight", "mlp.linear_fc1.weight"),
    ("mlp", "fc1.bias", "mlp.linear_fc1.bias", "mlp.linear_fc1.bias"),
    ("mlp", "fc2.weight", "mlp.linear_fc2.weight", "mlp.linear_fc2.weight"),
    ("mlp", "fc2.bias", "mlp.linear_fc2.bias", "mlp.linear_fc2.bias"),
)
_MEGATRON_LAYER = {name: (kind, ours) for kind, ours, te, local in _LAYER_PARAMS for name in (te, local)}
_GLOBAL_PARAMS = {  # ours -> Megatron, outside the transformer layers
    WORD_EMBEDDING: "embedding.word_embeddings.weight",
    POSITION_EMBEDDING: "embedding.position_embeddings.weight",
    "units.head.final_layernorm.weight": "decoder.final_layernorm.weight",
    "units.head.final_layernorm.bias": "decoder.final_layernorm.bias",
    OUTPUT_WEIGHT: "output_layer.weight",
}
_MEGATRON_GLOBAL = {m: o for o, m in _GLOBAL_PARAMS.items()}
# Modules whose state dict carries an `_extra_state` entry (None unless FP8 ran): Transformer Engine's modules, and
# megatron-core's own parallel linears, which keep the entry for compatibility with TE state dicts.
_EXTRA_STATE_MODULES = {
    "transformer_engine": ("self_attention.core_attention", "self_attention.linear_proj",
                           "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2"),
    "local": ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2"),
}
_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_UNIT_LAYER = re.compile(r"units\.(attn|mlp)_(\d+)\.(.+)")


def megatron_chunk_to_ours(sd: Mapping[str, Any], layer_offset: int, where: str = "checkpoint",
                           local_experts: int | None = None) -> dict:
    """One tp (and ep) rank's state dict of one Megatron model chunk -> our names (layer numbers + `layer_offset`;
    an MoE layer's local experts stacked, `local_experts` per rank needed only by the legacy grouped GEMM).

    `_extra_state` entries are dropped; any other name we cannot map is an error naming it."""
    moe, sd = split_moe_items(sd)
    out: dict[str, torch.Tensor] = {}
    for layer, items in moe.items():
        out.update(moe_layer_to_ours(items, f"units.mlp_{layer_offset + layer}.", local_experts, where))
    out.update(_dense_chunk_to_ours(sd, layer_offset, where, out))
    return {k: out[k] for k in sorted(out, key=unit_order)}  # units in model order: stages are read from it


def unit_order(name: str) -> tuple:
    """Model order of our names: the embedding, layer by layer (attention, then MLP), the head."""
    m = _UNIT_LAYER.fullmatch(name)
    if m:
        return 1, int(m.group(2)), int(m.group(1) == "mlp")
    return (0,) if name.startswith("units.embedding.") else (2,)


def _dense_chunk_to_ours(sd: Mapping[str, Any], layer_offset: int, where: str, moe: Mapping[str, Any]) -> dict:
    out: dict[str, torch.Tensor] = {}
    for name, value in sd.items():
        if name.rsplit(".", 1)[-1] == EXTRA_STATE:
            continue
        if name.startswith("language_model."):
            raise UsageError(f"{where} holds Megatron's legacy model names ({name}; --use-legacy-models), "
                             "only megatron-core GPT names are supported")
        if name.startswith("units."):
            raise UsageError(f"{where} holds megatron_bmw names ({name}); use --direction ours-to-megatron")
        m = _LAYER_KEY.fullmatch(name)
        if name in _MEGATRON_GLOBAL:
            ours = _MEGATRON_GLOBAL[name]
        elif m and m.group(2) in _MEGATRON_LAYER:
            kind, param = _MEGATRON_LAYER[m.group(2)]
            ours = f"units.{kind}_{layer_offset + int(m.group(1))}.{param}"
        else:
            raise UsageError(f"{where} has a tensor this converter does not know: {name} "
                             "(only dense GPT and Llama-style decoder layers are supported)")
        if not isinstance(value, torch.Tensor):
            raise UsageError(f"{where}: {name} is a {type(value).__name__}, not a tensor")
        if ours in out or ours in moe:
            raise UsageError(f"{where} holds {ours} twice (both the TE and the local layer-spec names?)")
        out[ours] = value
    return out


def ours_chunk_to_megatron(sd: Mapping[str, torch.Tensor], layer_offset: int, spec: str,
                           experts: str = "sequential") -> dict:
    """One tp (and ep) rank's state dict of one of our chunks -> Megatron names, layers numbered from 0 in the chunk;
    MoE layers' experts in the layout `experts` (megatron_moe.EXPERT_LAYOUTS).

    Adds the `_extra_state` entries (None) that megatron-core's modules of `spec` put into their state dicts."""
    if spec not in MEGATRON_SPECS:
        raise UsageError(f"unknown Megatron layer spec {spec!r} (choose {', '.join(MEGATRON_SPECS)})")
    column = 2 if spec == "transformer_engine" else 3
    names = {(kind, ours): row[column] for row in _LAYER_PARAMS for kind, ours in [row[:2]]}
    moe_layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in sd.items():
        if is_ours_moe(name):
            i, rest = name.split(".", 2)[1:]
            moe_layers.setdefault(int(i.removeprefix("mlp_")) - layer_offset, {})[rest] = t
    out: dict[str, Any] = {}
    layers: list[int] = []
    for local, items in moe_layers.items():
        out.update(moe_layer_to_megatron(items, local, experts))
    for name, t in sd.items():
        m = _UNIT_LAYER.fullmatch(name)
        if m and is_ours_moe(name):
            continue
        if m:
            local = int(m.group(2)) - layer_offset
            if local in moe_layers and m.group(3).startswith("post_attention_layernorm."):  # not fused into fc1
                out[f"decoder.layers.{local}.pre_mlp_layernorm.{m.group(3).rsplit('.', 1)[1]}"] = t
                layers.extend([] if local in layers else [local])
                continue
            if (m.group(1), m.group(3)) not in names:
                raise UsageError(f"checkpoint has a tensor this converter does not know: {name}")
            if local < 0:
                raise UsageError(f"layer numbering: {name} comes before this chunk's first layer {layer_offset}")
            out[f"decoder.layers.{local}.{names[m.group(1), m.group(3)]}"] = t
            if local not in layers:
                layers.append(local)
        elif name in _GLOBAL_PARAMS:
            out[_GLOBAL_PARAMS[name]] = t
        else:
            raise UsageError(f"checkpoint has a tensor this converter does not know: {name}")
    for local in layers:
        for module in _EXTRA_STATE_MODULES[spec]:
            if not (local in moe_layers and module.startswith("mlp.")):  # an MoE layer's: moe_layer_to_megatron
                out[f"decoder.layers.{local}.{module}.{EXTRA_STATE}"] = None
    if any(n.startswith("units.head.") for n in sd):
        out[f"output_layer.{EXTRA_STATE}"] = None  # the output layer exists on the last stage, tied or not
    return out


def megatron_chunk_layers(sd: Mapping[str, Any], where: str = "checkpoint") -> int:
    """How many transformer layers a Megatron chunk holds (its `decoder.layers.N`, N = 0..n-1)."""
    found = {int(m.group(1)) for m in map(_LAYER_KEY.fullmatch, sd) if m}
    if found != set(range(len(found))):
        raise UsageError(f"{where}: layers {sorted(found)} are not numbered 0..{len(found) - 1} "
                         "(megatron-core numbers each pipeline chunk's layers from 0)")
    return len(found)
