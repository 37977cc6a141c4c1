"""Validation of a pipeline schedule: coverage, ordering (a split backward's W after its B on the same rank),
communication matching, FIFO, deadlock, and BPipe transfers (matching, FIFO, no backward while its activations are away, the activation limit)."""

from __future__ import annotations

from typing import NoReturn

from .holding import resident_peaks
from .replay import replay, unit_times
from .schedule import (
    COMM_KINDS,
    COMPUTE_KINDS,
    RECV_KINDS,
    SEND_KINDS,
    TRANSFER_KINDS,
    Action,
    Kind,
    Schedule,
    ScheduleError,
    Tensor,
    gc_paused,
)

__all__ = ["ScheduleError", "check", "describe"]


def check(schedule: Schedule) -> None:
    """Raise ScheduleError describing the first problem found; return None if the schedule is sound."""
    with gc_paused():
        _check_shape(schedule)
        for rank in range(schedule.pp):
            _check_compute(schedule, rank)
        _check_communication(schedule)
        _check_transfers(schedule)
    replay(schedule, unit_times(1.0, 2.0), record=False)


def describe(schedule: Schedule, tensor: Tensor) -> str:
    """Human-readable name of a tensor on the wire."""
    grad, vstage, mb, half = tensor
    rank, chunk = schedule.location(vstage)
    part = "" if half is None else f" half {half}"
    what = "gradient" if grad else "activation"
    return f"{what} of micro-batch {mb}{part} from rank {rank} chunk {chunk}"


def _fail(s: Schedule, rank: int, a: Action, problem: str) -> NoReturn:
    name = a.label(s.virtual_stages > 1)
    if a.kind in COMM_KINDS | TRANSFER_KINDS:
        name = f"{a.kind.value} {name}"
    raise ScheduleError(f"rank {rank}: {name} {problem}")


def _check_shape(s: Schedule) -> None:
    p, m, v = s.pp, s.num_microbatches, s.virtual_stages
    if p < 1 or m < 1 or v < 1:
        raise ScheduleError(f"bad schedule sizes p={p} m={m} v={v}")
    if len(s.actions) != p:
        raise ScheduleError(f"schedule has {len(s.actions)} rank lists for {p} pipeline ranks")
    for rank, acts in enumerate(s.actions):
        for a in acts:
            if not isinstance(a.kind, Kind):
                raise ScheduleError(f"rank {rank}: unknown action kind {a.kind!r}")
            if not 0 <= a.microbatch < m:
                _fail(s, rank, a, f"has micro-batch outside 0..{m - 1}")
            if not 0 <= a.chunk < v:
                _fail(s, rank, a, f"has chunk outside 0..{v - 1}")
            if a.half not in (None, 0, 1):
                _fail(s, rank, a, f"has half {a.half!r} (expected None, 0 or 1)")
            if a.kind in COMPUTE_KINDS and a.peer is not None:
                _fail(s, rank, a, "is a compute action with a peer")
            if a.kind in COMM_KINDS | TRANSFER_KINDS and not (
                isinstance(a.peer, int) and 0 <= a.peer < p and a.peer != rank
            ):
                _fail(s, rank, a, f"has bad peer {a.peer!r}")


_F, _B, _BI, _W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


def _check_compute(s: Schedule, rank: int) -> None:
    """Exactly one FORWARD per owned (micro-batch, chunk[, half]) and, after it, either one BACKWARD or one
    BACKWARD_INPUT followed later by its BACKWARD_WEIGHT."""
    seen: set[tuple[Kind, int, int, int | None]] = set()
    for a in s.actions[rank]:
        if a.kind not in COMPUTE_KINDS:
            continue
        key = (a.kind, a.microbatch, a.chunk, a.half)
        if key in seen:
            _fail(s, rank, a, "appears twice")
        seen.add(key)
        if a.kind is not _F and (_F, a.microbatch, a.chunk, a.half) not in seen:
            _fail(s, rank, a, "runs before (or without) its FORWARD")
        if a.kind is _W and (_BI, a.microbatch, a.chunk, a.half) not in seen:
            _fail(s, rank, a, "runs before (or without) its input-gradient B")
        if (a.kind is _B and (_BI, a.microbatch, a.chunk, a.half) in seen) or \
                (a.kind is _BI and (_B, a.microbatch, a.chunk, a.half) in seen):
            _fail(s, rank, a, "has both a whole BACKWARD and a split one")
    for kind in (_F, _B):
        for mb in range(s.num_microbatches):
            for chunk in range(s.virtual_stages):
                halves = {h for h in (None, 0, 1) if (kind, mb, chunk, h) in seen or
                          (kind is _B and (_BI, mb, chunk, h) in seen)}
                if halves not in ({None}, {0, 1}):
                    what = "no" if not halves else "an incomplete set of"
                    raise ScheduleError(
                        f"rank {rank}: {what} {kind.name} actions for micro-batch {mb} chunk {chunk} "
                        f"(need one whole or both halves, found halves {sorted(halves, key=str)})"
                    )
    for kind, mb, chunk, half in seen:
        if kind is _F and (_B, mb, chunk, half) not in seen and (_BI, mb, chunk, half) not in seen:
            _fail(s, rank, Action(kind, mb, chunk, half=half), "has no BACKWARD")
        if kind is _BI and (_W, mb, chunk, half) not in seen:
            _fail(s, rank, Action(kind, mb, chunk, half=half), "has no weight-gradient W")


def _check_communication(s: Schedule) -> None:
    sends: dict[Tensor, tuple[int, Action]] = {}  # tensor -> (sender rank, action)
    recvs: dict[Tensor, tuple[int, Action]] = {}
    send_order: dict[tuple[int, int], list[Tensor]] = {}  # (src, dst) -> tensors in send order
    recv_order: dict[tuple[int, int], list[Tensor]] = {}
    for rank, acts in enumerate(s.actions):
        done: set[Tensor] = set()  # outputs computed so far on this rank
        received: set[Tensor] = set()  # RECVs posted so far on this rank
        for a in acts:
            kind = a.kind
            if kind in COMPUTE_KINDS:
                need = s.input_tensor(rank, a)
                if need is not None:
                    src = s.rank_of(need[1])
                    if src == rank:
                        if need not in done:
                            _fail(s, rank, a, "runs before its producer on the same rank")
                    elif need not in received:
                        _fail(s, rank, a, f"has no RECV of its input from rank {src} before it")
                out = s.output_tensor(rank, a)
                if out is not None:
                    done.add(out)
            elif kind in SEND_KINDS:
                tensor = s.wire_tensor(rank, a)
                if tensor is None:
                    _fail(s, rank, a, "sends from a virtual stage with no consumer")
                dst_rank = s.consumer_rank(tensor)
                if a.peer != dst_rank:
                    _fail(s, rank, a, f"goes to rank {a.peer}, but the consumer is rank {dst_rank}")
                if tensor not in done:
                    _fail(s, rank, a, "is placed before the compute producing it")
                if tensor in sends:
                    _fail(s, rank, a, "is sent twice")
                sends[tensor] = (rank, a)
                send_order.setdefault((rank, a.peer), []).append(tensor)
            elif kind in RECV_KINDS:
                tensor = s.wire_tensor(rank, a)
                if tensor is None:
                    _fail(s, rank, a, "receives into a virtual stage with no producer")
                src = s.rank_of(tensor[1])
                if a.peer != src:
                    _fail(s, rank, a, f"expects rank {a.peer}, but the producer is rank {src}")
                if tensor in recvs:
                    _fail(s, rank, a, "is received twice")
                recvs[tensor] = (rank, a)
                received.add(tensor)
                recv_order.setdefault((a.peer, rank), []).append(tensor)
    for tensor, (rank, a) in recvs.items():
        if tensor not in sends:
            _fail(s, rank, a, f"has no matching SEND on rank {a.peer}")
    for tensor, (rank, a) in sends.items():
        if tensor not in recvs:
            _fail(s, rank, a, f"has no matching RECV on rank {a.peer}")
    # NCCL matches point-to-point messages per (src, dst) pair in posting order, whatever their kind.
    for channel in sorted(send_order):
        for i, (x, y) in enumerate(zip(send_order[channel], recv_order[channel])):
            if x != y:
                raise ScheduleError(
                    f"channel rank {channel[0]} -> rank {channel[1]} is not FIFO: message #{i} is sent as the "
                    f"{describe(s, x)} but received as the {describe(s, y)}"
                )


def _check_transfers(s: Schedule) -> None:
    """EVICT/LOAD on the evictor match ACCEPT/RETURN on the acceptor in FIFO order per direction; a key is
    evicted only while saved and at most once; its BACKWARD runs only after it is loaded back."""
    # (src, dst) channel -> keys in posting order
    evicts: dict[tuple[int, int], list] = {}
    accepts: dict[tuple[int, int], list] = {}
    returns: dict[tuple[int, int], list] = {}
    loads: dict[tuple[int, int], list] = {}
    for rank, acts in enumerate(s.actions):
        forwarded: set = set()
        finished: set = set()
        away: dict = {}  # key -> acceptor
        evicted: set = set()
        held: set = set()  # (evictor, key) accepted and not yet returned
        for a in acts:
            kind, key = a.kind, a.key
            if kind is Kind.FORWARD:
                forwarded.add(key)
            elif kind is Kind.BACKWARD or kind is Kind.BACKWARD_INPUT or kind is Kind.BACKWARD_WEIGHT:
                if key in away:
                    _fail(s, rank, a, f"runs while its activations are away on rank {away[key]}")
                if kind is not Kind.BACKWARD_INPUT:
                    finished.add(key)
            elif kind is Kind.EVICT:
                if key not in forwarded or key in finished:
                    _fail(s, rank, a, "evicts activations that are not saved (outside FORWARD..BACKWARD)")
                if key in evicted:
                    _fail(s, rank, a, "evicts the same activations twice")
                evicted.add(key)
                away[key] = a.peer
                evicts.setdefault((rank, a.peer), []).append(key)
            elif kind is Kind.LOAD:
                if away.get(key) != a.peer:
                    _fail(s, rank, a, f"loads activations that are not away on rank {a.peer}")
                del away[key]
                loads.setdefault((a.peer, rank), []).append(key)
            elif kind is Kind.ACCEPT:
                if (a.peer, key) in held:
                    _fail(s, rank, a, "accepts activations it already holds")
                held.add((a.peer, key))
                accepts.setdefault((a.peer, rank), []).append(key)
            elif kind is Kind.RETURN:
                if (a.peer, key) not in held:
                    _fail(s, rank, a, "returns activations it has not accepted")
                held.remove((a.peer, key))
                returns.setdefault((rank, a.peer), []).append(key)
        if held:
            peer, key = min(held)
            _fail(s, rank, Action(Kind.ACCEPT, key[0], key[1], peer, key[2]), "is never returned")
    for what, sent, received in (("evict", evicts, accepts), ("return", returns, loads)):
        for channel in sorted(set(sent) | set(received)):
            x, y = sent.get(channel, []), received.get(channel, [])
            if x != y:
                raise ScheduleError(
                    f"BPipe {what} channel rank {channel[0]} -> rank {channel[1]} does not match: sent "
                    f"{_keys(x)}, received {_keys(y)} (both sides must list the same keys in the same order)"
                )
    if s.activation_limit is not None:
        for rank, peak in enumerate(resident_peaks(s)):
            if peak > s.activation_limit + 1e-9:
                raise ScheduleError(
                    f"rank {rank}: holds {peak:g} chunk-micro-batches of activations, above the limit "
                    f"{s.activation_limit:g}"
                )


def _keys(keys: list) -> str:
    shown = [f"{mb}.{chunk}" + ("" if half is None else "ab"[half]) for mb, chunk, half in keys[:6]]
    return "[" + ", ".join(shown) + (", ..." if len(keys) > 6 else "") + "]"
