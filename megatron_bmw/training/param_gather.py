"""The distributed optimizer's shard layout and its parameter all-gather, in buckets (Megatron-core's layout).

The trainable parameters are laid end to end in forward order and cut into buckets of whole parameters (each at
least `bucket_size` elements but the last), each padded to a multiple of the DP size. DP rank r owns the r-th
1/dp of every bucket; its shard is those ranges end to end. After a step each bucket is all-gathered from the
shards straight into the parameters, which are views of one buffer per bucket (as Megatron-core's parameter
buffer): at once, or (`--overlap-param-gather`) launched asynchronously, each waited for by a forward pre-hook of
the first module that owns one of its parameters, or by `finish()`, so the gather of later buckets runs during
the next iteration's forward. (Parameters of mixed dtypes keep their own storage and are copied in instead.) With one bucket (a model under `bucket_size`) rank r
owns the contiguous range [r*S, (r+1)*S) of all parameters.

A model with experts has two such layouts (`ShardDomain`s, docs/moe.md): the dense parameters sharded over the
dp x cp `grad_group`, the expert parameters over the `edp_group` (the ranks holding the same experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.expert_params import is_expert
from ..parallel.groups import group_rank, group_size

@dataclass(frozen=True)
class Bucket:
    start: int  # padded flat offset of its first element
    size: int  # padded length, a multiple of dp
    shard_offset: int  # where each rank's 1/dp of it sits in that rank's shard
    params: tuple[int, ...]  # indices of the parameters inside it


class ShardLayout:
    """Where each parameter sits in the padded flat space, the buckets, and each DP rank's ranges of it."""

    def __init__(self, numels: list[int], dp: int, bucket_size: int) -> None:
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be >= 1, got {bucket_size}")
        self.dp = dp
        self.offsets: list[int] = []  # padded flat offset of each parameter
        self.buckets: list[Bucket] = []
        start = shard = 0
        members: list[int] = []
        filled = 0
        for i, n in enumerate(numels):
            self.offsets.append(start + filled)
            members.append(i)
            filled += n
            if filled >= bucket_size or i == len(numels) - 1:
                size = -(-filled // dp) * dp
                self.buckets.append(Bucket(start, size, shard, tuple(members)))
                start, shard, members, filled = start + size, shard + size // dp, [], 0
        self.numels = list(numels)
        self.shard_size = shard
        self.bucket_of = [b for b, bucket in enumerate(self.buckets) for _ in bucket.params]

    def rank_ranges(self, rank: int) -> list[tuple[int, int, int]]:
        """(padded flat start, end, shard offset) of each range DP rank `rank` owns."""
        out = []
        for b in self.buckets:
            part = b.size // self.dp
            out.append((b.start + rank * part, b.start + (rank + 1) * part, b.shard_offset))
        return out

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """The padded flat tensor from every DP rank's shard (rank order)."""
        full = torch.empty(sum(b.size for b in self.buckets), dtype=shards[0].dtype, device=shards[0].device)
        for b in self.buckets:
            part = b.size // self.dp
            for r, shard in enumerate(shards):
                full[b.start + r * part: b.start + (r + 1) * part] = shard[b.shard_offset: b.shard_offset + part]
        return full


@dataclass
class ShardDomain:
    """Parameters ZeRO-1 shards over one group, with their layout and gather."""

    indices: list[int]  # into the optimizer's parameters, in order
    group: object  # the ranks sharing these parameters (None: one rank)
    layout: ShardLayout
    gather: ParamGather

    def pieces(self) -> list[tuple[int, int, int, int]]:
        """(parameter index, start, end, shard offset) of each flat range of a parameter this rank owns."""
        offsets, out = self.layout.offsets, []
        ranges = self.layout.rank_ranges(group_rank(self.group))
        for bucket, (lo, hi, shard_offset) in zip(self.layout.buckets, ranges):
            for j in bucket.params:
                a, b = max(offsets[j], lo), min(offsets[j] + self.layout.numels[j], hi)
                if a < b:
                    out.append((self.indices[j], a - offsets[j], b - offsets[j], shard_offset + a - lo))
        return out


def shard_domains(params: list[nn.Parameter], state, bucket_size: int, overlap: bool) -> list[ShardDomain]:
    """The dense parameters over `state.grad_group`, then the expert parameters (if any) over `state.edp_group`."""
    dense = [i for i, p in enumerate(params) if not is_expert(p)]
    experts = [i for i, p in enumerate(params) if is_expert(p)]
    out = []
    for indices, group in ((dense, state.grad_group), (experts, state.edp_group if experts else None)):
        if indices:
            mine = [params[i] for i in indices]
            layout = ShardLayout([p.numel() for p in mine], group_size(group), bucket_size)
            out.append(ShardDomain(indices, group, layout, ParamGather(mine, layout, group, overlap)))
    return out


class ParamGather:
    """All-gathers a step's shard into the parameters, bucket by bucket; with `overlap` the buckets are launched
    asynchronously and completed by forward pre-hooks (`hook_modules`) or `finish()`."""

    def __init__(self, params: list[nn.Parameter], layout: ShardLayout, group, overlap: bool = False) -> None:
        self.params = params
        self.layout = layout
        self.group = group
        self.overlap = overlap
        self._pending: dict[int, tuple] = {}  # bucket -> (work, gathered buffer, input kept alive)
        self._handles: list = []
        self._buffers = self._bucket_buffers() if len({p.dtype for p in params}) == 1 else None

    @torch.no_grad()
    def _bucket_buffers(self) -> list[torch.Tensor]:
        """One flat buffer per bucket; each parameter becomes a view of its own (its values kept)."""
        buffers = []
        for bucket in self.layout.buckets:
            first = self.params[bucket.params[0]]
            buf = torch.zeros(bucket.size, dtype=first.dtype, device=first.device)
            for i in bucket.params:
                p, a = self.params[i], self.layout.offsets[i] - bucket.start
                view = buf[a: a + p.numel()].view(p.shape)
                view.copy_(p.detach())
                p.data = view
            buffers.append(buf)
        return buffers

    def publish(self, shard: torch.Tensor) -> None:
        """Gather every bucket of this step's shard (in forward order) into the parameters, or launch it."""
        self.finish()
        for b, bucket in enumerate(self.layout.buckets):
            part = shard[bucket.shard_offset: bucket.shard_offset + bucket.size // self.layout.dp]
            out = self._buffers[b] if self._buffers is not None else \
                torch.empty(bucket.size, dtype=shard.dtype, device=shard.device)
            work = _all_gather(part, out, self.group, async_op=self.overlap)
            if work is None:
                self._copy_in(b, out)
            else:
                self._pending[b] = (work, out, part)

    def wait(self, buckets) -> None:
        """Complete these buckets' gathers (those still pending) and copy them into the parameters."""
        for b in buckets:
            entry = self._pending.pop(b, None)
            if entry is not None:
                entry[0].wait()
                self._copy_in(b, entry[1])

    def finish(self) -> None:
        """Complete every pending gather: the parameters then hold the last step's values."""
        self.wait(sorted(self._pending))

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    @torch.no_grad()
    def _copy_in(self, b: int, gathered: torch.Tensor) -> None:
        if self._buffers is not None:  # gathered into the parameters themselves
            return
        bucket = self.layout.buckets[b]
        for i in bucket.params:
            a = self.layout.offsets[i] - bucket.start
            p = self.params[i]
            p.detach().copy_(gathered[a: a + p.numel()].view(p.shape))

    def hook_modules(self, modules: list[nn.Module]) -> None:
        """A forward pre-hook on every module that directly owns parameters of these buckets: it completes their
        gathers before the module's first forward after a step. Every parameter must be owned by one of them."""
        index = {id(p): i for i, p in enumerate(self.params)}
        owned: set[int] = set()
        for root in modules:
            for m in root.modules():
                mine = sorted({self.layout.bucket_of[index[id(p)]] for p in m.parameters(recurse=False)
                               if id(p) in index})
                owned.update(index[id(p)] for p in m.parameters(recurse=False) if id(p) in index)
                if mine:
                    self._handles.append(m.register_forward_pre_hook(_waiter(self, tuple(mine))))
        missing = [i for i in range(len(self.params)) if i not in owned]
        if missing:
            raise ValueError(f"overlap_param_gather: {len(missing)} parameters belong to none of the modules given")

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def _waiter(gather: ParamGather, buckets: tuple[int, ...]):
    def pre_hook(module, args) -> None:
        if gather._pending:
            gather.wait(buckets)

    return pre_hook


def _all_gather(part: torch.Tensor, out: torch.Tensor, group, async_op: bool):
    """Every rank's `part` end to end into `out`; the pending work, or None when done. Without a group (data
    parallel size 1) it is a copy; a group of one rank runs its collective, so one GPU can run the asynchronous
    path (tools/gpu_check_steps.py)."""
    if group is None:
        out.copy_(part)
        return None
    n = group_size(group)
    if dist.get_backend(group) == "nccl":
        work = dist.all_gather_into_tensor(out, part, group=group, async_op=async_op)
    else:
        work = dist.all_gather(list(out.chunk(n)), part, group=group, async_op=async_op)
    return work if async_op else None
