"""Convert weights between Hugging Face BERT pretraining models and our BERT units (pure functions on state dicts).

    kwargs, full = hf_to_ours(hf_sd, hf_config, make_vocab_size_divisible_by=128, tp=2)
    shards = [shard_state_dict(full, 2, r) for r in range(2)]      # one state dict per tp rank
    hf_sd, hf_config = ours_to_hf(merge_shards(shards), kwargs, orig_vocab_size=hf_config["vocab_size"])

Two Hugging Face architectures (`hf_config["architectures"]`):
  * `MegatronBertForPreTraining`: Megatron's pre-LayerNorm BERT, the layout of our units (no embedding
    LayerNorm; a LayerNorm before each attention and MLP block; a final LayerNorm). Weights map one to one.
  * `BertForPreTraining` (Google's BERT): post-LayerNorm, LN(x + block(x)), with a LayerNorm on the embeddings.
    This is exactly a pre-LayerNorm transformer whose residuals start from the LayerNorm output (Megatron's
    --apply-residual-connection-post-layernorm) with the LayerNorms shifted by one block: attention i's input
    LayerNorm is the previous block's output LayerNorm (the embeddings' for i = 0), the MLP's is the attention
    output's, and the final LayerNorm is the last block's output LayerNorm. Converted models run with that flag.
GeLU: our MLP uses the tanh approximation; a config with hidden_act "gelu_new"/"gelu_pytorch_tanh" converts
exactly (and our LM head uses tanh too: --openai-gelu); "gelu" (exact erf, Google's checkpoints) converts with
a note, the MLP then differs by the approximation (about 1e-3 in the activations).
Q, K and V (three [h, h] matrices) become our fused QKV with rows [head, (q|k|v), head_dim]; the vocabulary is
padded with zero rows (and zero output bias) to a multiple of `make_vocab_size_divisible_by * tp`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import padded_vocab_size
from ..errors import UsageError
from .tp_shards import merge_shards, partition_dim, shard_state_dict  # noqa: F401 - part of this module's API

ARCHITECTURES = ("BertForPreTraining", "MegatronBertForPreTraining")
TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")


def _layer_names(arch: str, num_layers: int) -> dict[str, str]:
    """Our name -> HF name, for every weight except Q/K/V and the vocabulary-sized ones."""
    post = arch == "BertForPreTraining"
    m: dict[str, str] = {
        "units.embedding.position_embeddings": "bert.embeddings.position_embeddings.weight",
        "units.embedding.tokentype_embeddings": "bert.embeddings.token_type_embeddings.weight",
        "units.head.lm_dense.weight": "cls.predictions.transform.dense.weight",
        "units.head.lm_dense.bias": "cls.predictions.transform.dense.bias",
        "units.head.lm_layernorm.weight": "cls.predictions.transform.LayerNorm.weight",
        "units.head.lm_layernorm.bias": "cls.predictions.transform.LayerNorm.bias",
        "units.head.pooler.weight": "bert.pooler.dense.weight",
        "units.head.pooler.bias": "bert.pooler.dense.bias",
        "units.head.binary_head.weight": "cls.seq_relationship.weight",
        "units.head.binary_head.bias": "cls.seq_relationship.bias",
    }
    for i in range(num_layers):
        hf = f"bert.encoder.layer.{i}"
        for ours, theirs in (("proj", "attention.output.dense"),):
            for p in ("weight", "bias"):
                m[f"units.attn_{i}.{ours}.{p}"] = f"{hf}.{theirs}.{p}"
        for ours, theirs in (("fc1", "intermediate.dense"), ("fc2", "output.dense")):
            for p in ("weight", "bias"):
                m[f"units.mlp_{i}.{ours}.{p}"] = f"{hf}.{theirs}.{p}"
        if post:
            attn_ln = "bert.embeddings.LayerNorm" if i == 0 else f"bert.encoder.layer.{i - 1}.output.LayerNorm"
            mlp_ln = f"{hf}.attention.output.LayerNorm"
        else:
            attn_ln, mlp_ln = f"{hf}.attention.ln", f"{hf}.ln"
        for p in ("weight", "bias"):
            m[f"units.attn_{i}.input_layernorm.{p}"] = f"{attn_ln}.{p}"
            m[f"units.mlp_{i}.post_attention_layernorm.{p}"] = f"{mlp_ln}.{p}"
    final = f"bert.encoder.layer.{num_layers - 1}.output.LayerNorm" if post else "bert.encoder.ln"
    for p in ("weight", "bias"):
        m[f"units.head.final_layernorm.{p}"] = f"{final}.{p}"
    return m


def _architecture(hf_config: Mapping[str, Any]) -> str:
    archs = hf_config.get("architectures") or ["BertForPreTraining"]
    arch = archs[0]
    if arch not in ARCHITECTURES:
        raise UsageError(f"--hf-dir: architecture {arch} is not converted (one of {', '.join(ARCHITECTURES)})")
    return arch


def check_hf_config(hf_config: Mapping[str, Any]) -> list[str]:
    """Refuse what our units do not compute; return notes on what converts approximately."""
    if hf_config.get("position_embedding_type", "absolute") != "absolute":
        raise UsageError(f"--hf-dir: position_embedding_type {hf_config['position_embedding_type']} is not supported")
    if hf_config.get("type_vocab_size", 2) != 2:
        raise UsageError(f"--hf-dir: type_vocab_size {hf_config['type_vocab_size']}; Megatron's BERT has 2 token types")
    if hf_config.get("is_decoder") or hf_config.get("add_cross_attention"):
        raise UsageError("--hf-dir: decoder BERT configurations are not supported")
    act = hf_config.get("hidden_act", "gelu")
    if act not in TANH_GELU + ("gelu",):
        raise UsageError(f"--hf-dir: hidden_act {act!r} is not supported (gelu, gelu_new, gelu_pytorch_tanh)")
    if act == "gelu":
        return ["hidden_act gelu (exact): our MLP uses the tanh approximation, so outputs differ slightly"]
    return []


def hf_to_ours(hf_sd: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any], make_vocab_size_divisible_by: int = 128,
               tp: int = 1) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(ModelConfig keyword arguments, our full state dict) of a HF BERT pretraining model."""
    check_hf_config(hf_config)
    arch = _architecture(hf_config)
    sd = {k: v for k, v in hf_sd.items() if not k.endswith(("position_ids", "token_type_ids"))}
    L, h, heads = hf_config["num_hidden_layers"], hf_config["hidden_size"], hf_config["num_attention_heads"]
    vocab = hf_config["vocab_size"]
    padded = padded_vocab_size(vocab, make_vocab_size_divisible_by, tp)
    tied = hf_config.get("tie_word_embeddings", True)

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise UsageError(f"--hf-dir: the {arch} weights lack {name}")
        return sd[name]

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros((padded - t.size(0),) + tuple(t.shape[1:]))]) if padded > t.size(0) else t

    full = {ours: take(theirs) for ours, theirs in _layer_names(arch, L).items()}
    full["units.embedding.word_embeddings.weight"] = pad(take("bert.embeddings.word_embeddings.weight"))
    bias = "cls.predictions.decoder.bias" if "cls.predictions.decoder.bias" in sd else "cls.predictions.bias"
    full["units.head.lm_bias"] = pad(take(bias))  # the decoder's bias is the one its logits add
    if not tied:
        full["units.head.output_weight"] = pad(take("cls.predictions.decoder.weight"))
    d = h // heads
    for i in range(L):
        base = f"bert.encoder.layer.{i}.attention.self"
        q, k, v = (take(f"{base}.{x}.weight").view(heads, d, h) for x in ("query", "key", "value"))
        full[f"units.attn_{i}.qkv.weight"] = torch.stack([q, k, v], 1).reshape(3 * h, h).contiguous()
        qb, kb, vb = (take(f"{base}.{x}.bias").view(heads, d) for x in ("query", "key", "value"))
        full[f"units.attn_{i}.qkv.bias"] = torch.stack([qb, kb, vb], 1).reshape(3 * h).contiguous()
    kwargs = dict(model_type="bert", num_layers=L, hidden_size=h, num_attention_heads=heads,
                  ffn_hidden_size=hf_config["intermediate_size"], vocab_size=padded,
                  max_position_embeddings=hf_config["max_position_embeddings"],
                  seq_length=hf_config["max_position_embeddings"],
                  layernorm_epsilon=hf_config.get("layer_norm_eps", 1e-12), bert_binary_head=True,
                  untie_embeddings_and_output_weights=not tied,
                  apply_residual_connection_post_layernorm=arch == "BertForPreTraining",
                  openai_gelu=hf_config.get("hidden_act", "gelu") in TANH_GELU,
                  hidden_dropout=hf_config.get("hidden_dropout_prob", 0.1),
                  attention_dropout=hf_config.get("attention_probs_dropout_prob", 0.1),
                  init_method_std=hf_config.get("initializer_range", 0.02))
    return kwargs, {k: v.contiguous() for k, v in full.items()}


def _get(cfg, key: str, default=None):
    return cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)


def ours_to_hf(full: Mapping[str, torch.Tensor], model_config, orig_vocab_size: int) -> tuple[dict, dict]:
    """(HF state dict, HF config dict) of our full BERT state dict: BertForPreTraining for a model with
    post-LayerNorm residuals, MegatronBertForPreTraining for Megatron's pre-LayerNorm BERT."""
    if _get(model_config, "model_type") != "bert":
        raise UsageError("--load: not a BERT checkpoint (model_type is not bert)")
    if not _get(model_config, "bert_binary_head", True):
        raise UsageError("--load: a BERT without the binary head has no Hugging Face *ForPreTraining equivalent")
    post = bool(_get(model_config, "apply_residual_connection_post_layernorm", False))
    arch = "BertForPreTraining" if post else "MegatronBertForPreTraining"
    L, h = _get(model_config, "num_layers"), _get(model_config, "hidden_size")
    heads = _get(model_config, "num_attention_heads")
    d = h // heads
    sd = {theirs: full[ours] for ours, theirs in _layer_names(arch, L).items()}
    sd["bert.embeddings.word_embeddings.weight"] = full["units.embedding.word_embeddings.weight"][:orig_vocab_size]
    sd["cls.predictions.bias"] = full["units.head.lm_bias"][:orig_vocab_size]
    untied = bool(_get(model_config, "untie_embeddings_and_output_weights", False))
    out_w = full["units.head.output_weight"] if untied else full["units.embedding.word_embeddings.weight"]
    sd["cls.predictions.decoder.weight"] = out_w[:orig_vocab_size]
    sd["cls.predictions.decoder.bias"] = sd["cls.predictions.bias"]
    for i in range(L):
        base = f"bert.encoder.layer.{i}.attention.self"
        w = full[f"units.attn_{i}.qkv.weight"].view(heads, 3, d, h)
        b = full[f"units.attn_{i}.qkv.bias"].view(heads, 3, d)
        for j, x in enumerate(("query", "key", "value")):
            sd[f"{base}.{x}.weight"] = w[:, j].reshape(h, h).contiguous()
            sd[f"{base}.{x}.bias"] = b[:, j].reshape(h).contiguous()
    config = dict(architectures=[arch], vocab_size=orig_vocab_size, hidden_size=h, num_hidden_layers=L,
                  num_attention_heads=heads, intermediate_size=_get(model_config, "ffn_hidden_size") or 4 * h,
                  hidden_act="gelu_pytorch_tanh" if _get(model_config, "openai_gelu", False) else "gelu",
                  max_position_embeddings=_get(model_config, "max_position_embeddings"), type_vocab_size=2,
                  layer_norm_eps=_get(model_config, "layernorm_epsilon", 1e-5),
                  hidden_dropout_prob=_get(model_config, "hidden_dropout", 0.1),
                  attention_probs_dropout_prob=_get(model_config, "attention_dropout", 0.1),
                  initializer_range=_get(model_config, "init_method_std", 0.02), tie_word_embeddings=not untied)
    return {k: v.contiguous() for k, v in sd.items()}, config
