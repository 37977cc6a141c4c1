"""Activation recomputation that replays the same dropout masks, including those drawn under the RNG tracker.

Where a tensor argument requires a gradient this is Megatron's reentrant checkpoint: the forward runs without a
graph and saves only its tensor arguments; the backward restores the random states the forward started from,
runs it again with a graph and back-propagates through it. Its cost on the host is about one more forward;
torch's non-reentrant checkpoint adds a pack and an unpack hook per saved tensor and a check of the recomputed
tensors (benchmarks/recompute_overhead.py; on a GPU a small model's step is bound by the host). Units whose
gradient reaches only parameters (an embedding: no argument requires one) keep torch's non-reentrant checkpoint,
which does not need one.
"""

from __future__ import annotations

import torch

from ..device import get_rng_state as device_rng_state
from ..device import set_rng_state as set_device_rng_state


def _states(tracker, device: torch.device | None) -> tuple:
    return (torch.get_rng_state(), device_rng_state(device) if device is not None else None,
            tracker.get_states() if tracker is not None else None)


def _restore(states: tuple, tracker, device: torch.device | None) -> None:
    cpu, dev, tracked = states
    torch.set_rng_state(cpu)
    if device is not None:
        set_device_rng_state(device, dev)
    if tracker is not None:
        tracker.set_states(tracked)


def _accelerator(args) -> torch.device | None:
    return next((a.device for a in args if isinstance(a, torch.Tensor) and a.device.type != "cpu"), None)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tracker, *args):
        ctx.fn, ctx.tracker, ctx.device = fn, tracker, _accelerator(args)
        ctx.states = _states(tracker, ctx.device)
        ctx.tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_at))
        with torch.no_grad():
            return fn(*args)

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            args[i] = t.detach().requires_grad_(t.requires_grad)
        current = _states(ctx.tracker, ctx.device)
        _restore(ctx.states, ctx.tracker, ctx.device)
        try:
            with torch.enable_grad():
                out = ctx.fn(*args)
        finally:
            _restore(current, ctx.tracker, ctx.device)
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if isinstance(o, torch.Tensor) and o.requires_grad
                 and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, *(args[i].grad if i in ctx.tensor_at and args[i].requires_grad else None
                              for i in range(len(args))))


def checkpoint(fn, tracker, *args):
    """fn(*args), its activations rebuilt in backward with the random states its forward started from."""
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return _Recompute.apply(fn, tracker, *args)
    return _non_reentrant(fn, tracker, *args)


def _non_reentrant(fn, tracker, *args):
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    snapshot = tracker.get_states() if tracker is not None else None
    first_call = [True]

    def run(*a):
        if first_call[0] or tracker is None:
            first_call[0] = False
            return fn(*a)
        current = tracker.get_states()
        tracker.set_states(snapshot)
        try:
            return fn(*a)
        finally:
            tracker.set_states(current)

    return torch_checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)
