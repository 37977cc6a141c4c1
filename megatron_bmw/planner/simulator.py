"""Pipeline simulator: executes a schedule IR (any generator or transform) with per-action durations.

The timing is pipeline/replay.py's, the model the engine follows: compute is sequential per rank; SEND/RECV
are zero-time posts and a tensor reaches its consumer at max(send post, recv post) + transfer time; BPipe's
EVICT/ACCEPT/RETURN/LOAD move saved activations beside compute (a BACKWARD waits for its LOAD, a sender for
its transfer after the next compute). On top of replay's timeline this module derives
  - the critical path: walking back from the last-finishing compute through the cause replay recorded for
    each start (the previous compute on the rank, or the arrival of its input or of its loaded activations;
    on a tie the one on the higher rank), and AutoPipe's master stage: the stage the path spends most time on in
    the steady 1F1B phase, ties going to the stage closest to the last;
  - each rank's memory over time: static bytes plus the activations it holds (pipeline/holding.py's rule,
    the activation store's accounting), each hold at the start or end time of its action;
  - the iteration end after gradient synchronisation (`finish`, see CostModel.finish_times).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..pipeline.holding import bytes_size, holding_events
from ..pipeline.replay import CompiledSchedule, compile_schedule, replay
from ..pipeline.schedule import COMPUTE_KINDS, GRAD_KINDS, Action, Kind, Schedule, gc_paused
from .overlap import RankSpans

_EPS = 1e-12
_F, _B, _BI, _W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT
_COMPUTE = frozenset({_F, _B, _BI, _W})


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
    finish: Callable[[list[float], list[RankSpans]], list[float]] | None = None,
    record_transfers: bool = False,
    memory_over_time: bool = True,
    wgrad_bytes: list[list[float]] | None = None,
) -> Simulation:
    """Execute `schedule` (a Schedule or replay.compile_schedule's result, to reuse across calls).

    chunk_bytes[rank][chunk]: saved activations one micro-batch leaves on the rank (what BPipe moves);
    static_bytes[rank]: weights and optimizer states. copy_time(rank, action, bytes):
    duration of an EVICT or RETURN posted on `rank`. wgrad_bytes[rank][chunk]: what one micro-batch keeps from a
    split backward's B to its W (default: all of chunk_bytes). `record_transfers` keeps every p2p transfer's span;
    without `memory_over_time` the memory timeline is skipped (chunk_bytes then only sizes BPipe's moves)."""
    compiled = schedule if isinstance(schedule, CompiledSchedule) else compile_schedule(schedule)
    sched = compiled.schedule
    p = sched.pp
    zero = [[0.0] * sched.virtual_stages for _ in range(p)]
    moved = chunk_bytes or zero

    def bpipe_time(src: int, dst: int, a: Action) -> float:
        evictor = src if a.kind is Kind.EVICT else dst
        nbytes = a.weight * moved[evictor][a.chunk]
        return copy_time(src, a, nbytes) if copy_time is not None else 0.0

    kwargs = {"bpipe_time": bpipe_time} if copy_time is not None else {}
    rep = replay(compiled, compute_time, transfer_time, record=True, **kwargs) if transfer_time is not None \
        else replay(compiled, compute_time, record=True, **kwargs)
    with gc_paused():
        return _analyse(sched, rep, chunk_bytes if memory_over_time else None, static_bytes, finish,
                        record_transfers, wgrad_bytes)


def _analyse(sched, rep, chunk_bytes, static_bytes, finish, record_transfers, wgrad_bytes=None) -> Simulation:
    # every compute, a zero-bubble schedule's B and W included: replay's causes index them all
    computes = [[x for x in line if x[0].kind in COMPUTE_KINDS] for line in rep.timeline]
    ends = [max([acts[-1][2] if acts else 0.0] + [x[2] for x in rep.moves[r]]) for r, acts in enumerate(computes)]
    pipeline_time = max(ends) if ends else 0.0
    fin = finish(ends, [_spans(line, sched.virtual_stages, end) for line, end in zip(rep.timeline, ends)]) \
        if finish is not None else list(ends)
    path = _critical_path(computes, rep.causes)
    sim = Simulation(sched, max(fin) if fin else 0.0, pipeline_time, list(rep.busy), fin, computes, rep.moves,
                     rep.transfers if record_transfers else [], [(r, *computes[r][i]) for r, i in path],
                     _master_stage(computes, path))
    if chunk_bytes is not None:
        _memory(sim, rep.timeline, chunk_bytes, static_bytes, wgrad_bytes)
    return sim


def _spans(line, chunks: int, end: float) -> RankSpans:
    """Per chunk, the (start, end) of its last gradient action (BACKWARD or W) and of its first FORWARD."""
    last: list[tuple[float, float] | None] = [None] * chunks
    first: list[tuple[float, float] | None] = [None] * chunks
    for a, s, e in line:
        if a.kind is _F:
            if first[a.chunk] is None:
                first[a.chunk] = (s, e)
        elif a.kind is _B or a.kind is _W:
            last[a.chunk] = (s, e)
    return RankSpans([x or (end, end) for x in last], [x or (0.0, 0.0) for x in first])


def _memory(sim: Simulation, timeline, chunk_bytes, static_bytes, wgrad_bytes=None) -> None:
    """Memory over time per rank: pipeline/holding.py's holds, at the start or end time of their action."""
    p = len(timeline)
    static = static_bytes or [0.0] * p
    for r, line in enumerate(timeline):
        size = bytes_size(lambda owner: chunk_bytes[owner],
                          None if wgrad_bytes is None else (lambda owner: wgrad_bytes[owner]))
        events = [(line[h.index][2] if h.at_end else line[h.index][1], size(h))
                  for h in holding_events([a for a, _, _ in line], r)]
        level = top = static[r]
        steps = [(0.0, level)]
        for when, delta in sorted(events):  # at equal times frees come first
            level += delta
            steps.append((when, level))
            top = max(top, level)
        sim.memory.append(steps)
        sim.peak_memory.append(top)


def _critical_path(computes, causes) -> list[tuple[int, int]]:
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
        last = causes[last[0]][last[1]]
    path.reverse()
    return path


def _steady(acts: list[tuple[Action, float, float]]) -> set[int]:
    """Compute indices of the steady phase: from the forward before the first backward to the last forward."""
    first_b = next((i for i, x in enumerate(acts) if x[0].kind in GRAD_KINDS), None)
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
