"""Gradient accumulation in fp32 and gradient synchronisation after a pipeline schedule.

Each parameter gets `main_grad`, an fp32 view into a flat bucket buffer; a post-accumulate hook adds `p.grad`
into it and frees `p.grad` (a hook with no `p.grad`, from a backward that deferred the weight gradient, is
skipped), so gradients accumulate in fp32 whatever the parameter dtype. With `fusion` (the default, Megatron's
--gradient-accumulation-fusion) the linear layers' weights skip that: their backward adds the weight gradient into
`main_grad` itself and calls the parameter's sink (wgrad_accum.py). After the last micro-batch:
  - data parallel: each bucket is all-reduced over the DP group (dp x cp with context parallelism) and averaged
    (launched as soon as the bucket's last gradient is accumulated when `overlap` is set, else all at the end);
  - expert parameters (`expert_parallel`, docs/moe.md) sit in buckets of their own, summed over the expert data
    parallel group (`edp_group`, the ranks holding the same experts) and scaled by 1/(dp x cp), overlapped alike;
  - sequence parallel: replicated parameters marked `sequence_parallel` are summed over the TP group;
  - tied embedding: parameters marked `shared_embedding` are summed over the first and last pipeline stage.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from .expert_params import is_expert
from .groups import group_size
from .wgrad_accum import set_sinks


class _Bucket:
    def __init__(self, params: list[nn.Parameter], device: torch.device, group=None, divisor: int = 1) -> None:
        """group: reduced over it (None: no reduction); divisor: then divided by it."""
        self.params = params
        self.group, self.divisor = group, divisor
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        offset = 0
        for p in params:
            p.main_grad = self.buffer[offset: offset + p.numel()].view_as(p)
            offset += p.numel()
        self.pending = 0
        self.handle = None


class GradSync:
    def __init__(self, params: list[nn.Parameter], state, bucket_size: int = 40_000_000,
                 overlap: bool = False, fusion: bool = True) -> None:
        """state: the ParallelState (its device, dp, tp and embedding groups); fusion: linear layers add their
        weight gradients into `main_grad` themselves (wgrad_accum.py)."""
        self.state = state
        self.params = [p for p in params if p.requires_grad]
        dense = [p for p in self.params if not is_expert(p)]
        experts = [p for p in self.params if is_expert(p)]
        # Dense gradients are averaged over dp x cp: every rank holds the same parameters and its loss is the mean
        # over its own micro-batches, so the mean of the dp x cp ranks' gradients is the serial model's. An expert
        # lives on one ep rank of each edp copy, and its gradient there already holds what every ep rank's tokens
        # routed to it contributed (the dispatcher brings them over ep): the gradient of the sum of those ranks'
        # losses, not of their mean. Summed over edp (the other copies of the expert, which saw the other tokens)
        # it is the gradient of the sum of all dp x cp ranks' losses, and dividing by dp x cp makes it the mean's
        # (the serial model's), whatever ep and etp carve out of tp x cp x dp.
        ranks = group_size(state.grad_group)  # dp x cp
        self.buckets = _buckets(dense, bucket_size, state.device, state.grad_group, ranks)
        if experts:
            self.buckets += _buckets(experts, bucket_size, state.device, state.edp_group, ranks)
        # a one-rank group reduces too (a GPU check); a bucket without a group (size 1) has nothing to overlap
        self.overlap = overlap and any(b.group is not None for b in self.buckets)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._remaining: dict[int, int] = {}
        self._hooks = weak_grad_hooks(self, self.params)
        set_sinks(self, self.params, "_accumulated" if fusion else None)

    def buffer_bytes(self) -> int:
        """Bytes of the fp32 gradient buffers."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def zero(self) -> None:
        for b in self.buckets:
            b.buffer.zero_()
            b.handle = None

    def begin(self, backwards_per_param: int) -> None:
        """Arm the overlap: each parameter's gradient is final after this many backward passes."""
        self._remaining = {id(p): backwards_per_param for p in self.params}
        for b in self.buckets:
            b.pending = len(b.params)

    def _on_grad(self, p: nn.Parameter) -> None:
        if p.grad is None:  # a backward that deferred this weight's gradient (deferred_wgrad); its W brings it
            return
        p.main_grad.add_(p.grad)
        p.grad = None
        self._accumulated(p)

    def _accumulated(self, p: nn.Parameter) -> None:
        """One more backward's gradient of `p` is in `main_grad`: launch its bucket's reduction once complete."""
        if not self.overlap or id(p) not in self._remaining:
            return
        self._remaining[id(p)] -= 1
        if self._remaining[id(p)] == 0:
            bucket = self._bucket_of[id(p)]
            bucket.pending -= 1
            if bucket.pending == 0 and bucket.group is not None:
                bucket.handle = dist.all_reduce(bucket.buffer, group=bucket.group, async_op=True)

    def finish(self) -> None:
        """Complete every reduction; afterwards each `main_grad` holds the final gradient."""
        for b in self.buckets:
            if b.handle is None and b.group is not None:
                b.handle = dist.all_reduce(b.buffer, group=b.group, async_op=True)
        for b in self.buckets:
            if b.handle is not None:
                b.handle.wait()
                b.handle = None
            if b.divisor != 1:
                b.buffer.div_(b.divisor)
        self._remaining = {}
        _sum_over(self.params, "sequence_parallel", self.state.tp_group)
        _sum_over(self.params, "shared_embedding", self.state.embedding_group)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        set_sinks(self, self.params, None)


def _buckets(params: list[nn.Parameter], bucket_size: int, device, group, divisor: int) -> list[_Bucket]:
    """`params` in buckets of at least `bucket_size` elements (the last one less), in reverse order (backward
    visits parameters roughly so)."""
    out, current = [], []
    for p in reversed(params):
        current.append(p)
        if sum(q.numel() for q in current) >= bucket_size:
            out.append(_Bucket(current, device, group, divisor))
            current = []
    if current:
        out.append(_Bucket(current, device, group, divisor))
    return out


def weak_grad_hooks(owner, params: list[nn.Parameter]) -> list:
    """Post-accumulate-grad hooks calling `owner._on_grad` through a weak reference. Autograd keeps hooks where
    the garbage collector cannot see them, so a bound method would keep the owner, its parameters and its
    process groups alive for the life of the process."""
    ref = weakref.ref(owner)

    def hook(p: nn.Parameter) -> None:
        live = ref()
        if live is not None:
            live._on_grad(p)

    return [p.register_post_accumulate_grad_hook(hook) for p in params]


def _sum_over(params: list[nn.Parameter], flag: str, group) -> None:
    chosen = [p for p in params if getattr(p, flag, False)]
    if not chosen or group_size(group) == 1:
        return
    flat = torch.cat([p.main_grad.reshape(-1) for p in chosen])
    dist.all_reduce(flat, group=group)
    offset = 0
    for p in chosen:
        p.main_grad.copy_(flat[offset: offset + p.numel()].view_as(p))
        offset += p.numel()
