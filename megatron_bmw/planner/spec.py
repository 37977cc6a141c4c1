"""One candidate run as the planner sees it: model, degrees, micro-batching, partition, schedule."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import UsageError
from ..parallel.layout import RankLayout
from ..pipeline.generators import build_schedule
from ..pipeline.partition import parse_partition
from ..pipeline.schedule import Schedule
from .memory_model import StageLayout


@dataclass(frozen=True)
class RunSpec:
    model: ModelConfig
    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int
    partition: tuple[int, ...]  # units per virtual stage
    virtual: int = 1
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    sequence_parallel: bool = False
    rank_order: str = "tp-dp-pp"
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    bpipe: bool = False
    slicing: int = 0  # first micro-batches run as two halves (AutoPipe)

    def __post_init__(self) -> None:
        if self.virtual > 1 and self.schedule == "1f1b":
            object.__setattr__(self, "schedule", "interleaved")
        if self.tp * self.pp * self.dp < 1:
            raise UsageError("parallel degrees must be >= 1")
        if self.sequence_parallel and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", False)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def stage_layout(self) -> StageLayout:
        return StageLayout(self.tp, self.dp, self.pp, self.sp, self.micro_batch_size, self.partition)

    def rank_layout(self) -> RankLayout:
        return RankLayout(self.tp, self.dp, self.pp, self.rank_order)

    def build_schedule(self) -> Schedule:
        """The schedule the engine would run: generated, then sliced and BPipe-transformed as asked."""
        from ..pipeline.stages import transform_schedule

        sched = build_schedule(self.schedule, self.pp, self.num_microbatches, self.virtual)
        return transform_schedule(sched, self.slicing, self.bpipe)

    def hidden_bytes(self, half: bool = False) -> float:
        """Bytes of the hidden state one tensor-parallel rank sends between pipeline stages."""
        seq = self.model.seq_length // self.tp if self.sp else self.model.seq_length
        b = self.micro_batch_size / (2 if half else 1)
        return seq * b * self.model.hidden_size * _itemsize(self.model)


def _itemsize(model: ModelConfig) -> int:
    from .memory_model import dtype_size

    return dtype_size(model.params_dtype)


def spec_from_run_config(cfg, world_size: int, rank_order: str = "tp-dp-pp", bpipe: bool = False,
                         slicing: int = 0) -> RunSpec:
    """RunSpec from arguments.configs_from_args' RunConfig."""
    par = cfg.parallel
    pp, v = par.pipeline_model_parallel_size, par.virtual_pipeline_model_parallel_size
    partition = parse_partition(cfg.train.pipeline_partition, cfg.model.num_layers, pp, v)
    schedule = cfg.train.schedule
    if v > 1:
        if schedule != "1f1b":
            raise UsageError(f"--pipeline-schedule {schedule} cannot interleave; drop "
                             "--num-layers-per-virtual-pipeline-stage or use 1f1b")
        schedule = "interleaved"
    return RunSpec(model=cfg.model, tp=par.tensor_model_parallel_size, pp=pp, dp=par.data_parallel_size(world_size),
                   micro_batch_size=cfg.train.micro_batch_size, num_microbatches=cfg.train.num_microbatches,
                   partition=tuple(partition), virtual=v, schedule=schedule,
                   sequence_parallel=par.sequence_parallel, rank_order=rank_order,
                   distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
                   overlap_grad_reduce=cfg.train.overlap_grad_reduce, bpipe=bpipe, slicing=slicing)
