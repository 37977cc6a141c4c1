"""BPipe (Kim et al., 2023) as a schedule transform: balance saved activations across pipeline ranks.

In 1F1B, rank s holds up to min(p - s, m) micro-batches of saved activations. BPipe pairs the evictor s
with the acceptor p-1-s: the evictor sends (EVICT) the activations of some micro-batches to its acceptor,
which holds them (ACCEPT) and sends them back (RETURN) before the evictor needs them (LOAD), so no rank
holds more than mu_opt chunk-micro-batches. See docs/algorithms.md, "BPipe".

The evictor's transfers come from one walk over its compute actions (Belady's rule: evict what is needed
furthest in the future, load one action ahead). The acceptor's ACCEPT/RETURN are placed where its own list
stands when the evictor posts the transfer, in a unit-time replay of the schedule.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict

from ..errors import UsageError
from .generators import add_communication
from .holding import held_during, peak_inflight, resident_peaks
from .replay import replay
from .schedule import (
    COMPUTE_KINDS,
    TRANSFER_KINDS,
    Action,
    Key,
    Kind,
    Schedule,
    ScheduleError,
    gc_paused,
)

__all__ = ["ActivationLimitError", "bpipe_pairs", "insert_bpipe", "mu_opt"]


class ActivationLimitError(ScheduleError):
    """The transfers cannot keep some rank within mu_opt (it happens when many micro-batches are sliced)."""

    def __init__(self, rank: int, held: float, limit: float) -> None:
        super().__init__(f"BPipe: rank {rank} would hold {held:g} chunk-micro-batches of activations, above "
                         f"mu_opt {limit:g}")
        self.rank, self.held, self.limit = rank, held, limit


_EPS = 1e-9  # counts are multiples of 0.5, so this only guards the comparison


def mu_opt(p: int, v: int = 1) -> int:
    """Chunk-micro-batches of saved activations every rank may hold under BPipe."""
    return (p + 3) // 2 if v == 1 else p * v + 1


def bpipe_pairs(schedule: Schedule) -> dict[int, int]:
    """evictor rank -> acceptor rank, for the ranks whose peak exceeds mu_opt."""
    p, limit = schedule.pp, mu_opt(schedule.pp, schedule.virtual_stages)
    peaks = peak_inflight(schedule)
    pairs = {}
    for s, peak in enumerate(peaks):
        if peak <= limit:
            continue
        acceptor = p - 1 - s
        if acceptor <= s:
            raise ScheduleError(f"BPipe: rank {s} holds {peak:g} chunk-micro-batches, above {limit}, "
                                "and has no acceptor")
        if peaks[acceptor] + peak > 2 * limit:
            raise ScheduleError(f"BPipe: ranks {s} and {acceptor} together hold {peaks[acceptor] + peak:g} "
                                f"chunk-micro-batches, more than 2 x {limit}")
        pairs[s] = acceptor
    return pairs


def insert_bpipe(schedule: Schedule) -> Schedule:
    """Copy of `schedule` with BPipe's EVICT/LOAD (evictors) and ACCEPT/RETURN (acceptors) inserted and
    `activation_limit` set to mu_opt; SEND/RECV are re-derived. Pure: the input is not modified.
    Raises ActivationLimitError if some rank cannot be kept within mu_opt (never for unsliced 1F1B or
    interleaved schedules with p <= 16, m <= 64, v <= 4; possible when many micro-batches are sliced)."""
    if schedule.name not in ("1f1b", "interleaved"):
        raise UsageError(f"--bpipe needs the 1f1b or interleaved schedule, not {schedule.name}")
    if any(a.kind in TRANSFER_KINDS for acts in schedule.actions for a in acts):
        raise ScheduleError("BPipe: the schedule already has transfers")
    limit = mu_opt(schedule.pp, schedule.virtual_stages)
    pairs = bpipe_pairs(schedule)
    if not pairs:
        result = schedule.copy()
        result.activation_limit = limit
        return result
    computes = [[a for a in acts if a.kind in COMPUTE_KINDS] for acts in schedule.actions]
    timeline = _unit_timeline(schedule)
    result = _transfers(schedule, computes, timeline, pairs, limit, early=True)
    held = resident_peaks(result)
    if max(held) > limit + _EPS:  # transfers crowd an acceptor: evict only what each evictor must
        result = _transfers(schedule, computes, timeline, pairs, limit, early=False)
        held = resident_peaks(result)
    for rank, amount in enumerate(held):
        if amount > limit + _EPS:
            raise ActivationLimitError(rank, amount, limit)
    return result


def _transfers(schedule: Schedule, computes: list[list[Action]], timeline: list[list[tuple[float, float]]],
               pairs: dict[int, int], limit: float, early: bool) -> Schedule:
    inserts: list[dict[int, list[Action]]] = [defaultdict(list) for _ in computes]
    with gc_paused():
        for evictor, acceptor in pairs.items():
            plan = _plan_evictor(computes[evictor], limit, acceptor, evictor, early)
            for j, acts in plan.items():
                inserts[evictor][j].extend(acts)
            placed = _place_acceptor(plan, evictor, timeline[evictor], computes[acceptor], timeline[acceptor], limit)
            for i, acts in placed.items():
                inserts[acceptor][i].extend(acts)
    out = []
    for rank, comp in enumerate(computes):
        acts: list[Action] = []
        for j, a in enumerate(comp):
            acts.extend(inserts[rank].get(j, ()))
            acts.append(a)
        acts.extend(inserts[rank].get(len(comp), ()))
        out.append(acts)
    result = add_communication(schedule.copy(out))
    result.activation_limit = limit
    return result


def _unit_time(rank: int, a: Action) -> float:
    return (1.0 if a.kind is Kind.FORWARD else 2.0) * a.weight


def _unit_timeline(schedule: Schedule) -> list[list[tuple[float, float]]]:
    """Per rank, (start, end) of each compute action with forward 1, backward 2 (halves take half)."""
    result = replay(schedule, _unit_time)
    return [[(start, end) for a, start, end in line if a.kind in COMPUTE_KINDS] for line in result.timeline]


def _place_acceptor(plan: dict[int, list[Action]], evictor: int, evictor_line: list[tuple[float, float]],
                    computes: list[Action], line: list[tuple[float, float]], limit: float) -> dict[int, list[Action]]:
    """ACCEPT/RETURN for the evictor's transfers, keyed by the acceptor's compute index they precede.

    Times are from the unit-time replay. A RETURN goes where the acceptor stands when the evictor posts the
    LOAD. An ACCEPT goes where the acceptor stands when the EVICT is posted (the most overlap), or later, up
    to the evictor's wait for that send, when holding it from there would lift the acceptor above `limit`.
    """
    n = len(computes)
    ends = [end for _, end in line]
    held = held_during(computes, -1)  # own chunk-micro-batches during each acceptor compute; accepted ones added below
    posts = [0.0] + [end for _, end in evictor_line]  # actions before compute j are posted at the end of j-1
    returns: dict[Key, int] = {}
    for j in sorted(plan):
        for a in plan[j]:
            if a.kind is Kind.LOAD:
                returns[a.key] = bisect_right(ends, posts[j])
    placed: dict[int, list[Action]] = defaultdict(list)
    earliest = 0
    for j in sorted(plan):
        for a in plan[j]:
            if a.kind is Kind.LOAD:
                placed[returns[a.key]].append(Action(Kind.RETURN, a.microbatch, a.chunk, evictor, a.half))
                continue
            lo = max(earliest, bisect_right(ends, posts[j]))
            hi = max(lo, bisect_right(ends, evictor_line[j][1]))
            last = min(returns[a.key], n - 1)  # the acceptor holds the key up to and including this compute
            w = a.weight
            where = next((i for i in range(lo, hi + 1) if all(held[c] + w <= limit + _EPS
                                                                for c in range(i, last + 1))), hi)
            for c in range(where, last + 1):
                held[c] += w
            earliest = where
            placed[where].append(Action(Kind.ACCEPT, a.microbatch, a.chunk, evictor, a.half))
    return placed


def _plan_evictor(computes: list[Action], limit: float, acceptor: int, rank: int,
                  early: bool = True) -> dict[int, list[Action]]:
    """EVICT/LOAD actions to place before each compute index so the rank never holds more than `limit`.

    Accounting (as in holding.holding_events): a key evicted before compute j still counts during j; a key
    loaded before compute j counts from j on. Before compute j we (1) load the key compute j's backward needs
    if it is away, (2) load the key of compute j+1's backward one action ahead when it fits, and (3) evict,
    furthest next use first, what compute j+1 would not fit without - and, when compute j+1 is a forward,
    also what the one-ahead load for compute j+2 needs (the steady phase). In the cool-down (compute j+1 is
    a backward) a load waits in the idle slot before its backward instead. Without `early`, (3) evicts only
    what compute j+1 needs (fewer activations on the acceptor, loads not overlapped).
    """
    n = len(computes)
    backward_at = {a.key: j for j, a in enumerate(computes) if a.kind is Kind.BACKWARD}
    present: dict[Key, float] = {}  # own keys counted now
    away: set[Key] = set()
    plan: dict[int, list[Action]] = defaultdict(list)

    def load(j: int, key: Key) -> None:
        away.remove(key)
        present[key] = 0.5 if key[2] is not None else 1.0  # a key's weight, as Action.weight
        plan[j].append(Action(Kind.LOAD, key[0], key[1], acceptor, key[2]))

    def present_after(a: Action) -> None:
        if a.kind is Kind.FORWARD:
            present[a.key] = a.weight
        else:
            del present[a.key]

    for j, a in enumerate(computes):
        nxt = computes[j + 1] if j + 1 < n else None
        is_fwd = a.kind is Kind.FORWARD
        if not is_fwd and a.key in away:
            load(j, a.key)
        count = sum(present.values()) + (a.weight if is_fwd else 0.0)
        if (nxt is not None and nxt.kind is Kind.BACKWARD and nxt.key in away
                and count + nxt.weight <= limit + _EPS):
            load(j, nxt.key)
            count += nxt.weight
        if count > limit + _EPS:
            raise ScheduleError(f"BPipe: rank {rank} cannot keep {a.label()} within {limit:g} chunk-micro-batches")
        if nxt is not None:
            after = count - (0.0 if is_fwd else a.weight)
            need = after
            if nxt.kind is Kind.FORWARD or nxt.key in away:
                need += nxt.weight
            after_next = computes[j + 2] if j + 2 < n else None
            early_load = (early and nxt.kind is Kind.FORWARD and after_next is not None
                          and after_next.kind is Kind.BACKWARD and after_next.key in away)
            if need <= limit + _EPS and not early_load:
                present_after(a)
                continue
            candidates = sorted((k for k in present if k != a.key and backward_at[k] > j + 1),
                                key=lambda k: -backward_at[k])
            victims = []
            for k in candidates:
                if need <= limit + _EPS:
                    break
                victims.append(k)
                need -= present[k]
            if need > limit + _EPS:
                raise ScheduleError(f"BPipe: rank {rank} cannot make room before {nxt.label()} "
                                    f"within {limit:g} chunk-micro-batches")
            if early_load:
                want = need + after_next.weight
                extra = []
                for k in candidates[len(victims):]:
                    if want <= limit + _EPS or backward_at[k] <= backward_at[after_next.key]:
                        break
                    extra.append(k)
                    want -= present[k]
                if want <= limit + _EPS:
                    victims += extra
            for k in victims:
                del present[k]
                away.add(k)
                plan[j].append(Action(Kind.EVICT, k[0], k[1], acceptor, k[2]))
        present_after(a)
    return plan
