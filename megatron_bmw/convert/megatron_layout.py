"""A whole model <-> its tensor- and pipeline-parallel shards, and the layout and vocabulary padding it is written in.

`assemble` joins the chunk state dicts of every (tp, pp) rank (in our names) into one full state dict and the units
of each virtual stage; `split` is its inverse for a `Layout`. `retarget` picks the layout to write (a `Target`, else
the source's) and pads the vocabulary as a run at the new tensor-parallel size does. `check_full` holds a full state
dict to the shapes a ModelConfig implies.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import UsageError
from ..pipeline.partition import default_partition, parse_partition, rank_chunks, virtual_stage_units
from ..units import owns_output_weight, unit_names
from ..config import padded_vocab_size
from .gpt2 import POSITION_EMBEDDING, merge_shards, shard_state_dict
from .megatron_names import OUTPUT_WEIGHT, WORD_EMBEDDING

_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


@dataclass
class Layout:
    """Where the units live: tp and pp degrees, model chunks per pipeline rank, units per virtual stage."""

    tp: int
    pp: int
    virtual: int
    partition: list[int]
    ep: int = 1  # ranks the experts of MoE layers are split over (their tensor-parallel size is tp)

    def describe(self) -> str:
        v = f" virtual={self.virtual}" if self.virtual > 1 else ""
        e = f" ep={self.ep}" if self.ep > 1 else ""
        return f"tp={self.tp} pp={self.pp}{v}{e} partition={','.join(map(str, self.partition))}"


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
    ep: int | None = None


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


def _merge_tp(shards: list[Mapping[str, torch.Tensor]], swiglu: bool) -> dict[str, torch.Tensor]:
    """merge_shards, with SwiGLU's fc1 (dense, shared experts', every expert's) put back together as [gate; up] from
    the ranks' [gate_r; up_r]."""
    return merge_shards(shards, swiglu=swiglu)


def _shard_tp(sd: Mapping[str, torch.Tensor], tp: int, rank: int, swiglu: bool) -> dict[str, torch.Tensor]:
    """shard_state_dict, with SwiGLU's fc1 split block by block: rank r holds [gate_r; up_r] (Megatron's too)."""
    return shard_state_dict(sd, tp, rank, swiglu=swiglu)


def assemble(chunks: Mapping[tuple[int, int], list[dict]], tp: int, pp: int, where: str = "checkpoint",
             swiglu: bool = False) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """{(tp_rank, pp_rank): chunk state dicts in our names} -> (full state dict, unit names of each virtual stage).

    Tensor-parallel shards are concatenated (`_merge_tp`); virtual stage k is chunk k // pp of pipeline rank
    k % pp. The tied output copy of the last stage stays in (see `drop_tied_copy`)."""
    check_grid(chunks, tp, pp, where)
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


def check_grid(chunks: Mapping[tuple[int, int], Any], tp: int, pp: int, where: str) -> None:
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
        shapes.update({a + "qkv.weight": (m.qkv_rows, h), a + "proj.weight": (h, h)})
        shapes.update({a + "qkv.bias": (m.qkv_rows,)} if qkv_bias else {})
        shapes.update({a + "proj.bias": (h,)} if bias else {})
        shapes.update(moe_shapes(m, p) if m.moe_layer(i) else mlp_shapes(p, m.fc1_rows, f, h, bias))
        norm(p + "post_attention_layernorm", h)
    norm("units.head.final_layernorm", h)
    if cfg.get("untie_embeddings_and_output_weights"):
        shapes[OUTPUT_WEIGHT] = (v, h)
    return shapes


def mlp_shapes(prefix: str, rows: int, ffn: int, h: int, bias: bool) -> dict[str, tuple[int, ...]]:
    """A dense MLP's fc1 and fc2 (and biases) under `prefix`."""
    shapes = {prefix + "fc1.weight": (rows, h), prefix + "fc2.weight": (h, ffn)}
    shapes.update({prefix + "fc1.bias": (rows,), prefix + "fc2.bias": (h,)} if bias else {})
    return shapes


def moe_shapes(m: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """An MoE unit's router, stacked experts and shared experts (docs/moe.md), norm left out."""
    e, h, f, bias = m.moe.num_experts, m.hidden_size, m.moe_ffn_hidden_size, m.add_bias_linear
    rows = 2 * f if m.swiglu else f
    shapes = {prefix + "router.weight": (e, h), prefix + "experts.fc1.weight": (e, rows, h),
              prefix + "experts.fc2.weight": (e, h, f)}
    shapes.update({prefix + "experts.fc1.bias": (e, rows), prefix + "experts.fc2.bias": (e, h)} if bias else {})
    fs = m.moe.shared_expert_intermediate_size
    if fs:
        shapes.update(mlp_shapes(prefix + "shared_expert.", 2 * fs if m.swiglu else fs, fs, h, bias))
        shapes.update({prefix + "shared_expert_gate.weight": (1, h)} if m.moe.shared_expert_gate else {})
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
    moe = cfg.get("moe") or {}
    for name, size in (("num_attention_heads", cfg.get("num_attention_heads")), ("hidden_size", cfg.get("hidden_size")),
                       ("ffn_hidden_size", cfg.get("ffn_hidden_size")), ("num_query_groups", cfg.get("num_query_groups")),
                       ("moe_ffn_hidden_size", moe.get("ffn_hidden_size")),
                       ("moe_shared_expert_intermediate_size", moe.get("shared_expert_intermediate_size"))):
        if size and size % tp:
            raise UsageError(f"{what} {tp} does not divide {name} {size}")
    ep = (src.ep if target.ep is None else target.ep) if moe else 1
    if ep < 1 or (target.ep not in (None, 1) and not moe):
        raise UsageError(f"--target-expert-model-parallel-size {target.ep}: " +
                         ("must be >= 1" if ep < 1 else "the model has no experts"))
    if moe and moe["num_experts"] % ep:
        raise UsageError(f"the expert-parallel size {ep} does not divide the {moe['num_experts']} experts")
    model = dataclasses.replace(model, full=dict(model.full), config=dict(cfg))
    _repad_vocab(model, src.tp, tp, target)
    if model.config["vocab_size"] % tp:
        raise UsageError(f"{what} {tp} does not divide the padded vocabulary size {model.config['vocab_size']}")
    return model, Layout(tp, pp, virtual, partition, ep)


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


def megatron_stage_layers(layout: Layout, num_layers: int) -> list[int]:
    """Transformer layers per virtual stage (what Megatron must build: even, or --decoder-first/last-... flags)."""
    names = unit_names(num_layers)
    return [sum(1 for i in units if names[i].startswith("attn_")) for units in virtual_stage_units(layout.partition)]
