"""How a run is laid out: the parallel degrees, and how one iteration runs through the pipeline."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..errors import UsageError
from ..units import parse_recompute
from .schema import check_ranges, flag

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-1p", "zb-2p", "zbv")
ZERO_BUBBLE = ("zb-h1", "zb-h2", "zb-1p", "zb-2p", "zbv")  # backward split into B and W
TIMED_SCHEDULES = ("zb-1p", "zb-2p")  # their order is searched for the stages' times (pipeline/zb_search.py)


P = "parallelism"  # the flags' group
PIPELINE_SCHEDULE_FLAG = ("1f1b", "gpipe", "zb-h1", "zb-h2", "zb-1p", "zb-2p", "zbv")  # interleaved: 1f1b with virtual stages


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size", group=P, default=1, minimum=1)
    pipeline_model_parallel_size: int = flag("--pipeline-model-parallel-size", group=P, default=1, minimum=1)
    sequence_parallel: bool = flag("--sequence-parallel", group=P, default=False, action="store_true")
    context_parallel_size: int = flag(
        "--context-parallel-size", group=P, default=1, minimum=1,
        help="split every sequence over N ranks (2N chunks, rank r holding chunks r and 2N-1-r); attention runs "
             "over the cp group (--cp-comm-type)")
    cp_comm_type: str = flag("--cp-comm-type", group=P, default="p2p", choices=("p2p", "a2a"),
                             help="context-parallel attention: p2p passes K/V around a ring; a2a scatters heads "
                                  "(all-to-all) and attends over the whole sequence")
    expert_model_parallel_size: int = flag(
        "--expert-model-parallel-size", group=P, default=1, minimum=1,
        help="ranks the experts of an MoE layer are spread over (carved from tp x cp x dp, as Megatron's)")
    expert_tensor_parallel_size: int | None = flag(
        "--expert-tensor-parallel-size", group=P, default=None, minimum=1,
        help="tensor-parallel size inside each expert (default --tensor-model-parallel-size)")
    rank_order: str = flag(default="tp-dp-pp", domain=("tp-dp-pp", "bpipe"))  # bpipe: pairs (s, p-1-s) side by side
    gpus_per_node: int | None = flag("--gpus-per-node", group=P, default=None, minimum=1,
                                     help="node size for rank placement (default: the local world size)")
    # Galvatron-BMW hybrid: one strategy per unit (strategy.py text form) over the stage's world/pp ranks; tp is 1
    unit_strategies: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.unit_strategies is not None:
            self.unit_strategies = tuple(str(s) for s in self.unit_strategies)
        check_ranges(self)
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            self.sequence_parallel = False  # Megatron disables it for tp=1 as well
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        tp, cp, pp = self.tensor_model_parallel_size, self.context_parallel_size, self.pipeline_model_parallel_size
        if world_size % (tp * cp * pp):
            with_cp = f" x --context-parallel-size {cp}" if cp > 1 else ""
            raise UsageError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp}{with_cp} x "
                f"--pipeline-model-parallel-size {pp}")
        return world_size // (tp * cp * pp)


@dataclass
class PipelineConfig:
    """How one iteration runs: micro-batching, the schedule and its transforms, the unit partition and the
    recomputation of every unit. The part of a plan that the schedule, the engine, the memory and cost models
    and the simulator all read."""

    micro_batch_size: int = flag("--micro-batch-size", group="training", default=1, cli_default=2, minimum=1)
    num_microbatches: int = flag(default=1, minimum=1)  # from --global-batch-size, the micro-batch and dp sizes
    schedule: str = flag(  # gpipe | 1f1b | interleaved | zero-bubble zb-h1 | zb-h2 | zb-1p | zb-2p | zbv (B/W split)
        "--pipeline-schedule", group=P, default="1f1b", choices=PIPELINE_SCHEDULE_FLAG, domain=SCHEDULES,
        dest="pipeline_schedule",
        help="zero-bubble: zb-h1, zb-h2 (more warm-up forwards), zb-1p, zb-2p (searched for the stage times, "
             "p or 2p micro-batches held), zbv (two chunks per rank in a V)")
    virtual_stages: int = flag(default=1, minimum=1)  # model chunks per pipeline rank (interleaved; zbv 2)
    partition: tuple[int, ...] | None = flag(  # units per virtual stage; None: the default split
        "--pipeline-partition", group=P, default=None, type=str, dest="pipeline_partition",
        help="units per (virtual) pipeline stage, e.g. 3,4,4,3; units are [embedding, attn_0, mlp_0, ..., head]")
    recompute: tuple[str | None, ...] | None = None  # per unit: None | selective | full; from the recompute flags
    bpipe: bool = flag("--bpipe", group=P, default=False, action="store_true",
                       help="BPipe: balance saved activations between pipeline stages s and p-1-s (pair-adjacent ranks)")
    slicing: int | str = flag(  # AutoPipe: the first K micro-batches run as halves ("auto": chosen at start-up)
        "--microbatch-slicing", group=P, default=0, cli_default="0", type=str, dest="microbatch_slicing",
        help="halve the first K micro-batches to shorten the pipeline start-up (K >= 0, or auto)")
    # zb-1p/zb-2p: per stage (f, b, w, send) seconds the order was searched with (a plan's); None: equal stages
    schedule_times: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        for name, value in (("--micro-batch-size", self.micro_batch_size),
                            ("micro-batches per iteration", self.num_microbatches),
                            ("virtual pipeline stages", self.virtual_stages)):
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {value!r}")
        if self.virtual_stages > 1 and self.schedule == "1f1b":
            self.schedule = "interleaved"
        if self.schedule not in SCHEDULES:
            raise UsageError(f"unknown pipeline schedule {self.schedule!r} (choose {', '.join(SCHEDULES)})")
        if self.schedule == "zbv":
            if self.virtual_stages not in (1, 2):
                raise UsageError(f"--pipeline-schedule zbv holds 2 model chunks per rank, not {self.virtual_stages}")
            self.virtual_stages = 2
        elif self.virtual_stages > 1 and self.schedule != "interleaved":
            raise UsageError(f"--pipeline-schedule {self.schedule} cannot interleave model chunks")
        if self.schedule_times is not None:
            if self.schedule not in TIMED_SCHEDULES:
                raise UsageError(f"pipeline.schedule_times: only {', '.join(TIMED_SCHEDULES)} take stage times, "
                                 f"not {self.schedule}")
            try:
                self.schedule_times = tuple(tuple(float(x) for x in row) for row in self.schedule_times)
            except (TypeError, ValueError):
                raise UsageError("pipeline.schedule_times: expected per stage [f, b, w, send] numbers") from None
        if self.partition is not None:
            self.partition = tuple(self.partition)
        if self.recompute is not None:
            self.recompute = tuple(self.recompute)
        if self.bpipe and self.schedule == "gpipe":
            raise UsageError("--bpipe works with the 1F1B schedules, not --pipeline-schedule gpipe")
        if self.schedule in ZERO_BUBBLE and (self.bpipe or self.slicing):
            raise UsageError(f"--pipeline-schedule {self.schedule} does not combine with "
                             f"{'--bpipe' if self.bpipe else '--microbatch-slicing'} (not supported yet)")

    @property
    def placement(self) -> str:
        """Where the virtual stages sit on the ranks (pipeline/schedule.py): "v" for zbv, else "interleaved"."""
        return "v" if self.schedule == "zbv" else "interleaved"

    def unit_recompute(self, n_units: int) -> tuple[str | None, ...]:
        """Recomputation of every unit (a full-length tuple)."""
        return self.recompute if self.recompute is not None else (None,) * n_units

    def to_json(self) -> dict:
        out = asdict(self)
        out["partition"] = list(self.partition) if self.partition is not None else None
        out["recompute"] = [x or "none" for x in self.recompute] if self.recompute is not None else None
        out["schedule_times"] = None if self.schedule_times is None else [list(r) for r in self.schedule_times]
        return out

    @classmethod
    def from_json(cls, data: dict, n_units: int, where: str = "plan") -> PipelineConfig:
        known = set(cls.__dataclass_fields__)
        extra = sorted(set(data) - known)
        if extra:
            raise UsageError(f"{where}: unknown pipeline key {extra[0]!r} (allowed: {', '.join(sorted(known))})")
        values = dict(data)
        values["recompute"] = parse_recompute(values.get("recompute"), n_units, f"{where}: pipeline.recompute")
        try:
            return cls(**values)
        except TypeError as exc:
            raise UsageError(f"{where}: bad pipeline section ({exc})") from None

