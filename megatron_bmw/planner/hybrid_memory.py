"""Memory of one unit, and of one pipeline rank, under Galvatron-BMW's per-unit strategies (strategy.py).

A hybrid run has top-level tp 1 and dp = the stage width N; its stage micro-batch is B = micro-batch size x N.
A unit with strategy (t, d) works on B/d samples per rank with its weights split t ways, so its activations are
memory_model.py's for a micro-batch of B/d on tensor-parallel degree t (no sequence parallelism), and its model
states (parameters, fp32 gradients, fp32 master and Adam moments: PrecisionConfig without ZeRO-1) are those of
tp t, divided by d when the dp dimension is sharded (ZeRO-3 / FSDP2). A sharded unit also holds, while it
computes, its whole tp shard of parameters (all-gathered) and, in backward, its unsharded gradient before the
reduce-scatter: both are transient, counted with the unit's backward peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..pipeline.schedule import Schedule
from ..strategy import UnitStrategy
from ..units import owns_output_weight, unit_kind, unit_names
from .memory_model import (MemorySettings, PrecisionConfig, RankMemory, activation_walk, chunk_unit_indices,
                           shared_output_grad_bytes, unit_param_count)
from .unit_activations import unit_activation_bytes, unit_transient_bytes


def local_batch(strategy: UnitStrategy, micro_batch_size: int) -> int:
    """Samples one rank works on: the stage micro-batch (micro-batch size x width) over dp = micro-batch x tp."""
    return micro_batch_size * strategy.width // strategy.dp


@dataclass(frozen=True)
class UnitMemory:
    params: float  # parameter count the rank keeps between computations (its shard)
    state_bytes: float  # parameters, gradients and optimizer states it keeps
    saved_bytes: float  # activations one micro-batch leaves for backward
    transient_bytes: float  # its backward's peak beside the saved activations (and FSDP's gathered weights)


def unit_memory(kind: str, model: ModelConfig, strategy: UnitStrategy, micro_batch_size: int,
                recompute: str | None = None, device: str = "cuda", output_weight: bool = True) -> UnitMemory:
    """Per rank, one unit of `kind` under `strategy` (micro_batch_size: the run's per-rank micro-batch)."""
    t, d = strategy.tp, strategy.dp
    b = local_batch(strategy, micro_batch_size)
    precision = PrecisionConfig(param_bytes=model.dtype_bytes)
    per_param = precision.param_bytes + precision.grad_bytes + precision.optimizer_bytes(1)
    full = unit_param_count(kind, model, t, output_weight)  # the tp shard
    params = full / d if strategy.sharded else full
    saved = unit_activation_bytes(kind, model, b, t, False, recompute, device)
    transient = unit_transient_bytes(kind, model, b, t, False, recompute, device)
    if strategy.sharded:  # gathered parameters and the unsharded gradient, beyond the rank's own shard
        transient += (full - params) * precision.param_bytes + full * precision.param_bytes
    return UnitMemory(params, params * per_param, float(saved), float(transient))


def rank_memory_hybrid(spec, schedule: Schedule, rank: int, settings: MemorySettings = MemorySettings(),
                       activation_peak: float | None = None) -> RankMemory:
    """memory_model.rank_memory for a spec with unit_strategies."""
    model, pl = spec.model, spec.pipeline
    layout = spec.stage_layout()
    strategies = spec_strategies(spec)
    names = unit_names(model.num_layers)

    def per_chunk(r: int) -> list[list[UnitMemory]]:
        chunks = chunk_unit_indices(layout, r)
        own = owns_output_weight(model.untie_embeddings_and_output_weights, spec.pp,
                                 [names[i] for c in chunks for i in c])
        return [[unit_memory(unit_kind(names[i]), model, strategies[i], pl.micro_batch_size,
                             layout.unit_recompute(i), settings.device, own) for i in c] for c in chunks]

    mine = per_chunk(rank)
    units = [u for c in mine for u in c]
    chunk_bytes = [float(sum(u.saved_bytes for u in c)) for c in mine]
    act, inflight = activation_walk(schedule, rank, lambda r: [float(sum(u.saved_bytes for u in c))
                                                               for c in per_chunk(r)])
    if activation_peak is not None:
        act = activation_peak
    here = [names[i] for c in chunk_unit_indices(layout, rank) for i in c]
    transient = max(u.transient_bytes for u in units) + shared_output_grad_bytes(
        model, strategies[names.index("head")].tp, spec.pp, here, settings.engine)
    params = sum(u.params for u in units)
    precision = PrecisionConfig(param_bytes=model.dtype_bytes)
    static = sum(u.state_bytes for u in units)
    allowance = settings.workspace_bytes + settings.fragmentation * (static + act + transient)
    return RankMemory(params_bytes=params * precision.param_bytes, grads_bytes=params * precision.grad_bytes,
                      optimizer_bytes=params * precision.optimizer_bytes(1), activation_bytes=act,
                      transient_bytes=transient, allowance_bytes=allowance, peak_inflight_microbatches=inflight,
                      chunk_activation_bytes=chunk_bytes)


def hybrid_chunk_saved_bytes(spec, rank: int, settings: MemorySettings = MemorySettings()) -> list[float]:
    model, layout = spec.model, spec.stage_layout()
    strategies = spec_strategies(spec)
    names = unit_names(model.num_layers)
    return [float(sum(unit_memory(unit_kind(names[i]), model, strategies[i], spec.pipeline.micro_batch_size,
                                  layout.unit_recompute(i), settings.device).saved_bytes for i in c))
            for c in chunk_unit_indices(layout, rank)]


def spec_strategies(spec) -> tuple[UnitStrategy, ...] | None:
    """The spec's per-unit strategies as UnitStrategy objects (None for a uniform spec)."""
    from ..strategy import parse_unit_strategies
    raw = getattr(spec, "unit_strategies", None)
    if raw is None:
        return None
    return parse_unit_strategies(list(raw), spec.model.num_units, spec.dp, "unit_strategies")
