"""Which saved activations a rank holds, and when: the one rule behind the checker's activation limit, BPipe's
placement, the memory model's peaks and the simulator's memory over time.

The activation store's accounting: a FORWARD's key counts from its start, a BACKWARD's until its end; a split
backward's input-gradient B frees it at its end except what its weight-gradient W needs (the deferred linear
layers' inputs and output gradients, parallel/deferred_wgrad.py), which counts from B's end to W's end (holds
marked `wgrad`, sized by the second table of `bytes_size`; in chunk-micro-batches it is the same one); an
EVICTed or RETURNed key still counts during the next compute (its send overlaps it) and is gone at that
compute's end (at the rank's last action when no compute follows); a LOADed or ACCEPTed key counts from the
LOAD/ACCEPT on (its buffer exists from then). A half of a sliced micro-batch counts 0.5.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from .schedule import Action, Kind, Schedule

_F, _B, _BI, _W = Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT


class Hold(NamedTuple):
    """A change of what a rank holds: at the start (or `at_end`) of its `index`-th action, `share`
    chunk-micro-batches (negative: released) of `owner`'s chunk `chunk`. `compute`: from the rank's own
    FORWARD/BACKWARD, which also hold the chunk's output (never moved by BPipe). `wgrad`: only what the chunk's
    deferred weight gradients keep (between a B and its W)."""

    index: int
    at_end: bool
    owner: int
    chunk: int
    share: float
    compute: bool
    wgrad: bool = False


def holding_events(actions: list[Action], rank: int) -> list[Hold]:
    """The holds of one rank's action list, in the order they happen."""
    out: list[Hold] = []
    leaving: list[tuple[int, int, float]] = []  # (owner, chunk, share) sent away, gone after the next compute
    for i, a in enumerate(actions):
        kind = a.kind
        if kind is _F or kind is _B or kind is _BI or kind is _W:
            if kind is _F:
                out.append(Hold(i, False, rank, a.chunk, a.weight, True))
            elif kind is _B:
                out.append(Hold(i, True, rank, a.chunk, -a.weight, True))
            elif kind is _BI:  # all but what W needs is freed at B's end
                out.append(Hold(i, True, rank, a.chunk, -a.weight, True))
                out.append(Hold(i, True, rank, a.chunk, a.weight, True, True))
            else:
                out.append(Hold(i, True, rank, a.chunk, -a.weight, True, True))
            for owner, chunk, share in leaving:
                out.append(Hold(i, True, owner, chunk, -share, False))
            leaving.clear()
        elif kind is Kind.LOAD:
            out.append(Hold(i, False, rank, a.chunk, a.weight, False))
        elif kind is Kind.ACCEPT:
            out.append(Hold(i, False, a.peer, a.chunk, a.weight, False))
        elif kind is Kind.EVICT:
            leaving.append((rank, a.chunk, a.weight))
        elif kind is Kind.RETURN:
            leaving.append((a.peer, a.chunk, a.weight))
    for owner, chunk, share in leaving:
        out.append(Hold(len(actions) - 1, True, owner, chunk, -share, False))
    return out


def peak(holds: list[Hold], size: Callable[[Hold], float] | None = None) -> float:
    """Most held at once: the largest running sum of size(hold) (default: the share, in chunk-micro-batches)."""
    level = top = 0.0
    for h in holds:
        level += h.share if size is None else size(h)
        if level > top:
            top = level
    return top


def resident_peaks(schedule: Schedule) -> list[float]:
    """Per rank, the most chunk-micro-batches of saved activations held at once, BPipe transfers included."""
    return [peak(holding_events(acts, rank)) for rank, acts in enumerate(schedule.actions)]


def held_during(actions: list[Action], rank: int) -> list[float]:
    """Chunk-micro-batches held while each action runs (after the holds at its start)."""
    holds = holding_events(actions, rank)
    out, level, j = [], 0.0, 0
    for i in range(len(actions)):
        while j < len(holds) and holds[j].index == i and not holds[j].at_end:
            level += holds[j].share
            j += 1
        out.append(level)
        while j < len(holds) and holds[j].index == i:
            level += holds[j].share
            j += 1
    return out


def bytes_size(saved: Callable[[int], list[float]],
               wgrad: Callable[[int], list[float]] | None = None) -> Callable[[Hold], float]:
    """size() for `peak` in bytes: `saved(owner)[chunk]` per chunk-micro-batch, and for a `wgrad` hold
    `wgrad(owner)[chunk]` (what a chunk keeps from its B to its W; default: all it saved, as if B freed nothing)."""
    cache: dict[tuple[int, bool], list[float]] = {}

    def size(h: Hold) -> float:
        w = h.wgrad and wgrad is not None
        own = cache.get((h.owner, w))
        if own is None:
            own = cache[(h.owner, w)] = (wgrad if w else saved)(h.owner)
        return h.share * own[h.chunk]

    return size


def peak_inflight(schedule: Schedule) -> list[float]:
    """Per rank, the most chunk-micro-batches its own computes keep (BPipe transfers left out)."""
    return [peak(holding_events([a for a in acts if a.is_compute], rank))
            for rank, acts in enumerate(schedule.actions)]
