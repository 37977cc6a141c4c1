"""Convert weights between Hugging Face GPT-2 and our GPT units, and (un)shard them over tensor parallelism.

Pure functions on state dicts (no files, no process groups):

    kwargs, full = hf_to_megatron(hf_sd, hf_config, make_vocab_size_divisible_by=128, tp=2)
    shards = [shard_state_dict(full, 2, r) for r in range(2)]     # one ModelChunk state dict per tp rank
    hf_sd = megatron_to_hf(merge_shards(shards), {**kwargs, "orig_vocab_size": hf_config["vocab_size"]})

Layout differences handled here:
  * HF `Conv1D` weights are [in, out]; our linear weights are [out, in] (transposed).
  * HF `c_attn` output columns are [q (all heads) | k | v]; our fused QKV rows are [head, (q|k|v), head_dim],
    so that a contiguous tensor-parallel shard holds whole heads.
  * Our vocabulary is padded with zero rows to a multiple of `make_vocab_size_divisible_by * tp`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import torch

from ..config import ModelConfig
from ..config import padded_vocab_size
from ..errors import UsageError
from .hf_files import HFTensors
from .tp_shards import merge_shards, partition_dim, refuse_llama, shard_state_dict  # noqa: F401 - part of this module's API

# GPT2Config's defaults (GPT-2 small), for config.json files that leave keys out.
HF_GPT2_DEFAULTS: dict[str, Any] = dict(
    vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
    activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, layer_norm_epsilon=1e-5,
    initializer_range=0.02, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
    add_cross_attention=False, tie_word_embeddings=True,
)
HF_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")  # tanh-approximated GeLU, as in our MLP
_HF_IGNORED = re.compile(r"(^|\.)attn\.(bias|masked_bias)$")  # causal-mask buffers of older GPT-2 checkpoints
POSITION_EMBEDDING = "units.embedding.position_embeddings"  # a bare nn.Parameter in models/gpt.py (no ".weight")


# ----------------------------------------------------------------------------------------------------------------
# Vocabulary padding


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.size(0) == rows:
        return t.contiguous()
    return torch.cat([t, t.new_zeros((rows - t.size(0),) + tuple(t.shape[1:]))], dim=0)


# ----------------------------------------------------------------------------------------------------------------
# QKV layout


def _qkv_hf_to_ours(weight: torch.Tensor, bias: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Conv1D [h, 3h] with columns [q|k|v] x [head, d] -> ours [3h, h] with rows [head, q|k|v, d]."""
    h = weight.size(0)
    d = h // heads
    w = weight.t().reshape(3, heads, d, h).transpose(0, 1).reshape(3 * h, h).contiguous()
    b = bias.reshape(3, heads, d).transpose(0, 1).reshape(3 * h).contiguous()
    return w, b


def _qkv_ours_to_hf(weight: torch.Tensor, bias: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `_qkv_hf_to_ours`."""
    h = weight.size(1)
    d = h // heads
    w = weight.reshape(heads, 3, d, h).transpose(0, 1).reshape(3 * h, h).t().contiguous()
    b = bias.reshape(heads, 3, d).transpose(0, 1).reshape(3 * h).contiguous()
    return w, b


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face -> ours


def check_hf_config(hf_config: Mapping[str, Any]) -> None:
    """Raise UsageError unless the HF config describes a GPT-2 that our units compute exactly."""
    model_type = hf_config.get("model_type", "gpt2")
    if model_type != "gpt2":
        raise UsageError(f"--hf-dir holds a {model_type!r} model, only 'gpt2' is supported")
    act = hf_config.get("activation_function", "gelu_new")
    if act not in HF_ACTIVATIONS:
        raise UsageError(f"--hf-dir: activation_function {act!r} is not supported (need one of {HF_ACTIVATIONS})")
    for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)):
        if bool(hf_config.get(key, want)) != want:
            raise UsageError(f"--hf-dir: config {key}={hf_config.get(key)!r} is not supported (need {want})")
    for key in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions"):
        if not isinstance(hf_config.get(key), int):
            raise UsageError(f"--hf-dir: config.json lacks an integer {key!r}")


def hf_to_megatron(hf_state_dict: Mapping[str, torch.Tensor], hf_config_dict: Mapping[str, Any],
                   make_vocab_size_divisible_by: int = 128, tp: int = 1
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """HF GPT2LMHeadModel weights -> (ModelConfig kwargs, full unsharded state dict of our ModelChunk).

    The vocabulary is padded with zero rows to a multiple of `make_vocab_size_divisible_by * tp`.
    """
    cfg = {**HF_GPT2_DEFAULTS, **hf_config_dict}
    check_hf_config(cfg)
    layers, h, heads = cfg["n_layer"], cfg["n_embd"], cfg["n_head"]
    ffn = cfg.get("n_inner") or 4 * h
    orig_vocab = cfg["vocab_size"]
    vocab = padded_vocab_size(orig_vocab, make_vocab_size_divisible_by, tp)
    tied = bool(cfg.get("tie_word_embeddings", True))
    if tp < 1:
        raise UsageError(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if h % heads:
        raise UsageError(f"--hf-dir: n_embd {h} is not divisible by n_head {heads}")
    if heads % tp:
        raise UsageError(f"--tensor-model-parallel-size {tp} does not divide the {heads} attention heads")

    src = {k.removeprefix("transformer."): v for k, v in hf_state_dict.items() if not _HF_IGNORED.search(k)}
    tensors = HFTensors(src)
    take = tensors.take

    sd: dict[str, torch.Tensor] = {}
    sd["units.embedding.word_embeddings.weight"] = _pad_rows(take("wte.weight", (orig_vocab, h)), vocab)
    sd[POSITION_EMBEDDING] = take("wpe.weight", (cfg["n_positions"], h)).contiguous()
    for i in range(layers):
        p, a, m = f"h.{i}.", f"units.attn_{i}.", f"units.mlp_{i}."
        sd[a + "input_layernorm.weight"] = take(p + "ln_1.weight", (h,))
        sd[a + "input_layernorm.bias"] = take(p + "ln_1.bias", (h,))
        w, b = _qkv_hf_to_ours(take(p + "attn.c_attn.weight", (h, 3 * h)), take(p + "attn.c_attn.bias", (3 * h,)),
                               heads)
        sd[a + "qkv.weight"], sd[a + "qkv.bias"] = w, b
        sd[a + "proj.weight"] = take(p + "attn.c_proj.weight", (h, h)).t().contiguous()
        sd[a + "proj.bias"] = take(p + "attn.c_proj.bias", (h,))
        sd[m + "post_attention_layernorm.weight"] = take(p + "ln_2.weight", (h,))
        sd[m + "post_attention_layernorm.bias"] = take(p + "ln_2.bias", (h,))
        sd[m + "fc1.weight"] = take(p + "mlp.c_fc.weight", (h, ffn)).t().contiguous()
        sd[m + "fc1.bias"] = take(p + "mlp.c_fc.bias", (ffn,))
        sd[m + "fc2.weight"] = take(p + "mlp.c_proj.weight", (ffn, h)).t().contiguous()
        sd[m + "fc2.bias"] = take(p + "mlp.c_proj.bias", (h,))
    sd["units.head.final_layernorm.weight"] = take("ln_f.weight", (h,))
    sd["units.head.final_layernorm.bias"] = take("ln_f.bias", (h,))
    if tied:
        src.pop("lm_head.weight", None)  # the same tensor as wte when tied
    else:
        sd["units.head.output_weight"] = _pad_rows(take("lm_head.weight", (orig_vocab, h)), vocab)
    tensors.check_all_taken()

    kwargs: dict[str, Any] = dict(
        num_layers=layers, hidden_size=h, num_attention_heads=heads, ffn_hidden_size=ffn, vocab_size=vocab,
        seq_length=cfg["n_positions"], max_position_embeddings=cfg["n_positions"],
        layernorm_epsilon=float(cfg.get("layer_norm_epsilon", 1e-5)), untie_embeddings_and_output_weights=not tied,
        hidden_dropout=float(cfg.get("resid_pdrop", 0.1)), attention_dropout=float(cfg.get("attn_pdrop", 0.1)),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
    )
    ModelConfig(**kwargs).check_tensor_parallel(tp)  # validates the result (raises UsageError)
    return kwargs, sd


# ----------------------------------------------------------------------------------------------------------------
# Ours -> Hugging Face


def _field(model_config: ModelConfig | Mapping[str, Any], key: str, default: Any = None) -> Any:
    if isinstance(model_config, Mapping):
        return model_config.get(key, default)
    return getattr(model_config, key, default)



class Taker:
    """An export's reader of our state dict: `take(name)` pops a tensor from a copy of it, noting the names it lacks
    (an empty tensor stands in); `drop` forgets one; `done` raises the missing or left-over names in one line."""

    def __init__(self, state_dict) -> None:
        self.sd, self.missing = dict(state_dict), []

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.sd:
            self.missing.append(name)
            return torch.empty(0)
        return self.sd.pop(name)

    def drop(self, name: str) -> None:
        self.sd.pop(name, None)

    def done(self) -> None:
        if self.missing:
            raise UsageError(f"checkpoint lacks parameters, e.g. {self.missing[:3]}")
        if self.sd:
            raise UsageError(f"checkpoint has unexpected parameters, e.g. {sorted(self.sd)[:3]}")


def megatron_to_hf(full_state_dict: Mapping[str, torch.Tensor], model_config: ModelConfig | Mapping[str, Any],
                   orig_vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """Full (merged) state dict of our ModelChunk -> HF GPT2LMHeadModel state dict.

    `model_config` is a ModelConfig or a checkpoint's "args" dict; padded vocabulary rows beyond
    `orig_vocab_size` (default: args["orig_vocab_size"], else no stripping) are dropped.
    """
    refuse_llama(model_config if isinstance(model_config, Mapping) else dataclasses.asdict(model_config), "--load")
    layers = int(_field(model_config, "num_layers"))
    heads = int(_field(model_config, "num_attention_heads"))
    untied = bool(_field(model_config, "untie_embeddings_and_output_weights", False))
    if orig_vocab_size is None:
        orig_vocab_size = _field(model_config, "orig_vocab_size")
    take = Taker(full_state_dict)
    if POSITION_EMBEDDING + ".weight" in take.sd and POSITION_EMBEDDING not in take.sd:  # the module-style name
        take.sd[POSITION_EMBEDDING] = take.sd.pop(POSITION_EMBEDDING + ".weight")

    wte = take("units.embedding.word_embeddings.weight")
    vocab = wte.size(0) if orig_vocab_size is None else int(orig_vocab_size)
    out: dict[str, torch.Tensor] = {"transformer.wte.weight": wte[:vocab].contiguous(),
                                    "transformer.wpe.weight": take(POSITION_EMBEDDING)}
    for i in range(layers):
        p, a, m = f"transformer.h.{i}.", f"units.attn_{i}.", f"units.mlp_{i}."
        out[p + "ln_1.weight"] = take(a + "input_layernorm.weight")
        out[p + "ln_1.bias"] = take(a + "input_layernorm.bias")
        qkv_w, qkv_b = take(a + "qkv.weight"), take(a + "qkv.bias")
        if not take.missing:
            out[p + "attn.c_attn.weight"], out[p + "attn.c_attn.bias"] = _qkv_ours_to_hf(qkv_w, qkv_b, heads)
        out[p + "attn.c_proj.weight"] = take(a + "proj.weight").t().contiguous()
        out[p + "attn.c_proj.bias"] = take(a + "proj.bias")
        out[p + "ln_2.weight"] = take(m + "post_attention_layernorm.weight")
        out[p + "ln_2.bias"] = take(m + "post_attention_layernorm.bias")
        out[p + "mlp.c_fc.weight"] = take(m + "fc1.weight").t().contiguous()
        out[p + "mlp.c_fc.bias"] = take(m + "fc1.bias")
        out[p + "mlp.c_proj.weight"] = take(m + "fc2.weight").t().contiguous()
        out[p + "mlp.c_proj.bias"] = take(m + "fc2.bias")
    out["transformer.ln_f.weight"] = take("units.head.final_layernorm.weight")
    out["transformer.ln_f.bias"] = take("units.head.final_layernorm.bias")
    if untied:
        out["lm_head.weight"] = take("units.head.output_weight")[:vocab].contiguous()
    else:
        take.drop("units.head.output_weight")  # a pipeline copy of the tied embedding
        out["lm_head.weight"] = out["transformer.wte.weight"]
    take.done()
    return out


def hf_config_from_megatron(model_config: ModelConfig | Mapping[str, Any],
                            orig_vocab_size: int | None = None) -> dict[str, Any]:
    """GPT2Config kwargs describing our model (inverse of the config part of `hf_to_megatron`)."""
    h = int(_field(model_config, "hidden_size"))
    ffn = int(_field(model_config, "ffn_hidden_size") or 4 * h)
    if orig_vocab_size is None:
        orig_vocab_size = _field(model_config, "orig_vocab_size") or _field(model_config, "vocab_size")
    vocab = int(orig_vocab_size)
    eos = 50256 if vocab > 50256 else None  # GPT-2's <|endoftext|>, when the vocabulary has it
    return dict(
        vocab_size=vocab, n_positions=int(_field(model_config, "max_position_embeddings")), n_embd=h,
        n_layer=int(_field(model_config, "num_layers")), n_head=int(_field(model_config, "num_attention_heads")),
        n_inner=None if ffn == 4 * h else ffn, activation_function="gelu_new",
        resid_pdrop=float(_field(model_config, "hidden_dropout", 0.1)),
        embd_pdrop=float(_field(model_config, "hidden_dropout", 0.1)),
        attn_pdrop=float(_field(model_config, "attention_dropout", 0.1)),
        layer_norm_epsilon=float(_field(model_config, "layernorm_epsilon", 1e-5)),
        initializer_range=float(_field(model_config, "init_method_std", 0.02)),
        tie_word_embeddings=not bool(_field(model_config, "untie_embeddings_and_output_weights", False)),
        bos_token_id=eos, eos_token_id=eos,
    )
