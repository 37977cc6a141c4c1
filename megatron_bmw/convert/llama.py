"""Convert weights between Hugging Face Llama (LlamaForCausalLM, and Mistral configs of the same architecture) and
our GPT units with Llama-family layers (pure functions on state dicts).

    kwargs, full = hf_to_megatron(hf_sd, hf_config, make_vocab_size_divisible_by=128, tp=2)
    shards = [shard_state_dict(full, 2, r, swiglu=True) for r in range(2)]
    hf_sd = megatron_to_hf(merge_shards(shards, swiglu=True), {**kwargs, "orig_vocab_size": 32000})

Layout:
  * Rotary embeddings: HF Llama rotates the two halves of each head (rotate_half), as models/rotary.py does, so
    q_proj and k_proj rows map without a permutation (Meta's interleaved layout was permuted away when the HF
    checkpoint was made).
  * QKV: HF q_proj [heads*d, h], k_proj and v_proj [groups*d, h] -> our fused rows group by group,
    [q heads of group g; k_g; v_g] (Megatron's order; models/gpt.py), so a tp shard holds whole groups.
  * SwiGLU: gate_proj and up_proj -> fc1 [gate; up]; tp shards it with stride 2 (tp_shards.partition_stride).
  * The vocabulary is padded with zero rows to a multiple of `make_vocab_size_divisible_by * tp`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import UsageError
from .hf_files import HFTensors
from ..config import padded_vocab_size
from .gpt2 import Taker, _pad_rows
from .tp_shards import merge_shards, shard_state_dict  # noqa: F401 - part of this module's API

MODEL_TYPES = ("llama", "mistral")
WORD_EMBEDDING = "units.embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "units.head.output_weight"


# ----------------------------------------------------------------------------------------------------------------
# Config


def _rope(cfg: Mapping[str, Any]) -> tuple[float, float | None, float]:
    """(rope base, linear interpolation factor or None, partial rotary factor) of a Llama config, old or new style
    (rope_theta + rope_scaling, or transformers 5's rope_parameters)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    base = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if kind == "default":
        return float(base), None, float(partial)
    if kind != "linear":
        raise UsageError(f"--hf-dir: rope scaling {kind!r} is not supported (only 'linear' position interpolation)")
    factor = params.get("factor", scaling.get("factor"))
    if not isinstance(factor, (int, float)) or factor < 1:
        raise UsageError(f"--hf-dir: linear rope scaling needs a factor >= 1, got {factor!r}")
    return float(base), (float(factor) if factor != 1 else None), float(partial)


def check_hf_config(cfg: Mapping[str, Any]) -> None:
    """Raise UsageError unless the HF config describes a Llama that our units compute exactly."""
    model_type = cfg.get("model_type", "llama")
    if model_type not in MODEL_TYPES:
        raise UsageError(f"--hf-dir holds a {model_type!r} model; this converter takes {' or '.join(MODEL_TYPES)}")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings"):
        if not isinstance(cfg.get(key), int):
            raise UsageError(f"--hf-dir: config.json lacks an integer {key!r}")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UsageError(f"--hf-dir: hidden_act {act!r} is not supported (SwiGLU uses silu)")
    if bool(cfg.get("attention_bias", False)) != bool(cfg.get("mlp_bias", False)):
        raise UsageError(f"--hf-dir: attention_bias {cfg.get('attention_bias')} with mlp_bias {cfg.get('mlp_bias')} "
                         "is not supported (our projections have biases all together or not at all)")
    if model_type == "mistral" and cfg.get("sliding_window") is not None:
        raise UsageError(f"--hf-dir: sliding_window {cfg['sliding_window']} is not supported (full causal attention "
                         "only; a Mistral config converts with sliding_window null)")
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if h % heads:
        raise UsageError(f"--hf-dir: hidden_size {h} is not divisible by num_attention_heads {heads}")
    head_dim = cfg.get("head_dim") or h // heads
    if head_dim != h // heads:
        raise UsageError(f"--hf-dir: head_dim {head_dim} is not hidden_size/num_attention_heads {h // heads}")
    groups = cfg.get("num_key_value_heads") or heads
    if not isinstance(groups, int) or heads % groups:
        raise UsageError(f"--hf-dir: num_key_value_heads {groups!r} does not divide num_attention_heads {heads}")
    base, factor, partial = _rope(cfg)
    if partial != 1.0:
        raise UsageError(f"--hf-dir: partial_rotary_factor {partial} is not supported by LlamaForCausalLM")
    for flag, value in (("--rotary-base", base), ("--rotary-seq-len-interpolation-factor", factor)):
        if value is not None and not float(value).is_integer():
            raise UsageError(f"--hf-dir: rope {'theta' if flag == '--rotary-base' else 'scaling factor'} {value} is "
                             f"not an integer ({flag} takes integers, as in Megatron-LM)")


def model_kwargs(cfg: Mapping[str, Any], vocab: int) -> dict[str, Any]:
    """ModelConfig kwargs of a checked HF Llama config, with the padded vocabulary size `vocab`."""
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    base, factor, _ = _rope(cfg)
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=cfg["intermediate_size"], vocab_size=vocab, seq_length=cfg["max_position_embeddings"],
        max_position_embeddings=cfg["max_position_embeddings"], layernorm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        untie_embeddings_and_output_weights=not bool(cfg.get("tie_word_embeddings", False)), hidden_dropout=0.0,
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        init_method_std=float(cfg.get("initializer_range", 0.02)), position_embedding_type="rope",
        rotary_percent=1.0, rotary_base=int(base),
        rotary_seq_len_interpolation_factor=None if factor is None else int(factor), swiglu=True,
        num_query_groups=groups if groups != heads else None, normalization="RMSNorm", add_bias_linear=bias,
        add_qkv_bias=False,
    )


# ----------------------------------------------------------------------------------------------------------------
# QKV layout


def qkv_hf_to_ours(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """q [heads*d, ...], k and v [groups*d, ...] -> fused rows [group, (its q heads | k | v), d, ...]."""
    rest = tuple(q.shape[1:])
    d = k.size(0) // groups
    qg = q.reshape(groups, -1, d, *rest)
    return torch.cat([qg, k.reshape(groups, 1, d, *rest), v.reshape(groups, 1, d, *rest)], dim=1) \
        .reshape(-1, *rest).contiguous()


def qkv_ours_to_hf(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `qkv_hf_to_ours`."""
    rest = tuple(qkv.shape[1:])
    per = heads // groups
    g = qkv.reshape(groups, per + 2, -1, *rest)
    d = g.size(2)
    return (g[:, :per].reshape(heads * d, *rest).contiguous(), g[:, per].reshape(groups * d, *rest).contiguous(),
            g[:, per + 1].reshape(groups * d, *rest).contiguous())


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face -> ours


def hf_to_megatron(hf_state_dict: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any],
                   make_vocab_size_divisible_by: int = 128, tp: int = 1
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """HF LlamaForCausalLM weights -> (ModelConfig kwargs, full unsharded state dict of our ModelChunk)."""
    cfg = dict(hf_config)
    check_hf_config(cfg)
    if tp < 1:
        raise UsageError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    layers, h, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    ffn, d = cfg["intermediate_size"], h // heads
    orig_vocab = cfg["vocab_size"]
    vocab = padded_vocab_size(orig_vocab, make_vocab_size_divisible_by, tp)
    kwargs = model_kwargs(cfg, vocab)
    ModelConfig(**kwargs).check_tensor_parallel(tp)  # heads, groups, hidden, ffn (raises UsageError)
    bias = kwargs["add_bias_linear"]

    src = {k.removeprefix("model."): v for k, v in hf_state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    tensors = HFTensors(src)
    take = tensors.take

    sd: dict[str, torch.Tensor] = {WORD_EMBEDDING: _pad_rows(take("embed_tokens.weight", (orig_vocab, h)), vocab)}
    for i in range(layers):
        p, a, m = f"layers.{i}.", f"units.attn_{i}.", f"units.mlp_{i}."
        sd[a + "input_layernorm.weight"] = take(p + "input_layernorm.weight", (h,))
        at = p + "self_attn."
        sd[a + "qkv.weight"] = qkv_hf_to_ours(take(at + "q_proj.weight", (heads * d, h)),
                                              take(at + "k_proj.weight", (groups * d, h)),
                                              take(at + "v_proj.weight", (groups * d, h)), groups)
        sd[a + "proj.weight"] = take(at + "o_proj.weight", (h, heads * d))
        if bias:
            sd[a + "qkv.bias"] = qkv_hf_to_ours(take(at + "q_proj.bias", (heads * d,)),
                                                take(at + "k_proj.bias", (groups * d,)),
                                                take(at + "v_proj.bias", (groups * d,)), groups)
            sd[a + "proj.bias"] = take(at + "o_proj.bias", (h,))
        sd[m + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight", (h,))
        ml = p + "mlp."
        sd[m + "fc1.weight"] = torch.cat([take(ml + "gate_proj.weight", (ffn, h)), take(ml + "up_proj.weight", (ffn, h))])
        sd[m + "fc2.weight"] = take(ml + "down_proj.weight", (h, ffn))
        if bias:
            sd[m + "fc1.bias"] = torch.cat([take(ml + "gate_proj.bias", (ffn,)), take(ml + "up_proj.bias", (ffn,))])
            sd[m + "fc2.bias"] = take(ml + "down_proj.bias", (h,))
    sd["units.head.final_layernorm.weight"] = take("norm.weight", (h,))
    if kwargs["untie_embeddings_and_output_weights"]:
        sd[OUTPUT_WEIGHT] = _pad_rows(take("lm_head.weight", (orig_vocab, h)), vocab)
    else:
        src.pop("lm_head.weight", None)  # the embedding itself when tied
    tensors.check_all_taken()
    return kwargs, {k: v.contiguous() for k, v in sd.items()}


# ----------------------------------------------------------------------------------------------------------------
# Ours -> Hugging Face


def _get(model_config: ModelConfig | Mapping[str, Any], key: str, default: Any = None) -> Any:
    if isinstance(model_config, Mapping):
        value = model_config.get(key, default)
        return default if value is None else value
    return getattr(model_config, key, default)


def check_exportable(model_config: ModelConfig | Mapping[str, Any], where: str = "--load") -> None:
    """Raise UsageError unless LlamaForCausalLM computes exactly what our model with these settings does."""
    if _get(model_config, "model_type", "gpt") != "gpt":
        raise UsageError(f"{where}: a {str(_get(model_config, 'model_type')).upper()} model; this converter takes GPT")
    for key, want, flag in (("position_embedding_type", "rope", "--position-embedding-type rope"),
                            ("swiglu", True, "--swiglu"), ("normalization", "RMSNorm", "--normalization RMSNorm")):
        if _get(model_config, key) != want:
            raise UsageError(f"{where}: a Hugging Face Llama needs {flag} (the checkpoint has {key} "
                             f"{_get(model_config, key)!r}; GPT-2-style models: tools/checkpoint/convert_hf_gpt2.py)")
    if float(_get(model_config, "rotary_percent", 1.0)) != 1.0:
        raise UsageError(f"{where}: --rotary-percent {_get(model_config, 'rotary_percent')} has no LlamaForCausalLM "
                         "equivalent (it rotates whole heads)")
    if _get(model_config, "add_qkv_bias", False) and not _get(model_config, "add_bias_linear", True):
        raise UsageError(f"{where}: --add-qkv-bias without the other biases has no LlamaForCausalLM equivalent "
                         "(attention_bias also gives o_proj a bias)")
    if _get(model_config, "apply_residual_connection_post_layernorm", False):
        raise UsageError(f"{where}: --apply-residual-connection-post-layernorm has no LlamaForCausalLM equivalent")
    for key, flag in (("qk_layernorm", "--qk-layernorm"), ("apply_layernorm_1p", "--apply-layernorm-1p")):
        if _get(model_config, key, False):
            raise UsageError(f"{where}: {flag} has no LlamaForCausalLM equivalent (convert_megatron.py takes it)")


def megatron_to_hf(full_state_dict: Mapping[str, torch.Tensor], model_config: ModelConfig | Mapping[str, Any],
                   orig_vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Full (merged) state dict of our ModelChunk -> HF LlamaForCausalLM state dict; the padded vocabulary rows
    beyond `orig_vocab_size` (default: the config's orig_vocab_size, else none dropped) are left out."""
    check_exportable(model_config)
    layers = int(_get(model_config, "num_layers"))
    heads = int(_get(model_config, "num_attention_heads"))
    groups = int(_get(model_config, "num_query_groups", heads))
    untied = bool(_get(model_config, "untie_embeddings_and_output_weights", False))
    bias = bool(_get(model_config, "add_bias_linear", True))
    if orig_vocab_size is None:
        orig_vocab_size = _get(model_config, "orig_vocab_size")
    take = Taker(full_state_dict)

    wte = take(WORD_EMBEDDING)
    vocab = wte.size(0) if orig_vocab_size is None else int(orig_vocab_size)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": wte[:vocab].contiguous()}
    for i in range(layers):
        p, a, m = f"model.layers.{i}.", f"units.attn_{i}.", f"units.mlp_{i}."
        out[p + "input_layernorm.weight"] = take(a + "input_layernorm.weight")
        at = p + "self_attn."
        qkv = take(a + "qkv.weight")
        if qkv.numel():
            out[at + "q_proj.weight"], out[at + "k_proj.weight"], out[at + "v_proj.weight"] = \
                qkv_ours_to_hf(qkv, heads, groups)
        out[at + "o_proj.weight"] = take(a + "proj.weight")
        if bias:
            qkv_b = take(a + "qkv.bias")
            if qkv_b.numel():
                out[at + "q_proj.bias"], out[at + "k_proj.bias"], out[at + "v_proj.bias"] = \
                    qkv_ours_to_hf(qkv_b, heads, groups)
            out[at + "o_proj.bias"] = take(a + "proj.bias")
        out[p + "post_attention_layernorm.weight"] = take(m + "post_attention_layernorm.weight")
        ml = p + "mlp."
        fc1 = take(m + "fc1.weight")
        if fc1.numel():
            gate, up = fc1.chunk(2)
            out[ml + "gate_proj.weight"], out[ml + "up_proj.weight"] = gate.contiguous(), up.contiguous()
        out[ml + "down_proj.weight"] = take(m + "fc2.weight")
        if bias:
            fc1_b = take(m + "fc1.bias")
            if fc1_b.numel():
                gate, up = fc1_b.chunk(2)
                out[ml + "gate_proj.bias"], out[ml + "up_proj.bias"] = gate.contiguous(), up.contiguous()
            out[ml + "down_proj.bias"] = take(m + "fc2.bias")
    out["model.norm.weight"] = take("units.head.final_layernorm.weight")
    if untied:
        out["lm_head.weight"] = take(OUTPUT_WEIGHT)[:vocab].contiguous()
    else:
        take.drop(OUTPUT_WEIGHT)  # a pipeline copy of the tied embedding
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    take.done()
    return out


def hf_config_from_megatron(model_config: ModelConfig | Mapping[str, Any],
                            orig_vocab_size: int | None = None) -> dict[str, Any]:
    """LlamaConfig kwargs describing our model (inverse of `model_kwargs`)."""
    check_exportable(model_config)
    heads = int(_get(model_config, "num_attention_heads"))
    if orig_vocab_size is None:
        orig_vocab_size = _get(model_config, "orig_vocab_size") or _get(model_config, "vocab_size")
    factor = _get(model_config, "rotary_seq_len_interpolation_factor")
    base = float(_get(model_config, "rotary_base", 10000))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": base}
    if factor is not None:
        rope = {"rope_type": "linear", "rope_theta": base, "factor": float(factor)}
    bias = bool(_get(model_config, "add_bias_linear", True))
    hidden = int(_get(model_config, "hidden_size"))
    return dict(
        vocab_size=int(orig_vocab_size), hidden_size=hidden,
        intermediate_size=int(_get(model_config, "ffn_hidden_size")),
        num_hidden_layers=int(_get(model_config, "num_layers")), num_attention_heads=heads,
        num_key_value_heads=int(_get(model_config, "num_query_groups", heads)), head_dim=hidden // heads,
        hidden_act="silu", max_position_embeddings=int(_get(model_config, "max_position_embeddings")),
        initializer_range=float(_get(model_config, "init_method_std", 0.02)),
        rms_norm_eps=float(_get(model_config, "layernorm_epsilon", 1e-5)),
        tie_word_embeddings=not bool(_get(model_config, "untie_embeddings_and_output_weights", False)),
        rope_theta=base, rope_scaling=None if factor is None else {"rope_type": "linear", "factor": float(factor)},
        rope_parameters=rope, attention_bias=bias, mlp_bias=bias,
        attention_dropout=float(_get(model_config, "attention_dropout", 0.0)),
    )
