"""Gradient accumulation in fp32 and gradient synchronisation after a pipeline schedule.

Each parameter gets `main_grad`, an fp32 view into a flat bucket buffer; a post-accumulate hook adds `p.grad`
into it and frees `p.grad` (a hook with no `p.grad`, from a backward that deferred the weight gradient, is
skipped), so gradients accumulate in fp32 whatever the parameter dtype. With `fusion` (the default, Megatron's
--gradient-accumulation-fusion) the linear layers' weights skip that: their backward adds the weight gradient into
`main_grad` itself and calls the parameter's sink (wgrad_accum.py). After the last micro-batch:
  - data parallel: each bucket is all-reduced over the DP group and averaged (launched as soon as the bucket's
    last gradient is accumulated when `overlap` is set, else all at the end);
  - sequence parallel: replicated parameters marked `sequence_parallel` are summed over the TP group;
  - tied embedding: parameters marked `shared_embedding` are summed over the first and last pipeline stage.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn

from .groups import group_size
from .wgrad_accum import set_sinks


class _Bucket:
    def __init__(self, params: list[nn.Parameter], device: torch.device) -> None:
        self.params = params
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
        self.overlap = overlap and state.grad_group is not None  # a one-rank group reduces too (a GPU check)
        self.params = [p for p in params if p.requires_grad]
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        for p in reversed(self.params):  # backward visits parameters roughly in reverse order
            current.append(p)
            if sum(q.numel() for q in current) >= bucket_size:
                self.buckets.append(_Bucket(current, state.device))
                current = []
        if current:
            self.buckets.append(_Bucket(current, state.device))
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
            if bucket.pending == 0:
                bucket.handle = dist.all_reduce(bucket.buffer, group=self.state.grad_group, async_op=True)

    def finish(self) -> None:
        """Complete every reduction; afterwards each `main_grad` holds the final gradient."""
        if self.state.grad_group is not None:
            dp = group_size(self.state.grad_group)
            for b in self.buckets:
                if b.handle is None:
                    b.handle = dist.all_reduce(b.buffer, group=self.state.grad_group, async_op=True)
            for b in self.buckets:
                b.handle.wait()
                b.handle = None
                b.buffer.div_(dp)
        self._remaining = {}
        _sum_over(self.params, "sequence_parallel", self.state.tp_group)
        _sum_over(self.params, "shared_embedding", self.state.embedding_group)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        set_sinks(self, self.params, None)


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
