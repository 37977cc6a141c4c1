"""ZB-V in the search: two chunks per rank in a V (virtual stage s on rank s for s < p, on rank 2p - 1 - s
otherwise; pipeline/schedule.py placement "v"), so a rank's work is the sum of its two chunks.

- stage_places: per virtual stage its (rank, chunk); per rank its stages in chunk order (any placement).
- v_fold: ranks from the outside in, each taking units at both ends up to a bound; bisection on the bound.
- v_balance: from a 2p-stage partition, move boundaries next to the heaviest rank's chunks to where the two
  ranks they part balance best, until no move lowers the heavier of the two (min-max over per-rank sums).
- v_pipeline_time: up to 2p micro-batches (the ramp is most of it) the V replayed on the chunks' times; beyond,
  m x the busiest rank's F + B + W plus the bubble of ZB-V replayed on equal chunks with the layout's mean F, B,
  W and transfer (memoised by their ratios, rounded): exact on equal chunks; the finalists are simulated
  exactly.
"""

from __future__ import annotations

import math
from itertools import accumulate

from ..pipeline.generators import generate
from ..pipeline.replay import compile_schedule, replay
from ..pipeline.schedule import Kind, stage_location

_ROUND = 20  # ratios of the bubble's memo key, in 1/_ROUND steps


def stage_places(pp: int, stages: int, placement: str) -> tuple[list[tuple[int, int]], list[list[int]]]:
    """Per virtual stage its (rank, chunk); per rank its virtual stages, chunk 0 first."""
    where = [stage_location(k, pp, placement) for k in range(stages)]
    per_rank: list[list[int]] = [[] for _ in range(pp)]
    for k, (r, _) in sorted(enumerate(where), key=lambda x: x[1][1]):
        per_rank[r].append(k)
    return where, per_rank


def _rank_loads(sizes, prefixes, ranks, pp) -> list[float]:
    loads, a = [0.0] * pp, 0
    for k, s in enumerate(sizes):
        loads[ranks[k]] += prefixes[k][a + s] - prefixes[k][a]
        a += s
    return loads


def v_balance(costs, start: list[int], pp: int, max_moves: int = 256) -> list[int]:
    """`start` (2p stages of the V) rebalanced per rank: costs is one list per unit (or one per stage). While the
    heaviest rank (lowest on ties) has a boundary with another rank's stage where moving it lowers the larger of
    the two ranks' loads below the heaviest, take the best such move. Deterministic; O(units) per move."""
    stages = len(start)
    rows = costs if costs and isinstance(costs[0], (list, tuple)) else [costs] * stages
    prefixes = {id(r): [0.0, *accumulate(r)] for r in rows}
    prefixes = [prefixes[id(r)] for r in rows]
    ranks = [stage_location(k, pp, "v")[0] for k in range(stages)]
    sizes = list(start)
    for _ in range(max_moves):
        loads = _rank_loads(sizes, prefixes, ranks, pp)
        top = max(loads)
        heavy = loads.index(top)
        best = None  # (pair's new max, boundary, new cut)
        cuts = [0, *accumulate(sizes)]
        for k in range(stages - 1):  # boundary between stage k and k + 1, at cuts[k + 1]
            pair = (ranks[k], ranks[k + 1])
            if heavy not in pair or pair[0] == pair[1]:
                continue
            lo, hi = cuts[k] + 1, cuts[k + 2] - 1  # both stages keep a unit
            base = [loads[ranks[k]] - (prefixes[k][cuts[k + 1]] - prefixes[k][cuts[k]]),
                    loads[ranks[k + 1]] - (prefixes[k + 1][cuts[k + 2]] - prefixes[k + 1][cuts[k + 1]])]
            for c in range(lo, hi + 1):
                if c == cuts[k + 1]:
                    continue
                worst = max(base[0] + prefixes[k][c] - prefixes[k][cuts[k]],
                            base[1] + prefixes[k + 1][cuts[k + 2]] - prefixes[k + 1][c])
                if worst < top and (best is None or worst < best[0]):
                    best = (worst, k, c)
        if best is None:
            break
        _, k, c = best
        moved = c - cuts[k + 1]
        sizes[k] += moved
        sizes[k + 1] -= moved
    return sizes


def v_bubble(memo: dict, pp: int, m: int, f: float, b: float, w: float, p2p: float) -> float:
    """What ZB-V's span on equal chunks (F f, B b, W w, transfers p2p) adds to m x 2(f + b + w), from one replay
    per rounded ratio (memo: ScheduleShapes'); beyond 3p micro-batches it no longer changes."""
    scale = f + b + w
    if scale <= 0:
        return 0.0
    short = min(m, 3 * pp)
    key = ("zbv", pp, short, *(round(x / scale * _ROUND) for x in (f, b, p2p)))
    if key not in memo:
        sched_key = ("zbv-compiled", pp, short)
        if sched_key not in memo:
            memo[sched_key] = compile_schedule(generate("zbv", pp, short, 2))
        rf, rb, rc = (k / _ROUND for k in key[3:])
        rw = max(0.0, 1.0 - rf - rb)
        times = {Kind.FORWARD: rf, Kind.BACKWARD_INPUT: rb, Kind.BACKWARD_WEIGHT: rw}
        span = replay(memo[sched_key], lambda r, a: times[a.kind], lambda s, d, a: rc, record=False).makespan
        memo[key] = span - 2 * short * (rf + rb + rw)
    return memo[key] * scale


def v_pipeline_time(problem, fwd: list[float], bwd: list[float], wgt: list[float]) -> float:
    """ZB-V's estimate (LayoutProblem._pipeline_time): up to 2p micro-batches the V replayed on the stage times;
    beyond, m x the busiest rank's two chunks (F + B, B holding W) plus the equal-chunk bubble at the stages'
    mean F, B, W scaled to the largest chunk (unequal chunks stretch the ramp)."""
    lay = problem.layout
    if lay.num_microbatches <= 2 * lay.pp:  # a short V's ramp is most of it: replayed on the chunks' times
        key = ("zbv-compiled", lay.pp, lay.num_microbatches)
        if key not in problem.shapes.v_memo:
            problem.shapes.v_memo[key] = compile_schedule(generate("zbv", lay.pp, lay.num_microbatches, 2))
        kinds = {Kind.FORWARD: fwd, Kind.BACKWARD_WEIGHT: wgt}
        inputs, stage = [b - w for b, w in zip(bwd, wgt)], problem.rank_stages
        return replay(problem.shapes.v_memo[key], lambda r, a: kinds.get(a.kind, inputs)[stage[r][a.chunk]],
                      lambda s, d, a: problem.p2p, record=False).makespan
    work = max(sum(fwd[k] + bwd[k] for k in stages) for stages in problem.rank_stages)
    n = len(fwd)
    skew = max(f + b for f, b in zip(fwd, bwd)) * n / max(sum(fwd) + sum(bwd), 1e-30)  # the largest chunk's share
    f, w = sum(fwd) / n * skew, sum(wgt) / n * skew
    b = sum(bwd) / n * skew - w
    return lay.num_microbatches * work + v_bubble(problem.shapes.v_memo, lay.pp, lay.num_microbatches, f, b, w,
                                                  problem.p2p)


def _fold(rows, pp: int, bound: float) -> list[int] | None:
    """2p stage sizes with every rank's load <= bound, or None: ranks from the outside in (rank r holds the
    units left at both ends), each taking one unit at either end and then, while one fits, the next end unit
    of its lighter chunk (else of the other), two units left for every inner rank; rank p - 1 holds the middle, split where its chunks balance."""
    n, stages = len(rows[0]), 2 * pp
    left, right, front, back = 0, n, [], []
    for r in range(pp - 1):
        lrow, rrow = rows[r], rows[stages - 1 - r]
        if right - left < 2 * (pp - r):
            return None
        a, b, loads = left + 1, right - 1, [lrow[left], rrow[right - 1]]
        while b - a > 2 * (pp - 1 - r):
            sides = sorted(((loads[0], lrow[a], 0), (loads[1], rrow[b - 1], 1)))  # the lighter chunk first
            side = next((x[2] for x in sides if sum(loads) + x[1] <= bound), None)
            if side is None:
                break
            loads[side] += lrow[a] if side == 0 else rrow[b - 1]
            a, b = (a + 1, b) if side == 0 else (a, b - 1)
        if sum(loads) > bound:
            return None
        front.append(a - left)
        back.append(right - b)
        left, right = a, b
    first, second = rows[pp - 1][left:right], rows[pp][left:right]
    splits = [(sum(first[:c]), sum(second[c:])) for c in range(1, right - left)]
    if not splits or min(x + y for x, y in splits) > bound:
        return None
    c = min(range(len(splits)), key=lambda k: (max(splits[k]) if sum(splits[k]) <= bound else math.inf, k))
    return front + [c + 1, right - left - c - 1] + back[::-1]


def v_fold(costs, pp: int, steps: int = 20) -> list[int]:
    """A 2p-stage V partition whose largest per-rank load is the least _fold reaches (bisection on the bound)."""
    rows = costs if costs and isinstance(costs[0], (list, tuple)) else [costs] * (2 * pp)
    lo, hi = 0.0, sum(max(row[i] for row in rows) for i in range(len(rows[0])))
    best = _fold(rows, pp, hi)
    for _ in range(steps):
        mid = (lo + hi) / 2
        got = _fold(rows, pp, mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
        if hi - lo <= 1e-4 * hi:  # a hundredth of a percent of the load
            break
    return best


def v_starts(shapes, pp: int, time, memories: list[tuple]) -> list[list[int]]:
    """Per-rank balanced V partitions (v_fold, then v_balance) of the solver's costs: `time` per block (or per
    stage a list), each memory (static, saved, count per stage) holding static + count x saved bytes per block;
    memoised in the shapes' v_memo."""
    out = []
    for cost in [time, *memories]:
        if cost is not time:
            static, saved, counts = cost
            rows = {c: [s + c * a for s, a in zip(static, saved)] for c in set(counts)}
            cost = [rows[c] for c in counts]
        key = ("v", pp, tuple(map(tuple, cost)) if isinstance(cost[0], (list, tuple)) else tuple(cost))
        if key not in shapes.v_memo:
            shapes.v_memo[key] = v_balance(cost, v_fold(cost, pp), pp)
        out.append(list(shapes.v_memo[key]))
    return out
