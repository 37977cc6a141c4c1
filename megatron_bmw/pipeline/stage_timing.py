"""A short measurement of per-stage forward/backward times, for `--microbatch-slicing auto` without a cost model."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..parallel.random import get_rng_state, set_rng_state
from ..parallel.state import ParallelState


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_stage_times(chunks: list[nn.Module], state: ParallelState, get_batch: Callable[[int], dict],
                        hidden_shape: tuple[int, int, int], dtype: torch.dtype,
                        repeats: int = 2) -> tuple[list[float], list[float], float]:
    """(forward, backward seconds per pipeline stage for one micro-batch, p2p seconds of one activation).

    Every rank times its chunks on micro-batch 0 (after one untimed run), stages 0 and 1 time a ping-pong of
    one activation, and the numbers are combined with a MAX all-reduce over all ranks, so every rank gets the
    same answer. Gradients go through torch.autograd.grad: parameters' .grad and gradient hooks are untouched,
    and the random-number state is restored afterwards. All ranks must call this together.
    """
    p, rank, device = state.pp_size, state.pp_rank, state.device
    rng = get_rng_state(state.rng)
    batch = get_batch(0)
    fwd = bwd = float("inf")
    for attempt in range(repeats + 1):
        f_total = b_total = 0.0
        for c, chunk in enumerate(chunks):
            vstage = c * p + rank
            x = None if vstage == 0 else torch.zeros(hidden_shape, dtype=dtype, device=device, requires_grad=True)
            _sync(device)
            t0 = time.perf_counter()
            out = chunk(x, batch)
            _sync(device)
            t1 = time.perf_counter()
            inputs = [q for q in chunk.parameters() if q.requires_grad] + ([x] if x is not None else [])
            torch.autograd.grad(out, inputs, grad_outputs=torch.ones_like(out), allow_unused=True)
            _sync(device)
            f_total += t1 - t0
            b_total += time.perf_counter() - t1
        if attempt:
            fwd, bwd = min(fwd, f_total), min(bwd, b_total)
    set_rng_state(rng, state.rng)
    comm = _ping(state, hidden_shape, dtype, repeats) if p > 1 else 0.0
    table = torch.zeros(p + 1, 2, dtype=torch.float64, device=device)
    table[rank, 0], table[rank, 1] = fwd, bwd
    table[p, 0] = comm
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
    table = table.cpu()
    return table[:p, 0].tolist(), table[:p, 1].tolist(), float(table[p, 0])


def _ping(state: ParallelState, hidden_shape: tuple[int, int, int], dtype: torch.dtype, repeats: int) -> float:
    """Half the round trip of one activation between stages 0 and 1 (0 on the other stages)."""
    if state.pp_rank > 1:
        return 0.0
    me, other = state.pp_ranks[state.pp_rank], state.pp_ranks[1 - state.pp_rank]
    out, back = state.p2p_group(me, other), state.p2p_group(other, me)
    x = torch.zeros(hidden_shape, dtype=dtype, device=state.device)
    best = float("inf")
    for attempt in range(repeats + 1):
        _sync(state.device)
        t0 = time.perf_counter()
        if state.pp_rank == 0:
            dist.send(x, other, group=out)
            dist.recv(x, other, group=back)
        else:
            dist.recv(x, other, group=back)
            dist.send(x, other, group=out)
        _sync(state.device)
        if attempt:
            best = min(best, (time.perf_counter() - t0) / 2)
    return best
