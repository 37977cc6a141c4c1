"""The plan file: one run chosen by the planner, as JSON that `pretrain_gpt.py --plan` runs.

Format "megatron_bmw-plan", version 1 (see README, "The plan file"):
  model          ModelConfig (padded vocabulary), orig_vocab_size and make_vocab_size_divisible_by
  parallel       tp, pp, dp, sequence parallelism, rank order, gpus per node
  pipeline       PipelineConfig: micro-batch size and count, schedule, virtual stages, unit partition per virtual
                 stage, recomputation per unit (none | selective | full), BPipe, slicing K
  training       global batch size, ZeRO-1 (distributed optimizer), overlapped gradient reduction, and the engine
                 the memory was planned for (engine, accumulate_allreduce_grads_in_fp32; absent: megatron_bmw,
                 which pretrain_gpt.py runs; a plan for another engine is refused there)
  devices        the device type of every rank (global rank order)
  cluster        name, source and size of the cluster it was planned for; profiles: the profiles used
  prediction     iteration time, tokens/s, TFLOP/s per GPU, MFU, and per stage: peak bytes, capacity, busy time
  search         where the plan came from (rank among the candidates, what BPipe/slicing/recompute bought)
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..config import ModelConfig, ParallelConfig, PipelineConfig
from ..config.codec import to_data
from ..errors import UsageError
from .engine import OURS, EngineConfig
from .files import read_json, write_json
from .plan_fields import check_plan_fields
from .spec import RunSpec

_NOT_PLANNED = ("gpus_per_node",)  # where ranks sit is the cluster's
FORMAT = "megatron_bmw-plan"
VERSION = 1


@dataclass
class Plan:
    spec: RunSpec
    global_batch_size: int
    orig_vocab_size: int | None = None
    make_vocab_size_divisible_by: int = 128
    devices: list[str] = field(default_factory=list)
    cluster: dict = field(default_factory=dict)
    profiles: list[dict] = field(default_factory=list)
    prediction: dict = field(default_factory=dict)
    search: dict = field(default_factory=dict)
    engine: EngineConfig = field(default_factory=EngineConfig)

    def to_json(self) -> dict:
        s = self.spec
        return {
            "format": FORMAT, "version": VERSION,
            "model": s.model.to_json(), "orig_vocab_size": self.orig_vocab_size,
            "make_vocab_size_divisible_by": self.make_vocab_size_divisible_by,
            "parallel": {**to_data(s.parallel, exclude=_NOT_PLANNED), "data_parallel_size": s.dp},
            "pipeline": s.pipeline.to_json(),
            "training": {"global_batch_size": self.global_batch_size, "distributed_optimizer": s.distributed_optimizer,
                         "overlap_grad_reduce": s.overlap_grad_reduce, "overlap_param_gather": s.overlap_param_gather,
                         **self.engine.to_json()},
            "devices": list(self.devices), "cluster": self.cluster, "profiles": self.profiles,
            "prediction": self.prediction, "search": self.search,
        }

    def save(self, path: str) -> None:
        write_json(path, self.to_json(), "--output", "plan")

    @classmethod
    def load(cls, path: str) -> Plan:
        return cls.from_json(read_json(path, "--plan", "plan file"), f"--plan {path}")

    @classmethod
    def from_json(cls, data, where: str = "plan") -> Plan:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UsageError(f"{where}: not a plan file (written by tools/autoconfig.py search)")
        if data.get("version") != VERSION:
            raise UsageError(f"{where}: plan version {data.get('version')!r}; this megatron_bmw reads version {VERSION}")
        check_plan_fields(data, where)  # types, ranges and how the fields fit together, by field name
        par, tr = data["parallel"], data["training"]
        model = ModelConfig(**_known(data["model"], ModelConfig, where, "model"))
        pipeline = PipelineConfig.from_json(data["pipeline"], model.num_units, where)
        parallel = ParallelConfig(**{k: v for k, v in par.items() if k != "data_parallel_size"})
        spec = RunSpec(model=model, parallel=parallel, pipeline=pipeline, dp=par["data_parallel_size"],
                       distributed_optimizer=tr.get("distributed_optimizer", False),
                       overlap_grad_reduce=tr.get("overlap_grad_reduce", False),
                       overlap_param_gather=tr.get("overlap_param_gather", False))
        gbs = tr["global_batch_size"]
        return cls(spec=spec, global_batch_size=gbs, orig_vocab_size=data.get("orig_vocab_size"),
                   make_vocab_size_divisible_by=data.get("make_vocab_size_divisible_by", 128),
                   devices=data.get("devices", []), cluster=data.get("cluster", {}), profiles=data.get("profiles", []),
                   prediction=data.get("prediction", {}), search=data.get("search", {}),
                   engine=EngineConfig(tr.get("engine", OURS), tr.get("accumulate_allreduce_grads_in_fp32"),
                                       bool(tr.get("tp_comm_overlap", False)),
                                       bool(tr.get("gradient_accumulation_fusion", True))))


def _known(section, cls, where: str, name: str) -> dict:
    if not isinstance(section, dict):
        raise UsageError(f"{where}: {name} must be a mapping")
    allowed = {f.name for f in fields(cls)}
    extra = sorted(set(section) - allowed)
    if extra:
        raise UsageError(f"{where}: unknown {name} key {extra[0]!r}")
    return section
