"""Megatron-LM's saved arguments: what our units can compute of them, the ModelConfig they describe, and the
`args` each side writes (Megatron's Namespace, our dict) for a model at a layout."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import UsageError
from .gpt2 import POSITION_EMBEDDING
from .megatron_layout import Layout, Model, infer_divisible_by, megatron_stage_layers
from .megatron_names import WORD_EMBEDDING
from .megatron_moe_args import (  # noqa: F401 - part of this module's API
    expert_parallel_size, megatron_moe_args, moe_config_from_megatron, unsupported_moe_features,
)


# ----------------------------------------------------------------------------------------------------------------
# Megatron's arguments


def args_dict(args: Any) -> dict[str, Any]:
    """A checkpoint's `args` (Megatron: argparse.Namespace; ours: dict) as a dict."""
    if args is None:
        return {}
    if isinstance(args, Mapping):
        return dict(args)
    if hasattr(args, "__dict__"):
        return dict(vars(args))
    raise UsageError(f"checkpoint args are a {type(args).__name__}, not a Namespace or dict")


def unsupported_megatron_features(a: Mapping[str, Any]) -> list[str]:
    """What in Megatron's args our units cannot compute (empty: supported)."""
    heads, h = a.get("num_attention_heads"), a.get("hidden_size")
    found = []
    pos = _megatron_position(a)
    if pos not in ("learned_absolute", "rope", "none"):
        found.append(f"position_embedding_type {pos}")
    for key, what in (("rotary_interleaved", "interleaved rotary embeddings"),
                      ("use_rope_scaling", "Llama 3.1 rope scaling (--use-rope-scaling)"),
                      ("qk_l2_norm", "L2-normalised queries and keys"), ("window_size", "sliding-window attention"),
                      ("attention_output_gate", "gated attention output")):
        if a.get(key):
            found.append(what)
    if (a.get("softmax_type") or "vanilla") != "vanilla":
        found.append(f"softmax_type {a.get('softmax_type')}")
    if a.get("num_experts"):
        found.extend(unsupported_moe_features(a))
    if a.get("multi_latent_attention"):
        found.append("multi-latent attention")
    if a.get("mtp_num_layers"):
        found.append("multi-token prediction layers")
    norm = a.get("normalization") or "LayerNorm"
    if norm not in ("LayerNorm", "RMSNorm"):
        found.append(f"normalization {norm}")
    if a.get("apply_residual_connection_post_layernorm"):
        found.append("apply_residual_connection_post_layernorm")
    kv = a.get("kv_channels")
    if kv is not None and heads and h and kv * heads != h:
        found.append(f"kv_channels {kv} != hidden_size / num_attention_heads")
    if a.get("use_legacy_models"):
        found.append("legacy (non-mcore) models")
    return found


def megatron_notes(a: Mapping[str, Any]) -> list[str]:
    """Supported, but worth a line: where our units compute slightly differently than the Megatron run did."""
    notes = []
    if a.get("bias_gelu_fusion") is False and not (a.get("openai_gelu") or a.get("swiglu") or a.get("squared_relu")):
        notes.append("the Megatron run used the exact (erf) GeLU (--no-bias-gelu-fusion); megatron_bmw's MLP uses "
                     "the tanh approximation, as Megatron's fused bias-GeLU does: outputs differ slightly")
    return notes


def _megatron_position(a: Mapping[str, Any]) -> str:
    """Megatron's position embedding type (its older --use-rotary-position-embeddings is rope)."""
    if a.get("use_rotary_position_embeddings"):
        return "rope"
    return a.get("position_embedding_type") or "learned_absolute"


def _llama_config_from_megatron(a: Mapping[str, Any]) -> dict[str, Any]:
    """ModelConfig's Llama-family fields from a Megatron run's args."""
    heads, groups = a["num_attention_heads"], a.get("num_query_groups")
    factor = a.get("rotary_seq_len_interpolation_factor")
    return dict(
        position_embedding_type=_megatron_position(a), rotary_percent=float(a.get("rotary_percent") or 1.0),
        rotary_base=int(a.get("rotary_base") or 10000), rotary_seq_len_interpolation_factor=factor,
        swiglu=bool(a.get("swiglu")), squared_relu=bool(a.get("squared_relu")),
        num_query_groups=int(groups) if a.get("group_query_attention") and groups not in (None, heads) else None,
        normalization=a.get("normalization") or "LayerNorm",
        add_bias_linear=not (a.get("add_bias_linear") is False or a.get("disable_bias_linear")),
        add_qkv_bias=bool(a.get("add_qkv_bias")), qk_layernorm=bool(a.get("qk_layernorm")),
        apply_layernorm_1p=bool(a.get("apply_layernorm_1p") or a.get("layernorm_zero_centered_gamma")),
    )


def model_config_from_megatron(a: Mapping[str, Any], full: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        if not isinstance(a.get(key), int):
            raise UsageError(f"checkpoint args lack an integer {key!r}")
    llama = _llama_config_from_megatron(a)
    learned = llama["position_embedding_type"] == "learned_absolute"
    if WORD_EMBEDDING not in full or (learned and POSITION_EMBEDDING not in full):
        raise UsageError("checkpoint lacks the embeddings (embedding.word_embeddings.weight"
                         + (", embedding.position_embeddings.weight)" if learned else ")"))
    max_pos = int(full[POSITION_EMBEDDING].shape[0]) if learned else \
        int(a.get("max_position_embeddings") or a.get("seq_length") or 0) or None
    eps = a.get("norm_epsilon", a.get("layernorm_epsilon"))
    cfg = dict(
        num_layers=a["num_layers"], hidden_size=a["hidden_size"], num_attention_heads=a["num_attention_heads"],
        vocab_size=int(full[WORD_EMBEDDING].shape[0]), seq_length=int(a.get("seq_length") or max_pos or 0),
        max_position_embeddings=max_pos, ffn_hidden_size=a.get("ffn_hidden_size") or 4 * a["hidden_size"],
        hidden_dropout=float(a.get("hidden_dropout", 0.1)), attention_dropout=float(a.get("attention_dropout", 0.1)),
        init_method_std=float(a.get("init_method_std", 0.02)), layernorm_epsilon=float(1e-5 if eps is None else eps),
        untie_embeddings_and_output_weights=bool(a.get("untie_embeddings_and_output_weights", False)),
        params_dtype=dtype_name(full[WORD_EMBEDDING].dtype), moe=moe_config_from_megatron(a), **llama,
    )
    if not cfg["seq_length"]:
        raise UsageError("checkpoint args lack seq_length (a rotary model has no position table to tell it)")
    return ModelConfig(**cfg).to_json()  # fills defaults, validates


def dtype_name(dtype: torch.dtype) -> str:
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if dtype not in names:
        raise UsageError(f"checkpoint weights are {dtype}, expected float32, bfloat16 or float16")
    return names[dtype]


def int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


CARRIED_ARGS = ("seed", "micro_batch_size", "global_batch_size", "tokenizer_type", "data_parallel_size",
                "vocab_file", "merge_file")  # the tokenizer's files: a Hugging Face export writes them beside the model


# ----------------------------------------------------------------------------------------------------------------
# The args each side writes


def iteration_number(model: Model) -> int:
    return 0 if model.iteration == "release" else int(model.iteration)


def ours_args(model: Model, layout: Layout) -> dict[str, Any]:
    """The `args` dict our Trainer writes (training/loop.py `_args_dict`), for `model` at `layout`."""
    cfg = ModelConfig(**model.config)
    d = {k: v for k, v in cfg.to_json().items() if k != "params_dtype"}
    d.update(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
             padded_vocab_size=cfg.vocab_size, orig_vocab_size=model.orig_vocab_size,
             pipeline_partition=list(layout.partition), params_dtype=str(cfg.torch_dtype),
             virtual_pipeline_model_parallel_size=layout.virtual,
             **({"expert_model_parallel_size": layout.ep, "expert_tensor_parallel_size": layout.tp}
                if cfg.moe is not None else {}),
             make_vocab_size_divisible_by=model.make_vocab_size_divisible_by
             or infer_divisible_by(model.orig_vocab_size, cfg.vocab_size, layout.tp))
    if model.consumed_train_samples is not None:
        d["consumed_train_samples"] = model.consumed_train_samples
    if model.consumed_valid_samples is not None:
        d["consumed_valid_samples"] = model.consumed_valid_samples
    d.update({k: v for k, v in model.extra_args.items() if k not in d})
    return d


def megatron_args(model: Model, layout: Layout, spec: str, tokenizer_type: str | None = None,
                  experts: str = "sequential") -> argparse.Namespace:
    """The `args` Namespace a Megatron-LM run with this model and layout saves (the fields its loader reads)."""
    cfg = ModelConfig(**model.config)
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    stage_layers = megatron_stage_layers(layout, cfg.num_layers)
    divisible = (model.make_vocab_size_divisible_by
                 or infer_divisible_by(model.orig_vocab_size, cfg.vocab_size, layout.tp) or 128)
    dp = int(model.extra_args.get("data_parallel_size") or 1)
    if dp % layout.ep:  # Megatron's experts are split over ep ranks out of the data-parallel ones (etp = tp)
        dp = layout.ep
    dtype = cfg.torch_dtype
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=h, ffn_hidden_size=cfg.ffn_hidden_size, num_attention_heads=heads,
        kv_channels=h // heads, num_query_groups=cfg.query_groups,
        group_query_attention=cfg.num_query_groups is not None,
        seq_length=cfg.seq_length, max_position_embeddings=cfg.max_position_embeddings,
        position_embedding_type=cfg.position_embedding_type,
        add_position_embedding=cfg.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=cfg.position_embedding_type == "rope", rotary_percent=cfg.rotary_percent,
        rotary_base=cfg.rotary_base, rotary_seq_len_interpolation_factor=cfg.rotary_seq_len_interpolation_factor,
        rotary_interleaved=False, use_rope_scaling=False,
        padded_vocab_size=cfg.vocab_size, vocab_size=model.orig_vocab_size,
        make_vocab_size_divisible_by=divisible,
        tokenizer_type=tokenizer_type or model.extra_args.get("tokenizer_type") or "GPT2BPETokenizer",
        untie_embeddings_and_output_weights=cfg.untie_embeddings_and_output_weights,
        normalization=cfg.normalization, norm_epsilon=cfg.layernorm_epsilon, layernorm_epsilon=cfg.layernorm_epsilon,
        apply_layernorm_1p=cfg.apply_layernorm_1p,
        hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
        init_method_std=cfg.init_method_std, swiglu=cfg.swiglu, squared_relu=cfg.squared_relu, openai_gelu=False,
        bias_gelu_fusion=not (cfg.swiglu or cfg.squared_relu), bias_swiglu_fusion=cfg.swiglu and cfg.bias_swiglu_fusion,
        apply_rope_fusion=cfg.apply_rope_fusion, add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias, disable_bias_linear=not cfg.add_bias_linear,
        qk_layernorm=cfg.qk_layernorm, apply_residual_connection_post_layernorm=False,
        **megatron_moe_args(cfg, layout.ep, layout.tp, experts),
        fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.virtual if layout.virtual > 1 else None,
        num_layers_per_virtual_pipeline_stage=stage_layers[0] if layout.virtual > 1 and len(set(stage_layers)) == 1
        else None,
        data_parallel_size=dp, world_size=layout.tp * layout.pp * dp,
        transformer_impl=spec, use_legacy_models=False, use_mcore_models=True, ckpt_format="torch",
        bert_binary_head=False, iteration=iteration_number(model),
        consumed_train_samples=model.consumed_train_samples or 0,
        consumed_valid_samples=model.consumed_valid_samples or 0, skipped_train_samples=0,
        **{k: model.extra_args[k] for k in ("seed", "micro_batch_size", "global_batch_size", "vocab_file", "merge_file")
           if k in model.extra_args},
    )
