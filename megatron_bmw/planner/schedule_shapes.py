"""What a search works out once for every layout it solves (ScheduleShapes): per schedule, the micro-batches each
pipeline rank holds at its peaks (pipeline/holding.py's rule: one count per rank for 1F1B and GPipe, every mix
of chunks for interleaving, whole and held-for-W counts for split backwards; BPipe's bound on a transferring
pair) and a zero-bubble schedule's credit in its estimate; and the memo tables layouts share: unit times, saved
bytes, min-max partitions and knapsack choices.
"""

from __future__ import annotations

from ..pipeline.bpipe import mu_opt
from ..pipeline.generators import CHUNKS, compute_schedule, generate, interleaved_1f1b
from ..pipeline.holding import holding_events
from ..pipeline.replay import replay
from ..pipeline.zb_search import HANDCRAFTED
from ..pipeline.schedule import Kind
from .partitioners import minmax_partition
from .space import Layout, zero_bubble


class ScheduleShapes:
    """What a search computes once and every layout reuses: per (pp, m, v, schedule, bpipe) what each rank holds
    at its peaks; unit times per (device, link, degrees, choice); saved bytes."""

    def __init__(self) -> None:
        self._cache: dict[tuple, list[list[list[float]]]] = {}
        self._credit: dict[tuple, float] = {}
        self.unit_times: dict[tuple, tuple[float, float]] = {}
        self.saved_bytes: dict[tuple, float] = {}
        self.placements: dict[tuple, dict] = {}  # (tp, pp, dp, rank order) -> devices, links, capacity
        self._minmax: dict[tuple, list[int]] = {}
        self.knapsacks: dict[tuple, tuple | None] = {}  # LayoutProblem._choice_for
        self.v_memo: dict[tuple, object] = {}  # ZB-V's compiled schedules and equal-chunk bubbles (v_layout.py)

    def minmax(self, costs, stages: int) -> list[int]:
        """minmax_partition (exact), memoised: layouts of one placement share their unit times."""
        key = (stages, tuple(map(tuple, costs)) if isinstance(costs, tuple) else tuple(costs))
        if key not in self._minmax:
            self._minmax[key] = minmax_partition(costs, stages)
        return list(self._minmax[key])

    def minmax_memory(self, static: list[float], saved: list[float], counts: list[float]) -> list[int]:
        """The near-balanced memory split (minmax_partition, exact=False) of blocks holding `static` bytes and
        `saved` bytes per micro-batch, stage k holding counts[k] micro-batches; memoised."""
        key = (tuple(static), tuple(saved), tuple(counts))
        if key not in self._minmax:
            rows = {c: [s + c * a for s, a in zip(static, saved)] for c in set(counts)}  # one list per count
            self._minmax[key] = minmax_partition([rows[c] for c in counts], len(counts), exact=False)
        return list(self._minmax[key])

    def counts(self, layout: Layout, bpipe: bool) -> list[list[list[float]]]:
        """Per rank, the per-chunk micro-batch counts it may hold at its peak: one vector for 1F1B and GPipe;
        for interleaving every mix it holds that no other mix holds chunk by chunk, since with unequal chunks
        the heaviest moment may hold fewer micro-batches of a heavier mix."""
        pp, m, v = layout.pp, layout.num_microbatches, layout.virtual_stages
        # on equal stages (what the counts and the credit assume) zb-1p/zb-2p stand for the handcrafted order of their
        # memory, one of their candidates, at no search per (p, m); the finalists simulate the searched order itself
        if zero_bubble(layout.schedule):  # per rank [held whole per chunk, held for W per chunk] at each peak
            key = (HANDCRAFTED.get(layout.schedule, layout.schedule), pp, min(m, 3 * pp))
            if key not in self._cache:
                self._cache[key] = split_peak_mixes(key[0], pp, key[2])
            return self._cache[key]
        if v == 1:  # the schedules' own peaks: GPipe holds all, 1F1B p - r
            plain = [[[float(m if layout.schedule == "gpipe" else min(pp - r, m))]] for r in range(pp)]
        else:
            key = (pp, min(m, 3 * pp), v)  # the mixes repeat beyond 3p micro-batches
            if key not in self._cache:
                self._cache[key] = interleaved_peak_mixes(pp, m, v)
            plain = self._cache[key]
        if not bpipe:
            return plain
        # BPipe holds both ranks of a transferring pair at mu_opt, mostly the evictor's chunks (the exact schedule
        # is checked for the finalists)
        limit = mu_opt(pp, v)
        out = []
        for r in range(pp):
            evictor = max((r, pp - 1 - r), key=lambda q: sum(plain[q][0]))
            total = sum(plain[evictor][0])
            out.append(plain[r] if total <= limit else [[c * limit / total for c in mix] for mix in plain[evictor]])
        return out


    def zero_bubble_credit(self, schedule: str, pp: int, m: int) -> float:
        """n in the zero-bubble estimate (LayoutProblem._pipeline_time): how many bubbles of min(f, b, w) the
        schedule's W's fill, from one replay with equal stages and f = b = w = 1; ZB-H1's is min(m, p) - 1. Beyond
        3p micro-batches the schedule repeats."""
        schedule = HANDCRAFTED.get(schedule, schedule)
        key = (schedule, pp, min(m, 3 * pp))
        if schedule == "zb-h1":  # closed form (tests check it against the replay)
            return float(min(m, pp) - 1)
        if key not in self._credit:
            self._credit[key] = replayed_credit(schedule, pp, key[2])
        return self._credit[key]


def bubble_fill(schedule: str, f: float, b: float, w: float, pp: int, m: int) -> float:
    """How much of each of the zero-bubble estimate's n bubbles the schedule's W's fill (stage means): min(F, B, W).
    ZB-2p's 2p micro-batches start forwards early enough that two W's fill one (Qi et al.'s (p-1)(F + B - 2W)), up
    to the B it waits for: min(B, 2W), reached at 2p - 1 micro-batches, linearly from m = p (on equal stages the
    replayed ZB-2p is never faster, and at most 3% slower; tests/planner/test_solver.py)."""
    low = min(f, b, w)
    if schedule != "zb-2p" or pp < 2:
        return low
    share = min(1.0, max(0.0, (m - pp) / (pp - 1)))
    return low + (max(low, min(b, 2 * w)) - low) * share


def replayed_credit(schedule: str, pp: int, m: int) -> float:
    """ScheduleShapes.zero_bubble_credit by replaying the schedule."""
    span = replay(generate(schedule, pp, m), lambda r, a: 2.0 if a.kind is Kind.BACKWARD else 1.0,
                  record=False).makespan
    return 2 * pp + 3 * (m - 1) + 1 - span


def split_peak_mixes(schedule: str, p: int, m: int) -> list[list[list[float]]]:
    """Per rank of a schedule with split backwards, the counts held whole per chunk, then held for W per chunk
    ([whole, for W] with one chunk per rank; ZB-V: [whole 0, whole 1, for W 0, for W 1]) after each change
    (pipeline/holding.py's rule), without those another holds slot by slot."""
    v = CHUNKS.get(schedule, 1)
    sched = compute_schedule(schedule, p, m, v)
    out = []
    for rank in range(p):
        per = [0.0] * (2 * v)
        mixes = set()
        for h in holding_events(sched.actions[rank], rank):
            per[h.chunk + (v if h.wgrad else 0)] += h.share
            mixes.add(tuple(per))
        kept: list[tuple] = []
        for mix in sorted(mixes, key=lambda x: (-sum(x), x)):
            if not any(all(a >= b for a, b in zip(other, mix)) for other in kept):
                kept.append(mix)
        out.append([list(mix) for mix in kept])
    return out


def interleaved_peak_mixes(p: int, m: int, v: int) -> list[list[list[float]]]:
    """Per rank, the per-chunk counts it holds after each forward starts (pipeline/holding.py's rule), without
    those another mix holds chunk by chunk: whatever the chunks' sizes, the heaviest moment is one of them.
    After warm-up the pattern repeats every p micro-batches, so a schedule of 3p of them has every mix a longer
    one has."""
    short = m if m <= 3 * p else 3 * p
    sched = interleaved_1f1b(p, short, v)
    out = []
    for rank in range(p):
        per, mixes = [0.0] * v, set()
        for h in holding_events(sched.actions[rank], rank):
            per[h.chunk] += h.share
            if h.share > 0:
                mixes.add(tuple(per))
        ranked = sorted(mixes, key=lambda x: (-sum(x), x))
        kept: list[tuple] = []  # a mix another holds chunk by chunk is never the heaviest
        for mix in ranked:
            if not any(all(a >= b for a, b in zip(other, mix)) for other in kept):
                kept.append(mix)
        out.append([list(mix) for mix in kept])
    return out
