"""A synthetic allocation trace of one pipeline rank of our runtime, from the memory model's tensors and the
schedule, to replay through the caching-allocator model (caching_allocator.py) and see what the allocator would
reserve beyond what is allocated: the gaps between live blocks that the derived allowance (cuda_allowance.py)
does not count. Torch-free.

The trace, in the runtime's order:
  start-up  the parameters, tensor by tensor, unit by unit (16-bit, or fp32); the fp32 gradient buffer in buckets
            of BUCKET_ELEMS elements, last parameters first (parallel/grad_sync.py); the optimizer's fp32 states
            (master copy, Adam's moments, the fp32 gradient copy where gradients are 16-bit: the memory model's
            optimizer bytes), per parameter, or one shard per bucket under ZeRO-1;
  FORWARD   each unit of the chunk allocates the tensors it saves for backward (memory_model.unit_saved_tensors);
  BACKWARD  each unit of the chunk, last first, allocates its backward's transient (rebuilt activations and
            gradient buffers, memory_model.unit_transient_bytes), frees what it saved, then the transient;
and the schedule's actions repeated for `iterations` iterations. What it leaves out: a forward's short-lived
intermediates, the received activations' and gradients' buffers of pipeline transfers, the optimizer step's own
temporaries, kernels' workspaces. Our runtime's engine only; schedules of FORWARD and BACKWARD actions (no BPipe,
slicing or zero-bubble split backwards).
"""

from __future__ import annotations

from itertools import count

from ..config import ModelConfig
from ..errors import UsageError
from ..pipeline.build import build_schedule
from ..pipeline.schedule import Kind
from ..units import owns_output_weight, unit_kind, unit_names
from .caching_allocator import ALLOC, FREE, replay
from .engine import OURS
from .memory_model import MemorySettings, chunk_unit_indices, precision_from, shared_output_grad_bytes
from .overlap import BUCKET_ELEMS
from .spec import RunSpec
from .unit_activations import unit_saved_tensors, unit_transient_bytes


def unit_param_numels(kind: str, model: ModelConfig, tp: int = 1, output_weight: bool = True) -> list[int]:
    """The parameter tensors (elements each) one tensor-parallel rank holds for a unit, in the order the model
    builds them; they sum to memory_model.unit_param_count."""
    h, f, v = model.hidden_size, model.ffn_hidden_size, model.vocab_size
    norm = [h] if model.normalization == "RMSNorm" else [h, h]
    bias = model.add_bias_linear
    if kind == "embedding":
        out = [(v // tp) * h]
        if model.position_embedding_type == "learned_absolute":
            out.append(model.max_position_embeddings * h)
        if model.num_tokentypes:
            out.append(model.num_tokentypes * h)
        return out
    if kind == "attention":
        qkv = model.qkv_rows // tp
        out = [*norm, qkv * h]
        if bias or model.add_qkv_bias:
            out.append(qkv)
        if model.qk_layernorm:
            out += [n * model.head_dim // h for n in norm] * 2
        out.append(h * (h // tp))
        return out + ([h] if bias else [])
    if kind == "mlp":
        out = [*norm, (model.fc1_rows // tp) * h]
        if bias:
            out.append(model.fc1_rows // tp)
        out.append(h * (f // tp))
        return out + ([h] if bias else [])
    if kind == "head":
        out = list(norm)
        if model.model_type == "bert":
            out += [h * h, h, h, h, v // tp]
            if model.bert_binary_head:
                out += [h * h, h, 2 * h, 2]
        if output_weight:
            out.append((v // tp) * h)
        return out
    raise ValueError(f"unknown unit kind {kind!r}")


def rank_trace(spec: RunSpec, rank: int = 0, settings: MemorySettings = MemorySettings(),
               iterations: int = 2) -> list[tuple[int, int, int]]:
    """(code, bytes, address) events of pipeline rank `rank` (caching_allocator's codes; addresses are ids)."""
    if settings.engine.name != OURS:
        raise UsageError(f"a synthetic allocation trace models our runtime's tensors, not {settings.engine.name}'s")
    pl = spec.pipeline
    if pl.bpipe or pl.slicing or spec.unit_strategies is not None:
        raise UsageError("a synthetic allocation trace covers plain schedules (no BPipe, slicing or unit strategies)")
    schedule = build_schedule(pl, spec.pp)
    model, layout, tp = spec.model, spec.stage_layout(), spec.tp
    sp = spec.sp and tp > 1
    names = unit_names(model.num_layers)
    chunks = chunk_unit_indices(layout, rank)
    units = [i for c in chunks for i in c]
    own_output = owns_output_weight(model.untie_embeddings_and_output_weights, spec.pp, [names[i] for i in units])
    precision = precision_from(model, spec.distributed_optimizer, settings.engine)
    ids = count(1)
    events: list[tuple[int, int, int]] = []

    def alloc(nbytes: int) -> tuple[int, int]:
        block = (next(ids), int(nbytes))
        events.append((ALLOC, block[1], block[0]))
        return block

    def free(block: tuple[int, int]) -> None:
        events.append((FREE, block[1], block[0]))

    params = [n for i in units for n in unit_param_numels(unit_kind(names[i]), model, tp, own_output)]
    for n in params:
        alloc(n * precision.param_bytes)
    buckets, size = [], 0
    for n in reversed(params):
        size += n
        if size >= BUCKET_ELEMS:
            buckets.append(size)
            size = 0
    if size:
        buckets.append(size)
    for n in buckets:
        alloc(n * precision.grad_bytes)
    shards = spec.grad_dp  # ZeRO-1 shards over dp x cp
    states = precision.optimizer_bytes(shards) * (shards if spec.distributed_optimizer else 1)  # per parameter
    per_tensor = round(states / 4)  # fp32 tensors per parameter tensor (or per bucket's shard)
    for n in ([-(-b // shards) for b in buckets] if spec.distributed_optimizer else params):
        for _ in range(per_tensor):
            alloc(n * 4)

    def saved(i: int) -> list[int]:
        return [t.nbytes for t in unit_saved_tensors(unit_kind(names[i]), model, pl.micro_batch_size, tp, sp,
                                                     layout.unit_recompute(i), settings.device, spec.cp,
                                                     spec.cp_comm_type)]

    held: dict[tuple[int, int], list[list[tuple[int, int]]]] = {}
    shared_grad = shared_output_grad_bytes(model, tp, spec.pp, [names[i] for i in units], settings.engine)
    for _ in range(iterations):
        for a in schedule.actions[rank]:
            if a.kind is Kind.FORWARD:
                held[(a.microbatch, a.chunk)] = [[alloc(n) for n in saved(i)] for i in chunks[a.chunk]]
            elif a.kind is Kind.BACKWARD:
                blocks = held.pop((a.microbatch, a.chunk))
                output_grad = None
                for i, unit_blocks in zip(reversed(chunks[a.chunk]), reversed(blocks)):
                    transient = unit_transient_bytes(unit_kind(names[i]), model, pl.micro_batch_size, tp, sp,
                                                     layout.unit_recompute(i), settings.device, spec.cp,
                                                     spec.cp_comm_type)
                    extra = alloc(transient) if transient else None
                    if names[i] == "head" and shared_grad:
                        output_grad = alloc(shared_grad)
                    for block in unit_blocks:
                        free(block)
                    if extra is not None:
                        free(extra)
                if output_grad is not None:
                    free(output_grad)
            elif a.kind in (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.EVICT, Kind.LOAD, Kind.ACCEPT,
                            Kind.RETURN):
                raise UsageError(f"a synthetic allocation trace does not model {a.kind.name} actions")
    return events


def synthetic_allocator(spec: RunSpec, rank: int = 0, settings: MemorySettings = MemorySettings(),
                        iterations: int = 2) -> dict:
    """The caching-allocator model run on `rank_trace`: peak allocated, peak reserved, the peak of segments that
    hold a live block (what must fit), and that over the allocated peak less one: the allocator's overhead."""
    got = replay(rank_trace(spec, rank, settings, iterations))
    return {"peak_allocated": got["model_peak_allocated"], "peak_reserved": got["model_peak_reserved"],
            "pinned_peak": got["model_pinned_peak"], "segments": got["model_segments"],
            "allocator_fraction": got["model_pinned_peak"] / got["model_peak_allocated"] - 1}
