"""Galvatron's per-unit option knapsack (its decoupled memory DP): one option per unit (a recomputation choice:
time, saved memory, transient memory) with the least total time under a rank's memory. choose_grouped merges
identical units first (the solver's rank of attention and MLP units).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from megatron_bmw.errors import UsageError

from .partitioners import _numbers  # the partitioners' check of a caller's numbers

_INF = math.inf


def choose_options(options, budget: float, resolution: int = 512):
    """One option per unit minimising total time with sum(memory) + max(transient) <= budget.

    `options[u]` lists (time, memory, transient) triples. Memory is rounded up to buckets of budget/resolution,
    so a returned choice always fits. One DP over units per transient cap T (options with transient <= T, room
    budget - T), largest cap first; caps leaving the same room in buckets merge into the largest, and a cap
    is skipped when an earlier DP table already bounds it from below by the best time found. Returns
    (option index per unit, total time, peak memory), or None when nothing fits (at that resolution). Equal
    to the true optimum whenever that optimum leaves at least n_units * budget / resolution of slack.
    """
    if not isinstance(resolution, int) or resolution < 1:
        raise UsageError(f"resolution must be a positive int, got {resolution!r}")
    budget = float(budget)
    if budget != budget:
        raise UsageError("budget must be a number, got nan")
    units = []
    for u, opts in enumerate(options):
        if not opts:
            raise UsageError(f"unit {u} has no options")
        trip = []
        for o in opts:
            if len(o) != 3:
                raise UsageError(f"unit {u}: an option is (time, memory, transient), got {o!r}")
            trip.append(tuple(_numbers(o, f"unit {u}'s option values")))
        units.append(trip)
    n = len(units)

    if budget < 0:
        return None
    if n == 0:
        return [], 0.0, 0.0

    def result(choice):
        picked = [units[u][j] for u, j in enumerate(choice)]
        peak = math.fsum(o[1] for o in picked) + max((o[2] for o in picked), default=0.0)
        return list(choice), math.fsum(o[0] for o in picked), peak

    if budget == _INF or budget <= 0:  # no limit, or only zero-memory options fit
        choice = []
        for opts in units:
            ok = [j for j, o in enumerate(opts) if budget == _INF or (o[1] == 0 and o[2] == 0)]
            if not ok:
                return None
            choice.append(min(ok, key=lambda j, opts=opts: opts[j][0]))
        return result(choice)

    q = budget / resolution
    weights = []  # memory in buckets of q, rounded up so that a DP-feasible choice really fits
    for opts in units:
        ws = []
        for _, mem, _ in opts:
            w = math.ceil(mem / q) if mem <= budget else resolution + 1
            ws.append(w + 1 if w * q < mem else w)
        weights.append(ws)
    caps = {}  # room in buckets -> the largest transient cap leaving that room (same room, more options)
    for cap_t in sorted({o[2] for opts in units for o in opts if o[2] <= budget}):
        room = math.floor((budget - cap_t) / q)
        while room > 0 and room * q > budget - cap_t:
            room -= 1
        caps[min(room, resolution)] = cap_t
    best, best_value, bound = None, _INF, None
    # Larger caps first: their DP table (every room up to `resolution`) bounds the smaller caps from below.
    for room, cap_t in sorted(caps.items()):
        allowed = []
        for opts, ws in zip(units, weights):
            ok = [(j, o[0], ws[j]) for j, o in enumerate(opts) if o[2] <= cap_t and ws[j] <= resolution]
            if not ok:
                return best  # smaller caps allow even fewer options
            allowed.append(_undominated(ok))
        if best is not None and (sum(min(t for _, t, _ in ok) for ok in allowed) >= best_value
                                 or bound is not None and bound[room] >= best_value):
            continue
        table, hist = _knapsack(allowed, resolution)
        bound = table
        if table[room] < best_value:
            res = result(_backtrack(allowed, table, hist, room))
            if res[2] <= budget:
                best, best_value = res, float(table[room])
    return best


def _undominated(ok):
    """Drop options that are no faster and no lighter than another (keeping the first of equals)."""
    keep = []
    for j, t, w in ok:
        if not any(t2 <= t and w2 <= w for _, t2, w2 in keep):
            keep = [o for o in keep if not (t <= o[1] and w <= o[2])] + [(j, t, w)]
    return sorted(keep)


def _knapsack(allowed, size):
    """Multiple-choice knapsack: table[c] = least time for all units with total weight <= c, c = 0..size;
    also the table before each unit, for the backtrack. Each unit's options are one vectorised minimum over
    the shifted tables (the same float sums as a loop over c)."""
    width = size + 1
    pad = max(w for ok in allowed for _, _, w in ok)
    cols = np.arange(width)
    dp = np.zeros(width)
    hist = []
    for ok in allowed:
        hist.append(dp)
        shifted = np.concatenate((np.full(pad, _INF), dp))  # shifted[pad - w + c] = dp[c - w], inf for c < w
        if len(ok) == 1:
            _, t, w = ok[0]
            dp = shifted[pad - w:pad - w + width] + t
            continue
        ts = np.array([t for _, t, _ in ok])
        starts = np.array([pad - w for _, _, w in ok])
        dp = (shifted[starts[:, None] + cols] + ts[:, None]).min(axis=0)
    return dp, hist


def _backtrack(allowed, table, hist, room) -> list[int]:
    choice = []
    c, dp = room, table
    for ok, prev in zip(reversed(allowed), reversed(hist)):
        target = dp[c]
        for j, t, w in ok:
            if w <= c and prev[c - w] + t == target:
                choice.append(j)
                c -= w
                break
        dp = prev
    return choice[::-1]


def choose_grouped(options: list[list[tuple[float, float, float]]], room: float):
    """choose_options, with identical units (a rank's attention units, its MLP units) merged into one item whose
    choices are how many of them take each option (Pareto-pruned): the same optimum, a much smaller DP."""
    groups: dict[tuple, list[int]] = {}
    for u, opts in enumerate(options):
        groups.setdefault(tuple(opts), []).append(u)
    if all(len(units) == 1 for units in groups.values()):
        return choose_options(options, room)
    items, mixes = [], []
    for opts, units in groups.items():
        item, counts = _group_front(opts, len(units))
        items.append(item)
        mixes.append((units, counts))
    got = choose_options(items, room)
    if got is None:
        return None
    picked, total, peak = got
    choice = [0] * len(options)
    for (units, counts_list), k in zip(mixes, picked):
        it = iter(units)
        for j, n in enumerate(counts_list[k]):
            for _ in range(n):
                choice[next(it)] = j
    return choice, total, peak


@lru_cache(maxsize=1 << 16)
def _group_front(opts: tuple[tuple[float, float, float], ...], n: int) -> tuple[tuple, tuple]:
    """n identical units with options `opts` as one item: per undominated mix, its (time, memory, transient)
    and how many units take each option."""
    combos = []
    for counts in _compositions(n, len(opts)):
        used = [opts[j] for j, c in enumerate(counts) if c]
        combos.append((sum(c * o[0] for c, o in zip(counts, opts)), sum(c * o[1] for c, o in zip(counts, opts)),
                       max(o[2] for o in used), counts))
    front, best_time = [], _INF
    for c in sorted(combos, key=lambda x: (x[1], x[2], x[0])):  # least memory first
        if c[0] < best_time:
            front.append(c)
            best_time = c[0]
    return tuple((t, m, tr) for t, m, tr, _ in front), tuple(c[3] for c in front)  # cached: immutable


def _compositions(n: int, k: int):
    """Every way to write n as k non-negative counts."""
    if k == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in _compositions(n - first, k - 1):
            yield (first,) + rest
