"""Pipeline partitioners: exact min-max (AutoPipe) and AMP splits, AutoPipe's refinement, a local search and
Galvatron's bi-objective partition walk (its recomputation knapsack is option_knapsack.py's).

A model is a list of units; a partition is a list of positive ints (units per stage, contiguous, in order).
Costs are plain non-negative numbers (seconds or bytes) from the caller; inf means "never fits there".
Stage k's load is the sum of its units' costs on stage k, plus edge[c] when the stage ends at cut c.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from heapq import heappop, heappush
from itertools import accumulate
from operator import index, sub

import numpy as np

from megatron_bmw.errors import UsageError

__all__ = ["minmax_partition", "amp_partition", "autopipe_refine", "hill_climb", "galvatron_walk"]

_INF = math.inf


# ---------------------------------------------------------------------------------------------------------
# Shared helpers


def _numbers(values, what: str) -> list[float]:
    out = [float(x) for x in values]
    if not all(x >= 0 for x in out):  # also catches nan
        bad = next(x for x in out if not x >= 0)
        raise UsageError(f"{what} must be non-negative numbers, got {bad}")
    return out


def _prepare(costs, stages, edge):
    """Validate; per stage: prefix sums of the finite costs and, per cut b, the last unit < b that costs inf."""
    try:
        stages = index(stages)
    except TypeError:
        raise UsageError(f"stages must be an int, got {stages!r}") from None
    per_stage = len(costs) > 0 and isinstance(costs[0], (list, tuple))
    if per_stage:
        if len(costs) != stages:
            raise UsageError(f"per-stage costs need one list per stage: got {len(costs)} lists for {stages} stages")
        rows = costs
        n = len(rows[0])
        if any(len(r) != n for r in rows):
            raise UsageError("per-stage cost lists must all have one cost per unit")
    else:
        rows = [costs]
        n = len(costs)
    if stages < 1 or stages > n:
        raise UsageError(f"cannot split {n} units into {stages} non-empty stages")
    if edge is None:
        E = [0.0] * (n + 1)
    else:
        if len(edge) != n + 1:
            raise UsageError(f"edge needs one cost per cut position (n_units + 1 = {n + 1}), got {len(edge)}")
        E = _numbers(edge, "edge costs")
    prefixes, lastinf, done = [], [], {}
    for row in rows:
        if id(row) not in done:  # one list given for several stages is prepared once
            vals = _numbers(row, "unit costs")
            prefix = [0.0, *accumulate(0.0 if v == _INF else v for v in vals)]
            last, li = -1, [-1]
            if _INF in vals:
                for u, v in enumerate(vals):
                    if v == _INF:
                        last = u
                    li.append(last)
            else:
                li *= n + 1
            done[id(row)] = (prefix, li)
        prefix, li = done[id(row)]
        prefixes.append(prefix)
        lastinf.append(li)
    if not per_stage:
        prefixes *= stages
        lastinf *= stages
    return n, prefixes, lastinf, E


def _loads(sizes, P, L, E) -> list[float]:
    """Stage loads of a partition, with the exact arithmetic the DPs use."""
    out, a = [], 0
    for k, s in enumerate(sizes):
        b = a + s
        out.append(_INF if L[k][b] >= a else (P[k][b] + E[b]) - P[k][a])
        a = b
    return out


def _check_partition(part, n: int | None = None) -> tuple[int, ...]:
    part = tuple(part)
    if not part or any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in part):
        raise UsageError(f"a partition is a non-empty list of positive ints, got {list(part)}")
    if n is not None and sum(part) != n:
        raise UsageError(f"partition {list(part)} covers {sum(part)} units, expected {n}")
    return part


def _cuts_to_sizes(cuts: list[int]) -> list[int]:
    return [b - a for a, b in zip(cuts, cuts[1:])]


# ---------------------------------------------------------------------------------------------------------
# 1. Min-max partition (AutoPipe's Algorithm 1)


def _minmax_table(n, p, P, L, E) -> list[list[float]]:
    """T[k][b]: the smallest possible max load of units [0, b) on stages 0..k, stage k ending at cut b (inf when
    every such split has a unit that costs inf). One vectorised minimum per stage over the (a, b) pairs, the
    same float operations as the scalar recurrence min_a max(T[k-1][a], P_k[b] + E[b] - P_k[a])."""
    P0, L0 = P[0], L[0]
    row = [_INF] * (n + 1)
    for b in range(1, n - p + 2):
        if L0[b] < 0:
            row[b] = (P0[b] + E[b]) - P0[0]
    T = [row]
    cut = np.arange(n + 1)[:, None]
    edge = np.array(E, dtype=float)
    block = max(1, _TABLE_BLOCK // (n + 1))  # cuts b per vectorised block
    for k in range(1, p):
        Pk = np.array(P[k], dtype=float)
        last_inf = np.array(L[k], dtype=np.int64)
        prev = np.array(T[k - 1])[:, None]
        all_ends = np.arange(k + 1, n - p + k + 2) if k < p - 1 else np.array([n])
        row = [_INF] * (n + 1)
        for s in range(0, len(all_ends), block):
            ends = all_ends[s:s + block]
            first = np.maximum(last_inf[ends] + 1, k)  # stage k holds units [a, b) with a >= first
            worst = np.maximum(prev, (Pk[ends] + edge[ends])[None, :] - Pk[:, None])
            worst[(cut < first[None, :]) | (cut >= ends[None, :])] = _INF
            row[ends[0]:ends[-1] + 1] = worst.min(axis=0).tolist()  # ends are consecutive cuts
        T.append(row)
    return T


_TABLE_BLOCK = 1 << 20  # (a, b) pairs per vectorised block of _minmax_table


def _minmax_backtrack(n, p, P, L, E, T, bound) -> list[int]:
    """A partition with every stage load <= bound, whose later stages are as long as possible."""
    cuts = [n]
    b = n
    for k in range(p - 1, 0, -1):
        Pk, prev = P[k], T[k - 1]
        c = Pk[b] + E[b]
        for a in range(k if bound == _INF else max(k, L[k][b] + 1), b):
            if prev[a] <= bound and c - Pk[a] <= bound:
                break
        else:  # unreachable: T[k][b] <= bound is attained by some a
            raise AssertionError("min-max backtrack found no cut")
        cuts.append(a)
        b = a
    cuts.append(0)
    return _cuts_to_sizes(cuts[::-1])


def minmax_partition(costs, stages: int, edge=None, exact: bool = True) -> list[int]:
    """Contiguous split of the units into exactly `stages` non-empty stages minimising the largest stage load.

    `costs` is one cost per unit, or one such list per stage (costs[k][u]: unit u's cost on stage k);
    `edge[c]` (n_units + 1 values) is charged to the stage ending at cut c. Exact DP, O(n^2 p) in C-level loops.
    Ties go to the optimum whose later stages are longest (sizes read from the last stage backwards are
    lexicographically largest), which leaves the early, activation-heavy 1F1B stages the fewest units.
    Large problems without edges bisect on the bound with a greedy check instead: exact with one cost per unit;
    with per-stage costs only when `exact` is False (then a near-balanced split, as a starting point).
    """
    n, P, L, E = _prepare(costs, stages, edge)
    flat = not (len(costs) > 0 and isinstance(costs[0], (list, tuple)))
    if (flat or not exact) and edge is None and n * stages > _LARGE:
        return _minmax_bisect(n, stages, P, L)
    T = _minmax_table(n, stages, P, L, E)
    return _minmax_backtrack(n, stages, P, L, E, T, T[-1][n])


_LARGE = 4000  # units x stages above which min-max bisects on the bound instead of running the DP


def _greedy_from_back(n, stages, P, L, bound) -> list[int] | None:
    """Sizes with every load <= bound, each stage from the last one taking as many units as fit (the latest
    stages longest); None if the units do not fit. With the same costs on every stage, taking more units later
    never hurts the earlier stages (and a stage left empty can be split off a longer one), so this is feasible
    whenever any partition is; with per-stage costs it is not an exact check."""
    sizes, b = [], n
    for k in range(stages - 1, -1, -1):
        Pk, last_inf = P[k], L[k][b]
        a = b - 1  # leave one unit for each earlier stage (a >= k)
        if a < k or last_inf >= a or Pk[b] - Pk[a] > bound:
            return None
        a = _first_fit(Pk, Pk[b], bound, max(k, last_inf + 1), a, False)
        sizes.append(b - a)
        b = a
    if b != 0:
        return None
    return sizes[::-1]


def _minmax_bisect(n, stages, P, L) -> list[int]:
    """Min-max for large problems with one cost per unit: bisection on the bound (to a relative 1e-12) with the
    greedy check."""
    rows = list({id(Pk): Pk for Pk in P}.values())
    diffs = np.diff(np.array(rows, dtype=float), axis=1)
    lo = float(diffs.min(axis=0).max())
    hi = max(Pk[n] for Pk in rows)
    best = _greedy_from_back(n, stages, P, L, hi)
    if best is None:
        return [1] * (stages - 1) + [n - stages + 1]  # every partition has a stage that cannot fit
    while hi - lo > 1e-12 * max(hi, 1e-300):
        mid = (lo + hi) / 2
        got = _greedy_from_back(n, stages, P, L, mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


# ---------------------------------------------------------------------------------------------------------
# 2. AMP's objective: (gas - 1) * max_k T_k + sum_k T_k


def _first_fit(Pk, c, x, lo, hi, strict) -> int:
    """Smallest a in [lo, hi) whose load c - Pk[a] is < x (strict) or <= x; hi if none (loads fall with a)."""
    a = bisect_left(Pk, c - x, lo, hi) if x != _INF else lo
    if strict:
        while a > lo and c - Pk[a - 1] < x:
            a -= 1
        while a < hi and not c - Pk[a] < x:
            a += 1
    else:
        while a > lo and c - Pk[a - 1] <= x:
            a -= 1
        while a < hi and not c - Pk[a] <= x:
            a += 1
    return a


def _minsum(n, p, P, L, E, x, strict) -> list[int] | None:
    """The partition minimising the sum of stage loads with every load < x (strict) or <= x; None if none."""
    P0, L0 = P[0], L[0]
    D = [_INF] * (n + 1)
    for b in range(1, n - p + 2):
        c = P0[b] + E[b]
        if L0[b] < 0 and _first_fit(P0, c, x, 0, 1, strict) == 0:
            D[b] = c - P0[0]
    H = [None]  # H[k][a] = D_{k-1}[a] - P_k[a]: stage k ending at b costs (P_k[b] + E[b]) + min H[k][a..b-1]
    for k in range(1, p):
        Pk, Lk = P[k], L[k]
        h = list(map(sub, D, Pk))
        H.append(h)
        D = [_INF] * (n + 1)
        for b in range(k + 1, n - p + k + 2) if k < p - 1 else (n,):
            c = Pk[b] + E[b]
            a = _first_fit(Pk, c, x, max(k, Lk[b] + 1), b, strict)
            if a < b:
                D[b] = c + min(h[a:b])
    if D[n] == _INF:
        return None
    cuts = [n]
    b = n
    for k in range(p - 1, 0, -1):
        Pk = P[k]
        a = _first_fit(Pk, Pk[b] + E[b], x, max(k, L[k][b] + 1), b, strict)
        h = H[k]
        b = h.index(min(h[a:b]), a, b)
        cuts.append(b)
    cuts.append(0)
    return _cuts_to_sizes(cuts[::-1])


def amp_partition(costs, stages: int, gas: int, edge=None) -> list[int]:
    """Contiguous split into `stages` stages minimising AMP's pipeline time (gas - 1) * max_k T_k + sum_k T_k.

    Costs and edges as in minmax_partition; `gas` is the number of micro-batches per iteration. Exact: branch
    and bound over the limit M on the max load, each probe a min-sum DP under that limit (see _minsum); a
    handful of probes when gas is large, more when the trade between max and sum is close. Deterministic.
    """
    if not isinstance(gas, (int, float)) or isinstance(gas, bool) or not gas >= 1:
        raise UsageError(f"gas (micro-batches per iteration) must be >= 1, got {gas!r}")
    n, P, L, E = _prepare(costs, stages, edge)
    p, g = stages, float(gas - 1)
    T = _minmax_table(n, p, P, L, E)
    mstar = T[-1][n]
    best_part = _minmax_backtrack(n, p, P, L, E, T, mstar)
    if mstar == _INF:  # every split has a stage that cannot fit: nothing to trade
        return best_part

    def probe(x, strict):
        nonlocal best, best_part
        part = _minsum(n, p, P, L, E, x, strict)
        if part is None:
            return None
        loads = _loads(part, P, L, E)
        m, s = max(loads), sum(loads)
        if g * m + s < best:
            best, best_part = g * m + s, part
        return m, s

    loads = _loads(best_part, P, L, E)
    best = g * max(loads) + sum(loads)
    probe(mstar, False)  # the least sum at the least max: seeds `best`
    m0, s0 = probe(_INF, False)
    if g == 0:  # the unconstrained min sum is optimal
        return best_part
    # minsum(M), the least sum with every load <= M, falls as M grows; a probe at x returning max m and sum s
    # settles every M in [m, x]. A region is an open interval (lo, hi) of M where minsum >= s_hi; only
    # M < (best - s_hi) / g can still improve, and none can when g * lo + s_hi >= best. Probes alternate
    # between just below the region's top (walks down the staircase: fast when g is large) and its middle.
    regions = [(g * mstar + s0, mstar, m0, s0, False)]  # (lower bound, lo, hi, s_hi, probe the middle?)
    while regions:
        bound, lo, hi, s_hi, middle = heappop(regions)
        top = min(hi, (best - s_hi) / g)
        if top <= lo or bound >= best:
            continue
        if middle:
            y = (lo + top) / 2
            found = probe(y, False)
            if found is None:  # cannot happen (y > lo >= mstar); kept for float safety
                continue
            if found[0] > lo:
                heappush(regions, (g * lo + found[1], lo, found[0], found[1], False))
            heappush(regions, (g * y + s_hi, y, hi, s_hi, False))
        else:
            found = probe(top, True)
            if found is not None and found[0] > lo:
                heappush(regions, (g * lo + found[1], lo, found[0], found[1], True))
    return best_part


# ---------------------------------------------------------------------------------------------------------
# 3. AutoPipe's heuristic partitioner


def autopipe_refine(start, evaluate, costs, max_evals: int = 64) -> tuple[list[int], float]:
    """AutoPipe's heuristic: from `start`, rebalance after the master stage and shift its boundary units earlier.

    `evaluate(partition) -> (iteration_time, master_stage, fwd, bwd)` (per-stage times of one micro-batch);
    `costs` are per-unit forward+backward times for the DP re-balances. Breadth-first over candidates whose
    master stage does not move later; at most `max_evals` evaluations (cached). Returns the best seen.
    """
    costs = list(costs)
    n = len(costs)
    part = _check_partition(start, n)
    p = len(part)
    if max_evals < 1:
        raise UsageError(f"max_evals must be >= 1, got {max_evals}")
    cache: dict[tuple[int, ...], tuple[float, int, list[float], list[float]]] = {}
    best = [part, _INF]

    def ev(cand):
        cand = tuple(cand)
        if cand in cache:
            return cache[cand]
        if len(cache) >= max_evals:
            return None
        t, i, f, b = evaluate(list(cand))
        i = index(i)
        if not 0 <= i < p or len(f) != p or len(b) != p:
            raise UsageError(f"evaluate() must return (time, master stage in 0..{p - 1}, {p} fwd, {p} bwd)")
        cache[cand] = res = (float(t), i, list(f), list(b))
        if res[0] < best[1]:
            best[:] = [cand, res[0]]
        return res

    ev(part)
    queue, queued = deque([part]), {part}
    while queue:
        part = queue.popleft()
        t, i, f, b = cache[part]
        cuts = [0, *accumulate(part)]
        # (1) a cool-down bubble after the master stage: re-split the stages after it evenly
        if i < p - 1 and _cooldown_bubble(i, f, b):
            cand = part[:i + 1] + tuple(minmax_partition(costs[cuts[i + 1]:], p - 1 - i))
            if cand != part:
                res = ev(cand)
                if res is None:
                    break
                if res[0] <= t:
                    part, (t, i, f, b) = cand, res
                    cuts = [0, *accumulate(part)]
        # (3) move the master stage's first unit back (re-balance 0..i-1) or its last unit on (re-balance 0..i)
        if i == 0 or part[i] < 2:
            continue
        cands = [tuple(minmax_partition(costs[:cuts[i] + 1], i)) + (part[i] - 1,) + part[i + 1:]]
        if i < p - 1:
            cands.append(tuple(minmax_partition(costs[:cuts[i + 1] - 1], i + 1)) + (part[i + 1] + 1,)
                         + part[i + 2:])
        for cand in cands:
            res = ev(cand)
            if res is None:
                queue.clear()
                break
            if res[1] <= i and cand not in queued:
                queued.add(cand)
                queue.append(cand)
    return list(best[0]), best[1]


def _cooldown_bubble(i, f, b) -> bool:
    """True when some s > i has sum_{j=i+1..s} (f_j + b_j) > (s - i) * b_i."""
    acc = 0.0
    for s in range(i + 1, len(f)):
        acc += f[s] + b[s]
        if acc > (s - i) * b[i]:
            return True
    return False


# ---------------------------------------------------------------------------------------------------------
# 4. Local search


def _moves(cur: tuple[int, ...], far: bool):
    """Partitions one unit away from `cur`: a stage gives its first or last unit to a neighbour, or with `far`
    to any stage (the cuts between shift by one)."""
    p = len(cur)
    for src in range(p):
        if cur[src] < 2:
            continue
        for dst in range(p):
            if dst == src or (not far and abs(dst - src) != 1):
                continue
            nb = list(cur)
            nb[src] -= 1
            nb[dst] += 1
            yield tuple(nb)


def hill_climb(start, evaluate, max_evals: int = 200, far: bool | None = None) -> tuple[list[int], float]:
    """Steepest descent over single-unit moves; stops at a local optimum or after `max_evals` evaluations
    (cached). A move hands one unit to a neighbouring stage, or with `far` (default: when a round of all
    p(p-1) such moves fits in half the budget) to any stage, shifting the cuts between: that crosses
    the ridges where two cuts must move together. `evaluate(partition) -> float`. Returns (partition, value)."""
    cur = _check_partition(start)
    if max_evals < 1:
        raise UsageError(f"max_evals must be >= 1, got {max_evals}")
    p = len(cur)
    if far is None:
        far = 2 * p * (p - 1) <= max_evals
    cache = {cur: float(evaluate(list(cur)))}
    while True:
        best, best_t, exhausted = None, cache[cur], False
        for nb in _moves(cur, far):
            if nb not in cache:
                if len(cache) >= max_evals:
                    exhausted = True
                    break
                cache[nb] = float(evaluate(list(nb)))
            if cache[nb] < best_t:
                best, best_t = nb, cache[nb]
        if best is None:
            return list(cur), cache[cur]
        cur = best
        if exhausted:
            return list(cur), cache[cur]


# ---------------------------------------------------------------------------------------------------------
# 5. Galvatron-BMW's bi-objective walk


def galvatron_walk(start, stage_time, stage_memory, budgets, time_balanced_peak: float,
                   max_steps: int = 64) -> list[list[int]]:
    """Walk from the memory-balanced `start` toward time balance by moving the slowest stage's boundary units.

    The slowest stage (each of them, in order, on ties) gives its first unit to the stage before it or its last
    unit to the stage after it; a move is accepted when no stage gets slower than that slowest, every stage
    fits budgets[k], and no stage's memory exceeds max(time_balanced_peak, start's peak). Breadth-first, at most `max_steps`
    expansions; returns the accepted partitions in the order found, `start` first.
    """
    part = _check_partition(start)
    p = len(part)
    if len(budgets) != p:
        raise UsageError(f"budgets needs one memory limit per stage ({p}), got {len(budgets)}")
    cache = {}

    def models(cand):
        if cand not in cache:
            t, m = list(stage_time(list(cand))), list(stage_memory(list(cand)))
            if len(t) != p or len(m) != p:
                raise UsageError(f"stage_time and stage_memory must return {p} values")
            cache[cand] = (t, m)
        return cache[cand]

    mem_cap = max(time_balanced_peak, max(models(part)[1]))
    found, seen, queue = [list(part)], {part}, deque([part])
    steps = 0
    while queue and steps < max_steps:
        head = queue.popleft()
        steps += 1
        times = models(head)[0]
        slow = max(times)
        moves = []
        for k in (k for k, x in enumerate(times) if x == slow and head[k] > 1):
            if k > 0:  # first unit of stage k to stage k - 1
                moves.append(head[:k - 1] + (head[k - 1] + 1, head[k] - 1) + head[k + 1:])
            if k < p - 1:  # last unit of stage k to stage k + 1
                moves.append(head[:k] + (head[k] - 1, head[k + 1] + 1) + head[k + 2:])
        for cand in moves:
            if cand in seen:
                continue
            t, m = models(cand)
            if max(t) <= slow and all(x <= lim for x, lim in zip(m, budgets)) and max(m) <= mem_cap:
                seen.add(cand)
                found.append(list(cand))
                queue.append(cand)
    return found
