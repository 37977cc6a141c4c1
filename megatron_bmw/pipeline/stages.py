"""Build the model chunks one pipeline rank holds, and the schedule it runs."""

from __future__ import annotations

from ..config import ModelConfig
from ..models.gpt import GPTModel, build_units, unit_names
from ..parallel.state import ParallelState
from .generators import build_schedule
from .partition import parse_partition, rank_chunks
from .schedule import Schedule


def build_model_chunks(cfg: ModelConfig, state: ParallelState, seed: int, partition: list[int]) -> list[GPTModel]:
    """One GPTModel per local chunk. All units of the rank are built together so that, at pp=1, the head
    shares the embedding's word-embedding Parameter."""
    chunks = rank_chunks(partition, state.pp_size, state.pp_rank)
    names = unit_names(cfg.num_layers)
    units = build_units(cfg, state, seed, [i for c in chunks for i in c])
    return [GPTModel({names[i]: units[names[i]] for i in c}) for c in chunks]


def pipeline_setup(cfg: ModelConfig, state: ParallelState, seed: int, num_microbatches: int,
                   schedule: str = "1f1b", virtual: int = 1,
                   partition: str | list[int] | None = None) -> tuple[list[GPTModel], Schedule, list[int]]:
    parts = parse_partition(partition, cfg.num_layers, state.pp_size, virtual)
    name = "interleaved" if virtual > 1 and schedule == "1f1b" else schedule
    sched = build_schedule(name, state.pp_size, num_microbatches, virtual)
    return build_model_chunks(cfg, state, seed, parts), sched, parts


def hidden_shape(cfg: ModelConfig, state: ParallelState, micro_batch_size: int) -> tuple[int, int, int]:
    seq = cfg.seq_length // state.tp_size if state.sequence_parallel else cfg.seq_length
    return (seq, micro_batch_size, cfg.hidden_size)
