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

from ..config import ModelConfig
from ..errors import UsageError
from ..pipeline.partition import virtual_stage_units
from ..safe_load import Foreign
from ..units import unit_names
from .checkpoint_files import check_uniform_layout
from .gpt2 import POSITION_EMBEDDING
from .megatron_args import (
    CARRIED_ARGS, args_dict, dtype_name, int_or_none, iteration_number, megatron_args, megatron_notes,
    model_config_from_megatron, ours_args, unsupported_megatron_features,
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
Files = dict[tuple[int, int], dict]


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
            chunks[t, r].append(megatron_chunk_to_ours(sd, offset, chunk_where))
        offset += n
    full, stages = assemble(chunks, tp, pp, where, swiglu=bool(a.get("swiglu")))
    cfg = model_config_from_megatron(a, full)
    if offset != cfg["num_layers"]:
        raise UsageError(f"{where}: args say num_layers {cfg['num_layers']}, the pipeline stages hold {offset} layers")
    partition = partition_of(stages, cfg["num_layers"], where)
    drop_tied_copy(full, cfg["untie_embeddings_and_output_weights"])
    check_full(full, cfg, where)
    if iteration is None:
        iteration = int(first.get("iteration", a.get("iteration", 0)) or 0)
    return Model(
        full=full, config=cfg, layout=Layout(tp, pp, virtual, partition), iteration=iteration,
        consumed_train_samples=int_or_none(a.get("consumed_train_samples")),
        consumed_valid_samples=int_or_none(a.get("consumed_valid_samples")),
        orig_vocab_size=int_or_none(a.get("vocab_size")),
        make_vocab_size_divisible_by=int_or_none(a.get("make_vocab_size_divisible_by")),
        extra_args={k: a[k] for k in CARRIED_ARGS if isinstance(a.get(k), (int, str))}, notes=megatron_notes(a),
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
    check_grid(files, tp, pp, where)
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
    cfg["params_dtype"] = dtype_name(full[WORD_EMBEDDING].dtype)
    cfg = ModelConfig(**cfg).to_json()  # fills defaults, validates
    drop_tied_copy(full, cfg["untie_embeddings_and_output_weights"])
    check_full(full, cfg, where)
    if iteration is None:
        iteration = int(first.get("iteration", 0) or 0)
    return Model(
        full=full, config=cfg, layout=Layout(tp, pp, len(chunks[0, 0]), partition), iteration=iteration,
        consumed_train_samples=int_or_none(first.get("consumed_train_samples")),
        consumed_valid_samples=int_or_none(first.get("consumed_valid_samples")),
        orig_vocab_size=int_or_none(a.get("orig_vocab_size")),
        make_vocab_size_divisible_by=int_or_none(a.get("make_vocab_size_divisible_by")),
        extra_args={k: a[k] for k in CARRIED_ARGS if isinstance(a.get(k), (int, str))},
    )


# ----------------------------------------------------------------------------------------------------------------
# Writing


def write_ours(model: Model, layout: Layout) -> Files:
    """Model -> {(tp_rank, pp_rank): payload} in our Trainer's checkpoint format (weights, iteration, samples)."""
    check_full(model.full, model.config)
    args = ours_args(model, layout)
    it = iteration_number(model)
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
                                   "iteration": iteration_number(model), "num_floating_point_operations_so_far": 0}
        if len(converted) == 1:
            payload["model"] = converted[0]
        else:
            payload.update({f"model{i}": c for i, c in enumerate(converted)})
        out[t, r] = payload
    return out
