"""Event-driven execution of a schedule with given durations (the planner's simulator core).

Model: each rank runs its list in order, one action at a time. FORWARD/BACKWARD take
compute_time(rank, action) and start once the rank is free and their input has arrived.
SEND and RECV are zero-time posts (asynchronous); a tensor is available to its consumer at
max(send post, recv post) + transfer_time(src, dst, send_action). Sends and receives are
matched by tensor identity, not by channel order (the checker verifies FIFO order separately).

BPipe transfers run beside compute, like the engine runs them. EVICT and ACCEPT are zero-time
posts; the evicted data has moved at max(EVICT post, ACCEPT post) + bpipe_time(evictor, acceptor,
EVICT), and the evictor waits for that after the compute following the EVICT and that compute's
SEND/RECV posts (its memory is freed then). RETURN waits until the evicted data is on the
acceptor, then posts; the data is back at max(RETURN post, LOAD post) + bpipe_time(acceptor,
evictor, RETURN): the backward of that key waits for it, and the acceptor waits for it after the
compute following the RETURN. An acceptor's first ACCEPT of a (chunk, whole/half) class also
waits for the evictor's first forward of that class (the engine announces the class's size then).

A recorded replay also says why each compute started when it did (`Replay.causes`: the compute before it on
the rank, or the compute after which the input was posted, on the sending or the receiving side, whichever
came later, or the one after which its loaded activations were), and the span of every p2p transfer and BPipe
move, so the simulator derives its critical path without matching sends and receives again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .schedule import (TRANSFER_KINDS, Action, DeadlockError, Kind, Schedule, ScheduleError,
                       gc_paused)


Cause = tuple[int, int]  # (rank, index among that rank's computes); index -1: the iteration's start


@dataclass
class Replay:
    """Result of `replay`: per-rank (action, start, end) in execution order; with `record`, also per compute
    the cause of its start, every p2p transfer (src, dst, send action, start, arrival) and every BPipe move
    per sending rank (EVICT/RETURN action, start, arrival)."""

    schedule: Schedule
    timeline: list[list[tuple[Action, float, float]]]
    makespan: float
    busy: list[float]  # compute time per rank
    causes: list[list[Cause]] = field(default_factory=list)
    transfers: list[tuple[int, int, Action, float, float]] = field(default_factory=list)
    moves: list[list[tuple[Action, float, float]]] = field(default_factory=list)

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


class _Op:
    """What a compiled op does (its code, an int): a schedule action, then (from EVICT_DONE on) the waits the compiler
    adds for BPipe's transfers, which record nothing in the timeline. Plain int constants, not an IntEnum: the
    replay tests them at every op, and an enum's attribute costs a lookup each time."""

    COMPUTE = 0  # FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT
    SEND = 1  # SEND_ACT, SEND_GRAD: a zero-time post
    RECV = 2  # RECV_ACT, RECV_GRAD: a zero-time post
    OTHER = 3  # any other action: recorded, takes no time
    EVICT = 4  # BPipe's transfer posts
    ACCEPT = 5
    RETURN = 6
    LOAD = 7
    EVICT_DONE = 8  # the evictor waits for its evicted data to be on the acceptor
    RETURN_DONE = 9  # the acceptor waits for the data it returns to be back on the evictor
    LOAD_WAIT = 10  # a backward waits for its loaded activations
    HEADER = 11  # the evictor announces a (chunk, whole/half) class: its first forward of it has ended
    SEND_WAIT = 12  # synchronous p2p: the sender waits until its SEND has reached the receiver


_SYNTHETIC = _Op.EVICT_DONE  # ops from this code on are the compiler's waits, not schedule actions


class _Post:
    """The events of one BPipe transfer (one key's saved activations moved out and back), one per op that posts."""

    EVICT = 0
    ACCEPT = 1
    RETURN = 2
    LOAD = 3


class _Move:
    """The two moves of one BPipe transfer, each as long as bpipe_time says."""

    EVICT = 0  # evictor -> acceptor
    RETURN = 1  # acceptor -> evictor


_POSTS, _MOVES = 4, 2  # per transfer: its events (_Post) and its moves (_Move)
_CLASSES = 2  # per chunk, the classes an evictor announces: whole and half (sliced) micro-batches
_EPS = 1e-12


@dataclass
class CompiledSchedule:
    """A schedule pre-digested for fast repeated replays (e.g. by the planner).

    ops[rank][i] = (op, action, tensor, peer, produced): `tensor` is a dense tensor id
    (the input a compute needs, or the tensor a SEND/RECV carries; -1 if none), `peer` the
    rank at the other end (-1 if none), `produced` the tensor a compute hands to a consumer on
    the same rank (-1 if none). For BPipe ops `tensor` is the transfer id and `produced` the
    header event a first ACCEPT waits for (-1 if none). Recompile after changing the schedule.
    """

    schedule: Schedule
    ops: list[list[tuple[int, Action, int, int, int]]]
    num_tensors: int
    num_transfers: int = 0
    derived: dict = field(default_factory=dict)  # what callers derive from the schedule once (e.g. its holds)


def compile_schedule(schedule: Schedule, synchronous_p2p: bool = False) -> CompiledSchedule:
    """Index a schedule's tensors once; pass the result to `replay` to skip this step.

    `synchronous_p2p`: the engine waits for its sends, as Megatron-LM's p2p_communication does (batched
    isend/irecv, then a wait on every request): before the compute after a run of SEND/RECV posts, the rank
    waits until each of those SENDs has reached its receiver, which needs the receiver's RECV posted."""
    p = schedule.pp
    if len(schedule.actions) != p:
        raise ScheduleError(f"schedule has {len(schedule.actions)} rank lists for {p} pipeline ranks")
    with gc_paused():
        ops = [_compile_rank(schedule, rank, acts) for rank, acts in enumerate(schedule.actions)]
        transfers = any(a.kind in TRANSFER_KINDS for acts in schedule.actions for a in acts)
        if transfers:
            ops = [_add_transfer_waits(schedule, rank, rank_ops) for rank, rank_ops in enumerate(ops)]
        if synchronous_p2p:
            ops = [_add_send_waits(rank_ops) for rank_ops in ops]
    return CompiledSchedule(schedule, ops, schedule.num_tensor_ids, p * schedule.num_keys if transfers else 0)


def _transfer_id(schedule: Schedule, evictor: int, a: Action) -> int:
    return evictor * schedule.num_keys + schedule.key_index(a.key)


def _header_id(evictor: int, a: Action, v: int) -> int:
    """Event: the evictor's first forward of the action's (chunk, whole/half) class has ended."""
    return (evictor * v + a.chunk) * _CLASSES + (a.half is not None)


def _add_transfer_waits(schedule: Schedule, rank: int, rank_ops: list) -> list:
    """Add the waits a BPipe transfer implies: the send of an EVICT/RETURN completes after the next compute
    (once that compute's SEND/RECV are posted); a backward waits for its LOAD; a first ACCEPT of a class
    waits for the header; the evictor announces it."""
    p, v = schedule.pp, schedule.virtual_stages
    evicted_classes = {(a.chunk, a.half is not None) for _, a, *_ in rank_ops if a.kind is Kind.EVICT}
    announced: set[tuple[int, bool]] = set()
    accepted: set[tuple[int, bool]] = set()
    loaded: dict[tuple, int] = {}  # key -> transfer id of its pending LOAD
    pending: list[tuple] = []  # send completions to wait for after the next compute
    due: list[tuple] = []  # ... which the engine waits for once that compute's own SEND/RECV are posted
    out = []
    for entry in rank_ops:
        op, a = entry[0], entry[1]
        kind = a.kind
        if due and op != _Op.SEND and op != _Op.RECV:
            out.extend(due)
            due.clear()
        if kind in TRANSFER_KINDS:
            if a.peer is None or not 0 <= a.peer < p:
                raise ScheduleError(f"rank {rank}: {a.label(v > 1)} has bad peer {a.peer!r}")
            tid = _transfer_id(schedule, rank if kind is Kind.EVICT or kind is Kind.LOAD else a.peer, a)
            if kind is Kind.EVICT:
                out.append((_Op.EVICT, a, tid, a.peer, -1))
                pending.append((_Op.EVICT_DONE, a, tid, a.peer, -1))
            elif kind is Kind.LOAD:
                out.append((_Op.LOAD, a, tid, a.peer, -1))
                loaded[a.key] = tid
            elif kind is Kind.ACCEPT:
                cls = (a.chunk, a.half is not None)
                header = -1
                if cls not in accepted:
                    accepted.add(cls)
                    header = _header_id(a.peer, a, v)
                out.append((_Op.ACCEPT, a, tid, a.peer, header))
            else:
                out.append((_Op.RETURN, a, tid, a.peer, -1))
                pending.append((_Op.RETURN_DONE, a, tid, a.peer, -1))
            continue
        if op == _Op.COMPUTE and (kind is Kind.BACKWARD or kind is Kind.BACKWARD_INPUT) and a.key in loaded:
            out.append((_Op.LOAD_WAIT, a, loaded.pop(a.key), -1, -1))
        out.append(entry)
        if op == _Op.COMPUTE:
            if kind is Kind.FORWARD:
                cls = (a.chunk, a.half is not None)
                if cls in evicted_classes and cls not in announced:
                    announced.add(cls)
                    out.append((_Op.HEADER, a, _header_id(rank, a, v), -1, -1))
            due.extend(pending)
            pending.clear()
    out.extend(due)
    out.extend(pending)
    return out


def _add_send_waits(rank_ops: list) -> list:
    """A SEND_WAIT for every SEND of a run of posts, before the compute after them (or at the end)."""
    out, pending = [], []
    for entry in rank_ops:
        if entry[0] == _Op.COMPUTE and pending:
            out.extend(pending)
            pending.clear()
        out.append(entry)
        if entry[0] == _Op.SEND:
            pending.append((_Op.SEND_WAIT, entry[1], entry[2], entry[3], -1))
    return out + pending


def _compile_rank(schedule: Schedule, rank: int, acts: list[Action]) -> list[tuple[int, Action, int, int, int]]:
    m, v = schedule.num_microbatches, schedule.virtual_stages
    tensor, tensor_id, rank_of = schedule.tensor, schedule.tensor_id, schedule.rank_of
    forward, backward = Kind.FORWARD, Kind.BACKWARD
    backward_input, weight = Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
    send_act, send_grad, recv_act, recv_grad = Kind.SEND_ACT, Kind.SEND_GRAD, Kind.RECV_ACT, Kind.RECV_GRAD
    rank_ops: list[tuple[int, Action, int, int, int]] = []
    append = rank_ops.append
    for a in acts:
        kind, chunk, mb, half = a.kind, a.chunk, a.microbatch, a.half
        if not (0 <= chunk < v and 0 <= mb < m and half in (None, 0, 1)):
            raise ScheduleError(f"rank {rank}: {a.label(v > 1)} is out of range (m={m}, v={v}, half None/0/1)")
        if kind is weight:  # a deferred weight gradient: local, no tensor in or out
            append((_Op.COMPUTE, a, -1, -1, -1))
        elif kind is forward or kind is backward or kind is backward_input:
            grad = kind is not forward
            need = tensor(rank, chunk, mb, half, grad, False)
            out = tensor(rank, chunk, mb, half, grad, True)
            produced = tensor_id(out) if out is not None and rank_of(out[1] + (-1 if grad else 1)) == rank else -1
            if need is None:
                append((_Op.COMPUTE, a, -1, -1, produced))
            else:
                append((_Op.COMPUTE, a, tensor_id(need), rank_of(need[1]), produced))
        elif kind is send_act or kind is send_grad:
            t = tensor(rank, chunk, mb, half, kind is send_grad, True)
            if t is None:
                raise ScheduleError(f"rank {rank}: {a.label(v > 1)} sends from the "
                                    f"{'first' if kind is send_grad else 'last'} virtual stage")
            append((_Op.SEND, a, tensor_id(t), -1 if a.peer is None else a.peer, -1))
        elif kind is recv_act or kind is recv_grad:
            t = tensor(rank, chunk, mb, half, kind is recv_grad, False)
            if t is None:
                raise ScheduleError(f"rank {rank}: {a.label(v > 1)} receives into the "
                                    f"{'last' if kind is recv_grad else 'first'} virtual stage")
            append((_Op.RECV, a, tensor_id(t), -1, -1))
        else:
            append((_Op.OTHER, a, -1, -1, -1))
    return rank_ops


def replay(
    schedule: Schedule | CompiledSchedule,
    compute_time: Callable[[int, Action], float],
    transfer_time: Callable[[int, int, Action], float] = _zero_transfer,
    record: bool = True,
    bpipe_time: Callable[[int, int, Action], float] = _zero_transfer,
    synchronous_p2p: bool = False,
) -> Replay:
    """Run `schedule` with the given durations; raises DeadlockError if it gets stuck. `synchronous_p2p`: see
    compile_schedule (a compiled schedule keeps the mode it was compiled with).

    `bpipe_time(src, dst, action)` is how long an EVICT (evictor -> acceptor) or a RETURN (acceptor ->
    evictor) takes to move one key's saved activations. `record=False` leaves the timeline empty
    (makespan and busy times only), for speed.
    """
    compiled = schedule if isinstance(schedule, CompiledSchedule) else compile_schedule(schedule, synchronous_p2p)
    with gc_paused():
        return _run(compiled, compute_time, transfer_time, record, bpipe_time)


def _run(
    compiled: CompiledSchedule,
    compute_time: Callable[[int, Action], float],
    transfer_time: Callable[[int, int, Action], float],
    record: bool,
    bpipe_time: Callable[[int, int, Action], float] = _zero_transfer,
) -> Replay:
    state = _State(compiled, record)
    _walk(state, compute_time, transfer_time, record, bpipe_time)
    return _result(state, compiled, record)


class _State:
    """A replay under way: per tensor when it was sent, received or made, and which rank waits for it; per BPipe
    event when it was posted and which rank waits for it; per rank how far it got, its clock and busy time. With
    `record`, the timeline, each compute's cause, the transfers and moves, and after which compute each post came."""

    __slots__ = ("ops", "show_chunk", "send_at", "send_rank", "send_action", "recv_at", "produced_at", "waiting",
                 "headers", "x_at", "x_wait", "x_time", "index", "clock", "busy", "timeline", "ready", "ncomp",
                 "last_end", "causes", "transfers", "moves", "send_after", "recv_after", "made_by", "x_after",
                 "load_cause", "recv_waiting")

    def __init__(self, compiled: CompiledSchedule, record: bool) -> None:
        ops = self.ops = compiled.ops
        p = len(ops)
        self.show_chunk = compiled.schedule.virtual_stages > 1
        n_tensors = compiled.num_tensors
        self.send_at: list[float | None] = [None] * n_tensors
        self.send_rank = [-1] * n_tensors
        self.send_action: list[Action | None] = [None] * n_tensors
        self.recv_at: list[float | None] = [None] * n_tensors
        self.produced_at: list[float | None] = [None] * n_tensors
        self.waiting = [-1] * n_tensors  # rank blocked on the tensor
        self.recv_waiting = [-1] * n_tensors  # synchronous p2p: the sender blocked until the tensor's RECV is posted
        # BPipe events: at[_POSTS * transfer + post] for each _Post of a transfer; then one per (evictor, chunk,
        # class) header. Their moves: time[_MOVES * transfer + move] for each _Move.
        n_x = compiled.num_transfers
        self.headers = _POSTS * n_x  # the first header event
        events = self.headers + _CLASSES * p * compiled.schedule.virtual_stages
        self.x_at: list[float | None] = [None] * events if n_x else []
        self.x_wait = [-1] * len(self.x_at)
        self.x_time = [0.0] * (_MOVES * n_x) if n_x else []  # durations of each transfer's moves
        self.index = [0] * p
        self.clock = [0.0] * p
        self.busy = [0.0] * p
        self.timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
        self.ready = deque(range(p))
        # With `record`: computes so far per rank, and for every post (tensor, BPipe event) the compute before it.
        self.ncomp = [0] * p
        self.last_end = [0.0] * p
        self.causes: list[list[Cause]] = [[] for _ in range(p)]
        self.transfers: list[tuple[int, int, Action, float, float]] = []
        self.moves: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
        self.send_after = [-1] * n_tensors if record else []
        self.recv_after = [-1] * n_tensors if record else []
        self.made_by = [-1] * n_tensors if record else []
        self.x_after: list[Cause] = [(-1, -1)] * len(self.x_at) if record else []
        self.load_cause: list[tuple[float, Cause] | None] = [None] * p


def _walk(state: _State, compute_time: Callable[[int, Action], float],
          transfer_time: Callable[[int, int, Action], float], record: bool,
          bpipe_time: Callable[[int, int, Action], float]) -> None:
    """Run the ready ranks' ops in order, each rank until it waits for a tensor or an event, until none is ready."""
    ops, ready, index, clock, busy = state.ops, state.ready, state.index, state.clock, state.busy
    timeline = state.timeline
    send_at, send_rank, send_action, recv_at = state.send_at, state.send_rank, state.send_action, state.recv_at
    produced_at, waiting, send_after, recv_after = state.produced_at, state.waiting, state.send_after, state.recv_after
    ncomp, show_chunk = state.ncomp, state.show_chunk
    zero_transfer = transfer_time is _zero_transfer
    compute, send, recv, evict = _Op.COMPUTE, _Op.SEND, _Op.RECV, _Op.EVICT  # locals: every op tests them
    while ready:
        rank = ready.popleft()
        rank_ops = ops[rank]
        n = len(rank_ops)
        i = index[rank]
        t = clock[rank]
        line = timeline[rank]
        while i < n:
            op, a, tid, peer, produced = rank_ops[i]
            if op == compute:
                start = t
                arrival = sent = posted = None
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
                    _record_compute(state, rank, a, tid, peer, produced, start, end, arrival, sent, posted)
                t = end
                if produced >= 0:
                    produced_at[produced] = end
                    if waiting[produced] >= 0:
                        _wake(waiting, produced, ready)
            elif op < evict:
                if op == send:
                    send_at[tid] = t
                    send_rank[tid] = rank
                    send_action[tid] = a
                    if record:
                        send_after[tid] = ncomp[rank] - 1
                    if waiting[tid] >= 0:
                        _wake(waiting, tid, ready)
                elif op == recv:
                    recv_at[tid] = t
                    if record:
                        recv_after[tid] = ncomp[rank] - 1
                    if state.recv_waiting[tid] >= 0:
                        _wake(state.recv_waiting, tid, ready)
                if record:
                    line.append((a, t, t))
            else:
                after = _send_wait(state, rank, a, tid, peer, t, transfer_time) if op == _Op.SEND_WAIT else \
                    _bpipe_op(state, rank, op, a, tid, peer, produced, t, record, bpipe_time)
                if after is None:  # the event it waits for is not posted yet
                    break
                t = after
            i += 1
        index[rank] = i
        clock[rank] = t


def _wake(waiting: list[int], tid: int, ready: deque) -> None:
    ready.append(waiting[tid])
    waiting[tid] = -1


def _send_wait(state: _State, rank: int, a: Action, tid: int, peer: int, t: float,
               transfer_time: Callable[[int, int, Action], float]) -> float | None:
    """Synchronous p2p: the time the SEND of `tid` has reached `peer` (None: its RECV is not posted yet)."""
    posted = state.recv_at[tid]
    if posted is None:
        state.recv_waiting[tid] = rank
        return None
    return max(t, max(state.send_at[tid], posted) + transfer_time(rank, peer, a))


def _record_compute(state: _State, rank: int, a: Action, tid: int, peer: int, produced: int, start: float, end: float,
                    arrival: float | None, sent: float | None, posted: float | None) -> None:
    """Record a compute: its span, and its cause (the compute before it, its input's post or its loaded data's)."""
    k = state.ncomp[rank]
    best_t, best = state.last_end[rank], (rank, k - 1)
    if tid >= 0:
        if peer == rank:
            cand = (rank, state.made_by[tid])
        else:
            cand = (peer, state.send_after[tid]) if sent >= posted else (rank, state.recv_after[tid])
            state.transfers.append((peer, rank, state.send_action[tid], sent if sent > posted else posted, arrival))
        if arrival > best_t + _EPS or (arrival > best_t - _EPS and cand[0] > best[0]):
            best_t, best = arrival, cand
    pending_load = state.load_cause[rank]
    if pending_load is not None:
        state.load_cause[rank] = None
        if pending_load[0] > best_t + _EPS or (pending_load[0] > best_t - _EPS and pending_load[1][0] > best[0]):
            best = pending_load[1]
    state.causes[rank].append(best)
    state.ncomp[rank] = k + 1
    state.last_end[rank] = end
    state.timeline[rank].append((a, start, end))
    if produced >= 0:
        state.made_by[produced] = k


def _bpipe_op(state: _State, rank: int, op: int, a: Action, tid: int, peer: int, produced: int, t: float,
              record: bool, bpipe_time: Callable[[int, int, Action], float]) -> float | None:
    """A BPipe op at `t`: wait for the event it needs, then post its own; the rank's time after it (None: waits)."""
    x_at, x_time = state.x_at, state.x_time
    base = _POSTS * tid
    post = need = -1  # the events it posts and waits for
    if op == _Op.EVICT:
        post = base + _Post.EVICT
        x_time[_MOVES * tid + _Move.EVICT] = bpipe_time(rank, peer, a)
    elif op == _Op.ACCEPT:
        post, need = base + _Post.ACCEPT, (state.headers + produced if produced >= 0 else -1)
    elif op == _Op.LOAD:
        post = base + _Post.LOAD
    elif op == _Op.RETURN or op == _Op.EVICT_DONE:
        need = base + _Post.EVICT if op == _Op.RETURN else base + _Post.ACCEPT
    elif op == _Op.RETURN_DONE or op == _Op.LOAD_WAIT:
        need = base + _Post.LOAD if op == _Op.RETURN_DONE else base + _Post.RETURN
    if need >= 0:
        ready_at = x_at[need]
        if ready_at is None:
            state.x_wait[need] = rank
            return None
        if op != _Op.ACCEPT:  # a transfer's data waited for: moved to the acceptor, or back on the evictor
            ready_at = _moved(state, rank, op, a, tid, record)
        if ready_at > t:
            t = ready_at
    if op == _Op.RETURN:
        post = base + _Post.RETURN
        x_time[_MOVES * tid + _Move.RETURN] = bpipe_time(rank, peer, a)
    elif op == _Op.HEADER:
        post = state.headers + tid
    if post >= 0:
        x_at[post] = t
        if record:
            state.x_after[post] = (rank, state.ncomp[rank] - 1)
        if state.x_wait[post] >= 0:
            state.ready.append(state.x_wait[post])
            state.x_wait[post] = -1
    if record and op < _SYNTHETIC:
        state.timeline[rank].append((a, t, t))
    return t


def _moved(state: _State, rank: int, op: int, a: Action, tid: int, record: bool) -> float:
    """When the data a RETURN or EVICT_DONE (evicted) or a RETURN_DONE or LOAD_WAIT (returned) waits for arrives."""
    x_at, base = state.x_at, _POSTS * tid
    if op == _Op.RETURN or op == _Op.EVICT_DONE:  # the evicted data has reached the acceptor
        if x_at[base + _Post.ACCEPT] is None:
            raise ScheduleError(f"rank {rank}: {a.label(state.show_chunk)} comes before its ACCEPT")
        moved_from = max(x_at[base + _Post.EVICT], x_at[base + _Post.ACCEPT])
        ready_at = moved_from + state.x_time[_MOVES * tid + _Move.EVICT]
        if record and op == _Op.EVICT_DONE:
            state.moves[rank].append((a, moved_from, ready_at))
        return ready_at
    moved_from = max(x_at[base + _Post.RETURN], x_at[base + _Post.LOAD])  # the data is back on the evictor
    ready_at = moved_from + state.x_time[_MOVES * tid + _Move.RETURN]
    if record and op == _Op.RETURN_DONE:
        state.moves[rank].append((a, moved_from, ready_at))
    elif record:
        returned, loaded = base + _Post.RETURN, base + _Post.LOAD
        by = state.x_after[returned] if x_at[returned] >= x_at[loaded] else state.x_after[loaded]
        state.load_cause[rank] = (ready_at, by)
    return ready_at


def _result(state: _State, compiled: CompiledSchedule, record: bool) -> Replay:
    """The Replay of a finished walk; a DeadlockError naming where the ranks that cannot go on stopped."""
    ops, index, clock, moves = state.ops, state.index, state.clock, state.moves
    stuck = [r for r in range(len(ops)) if index[r] < len(ops[r])]
    if stuck:
        detail = ", ".join(f"rank {r} at {ops[r][index[r]][1].label(state.show_chunk)}" for r in stuck)
        raise DeadlockError(f"deadlock: {len(stuck)} rank(s) cannot progress: {detail}")
    for rank_moves in moves:
        rank_moves.sort(key=lambda x: x[1])
    return Replay(compiled.schedule, state.timeline, max(clock) if clock else 0.0, state.busy,
                  state.causes if record else [], state.transfers, moves if record else [])


def unit_times(forward: float = 1.0, backward: float = 2.0) -> Callable[[int, Action], float]:
    """compute_time giving every FORWARD `forward` and every BACKWARD `backward`; a split backward's input
    gradient B and weight gradient W get half of `backward` each."""

    def compute_time(rank: int, action: Action) -> float:
        kind = action.kind
        if kind is Kind.FORWARD:
            return forward
        return backward if kind is Kind.BACKWARD else backward / 2

    return compute_time


__all__ = [
    "CompiledSchedule",
    "DeadlockError",
    "Replay",
    "ScheduleError",
    "compile_schedule",
    "replay",
    "unit_times",
]
