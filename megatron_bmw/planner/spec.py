"""One candidate run as the planner sees it: the model, the degrees and the pipeline plan."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ModelConfig, PipelineConfig, RunConfig
from ..errors import UsageError
from ..parallel.layout import RankLayout
from ..pipeline.partition import parse_partition
from ..strategy import parse_unit_strategies
from ..units import hidden_shape
from .memory_model import StageLayout


@dataclass(frozen=True)
class RunSpec:
    model: ModelConfig
    tp: int
    pp: int
    dp: int
    pipeline: PipelineConfig  # its partition is filled in (the default split when not given)
    sequence_parallel: bool = False
    rank_order: str = "tp-dp-pp"
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False  # ZeRO-1's gather behind the next forwards (with distributed_optimizer)
    # Galvatron-BMW hybrid (tp 1, each unit its own strategy over the stage's dp ranks): one canonical strategy
    # string per unit (strategy.py), or None for the uniform Megatron layout
    unit_strategies: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp) < 1:
            raise UsageError("parallel degrees must be >= 1")
        if self.unit_strategies is not None:
            if self.tp != 1:
                raise UsageError("unit strategies need tensor-model-parallel size 1 (each unit has its own tp)")
            parsed = parse_unit_strategies(self.unit_strategies, self.model.num_units, self.dp, "unit_strategies")
            object.__setattr__(self, "unit_strategies", tuple(str(s) for s in parsed))
        if self.sequence_parallel and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", False)
        pl = self.pipeline
        partition = parse_partition(pl.partition, self.model.num_layers, self.pp, pl.virtual_stages)
        if pl.partition is None or tuple(partition) != pl.partition:
            object.__setattr__(self, "pipeline", replace(pl, partition=tuple(partition)))
        if self.pipeline.bpipe and self.rank_order != "bpipe":
            object.__setattr__(self, "rank_order", "bpipe")

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.pipeline.micro_batch_size * self.pipeline.num_microbatches

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def stage_layout(self) -> StageLayout:
        pl = self.pipeline
        return StageLayout(self.tp, self.dp, self.pp, self.sp, pl.micro_batch_size, pl.partition, pl.recompute,
                           pl.placement)

    def rank_layout(self) -> RankLayout:
        return RankLayout(self.tp, self.dp, self.pp, self.rank_order)

    def hidden_bytes(self, half: bool = False) -> float:
        """Bytes of the hidden state one tensor-parallel rank sends between pipeline stages."""
        s, b, h = hidden_shape(self.model.seq_length, self.pipeline.micro_batch_size, self.model.hidden_size, self.tp,
                               self.sp)
        return s * b * h * self.model.dtype_bytes / (2 if half else 1)


def spec_from_run_config(cfg: RunConfig, world_size: int) -> RunSpec:
    """The planner's view of a run: the one place a RunSpec comes from a RunConfig (a plan's RunSpec comes back
    unchanged from the RunConfig its plan builds)."""
    par = cfg.parallel
    return RunSpec(model=cfg.model, tp=par.tensor_model_parallel_size, pp=par.pipeline_model_parallel_size,
                   dp=par.data_parallel_size(world_size), pipeline=cfg.pipeline,
                   sequence_parallel=par.sequence_parallel, rank_order=par.rank_order,
                   distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
                   overlap_grad_reduce=cfg.train.overlap_grad_reduce,
                   overlap_param_gather=cfg.optimizer.overlap_param_gather, unit_strategies=par.unit_strategies)
