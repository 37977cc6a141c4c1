"""The device behind one small interface: which device, synchronising it, its RNG state, NCCL's needs, and a
free local port for process groups. CPU (gloo) and CUDA (NCCL) go through the same calls."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .errors import UsageError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_device() -> torch.device:
    """The GPU of this local rank under NCCL, else the CPU."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def choose_backend(backend: str | None, local_ranks: int = 1) -> str:
    """The asked backend, checked; by default nccl when CUDA has a GPU for each of `local_ranks`, else gloo."""
    if backend is None:
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks else "gloo"
    if backend not in ("nccl", "gloo"):
        raise UsageError(f"--distributed-backend must be nccl or gloo, not {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("--distributed-backend nccl needs CUDA, which is not available; use gloo")
    return backend


def set_device(local_rank: int, backend: str) -> torch.device:
    """Bind this process to its GPU under NCCL; the CPU otherwise."""
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (on the host) on `device`; to a GPU through pinned memory without blocking the host, as Megatron's
    pinned data loader (a copy from pageable memory waits for the GPU's queue to drain)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """(seconds, result) of `fn()`, the device synchronised before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def sleep_cycles_per_s() -> float | None:
    """The GPU's clock as `torch.cuda._sleep` counts it (None without CUDA or without that kernel)."""
    if not torch.cuda.is_available() or not hasattr(torch.cuda, "_sleep"):
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    return 1e7 / max(start.elapsed_time(end) / 1e3, 1e-6)


def covered_seconds(fn: Callable[[], object], cycles_per_s: float, cover_s: float = 3e-3):
    """(device seconds, host seconds, fn()) of `fn` on CUDA, with a sleep kernel of `cover_s` queued first: the
    GPU is busy while the host dispatches `fn`, so the events around it time its kernels back to back, without
    the host's gaps between them (as a run that is bound by the device has them)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(int(cover_s * cycles_per_s))
    start.record()
    t0 = time.perf_counter()
    out = fn()
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3, host, out


def ping_pong(first: bool, x: torch.Tensor, peer: int, out=None, back=None) -> None:
    """One round trip of `x` with `peer` (the `first` side sends first), on the given one-way groups."""
    if first:
        dist.send(x, peer, group=out)
        dist.recv(x, peer, group=back)
    else:
        dist.recv(x, peer, group=back)
        dist.send(x, peer, group=out)


def batch_p2p(ops: list) -> list:
    """Post `ops` (dist.P2POp) as one batch and return a work per op. NCCL coalesces a batch into one work
    (torch returns a list of one): every op of the batch then shares it, and waiting on it completes them all."""
    works = dist.batch_isend_irecv(ops)
    if len(works) == len(ops):
        return list(works)
    if len(works) == 1:
        return [works[0]] * len(ops)
    raise RuntimeError(f"batch_isend_irecv returned {len(works)} works for {len(ops)} operations")


def get_rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
