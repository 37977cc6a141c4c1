"""One candidate run as the planner sees it: the model, the degrees and the pipeline plan."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ZERO_BUBBLE, ModelConfig, ParallelConfig, PipelineConfig, RunConfig
from ..config.layout_rules import check_context_parallel
from ..errors import UsageError
from ..parallel.layout import RankLayout
from ..pipeline.partition import parse_partition
from ..strategy import parse_unit_strategies
from ..units import hidden_shape
from .memory_model import StageLayout
from .moe_model import Experts, check_experts


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
           unit_strategies: tuple[str, ...] | None = None, cp: int = 1, cp_comm_type: str = "p2p", ep: int = 1,
           etp: int | None = None) -> RunSpec:
        """A candidate by its degrees (the planner's spelling): Galvatron-BMW's unit strategies (tp 1, each unit its
        own strategy over the stage's dp ranks) or None for the uniform Megatron layout; `cp` ranks split every
        sequence (context parallelism, `cp_comm_type` its attention's exchange); `ep` ranks split the experts and
        `etp` (None: tp) each expert (docs/moe.md)."""
        if min(tp, pp, cp) < 1:
            raise UsageError("parallel degrees must be >= 1")
        parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                  sequence_parallel=sequence_parallel, rank_order=rank_order,
                                  unit_strategies=unit_strategies, context_parallel_size=cp,
                                  cp_comm_type=cp_comm_type, expert_model_parallel_size=ep,
                                  expert_tensor_parallel_size=etp)
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
        check_context_parallel(self.model, par)
        if par.unit_strategies is not None and self.model.moe is not None:
            raise UsageError("per-unit strategies (--unit-strategies) are not planned for MoE models")
        if self.model.moe is not None and self.pipeline.schedule in ZERO_BUBBLE:
            raise UsageError(f"--pipeline-schedule {self.pipeline.schedule}: zero-bubble schedules are not planned "
                             "for MoE models (the experts' deferred weight gradients are not modelled)")
        check_experts(self.model, par.tensor_model_parallel_size, par.context_parallel_size, self.dp,
                      par.expert_model_parallel_size, par.expert_tensor_parallel_size,
                      par.sequence_parallel and par.tensor_model_parallel_size > 1)
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
    def cp(self) -> int:
        """Context-parallel size: ranks that split every sequence (each holds s/cp tokens of it)."""
        return self.parallel.context_parallel_size

    @property
    def cp_comm_type(self) -> str:
        return self.parallel.cp_comm_type

    @property
    def ep(self) -> int:
        """Expert-parallel size: ranks the experts of an MoE unit are spread over (docs/moe.md)."""
        return self.parallel.expert_model_parallel_size

    @property
    def etp(self) -> int:
        """Expert-tensor-parallel size: ranks each expert is split over."""
        return self.parallel.expert_tensor_parallel_size

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ranks holding the same expert shards, tp cp dp / (etp ep)."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    def experts(self, imbalance: float = 1.0) -> Experts:
        return Experts(self.ep, self.etp, imbalance)

    @property
    def grad_dp(self) -> int:
        """Ranks holding the same parameters: gradients are reduced, and ZeRO-1 shards, over dp x cp."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def describe_degrees(self) -> str:
        """"tp 2 x cp 2 x pp 4 x dp 2" (cp only where > 1): the layout's degrees in messages."""
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        experts = f" (ep {self.ep}, etp {self.etp})" if self.model.moe is not None else ""
        return f"tp {self.tp}{cp} x pp {self.pp} x dp {self.dp}{experts}"

    def rank_model(self) -> ModelConfig:
        """The model as one context-parallel rank computes its units: its s/cp tokens of every sequence, attention
        by the context-parallel core (no s^2 tensor whatever the backend: "flash"). The model itself at cp 1. What
        the core costs beyond the local sequence's (each rank does 1/cp of the whole causal attention) and its
        exchange are the cost model's (cost_model.CostModel.cp_core_parts)."""
        if self.cp == 1:
            return self.model
        return replace(self.model, seq_length=self.model.seq_length // self.cp, attention_backend="flash")

    def stage_ranks(self, stage: int) -> list[int]:
        """Every global rank of pipeline stage `stage` (its tp, cp and dp coordinates)."""
        layout = self.rank_layout()
        return [layout.rank(t, d, stage, c) for d in range(self.dp) for c in range(self.cp) for t in range(self.tp)]

    @property
    def global_batch_size(self) -> int:
        return self.dp * self.pipeline.micro_batch_size * self.pipeline.num_microbatches

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1

    def stage_layout(self) -> StageLayout:
        pl = self.pipeline
        return StageLayout(self.tp, self.dp, self.pp, self.sp, pl.micro_batch_size, pl.partition, pl.recompute,
                           pl.placement, self.cp, self.cp_comm_type, self.ep, self.etp)

    def rank_layout(self) -> RankLayout:
        return RankLayout(self.tp, self.dp, self.pp, self.rank_order, self.cp)

    def hidden_bytes(self, half: bool = False) -> float:
        """Bytes of the hidden state one tensor-parallel rank sends between pipeline stages (its s/cp tokens)."""
        s, b, h = hidden_shape(self.model.seq_length // self.cp, self.pipeline.micro_batch_size,
                               self.model.hidden_size, self.tp, self.sp)
        return s * b * h * self.model.dtype_bytes / (2 if half else 1)



def spec_from_run_config(cfg: RunConfig, world_size: int) -> RunSpec:
    """The planner's view of a run: the one place a RunSpec comes from a RunConfig (a plan's RunSpec comes back
    unchanged from the RunConfig its plan builds)."""
    return RunSpec(model=cfg.model, parallel=cfg.parallel, pipeline=cfg.pipeline,
                   dp=cfg.parallel.data_parallel_size(world_size),
                   distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
                   overlap_grad_reduce=cfg.train.overlap_grad_reduce,
                   overlap_param_gather=cfg.optimizer.overlap_param_gather)
