"""Evaluate one RunSpec: memory per pipeline stage, and a simulated iteration on a cluster."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..pipeline.build import build_schedule
from ..pipeline.generators import TIMED
from ..pipeline.holding import holding_events
from ..pipeline.megatron_p2p import megatron_communication
from ..pipeline.replay import CompiledSchedule, compile_schedule
from ..pipeline.schedule import Action, Kind, Schedule
from .cluster import Cluster
from .core_sharing import simulate_sharing_cores
from .cost_model import CostModel, CostSettings
from .engine import EngineConfig
from .memory_model import (MemorySettings, RankMemory, chunk_saved_bytes, chunk_wgrad_bytes, precision_from,
                           rank_memory)
from .profile_data import Profile, Profiles
from .simulator import Simulation, simulate
from .spec import RunSpec


def estimate_memory(spec: RunSpec, schedule: Schedule | None = None,
                    settings: MemorySettings = MemorySettings(),
                    activation_peaks: list[float] | None = None,
                    holds: list[list] | None = None) -> list[RankMemory]:
    """Memory of every pipeline stage; in-flight micro-batches come from walking `schedule` (or its holding
    events per rank, `holds`, when the caller keeps them)."""
    schedule = schedule or build_schedule(spec.pipeline, spec.pp)
    settings = layout_settings(spec, settings)
    if spec.unit_strategies is not None:  # Galvatron-BMW per-unit strategies
        from .hybrid_memory import rank_memory_hybrid
        return [rank_memory_hybrid(spec, schedule, r, settings,
                                   None if activation_peaks is None else activation_peaks[r]) for r in range(spec.pp)]
    precision = precision_from(spec.model, spec.distributed_optimizer, settings.engine)
    layout = spec.stage_layout()
    return [rank_memory(layout, spec.model, schedule, r, precision, settings,
                        None if activation_peaks is None else activation_peaks[r],
                        None if holds is None else holds[r]) for r in range(spec.pp)]


def layout_settings(spec: RunSpec, settings: MemorySettings) -> MemorySettings:
    """`settings` with the allowance of the spec's layout (a derived CUDA allowance depends on it)."""
    return settings.for_layout(spec.model, spec.tp, spec.dp, spec.pp, spec.pipeline.micro_batch_size, spec.sp,
                               spec.cp)


def stage_times(cost: CostModel, pp: int) -> tuple[tuple[float, float, float, float], ...]:
    """Per pipeline rank (one chunk each) the cost model's (F, B, W, send to the next rank) seconds: the times the
    simulator then gives those actions (of micro-batch 0), which ZB-1p/ZB-2p are searched for."""
    out = []
    for r in range(pp):
        f, b, w = (cost.compute_time(r, Action(k, 0)) for k in (Kind.FORWARD, Kind.BACKWARD_INPUT,
                                                                 Kind.BACKWARD_WEIGHT))
        send = cost.transfer_time(r, r + 1, Action(Kind.SEND_ACT, 0, 0, r + 1)) if r + 1 < pp else 0.0
        out.append((f, b, w, send))
    return tuple(out)


def timed_spec(spec: RunSpec, cost: CostModel) -> RunSpec:
    """`spec` whose ZB-1p/ZB-2p schedule carries the cost model's stage times (what the plan file hands the
    runtime to regenerate the same order); unchanged for other schedules or when it already has times."""
    if spec.pipeline.schedule not in TIMED or spec.pipeline.schedule_times is not None:
        return spec
    return replace(spec, pipeline=replace(spec.pipeline, schedule_times=stage_times(cost, spec.pp)))


@dataclass
class Evaluation:
    spec: RunSpec
    schedule: Schedule
    memory: list[RankMemory]
    simulation: Simulation
    cost: CostModel


def compiled_for(schedule: Schedule, engine: EngineConfig) -> CompiledSchedule:
    """`schedule` compiled as `engine` runs its transfers: Megatron-LM's own schedules in batches that their sends
    wait for (EngineConfig.synchronous_p2p, pipeline/megatron_p2p.py); others as generated."""
    if engine.synchronous_p2p(schedule.name):
        return compile_schedule(megatron_communication(schedule), synchronous_p2p=True)
    return compile_schedule(schedule)


def simulate_run(spec: RunSpec, cluster: Cluster, profiles: Profiles | Profile | None = None,
                 cost_settings: CostSettings = CostSettings(), memory_settings: MemorySettings = MemorySettings(),
                 schedule: Schedule | CompiledSchedule | None = None, record_transfers: bool = False,
                 memory_over_time: bool = True) -> Evaluation:
    """Simulate one iteration of `schedule` (default: the spec's; a compiled one is reused as it is) with the
    cost model's durations. Without a schedule, ZB-1p/ZB-2p are searched for the cost model's stage times and the
    Evaluation's spec carries them (timed_spec)."""
    compiled = schedule if isinstance(schedule, CompiledSchedule) else None
    layout = spec.stage_layout()
    if spec.unit_strategies is not None:  # Galvatron-BMW per-unit strategies
        from .hybrid_cost import HybridCostModel
        from .hybrid_memory import hybrid_chunk_saved_bytes
        cost = HybridCostModel(spec, cluster, profiles, cost_settings)
        saved = [hybrid_chunk_saved_bytes(spec, r, memory_settings) for r in range(spec.pp)]
        wgrad = None
    else:
        cost = CostModel(spec, cluster, profiles, cost_settings)
        saved = [chunk_saved_bytes(layout, spec.model, r, memory_settings) for r in range(spec.pp)]
        wgrad = [chunk_wgrad_bytes(layout, spec.model, r) for r in range(spec.pp)]
        if compiled is None and schedule is None:
            spec = timed_spec(spec, cost)
    schedule = compiled.schedule if compiled is not None else schedule or build_schedule(spec.pipeline, spec.pp)
    if compiled is None and cost_settings.engine.synchronous_p2p(schedule.name):
        compiled = compiled_for(schedule, cost_settings.engine)
    holds = None
    if compiled is not None and spec.unit_strategies is None:  # replayed again and again: walk it once
        if "holds" not in compiled.derived:
            compiled.derived["holds"] = [holding_events(acts, r) for r, acts in enumerate(schedule.actions)]
        holds = compiled.derived["holds"]
    memory = estimate_memory(spec, schedule, memory_settings, holds=holds)
    static = [m.static_bytes for m in memory]
    sim = simulate_sharing_cores(cost, lambda: simulate(
        compiled or schedule, cost.compute_time, cost.transfer_time, cost.copy_time, saved, static,
        cost.finish_times, record_transfers=record_transfers, memory_over_time=memory_over_time,
        wgrad_bytes=wgrad))
    return Evaluation(spec, schedule, memory, sim, cost)


def stage_capacity(spec: RunSpec, cluster: Cluster, stage: int) -> float:
    """Memory of the smallest device holding the stage."""
    return min(device.memory_bytes for device in cluster.devices_of(spec.stage_ranks(stage)))
