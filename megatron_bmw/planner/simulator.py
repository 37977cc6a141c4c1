"""Pipeline simulator: executes a schedule IR (any generator or transform) with per-action durations.

The timing is pipeline/replay.py's, the model the engine follows: compute is sequential per rank; SEND/RECV
are zero-time posts and a tensor reaches its consumer at max(send post, recv post) + transfer time; BPipe's
EVICT/ACCEPT/RETURN/LOAD move saved activations beside compute (a BACKWARD waits for its LOAD, a sender for
its transfer after the next compute). On top of replay's timeline this module derives
  - the critical path: walking back from the last-finishing compute through the dependency that set each
    start (the previous compute on the rank, or the arrival of its input or of its loaded activations; on a
    tie the one on the higher rank), and AutoPipe's master stage: the stage the path spends most time on in
    the steady 1F1B phase, ties going to the stage closest to the last;
  - each rank's memory over time: static bytes plus the activations it holds, with the activation store's
    accounting (replay.resident_peaks): a forward's bytes count from its start, a backward's until its end,
    evicted or returned ones until the compute their send overlaps ends, loaded or accepted ones from their
    LOAD/ACCEPT on;
  - the iteration end after gradient synchronisation (`finish`, see CostModel.finish_times).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..pipeline.replay import CompiledSchedule, compile_schedule, replay
from ..pipeline.schedule import Action, Kind, Schedule, gc_paused

_EPS = 1e-12
_F, _B = Kind.FORWARD, Kind.BACKWARD


@dataclass
class Simulation:
    schedule: Schedule
    iteration_time: float  # including gradient synchronisation
    pipeline_time: float  # last compute end
    busy: list[float]  # compute seconds per rank
    finish: list[float]  # per rank, end of its iteration
    computes: list[list[tuple[Action, float, float]]]  # per rank (action, start, end)
    copies: list[list[tuple[Action, float, float]]]  # per rank, outgoing EVICT/RETURN (action, post, arrival)
    transfers: list[tuple[int, int, Action, float, float]]  # (src, dst, send action, start, arrival)
    critical_path: list[tuple[int, Action, float, float]]  # first to last
    master_stage: int
    memory: list[list[tuple[float, float]]] = field(default_factory=list)  # per rank (time, bytes) steps
    peak_memory: list[float] = field(default_factory=list)

    @property
    def idle(self) -> list[float]:
        return [self.iteration_time - b for b in self.busy]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the pipeline phase: 1 - sum(busy) / (p x pipeline time)."""
        total = self.pipeline_time * len(self.busy)
        return 0.0 if total == 0 else 1.0 - sum(self.busy) / total


def simulate(
    schedule: Schedule | CompiledSchedule,
    compute_time: Callable[[int, Action], float],
    transfer_time: Callable[[int, int, Action], float] | None = None,
    copy_time: Callable[[int, Action, float], float] | None = None,
    chunk_bytes: list[list[float]] | None = None,
    static_bytes: list[float] | None = None,
    finish: Callable[[list[float], list[tuple[float, float]]], list[float]] | None = None,
    record_transfers: bool = False,
    held_bytes: list[list[float]] | None = None,
) -> Simulation:
    """Execute `schedule` (a Schedule or replay.compile_schedule's result, to reuse across calls).

    chunk_bytes[rank][chunk]: saved activations one micro-batch leaves on the rank (what BPipe moves);
    held_bytes[rank][chunk]: more bytes a micro-batch holds until its backward but never moves (the chunk's
    output the engine keeps); static_bytes[rank]: weights and optimizer states. copy_time(rank, action, bytes):
    duration of an EVICT or RETURN posted on `rank`. `record_transfers` keeps every p2p transfer's span."""
    compiled = schedule if isinstance(schedule, CompiledSchedule) else compile_schedule(schedule)
    sched = compiled.schedule
    p = sched.num_stages
    zero = [[0.0] * sched.virtual_stages for _ in range(p)]
    moved = chunk_bytes or zero

    def bpipe_time(src: int, dst: int, a: Action) -> float:
        evictor = src if a.kind is Kind.EVICT else dst
        nbytes = (1.0 if a.half is None else 0.5) * moved[evictor][a.chunk]
        return copy_time(src, a, nbytes) if copy_time is not None else 0.0

    kwargs = {"bpipe_time": bpipe_time} if copy_time is not None else {}
    rep = replay(compiled, compute_time, transfer_time, record=True, **kwargs) if transfer_time is not None \
        else replay(compiled, compute_time, record=True, **kwargs)
    with gc_paused():
        return _analyse(sched, rep.timeline, rep.busy, transfer_time, bpipe_time, chunk_bytes, held_bytes,
                        static_bytes, finish, record_transfers)


def _tensor(grad: bool, vstage: int, a: Action) -> tuple:
    return (grad, vstage, a.microbatch, a.half)


def _analyse(sched, timeline, busy, transfer_time, bpipe_time, chunk_bytes, held_bytes, static_bytes, finish,
             record_transfers) -> Simulation:
    p, v = sched.num_stages, sched.virtual_stages
    last_vs = p * v - 1
    computes: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    # Posts, keyed by what they carry: (rank, time, index of the compute before the post on that rank).
    sends: dict[tuple, tuple[int, float, int, Action]] = {}
    recvs: dict[tuple, tuple[float, int]] = {}
    moves: dict[tuple, tuple[int, float, int, Action]] = {}  # (kind, evictor, key) -> post
    send_act, send_grad, recv_act, recv_grad = Kind.SEND_ACT, Kind.SEND_GRAD, Kind.RECV_ACT, Kind.RECV_GRAD
    for rank, line in enumerate(timeline):
        mine = computes[rank]
        for a, s, e in line:
            kind = a.kind
            if kind is _F or kind is _B:
                mine.append((a, s, e))
            elif kind is send_act or kind is send_grad:
                sends[_tensor(kind is send_grad, a.chunk * p + rank, a)] = (rank, s, len(mine) - 1, a)
            elif kind is recv_act:
                recvs[_tensor(False, a.chunk * p + rank - 1, a)] = (s, len(mine) - 1)
            elif kind is recv_grad:
                recvs[_tensor(True, a.chunk * p + rank + 1, a)] = (s, len(mine) - 1)
            elif kind is Kind.EVICT or kind is Kind.LOAD:
                moves[(kind, rank, a.key)] = (rank, s, len(mine) - 1, a)
            elif kind is Kind.ACCEPT or kind is Kind.RETURN:
                moves[(kind, a.peer, a.key)] = (rank, s, len(mine) - 1, a)

    transfers: list[tuple[int, int, Action, float, float]] = []
    preds: list[list[tuple[int, int]]] = []
    for rank, acts in enumerate(computes):
        rank_preds = []
        for i, (a, s, _) in enumerate(acts):
            best_t, best = (acts[i - 1][2], (rank, i - 1)) if i else (0.0, (rank, -1))
            candidates = []
            vs = a.chunk * p + rank
            need = None
            if a.kind is _F and vs != 0:
                need = _tensor(False, vs - 1, a)
            elif a.kind is _B and vs != last_vs:
                need = _tensor(True, vs + 1, a)
            if need is not None and need in sends and need in recvs:
                s_rank, sent, s_idx, s_action = sends[need]
                posted, r_idx = recvs[need]
                base = max(sent, posted)
                arrival = base + (transfer_time(s_rank, rank, s_action) if transfer_time else 0.0)
                candidates.append((arrival, (s_rank, s_idx) if sent >= posted else (rank, r_idx)))
                if record_transfers:
                    transfers.append((s_rank, rank, s_action, base, arrival))
            if a.kind is _B and (Kind.LOAD, rank, a.key) in moves and (Kind.RETURN, rank, a.key) in moves:
                _, loaded, l_idx, _ = moves[(Kind.LOAD, rank, a.key)]
                r_rank, returned, r_idx, r_action = moves[(Kind.RETURN, rank, a.key)]
                back = max(loaded, returned) + bpipe_time(r_rank, rank, r_action)
                candidates.append((back, (r_rank, r_idx) if returned >= loaded else (rank, l_idx)))
            for t, dep in candidates:
                if t > best_t + _EPS or (t > best_t - _EPS and dep[0] > best[0]):
                    best_t, best = t, dep
            rank_preds.append(best)
        preds.append(rank_preds)

    copies: list[list[tuple[Action, float, float]]] = [[] for _ in range(p)]
    for (kind, evictor, key), (rank, t, _, a) in moves.items():
        if kind is Kind.EVICT or kind is Kind.RETURN:
            match = moves.get((Kind.ACCEPT if kind is Kind.EVICT else Kind.LOAD, evictor, key))
            start = max(t, match[1]) if match else t
            dst = a.peer
            copies[rank].append((a, start, start + bpipe_time(rank, dst, a)))
    for c in copies:
        c.sort(key=lambda x: x[1])

    ends = [acts[-1][2] if acts else 0.0 for acts in computes]
    ends = [max([e] + [x[2] for x in copies[r]]) for r, e in enumerate(ends)]
    pipeline_time = max(ends) if ends else 0.0
    last_b = []
    for r in range(p):
        backs = [c for c in reversed(computes[r]) if c[0].kind is _B]
        last_b.append((backs[0][1], backs[0][2] - backs[0][1]) if backs else (ends[r], 0.0))
    fin = finish(ends, last_b) if finish is not None else list(ends)
    path = _critical_path(computes, preds)
    sim = Simulation(sched, max(fin) if fin else 0.0, pipeline_time, list(busy), fin, computes, copies, transfers,
                     [(r, *computes[r][i]) for r, i in path], _master_stage(computes, path))
    if chunk_bytes is not None:
        _memory(sim, timeline, chunk_bytes, held_bytes, static_bytes)
    return sim


def _memory(sim: Simulation, timeline, chunk_bytes, held_bytes, static_bytes) -> None:
    """Memory over time per rank, with the activation store's accounting (see the module doc)."""
    p = len(timeline)
    events: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    for rank, line in enumerate(timeline):
        leaving = 0.0
        for a, s, e in line:
            kind = a.kind
            share = 1.0 if a.half is None else 0.5
            if kind is _F or kind is _B:
                own = share * (chunk_bytes[rank][a.chunk] + (held_bytes[rank][a.chunk] if held_bytes else 0.0))
                if kind is _F:
                    events[rank].append((s, own))
                else:
                    events[rank].append((e, -own))
                if leaving:
                    events[rank].append((e, -leaving))
                    leaving = 0.0
            elif kind is Kind.LOAD:
                events[rank].append((s, share * chunk_bytes[rank][a.chunk]))
            elif kind is Kind.ACCEPT:
                events[rank].append((s, share * chunk_bytes[a.peer][a.chunk]))
            elif kind is Kind.EVICT:
                leaving += share * chunk_bytes[rank][a.chunk]
            elif kind is Kind.RETURN:
                leaving += share * chunk_bytes[a.peer][a.chunk]
        if leaving:
            events[rank].append((line[-1][2], -leaving))
    static = static_bytes or [0.0] * p
    for r in range(p):
        level = peak = static[r]
        steps = [(0.0, level)]
        for when, delta in sorted(events[r]):  # at equal times frees come first
            level += delta
            steps.append((when, level))
            peak = max(peak, level)
        sim.memory.append(steps)
        sim.peak_memory.append(peak)


def _critical_path(computes, preds) -> list[tuple[int, int]]:
    """(rank, compute index) from the first action to the last-finishing one (ties: the higher rank)."""
    last = None
    for r, acts in enumerate(computes):
        if not acts:
            continue
        if last is None:
            last = (r, len(acts) - 1)
            continue
        best = computes[last[0]][last[1]][2]
        if acts[-1][2] > best + _EPS or (acts[-1][2] > best - _EPS and r > last[0]):
            last = (r, len(acts) - 1)
    path = []
    while last is not None and last[1] >= 0:
        path.append(last)
        last = preds[last[0]][last[1]]
    path.reverse()
    return path


def _steady(acts: list[tuple[Action, float, float]]) -> set[int]:
    """Compute indices of the steady phase: from the forward before the first backward to the last forward."""
    first_b = next((i for i, x in enumerate(acts) if x[0].kind is _B), None)
    last_f = max((i for i, x in enumerate(acts) if x[0].kind is _F), default=None)
    if first_b is None or last_f is None or last_f < first_b:
        return set()
    return set(range(max(0, first_b - 1), last_f + 1))


def _master_stage(computes, path: list[tuple[int, int]]) -> int:
    if not path:
        return 0
    steady = [_steady(acts) for acts in computes]
    on_steady = [0.0] * len(computes)
    overall = [0.0] * len(computes)
    for r, i in path:
        _, s, e = computes[r][i]
        overall[r] += e - s
        if i in steady[r]:
            on_steady[r] += e - s
    weights = on_steady if any(on_steady) else overall
    best = max(weights)
    return max(r for r, w in enumerate(weights) if w >= best * (1 - 1e-9))


__all__ = ["Simulation", "compile_schedule", "simulate"]
