"""One candidate run as the planner sees it: the model, the degrees and the pipeline plan."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ModelConfig, ParallelConfig, PipelineConfig, RunConfig
from ..errors import UsageError
from ..parallel.layout import RankLayout
from ..pipeline.partition import parse_partition
from ..strategy import parse_unit_strategies
from ..units import hidden_shape
from .memory_model import StageLayout


@dataclass(frozen=True)
class RunSpec:
    """The slice of a run the planner reads: the model, the parallel layout and the pipeline as the run's own
    configs hold them, the data-parallel size the world gives, and the optimizer choices that change memory and
    time. The planner's short names (tp, pp, sp, ...) read through to the configs."""

    model: ModelConfig
    parallel: ParallelConfig
    pipeline: PipelineConfig  # its partition is filled in (the default split when not given)
    dp: int
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False  # ZeRO-1's gather behind the next forwards (with distributed_optimizer)

    @classmethod
    def of(cls, model: ModelConfig, tp: int, pp: int, dp: int, pipeline: PipelineConfig,
           sequence_parallel: bool = False, rank_order: str = "tp-dp-pp", distributed_optimizer: bool = False,
           overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
           unit_strategies: tuple[str, ...] | None = None) -> RunSpec:
        """A candidate by its degrees (the planner's spelling): Galvatron-BMW's unit strategies (tp 1, each unit its
        own strategy over the stage's dp ranks) or None for the uniform Megatron layout."""
        if min(tp, pp) < 1:
            raise UsageError("parallel degrees must be >= 1")
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  sequence_parallel=sequence_parallel, rank_order=rank_order,
                                  unit_strategies=unit_strategies)
        return cls(model, parallel, pipeline, dp, distributed_optimizer, overlap_grad_reduce, overlap_param_gather)

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise UsageError("parallel degrees must be >= 1")
        par = replace(self.parallel, gpus_per_node=None)  # where ranks sit is the cluster's, not the plan's
        if par.unit_strategies is not None:
            if par.tensor_model_parallel_size != 1:
                raise UsageError("unit strategies need tensor-model-parallel size 1 (each unit has its own tp)")
            parsed = parse_unit_strategies(par.unit_strategies, self.model.num_units, self.dp, "unit_strategies")
            par = replace(par, unit_strategies=tuple(str(s) for s in parsed))
        if self.pipeline.bpipe:
            par = replace(par, rank_order="bpipe")
        object.__setattr__(self, "parallel", par)
        pl = self.pipeline
        partition = parse_partition(pl.partition, self.model.num_layers, self.pp, pl.virtual_stages)
        if pl.partition is None or tuple(partition) != pl.partition:
            object.__setattr__(self, "pipeline", replace(pl, partition=tuple(partition)))

    @property
    def tp(self) -> int:
        return self.parallel.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.parallel.pipeline_model_parallel_size

    @property
    def sequence_parallel(self) -> bool:
        return self.parallel.sequence_parallel

    @property
    def rank_order(self) -> str:
        return self.parallel.rank_order

    @property
    def unit_strategies(self) -> tuple[str, ...] | None:
        return self.parallel.unit_strategies

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
    return RunSpec(model=cfg.model, parallel=cfg.parallel, pipeline=cfg.pipeline,
                   dp=cfg.parallel.data_parallel_size(world_size),
                   distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
                   overlap_grad_reduce=cfg.train.overlap_grad_reduce,
                   overlap_param_gather=cfg.optimizer.overlap_param_gather)
