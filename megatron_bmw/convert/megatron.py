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

This module reads and writes the payloads; the pieces live beside it: `megatron_names.py` (one chunk's names,
Megatron's <-> ours), `megatron_layout.py` (the whole model <-> its tp x pp shards, retargeting the layout and the
vocabulary padding), `megatron_args.py` (Megatron's saved arguments -> a ModelConfig, and the args each side
writes), `mcore_dist.py` (megatron-core's torch_dist layout). Their public names are importable from here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ..config import ModelConfig
from ..errors import UsageError
from ..pipeline.partition import virtual_stage_units
from ..safe_load import Foreign
from ..units import unit_names
from .checkpoint_files import check_uniform_layout
from .tp_shards import join_experts, split_experts
from .megatron_moe import DIST, EXPERT_LAYOUTS
from .gpt2 import POSITION_EMBEDDING
from .megatron_args import (
    CARRIED_ARGS, args_dict, dtype_name, expert_parallel_size, int_or_none, iteration_number, megatron_args,
    megatron_notes, model_config_from_megatron, ours_args, unsupported_megatron_features,
)
from .megatron_layout import (  # noqa: F401 - the layout's names are this module's API too
    Layout, Model, Target, assemble, check_full, check_grid, drop_tied_copy, megatron_partition_problem,
    megatron_stage_layers, model_chunks, partition_of, retarget, split,
)
from .megatron_names import (  # noqa: F401 - as are the names'
    EXTRA_STATE, MEGATRON_SPECS, OUTPUT_WEIGHT, WORD_EMBEDDING, megatron_chunk_layers, megatron_chunk_to_ours,
    ours_chunk_to_megatron,
)

CHECKPOINT_VERSION = 3.0
Files = dict[tuple, dict]  # (tp, pp) or, with experts over ep ranks, (tp, pp, ep)


# ----------------------------------------------------------------------------------------------------------------
# Reading


def by_expert_rank(files: Mapping[tuple, Any], where: str) -> dict[int, dict[tuple[int, int], Any]]:
    """{(tp, pp) or (tp, pp, ep): payload} -> {ep rank: {(tp, pp): payload}}."""
    out: dict[int, dict[tuple[int, int], Any]] = {}
    for key, payload in files.items():
        if len(key) not in (2, 3):
            raise UsageError(f"{where}: rank key {key} is not (tp, pp) or (tp, pp, ep)")
        out.setdefault(key[2] if len(key) == 3 else 0, {})[key[0], key[1]] = payload
    if sorted(out) != list(range(len(out))):
        raise UsageError(f"{where}: expert-parallel ranks {sorted(out)} are not 0..{len(out) - 1}")
    return out


def _first_payload(files: Mapping[tuple, Any], where: str) -> Any:
    for key in ((0, 0), (0, 0, 0)):
        if key in files:
            return files[key]
    raise UsageError(f"{where} has no file of rank (tp 0, pp 0)")


def _megatron_ep_chunks(files: Mapping[tuple[int, int], Any], tp: int, pp: int, where: str,
                        local_experts: int | None) -> tuple[dict[tuple[int, int], list[dict]], int]:
    """One ep rank's Megatron payloads -> ({(tp, pp): chunk state dicts in our names}, layers held)."""
    check_grid(files, tp, pp, where)
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
            chunks[t, r].append(megatron_chunk_to_ours(sd, offset, chunk_where, local_experts))
        offset += n
    return chunks, offset


def _assemble_experts(per_ep: list[dict[tuple[int, int], list[dict]]], tp: int, pp: int, where: str,
                      swiglu: bool) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """`assemble` of each ep rank's chunks, the ranks' experts joined in ep order (the rest from ep rank 0)."""
    fulls = [assemble(chunks, tp, pp, f"{where} (ep rank {e})" if len(per_ep) > 1 else where, swiglu=swiglu)
             for e, chunks in enumerate(per_ep)]
    if any(stages != fulls[0][1] for _, stages in fulls[1:]):
        raise UsageError(f"{where}: the expert-parallel ranks hold different pipeline stages")
    return join_experts([full for full, _ in fulls]), fulls[0][1]


def read_megatron(files: Mapping[tuple, Mapping[str, Any]], iteration: int | str | None = None,
                  where: str = "checkpoint") -> Model:
    """A Megatron-LM (megatron-core GPT, legacy torch format) checkpoint's payloads, keyed (tp, pp) or with
    experts over ep ranks (tp, pp, ep) -> Model."""
    first = _first_payload(files, where)
    if "args" not in first:
        raise UsageError(f"{where}: model_optim_rng.pt has no 'args'")
    a = args_dict(first["args"])
    version = first.get("checkpoint_version", 0) or 0
    if float(version) < 3.0:
        raise UsageError(f"{where}: checkpoint_version {version} is not supported (megatron-core checkpoints are 3.0)")
    bad = unsupported_megatron_features(a)
    if bad:
        raise UsageError(f"{where}: unsupported Megatron model: {'; '.join(bad)}")
    tp = int(a.get("tensor_model_parallel_size") or 1)
    pp = int(a.get("pipeline_model_parallel_size") or 1)
    ep = expert_parallel_size(a, where)
    grouped = by_expert_rank(files, where)
    if len(grouped) != ep:
        raise UsageError(f"{where}: args say expert_model_parallel_size {ep}, the checkpoint holds {len(grouped)} "
                         "expert ranks")
    local = int(a["num_experts"]) // ep if a.get("num_experts") else None
    per_ep = [_megatron_ep_chunks(grouped[e], tp, pp, where, local) for e in range(ep)]
    full, stages = _assemble_experts([c for c, _ in per_ep], tp, pp, where, bool(a.get("swiglu")))
    offset = per_ep[0][1]
    cfg = model_config_from_megatron(a, full)
    if offset != cfg["num_layers"]:
        raise UsageError(f"{where}: args say num_layers {cfg['num_layers']}, the pipeline stages hold {offset} layers")
    partition = partition_of(stages, cfg["num_layers"], where)
    drop_tied_copy(full, cfg["untie_embeddings_and_output_weights"])
    check_full(full, cfg, where)
    if iteration is None:
        iteration = int(first.get("iteration", a.get("iteration", 0)) or 0)
    return Model(
        full=full, config=cfg, layout=Layout(tp, pp, len(per_ep[0][0][0, 0]), partition, ep), iteration=iteration,
        consumed_train_samples=int_or_none(a.get("consumed_train_samples")),
        consumed_valid_samples=int_or_none(a.get("consumed_valid_samples")),
        orig_vocab_size=int_or_none(a.get("vocab_size")),
        make_vocab_size_divisible_by=int_or_none(a.get("make_vocab_size_divisible_by")),
        extra_args={k: a[k] for k in CARRIED_ARGS if isinstance(a.get(k), (int, str))}, notes=megatron_notes(a),
    )


def read_ours(files: Mapping[tuple, Mapping[str, Any]], iteration: int | str | None = None,
              where: str = "checkpoint") -> Model:
    """A megatron_bmw checkpoint's payloads, keyed (tp, pp) or (tp, pp, ep) -> Model."""
    first = _first_payload(files, where)
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
    ep = expert_parallel_size(a, where)
    grouped = by_expert_rank(files, where)
    if len(grouped) != ep:
        raise UsageError(f"{where}: args say expert_model_parallel_size {ep}, the checkpoint holds {len(grouped)} "
                         "expert ranks")
    per_ep = []
    for e in range(ep):
        check_grid(grouped[e], tp, pp, where)
        chunks = {key: model_chunks(p, f"{where} rank (tp {key[0]}, pp {key[1]})") for key, p in grouped[e].items()}
        for key, cs in chunks.items():
            bad = [name for sd in cs for name in sd if not str(name).startswith("units.")]
            if bad:
                raise UsageError(f"{where} rank (tp {key[0]}, pp {key[1]}) holds {bad[0]}, not a megatron_bmw name "
                                 "(units.*); use --direction megatron-to-ours")
        per_ep.append(chunks)
    full, stages = _assemble_experts(per_ep, tp, pp, where, bool(cfg.get("swiglu")))
    partition = partition_of(stages, cfg["num_layers"], where)
    if WORD_EMBEDDING not in full:
        raise UsageError(f"{where} lacks {WORD_EMBEDDING}")
    cfg["vocab_size"] = int(full[WORD_EMBEDDING].shape[0])
    if POSITION_EMBEDDING in full:
        cfg["max_position_embeddings"] = int(full[POSITION_EMBEDDING].shape[0])
    cfg["params_dtype"] = dtype_name(full[WORD_EMBEDDING].dtype)
    cfg = ModelConfig(**cfg).to_json()  # fills defaults, validates
    drop_tied_copy(full, cfg["untie_embeddings_and_output_weights"])
    check_full(full, cfg, where)
    if iteration is None:
        iteration = int(first.get("iteration", 0) or 0)
    return Model(
        full=full, config=cfg, layout=Layout(tp, pp, len(per_ep[0][0, 0]), partition, ep), iteration=iteration,
        consumed_train_samples=int_or_none(first.get("consumed_train_samples")),
        consumed_valid_samples=int_or_none(first.get("consumed_valid_samples")),
        orig_vocab_size=int_or_none(a.get("orig_vocab_size")),
        make_vocab_size_divisible_by=int_or_none(a.get("make_vocab_size_divisible_by")),
        extra_args={k: a[k] for k in CARRIED_ARGS if isinstance(a.get(k), (int, str))},
    )


# ----------------------------------------------------------------------------------------------------------------
# Writing


def split_ranks(model: Model, layout: Layout) -> dict[tuple, list[dict[str, torch.Tensor]]]:
    """`split` of the model for the layout, each ep rank's experts apart: keys (tp, pp), or (tp, pp, ep) with
    layout.ep > 1."""
    cfg = model.config
    out: dict[tuple, list[dict[str, torch.Tensor]]] = {}
    for e in range(layout.ep):
        local = split_experts(model.full, layout.ep, e)
        for (t, r), chunks in split(local, cfg["num_layers"], cfg["untie_embeddings_and_output_weights"], layout,
                                    bool(cfg.get("swiglu"))).items():
            out[(t, r, e) if layout.ep > 1 else (t, r)] = chunks
    return out


def write_ours(model: Model, layout: Layout) -> Files:
    """Model -> {(tp_rank, pp_rank[, ep_rank]): payload} in our Trainer's checkpoint format (weights, iteration,
    samples)."""
    check_full(model.full, model.config)
    args = ours_args(model, layout)
    it = iteration_number(model)
    out: Files = {}
    for key, chunks in split_ranks(model, layout).items():
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


def write_megatron(model: Model, layout: Layout, spec: str = "transformer_engine",
                   tokenizer_type: str | None = None, experts: str = "sequential") -> Files:
    """Model -> {(tp_rank, pp_rank[, ep_rank]): payload} as Megatron-LM saves with --ckpt-format torch (weights
    only); MoE layers' experts in the layout `experts` (megatron_moe.EXPERT_LAYOUTS)."""
    if spec not in MEGATRON_SPECS:
        raise UsageError(f"unknown Megatron layer spec {spec!r} (choose {', '.join(MEGATRON_SPECS)})")
    if experts not in EXPERT_LAYOUTS + (DIST,):
        raise UsageError(f"unknown Megatron expert layout {experts!r} (choose {', '.join(EXPERT_LAYOUTS)})")
    if experts == "te_grouped" and spec != "transformer_engine":
        raise UsageError("--megatron-expert-layout te_grouped is Transformer Engine's grouped GEMM: it needs "
                         "--megatron-layer-spec transformer_engine")
    problem = megatron_partition_problem(layout.partition)
    if problem:
        raise UsageError(f"pipeline partition {','.join(map(str, layout.partition))}: {problem}; "
                         "Megatron's pipeline stages hold whole transformer layers")
    check_full(model.full, model.config)
    args = megatron_args(model, layout, spec, tokenizer_type, experts)
    names = unit_names(model.config["num_layers"])
    stages = virtual_stage_units(layout.partition)
    first_layer = []  # global index of each virtual stage's first layer
    done = 0
    for units in stages:
        first_layer.append(done)
        done += sum(1 for i in units if names[i].startswith("attn_"))
    out: Files = {}
    for key, chunks in split_ranks(model, layout).items():
        r = key[1]
        converted = [ours_chunk_to_megatron(sd, first_layer[i * layout.pp + r], spec, experts)
                     for i, sd in enumerate(chunks)]
        payload: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION,
                                   "iteration": iteration_number(model), "num_floating_point_operations_so_far": 0}
        if len(converted) == 1:
            payload["model"] = converted[0]
        else:
            payload.update({f"model{i}": c for i, c in enumerate(converted)})
        out[key] = payload
    return out
