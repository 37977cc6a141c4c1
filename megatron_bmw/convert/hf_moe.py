"""Convert weights between Hugging Face mixtures of experts (MixtralForCausalLM, Qwen2MoeForCausalLM) and our GPT
units with MoE layers (docs/moe.md; pure functions on state dicts).

    kwargs, full = hf_to_megatron(hf_sd, hf_config, make_vocab_size_divisible_by=128, tp=2, ep=2)
    hf_sd = megatron_to_hf(full, {**kwargs, "orig_vocab_size": 32000})
    model_type, hf_kwargs = hf_config_from_megatron(kwargs)

Layout (attention, norms, embeddings and rope as convert/llama.py):
  * Experts: Mixtral's `block_sparse_moe.experts.N.w1` (gate), `w3` (up), `w2` (down) and Qwen2-MoE's
    `mlp.experts.N.gate_proj` / `up_proj` / `down_proj` stack into `experts.fc1.weight` [E, 2F, h] ([gate; up]
    per expert) and `experts.fc2.weight` [E, h, F]. transformers 5 keeps them fused in memory
    (`mlp.experts.gate_up_proj` [E, 2F, h], `mlp.experts.down_proj` [E, h, F], the same layout) and writes the
    per-expert names on save; both are read, the per-expert names written.
  * Router: `block_sparse_moe.gate.weight` / `mlp.gate.weight` [E, h] -> `router.weight`.
  * Qwen2-MoE's shared expert: `mlp.shared_expert.{gate,up,down}_proj` -> `shared_expert.fc1` [gate; up] and
    `shared_expert.fc2`, `mlp.shared_expert_gate.weight` [1, h] -> `shared_expert_gate.weight`; its dense layers
    (`mlp_only_layers`, `decoder_sparse_step`) are ordinary MLP units and `--moe-layer-freq` lists the pattern.
  * Routing: Mixtral takes the softmax over all experts, the top k, and renormalises over them: the softmax over
    the k chosen logits (our default). Qwen2-MoE with `norm_topk_prob` false keeps the top-k of the softmax over
    all experts unrenormalised: `--moe-router-pre-softmax`; with it true, as Mixtral.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..config import ModelConfig, padded_vocab_size
from ..config.moe import moe_layer_pattern
from ..errors import UsageError
from .gpt2 import Taker, _pad_rows
from .hf_files import HFTensors
from .llama import _get, _rope, qkv_hf_to_ours, qkv_ours_to_hf

MODEL_TYPES = ("mixtral", "qwen2_moe")
WORD_EMBEDDING = "units.embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "units.head.output_weight"
# per-expert (gate, up, down) names and the MoE block's module under each HF layer
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}
_BLOCK = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp"}


# ----------------------------------------------------------------------------------------------------------------
# Config


def _int(cfg: Mapping[str, Any], key: str) -> int:
    if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool):
        raise UsageError(f"--hf-dir: config.json lacks an integer {key!r}")
    return cfg[key]


def moe_layers(cfg: Mapping[str, Any]) -> list[bool]:
    """Which HF layers are sparse: all for Mixtral; Qwen2-MoE's rule (not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0)."""
    n = _int(cfg, "num_hidden_layers")
    if cfg.get("model_type") == "mixtral":
        return [True] * n
    step = cfg.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise UsageError(f"--hf-dir: decoder_sparse_step {step!r} must be an integer >= 1")
    dense = set(cfg.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(n)]


def check_hf_config(cfg: Mapping[str, Any]) -> None:
    """Raise UsageError unless the HF config describes a Mixtral or Qwen2-MoE our units compute exactly."""
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise UsageError(f"--hf-dir holds a {model_type!r} model; this converter takes {' or '.join(MODEL_TYPES)}")
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                "max_position_embeddings", "num_experts_per_tok"):
        _int(cfg, key)
    experts = _int(cfg, "num_local_experts" if model_type == "mixtral" else "num_experts")
    if not 1 <= cfg["num_experts_per_tok"] <= experts:
        raise UsageError(f"--hf-dir: num_experts_per_tok {cfg['num_experts_per_tok']} is not in 1..{experts}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UsageError(f"--hf-dir: hidden_act {cfg.get('hidden_act')!r} is not supported (SwiGLU uses silu)")
    if model_type == "mixtral" and cfg.get("sliding_window") is not None:
        raise UsageError(f"--hf-dir: sliding_window {cfg['sliding_window']} is not supported (full causal attention "
                         "only; a Mixtral config converts with sliding_window null)")
    if model_type == "qwen2_moe":
        if cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or []):
            raise UsageError("--hf-dir: use_sliding_window is not supported (full causal attention only)")
        for key in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            if _int(cfg, key) < 1:
                raise UsageError(f"--hf-dir: {key} {cfg[key]} must be >= 1")
        if not any(moe_layers(cfg)):
            raise UsageError("--hf-dir: no layer is sparse (mlp_only_layers and decoder_sparse_step leave none): a "
                             "dense model, convert it as a Qwen2 / Llama")
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if h % heads or (cfg.get("head_dim") or h // heads) != h // heads:
        raise UsageError(f"--hf-dir: head_dim {cfg.get('head_dim')} is not hidden_size/num_attention_heads")
    groups = cfg.get("num_key_value_heads") or heads
    if not isinstance(groups, int) or heads % groups:
        raise UsageError(f"--hf-dir: num_key_value_heads {groups!r} does not divide num_attention_heads {heads}")
    base, factor, partial = _rope(cfg)
    if partial != 1.0:
        raise UsageError(f"--hf-dir: partial_rotary_factor {partial} is not supported")
    for what, value in (("theta", base), ("scaling factor", factor)):
        if value is not None and not float(value).is_integer():
            raise UsageError(f"--hf-dir: rope {what} {value} is not an integer (Megatron's flags take integers)")


def _layer_freq(pattern: list[bool]) -> str:
    """--moe-layer-freq for a pattern: "1" when every layer is MoE, else Megatron's list."""
    return "1" if all(pattern) else "[" + ",".join(str(int(p)) for p in pattern) + "]"


def model_kwargs(cfg: Mapping[str, Any], vocab: int) -> dict[str, Any]:
    """ModelConfig kwargs (the MoE settings as a dict under "moe") of a checked HF config, padded vocabulary `vocab`."""
    qwen = cfg["model_type"] == "qwen2_moe"
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    base, factor, _ = _rope(cfg)
    moe = dict(num_experts=cfg["num_experts"] if qwen else cfg["num_local_experts"],
               router_topk=cfg["num_experts_per_tok"],
               ffn_hidden_size=cfg["moe_intermediate_size"] if qwen else cfg["intermediate_size"],
               layer_freq=_layer_freq(moe_layers(cfg)), load_balancing_type="aux_loss",
               aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0) or 0.0), score_function="softmax",
               pre_softmax=qwen and not cfg.get("norm_topk_prob", False),
               shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"] if qwen else None,
               shared_expert_gate=qwen)
    return dict(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=heads,
        ffn_hidden_size=cfg["intermediate_size"], vocab_size=vocab, seq_length=cfg["max_position_embeddings"],
        max_position_embeddings=cfg["max_position_embeddings"], layernorm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        untie_embeddings_and_output_weights=not bool(cfg.get("tie_word_embeddings", False)), hidden_dropout=0.0,
        attention_dropout=float(cfg.get("attention_dropout", 0.0)),
        init_method_std=float(cfg.get("initializer_range", 0.02)), position_embedding_type="rope",
        rotary_percent=1.0, rotary_base=int(base),
        rotary_seq_len_interpolation_factor=None if factor is None else int(factor), swiglu=True,
        num_query_groups=groups if groups != heads else None, normalization="RMSNorm", add_bias_linear=False,
        add_qkv_bias=qwen and bool(cfg.get("qkv_bias", True)), moe=moe,
    )


def check_moe_parallel(kwargs: Mapping[str, Any], tp: int, ep: int) -> None:
    """The layout's sizes divide the model's (heads, groups, hidden, FFN and vocabulary over tp; the experts over ep;
    each expert's FFN and the shared experts' over tp, the experts' tensor-parallel size here)."""
    if tp < 1 or ep < 1:
        raise UsageError(f"--tensor-model-parallel-size {tp} and --expert-model-parallel-size {ep} must be >= 1")
    ModelConfig(**kwargs).check_tensor_parallel(tp)
    moe = kwargs["moe"]
    if moe["num_experts"] % ep:
        raise UsageError(f"--expert-model-parallel-size {ep} does not divide the {moe['num_experts']} experts")
    for what, size in (("each expert's FFN size", moe["ffn_hidden_size"]),
                       ("the shared experts' FFN size", moe.get("shared_expert_intermediate_size"))):
        if size and size % tp:
            raise UsageError(f"--tensor-model-parallel-size {tp} does not divide {what} {size}")


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face -> ours


def _experts(src: dict[str, torch.Tensor], take: Callable, block: str, names: tuple[str, str, str], e: int, f: int,
             h: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc1 [E, 2F, h], fc2 [E, h, F]) of one layer's experts, per-expert names or transformers 5's fused ones."""
    fused = block.rsplit(".", 1)[0] + ".mlp.experts."  # transformers 5 in memory: under mlp. for Mixtral too
    if fused + "gate_up_proj" in src:
        return take(fused + "gate_up_proj", (e, 2 * f, h)), take(fused + "down_proj", (e, h, f))
    gate, up, down = names
    x = block + ".experts."
    fc1 = torch.stack([torch.cat([take(f"{x}{j}.{gate}.weight", (f, h)), take(f"{x}{j}.{up}.weight", (f, h))])
                       for j in range(e)])
    return fc1, torch.stack([take(f"{x}{j}.{down}.weight", (h, f)) for j in range(e)])


def _attention_to_ours(sd: dict, take: Callable, p: str, a: str, heads: int, groups: int, h: int,
                       qkv_bias: bool) -> None:
    d = h // heads
    at = p + "self_attn."
    sd[a + "input_layernorm.weight"] = take(p + "input_layernorm.weight", (h,))
    sd[a + "qkv.weight"] = qkv_hf_to_ours(take(at + "q_proj.weight", (heads * d, h)),
                                          take(at + "k_proj.weight", (groups * d, h)),
                                          take(at + "v_proj.weight", (groups * d, h)), groups)
    if qkv_bias:
        sd[a + "qkv.bias"] = qkv_hf_to_ours(take(at + "q_proj.bias", (heads * d,)),
                                            take(at + "k_proj.bias", (groups * d,)),
                                            take(at + "v_proj.bias", (groups * d,)), groups)
    sd[a + "proj.weight"] = take(at + "o_proj.weight", (h, heads * d))


def _mlp_to_ours(sd: dict, take: Callable, ml: str, m: str, f: int, h: int) -> None:
    """A SwiGLU MLP's gate_proj / up_proj / down_proj under `ml` -> fc1 [gate; up], fc2 under `m`."""
    sd[m + "fc1.weight"] = torch.cat([take(ml + "gate_proj.weight", (f, h)), take(ml + "up_proj.weight", (f, h))])
    sd[m + "fc2.weight"] = take(ml + "down_proj.weight", (h, f))


def hf_to_megatron(hf_state_dict: Mapping[str, torch.Tensor], hf_config: Mapping[str, Any],
                   make_vocab_size_divisible_by: int = 128, tp: int = 1, ep: int = 1
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """HF Mixtral / Qwen2-MoE weights -> (ModelConfig kwargs, full unsharded state dict of our ModelChunk)."""
    cfg = dict(hf_config)
    check_hf_config(cfg)
    model_type = cfg["model_type"]
    layers, h, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    orig_vocab = cfg["vocab_size"]
    vocab = padded_vocab_size(orig_vocab, make_vocab_size_divisible_by, tp)
    kwargs = model_kwargs(cfg, vocab)
    check_moe_parallel(kwargs, tp, ep)
    moe = kwargs["moe"]
    e, fe, fs = moe["num_experts"], moe["ffn_hidden_size"], moe["shared_expert_intermediate_size"]
    sparse = moe_layers(cfg)

    src = {k: v for k, v in hf_state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    tensors = HFTensors(src)
    take = tensors.take
    sd: dict[str, torch.Tensor] = {WORD_EMBEDDING: _pad_rows(take("model.embed_tokens.weight", (orig_vocab, h)), vocab)}
    for i in range(layers):
        p, a, m = f"model.layers.{i}.", f"units.attn_{i}.", f"units.mlp_{i}."
        _attention_to_ours(sd, take, p, a, heads, groups, h, kwargs["add_qkv_bias"])
        sd[m + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight", (h,))
        if not sparse[i]:
            _mlp_to_ours(sd, take, p + "mlp.", m, cfg["intermediate_size"], h)
            continue
        block = p + _BLOCK[model_type]
        if block + ".gate.weight" not in src and p + "mlp.gate.weight" in src:  # transformers 5's in-memory names
            block = p + "mlp"
        sd[m + "router.weight"] = take(block + ".gate.weight", (e, h))
        sd[m + "experts.fc1.weight"], sd[m + "experts.fc2.weight"] = \
            _experts(src, take, block, _EXPERT_NAMES[model_type], e, fe, h)
        if fs:
            _mlp_to_ours(sd, take, block + ".shared_expert.", m + "shared_expert.", fs, h)
            sd[m + "shared_expert_gate.weight"] = take(block + ".shared_expert_gate.weight", (1, h))
    sd["units.head.final_layernorm.weight"] = take("model.norm.weight", (h,))
    if kwargs["untie_embeddings_and_output_weights"]:
        sd[OUTPUT_WEIGHT] = _pad_rows(take("lm_head.weight", (orig_vocab, h)), vocab)
    else:
        src.pop("lm_head.weight", None)  # the embedding itself when tied
    tensors.check_all_taken()
    return kwargs, {k: v.contiguous() for k, v in sd.items()}


# ----------------------------------------------------------------------------------------------------------------
# Ours -> Hugging Face


def _moe(model_config: ModelConfig | Mapping[str, Any]) -> dict[str, Any]:
    moe = _get(model_config, "moe")
    if moe is None:
        raise UsageError("--load: a dense model (no --num-experts); Llama-style dense models: "
                         "tools/checkpoint/convert_hf_llama.py")
    return dict(moe) if isinstance(moe, Mapping) else moe.to_json()


def hf_model_type(model_config: ModelConfig | Mapping[str, Any], where: str = "--load") -> str:
    """'mixtral' or 'qwen2_moe': the Hugging Face architecture computing exactly what our model does (or a
    UsageError naming the setting neither has)."""
    for key, want, flag in (("model_type", "gpt", "a GPT model"), ("position_embedding_type", "rope",
                            "--position-embedding-type rope"), ("swiglu", True, "--swiglu"),
                            ("normalization", "RMSNorm", "--normalization RMSNorm"), ("add_bias_linear", False,
                            "--disable-bias-linear"), ("rotary_percent", 1.0, "--rotary-percent 1")):
        if _get(model_config, key, {"model_type": "gpt", "add_bias_linear": True, "rotary_percent": 1.0}.get(key)) \
                != want:
            raise UsageError(f"{where}: a Hugging Face Mixtral or Qwen2-MoE needs {flag} (the checkpoint has {key} "
                             f"{_get(model_config, key)!r})")
    for key, flag in (("qk_layernorm", "--qk-layernorm"), ("apply_layernorm_1p", "--apply-layernorm-1p"),
                      ("apply_residual_connection_post_layernorm", "--apply-residual-connection-post-layernorm")):
        if _get(model_config, key, False):
            raise UsageError(f"{where}: {flag} has no Mixtral or Qwen2-MoE equivalent")
    moe = _moe(model_config)
    for key, flag, ok in (("score_function", "--moe-router-score-function", lambda v: v in (None, "softmax")),
                          ("topk_scaling_factor", "--moe-router-topk-scaling-factor", lambda v: v is None),
                          ("expert_capacity_factor", "--moe-expert-capacity-factor", lambda v: v is None)):
        if not ok(moe.get(key)):
            raise UsageError(f"{where}: {flag} {moe.get(key)} has no Mixtral or Qwen2-MoE equivalent")
    if moe.get("shared_expert_intermediate_size"):
        if not moe.get("shared_expert_gate"):
            raise UsageError(f"{where}: shared experts without --moe-shared-expert-gate have no Hugging Face "
                             "equivalent (Qwen2-MoE gates them)")
        return "qwen2_moe"
    layers = int(_get(model_config, "num_layers"))
    if not all(moe_layer_pattern(str(moe.get("layer_freq", "1")), layers)):
        raise UsageError(f"{where}: --moe-layer-freq {moe.get('layer_freq')} leaves dense layers: Mixtral has experts "
                         "in every layer, and Qwen2-MoE's mixes need shared experts")
    if moe.get("pre_softmax"):
        raise UsageError(f"{where}: --moe-router-pre-softmax without shared experts: Mixtral renormalises over the "
                         "top k (Qwen2-MoE's norm_topk_prob false needs its shared experts)")
    if _get(model_config, "add_qkv_bias", False):
        raise UsageError(f"{where}: --add-qkv-bias without shared experts: Mixtral's attention has no biases")
    return "mixtral"


def _attention_to_hf(out: dict, take: Callable, p: str, a: str, heads: int, groups: int, qkv_bias: bool) -> None:
    at = p + "self_attn."
    out[p + "input_layernorm.weight"] = take(a + "input_layernorm.weight")
    names = [at + "q_proj.", at + "k_proj.", at + "v_proj."]
    for suffix in ("weight",) + (("bias",) if qkv_bias else ()):
        qkv = take(f"{a}qkv.{suffix}")
        if qkv.numel():
            for name, t in zip(names, qkv_ours_to_hf(qkv, heads, groups)):
                out[name + suffix] = t
    out[at + "o_proj.weight"] = take(a + "proj.weight")


def _mlp_to_hf(out: dict, take: Callable, m: str, ml: str, names: tuple[str, str, str] = ("gate_proj", "up_proj",
               "down_proj")) -> None:
    fc1 = take(m + "fc1.weight")
    if fc1.numel():
        gate, up = fc1.chunk(2)
        out[f"{ml}{names[0]}.weight"], out[f"{ml}{names[1]}.weight"] = gate.contiguous(), up.contiguous()
    out[f"{ml}{names[2]}.weight"] = take(m + "fc2.weight")


def megatron_to_hf(full_state_dict: Mapping[str, torch.Tensor], model_config: ModelConfig | Mapping[str, Any],
                   orig_vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Full (merged, every expert) state dict of our ModelChunk -> the HF checkpoint's state dict (per-expert names,
    as save_pretrained writes them); padded vocabulary rows beyond `orig_vocab_size` (default: the config's) left
    out. A tied output weight is left out too (HF ties lm_head to the embedding on load)."""
    model_type = hf_model_type(model_config)
    moe = _moe(model_config)
    layers, heads = int(_get(model_config, "num_layers")), int(_get(model_config, "num_attention_heads"))
    groups = int(_get(model_config, "num_query_groups", heads))
    sparse = moe_layer_pattern(str(moe.get("layer_freq", "1")), layers)
    qkv_bias = bool(_get(model_config, "add_qkv_bias", False))
    if orig_vocab_size is None:
        orig_vocab_size = _get(model_config, "orig_vocab_size")
    take = Taker(full_state_dict)

    wte = take(WORD_EMBEDDING)
    vocab = wte.size(0) if orig_vocab_size is None else int(orig_vocab_size)
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": wte[:vocab].contiguous()}
    for i in range(layers):
        p, a, m = f"model.layers.{i}.", f"units.attn_{i}.", f"units.mlp_{i}."
        _attention_to_hf(out, take, p, a, heads, groups, qkv_bias)
        out[p + "post_attention_layernorm.weight"] = take(m + "post_attention_layernorm.weight")
        if not sparse[i]:
            _mlp_to_hf(out, take, m, p + "mlp.")
            continue
        block = p + _BLOCK[model_type] + "."
        out[block + "gate.weight"] = take(m + "router.weight")
        fc1, fc2 = take(m + "experts.fc1.weight"), take(m + "experts.fc2.weight")
        gate, up, down = _EXPERT_NAMES[model_type]
        for j in range(fc1.size(0) if fc1.numel() and fc2.numel() else 0):
            out[f"{block}experts.{j}.{gate}.weight"], out[f"{block}experts.{j}.{up}.weight"] = \
                (t.contiguous() for t in fc1[j].chunk(2))
            out[f"{block}experts.{j}.{down}.weight"] = fc2[j].contiguous()
        if model_type == "qwen2_moe":
            _mlp_to_hf(out, take, m + "shared_expert.", block + "shared_expert.")
            out[block + "shared_expert_gate.weight"] = take(m + "shared_expert_gate.weight")
    out["model.norm.weight"] = take("units.head.final_layernorm.weight")
    if _get(model_config, "untie_embeddings_and_output_weights", False):
        out["lm_head.weight"] = take(OUTPUT_WEIGHT)[:vocab].contiguous()
    else:
        take.drop(OUTPUT_WEIGHT)  # a pipeline copy of the tied embedding
    take.done()
    return out


def _sparse_step(pattern: tuple[bool, ...]) -> tuple[int, list[int]]:
    """Qwen2-MoE's (decoder_sparse_step, mlp_only_layers) for a layer pattern: the step leaving the fewest listed
    dense layers (the smallest such step)."""
    best: tuple[int, list[int]] | None = None
    for step in range(1, len(pattern) + 1):
        by_step = [(i + 1) % step == 0 for i in range(len(pattern))]
        if any(p and not s for p, s in zip(pattern, by_step)):
            continue
        dense = [i for i, (p, s) in enumerate(zip(pattern, by_step)) if s and not p]
        if best is None or len(dense) < len(best[1]):
            best = (step, dense)
    assert best is not None  # step 1 always covers the pattern
    return best


def hf_config_from_megatron(model_config: ModelConfig | Mapping[str, Any], orig_vocab_size: int | None = None
                            ) -> tuple[str, dict[str, Any]]:
    """(model_type, MixtralConfig or Qwen2MoeConfig kwargs) describing our model (inverse of `model_kwargs`)."""
    model_type = hf_model_type(model_config)
    moe = _moe(model_config)
    heads, hidden = int(_get(model_config, "num_attention_heads")), int(_get(model_config, "hidden_size"))
    layers = int(_get(model_config, "num_layers"))
    if orig_vocab_size is None:
        orig_vocab_size = _get(model_config, "orig_vocab_size") or _get(model_config, "vocab_size")
    factor = _get(model_config, "rotary_seq_len_interpolation_factor")
    base = float(_get(model_config, "rotary_base", 10000))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": base}
    if factor is not None:
        rope = {"rope_type": "linear", "rope_theta": base, "factor": float(factor)}
    out = dict(
        vocab_size=int(orig_vocab_size), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(_get(model_config, "num_query_groups", heads)), hidden_act="silu",
        max_position_embeddings=int(_get(model_config, "max_position_embeddings")),
        initializer_range=float(_get(model_config, "init_method_std", 0.02)),
        rms_norm_eps=float(_get(model_config, "layernorm_epsilon", 1e-5)),
        tie_word_embeddings=not bool(_get(model_config, "untie_embeddings_and_output_weights", False)),
        rope_theta=base, rope_parameters=rope, attention_dropout=float(_get(model_config, "attention_dropout", 0.0)),
        num_experts_per_tok=int(moe["router_topk"]), router_aux_loss_coef=float(moe.get("aux_loss_coeff") or 0.0),
    )
    expert_ffn = int(moe.get("ffn_hidden_size") or _get(model_config, "ffn_hidden_size"))
    if model_type == "mixtral":
        return model_type, dict(out, intermediate_size=expert_ffn, num_local_experts=int(moe["num_experts"]),
                                head_dim=hidden // heads, sliding_window=None)
    step, dense = _sparse_step(moe_layer_pattern(str(moe.get("layer_freq", "1")), layers))
    return model_type, dict(
        out, intermediate_size=int(_get(model_config, "ffn_hidden_size")), moe_intermediate_size=expert_ffn,
        shared_expert_intermediate_size=int(moe["shared_expert_intermediate_size"]),
        num_experts=int(moe["num_experts"]), norm_topk_prob=not moe.get("pre_softmax", False),
        decoder_sparse_step=step, mlp_only_layers=dense, qkv_bias=bool(_get(model_config, "add_qkv_bias", False)),
        use_sliding_window=False)
