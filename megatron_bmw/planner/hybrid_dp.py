"""Galvatron-BMW's per-layer dynamic program inside one pipeline stage.

Units u = 0..L-1 in order; each has options o = (strategy index s_o, time c_o, memory m_o, transient r_o).
Consecutive units with strategies p then s pay a re-layout R[p][s]; the first pays enter[s]. With memory in
buckets of budget / resolution (rounded to the nearest; the read-back checks the true bytes):

    C(u, s, e) = min over options o of unit u with s_o = s of  c_o + min over p of ( C(u-1, p, e - m_o) + R[p][s] )

C(u, s, e) is the least time of units 0..u ending in strategy s with forward memory (model states plus saved
activations) <= e. The backward peak (max r_o over the chosen options) is not additive; as Galvatron-BMW
decouples it, the table is solved once for the whole budget and plans are read back from the largest e
downwards until one whose true peak (memory + its largest transient) fits. O(L x |S|^2 x E) with numpy.
"""

from __future__ import annotations

import math

import numpy as np

_INF = math.inf


def stage_dp(options: list[list[tuple[int, float, float, float]]], relayout, enter, budget: float,
             resolution: int = 512, max_caps: int | None = 8):
    """Per unit an option index with the least total time (unit times + re-layouts) under `budget` bytes.

    options[u]: (strategy index, time, memory, transient); relayout[p][s]: seconds; enter[s]: seconds for the
    first unit. Returns (choice per unit, time, peak bytes) or None when nothing fits.

    First Galvatron-BMW's decoupling (one table, plans read back from the largest forward budget down). When
    the best plan of the whole budget does not fit with its backward peak, the table is also solved with the
    options whose transient is at most a cap, for up to `max_caps` caps (None: every distinct transient, which
    is exact up to the memory buckets), on the budget minus the cap; the fastest plan found wins."""
    n = len(options)
    if n == 0:
        return [], 0.0, 0.0
    if budget <= 0:
        return None
    got, first = _solve(options, relayout, enter, budget, resolution)
    if got is not None and first:
        return got
    caps = sorted({o[3] for opts in options for o in opts if o[3] < budget})
    if max_caps is not None and len(caps) > max_caps:
        step = (len(caps) - 1) / (max_caps - 1)
        caps = sorted({caps[round(k * step)] for k in range(max_caps)})
    best = got
    for cap in caps:
        keep = [[j for j, o in enumerate(opts) if o[3] <= cap] for opts in options]
        if not all(keep):
            continue
        sub = [[options[u][j] for j in ks] for u, ks in enumerate(keep)]
        q = budget / resolution  # the same buckets as the whole budget's table
        room = int((budget - cap) / q + 1e-9)
        if room < 1:
            continue
        found, _ = _solve(sub, relayout, enter, room * q, room, budget)
        if found is not None and (best is None or found[1] < best[1]):
            choice = [keep[u][j] for u, j in enumerate(found[0])]
            picked = [options[u][j] for u, j in enumerate(choice)]
            best = (choice, found[1], math.fsum(o[2] for o in picked) + max(o[3] for o in picked))
    return best


def _solve(options, relayout, enter, budget: float, resolution: int, limit: float | None = None):
    """The decoupled table over forward memory up to `budget` and its read-back of plans whose peak (forward
    memory + largest transient) is at most `limit` (default `budget`): (result or None, whether the whole
    budget's best plan fit)."""
    limit = budget if limit is None else limit
    n = len(options)
    n_s = len(enter)
    R = np.asarray(relayout, dtype=float).reshape(n_s, n_s)
    q = budget / resolution
    width = resolution + 1
    # nearest buckets: rounding errors cancel over many units; the read-back checks the true bytes
    weights = [[round(mem / q) if mem <= budget else width for _, _, mem, _ in opts] for opts in options]
    prev = None  # C(u-1, :, :)
    tables, args, picks = [], [], []
    for u, opts in enumerate(options):
        if prev is None:
            M = np.repeat(np.asarray(enter, dtype=float)[:, None], width, axis=1)
            A = np.zeros((n_s, width), dtype=np.int64)
        else:
            total = prev[:, None, :] + R[:, :, None]  # [p, s, e]
            A = np.argmin(total, axis=0)
            M = np.take_along_axis(total, A[None], axis=0)[0]
        cur = np.full((n_s, width), _INF)
        pick = np.full((n_s, width), -1, dtype=np.int64)
        for j, (s, c, _, _) in enumerate(opts):
            w = weights[u][j]
            if w > resolution:
                continue
            cand = np.full(width, _INF)
            cand[w:] = M[s, :width - w] + c
            better = cand < cur[s]
            cur[s] = np.where(better, cand, cur[s])
            pick[s] = np.where(better, j, pick[s])
        tables.append(cur)
        args.append(A)
        picks.append(pick)
        prev = cur
        if not np.isfinite(cur).any():
            return None, False
    last = tables[-1]
    best_per_e = last.min(axis=0)
    seen = set()
    top = True
    for e in range(resolution, -1, -1):
        if not math.isfinite(best_per_e[e]):
            break
        s = int(np.argmin(last[:, e]))
        choice = [0] * n
        ee = e
        for u in range(n - 1, -1, -1):
            j = int(picks[u][s, ee])
            choice[u] = j
            ee -= weights[u][j]
            if u > 0:
                s = int(args[u][options[u][j][0], ee])
        key = tuple(choice)
        if key in seen:
            continue
        seen.add(key)
        picked = [options[u][j] for u, j in enumerate(choice)]
        peak = math.fsum(o[2] for o in picked) + max(o[3] for o in picked)
        if peak <= limit:
            return (choice, float(best_per_e[e]), peak), top
        top = False
    return None, False


def exhaustive(options, relayout, enter, budget: float):
    """Every combination (tests: the DP's optimum on small cases)."""
    from itertools import product
    best = None
    for choice in product(*[range(len(o)) for o in options]):
        picked = [options[u][j] for u, j in enumerate(choice)]
        peak = sum(o[2] for o in picked) + max(o[3] for o in picked)
        if peak > budget:
            continue
        t = enter[picked[0][0]] + sum(o[1] for o in picked)
        t += sum(relayout[a[0]][b[0]] for a, b in zip(picked, picked[1:]))
        if best is None or t < best[1] - 1e-15:
            best = (list(choice), t, peak)
    return best
