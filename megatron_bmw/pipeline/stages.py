"""Build the model chunks one pipeline rank holds, and the schedule it runs."""

from __future__ import annotations

from collections.abc import Callable

from ..config import ModelConfig, PipelineConfig
from ..errors import UsageError
from ..models.chunk import ModelChunk, build_units
from ..parallel.state import ParallelState
from .build import build_schedule
from .partition import parse_partition, rank_chunks
from .schedule import Schedule
from .slicing import check_slicing, choose_slices

StageTimes = tuple[list[float], list[float], float]  # forward, backward per stage; activation p2p time


def build_model_chunks(cfg: ModelConfig, state: ParallelState, seed: int, partition: list[int],
                       recompute: tuple | None = None, placement: str = "interleaved") -> list[ModelChunk]:
    """This rank's model chunks (virtual stages placed as `placement` says, units as `state.units` says). All
    units of the rank are built together so that, where one rank holds both (pp=1, or the V placement), the
    head shares the embedding's word-embedding Parameter."""
    chunks = rank_chunks(partition, state.pp_size, state.pp_rank, placement)
    placement = state.units
    placement.check(cfg)
    units = build_units(cfg, state, seed, [i for c in chunks for i in c], recompute,
                        state_of=lambda i: placement.unit_state(state, i))
    return placement.chunks(cfg, state, units, chunks, ModelChunk)


def pipeline_setup(cfg: ModelConfig, state: ParallelState, seed: int, pipeline: PipelineConfig,
                   stage_times: Callable[[list[ModelChunk]], StageTimes] | None = None,
                   ) -> tuple[list[ModelChunk], Schedule, list[int]]:
    """Model chunks of this rank, the (transformed) schedule and the partition.

    With slicing "auto", `stage_times(chunks)` gives the per-stage times for AutoPipe's slicer
    (slicing.stage_times_from_cost with the planner's cost model, or profiler.measure_stage_times);
    slicing.num_sliced(schedule) tells the count chosen. BPipe needs the bpipe rank order."""
    parts = parse_partition(pipeline.partition, cfg.num_layers, state.pp_size, pipeline.virtual_stages)
    if pipeline.bpipe and state.layout.order != "bpipe":
        raise UsageError("--bpipe needs the pair-adjacent rank order (ParallelConfig(rank_order='bpipe'))")
    check_slicing(pipeline.slicing, pipeline.micro_batch_size, pipeline.num_microbatches)
    chunks = build_model_chunks(cfg, state, seed, parts, pipeline.recompute, pipeline.placement)
    slicing = None
    if pipeline.slicing == "auto":
        if stage_times is None:
            raise ValueError("slicing='auto' needs stage_times (a cost model's or a measurement's)")
        forward, backward, comm = stage_times(chunks)
        slicing = choose_slices(forward, backward, comm, pipeline.num_microbatches)
    return chunks, build_schedule(pipeline, state.pp_size, slicing), parts


def hidden_shape(cfg: ModelConfig, state: ParallelState, micro_batch_size: int) -> tuple[int, int, int]:
    """[seq, batch, hidden] of the hidden state between stages (parallel/placement.py)."""
    return state.units.hidden_shape(cfg, state, micro_batch_size)
