"""megatron-core's MoE layer names <-> ours, one model chunk of one (tp, ep) rank at a time (convert/megatron_names.py
calls these for the `mlp.router`, `mlp.experts` and `mlp.shared_experts` entries of a layer).

An MoE layer of megatron-core (checked against 0.16.1's experts.py, router.py, shared_experts.py) holds
`mlp.router.weight` [E, h] (replicated; fp32 in Megatron's runs, kept as it is), its norm as `pre_mlp_layernorm`
(also with the Transformer Engine spec: the router needs the normed input, so it is not fused into a linear),
`mlp.shared_experts.linear_fc1` / `linear_fc2` (split over tp as a dense MLP) with `mlp.shared_experts.gate_weight`
[1, h], and this ep rank's E/ep experts numbered locally from 0 in one of three layouts:

  * `sequential` (SequentialMLP): `mlp.experts.local_experts.J.linear_fc1.weight` [rows/etp, h] (SwiGLU: the rank's
    [gate_r; up_r]) and `linear_fc2.weight` [h, F/etp], each with an `_extra_state`;
  * `te_grouped` (TEGroupedMLP, --moe-grouped-gemm with Transformer Engine): `mlp.experts.linear_fc1.weightJ` and
    `mlp.experts.linear_fc2.weightJ`, the same tensors, one `_extra_state` per GroupedLinear;
  * `legacy_grouped` (GroupedMLP, --moe-use-legacy-grouped-gemm): `mlp.experts.weight1` [h, E/ep * rows/etp] whose
    memory is the local experts' fc1 transposed one after the other (Megatron reads it as weight1.view(E/ep, h,
    rows/etp), [J] = fc1_J.T), and `mlp.experts.weight2` [E/ep * F/etp, h] (weight2.view(E/ep, F/etp, h)[J] =
    fc2_J.T); no `_extra_state`.

Ours stacks them: `experts.fc1.weight` [E/ep, rows/etp, h], `experts.fc2.weight` [E/ep, h, F/etp] (docs/moe.md).
megatron-core's torch_dist names every layout's experts alike, stacked over all E experts (SequentialMLP's
sharded_state_dict puts expert J at offset J of `mlp.experts.experts.linear_fc1.weight`; the grouped ones match
it): the `dist` layout here, one layer's [E, ...] before mcore_dist.py stacks the layers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import UsageError

EXPERT_LAYOUTS = ("sequential", "te_grouped", "legacy_grouped")
DIST = "dist"  # megatron-core's torch_dist key: every expert stacked, `experts.experts.linear_fc1.weight` [E, ...]
EXTRA_STATE = "_extra_state"
_MOE_KEY = re.compile(r"decoder\.layers\.(\d+)\.mlp\.(router\..+|experts\..+|shared_experts\..+)")
_SEQUENTIAL = re.compile(r"experts\.local_experts\.(\d+)\.linear_(fc1|fc2)\.(weight|bias)")
_TE_GROUPED = re.compile(r"experts\.linear_(fc1|fc2)\.(weight|bias)(\d+)")
_LEGACY = re.compile(r"experts\.weight([12])")
_DIST = re.compile(r"experts\.experts\.linear_(fc1|fc2)\.(weight|bias)")
_SHARED = {"shared_experts.linear_fc1.weight": "shared_expert.fc1.weight",
           "shared_experts.linear_fc1.bias": "shared_expert.fc1.bias",
           "shared_experts.linear_fc2.weight": "shared_expert.fc2.weight",
           "shared_experts.linear_fc2.bias": "shared_expert.fc2.bias",
           "shared_experts.gate_weight": "shared_expert_gate.weight", "router.weight": "router.weight"}
_OURS_MOE = re.compile(r"units\.mlp_(\d+)\.(router\.weight|experts\..+|shared_expert\..+|shared_expert_gate\..+)")


def is_megatron_moe(name: str) -> bool:
    return _MOE_KEY.fullmatch(name) is not None


def is_ours_moe(name: str) -> bool:
    return _OURS_MOE.fullmatch(name) is not None


def _stack(per_expert: dict[int, torch.Tensor], what: str, where: str) -> torch.Tensor:
    if sorted(per_expert) != list(range(len(per_expert))):
        raise UsageError(f"{where}: {what} holds local experts {sorted(per_expert)}, expected 0..{len(per_expert) - 1}")
    return torch.stack([per_expert[j] for j in range(len(per_expert))])


def _unfold_legacy(which: str, t: torch.Tensor, local_experts: int | None, where: str) -> torch.Tensor:
    """GroupedMLP's weight1 [h, E/ep * rows] -> [E/ep, rows, h]; weight2 [E/ep * F, h] -> [E/ep, h, F]."""
    if not local_experts:
        raise UsageError(f"{where}: a legacy grouped-GEMM layer (mlp.experts.weight{which}) needs the checkpoint's "
                         "num_experts and expert_model_parallel_size")
    if which == "1":
        return t.reshape(local_experts, t.size(0), -1).transpose(1, 2).contiguous()  # Megatron's view, flat order
    return t.reshape(local_experts, -1, t.size(1)).transpose(1, 2).contiguous()


def moe_layer_to_ours(items: Mapping[str, Any], prefix: str, local_experts: int | None, where: str
                      ) -> dict[str, torch.Tensor]:
    """One layer's `mlp.<...>` MoE entries (names without `decoder.layers.N.mlp.`) -> ours under `prefix`
    (`units.mlp_i.`), the local experts stacked; `_extra_state` entries dropped."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in items.items():
        if name.rsplit(".", 1)[-1] == EXTRA_STATE:
            continue
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"{where}: {prefix}{name} is a {type(t).__name__}, not a tensor")
        seq, grouped, legacy = _SEQUENTIAL.fullmatch(name), _TE_GROUPED.fullmatch(name), _LEGACY.fullmatch(name)
        dist = _DIST.fullmatch(name)
        if name in _SHARED:
            out[prefix + _SHARED[name]] = t
        elif dist:
            out[f"{prefix}experts.{dist.group(1)}.{dist.group(2)}"] = t
        elif seq or grouped:
            j, fc, kind = (seq.group(1), seq.group(2), seq.group(3)) if seq else \
                (grouped.group(3), grouped.group(1), grouped.group(2))
            stacks.setdefault(f"experts.{fc}.{kind}", {})[int(j)] = t
        elif legacy:
            out[f"{prefix}experts.fc{legacy.group(1)}.weight"] = _unfold_legacy(legacy.group(1), t, local_experts, where)
        else:
            raise UsageError(f"{where} has an MoE tensor this converter does not know: mlp.{name} (router expert "
                             "bias, latent projections, ... are not supported)")
    for name, per_expert in stacks.items():
        if prefix + name in out:
            raise UsageError(f"{where}: {prefix}{name} is held in two expert layouts")
        out[prefix + name] = _stack(per_expert, name, where)
    return out


def split_moe_items(sd: Mapping[str, Any]) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """({layer: {mlp sub-name: value}} of the MoE entries, the rest) of a Megatron chunk's state dict."""
    moe: dict[int, dict[str, Any]] = {}
    rest: dict[str, Any] = {}
    for name, value in sd.items():
        m = _MOE_KEY.fullmatch(name)
        if m:
            moe.setdefault(int(m.group(1)), {})[m.group(2)] = value
        else:
            rest[name] = value
    return moe, rest


def moe_layer_to_megatron(sd: Mapping[str, torch.Tensor], local: int, layout: str) -> dict[str, Any]:
    """Our MoE entries of one layer (names after `units.mlp_i.`) -> Megatron's under `decoder.layers.<local>.mlp.`
    in the expert `layout`, with the `_extra_state` entries its modules carry."""
    if layout not in EXPERT_LAYOUTS + (DIST,):
        raise UsageError(f"unknown Megatron expert layout {layout!r} (choose {', '.join(EXPERT_LAYOUTS)})")
    p = f"decoder.layers.{local}.mlp."
    ours_shared = {o: m for m, o in _SHARED.items()}
    out: dict[str, Any] = {}
    for name, t in sd.items():
        if name in ours_shared:
            out[p + ours_shared[name]] = t
            continue
        m = re.fullmatch(r"experts\.(fc1|fc2)\.(weight|bias)", name)
        if not m:
            raise UsageError(f"checkpoint has an MoE tensor this converter does not know: units.mlp_*.{name}")
        fc, kind = m.groups()
        if layout == DIST:
            out[f"{p}experts.experts.linear_{fc}.{kind}"] = t
            continue
        if layout == "legacy_grouped":
            if kind == "bias":
                raise UsageError("Megatron's legacy grouped GEMM has no expert biases (--disable-bias-linear)")
            per_expert = t.transpose(1, 2).contiguous()  # [E/ep, h, rows] or [E/ep, F, h], laid out flat
            out[f"{p}experts.weight{fc[-1]}"] = (per_expert.reshape(t.size(2), -1) if fc == "fc1"
                                                 else per_expert.reshape(-1, t.size(1)))
            continue
        for j in range(t.size(0)):
            key = (f"{p}experts.local_experts.{j}.linear_{fc}.{kind}" if layout == "sequential"
                   else f"{p}experts.linear_{fc}.{kind}{j}")
            out[key] = t[j].contiguous()
    experts = sd["experts.fc1.weight"].size(0) if "experts.fc1.weight" in sd else 0
    modules = ([f"experts.local_experts.{j}.linear_{fc}" for j in range(experts) for fc in ("fc1", "fc2")]
               if layout == "sequential" else ["experts.linear_fc1", "experts.linear_fc2"]
               if layout == "te_grouped" else [])
    if "shared_expert.fc1.weight" in sd and layout != DIST:
        modules += ["shared_experts.linear_fc1", "shared_experts.linear_fc2"]
    out.update({f"{p}{mod}.{EXTRA_STATE}": None for mod in modules})
    return out


def expert_layout_of(names: list[str]) -> str | None:
    """The expert layout a Megatron chunk's names use (None: no experts)."""
    for name in names:
        m = _MOE_KEY.fullmatch(name)
        if m and _SEQUENTIAL.fullmatch(m.group(2)):
            return "sequential"
        if m and _TE_GROUPED.fullmatch(m.group(2)):
            return "te_grouped"
        if m and _LEGACY.fullmatch(m.group(2)):
            return "legacy_grouped"
    return None
