"""Megatron-LM's MoE arguments (megatron-core 0.16.1's TransformerConfig names, as its argument parser saves them)
<-> our MoEConfig: what our units compute of them, and the arguments a Megatron run with our model would save."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import ModelConfig
from ..config.moe import moe_layer_pattern
from ..errors import UsageError

# our MoEConfig field -> Megatron's argument (the same meaning; layer_freq and the list-valued ones converted)
MOE_ARGS = {"num_experts": "num_experts", "router_topk": "moe_router_topk", "ffn_hidden_size": "moe_ffn_hidden_size",
            "layer_freq": "moe_layer_freq", "load_balancing_type": "moe_router_load_balancing_type",
            "aux_loss_coeff": "moe_aux_loss_coeff", "z_loss_coeff": "moe_z_loss_coeff",
            "score_function": "moe_router_score_function", "pre_softmax": "moe_router_pre_softmax",
            "topk_scaling_factor": "moe_router_topk_scaling_factor",
            "shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
            "shared_expert_gate": "moe_shared_expert_gate", "token_dispatcher_type": "moe_token_dispatcher_type",
            "expert_capacity_factor": "moe_expert_capacity_factor", "token_drop_policy": "moe_token_drop_policy",
            "pad_expert_input_to_capacity": "moe_pad_expert_input_to_capacity", "grouped_gemm": "moe_grouped_gemm"}
# Megatron MoE settings our units do not compute (argument, what it is)
_UNSUPPORTED = (("moe_router_enable_expert_bias", "the router's expert bias (aux-loss-free balancing)"),
                ("moe_router_num_groups", "group-limited routing"), ("moe_router_group_topk", "group-limited routing"),
                ("moe_router_topk_limited_devices", "device-limited routing"),
                ("moe_latent_size", "latent MoE projections"), ("moe_apply_probs_on_input", "probabilities applied to "
                                                                "the experts' input"),
                ("moe_input_jitter_eps", "router input jitter"), ("moe_use_upcycling", "upcycling"))


def _single(value: Any, name: str) -> Any:
    """A Megatron setting that may be a list per auxiliary loss: one value (a one-element list is that value)."""
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise UsageError(f"unsupported Megatron model: {name} {list(value)} (one load-balancing type only)")
        return value[0]
    return value


def unsupported_moe_features(a: Mapping[str, Any]) -> list[str]:
    """What in a Megatron MoE run's args our MoE units cannot compute (empty: supported)."""
    found = [f"MoE {what} ({name})" for name, what in _UNSUPPORTED if a.get(name)]
    if a.get("add_bias_linear") is not False and not a.get("disable_bias_linear"):
        found.append("MoE with biases (megatron-core's router then has a bias; give --disable-bias-linear)")
    kinds = a.get("moe_router_load_balancing_type")
    if isinstance(kinds, (list, tuple)) and len(kinds) != 1:
        found.append(f"MoE load-balancing types {list(kinds)} (one only)")
    dispatcher = a.get("moe_token_dispatcher_type") or "allgather"
    if dispatcher not in ("allgather", "alltoall", "flex"):
        found.append(f"moe_token_dispatcher_type {dispatcher}")
    return found


def expert_parallel_size(a: Mapping[str, Any], where: str) -> int:
    """A checkpoint's expert-parallel size; its experts' tensor-parallel size must be tp (one tp index per file)."""
    ep = int(a.get("expert_model_parallel_size") or 1)
    etp, tp = a.get("expert_tensor_parallel_size"), int(a.get("tensor_model_parallel_size") or 1)
    if etp is not None and int(etp) != tp:
        raise UsageError(f"{where}: expert_tensor_parallel_size {etp} differs from tensor_model_parallel_size {tp}; "
                         "per-rank files are converted with the experts split as the dense layers (etp = tp)")
    if a.get("num_experts") and int(a["num_experts"]) % ep:
        raise UsageError(f"{where}: expert_model_parallel_size {ep} does not divide num_experts {a['num_experts']}")
    return ep


def _layer_freq_text(value: Any, num_layers: int) -> str:
    """Megatron's moe_layer_freq (an int N, or the list it parsed from a pattern) as our --moe-layer-freq."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_layers:
            raise UsageError(f"checkpoint args: moe_layer_freq has {len(value)} entries for {num_layers} layers")
        return "1" if all(value) else "[" + ",".join(str(int(bool(v))) for v in value) + "]"
    return str(int(value or 1))


def moe_config_from_megatron(a: Mapping[str, Any]) -> dict[str, Any] | None:
    """Our MoEConfig fields of a Megatron run's args (None: a dense model)."""
    if not a.get("num_experts"):
        return None
    moe = {ours: a[theirs] for ours, theirs in MOE_ARGS.items() if a.get(theirs) is not None}
    moe["layer_freq"] = _layer_freq_text(a.get("moe_layer_freq", 1), int(a["num_layers"]))
    for key in ("load_balancing_type", "aux_loss_coeff"):
        if key in moe:
            moe[key] = _single(moe[key], MOE_ARGS[key])
    if moe.get("token_dispatcher_type") == "flex":  # DeepEP / HybridEP: the same routing, another transport
        moe["token_dispatcher_type"] = "alltoall"
    moe["ffn_hidden_size"] = a.get("moe_ffn_hidden_size") or a.get("ffn_hidden_size")
    return moe


def megatron_moe_args(cfg: ModelConfig, ep: int, tp: int, experts: str) -> dict[str, Any]:
    """The MoE arguments a Megatron run of `cfg` with experts over `ep` ranks in layout `experts` saves."""
    if cfg.moe is None:
        return {"num_experts": None, "expert_model_parallel_size": 1, "expert_tensor_parallel_size": tp}
    moe = cfg.moe.to_json()
    out = {theirs: moe[ours] for ours, theirs in MOE_ARGS.items()}
    pattern = moe_layer_pattern(cfg.moe.layer_freq, cfg.num_layers)
    text = cfg.moe.layer_freq.strip()
    out["moe_layer_freq"] = int(text) if text.isdigit() else [int(p) for p in pattern]
    out["moe_ffn_hidden_size"] = cfg.moe_ffn_hidden_size
    out.update(moe_grouped_gemm=experts != "sequential", moe_use_legacy_grouped_gemm=experts == "legacy_grouped",
               expert_model_parallel_size=ep, expert_tensor_parallel_size=tp, moe_router_enable_expert_bias=False,
               moe_router_dtype="fp32", moe_token_dropping=False)
    return out
