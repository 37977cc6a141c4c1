"""Convert checkpoints between Megatron-LM (legacy `torch` format, megatron-core GPT names) and ours.

Pure functions on checkpoint payloads (no files; tools/checkpoint/convert_megatron.py reads and writes the
directories). A checkpoint here is `{(tp_rank, pp_rank): payload}`, each payload the dict one
`mp_rank_TT[_PPP]/model_optim_rng.pt` holds; both sides keep the model under "model", or "model0", "model1", ...
with virtual pipeline stages.

    model = read_megatron(files)                              # or read_ours(files)
    model, layout = retarget(model, Target(tp=1, pp=1), to_megatron=False)
    out = write_ours(model, layout)                           # or write_megatron(model, layout, spec)

The two sides differ in names only: the tensors, their tensor-parallel splits and the fused QKV row layout
(megatron-core's per query group [q heads of group g; k_g; v_g], each head_dim rows; per head [q_h; k_h; v_h]
without groups) are the same. Llama-family layers convert too: rotary positions (no position table), SwiGLU
(fc1 holds [gate; up]; a tp rank's shard is [gate_r; up_r], merged and split here block by block), grouped-query
attention, RMSNorm (weights only), no biases, q/k LayerNorm, zero-centred norm weights (stored as gamma - 1 on
both sides), an untied output layer. Megatron numbers the layers of each model chunk from 0 (`decoder.layers.N` is
local to the chunk, as its loader and saver read them); ours names units globally (attn_i, mlp_i), and a chunk
may end between a layer's attention and its MLP, which Megatron cannot express.

Only weights travel: no optimizer state, RNG state or LR schedule. The iteration and consumed samples are kept,
so the result continues training with `--no-load-optim --no-load-rng` (or starts a fine-tune with `--finetune`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import UsageError
from ..pipeline.partition import default_partition, parse_partition, rank_chunks, virtual_stage_units
from ..safe_load import Foreign
from ..units import owns_output_weight, unit_names
from .checkpoint_files import check_uniform_layout
from .gpt2 import POSITION_EMBEDDING, merge_shards, padded_vocab_size, shard_state_dict

CHECKPOINT_VERSION = 3.0
MEGATRON_SPECS = ("transformer_engine", "local")
WORD_EMBEDDING = "units.embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "units.head.output_weight"
EXTRA_STATE = "_extra_state"
Files = dict[tuple[int, int], dict]

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
_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
_LAYER_KEY = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_UNIT_LAYER = re.compile(r"units\.(attn|mlp)_(\d+)\.(.+)")


@dataclass
class Layout:
    """Where the units live: tp and pp degrees, model chunks per pipeline rank, units per virtual stage."""

    tp: int
    pp: int
    virtual: int
    partition: list[int]

    def describe(self) -> str:
        v = f" virtual={self.virtual}" if self.virtual > 1 else ""
        return f"tp={self.tp} pp={self.pp}{v} partition={','.join(map(str, self.partition))}"


@dataclass
class Model:
    """A whole model in our names (tensor-parallel shards merged, pipeline stages joined) and what travels with it."""

    full: dict[str, torch.Tensor]
    config: dict[str, Any]  # ModelConfig fields (vocab_size: the padded size the tensors have)
    layout: Layout  # the layout it was read in
    iteration: int | str  # or "release"
    consumed_train_samples: int | None = None
    consumed_valid_samples: int | None = None
    orig_vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = None
    extra_args: dict[str, Any] = field(default_factory=dict)  # seed, batch sizes, tokenizer_type, ...
    notes: list[str] = field(default_factory=list)  # differences worth telling the user


@dataclass
class Target:
    """The layout and vocabulary wanted; None: keep the source's."""

    tp: int | None = None
    pp: int | None = None
    virtual: int | None = None
    partition: str | list[int] | None = None
    true_vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = None


# ----------------------------------------------------------------------------------------------------------------
# Names


def megatron_chunk_to_ours(sd: Mapping[str, Any], layer_offset: int, where: str = "checkpoint") -> dict:
    """One tp rank's state dict of one Megatron model chunk -> our names (layer numbers + `layer_offset`).

    `_extra_state` entries are dropped; any other name we cannot map is an error naming it."""
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
        if ours in out:
            raise UsageError(f"{where} holds {ours} twice (both the TE and the local layer-spec names?)")
        out[ours] = value
    return out


def ours_chunk_to_megatron(sd: Mapping[str, torch.Tensor], layer_offset: int, spec: str) -> dict:
    """One tp rank's state dict of one of our chunks -> Megatron names, layers numbered from 0 in the chunk.

    Adds the `_extra_state` entries (None) that megatron-core's modules of `spec` put into their state dicts."""
    if spec not in MEGATRON_SPECS:
        raise UsageError(f"unknown Megatron layer spec {spec!r} (choose {', '.join(MEGATRON_SPECS)})")
    column = 2 if spec == "transformer_engine" else 3
    names = {(kind, ours): row[column] for row in _LAYER_PARAMS for kind, ours in [row[:2]]}
    out: dict[str, Any] = {}
    layers: list[int] = []
    for name, t in sd.items():
        m = _UNIT_LAYER.fullmatch(name)
        if m:
            local = int(m.group(2)) - layer_offset
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


# ----------------------------------------------------------------------------------------------------------------
# Whole model <-> shards


def unit_of(name: str) -> str:
    """'units.attn_3.qkv.weight' -> 'attn_3'."""
    return name.split(".")[1]


def model_chunks(payload: Mapping[str, Any], where: str) -> list[dict]:
    """The model chunks of one rank's payload: ["model"] or ["model0", "model1", ...]."""
    if "model" in payload:
        return [payload["model"]]
    keys = sorted((int(k[5:]) for k in payload if re.fullmatch(r"model\d+", str(k))))
    if not keys:
        raise UsageError(f"{where} holds no 'model' (weights)")
    if keys != list(range(len(keys))):
        raise UsageError(f"{where} holds model chunks {keys}, expected model0..model{len(keys) - 1}")
    return [payload[f"model{i}"] for i in keys]


_FC1 = re.compile(r"units\.mlp_\d+\.fc1\.(weight|bias)")


def _merge_tp(shards: list[Mapping[str, torch.Tensor]], swiglu: bool) -> dict[str, torch.Tensor]:
    """merge_shards, with SwiGLU's fc1 put back together as [gate; up] from the ranks' [gate_r; up_r]."""
    full = merge_shards(shards)
    if swiglu and len(shards) > 1:
        for name in full:
            if _FC1.fullmatch(name):
                halves = [sd[name].chunk(2, 0) for sd in shards]
                full[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return full


def _shard_tp(sd: Mapping[str, torch.Tensor], tp: int, rank: int, swiglu: bool) -> dict[str, torch.Tensor]:
    """shard_state_dict, with SwiGLU's fc1 split block by block: rank r holds [gate_r; up_r] (Megatron's too)."""
    out = shard_state_dict(sd, tp, rank)
    if swiglu and tp > 1:
        for name, t in sd.items():
            if _FC1.fullmatch(name):
                out[name] = torch.cat([half.chunk(tp, 0)[rank] for half in t.chunk(2, 0)])
    return out


def assemble(chunks: Mapping[tuple[int, int], list[dict]], tp: int, pp: int, where: str = "checkpoint",
             swiglu: bool = False) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """{(tp_rank, pp_rank): chunk state dicts in our names} -> (full state dict, unit names of each virtual stage).

    Tensor-parallel shards are concatenated (`_merge_tp`); virtual stage k is chunk k // pp of pipeline rank
    k % pp. The tied output copy of the last stage stays in (see `drop_tied_copy`)."""
    _check_grid(chunks, tp, pp, where)
    virtual = len(chunks[0, 0])
    full: dict[str, torch.Tensor] = {}
    stages: list[list[str]] = []
    for k in range(pp * virtual):
        r, i = k % pp, k // pp
        for t in range(tp):
            if len(chunks[t, r]) != virtual:
                raise UsageError(f"{where}: rank (tp {t}, pp {r}) holds {len(chunks[t, r])} model chunks, "
                                 f"rank (0, 0) holds {virtual}")
        merged = _merge_tp([chunks[t, r][i] for t in range(tp)], swiglu)
        units: list[str] = []
        for name, tensor in merged.items():
            if name in full:
                raise UsageError(f"{where}: {name} is held by two pipeline stages")
            full[name] = tensor
            if unit_of(name) not in units:
                units.append(unit_of(name))
        stages.append(units)
    return full, stages


def _check_grid(chunks: Mapping[tuple[int, int], Any], tp: int, pp: int, where: str) -> None:
    want = {(t, r) for t in range(tp) for r in range(pp)}
    if set(chunks) != want:
        missing, extra = sorted(want - set(chunks)), sorted(set(chunks) - want)
        raise UsageError(f"{where}: tensor/pipeline parallel sizes ({tp}, {pp}) need ranks (tp, pp) {sorted(want)}; "
                         f"missing {missing}, unexpected {extra}")


def partition_of(stages: list[list[str]], num_layers: int, where: str = "checkpoint") -> list[int]:
    """Units per virtual stage, checking that the stages hold [embedding, attn_0, ..., head] in order."""
    order = {n: i for i, n in enumerate(unit_names(num_layers))}
    flat = [u for s in stages for u in s]
    unknown = [u for u in flat if u not in order]
    if unknown:
        raise UsageError(f"{where}: unit {unknown[0]} is outside a {num_layers}-layer model")
    if sorted(flat, key=order.__getitem__) != flat or len(flat) != len(order):
        missing = [n for n in order if n not in flat]
        raise UsageError(f"{where}: pipeline stages do not hold the model's units in order once each"
                         + (f" (missing {missing[:3]})" if missing else ""))
    return [len(s) for s in stages]


def drop_tied_copy(full: dict[str, torch.Tensor], untied: bool) -> None:
    """With tied embeddings the last pipeline stage holds a copy of the word embeddings as its output weight."""
    if not untied:
        full.pop(OUTPUT_WEIGHT, None)


def split(full: Mapping[str, torch.Tensor], num_layers: int, untied: bool, layout: Layout,
          swiglu: bool = False) -> dict[tuple[int, int], list[dict[str, torch.Tensor]]]:
    """Inverse of `assemble` (+ `drop_tied_copy`): {(tp_rank, pp_rank): chunk state dicts in our names}.

    The last stage gets its copy of the tied word embeddings whenever ours would hold one (units.owns_output_weight).
    Tensors are tensor-parallel shards with their own storage (`_shard_tp`)."""
    names = unit_names(num_layers)
    by_unit: dict[str, list[str]] = {}
    for name in full:
        by_unit.setdefault(unit_of(name), []).append(name)
    out: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
    for r in range(layout.pp):
        chunk_units = [[names[i] for i in c] for c in rank_chunks(layout.partition, layout.pp, r)]
        own = owns_output_weight(untied, layout.pp, [u for c in chunk_units for u in c])
        chunks = []
        for units in chunk_units:
            sd = {n: full[n] for u in units for n in by_unit.get(u, [])}
            if "head" in units and not untied and own:
                sd[OUTPUT_WEIGHT] = full[WORD_EMBEDDING]
            chunks.append(sd)
        for t in range(layout.tp):
            out[t, r] = [_shard_tp(sd, layout.tp, t, swiglu) for sd in chunks]
    return out


def expected_shapes(cfg: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Our full model's parameter names and shapes for ModelConfig fields `cfg` (tied output weight left out)."""
    m = ModelConfig(**{k: v for k, v in cfg.items() if k in _MODEL_FIELDS})
    h, v, f, d = m.hidden_size, m.vocab_size, m.ffn_hidden_size, m.head_dim
    rms, bias, qkv_bias = m.normalization == "RMSNorm", m.add_bias_linear, m.add_bias_linear or m.add_qkv_bias
    shapes: dict[str, tuple[int, ...]] = {WORD_EMBEDDING: (v, h)}
    if m.position_embedding_type == "learned_absolute":
        shapes[POSITION_EMBEDDING] = (m.max_position_embeddings, h)

    def norm(prefix: str, size: int) -> None:
        shapes[prefix + ".weight"] = (size,)
        if not rms:
            shapes[prefix + ".bias"] = (size,)

    for i in range(m.num_layers):
        a, p = f"units.attn_{i}.", f"units.mlp_{i}."
        norm(a + "input_layernorm", h)
        if m.qk_layernorm:
            norm(a + "q_layernorm", d)
            norm(a + "k_layernorm", d)
        shapes.update({a + "qkv.weight": (m.qkv_rows, h), a + "proj.weight": (h, h),
                       p + "fc1.weight": (m.fc1_rows, h), p + "fc2.weight": (h, f)})
        shapes.update({a + "qkv.bias": (m.qkv_rows,)} if qkv_bias else {})
        shapes.update({a + "proj.bias": (h,), p + "fc1.bias": (m.fc1_rows,), p + "fc2.bias": (h,)} if bias else {})
        norm(p + "post_attention_layernorm", h)
    norm("units.head.final_layernorm", h)
    if cfg.get("untie_embeddings_and_output_weights"):
        shapes[OUTPUT_WEIGHT] = (v, h)
    return shapes


def check_full(full: Mapping[str, torch.Tensor], cfg: Mapping[str, Any], where: str = "checkpoint") -> None:
    """Raise UsageError unless `full` holds exactly the parameters, with the shapes, that `cfg` implies."""
    want = expected_shapes(cfg)
    missing = [n for n in want if n not in full]
    if missing:
        more = f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""
        raise UsageError(f"{where} lacks {missing[0]}{more}")
    extra = [n for n in full if n not in want]
    if extra:
        raise UsageError(f"{where} has unexpected tensors, e.g. {extra[:3]}")
    for name, shape in want.items():
        if tuple(full[name].shape) != shape:
            raise UsageError(f"{where}: {name} has shape {tuple(full[name].shape)}, "
                             f"the model's arguments imply {shape}")


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
    if a.get("squared_relu"):
        found.append("squared_relu")
    if a.get("num_experts"):
        found.append(f"MoE (num_experts {a.get('num_experts')})")
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
    if a.get("bias_gelu_fusion") is False and not a.get("openai_gelu") and not a.get("swiglu"):
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
        swiglu=bool(a.get("swiglu")),
        num_query_groups=int(groups) if a.get("group_query_attention") and groups not in (None, heads) else None,
        normalization=a.get("normalization") or "LayerNorm",
        add_bias_linear=not (a.get("add_bias_linear") is False or a.get("disable_bias_linear")),
        add_qkv_bias=bool(a.get("add_qkv_bias")), qk_layernorm=bool(a.get("qk_layernorm")),
        apply_layernorm_1p=bool(a.get("apply_layernorm_1p") or a.get("layernorm_zero_centered_gamma")),
    )


def _model_config_from_megatron(a: Mapping[str, Any], full: Mapping[str, torch.Tensor]) -> dict[str, Any]:
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
        params_dtype=_dtype_name(full[WORD_EMBEDDING].dtype), **llama,
    )
    if not cfg["seq_length"]:
        raise UsageError("checkpoint args lack seq_length (a rotary model has no position table to tell it)")
    return ModelConfig(**cfg).to_json()  # fills defaults, validates


def _dtype_name(dtype: torch.dtype) -> str:
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if dtype not in names:
        raise UsageError(f"checkpoint weights are {dtype}, expected float32, bfloat16 or float16")
    return names[dtype]


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


_CARRIED = ("seed", "micro_batch_size", "global_batch_size", "tokenizer_type", "data_parallel_size")


# ----------------------------------------------------------------------------------------------------------------
# Reading


def read_megatron(files: Mapping[tuple[int, int], Mapping[str, Any]], iteration: int | str | None = None,
                  where: str = "checkpoint") -> Model:
    """A Megatron-LM (megatron-core GPT, legacy torch format) checkpoint's payloads -> Model."""
    if (0, 0) not in files:
        raise UsageError(f"{where} has no file of rank (tp 0, pp 0)")
    first = files[0, 0]
    if "args" not in first:
        raise UsageError(f"{where}: model_optim_rng.pt has no 'args'")
    a = args_dict(first["args"])
    version = first.get("checkpoint_version", 0) or 0
    if float(version) < 3.0:
        raise UsageError(f"{where}: checkpoint_version {version} is not supported (megatron-core checkpoints are 3.0)")
    bad = unsupported_megatron_features(a)
    if bad:
        raise UsageError(f"{where}: unsupported Megatron model: {'; '.join(bad)}")
    if int(a.get("expert_model_parallel_size") or 1) > 1:
        raise UsageError(f"{where}: unsupported Megatron model: expert parallelism")
    tp = int(a.get("tensor_model_parallel_size") or 1)
    pp = int(a.get("pipeline_model_parallel_size") or 1)
    _check_grid(files, tp, pp, where)
    raw = {key: model_chunks(p, f"{where} rank (tp {key[0]}, pp {key[1]})") for key, p in files.items()}
    virtual = len(raw[0, 0])
    chunks: dict[tuple[int, int], list[dict]] = {key: [] for key in raw}
    offset = 0
    for k in range(pp * virtual):  # virtual stage order: chunk k // pp of pipeline rank k % pp
        r, i = k % pp, k // pp
        if any(len(raw[t, r]) != virtual for t in range(tp)):
            raise UsageError(f"{where}: pipeline ranks hold different numbers of model chunks")
        n = megatron_chunk_layers(raw[0, r][i], f"{where} rank (tp 0, pp {r}) chunk {i}")
        for t in range(tp):
            sd = raw[t, r][i]
            chunk_where = f"{where} rank (tp {t}, pp {r}) chunk {i}"
            if megatron_chunk_layers(sd, chunk_where) != n:
                raise UsageError(f"{chunk_where}: tensor-parallel ranks hold different layers")
            chunks[t, r].append(megatron_chunk_to_ours(sd, offset, chunk_where))
        offset += n
    full, stages = assemble(chunks, tp, pp, where, swiglu=bool(a.get("swiglu")))
    cfg = _model_config_from_megatron(a, full)
    if offset != cfg["num_layers"]:
        raise UsageError(f"{where}: args say num_layers {cfg['num_layers']}, the pipeline stages hold {offset} layers")
    partition = partition_of(stages, cfg["num_layers"], where)
    drop_tied_copy(full, cfg["untie_embeddings_and_output_weights"])
    check_full(full, cfg, where)
    if iteration is None:
        iteration = int(first.get("iteration", a.get("iteration", 0)) or 0)
    return Model(
        full=full, config=cfg, layout=Layout(tp, pp, virtual, partition), iteration=iteration,
        consumed_train_samples=_int_or_none(a.get("consumed_train_samples")),
        consumed_valid_samples=_int_or_none(a.get("consumed_valid_samples")),
        orig_vocab_size=_int_or_none(a.get("vocab_size")),
        make_vocab_size_divisible_by=_int_or_none(a.get("make_vocab_size_divisible_by")),
        extra_args={k: a[k] for k in _CARRIED if isinstance(a.get(k), (int, str))}, notes=megatron_notes(a),
    )


def read_ours(files: Mapping[tuple[int, int], Mapping[str, Any]], iteration: int | str | None = None,
              where: str = "checkpoint") -> Model:
    """A megatron_bmw checkpoint's payloads -> Model."""
    if (0, 0) not in files:
        raise UsageError(f"{where} has no file of rank (tp 0, pp 0)")
    first = files[0, 0]
    a = args_dict(first.get("args"))
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = {k: a[k] for k in names if k in a and k != "params_dtype"}
    if isinstance(cfg.get("model_type"), Foreign):  # megatron.core's ModelType enum: Megatron-LM's own args
        raise UsageError(f"{where} holds Megatron-LM's args (model_type {type(cfg['model_type']).__name__} "
                         f"{cfg['model_type'].value}); use --direction megatron-to-ours")
    if cfg.get("model_type", "gpt") != "gpt":
        raise UsageError(f"{where} holds a {str(cfg['model_type']).upper()} model; only GPT checkpoints convert to "
                         "Megatron-LM")
    for key in ("num_layers", "hidden_size", "num_attention_heads"):
        if not isinstance(cfg.get(key), int):
            raise UsageError(f"{where}: checkpoint args lack an integer {key!r}")
    check_uniform_layout(a, where)
    tp = int(a.get("tensor_model_parallel_size") or 1)
    pp = int(a.get("pipeline_model_parallel_size") or 1)
    _check_grid(files, tp, pp, where)
    chunks = {key: model_chunks(p, f"{where} rank (tp {key[0]}, pp {key[1]})") for key, p in files.items()}
    for key, cs in chunks.items():
        for sd in cs:
            for name in sd:
                if not str(name).startswith("units."):
                    raise UsageError(f"{where} rank (tp {key[0]}, pp {key[1]}) holds {name}, not a megatron_bmw name "
                                     "(units.*); use --direction megatron-to-ours")
    full, stages = assemble(chunks, tp, pp, where, swiglu=bool(cfg.get("swiglu")))
    partition = partition_of(stages, cfg["num_layers"], where)
    if WORD_EMBEDDING not in full:
        raise UsageError(f"{where} lacks {WORD_EMBEDDING}")
    cfg["vocab_size"] = int(full[WORD_EMBEDDING].shape[0])
    if POSITION_EMBEDDING in full:
        cfg["max_position_embeddings"] = int(full[POSITION_EMBEDDING].shape[0])
    cfg["params_dtype"] = _dtype_name(full[WORD_EMBEDDING].dtype)
    cfg = ModelConfig(**cfg).to_json()  # fills defaults, validates
    drop_tied_copy(full, cfg["untie_embeddings_and_output_weights"])
    check_full(full, cfg, where)
    if iteration is None:
        iteration = int(first.get("iteration", 0) or 0)
    return Model(
        full=full, config=cfg, layout=Layout(tp, pp, len(chunks[0, 0]), partition), iteration=iteration,
        consumed_train_samples=_int_or_none(first.get("consumed_train_samples")),
        consumed_valid_samples=_int_or_none(first.get("consumed_valid_samples")),
        orig_vocab_size=_int_or_none(a.get("orig_vocab_size")),
        make_vocab_size_divisible_by=_int_or_none(a.get("make_vocab_size_divisible_by")),
        extra_args={k: a[k] for k in _CARRIED if isinstance(a.get(k), (int, str))},
    )


# ----------------------------------------------------------------------------------------------------------------
# Retargeting: layout and vocabulary padding


def megatron_partition_problem(partition: list[int]) -> str | None:
    """Why Megatron cannot hold this partition (a stage boundary between a layer's attention and MLP), or None."""
    total = 0
    for k, n in enumerate(partition[:-1]):
        total += n
        if total % 2 == 0:  # units [embedding, attn_0, mlp_0, ...]: whole layers end after an odd count
            layer = (total - 1) // 2
            return f"stage {k} ends between attn_{layer} and mlp_{layer}"
    return None


def retarget(model: Model, target: Target, to_megatron: bool) -> tuple[Model, Layout]:
    """The layout to write (target, else the source's) and the model with its vocabulary padded for it."""
    src, cfg = model.layout, model.config
    tp = src.tp if target.tp is None else target.tp  # 0 is a bad value, not "the source's"
    pp = src.pp if target.pp is None else target.pp
    virtual = (src.virtual if pp == src.pp else 1) if target.virtual is None else target.virtual
    for flag, value in (("--target-tensor-parallel-size", tp), ("--target-pipeline-model-parallel-size", pp),
                        ("--target-virtual-pipeline-model-parallel-size", virtual)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if virtual > 1 and pp == 1:
        raise UsageError("--target-virtual-pipeline-model-parallel-size > 1 needs a pipeline-parallel size > 1")
    n = cfg["num_layers"]
    if to_megatron and n < pp * virtual:
        raise UsageError(f"the model's {n} layers are fewer than the {pp * virtual} (virtual) pipeline stages, and "
                         "Megatron's stages hold whole transformer layers: give a smaller target pipeline size")
    try:
        if target.partition is not None:
            partition = parse_partition(target.partition, n, pp, virtual)
            origin = "--target-pipeline-partition"
        elif (pp, virtual) == (src.pp, src.virtual):
            partition, origin = parse_partition(list(src.partition), n, pp, virtual), "the source's pipeline partition"
        else:
            partition, origin = default_partition(n, pp, virtual), "the default pipeline partition"
    except UsageError as exc:  # name this tool's flag
        raise UsageError(str(exc).replace("--pipeline-partition", "--target-pipeline-partition")) from None
    if to_megatron:
        problem = megatron_partition_problem(partition)
        if problem:
            fix = ("give one whose stages end between layers" if origin == "--target-pipeline-partition"
                   else "give --target-pipeline-partition")
            raise UsageError(f"{origin} {','.join(map(str, partition))}: {problem}, but Megatron's pipeline stages "
                             f"hold whole transformer layers; {fix}")
    what = "--target-tensor-parallel-size" if target.tp else "the tensor-parallel size"
    for name in ("num_attention_heads", "hidden_size", "ffn_hidden_size", "num_query_groups"):
        if cfg.get(name) and cfg[name] % tp:
            raise UsageError(f"{what} {tp} does not divide {name} {cfg[name]}")
    model = dataclasses.replace(model, full=dict(model.full), config=dict(cfg))
    _repad_vocab(model, src.tp, tp, target)
    if model.config["vocab_size"] % tp:
        raise UsageError(f"{what} {tp} does not divide the padded vocabulary size {model.config['vocab_size']}")
    return model, Layout(tp, pp, virtual, partition)


def _repad_vocab(model: Model, src_tp: int, tp: int, target: Target) -> None:
    """Pad the vocabulary as a run at tensor-parallel size `tp` does: Megatron's rule, orig vocabulary rounded up to
    a multiple of make_vocab_size_divisible_by * tp. Kept as is when tp does not change and no vocabulary flag asks."""
    rows = int(model.full[WORD_EMBEDDING].shape[0])
    if tp == src_tp and target.true_vocab_size is None and target.make_vocab_size_divisible_by is None:
        return
    orig = target.true_vocab_size or model.orig_vocab_size
    if orig is None:
        raise UsageError(f"the tensor-parallel size changes ({src_tp} -> {tp}) and so does the vocabulary padding: "
                         "give --true-vocab-size (the tokenizer's vocabulary size; the checkpoint does not say it)")
    if not 0 < orig <= rows:
        raise UsageError(f"--true-vocab-size {orig} does not fit the checkpoint's {rows} vocabulary rows")
    divisible = target.make_vocab_size_divisible_by or model.make_vocab_size_divisible_by
    if divisible is None:
        divisible = infer_divisible_by(orig, rows, src_tp)
        if divisible is None:
            raise UsageError(f"cannot tell how vocabulary {orig} was padded to {rows} rows: "
                             "give --make-vocab-size-divisible-by")
    new_rows = padded_vocab_size(orig, divisible, tp)
    model.orig_vocab_size, model.make_vocab_size_divisible_by = orig, divisible
    model.config["vocab_size"] = new_rows
    names = [WORD_EMBEDDING] + ([OUTPUT_WEIGHT] if OUTPUT_WEIGHT in model.full else [])
    for name in names:
        t = model.full[name]
        if new_rows <= rows:
            model.full[name] = t[:new_rows]
        else:
            model.full[name] = torch.cat([t, t.new_zeros((new_rows - rows, t.size(1)))])


def infer_divisible_by(orig: int | None, rows: int, tp: int) -> int | None:
    """The largest make_vocab_size_divisible_by (a power of two up to Megatron's default 128) that pads `orig` to
    `rows` at tensor-parallel size `tp`; None when none does or `orig` is unknown."""
    if orig is None:
        return None
    return next((d for d in (128, 64, 32, 16, 8, 4, 2, 1) if padded_vocab_size(orig, d, tp) == rows), None)


# ----------------------------------------------------------------------------------------------------------------
# Writing


def _iteration_number(model: Model) -> int:
    return 0 if model.iteration == "release" else int(model.iteration)


def ours_args(model: Model, layout: Layout) -> dict[str, Any]:
    """The `args` dict our Trainer writes (training/loop.py `_args_dict`), for `model` at `layout`."""
    cfg = ModelConfig(**model.config)
    d = {k: v for k, v in cfg.to_json().items() if k != "params_dtype"}
    d.update(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
             padded_vocab_size=cfg.vocab_size, orig_vocab_size=model.orig_vocab_size,
             pipeline_partition=list(layout.partition), params_dtype=str(cfg.torch_dtype),
             virtual_pipeline_model_parallel_size=layout.virtual,
             make_vocab_size_divisible_by=model.make_vocab_size_divisible_by
             or infer_divisible_by(model.orig_vocab_size, cfg.vocab_size, layout.tp))
    if model.consumed_train_samples is not None:
        d["consumed_train_samples"] = model.consumed_train_samples
    if model.consumed_valid_samples is not None:
        d["consumed_valid_samples"] = model.consumed_valid_samples
    d.update({k: v for k, v in model.extra_args.items() if k not in d})
    return d


def write_ours(model: Model, layout: Layout) -> Files:
    """Model -> {(tp_rank, pp_rank): payload} in our Trainer's checkpoint format (weights, iteration, samples)."""
    check_full(model.full, model.config)
    args = ours_args(model, layout)
    it = _iteration_number(model)
    out: Files = {}
    cfg = model.config
    for key, chunks in split(model.full, cfg["num_layers"], cfg["untie_embeddings_and_output_weights"], layout,
                             bool(cfg.get("swiglu"))).items():
        payload: dict[str, Any] = {"iteration": it, "args": dict(args), "checkpoint_version": CHECKPOINT_VERSION}
        if model.consumed_train_samples is not None:
            payload["consumed_train_samples"] = model.consumed_train_samples
        if model.consumed_valid_samples is not None:
            payload["consumed_valid_samples"] = model.consumed_valid_samples
        if len(chunks) == 1:
            payload["model"] = chunks[0]
        else:
            payload.update({f"model{i}": c for i, c in enumerate(chunks)})
        out[key] = payload
    return out


def megatron_args(model: Model, layout: Layout, spec: str, tokenizer_type: str | None = None) -> argparse.Namespace:
    """The `args` Namespace a Megatron-LM run with this model and layout saves (the fields its loader reads)."""
    cfg = ModelConfig(**model.config)
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    stage_layers = megatron_stage_layers(layout, cfg.num_layers)
    divisible = (model.make_vocab_size_divisible_by
                 or infer_divisible_by(model.orig_vocab_size, cfg.vocab_size, layout.tp) or 128)
    dp = int(model.extra_args.get("data_parallel_size") or 1)
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
        init_method_std=cfg.init_method_std, swiglu=cfg.swiglu, squared_relu=False, openai_gelu=False,
        bias_gelu_fusion=not cfg.swiglu, bias_swiglu_fusion=cfg.swiglu, add_bias_linear=cfg.add_bias_linear,
        add_qkv_bias=cfg.add_qkv_bias, disable_bias_linear=not cfg.add_bias_linear,
        qk_layernorm=cfg.qk_layernorm, apply_residual_connection_post_layernorm=False, num_experts=None,
        fp16=dtype == torch.float16, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.virtual if layout.virtual > 1 else None,
        num_layers_per_virtual_pipeline_stage=stage_layers[0] if layout.virtual > 1 and len(set(stage_layers)) == 1
        else None,
        data_parallel_size=dp, world_size=layout.tp * layout.pp * dp,
        transformer_impl=spec, use_legacy_models=False, use_mcore_models=True, ckpt_format="torch",
        bert_binary_head=False, iteration=_iteration_number(model),
        consumed_train_samples=model.consumed_train_samples or 0,
        consumed_valid_samples=model.consumed_valid_samples or 0, skipped_train_samples=0,
        **{k: model.extra_args[k] for k in ("seed", "micro_batch_size", "global_batch_size")
           if k in model.extra_args},
    )


def write_megatron(model: Model, layout: Layout, spec: str = "transformer_engine",
                   tokenizer_type: str | None = None) -> Files:
    """Model -> {(tp_rank, pp_rank): payload} as Megatron-LM saves with --ckpt-format torch (weights only)."""
    if spec not in MEGATRON_SPECS:
        raise UsageError(f"unknown Megatron layer spec {spec!r} (choose {', '.join(MEGATRON_SPECS)})")
    problem = megatron_partition_problem(layout.partition)
    if problem:
        raise UsageError(f"pipeline partition {','.join(map(str, layout.partition))}: {problem}; "
                         "Megatron's pipeline stages hold whole transformer layers")
    check_full(model.full, model.config)
    args = megatron_args(model, layout, spec, tokenizer_type)
    names = unit_names(model.config["num_layers"])
    stages = virtual_stage_units(layout.partition)
    first_layer = []  # global index of each virtual stage's first layer
    done = 0
    for units in stages:
        first_layer.append(done)
        done += sum(1 for i in units if names[i].startswith("attn_"))
    out: Files = {}
    for (t, r), chunks in split(model.full, model.config["num_layers"],
                                model.config["untie_embeddings_and_output_weights"], layout,
                                bool(model.config.get("swiglu"))).items():
        converted = [ours_chunk_to_megatron(sd, first_layer[i * layout.pp + r], spec) for i, sd in enumerate(chunks)]
        payload: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                                   "iteration": _iteration_number(model), "num_floating_point_operations_so_far": 0}
        if len(converted) == 1:
            payload["model"] = converted[0]
        else:
            payload.update({f"model{i}": c for i, c in enumerate(converted)})
        out[t, r] = payload
    return out


def megatron_stage_layers(layout: Layout, num_layers: int) -> list[int]:
    """Transformer layers per virtual stage (what Megatron must build: even, or --decoder-first/last-... flags)."""
    names = unit_names(num_layers)
    return [sum(1 for i in units if names[i].startswith("attn_")) for units in virtual_stage_units(layout.partition)]
