"""Durations of every schedule action, and of the gradient synchronisation after the pipeline.

Compute: each unit's forward and backward time from the profile of the stage's device type (interpolated in
the micro-batch size, rescaled by FLOPs for another model; a device type without a profile is an error when
profiles are given), or analytically as FLOPs / (peak x achievable fraction) with backward = 2 x forward. Tensor-parallel collectives run inside
units: measured when the profile has that tp degree, else added from the cluster's links. Recomputation
adds the recomputed forward (the whole unit for full, the attention core for selective) to the backward.

Communication (AMP's formulas, B the slowest link of the group, plus per-step latency):
  ring all-reduce 2(n-1)/n x M / B; all-gather and reduce-scatter (n-1)/n x M / B; p2p v / b + latency.
After the last backward each rank all-reduces its fp32 gradients over data parallel (overlapped with the
last backward when --overlap-grad-reduce, both slowed by the overlap factor, Galvatron's 1.3), sums the
sequence-parallel gradients over tensor parallel, and the first and last stage all-reduce the tied embedding;
then the optimizer steps (memory-bound) and, with ZeRO-1, the parameters are all-gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..pipeline.schedule import Action, Kind
from .cluster import Cluster, DeviceType, Link
from .flops import core_attention_share, unit_forward_flops
from ..units import owns_output_weight, unit_kind, unit_names
from .memory_model import chunk_unit_indices, chunk_units, unit_activation_bytes, unit_param_count
from .profile_data import Profile, Profiles
from .spec import RunSpec


@dataclass(frozen=True)
class CostSettings:
    achievable_fraction: float | None = None  # of peak FLOP/s for analytic times; None: the device type's (or 0.5)
    bandwidth_fraction: float = 0.8  # of the memory bandwidth, for memory-bound work (elementwise, optimizer)
    overlap_factor: float = 1.3  # slowdown of compute and communication that overlap

    def __post_init__(self) -> None:
        if self.achievable_fraction is not None and not 0 < self.achievable_fraction <= 1:
            raise UsageError(f"--achievable-fraction must be in (0, 1], got {self.achievable_fraction}")
        if not 0 < self.bandwidth_fraction <= 1:
            raise UsageError(f"--bandwidth-fraction must be in (0, 1], got {self.bandwidth_fraction}")
        if self.overlap_factor < 1:
            raise UsageError(f"--overlap-factor must be >= 1, got {self.overlap_factor}")

    def fraction(self, device: DeviceType) -> float:
        """Achievable share of `device`'s peak FLOP/s: the setting, else the device type's, else 0.5."""
        if self.achievable_fraction is not None:
            return self.achievable_fraction
        return device.achievable_fraction if device.achievable_fraction is not None else 0.5


def allreduce_time(nbytes: float, n: int, link: Link) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def allgather_time(nbytes: float, n: int, link: Link) -> float:
    """All-gather (or reduce-scatter) of a tensor of `nbytes` in total."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def optimizer_step_seconds(params: float, dp: int, zero1: bool, dtype_bytes: int, device: DeviceType,
                           bandwidth_fraction: float) -> float:
    """The optimizer step is memory-bound: per parameter the gradient norm and the zeroing touch the fp32
    gradient (8 bytes) and the parameter is written; per parameter the rank updates (all of them, or its ZeRO-1
    shard) Adam reads the gradient and reads and writes the fp32 master and both moments (28 bytes). At the
    device's memory bandwidth x the achievable fraction of it; 0 when the bandwidth is not described."""
    if device.memory_bandwidth is None:
        return 0.0
    shard = params / dp if zero1 else params
    return (params * (8 + dtype_bytes) + shard * 28) / (device.memory_bandwidth * bandwidth_fraction)


class CostModel:
    """Durations for one RunSpec on one cluster. Build once, query per action."""

    def __init__(self, spec: RunSpec, cluster: Cluster, profiles: Profiles | Profile | None = None,
                 settings: CostSettings = CostSettings(), placement: dict | None = None) -> None:
        """`placement`: a dict shared by cost models of one placement (tp, pp, dp, rank order on one cluster), which
        then work out each stage's device and links once."""
        if spec.world_size > cluster.num_gpus:
            raise UsageError(f"the layout needs {spec.world_size} GPUs (tp {spec.tp} x pp {spec.pp} x dp {spec.dp}) "
                             f"but cluster {cluster.name} has {cluster.num_gpus}")
        if isinstance(profiles, Profile):
            profiles = Profiles([profiles])
        self.spec, self.cluster, self.profiles, self.settings = spec, cluster, profiles or Profiles(), settings
        self.dtype = spec.model.params_dtype
        self.layout = spec.rank_layout()
        p = spec.pp
        placement = {} if placement is None else placement
        if "devices" not in placement:
            placement["devices"] = [self._stage_device(s) for s in range(p)]
        self.devices = placement["devices"]
        for device in {d.name: d for d in self.devices}.values():
            self.profiles.for_device(device.name)  # a device type without a profile is an error now, not later
        self._p2p: dict[tuple, Link] = placement.setdefault("links", {})  # stage pairs, each stage's tp/dp group
        self._tables: tuple[list[list[float]], list[list[float]], list[int]] | None = None

    @property
    def chunk_forward(self) -> list[list[float]]:
        """Per rank, per model chunk: forward seconds of one micro-batch."""
        return self._chunk_tables()[0]

    @property
    def chunk_backward(self) -> list[list[float]]:
        return self._chunk_tables()[1]

    @property
    def params(self) -> list[int]:
        """Parameters per rank (one tensor-parallel shard)."""
        return self._chunk_tables()[2]

    def _chunk_tables(self):
        if self._tables is not None:
            return self._tables
        spec = self.spec
        chunk_forward: list[list[float]] = []
        chunk_backward: list[list[float]] = []
        params: list[int] = []
        names = unit_names(spec.model.num_layers)
        layout = spec.stage_layout()
        for rank in range(spec.pp):
            chunks = chunk_unit_indices(layout, rank)
            fwd, bwd = [], []
            for c in chunks:
                f = b = 0.0
                for i in c:
                    uf, ub = self.unit_times(unit_kind(names[i]), layout.unit_recompute(i), self.devices[rank], rank,
                                             i)
                    f, b = f + uf, b + ub
                over = self._overhead(self.devices[rank])
                fwd.append(f + over[0])
                bwd.append(b + over[1])
            chunk_forward.append(fwd)
            chunk_backward.append(bwd)
            params.append(self._rank_params([names[i] for c in chunks for i in c]))
        self._tables = (chunk_forward, chunk_backward, params)
        return self._tables

    # ---- placement ---------------------------------------------------------------------------------------------
    def gpus(self, stage: int) -> list[int]:
        return [self.layout.rank(t, d, stage) for d in range(self.spec.dp) for t in range(self.spec.tp)]

    def _stage_device(self, stage: int) -> DeviceType:
        """The slowest device type holding the stage (data-parallel replicas wait for it)."""
        return min(self.cluster.devices_of(self.gpus(stage)), key=lambda d: d.peak(self.dtype))

    def _group_link(self, kind: str, stage: int, ranks) -> Link:
        key = (kind, stage)
        if key not in self._p2p:
            self._p2p[key] = self.cluster.slowest_link(list(ranks))
        return self._p2p[key]

    def tp_link(self, stage: int) -> Link:
        return self._group_link("tp", stage, (self.layout.rank(t, 0, stage) for t in range(self.spec.tp)))

    def dp_link(self, stage: int) -> Link:
        return self._group_link("dp", stage, (self.layout.rank(0, d, stage) for d in range(self.spec.dp)))

    def p2p_link(self, src: int, dst: int) -> Link:
        """Slowest of the links joining the tensor-/data-parallel replicas of two pipeline stages."""
        key = (src, dst)
        if key not in self._p2p:
            links = [self.cluster.link(self.layout.rank(t, d, src), self.layout.rank(t, d, dst))
                     for d in range(self.spec.dp) for t in range(self.spec.tp)]
            self._p2p[key] = Link(min(x.bandwidth for x in links), max(x.latency for x in links))
        return self._p2p[key]

    # ---- compute ----------------------------------------------------------------------------------------------
    def _overhead(self, device: DeviceType) -> tuple[float, float]:
        for prof in self.profiles.for_device(device.name):
            if prof.overhead:
                return prof.overhead.get("forward_s", 0.0), prof.overhead.get("backward_s", 0.0)
        return 0.0, 0.0

    def _analytic(self, kind: str, tp: int, device: DeviceType) -> tuple[float, float]:
        model, b = self.spec.model, self.spec.pipeline.micro_batch_size
        rate = device.peak(self.dtype) * self.settings.fraction(device)
        fwd = unit_forward_flops(kind, model, b, tp) / rate
        if device.memory_bandwidth is not None:  # elementwise work: read and write what the unit keeps
            kept = unit_activation_bytes(kind, model, b, tp, self.spec.sp, None, "cuda")
            fwd += 2 * kept / (device.memory_bandwidth * self.settings.bandwidth_fraction)
        return fwd, 2 * fwd

    def _compute(self, kind: str, device: DeviceType, index: int | None) -> tuple[float, float, bool]:
        """(forward, backward, TP communication included): the profile at this tp, else its tp=1 times split
        over tp ranks, else analytic."""
        tp, b = self.spec.tp, self.spec.pipeline.micro_batch_size
        profiles = self.profiles.for_device(device.name)
        for degree in (tp, 1):
            for prof in profiles:
                timed = prof.unit_time(kind, degree, b, self.spec.model, index)
                if timed is not None:
                    return timed[0] * degree / tp, timed[1] * degree / tp, degree == tp
        if profiles and kind in ("attention", "mlp"):
            raise UsageError(f"--profile for device type {device.name} has no {kind} timings")
        fwd, bwd = self._analytic(kind, tp, device)
        return fwd, bwd, False

    def tp_comm(self, kind: str, stage: int) -> tuple[float, float]:
        """Tensor-parallel collectives of one unit: (forward, backward) seconds."""
        tp = self.spec.tp
        if tp == 1:
            return 0.0, 0.0
        link = self.tp_link(stage)
        m = self.spec.model.seq_length * self.spec.pipeline.micro_batch_size * self.spec.model.hidden_size \
            * self.spec.model.dtype_bytes
        ar, ag = allreduce_time(m, tp, link), allgather_time(m, tp, link)
        sp = self.spec.sp
        if kind in ("attention", "mlp"):
            return (2 * ag, 2 * ag) if sp else (ar, ar)
        if kind == "embedding":
            return ar, (ag if sp else 0.0)
        small = 3 * allreduce_time(self.spec.model.seq_length * self.spec.pipeline.micro_batch_size * 4, tp, link)
        return (ag if sp else 0.0) + small, (ag if sp else ar)

    def unit_times(self, kind: str, recompute: str | None, device: DeviceType, stage: int,
                   index: int | None = None) -> tuple[float, float]:
        """(forward, backward) of one unit (unit `index` of the model, for per-unit profiles) for one micro-batch,
        collectives and recomputation included."""
        fwd, bwd, comm_in = self._compute(kind, device, index)
        if not comm_in:
            cf, cb = self.tp_comm(kind, stage)
            fwd, bwd = fwd + cf, bwd + cb
        if recompute == "full":
            bwd += fwd
        elif recompute == "selective" and kind == "attention":
            bwd += fwd * core_attention_share(self.spec.model)
        return fwd, bwd

    # ---- per action --------------------------------------------------------------------------------------------
    def compute_time(self, rank: int, action: Action) -> float:
        table = self.chunk_forward if action.kind is Kind.FORWARD else self.chunk_backward
        return table[rank][action.chunk] * action.weight

    def transfer_time(self, src: int, dst: int, action: Action) -> float:
        return self.p2p_link(src, dst).time(self.spec.hidden_bytes(action.half is not None))

    def copy_time(self, rank: int, action: Action, nbytes: float) -> float:
        """An EVICT or LOAD of `nbytes` between `rank` and its peer (or host memory when it has none)."""
        if action.peer is None:
            return nbytes / self.cluster.inter_node.bandwidth
        return self.p2p_link(rank, action.peer).time(nbytes)

    # ---- after the pipeline -------------------------------------------------------------------------------------
    def _rank_params(self, names: list[str]) -> int:
        model = self.spec.model
        own_output = owns_output_weight(model.untie_embeddings_and_output_weights, self.spec.pp, names)
        return sum(unit_param_count(unit_kind(n), model, self.spec.tp, own_output) for n in names)

    def dp_sync_time(self, rank: int) -> float:
        return allreduce_time(4.0 * self.params[rank], self.spec.dp, self.dp_link(rank))

    def sp_sync_time(self, rank: int) -> float:
        """Sequence-parallel replicated gradients (LayerNorms, row-parallel biases) summed over tp."""
        if not self.spec.sp:
            return 0.0
        h = self.spec.model.hidden_size
        names = [n for c in chunk_units(self.spec.stage_layout(), self.spec.model, rank) for n in c]
        count = sum({"attention": 3 * h, "mlp": 3 * h, "head": 2 * h}.get(unit_kind(n), 0) for n in names)
        return allreduce_time(4.0 * count, self.spec.tp, self.tp_link(rank))

    def embedding_sync_time(self) -> float:
        spec = self.spec
        if spec.pp == 1 or spec.model.untie_embeddings_and_output_weights:
            return 0.0
        nbytes = 4.0 * (spec.model.vocab_size // spec.tp) * spec.model.hidden_size
        first, last = self.layout.rank(0, 0, 0), self.layout.rank(0, 0, spec.pp - 1)
        return allreduce_time(nbytes, 2, self.cluster.link(first, last))

    def optimizer_gather_time(self, rank: int) -> float:
        """ZeRO-1: the updated parameters are all-gathered over data parallel."""
        if not self.spec.distributed_optimizer:
            return 0.0
        nbytes = self.params[rank] * self.spec.model.dtype_bytes
        return allgather_time(nbytes, self.spec.dp, self.dp_link(rank))

    def optimizer_step_time(self, rank: int) -> float:
        return optimizer_step_seconds(self.params[rank], self.spec.dp, self.spec.distributed_optimizer,
                                      self.spec.model.dtype_bytes, self.devices[rank],
                                      self.settings.bandwidth_fraction)

    def finish_times(self, pipeline_end: list[float], last_backward: list[tuple[float, float]]) -> list[float]:
        """Per rank, when its iteration ends, given when its pipeline work ends and its last backward."""
        factor = self.settings.overlap_factor
        out = []
        for rank, end in enumerate(pipeline_end):
            sync = self.dp_sync_time(rank)
            start, dur = last_backward[rank]
            if sync > 0 and self.spec.overlap_grad_reduce:
                t = max(end, start + max(dur, sync) + (factor - 1) * min(dur, sync))
            else:
                t = end + sync
            out.append(t + self.sp_sync_time(rank))
        emb = self.embedding_sync_time()
        if emb > 0:
            both = max(out[0], out[-1]) + emb
            out[0] = out[-1] = both
        return [t + self.optimizer_step_time(r) + self.optimizer_gather_time(r) for r, t in enumerate(out)]
