"""The CUDA memory a rank needs beyond the tensors the memory model counts, per device type and layout.

The memory model counts tensors byte for byte; a CUDA process holds more. The allowance keeps the form the
memory model and the solver use, a fixed part plus a fraction of the counted bytes, and derives both per rank:

1. CUDA context (outside the caching allocator): the driver's per-process state and the loaded kernel images.
   No formula gives it; the device type in the cluster file states it (`cuda_context_gb`; default 0.5 GiB,
   PyTorch under CUDA's lazy module loading, the default since CUDA 11.7 and PyTorch 1.13: NVIDIA's CUDA C++
   Programming Guide, "Lazy Loading"; eager loading of every kernel takes more). A measured profile replaces it.
2. cuBLAS workspaces (inside the allocator, not tensors of the model): PyTorch gives each (cuBLAS handle,
   stream) pair a workspace of CUBLAS_WORKSPACE_CONFIG's default size, ":4096:2:16:8" (2 x 4 MiB + 8 x 16 KiB)
   before Hopper, 32 MiB on Hopper (cuBLAS documentation of cublasSetWorkspace: 4 MiB recommended, 32 MiB for
   Hopper; PyTorch's CublasHandlePool.cpp), and a cuBLASLt workspace (CUBLASLT_WORKSPACE_SIZE: 1 MiB, 4 MiB on
   Ampere with >= 24 GB, 32 MiB from Hopper on; PyTorch pull request 120925). Two pairs: the forward runs on the
   main thread, the backward on the autograd engine's device thread, each thread with its own handle.
3. NCCL buffers (outside the allocator): NCCL_BUFFSIZE (default 4 MiB, the Simple protocol's buffer; the
   smaller LL and LL128 buffers are not counted) per channel and peer connection of each communicator: two
   ring neighbours over the device type's collective channels (`nccl_channels`, what NCCL_DEBUG=INFO prints as
   "N coll channels"; default 8), and for the pipeline's two-rank send/recv communicators one peer over NCCL's
   default 2 p2p channels per peer. The communicators are the groups our runtime uses (parallel/state.py),
   each created by NCCL at its first collective: the world (start-up barriers), tp, dp, pp, model-parallel
   (the gradient norm), the tied embedding's, and four directional p2p groups (to and from each neighbour).
4. The caching allocator (PyTorch's CUDACachingAllocator.cpp): a request is rounded up to 512 bytes; requests of
   at most 1 MiB share 2 MiB segments; larger ones below 10 MiB are cut from 20 MiB segments; from 10 MiB on a
   request gets a segment of its own, rounded up to 2 MiB. A freed block is handed to the smallest request it
   fits (best fit), so the 20 MiB segments' tails are counted after packing the held requests largest first,
   each into the fullest segment it fits. The fraction is that overhead over the bytes of what a rank holds at
   its peak: the saved activations (unit_saved_tensors) of its layers for each of the pp micro-batches the first
   1F1B stage holds, and its layers' weight matrices with their per-tensor optimizer states (gradients sit in
   flat buckets; under nemo's Apex optimizer the parameters and states are flat buffers too). Freed blocks
   between live ones that no later request fits are not counted (a profile measures them: max reserved over max
   allocated).

Precedence: --memory-workspace-gb / --memory-fragmentation, then a profile's calibrated memory_allowance, then a
profile's measured CUDA memory (`cuda_memory`: context, NCCL bytes per communicator, allocator overhead), then
the terms above.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import ModelConfig
from .cluster import DeviceType
from .engine import PrecisionConfig
from .memory_model import MemorySettings
from .unit_activations import unit_saved_tensors

MiB, GiB = 2**20, 2**30
DEFAULT_CONTEXT_BYTES = 0.5 * GiB
DEFAULT_NCCL_CHANNELS = 8
NCCL_BUFFSIZE = 4 * MiB
NCCL_P2P_CHANNELS_PER_PEER = 2
CUBLAS_STREAMS = 2  # the forward's thread and the autograd engine's device thread
_SMALL, _MID_SEGMENT, _LARGE, _LARGE_ROUND = MiB, 20 * MiB, 10 * MiB, 2 * MiB  # CUDACachingAllocator.cpp


@dataclass(frozen=True)
class MeasuredCudaMemory:
    """What `autoconfig.py profile` measured on a GPU (None: not measured, the derived term stays)."""

    context_bytes: float | None = None  # outside the allocator in a process without communicators
    nccl_bytes_per_communicator: float | None = None  # outside the allocator, per collective communicator
    allocator_fraction: float | None = None  # max reserved / max allocated - 1 over the profiled steps


@dataclass(frozen=True)
class AllowanceTerms:
    context: float
    cublas: float
    nccl: float
    fragmentation: float
    communicators: int

    @property
    def workspace(self) -> float:
        return self.context + self.cublas + self.nccl

    def to_json(self) -> dict:
        return {"context_bytes": self.context, "cublas_bytes": self.cublas, "nccl_bytes": self.nccl,
                "nccl_communicators": self.communicators, "allocator_fraction": self.fragmentation}


def cublas_workspace_bytes(device: DeviceType | None) -> float:
    """cuBLAS and cuBLASLt workspaces of one (handle, stream) pair on `device` (term 2)."""
    cc = device.compute_capability if device is not None else None
    if cc is not None and cc >= 9:
        return 32 * MiB + 32 * MiB
    lt = 4 * MiB if cc is not None and cc >= 8 and device.memory_bytes >= 24e9 else MiB
    return 2 * 4 * MiB + 8 * 16 * 1024 + lt


def nccl_communicators(tp: int, dp: int, pp: int, tied_embedding: bool, cp: int = 1) -> list[tuple[int, bool]]:
    """(ranks, point-to-point) of every NCCL communicator one rank of the layout joins (term 3); with context
    parallelism the cp group (its attention's exchange) and the gradients' dp x cp group in the dp group's place."""
    comms = [(n, False) for n in (tp * cp * dp * pp, tp, cp, dp * cp, pp, tp * pp) if n > 1]
    if pp > 1:
        if tied_embedding:
            comms.append((2, False))
        comms += [(2, True)] * 4
    return comms


def nccl_bytes(comms: list[tuple[int, bool]], channels: int, per_collective: float | None = None) -> float:
    total = 0.0
    for ranks, p2p in comms:
        if p2p:
            total += NCCL_P2P_CHANNELS_PER_PEER * NCCL_BUFFSIZE
        elif per_collective is not None:
            total += per_collective
        else:
            total += min(ranks - 1, 2) * channels * NCCL_BUFFSIZE
    return total


def block_overhead(nbytes: int) -> float:
    """Bytes the caching allocator reserves for one request of `nbytes` beyond it, where requests of its size
    alone fill the segments (term 4)."""
    size = _rounded(nbytes)
    if size <= _SMALL:
        return size - nbytes
    if size < _LARGE:
        per_segment = _MID_SEGMENT // size
        return size - nbytes + (_MID_SEGMENT - per_segment * size) / per_segment
    return -(-size // _LARGE_ROUND) * _LARGE_ROUND - nbytes


def _rounded(nbytes: int) -> int:
    return max(512, -(-nbytes // 512) * 512)


def segment_tails(counts: dict[int, int]) -> int:
    """Bytes of the 20 MiB segments that `counts` (rounded size -> requests) of 1 to 10 MiB leave unused, the
    larger sizes placed first and each request in the fullest segment it fits (the allocator's best fit over the
    pool's free blocks): tails of large requests take smaller ones."""
    free: dict[int, int] = {}  # unused bytes of a segment -> segments with that many
    for size in sorted(counts, reverse=True):
        left = counts[size]
        for room in sorted(r for r in free if r >= size):
            if not left:
                break
            fit, segments = room // size, free.pop(room)
            full = min(segments, left // fit)
            part = left - full * fit if full < segments else 0
            for r, n in ((room - fit * size, full), (room - part * size, 1 if part else 0),
                         (room, segments - full - (1 if part else 0))):
                if n:
                    free[r] = free.get(r, 0) + n
            left -= full * fit + part
        if left:
            fit = _MID_SEGMENT // size
            for r, n in ((_MID_SEGMENT - fit * size, left // fit), (_MID_SEGMENT - (left % fit) * size,
                                                                      1 if left % fit else 0)):
                if n:
                    free[r] = free.get(r, 0) + n
    return sum(r * n for r, n in free.items())


def held_tensor_bytes(model: ModelConfig, tp: int, pp: int, micro_batch_size: int, sp: bool,
                      precision: PrecisionConfig, cp: int = 1) -> list[tuple[int, int]]:
    """(bytes, count) of the allocations of the layers of a first pipeline rank at its peak (see term 4)."""
    layers = -(-model.num_layers // pp)
    out = []
    for kind in ("attention", "mlp"):
        for t in unit_saved_tensors(kind, model, micro_batch_size, tp, sp, None, "cuda", cp):
            out.append((t.nbytes, pp * layers))
    if precision.master_remainder:  # Apex's DistributedFusedAdam (nemo): parameters are views of a flat buffer,
        return out  # the optimizer's states flat shards of its buckets: no allocation per weight matrix
    h, f = model.hidden_size, model.ffn_hidden_size
    fp32_tensors = round((precision.optimizer_bytes(1) - (4 if precision.grad_bytes < 4 else 0)) / 4)
    for numel in ((model.qkv_rows // tp) * h, h * (h // tp), (model.fc1_rows // tp) * h, h * (f // tp)):
        out.append((numel * precision.param_bytes, layers))
        out.append((numel * 4, layers * fp32_tensors))  # fp32 master copy and moments, a tensor each
    return out


def allocator_fraction(held: list[tuple[int, int]]) -> float:
    """The allocator's overhead over the bytes of `held` ((bytes, count) of requests): rounding of every request,
    a segment of its own for large ones, and the unused tails of the shared 20 MiB segments."""
    total = sum(n * c for n, c in held)
    if not total:
        return 0.0
    over, mid = 0.0, {}
    for n, c in held:
        size = _rounded(n)
        if _SMALL < size < _LARGE:
            over += (size - n) * c
            mid[size] = mid.get(size, 0) + c
        else:
            over += block_overhead(n) * c
    return (over + segment_tails(mid)) / total


def allowance_terms(device: DeviceType | None, model: ModelConfig, tp: int, dp: int, pp: int, micro_batch_size: int,
                    sp: bool, precision: PrecisionConfig, measured: MeasuredCudaMemory = MeasuredCudaMemory(),
                    cp: int = 1) -> AllowanceTerms:
    """The four terms for one rank of the layout on `device` (None: the defaults), measured ones first."""
    context = measured.context_bytes
    if context is None:
        context = device.cuda_context_bytes if device is not None and device.cuda_context_bytes is not None \
            else DEFAULT_CONTEXT_BYTES
    channels = device.nccl_channels if device is not None and device.nccl_channels else DEFAULT_NCCL_CHANNELS
    comms = nccl_communicators(tp, dp, pp, not model.untie_embeddings_and_output_weights, cp)
    fraction = measured.allocator_fraction
    if fraction is None:
        fraction = allocator_fraction(held_tensor_bytes(model, tp, pp, micro_batch_size, sp, precision, cp))
    return AllowanceTerms(context=float(context), cublas=CUBLAS_STREAMS * cublas_workspace_bytes(device),
                          nccl=nccl_bytes(comms, channels, measured.nccl_bytes_per_communicator),
                          fragmentation=fraction, communicators=len(comms))


@dataclass(frozen=True)
class DerivedAllowance:
    """MemorySettings.derived: the allowance per layout on a cluster's device types (the largest where they
    differ), an explicit workspace or fragmentation (flags, a calibrated profile) winning over its term."""

    devices: tuple[DeviceType, ...] = ()
    measured: MeasuredCudaMemory = MeasuredCudaMemory()
    workspace_bytes: float | None = None
    fragmentation: float | None = None

    def terms(self, settings: MemorySettings, model: ModelConfig, tp: int, dp: int, pp: int, micro_batch_size: int,
              sp: bool, cp: int = 1) -> list[AllowanceTerms]:
        precision = settings.precision(model, False)
        return [allowance_terms(d, model, tp, dp, pp, micro_batch_size, sp, precision, self.measured, cp)
                for d in (self.devices or (None,))]

    def settings(self, settings: MemorySettings, model: ModelConfig, tp: int, dp: int, pp: int,
                 micro_batch_size: int, sp: bool, cp: int = 1) -> MemorySettings:
        key = (settings.engine, tp, dp, pp, micro_batch_size, sp, cp, repr(model))
        got = _memo.get(key)
        if got is None or got[0] is not self:
            terms = self.terms(settings, model, tp, dp, pp, micro_batch_size, sp, cp)
            workspace = self.workspace_bytes if self.workspace_bytes is not None \
                else max(t.workspace for t in terms)
            fragmentation = self.fragmentation if self.fragmentation is not None \
                else max(t.fragmentation for t in terms)
            if len(_memo) > 10_000:
                _memo.clear()
            got = _memo[key] = (self, workspace, fragmentation)
        return replace(settings, workspace_bytes=got[1], fragmentation=got[2], derived=None)


_memo: dict[tuple, tuple] = {}
