"""Durations of every schedule action, and of the gradient synchronisation after the pipeline.

Compute: each unit's forward and backward time from the profile of the stage's device type (interpolated in
the micro-batch size; for another model, or a tp=1 timing split over tp ranks, rescaled by the kernel model's
times of the two shapes where the SM count is known, else by FLOPs; a device type without a profile is an error
when profiles are given), or analytically (by GEMM shape, kernel_time.py, where the device type gives its SMs, else
FLOPs / (peak x achievable fraction) with backward = 2 x forward). Tensor-parallel collectives run inside units:
measured when the profile has that tp degree, else added from the cluster's links (with Megatron-core's
--tp-comm-overlap, the sequence-parallel ones beside their GEMMs, as Transformer Engine runs them: tp_overlap.py). Recomputation
adds the recomputed forward (the whole unit for full, the attention core for selective) to the backward, unless the
profile timed the unit recomputed (its forward without saved activations, its backward with the recomputation and
whatever that costs beside the forward, e.g. the host's work of restoring the random states).
A zero-bubble schedule's split backward: W (the deferred weight gradients) takes `wgrad_share` of the unit's own
backward, the share its weight-gradient GEMMs have of the backward's matrix work (by GEMM shape where the
device type gives its SMs, else by FLOPs); B takes the rest with the recomputation, the collectives and the
profile's backward overhead.

Communication (the collectives' formulas, the links, the transfers and the synchronisation after the pipeline) is
comm_cost.py's, whose CommCosts is part of CostModel; the optimizer step after the pipeline is memory-bound.

CPU ranks that share cores (a cluster group with cores_per_node, e.g. gloo ranks on this machine) stretch their
work: core_sharing.py.

Mixtures of experts (docs/moe.md): an MoE unit's compute is the busiest rank's of the stage's expert layout (ep,
etp) under the routing model (CostSettings.moe_imbalance: max/mean tokens per expert, 1.0 by default): grouped
GEMMs at the tokens its experts receive (kernel_time.py), and its dispatcher's exchanges on the links they cross
(moe_cost.py); a profile's MoE unit time (timed at ep 1) is taken as the compute of any ep, and where a profile has
no MoE times (a dense model's profile, or one written before they were timed) the kernel model's. The expert
gradients are
reduced over the expert data-parallel group (comm_cost.py).

Context parallelism (cp > 1): a unit is timed on the rank's s/cp tokens (RunSpec.rank_model), its attention core
as 1/cp of the whole sequence's with the ring's or the all-to-alls' exposed time (cp_cost.py, `cp_attention_parts`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from ..pipeline.generators import SCHEDULES
from ..pipeline.schedule import Action, Kind
from .cluster import Cluster, DeviceType, Link
from .comm_cost import CommCosts
from .core_sharing import stage_sharing
from .cp_cost import a2a_times, core_times, cp_core_times, ring_times
from .engine import OURS, EngineConfig
from .elementwise import unit_elementwise_bytes
from .flops import core_attention_share, unit_forward_flops, unit_weight_grad_flops
from .kernel_time import (KernelDevice, device_kernels, moe_kernel_parts, shape_ratio, unit_kernel_times,
                          unit_weight_grad_time)
from ..units import owns_output_weight, unit_kind_of, unit_names
from .memory_model import chunk_unit_indices, chunk_units, unit_param_count, unit_param_split
from .moe_cost import busiest_share, dispatch_seconds
from .moe_model import local_tokens
from .profile_data import Profile, Profiles
from .spec import RunSpec
# re-exported: callers outside the planner import it from here (benchmarks/amp_trials.py)
from .comm_cost import allreduce_time  # noqa: F401


# the host's time per operator our runtime dispatches, all its host work included: on the H100 run's host (README,
# "What has run on a GPU") an 8-layer GPT (hidden 1024, flash, micro-batch 1) was bound by the host at 26.3 and
# 28.0 ms per micro-batch, over the 336 operators its units dispatch (models/op_count.py). Those runs were plan
# checks with pageable batch copies and the activation store's saved-tensor hooks on, which runs no longer have.
# Without them the third session's `launch` step measured 46-62 us; left at 80: one stream of micro-batches took
# 13.4 ms on one lease's host and 18.2 ms on the next
HOST_OP_S = 80e-6


@dataclass(frozen=True)
class CostSettings:
    achievable_fraction: float | None = None  # of peak FLOP/s for analytic times; None: the device type's (or 0.5)
    bandwidth_fraction: float = 0.8  # of the memory bandwidth, for memory-bound work (elementwise, optimizer)
    overlap_factor: float = 1.3  # slowdown of compute and communication that overlap
    engine: EngineConfig = EngineConfig()  # whose runtime: the bytes and the collective of the gradient reduction
    # host_ops: (kind, forward operators, backward operators) per unit kind (models/op_count.py), without the
    # tensor-parallel collectives; with them an analytic unit takes at least its host time (operators x host_op_s),
    # and with launch_blocking (CUDA_LAUNCH_BLOCKING=1: every launch waits for its kernel) the host time adds
    launch_blocking: bool = False
    host_op_s: float = HOST_OP_S
    host_ops: tuple[tuple[str, int, int], ...] | None = None
    moe_imbalance: float = 1.0  # max/mean tokens per expert (moe_model.py's routing model; --moe-load-imbalance)

    def __post_init__(self) -> None:
        if self.achievable_fraction is not None and not 0 < self.achievable_fraction <= 1:
            raise UsageError(f"--achievable-fraction must be in (0, 1], got {self.achievable_fraction}")
        if not 0 < self.bandwidth_fraction <= 1:
            raise UsageError(f"--bandwidth-fraction must be in (0, 1], got {self.bandwidth_fraction}")
        if self.overlap_factor < 1:
            raise UsageError(f"--overlap-factor must be >= 1, got {self.overlap_factor}")
        if not 0 <= self.host_op_s < 0.01:
            raise UsageError(f"--host-op-us must be in [0, 10000), got {self.host_op_s * 1e6:g}")
        if self.launch_blocking and self.host_ops is None:
            raise UsageError("--cuda-launch-blocking needs the units' operator counts (models/op_count.py)")

    def host_time(self, kind: str, tp: int, sp: bool) -> tuple[float, float]:
        """(forward, backward) seconds of a unit's host work (0 without operator counts): its operators, and its
        tensor-parallel collectives (one each way; with sequence parallelism two forward and three backward, as
        tp_comm_parts counts them; the vocabulary-parallel loss's three reductions forward), at host_op_s each."""
        if self.host_ops is None:
            return 0.0, 0.0
        ops = {k: (f, b) for k, f, b in self.host_ops}
        if kind not in ops:
            raise UsageError(f"--cuda-launch-blocking: no operator count for {kind} units")
        f, b = ops[kind]
        if tp > 1:
            extra = {"attention": (1, 1), "mlp": (1, 1), "embedding": (1, 0), "head": (3, 1), "moe": (2, 2)}[kind]
            if sp and kind in ("attention", "mlp"):
                extra = (2, 3)
            elif sp and kind == "head":
                extra = (4, 2)
            f, b = f + extra[0], b + extra[1]
        return f * self.host_op_s, b * self.host_op_s

    def fraction(self, device: DeviceType) -> float:
        """Achievable share of `device`'s peak FLOP/s: the setting, else the device type's, else 0.5."""
        if self.achievable_fraction is not None:
            return self.achievable_fraction
        return device.achievable_fraction if device.achievable_fraction is not None else 0.5


def optimizer_step_bytes(params: float, dp: int, zero1: bool, dtype_bytes: int) -> float:
    """Bytes the optimizer step moves: per parameter the gradient norm and the zeroing touch the fp32 gradient
    (8 bytes) and the parameter is written; per parameter the rank updates (all of them, or its ZeRO-1 shard) Adam
    reads the gradient and reads and writes the fp32 master and both moments (28 bytes)."""
    shard = params / dp if zero1 else params
    return params * (8 + dtype_bytes) + shard * 28


def optimizer_step_seconds(params: float, dp: int, zero1: bool, dtype_bytes: int, device: DeviceType,
                           bandwidth_fraction: float) -> float:
    """The optimizer step is memory-bound (optimizer_step_bytes): at the rate a CPU profile measured, with its
    fixed part, else at the device's memory bandwidth x the achievable fraction of it; 0 when neither is known."""
    moved = optimizer_step_bytes(params, dp, zero1, dtype_bytes)
    if device.optimizer_bytes_per_s is not None:
        return device.optimizer_fixed_s + moved / device.optimizer_bytes_per_s
    if device.memory_bandwidth is None:
        return 0.0
    return moved / (device.memory_bandwidth * bandwidth_fraction)


def check_engine_runs(spec: RunSpec, engine: EngineConfig) -> None:
    """A UsageError where `spec` uses what `engine` does not run. Ours runs everything. Megatron-LM runs 1F1B
    and interleaved 1F1B (and, in the zero-bubble authors' fork, sail-sg/zero-bubble-pipeline-parallelism, the
    zero-bubble schedules) over stages of whole layers, where the embedding or the output layer may also be a
    stage of its own (--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split), without
    BPipe, slicing or per-unit strategies; DeepSpeed's pipeline engine runs 1F1B (or GPipe) without BPipe or
    sequence parallelism."""
    if engine.name == OURS:
        return
    pl, name = spec.pipeline, f"--engine {engine.name}"
    zero_bubble = tuple(x for x in SCHEDULES if x.startswith("zb"))
    runs = ("1f1b", "gpipe") if engine.blocking_p2p else ("1f1b", "interleaved") + zero_bubble
    if pl.schedule not in runs:
        shown = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "interleaved 1F1B"}
        raise UsageError(f"{name} runs the {', '.join(shown.get(r, r) for r in runs)} schedule, not {pl.schedule}")
    for used, what in ((pl.bpipe, "BPipe (--bpipe)"), (pl.slicing, "micro-batch slicing (--microbatch-slicing)"),
                       (spec.unit_strategies, "per-unit strategies (--unit-strategies)"),
                       (engine.blocking_p2p and spec.sp, "sequence parallelism (--sequence-parallel)")):
        if used:
            raise UsageError(f"{name} has no {what}")
    units, layers, end = unit_names(spec.model.num_layers), spec.model.num_layers, 0
    alone = () if engine.blocking_p2p else (1, 2 * layers + 1)  # after the embedding alone, the head alone
    for size in pl.partition[:-1]:
        end += size  # the next stage starts with unit `end`: a layer's attention after a whole layer
        if not ((units[end].startswith("attn_") and 3 <= end <= 2 * layers - 1) or end in alone):
            raise UsageError(f"{name} runs pipeline stages of whole transformer layers (the embedding and the head "
                             f"beside layers{'' if engine.blocking_p2p else ', or each a stage of its own'}); "
                             f"--pipeline-partition {','.join(map(str, pl.partition))} starts a stage at {units[end]}")


class CostModel(CommCosts):
    """Durations for one RunSpec on one cluster. Build once, query per action (compute here, communication
    in CommCosts, comm_cost.py)."""

    def __init__(self, spec: RunSpec, cluster: Cluster, profiles: Profiles | Profile | None = None,
                 settings: CostSettings = CostSettings(), placement: dict | None = None) -> None:
        """`placement`: a dict shared by cost models of one placement (tp, pp, dp, rank order on one cluster), which
        then work out each stage's device and links once."""
        if spec.world_size > cluster.num_gpus:
            raise UsageError(f"the layout needs {spec.world_size} GPUs ({spec.describe_degrees()}) "
                             f"but cluster {cluster.name} has {cluster.num_gpus}")
        if isinstance(profiles, Profile):
            profiles = Profiles([profiles])
        self.spec, self.cluster, self.profiles, self.settings = spec, cluster, profiles or Profiles(), settings
        self.unit_model = spec.rank_model()  # what one context-parallel rank computes (the model at cp 1)
        self.experts = spec.experts(settings.moe_imbalance)
        if settings.launch_blocking and self.profiles:
            raise UsageError("--cuda-launch-blocking models blocking launches on analytic unit times; a profile's "
                             "times are what its run did: profile with CUDA_LAUNCH_BLOCKING=1 set instead")
        self.dtype = spec.model.params_dtype
        self.layout = spec.rank_layout()
        p = spec.pp
        self.blocking_p2p = settings.engine.blocking_p2p
        check_engine_runs(spec, settings.engine)
        placement = {} if placement is None else placement
        if "devices" not in placement:
            placement["devices"] = [self._stage_device(s) for s in range(p)]
        self.devices = placement["devices"]
        for device in {d.name: d for d in self.devices}.values():
            self.profiles.for_device(device.name)  # a device type without a profile is an error now, not later
        self._p2p: dict[tuple, Link] = placement.setdefault("links", {})  # stage pairs, each stage's tp/dp group
        self._transfers: dict[tuple, float] = {}  # (src, dst, half) -> p2p seconds of the hidden state
        self._held: dict[tuple, float] = {}  # (rank, kind, half) -> transfers a blocking engine's action holds
        self._tables: tuple[list[list[float]], list[list[float]], list[int]] | None = None
        self._grad_units: dict[int, list] = {}  # grad_units, per rank
        self._wshare: dict[tuple, float] = {}
        # CPU ranks sharing cores: per stage {node: its ranks there}, cores per node, the static factor per stage
        self.shares_cores = cluster.shares_cores
        self.action_factors: dict[tuple[int, Action], float] | None = None  # core_sharing.py sets it
        if self.shares_cores:
            if "sharing" not in placement:
                placement["sharing"] = stage_sharing(cluster, [self.gpus(s) for s in range(p)])
            self.stage_nodes, self.node_cores, self.static_factor = placement["sharing"]
        else:
            self.stage_nodes, self.node_cores, self.static_factor = [], {}, [1.0] * p

    @property
    def chunk_forward(self) -> list[list[float]]:
        """Per rank, per model chunk: forward seconds of one micro-batch."""
        return self._chunk_tables()[0]

    @property
    def chunk_backward(self) -> list[list[float]]:
        return self._chunk_tables()[1]

    @property
    def chunk_wgrad(self) -> list[list[float]]:
        """Per rank, per model chunk: the W (deferred weight gradients) of one micro-batch, part of its backward
        (zero where a subclass's tables do not split it)."""
        self._chunk_tables()
        return getattr(self, "_wtable", None) or [[0.0] * len(b) for b in self.chunk_backward]

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
        self._split = []  # per rank, per chunk: (forward work, forward wait, backward work, backward wait)
        self._wsplit = []  # per rank, per chunk: (W work, W wait), part of the backward
        self._wtable = []
        for rank in range(spec.pp):
            chunks = chunk_unit_indices(layout, rank)
            fwd, bwd, split, wsplit, wtab = [], [], [], [], []
            for c in chunks:
                fw = fl = bw = bl = ww = wl = 0.0
                for i in c:
                    kind = unit_kind_of(spec.model, names[i])
                    (a, b), (x, y) = self.unit_parts(kind, layout.unit_recompute(i), self.devices[rank], rank, i)
                    u, v = self.wgrad_parts(kind, self.devices[rank], i)
                    fw, fl, bw, bl, ww, wl = fw + a, fl + b, bw + x, bl + y, ww + u, wl + v
                over = self._overhead(self.devices[rank])
                fw, bw = fw + over[0], bw + over[1]
                k = self.static_factor[rank]
                fwd.append(fw * k + fl)
                bwd.append(bw * k + bl)
                split.append((fw, fl, bw, bl))
                wsplit.append((ww, wl))
                wtab.append(ww * k + wl)
            chunk_forward.append(fwd)
            chunk_backward.append(bwd)
            self._split.append(split)
            self._wsplit.append(wsplit)
            self._wtable.append(wtab)
            params.append(self._rank_params([names[i] for c in chunks for i in c]))
        self._tables = (chunk_forward, chunk_backward, params)
        return self._tables

    # ---- placement ---------------------------------------------------------------------------------------------
    def gpus(self, stage: int) -> list[int]:
        return self.spec.stage_ranks(stage)

    def _stage_device(self, stage: int) -> DeviceType:
        """The slowest device type holding the stage (data-parallel replicas wait for it)."""
        return min(self.cluster.devices_of(self.gpus(stage)), key=lambda d: d.peak(self.dtype))

    # ---- compute ----------------------------------------------------------------------------------------------
    def _overhead(self, device: DeviceType) -> tuple[float, float]:
        for prof in self.profiles.for_device(device.name):
            if prof.overhead:
                return prof.overhead.get("forward_s", 0.0), prof.overhead.get("backward_s", 0.0)
        return 0.0, 0.0

    def _analytic(self, kind: str, tp: int, device: DeviceType) -> tuple[float, float]:
        """Matrix work by GEMM shape where the device type gives its SMs (kernel_time.py), else FLOPs at the
        achievable rate with backward = 2 x forward; plus the elementwise kernels' bytes at memory bandwidth
        (elementwise.py) and, in backward, the engine's accumulation of each weight gradient (a measured profile
        includes both)."""
        model, b = self.unit_model, self.spec.pipeline.micro_batch_size
        kd = self.kernel_device(device)
        if kd is not None and kind == "moe":  # the busiest rank of the expert layout (kernel_time.py)
            parts = moe_kernel_parts(model, b, tp, kd, self.spec.sp, 1, self.experts)
            fwd, bwd = sum(f for f, _, _ in parts), sum(g for _, g, _ in parts)
        elif kd is not None:
            fwd, bwd = unit_kernel_times(kind, model, b, tp, kd)
        else:
            fwd = unit_forward_flops(kind, model, b, tp) / (device.peak(self.dtype) * self.settings.fraction(device))
            if kind == "moe":
                fwd *= busiest_share(model, local_tokens(model, b, tp, self.spec.sp), self.experts)
            bwd = 2 * fwd
        if device.memory_bandwidth is not None:
            grad_bytes = 4 if self.settings.engine.grads_in_fp32(model.params_dtype) else model.dtype_bytes
            moved = unit_elementwise_bytes(kind, model, b, tp, self.spec.sp, grad_bytes)
            if kind != "embedding":  # (the table's gradient is the embedding's elementwise work)
                own = model.untie_embeddings_and_output_weights or self.spec.pp > 1
                accumulate = self.settings.engine.accumulation_bytes(model.params_dtype)
                moved = moved[0], moved[1] + unit_param_count(kind, model, tp, own, self.experts) * accumulate
            rate = device.memory_bandwidth * self.settings.bandwidth_fraction
            fwd, bwd = fwd + moved[0] / rate, bwd + moved[1] / rate
        if self.settings.launch_blocking:  # the launches wait for the kernels: the host's time adds
            host = self.settings.host_time(kind, tp, self.spec.sp)
            fwd, bwd = fwd + host[0], bwd + host[1]
        return fwd, bwd

    def kernel_device(self, device: DeviceType) -> KernelDevice | None:
        """The kernel model's view of `device` (None where the cluster file gives no SM count)."""
        return device_kernels(device, self.dtype, self.settings.fraction(device))

    def _compute(self, kind: str, device: DeviceType, index: int | None) -> tuple[float, float, bool]:
        """(forward, backward, TP communication included): the profile at this tp, else its tp=1 times split
        over tp ranks, else analytic."""
        (fw, fl), (bw, bl), comm_in = self._compute_parts(kind, device, index)
        return fw + fl, bw + bl, comm_in

    def _compute_parts(self, kind: str, device: DeviceType, index: int | None, recompute: str | None = None):
        """((forward work, wait), (backward work, wait), TP communication included); waiting only where ranks
        share cores and a tp > 1 profile entry holds more than its share of the tp=1 work. With `recompute`: the
        profile's timing of the unit recomputed so, None where it has none."""
        tp, b = self.spec.tp, self.spec.pipeline.micro_batch_size
        profiles = self.profiles.for_device(device.name)
        for degree in (tp, 1):
            for prof in profiles:
                kd = prof.kernel_device(self.kernel_device(device))
                timed = prof.unit_time(kind, degree, b, self.unit_model, index, kd, recompute)
                if timed is not None:
                    shard = (degree / tp,) * 2
                    if degree != tp and kd is not None:  # a tp=1 timing split by the kernel model's shard shapes
                        shard = shape_ratio(kind, self.unit_model, b, tp, self.unit_model, degree, kd) or shard
                    f, g = timed[0] * shard[0], timed[1] * shard[1]
                    if self.shares_cores and degree > 1 and prof.device.get("kind") == "cpu":
                        one = prof.unit_time(kind, 1, b, self.unit_model, index, recompute=recompute)
                        if one is not None:
                            c = max(1.0, degree * int(prof.device.get("threads") or 1) / prof.cores())
                            fw, bw = min(f / c, one[0] / degree), min(g / c, one[1] / degree)
                            return (fw, f - fw * c), (bw, g - bw * c), True
                    return (f, 0.0), (g, 0.0), degree == tp
        if recompute is not None:
            return None
        if profiles and kind in ("attention", "mlp"):  # (an MoE unit without profile times: the kernel model's)
            raise UsageError(f"--profile for device type {device.name} has no {kind} timings")
        fwd, bwd = self._analytic(kind, tp, device)
        return (fwd, 0.0), (bwd, 0.0), False

    def wgrad_share(self, kind: str, device: DeviceType) -> float:
        """Share of a unit's own backward matrix work that is its deferred weight gradients (a split backward's W):
        weight-gradient GEMM time over backward kernel time by GEMM shape where the device type gives its SMs,
        else weight-gradient FLOPs over backward FLOPs (2 x forward)."""
        key = (kind, device.name, device.sm_count)
        got = self._wshare.get(key)
        if got is None:
            model, b, tp = self.unit_model, self.spec.pipeline.micro_batch_size, self.spec.tp
            kd = self.kernel_device(device)
            if kd is not None:
                w, total = unit_weight_grad_time(kind, model, b, tp, kd), unit_kernel_times(kind, model, b, tp, kd)[1]
            else:
                w, total = unit_weight_grad_flops(kind, model, b, tp), 2 * unit_forward_flops(kind, model, b, tp)
            got = self._wshare[key] = w / total if total > 0 else 0.0
        return got

    def wgrad_parts(self, kind: str, device: DeviceType, index: int | None = None) -> tuple[float, float]:
        """(work, wait) of a unit's W: `wgrad_share` of its own backward (profiled or analytic) on a core of its
        own; recomputation and the collectives added outside a profile stay in B."""
        (_, _), (bw, bl), _ = self._compute_parts(kind, device, index)
        share = self.wgrad_share(kind, device)
        return bw * share, bl * share

    def unit_times(self, kind: str, recompute: str | None, device: DeviceType, stage: int,
                   index: int | None = None) -> tuple[float, float]:
        """(forward, backward) of one unit (unit `index` of the model, for per-unit profiles) for one micro-batch,
        collectives and recomputation included; CPU work stretched by the stage's static core-sharing factor."""
        (fw, fl), (bw, bl) = self.unit_parts(kind, recompute, device, stage, index)
        k = self.static_factor[stage] if stage < len(self.static_factor) else 1.0
        return fw * k + fl, bw * k + bl

    def unit_parts(self, kind: str, recompute: str | None, device: DeviceType, stage: int,
                   index: int | None = None) -> tuple[tuple[float, float], tuple[float, float]]:
        """unit_times as ((forward work, forward wait), (backward work, backward wait)) on a core of its own."""
        # a profile that timed the unit recomputed holds its recomputation, whatever it costs beside the forward
        timed = self._compute_parts(kind, device, index, recompute) if recompute and self.profiles else None
        (fw, fl), (bw, bl), comm_in = timed if timed is not None else self._compute_parts(kind, device, index)
        if not comm_in:  # gloo's reduction burns CPU: the bandwidth term is work, the latency waiting
            (a, b), (c, d) = self.tp_comm_parts(kind, stage)
            fw, fl, bw, bl = fw + a, fl + b, bw + c, bl + d
            if timed is not None and recompute == "full":  # the recomputed forward's collectives
                bw, bl = bw + a, bl + b
        if kind == "moe":  # the dispatcher's exchanges, not overlapped (moe_cost.py)
            xf, xb = self.moe_dispatch(stage)
            fl, bl = fl + xf, bl + xb
        core_again = None  # context parallelism: the attention core's forward, as selective recomputation reruns it
        if kind == "attention" and self.spec.cp > 1:
            (xf, xl), (xb, xbl), core_again = self.cp_attention_parts(device, stage)
            fw, fl, bw, bl = fw + xf, fl + xl, bw + xb, bl + xbl
            if timed is not None and recompute:  # the profile's recomputed forward ran the local core
                bw, bl = bw + xf, bl + xl
        if (self.settings.host_ops is not None and not self.settings.launch_blocking and not self.profiles
                and device.sm_count is not None):
            # launches run ahead of the GPU (a device type with SMs), but no faster than the host issues them: a
            # unit takes at least its host time (a profile's wall times hold it already)
            hf, hb = self.settings.host_time(kind, self.spec.tp, self.spec.sp)
            fw, bw = fw + max(0.0, hf - fw - fl), bw + max(0.0, hb - bw - bl)
        if timed is None and recompute == "full":
            bw, bl = bw + fw, bl + fl
        elif timed is None and recompute == "selective" and core_again is not None:
            bw, bl = bw + core_again[0], bl + core_again[1]
        elif timed is None and recompute == "selective" and kind == "attention":
            share = core_attention_share(self.spec.model)
            bw, bl = bw + fw * share, bl + fl * share
        return (fw, fl), (bw, bl)

    def cp_attention_parts(self, device: DeviceType, stage: int):
        """Context parallelism's attention beyond the local sequence's unit times (cp_cost.py): ((forward work,
        exposed exchange), (backward work, exposed exchange), (the core's forward work, its exposed exchange): what
        selective recomputation runs again). The work is the context-parallel core (1/cp of the whole sequence's
        causal core) less the local sequence's core the unit times hold."""
        key = ("cp-attention", device.name, stage)
        got = self._wshare.get(key)
        if got is None:
            spec, b = self.spec, self.spec.pipeline.micro_batch_size
            kd = self.kernel_device(device)
            rate = device.peak(self.dtype) * self.settings.fraction(device)
            timed = self._timed_cp_core(device)
            if timed is not None:  # the runtime's tiles as the profile timed them
                core, local = timed
            else:
                local = core_times(self.unit_model, b, spec.tp, kd, rate)
                core = cp_core_times(spec.model, b, spec.tp, spec.cp, kd, rate)
            if spec.cp_comm_type == "a2a":
                comm = a2a_times(spec.model, b, spec.tp, spec.cp, self.cp_link(stage, ring=False))
            else:
                comm = ring_times(spec.model, b, spec.tp, spec.cp, self.cp_link(stage), core)
            got = self._wshare[key] = ((core[0] - local[0], comm[0]), (core[1] - local[1], comm[1]),
                                       (core[0], comm[0]))
        return got

    def moe_dispatch(self, stage: int) -> tuple[float, float]:
        """(forward, backward) seconds of an MoE unit's dispatcher exchanges on the stage (moe_cost.py)."""
        key = ("moe-dispatch", stage)
        got = self._wshare.get(key)
        if got is None:
            spec = self.spec
            tokens = local_tokens(self.unit_model, spec.pipeline.micro_batch_size, spec.tp, spec.sp)
            groups = ("ep", "etp", "etp_ep")
            got = self._wshare[key] = dispatch_seconds(
                self.unit_model, tokens, self.experts, {g: self.expert_ranks(stage, g) for g in groups},
                {g: self.expert_link(stage, g) for g in groups}, self.cluster)
        return got

    def _timed_cp_core(self, device: DeviceType):
        """(the context-parallel core, the local core the unit times hold), each (forward, backward), where a
        profile of `device` timed the runtime's tiles (Profile.cp_core_time), else None. The local core is the
        attention unit's profiled time at the rank's s/cp tokens times the core's share of its FLOPs
        (flops.core_attention_share), the share a FLOP-rescaled unit time gives its core."""
        spec, b = self.spec, self.spec.pipeline.micro_batch_size
        for prof in self.profiles.for_device(device.name):
            core = prof.cp_core_time(spec.model, b, spec.tp, spec.cp)
            if core is not None:
                (fw, fl), (bw, bl), _ = self._compute_parts("attention", device, None)
                share = core_attention_share(self.unit_model)
                return core, ((fw + fl) * share, (bw + bl) * share)
        return None

    # ---- per action --------------------------------------------------------------------------------------------
    def compute_time(self, rank: int, action: Action) -> float:
        if self.blocking_p2p:
            return self._compute_time(rank, action) + self._held_transfers(rank, action)
        return self._compute_time(rank, action)

    def _compute_time(self, rank: int, action: Action) -> float:
        if self.action_factors is not None:
            work, wait = self._action_parts(rank, action)
            return (work * self.action_factors.get((rank, action), self.static_factor[rank]) + wait) * action.weight
        kind = action.kind
        if kind is Kind.FORWARD:
            return self.chunk_forward[rank][action.chunk] * action.weight
        if kind is Kind.BACKWARD:
            return self.chunk_backward[rank][action.chunk] * action.weight
        w = self.chunk_wgrad[rank][action.chunk]
        return (w if kind is Kind.BACKWARD_WEIGHT else self.chunk_backward[rank][action.chunk] - w) * action.weight

    def _action_parts(self, rank: int, action: Action) -> tuple[float, float]:
        """(work, wait) of a compute action on a core of its own: forward, backward, or a split backward's B or W."""
        fw, fl, bw, bl = self._split_of(rank, action.chunk)
        kind = action.kind
        if kind is Kind.FORWARD:
            return fw, fl
        if kind is Kind.BACKWARD:
            return bw, bl
        wsplit = getattr(self, "_wsplit", None)
        ww, wl = wsplit[rank][action.chunk] if wsplit else (0.0, 0.0)
        return (ww, wl) if kind is Kind.BACKWARD_WEIGHT else (bw - ww, bl - wl)

    def _split_of(self, rank: int, chunk: int) -> tuple[float, float, float, float]:
        return self.work_split()[rank][chunk]

    def work_split(self) -> list[list[tuple[float, float, float, float]]] | None:
        """Per rank, per chunk: (forward work, forward wait, backward work, backward wait) on a core of its own;
        None when a subclass built its tables without it (then no processor-sharing replay)."""
        self._chunk_tables()
        return getattr(self, "_split", None)

    def busy_share(self, rank: int, action: Action, factor: float) -> float:
        """Share of a compute action's span its ranks spend on the CPU (the rest waits), at `factor`."""
        work, wait = self._action_parts(rank, action)
        total = work * factor + wait
        return 1.0 if total <= 0 else work * factor / total

    # ---- after the pipeline: parameters and the optimizer step (the rest is CommCosts') -------------------------
    def _rank_params(self, names: list[str]) -> int:
        return sum(self._rank_split(names))

    def _rank_split(self, names: list[str]) -> tuple[int, int]:
        """(dense, expert) parameters of a rank holding units `names`."""
        model = self.spec.model
        own_output = owns_output_weight(model.untie_embeddings_and_output_weights, self.spec.pp, names)
        splits = [unit_param_split(unit_kind_of(model, n), model, self.spec.tp, own_output, self.experts)
                  for n in names]
        return sum(d for d, _ in splits), sum(x for _, x in splits)

    def expert_params(self, rank: int) -> int:
        """The expert parameters of pipeline rank `rank` (0 for a dense model)."""
        if self.spec.model.moe is None:
            return 0
        names = [n for c in chunk_units(self.spec.stage_layout(), self.spec.model, rank) for n in c]
        return self._rank_split(names)[1]

    def optimizer_step_time(self, rank: int) -> float:
        """The step over the rank's parameters; with ZeRO-1 Adam updates its shard: the dense ones' over dp x cp, the
        expert ones' over edp (given to optimizer_step_seconds as the same bytes over dp x cp)."""
        params, shards = self.params[rank], self.spec.grad_dp
        expert = self.expert_params(rank)
        if expert and self.spec.distributed_optimizer:
            shard = (params - expert) / shards + expert / self.spec.edp
            shards = params / shard if shard > 0 else shards
        return optimizer_step_seconds(params, shards, self.spec.distributed_optimizer,
                                      self.spec.model.dtype_bytes, self.devices[rank],
                                      self.settings.bandwidth_fraction)

    def grad_units(self, rank: int) -> list[list[tuple[float, float, float]]]:
        """Per chunk of the rank, its units' (parameter elements, forward seconds, backward seconds) in forward
        order: what the overlap model (overlap.py) needs to know when each bucket is ready or needed."""
        if rank not in self._grad_units:
            spec, names = self.spec, unit_names(self.spec.model.num_layers)
            layout = spec.stage_layout()
            chunks = chunk_unit_indices(layout, rank)
            own = owns_output_weight(spec.model.untie_embeddings_and_output_weights, spec.pp,
                                     [names[i] for c in chunks for i in c])
            kinds = [unit_kind_of(spec.model, n) for n in names]
            self._grad_units[rank] = [
                [(self.reduced_elements(rank, *unit_param_split(kinds[i], spec.model, spec.tp, own, self.experts)),
                  *self.unit_times(kinds[i], layout.unit_recompute(i), self.devices[rank], rank, i))
                 for i in c] for c in chunks]
        return self._grad_units[rank]
