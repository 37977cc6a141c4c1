"""Build the model chunks one pipeline rank holds, and the schedule it runs."""

from __future__ import annotations

from collections.abc import Callable

from ..config import ModelConfig, PipelineConfig
from ..errors import UsageError
from ..models.gpt import GPTModel, build_units, unit_names
from ..parallel.hybrid import HybridModel, check_hybrid, mark_norm_counting, shard_units
from ..parallel.state import ParallelState
from ..units import hidden_shape as _hidden_shape
from .build import build_schedule
from .partition import parse_partition, rank_chunks
from .schedule import Schedule
from .slicing import check_slicing, choose_slices

StageTimes = tuple[list[float], list[float], float]  # forward, backward per stage; activation p2p time


def build_model_chunks(cfg: ModelConfig, state: ParallelState, seed: int, partition: list[int],
                       recompute: tuple | None = None) -> list[GPTModel]:
    """One GPTModel per local chunk. All units of the rank are built together so that, at pp=1, the head
    shares the embedding's word-embedding Parameter."""
    chunks = rank_chunks(partition, state.pp_size, state.pp_rank)
    if state.hybrid is not None:  # per-unit strategies (parallel/hybrid.py)
        return _hybrid_chunks(cfg, state, seed, chunks, recompute)
    names = unit_names(cfg.num_layers)
    units = build_units(cfg, state, seed, [i for c in chunks for i in c], recompute)
    return [GPTModel({names[i]: units[names[i]] for i in c}) for c in chunks]


def _hybrid_chunks(cfg, state: ParallelState, seed: int, chunk_units: list[list[int]],
                   recompute: tuple | None = None) -> list[HybridModel]:
    """This rank's model chunks on their unit strategies (sharded units wrapped by FSDP2)."""
    hybrid = state.hybrid
    check_hybrid(hybrid, cfg)
    names = unit_names(cfg.num_layers)
    views = {}

    def state_of(i: int) -> ParallelState:
        views[i] = hybrid.view(state, i)
        return views[i]

    flat = [i for c in chunk_units for i in c]
    units = build_units(cfg, state, seed, flat, recompute, state_of=state_of)
    for i in flat:
        for p in units[names[i]].parameters():
            if not hasattr(p, "grad_group"):
                p.grad_group = views[i].dp_group
    chunks = []
    for c in chunk_units:
        mine = {names[i]: units[names[i]] for i in c}
        shard_units(mine, c, hybrid, state.device)
        chunks.append(HybridModel(mine, c, hybrid))
    mark_norm_counting(chunks, hybrid)
    return chunks


def pipeline_setup(cfg: ModelConfig, state: ParallelState, seed: int, pipeline: PipelineConfig,
                   stage_times: Callable[[list[GPTModel]], StageTimes] | None = None,
                   ) -> tuple[list[GPTModel], Schedule, list[int]]:
    """Model chunks of this rank, the (transformed) schedule and the partition.

    With slicing "auto", `stage_times(chunks)` gives the per-stage times for AutoPipe's slicer
    (slicing.stage_times_from_cost with the planner's cost model, or profiler.measure_stage_times);
    slicing.num_sliced(schedule) tells the count chosen. BPipe needs the bpipe rank order."""
    parts = parse_partition(pipeline.partition, cfg.num_layers, state.pp_size, pipeline.virtual_stages)
    if pipeline.bpipe and state.layout.order != "bpipe":
        raise UsageError("--bpipe needs the pair-adjacent rank order (ParallelConfig(rank_order='bpipe'))")
    check_slicing(pipeline.slicing, pipeline.micro_batch_size, pipeline.num_microbatches)
    chunks = build_model_chunks(cfg, state, seed, parts, pipeline.recompute)
    slicing = None
    if pipeline.slicing == "auto":
        if stage_times is None:
            raise ValueError("slicing='auto' needs stage_times (a cost model's or a measurement's)")
        forward, backward, comm = stage_times(chunks)
        slicing = choose_slices(forward, backward, comm, pipeline.num_microbatches)
    return chunks, build_schedule(pipeline, state.pp_size, slicing), parts


def hidden_shape(cfg: ModelConfig, state: ParallelState, micro_batch_size: int) -> tuple[int, int, int]:
    """[seq, batch, hidden] of the hidden state between stages; with unit strategies the batch is the whole stage
    micro-batch (the engine divides it by the dp of the unit before a chunk)."""
    if state.hybrid is not None:
        return (cfg.seq_length, micro_batch_size * state.hybrid.width, cfg.hidden_size)
    return _hidden_shape(cfg.seq_length, micro_batch_size, cfg.hidden_size, state.tp_size, state.sequence_parallel)
