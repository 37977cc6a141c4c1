"""Event-driven execution of a schedule with given durations (the planner's simulator core).

Model: each rank runs its list in order, one action at a time. FORWARD/BACKWARD take
compute_time(rank, action) and start once the rank is free and their input has arrived.
SEND and RECV are zero-time posts (asynchronous); a tensor is available to its consumer at
max(send post, recv post) + transfer_time(src, dst, send_action). EVICT/LOAD are zero-time
no-ops for now. Sends and receives are matched by tensor identity, not by channel order
(the checker verifies FIFO order separately).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .schedule import Action, DeadlockError, Kind, Schedule, ScheduleError, gc_paused


@dataclass
class Replay:
    """Result of `replay`: per-rank (action, start, end) in execution order."""

    schedule: Schedule
    timeline: list[list[tuple[Action, float, float]]]
    makespan: float
    busy: list[float]  # compute time per rank

    @property
    def bubble_time(self) -> float:
        """Idle compute time summed over ranks."""
        return self.makespan * len(self.busy) - sum(self.busy)

    @property
    def bubble_fraction(self) -> float:
        total = self.makespan * len(self.busy)
        return 0.0 if total == 0 else 1.0 - sum(self.busy) / total


def _zero_transfer(src: int, dst: int, action: Action) -> float:
    return 0.0


_COMPUTE, _SEND, _RECV, _OTHER = 0, 1, 2, 3


@dataclass
class CompiledSchedule:
    """A schedule pre-digested for fast repeated replays (e.g. by the planner).

    ops[rank][i] = (op, action, tensor, peer, produced): `tensor` is a dense tensor id
    (the input a compute needs, or the tensor a SEND/RECV carries; -1 if none), `peer` the
    rank at the other end (-1 if none), `produced` the tensor a compute hands to a consumer on
    the same rank (-1 if none). Recompile after changing the schedule.
    """

    schedule: Schedule
    ops: list[list[tuple[int, Action, int, int, int]]]
    num_tensors: int


def compile_schedule(schedule: Schedule) -> CompiledSchedule:
    """Index a schedule's tensors once; pass the result to `replay` to skip this step."""
    p = schedule.num_stages
    m = schedule.num_microbatches
    v = schedule.virtual_stages
    if len(schedule.actions) != p:
        raise ScheduleError(f"schedule has {len(schedule.actions)} rank lists for {p} pipeline ranks")
    with gc_paused():
        ops = [_compile_rank(rank, acts, p, m, v) for rank, acts in enumerate(schedule.actions)]
    return CompiledSchedule(schedule, ops, 6 * m * p * v + 6)


def _compile_rank(rank: int, acts: list[Action], p: int, m: int, v: int) -> list[tuple[int, Action, int, int, int]]:
    # Tensor (is_grad, producer vstage, mb, half) gets id ((mb * p*v + vstage) * 3 + half_code) * 2 + is_grad,
    # so the same micro-batch's tensors of the neighbouring virtual stages are 6 ids away.
    nv = p * v
    last = nv - 1
    forward, backward = Kind.FORWARD, Kind.BACKWARD
    send_act, send_grad = Kind.SEND_ACT, Kind.SEND_GRAD
    recv_act, recv_grad = Kind.RECV_ACT, Kind.RECV_GRAD
    rank_ops: list[tuple[int, Action, int, int, int]] = []
    append = rank_ops.append
    for a in acts:
        kind = a.kind
        chunk, mb, half = a.chunk, a.microbatch, a.half
        if not (0 <= chunk < v and 0 <= mb < m and half in (None, 0, 1)):
            raise ScheduleError(f"rank {rank}: {a.label(v > 1)} is out of range (m={m}, v={v}, half None/0/1)")
        vstage = chunk * p + rank
        base = ((mb * nv + vstage) * 3 + (0 if half is None else half + 1)) * 2
        if kind is forward:
            if vstage == 0:
                need = peer = -1
            else:
                need, peer = base - 6, (vstage - 1) % p
            produced = base if vstage != last and (vstage + 1) % p == rank else -1
            append((_COMPUTE, a, need, peer, produced))
        elif kind is backward:
            if vstage == last:
                need = peer = -1
            else:
                need, peer = base + 7, (vstage + 1) % p
            produced = base + 1 if vstage != 0 and (vstage - 1) % p == rank else -1
            append((_COMPUTE, a, need, peer, produced))
        elif kind is send_act or kind is send_grad:
            grad = kind is send_grad
            if vstage == (0 if grad else last):
                where = "first" if grad else "last"
                raise ScheduleError(f"rank {rank}: {a.label(v > 1)} sends from the {where} virtual stage")
            append((_SEND, a, base + grad, -1 if a.peer is None else a.peer, -1))
        elif kind is recv_act or kind is recv_grad:
            grad = kind is recv_grad
            if vstage == (last if grad else 0):
                where = "last" if grad else "first"
                raise ScheduleError(f"rank {rank}: {a.label(v > 1)} receives into the {where} virtual stage")
            append((_RECV, a, base + 7 if grad else base - 6, -1, -1))
        else:
            append((_OTHER, a, -1, -1, -1))
    return rank_ops


def replay(
    schedule: Schedule | CompiledSchedule,
    compute_time: Callable[[int, Action], float],
    transfer_time: Callable[[int, int, Action], float] = _zero_transfer,
    record: bool = True,
) -> Replay:
    """Run `schedule` with the given durations; raises DeadlockError if it gets stuck.

    `record=False` leaves the timeline empty (makespan and busy times only), for speed.
    """
    compiled = schedule if isinstance(schedule, CompiledSchedule) else compile_schedule(schedule)
    with gc_paused():
        return _run(compiled, compute_time, transfer_time, record)


def _run(
    compiled: CompiledSchedule,
    compute_time: Callable[[int, Action], float],
    transfer_time: Callable[[int, int, Action], float],
    record: bool,
) -> Replay:
    ops = compiled.ops
    p = len(ops)
    show_chunk = compiled.schedule.virtual_stages > 1
    n_tensors = compiled.num_tensors
    send_at: list[float | None] = [None] * n_tensors
    send_rank = [-1] * n_tensors
    send_action: list[Action | None] = [None] * n_tensors
    recv_at: list[float | None] = [None] * n_tensors
    produced_at: list[float | None] = [None] * n_tensors
    waiting = [-1] * n_tensors  # rank blocked on the tensor
    zero_transfer = transfer_time is _zero_transfer

    index = [0] * p
    clock = [0.0] * p
    busy = [0.0] * p
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    ready = deque(range(p))

    while ready:
        rank = ready.popleft()
        rank_ops = ops[rank]
        n = len(rank_ops)
        i = index[rank]
        t = clock[rank]
        line = timeline[rank]
        while i < n:
            op, a, tid, peer, produced = rank_ops[i]
            if op == _COMPUTE:
                start = t
                if tid >= 0:
                    if peer == rank:
                        arrival = produced_at[tid]
                        if arrival is None:
                            waiting[tid] = rank
                            break
                    else:
                        posted = recv_at[tid]
                        if posted is None:
                            raise ScheduleError(
                                f"rank {rank}: {a.label(show_chunk)} runs before the RECV of its input from rank {peer}"
                            )
                        sent = send_at[tid]
                        if sent is None:
                            waiting[tid] = rank
                            break
                        arrival = sent if sent > posted else posted
                        if not zero_transfer:
                            arrival += transfer_time(send_rank[tid], rank, send_action[tid])
                    if arrival > start:
                        start = arrival
                end = start + compute_time(rank, a)
                busy[rank] += end - start
                if record:
                    line.append((a, start, end))
                t = end
                if produced >= 0:
                    produced_at[produced] = end
                    if waiting[produced] >= 0:
                        ready.append(waiting[produced])
                        waiting[produced] = -1
            else:
                if op == _SEND:
                    send_at[tid] = t
                    send_rank[tid] = rank
                    send_action[tid] = a
                    if waiting[tid] >= 0:
                        ready.append(waiting[tid])
                        waiting[tid] = -1
                elif op == _RECV:
                    recv_at[tid] = t
                if record:
                    line.append((a, t, t))
            i += 1
        index[rank] = i
        clock[rank] = t

    stuck = [r for r in range(p) if index[r] < len(ops[r])]
    if stuck:
        detail = ", ".join(f"rank {r} at {ops[r][index[r]][1].label(show_chunk)}" for r in stuck)
        raise DeadlockError(f"deadlock: {len(stuck)} rank(s) cannot progress: {detail}")
    return Replay(compiled.schedule, timeline, max(clock) if clock else 0.0, busy)


def peak_inflight(schedule: Schedule) -> list[float]:
    """Per rank, the most chunk-micro-batches with FORWARD done and BACKWARD not (a half counts 0.5)."""
    peaks = []
    for acts in schedule.actions:
        live = peak = 0.0
        for a in acts:
            if a.kind is Kind.FORWARD:
                live += 1.0 if a.half is None else 0.5
                peak = max(peak, live)
            elif a.kind is Kind.BACKWARD:
                live -= 1.0 if a.half is None else 0.5
        peaks.append(peak)
    return peaks


def unit_times(forward: float = 1.0, backward: float = 2.0) -> Callable[[int, Action], float]:
    """compute_time giving every FORWARD `forward` and every BACKWARD `backward`."""

    def compute_time(rank: int, action: Action) -> float:
        return forward if action.kind is Kind.FORWARD else backward

    return compute_time


__all__ = [
    "CompiledSchedule",
    "DeadlockError",
    "Replay",
    "ScheduleError",
    "compile_schedule",
    "peak_inflight",
    "replay",
    "unit_times",
]
