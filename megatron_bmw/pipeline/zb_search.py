"""ZB-1p and ZB-2p (Qi et al., ICLR 2024): zero-bubble schedules searched for the stages' own times.

Given each stage's forward F, input-gradient B and weight-gradient W times, the time a tensor takes to cross each
stage boundary, and a memory limit per stage (micro-batches held: pipeline/holding.py's rule, a FORWARD's
activations count from its start until its W ends), an event-driven greedy walk in real durations places every
stage's passes:
  - a stage that is free runs the oldest B whose gradient has arrived (the critical path);
  - else the oldest F whose input has arrived, if the limit allows one more micro-batch and, before the stage's
    first B, the warm-up cap allows one more F (as many F's as memory allows shrink the bubble before the first B);
  - else a pending W when the limit blocks the next F (a forced W), when the stage would idle at least W's time
    before its next input can arrive, when that idle time is shorter but the stage has the largest idle time so
    far of all stages, or when no input is left to wait for (the W's fill the tail);
  - else it idles until the next event (an input arrives, another stage frees).
Ties in time go to the lower stage; everything is a pure function of its inputs, so every rank builds the same
order (the runtime regenerates it from the times the plan carries, pipeline/build.py).

The walk runs in three variants (warm-up caps: memory only, 1F1B's p - s, ZB-H2's 2(p - s) - 1). Each, and the
handcrafted ZB-H1 order (and ZB-H2's where its 2p - 1 micro-batches fit the limit), is replayed
(pipeline/replay.py) with the same times and transfers; the fastest wins (ties: the earlier candidate). So the
result is never slower than ZB-H1 under those times, and where the heuristic loses it is a handcrafted order.

"zb-1p" limits every stage to p micro-batches (1F1B's first stage), "zb-2p" to 2p (the paper's ZB-2p).
Without times every stage gets f = b = w = 1 and free transfers.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence

from ..errors import UsageError
from .communication import add_communication
from .replay import replay
from .schedule import Action, Kind, Schedule
from .zero_bubble import list_schedule, zb_h1_order, zb_h2_budgets

SEARCHED_ZB = {"zb-1p": 1, "zb-2p": 2}  # name -> memory limit in multiples of p
HANDCRAFTED = {"zb-1p": "zb-h1", "zb-2p": "zb-h2"}  # the handcrafted order within each one's memory (a candidate)
StageTimes = tuple[float, float, float, float]  # (f, b, w, send to the next stage) in seconds
_EPS = 1e-12


def equal_times(p: int) -> list[StageTimes]:
    """f = b = w = 1 on every stage, free transfers: the default without a plan's times."""
    return [(1.0, 1.0, 1.0, 0.0)] * p


def check_times(times: Sequence[Sequence[float]], p: int, where: str = "pipeline.schedule_times") -> list[StageTimes]:
    """`times` as p (f, b, w, send) tuples of finite non-negative floats; UsageError otherwise."""
    if len(times) != p:
        raise UsageError(f"{where}: {len(times)} stages of times for {p} pipeline stages")
    out = []
    for s, row in enumerate(times):
        vals = tuple(float(x) for x in row)
        if len(vals) != 4 or not all(math.isfinite(x) and x >= 0 for x in vals):
            raise UsageError(f"{where}: stage {s} needs (f, b, w, send) finite and >= 0, got {list(row)}")
        out.append(vals)
    return out


class _Walk:
    """One greedy walk (see the module docstring): per stage its clock, next F and B, pending W's, holding."""

    def __init__(self, p: int, m: int, times: list[StageTimes], limits: list[float], caps: list[int]) -> None:
        self.p, self.m, self.times, self.limits, self.caps = p, m, times, limits, caps
        self.free = [0.0] * p
        self.idle = [0.0] * p
        self.nf = [0] * p
        self.nb = [0] * p
        self.held = [0] * p
        self.left = [3 * m] * p
        self.wq: list[deque[int]] = [deque() for _ in range(p)]
        self.act_at: list[list[float | None]] = [[0.0 if s == 0 else None] * m for s in range(p)]
        self.grad_at: list[list[float | None]] = [[None] * m for _ in range(p)]
        self.arrivals: list[float] = []  # heap of known future arrival times
        self.order: list[list[Action]] = [[] for _ in range(p)]

    def run(self) -> list[list[Action]]:
        active = list(range(self.p))
        while active:
            free = self.free
            t = min(free[s] for s in active)
            at_t = [s for s in active if free[s] == t]
            acted = False
            for s in at_t:
                a = self._decide(s, t)
                if a is not None:
                    self._place(s, t, a)
                    acted = True
            if acted:
                active = [s for s in active if self.left[s]]
            else:
                self._advance(t, at_t, active)
        return self.order

    def _advance(self, t: float, waiting: list[int], active: list[int]) -> None:
        while self.arrivals and self.arrivals[0] <= t:
            heapq.heappop(self.arrivals)
        later = [self.free[s] for s in active if self.free[s] > t]
        if self.arrivals:
            later.append(self.arrivals[0])
        if not later:
            raise AssertionError(f"zb search stalled at {t} (p={self.p}, m={self.m})")  # cannot happen: limit >= 1
        nxt = min(later)
        for s in waiting:
            self.idle[s] += nxt - t
            self.free[s] = nxt

    def _decide(self, s: int, t: float) -> Action | None:
        nf, nb = self.nf[s], self.nb[s]
        grad = self.grad_at[s][nb] if nb < nf else None
        if grad is not None and grad <= t + _EPS:
            return Action(Kind.BACKWARD_INPUT, nb)
        f_ready = nf < self.m and self.act_at[s][nf] is not None and self.act_at[s][nf] <= t + _EPS
        mem_ok = self.held[s] + 1 <= self.limits[s] + _EPS
        warm_ok = nb > 0 or nf < self.caps[s]
        if f_ready and mem_ok and warm_ok:
            return Action(Kind.FORWARD, nf)
        if not self.wq[s]:
            return None
        w = self.times[s][2]
        forced = not mem_ok and nf < self.m  # only a W makes room for the next F
        if forced or self._gap(s, t) >= w - _EPS or self.idle[s] >= max(self.idle) - _EPS:
            return Action(Kind.BACKWARD_WEIGHT, self.wq[s][0])
        return None

    def _gap(self, s: int, t: float) -> float:
        """A lower bound on how long stage s waits for its next input (inf: no input left to come)."""
        nf, nb = self.nf[s], self.nb[s]
        soonest = math.inf
        if nb < nf:
            at = self.grad_at[s][nb]
            soonest = at if at is not None else max(self.free[s + 1], t) + self.times[s + 1][1] + self.times[s][3]
        if nf < self.m and self.held[s] + 1 <= self.limits[s] + _EPS:
            at = self.act_at[s][nf]
            if at is None and s > 0:
                at = max(self.free[s - 1], t) + self.times[s - 1][0] + self.times[s - 1][3]
            soonest = min(soonest, at if at is not None else math.inf)
        return soonest - t

    def _place(self, s: int, t: float, a: Action) -> None:
        f, b, w, _ = self.times[s]
        mb = a.microbatch
        if a.kind is Kind.FORWARD:
            end = t + f
            self.nf[s] += 1
            self.held[s] += 1
            if s == self.p - 1:
                self.grad_at[s][mb] = end  # the loss is local
            else:
                self._arrive(self.act_at[s + 1], mb, end + self.times[s][3])
        elif a.kind is Kind.BACKWARD_INPUT:
            end = t + b
            self.nb[s] += 1
            self.wq[s].append(mb)
            if s > 0:
                self._arrive(self.grad_at[s - 1], mb, end + self.times[s - 1][3])
        else:
            end = t + w
            self.wq[s].popleft()
            self.held[s] -= 1
        self.order[s].append(a)
        self.left[s] -= 1
        self.free[s] = end

    def _arrive(self, table: list[float | None], mb: int, at: float) -> None:
        table[mb] = at
        heapq.heappush(self.arrivals, at)


def greedy_order(p: int, m: int, times: list[StageTimes], limits: list[float],
                 caps: list[int] | None = None) -> list[list[Action]]:
    """One walk's per-rank F/B/W order (caps: the most F's before each stage's first B; default: memory only)."""
    if min(limits) < 1:
        raise UsageError(f"zero-bubble search: every stage must hold at least 1 micro-batch, got {min(limits)}")
    caps = caps if caps is not None else [m] * p
    return _Walk(p, m, times, limits, caps).run()


def _candidates(p: int, m: int, times: list[StageTimes], limits: list[float]) -> list[list[list[Action]]]:
    """The walk's variants, then the handcrafted orders that fit the limits (duplicates left out)."""
    cap_sets = ([m] * p, [min(m, p - s) for s in range(p)], [min(m, 2 * (p - s) - 1) for s in range(p)])
    out = [greedy_order(p, m, times, limits, caps) for caps in cap_sets]
    out.append(zb_h1_order(p, m).actions)  # rank r holds at most p micro-batches
    if min(limits) >= 2 * p - 1:
        out.append(list_schedule("zb-h2", p, m, 1, "interleaved", zb_h2_budgets(p)).actions)
    seen: set = set()
    return [o for o in out if not (tuple(map(tuple, o)) in seen or seen.add(tuple(map(tuple, o))))]


def makespan(schedule: Schedule, times: list[StageTimes]) -> float:
    """The replayed iteration time of `schedule` (one chunk per rank) with `times` and their transfers."""
    def compute(rank: int, a: Action) -> float:
        f, b, w, _ = times[rank]
        return {Kind.FORWARD: f, Kind.BACKWARD_INPUT: b, Kind.BACKWARD_WEIGHT: w, Kind.BACKWARD: b + w}[a.kind]

    def transfer(src: int, dst: int, a: Action) -> float:
        return times[min(src, dst)][3]

    return replay(add_communication(schedule), compute, transfer, record=False).makespan


def zb_search(name: str, p: int, m: int, times: Sequence[Sequence[float]] | None = None) -> Schedule:
    """The compute order of "zb-1p" or "zb-2p" on p ranks, m micro-batches, with per-stage (f, b, w, send) times
    (default equal_times): the fastest candidate under those times (module docstring)."""
    if name not in SEARCHED_ZB:
        raise UsageError(f"unknown searched zero-bubble schedule {name!r} (choose {', '.join(SEARCHED_ZB)})")
    stage_times = equal_times(p) if times is None else check_times(times, p)
    limits = [float(SEARCHED_ZB[name] * p)] * p
    best, best_time = None, math.inf
    for order in _candidates(p, m, stage_times, limits):
        sched = Schedule(name, p, m, 1, order)
        span = makespan(sched, stage_times)
        if span < best_time - 1e-12 * max(1.0, span):
            best, best_time = sched, span
    assert best is not None
    return best
