"""Build the model chunks one pipeline rank holds, and the schedule it runs."""

from __future__ import annotations

from collections.abc import Callable

from ..config import ModelConfig
from ..errors import UsageError
from ..models.gpt import GPTModel, build_units, unit_names
from ..parallel.state import ParallelState
from .bpipe import ActivationLimitError, insert_bpipe
from .checker import check
from .generators import build_schedule
from .partition import parse_partition, rank_chunks
from .schedule import Schedule
from .slicing import check_slicing, choose_slices, slice_microbatches

StageTimes = tuple[list[float], list[float], float]  # forward, backward per stage; activation p2p time


def build_model_chunks(cfg: ModelConfig, state: ParallelState, seed: int, partition: list[int]) -> list[GPTModel]:
    """One GPTModel per local chunk. All units of the rank are built together so that, at pp=1, the head
    shares the embedding's word-embedding Parameter."""
    chunks = rank_chunks(partition, state.pp_size, state.pp_rank)
    names = unit_names(cfg.num_layers)
    units = build_units(cfg, state, seed, [i for c in chunks for i in c])
    return [GPTModel({names[i]: units[names[i]] for i in c}) for c in chunks]


def transform_schedule(schedule: Schedule, slicing: int = 0, bpipe: bool = False,
                       fit_slicing: bool = False) -> Schedule:
    """Apply micro-batch slicing (first k micro-batches halved), then BPipe, and check the result.

    BPipe cannot always keep every rank within mu_opt when many micro-batches are sliced: then, with
    `fit_slicing` (for --microbatch-slicing auto), slice fewer micro-batches until it can; without, refuse."""
    for k in range(slicing, -1, -1) if fit_slicing else (slicing,):
        sliced = slice_microbatches(schedule, k) if k else schedule
        try:
            result = insert_bpipe(sliced) if bpipe else sliced
        except ActivationLimitError as err:
            if fit_slicing and k:
                continue
            raise UsageError(f"--bpipe with --microbatch-slicing {k}: rank {err.rank} would hold {err.held:g} "
                             f"micro-batches of activations, above mu_opt {err.limit:g}; slice fewer "
                             "micro-batches") from None
        if k or bpipe:
            check(result)
        return result
    raise AssertionError("unreachable")


def pipeline_setup(cfg: ModelConfig, state: ParallelState, seed: int, num_microbatches: int,
                   schedule: str = "1f1b", virtual: int = 1,
                   partition: str | list[int] | None = None, bpipe: bool = False, slicing: int | str = 0,
                   micro_batch_size: int | None = None,
                   stage_times: Callable[[list[GPTModel]], StageTimes] | None = None,
                   ) -> tuple[list[GPTModel], Schedule, list[int]]:
    """Model chunks of this rank, the (transformed) schedule and the partition.

    slicing: the number of micro-batches to halve, or "auto": then `stage_times(chunks)` gives the per-stage
    times for AutoPipe's slicer (slicing.stage_times_from_cost with the planner's cost model, or
    stage_timing.measure_stage_times); slicing.num_sliced(schedule) tells the count chosen. With
    `micro_batch_size` given, slicing is checked to be possible. BPipe needs the bpipe rank order
    (ParallelConfig(rank_order="bpipe")).
    """
    parts = parse_partition(partition, cfg.num_layers, state.pp_size, virtual)
    name = "interleaved" if virtual > 1 and schedule == "1f1b" else schedule
    if bpipe and state.layout.order != "bpipe":
        raise UsageError("--bpipe needs the pair-adjacent rank order (ParallelConfig(rank_order='bpipe'))")
    if slicing and micro_batch_size is not None:
        check_slicing(slicing, micro_batch_size, num_microbatches)
    chunks = build_model_chunks(cfg, state, seed, parts)
    auto = slicing == "auto"
    if auto:
        if stage_times is None:
            raise ValueError("slicing='auto' needs stage_times (a cost model's or a measurement's)")
        forward, backward, comm = stage_times(chunks)
        slicing = choose_slices(forward, backward, comm, num_microbatches)
    sched = build_schedule(name, state.pp_size, num_microbatches, virtual)
    sched = transform_schedule(sched, slicing, bpipe, fit_slicing=auto)
    return chunks, sched, parts


def hidden_shape(cfg: ModelConfig, state: ParallelState, micro_batch_size: int) -> tuple[int, int, int]:
    seq = cfg.seq_length // state.tp_size if state.sequence_parallel else cfg.seq_length
    return (seq, micro_batch_size, cfg.hidden_size)
