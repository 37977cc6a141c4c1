"""Partitioners: exact against brute force over all compositions, heuristics against analytic models."""

import itertools
import math
import random

import pytest

from megatron_bmw.errors import UsageError
from megatron_bmw.planner.option_knapsack import choose_options
from megatron_bmw.planner.partitioners import (amp_partition, autopipe_refine, galvatron_walk, hill_climb,
                                               minmax_partition)


def _compositions(n, p):
    for cuts in itertools.combinations(range(1, n), p - 1):
        c = (0, *cuts, n)
        yield [c[k + 1] - c[k] for k in range(p)]


def _loads(part, costs, edge=None):
    """Stage loads summed directly (not through prefix sums)."""
    out, a = [], 0
    for k, s in enumerate(part):
        row = costs[k] if isinstance(costs[0], list) else costs
        out.append(sum(row[a:a + s]) + (edge[a + s] if edge else 0.0))
        a += s
    return out


def _amp_objective(part, costs, gas, edge=None):
    loads = _loads(part, costs, edge)
    return (gas - 1) * max(loads) + sum(loads)


def _valid(part, n, p):
    return len(part) == p and sum(part) == n and all(isinstance(s, int) and s >= 1 for s in part)


def _random_instance(rng, max_n=9, max_p=4):
    n = rng.randint(1, max_n)
    p = rng.randint(1, min(max_p, n))
    flat = [rng.choice([0.0, rng.random(), float(rng.randint(1, 4))]) for _ in range(n)]
    if rng.random() < 0.5:  # stage-dependent: devices of different speeds
        costs = [[c * rng.choice([1.0, 1.5, 2.0]) for c in flat] for _ in range(p)]
    else:
        costs = flat
    edge = [rng.random() for _ in range(n + 1)] if rng.random() < 0.5 else None
    return n, p, costs, edge


def _close(a, b):
    return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# minmax_partition


def test_minmax_matches_brute_force():
    rng = random.Random(0)
    for _ in range(600):
        n, p, costs, edge = _random_instance(rng)
        part = minmax_partition(costs, p, edge)
        assert _valid(part, n, p)
        best = min(max(_loads(c, costs, edge)) for c in _compositions(n, p))
        assert _close(max(_loads(part, costs, edge)), best), (costs, p, edge, part)


def test_minmax_ties_give_later_stages_more_units():
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(2, 9)
        p = rng.randint(1, min(4, n))
        costs = [float(rng.randint(0, 3)) for _ in range(n)]  # integers: sums are exact, ties are real
        best = min(max(_loads(c, costs)) for c in _compositions(n, p))
        optimal = [c for c in _compositions(n, p) if max(_loads(c, costs)) == best]
        assert minmax_partition(costs, p) == max(optimal, key=lambda c: c[::-1])


def test_minmax_simple_cases_and_edges():
    assert minmax_partition([1.0] * 8, 4) == [2, 2, 2, 2]
    assert minmax_partition([5.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2) == [1, 5]
    assert minmax_partition([3.0], 1) == [1]
    # an expensive cut after unit 1 moves the boundary
    edge = [0.0, 0.0, 10.0, 0.0, 0.0]
    assert minmax_partition([1.0, 1.0, 1.0, 1.0], 2, edge) in ([1, 3], [3, 1])
    # stage 1 twice as fast: it takes twice the units
    assert minmax_partition([[2.0] * 6, [1.0] * 6], 2) == [2, 4]


def test_minmax_avoids_units_that_cannot_fit():
    inf = math.inf
    costs = [[1.0, 1.0, inf, inf], [inf, 1.0, 1.0, 1.0]]  # units 2, 3 only fit on stage 1, unit 0 on stage 0
    assert minmax_partition(costs, 2) == [2, 2]
    assert amp_partition(costs, 2, 4) == [2, 2]
    # nothing fits: still a valid partition
    assert _valid(minmax_partition([[inf] * 3, [inf] * 3], 2), 3, 2)


@pytest.mark.parametrize("stages", [0, -1, 4])
def test_minmax_rejects_bad_stage_counts(stages):
    with pytest.raises(UsageError, match="stages"):
        minmax_partition([1.0, 2.0, 3.0], stages)


def test_bad_inputs_are_usage_errors():
    with pytest.raises(UsageError, match="edge"):
        minmax_partition([1.0, 2.0], 2, edge=[0.0, 0.0])
    with pytest.raises(UsageError, match="non-negative"):
        minmax_partition([1.0, float("nan")], 1)
    with pytest.raises(UsageError, match="non-negative"):
        amp_partition([1.0, -2.0], 1, 4)
    with pytest.raises(UsageError, match="one list per stage"):
        minmax_partition([[1.0, 2.0]], 2)
    with pytest.raises(UsageError, match="gas"):
        amp_partition([1.0, 2.0], 2, 0)


# ---------------------------------------------------------------------------------------------------------
# amp_partition


def test_amp_matches_brute_force():
    rng = random.Random(2)
    for _ in range(600):
        n, p, costs, edge = _random_instance(rng)
        gas = rng.choice([1, 2, 3, 5, 16, 64])
        part = amp_partition(costs, p, gas, edge)
        assert _valid(part, n, p)
        best = min(_amp_objective(c, costs, gas, edge) for c in _compositions(n, p))
        assert _close(_amp_objective(part, costs, gas, edge), best), (costs, p, gas, edge, part)


def _amp_reference(costs, p, gas, edge):
    """Exact by another route: a DP keeping every Pareto-optimal (max load, sum) pair per (cut, stages)."""
    n = len(costs[0]) if isinstance(costs[0], list) else len(costs)
    row = (lambda k: costs[k]) if isinstance(costs[0], list) else (lambda k: costs)
    front = {(0, 0): [(0.0, 0.0)]}
    for k in range(p):
        for b in range(k + 1, n - p + k + 2):
            pairs = sorted((max(mx, load), sm + load)
                           for a in range(k, b) if (a, k) in front
                           for load in [sum(row(k)[a:b]) + (edge[b] if edge else 0.0)]
                           for mx, sm in front[(a, k)])
            kept, least = [], math.inf
            for mx, sm in pairs:
                if sm < least:
                    kept.append((mx, sm))
                    least = sm
            front[(b, k + 1)] = kept
    return min((gas - 1) * mx + sm for mx, sm in front[(n, p)])


def test_amp_matches_pareto_dp_on_larger_cases():
    rng = random.Random(3)
    for _ in range(30):
        n, p = rng.randint(12, 22), rng.randint(2, 6)
        flat = [rng.uniform(0.5, 2.0) for _ in range(n)]
        costs = [[c * (1.0 if k % 2 else 1.6) for c in flat] for k in range(p)] if rng.random() < 0.7 else flat
        edge = [rng.uniform(0, 0.3) for _ in range(n + 1)] if rng.random() < 0.5 else None
        gas = rng.choice([2, 3, 4, 8, 32])
        part = amp_partition(costs, p, gas, edge)
        assert _valid(part, n, p)
        assert _close(_amp_objective(part, costs, gas, edge), _amp_reference(costs, p, gas, edge))


def test_amp_extremes():
    rng = random.Random(4)
    costs = [[rng.uniform(1, 2) * (1 if k < 2 else 3) for _ in range(12)] for k in range(4)]
    # one micro-batch: only the sum counts, so the fast stages take almost everything
    part = amp_partition(costs, 4, 1)
    assert _close(sum(_loads(part, costs)), min(sum(_loads(c, costs)) for c in _compositions(12, 4)))
    # many micro-batches: the max dominates, as in minmax_partition
    part = amp_partition(costs, 4, 10 ** 6)
    assert _close(max(_loads(part, costs)), max(_loads(minmax_partition(costs, 4), costs)))


# ---------------------------------------------------------------------------------------------------------
# autopipe_refine and hill_climb, on an analytic 1F1B model


def _one_f_one_b(unit_fwd, m, calls=None):
    """Iteration time sum_k (f_k + b_k) + (m - 1) max_k (f_k + b_k), b = 2 f; master: the heaviest, last on ties."""

    def evaluate(part):
        assert all(s >= 1 for s in part) and sum(part) == len(unit_fwd)
        if calls is not None:
            calls.append(list(part))
        f, a = [], 0
        for s in part:
            f.append(sum(unit_fwd[a:a + s]))
            a += s
        b = [2 * x for x in f]
        fb = [x + y for x, y in zip(f, b)]
        heaviest = max(fb)
        master = max(k for k, x in enumerate(fb) if x == heaviest)
        return sum(fb) + (m - 1) * heaviest, master, f, b

    return evaluate


def _random_units(rng, n_range, max_p):
    """(units, stages, per-unit forward times) of a random small case."""
    n = rng.randint(*n_range)
    p = rng.randint(2, min(max_p, n))
    return n, p, [float(rng.randint(1, 5)) for _ in range(n)]


def test_autopipe_never_worse_than_start_and_respects_budget():
    rng = random.Random(5)
    for _ in range(150):
        n, p, fwd = _random_units(rng, (3, 12), 5)
        calls = []
        evaluate = _one_f_one_b(fwd, rng.choice([1, 4, 8]), calls)
        start = rng.choice(list(_compositions(n, p)))
        max_evals = rng.choice([1, 3, 64])
        part, t = autopipe_refine(start, evaluate, [3 * x for x in fwd], max_evals=max_evals)
        assert _valid(part, n, p)
        assert t <= evaluate(start)[0] and t == evaluate(part)[0]
        calls = calls[:-2]  # the two checks above
        assert len(calls) <= max_evals and len({tuple(c) for c in calls}) == len(calls)  # cached


def test_autopipe_finds_the_best_partition_from_a_heavy_last_stage():
    rng = random.Random(6)
    for _ in range(12):
        n, p, fwd = _random_units(rng, (4, 9), 4)
        evaluate = _one_f_one_b(fwd, rng.choice([2, 4, 8]))
        start = [1] * (p - 1) + [n - p + 1]
        part, t = autopipe_refine(start, evaluate, [3 * x for x in fwd])
        assert t == min(evaluate(c)[0] for c in _compositions(n, p))
        assert autopipe_refine(start, evaluate, [3 * x for x in fwd]) == (part, t)  # deterministic


def test_autopipe_rebalances_a_cool_down_bubble_after_the_master():
    fwd = [1.0] * 9
    calls = []
    # loads 3, 12, 9, 3: master 1; stage 2 alone takes 9 > b_1 = 8, a cool-down bubble
    autopipe_refine([1, 4, 3, 1], _one_f_one_b(fwd, 4, calls), [3.0] * 9, max_evals=2)
    assert calls == [[1, 4, 3, 1], [1, 4, 2, 2]]


def test_hill_climb_reaches_a_local_optimum():
    rng = random.Random(7)
    for _ in range(60):
        n = rng.randint(3, 14)
        p = rng.randint(2, min(5, n))
        fwd = [rng.uniform(0.5, 3) for _ in range(n)]
        calls = []
        model = _one_f_one_b(fwd, rng.choice([1, 4, 8]), calls)
        start = rng.choice(list(_compositions(n, p)))
        part, t = hill_climb(start, lambda q: model(q)[0], max_evals=10 ** 4)
        assert _valid(part, n, p) and t <= model(start)[0] and t == model(part)[0]
        assert len({tuple(c) for c in calls[:-2]}) == len(calls) - 2  # cached
        for c in range(p - 1):
            for d in (1, -1):
                nb = list(part)
                nb[c] -= d
                nb[c + 1] += d
                if min(nb) >= 1:
                    assert model(nb)[0] >= t


def test_hill_climb_stops_after_max_evals():
    calls = []
    model = _one_f_one_b([1.0] * 30, 8, calls)
    part, t = hill_climb([27, 1, 1, 1], lambda q: model(q)[0], max_evals=5)
    assert len(calls) == 5 and t < model([27, 1, 1, 1])[0] and t == model(part)[0]


# ---------------------------------------------------------------------------------------------------------
# choose_options


def _brute_options(options, budget):
    best = None
    for choice in itertools.product(*[range(len(o)) for o in options]):
        picked = [options[u][j] for u, j in enumerate(choice)]
        peak = sum(o[1] for o in picked) + max((o[2] for o in picked), default=0.0)
        time = sum(o[0] for o in picked)
        if peak <= budget and (best is None or time < best[0]):
            best = (time, peak)
    return best


def test_choose_options_matches_brute_force():
    rng = random.Random(8)
    compared = 0
    for _ in range(1500):
        n = rng.randint(1, 6)
        resolution = rng.choice([16, 64, 512])
        options = [[(rng.uniform(0, 3), rng.choice([0.0, rng.uniform(0, 10)]), rng.choice([0.0, rng.uniform(0, 5)]))
                    for _ in range(rng.randint(1, 3))] for _ in range(n)]
        if rng.random() < 0.3:
            options = [options[0]] * n  # identical units
        budget = rng.uniform(1, 40)
        got = choose_options(options, budget, resolution)
        best = _brute_options(options, budget)
        if got is None:
            assert best is None or budget - best[1] < n * budget / resolution
            continue
        choice, time, peak = got
        picked = [options[u][j] for u, j in enumerate(choice)]
        assert len(choice) == n
        assert _close(time, sum(o[0] for o in picked))
        assert _close(peak, sum(o[1] for o in picked) + max(o[2] for o in picked)) and peak <= budget
        assert time >= best[0] - 1e-9
        if budget - best[1] >= n * budget / resolution:
            compared += 1
            assert _close(time, best[0])
    assert compared > 500


def test_choose_options_returns_none_when_nothing_fits():
    options = [[(1.0, 10.0, 0.0), (2.0, 4.0, 3.0)]] * 3
    assert choose_options(options, 14.0) is None  # the lightest choice needs 12 + 3
    assert choose_options(options, -1.0) is None
    assert choose_options([[(1.0, 0.0, 0.0)]], 0.0) == ([0], 1.0, 0.0)
    assert choose_options([], 5.0) == ([], 0.0, 0.0)


def test_choose_options_recomputes_where_memory_is_short():
    no_rc, full = (1.0, 10.0, 0.0), (1.3, 1.0, 9.0)
    options = [[no_rc, full]] * 4
    assert choose_options(options, 1e9) == ([0, 0, 0, 0], 4.0, 40.0)
    choice, time, peak = choose_options(options, 33.0)  # 2 x 10 + 2 x 1 + 9 = 31 fits, 3 x 10 + 1 + 9 does not
    assert sorted(choice) == [0, 0, 1, 1] and _close(time, 4.6) and peak == 31.0
    with pytest.raises(UsageError):
        choose_options([[]], 1.0)
    with pytest.raises(UsageError):
        choose_options(options, 1.0, resolution=0)


# ---------------------------------------------------------------------------------------------------------
# galvatron_walk


def test_galvatron_walk_keeps_its_three_conditions():
    rng = random.Random(9)
    grew = 0
    for _ in range(40):
        n = rng.randint(6, 16)
        p = rng.randint(2, min(5, n))
        unit_time = [rng.uniform(1, 3) for _ in range(n)]
        weights = [rng.uniform(1, 2) for _ in range(n)]
        acts = [rng.uniform(0.5, 1.5) for _ in range(n)]

        def stage_time(part):
            return _loads(part, unit_time)

        def stage_memory(part):  # 1F1B: stage k holds p - k micro-batches of activations
            return [w + (p - k) * a for k, (w, a) in enumerate(zip(_loads(part, weights), _loads(part, acts)))]

        start = minmax_partition([[weights[u] + (p - k) * acts[u] for u in range(n)] for k in range(p)], p)
        peak = max(stage_memory(minmax_partition(unit_time, p)))
        budgets = [max(stage_memory(start)) * rng.uniform(1.0, 1.4) for _ in range(p)]
        found = galvatron_walk(start, stage_time, stage_memory, budgets, peak)
        assert found[0] == start
        assert len({tuple(f) for f in found}) == len(found)
        cap = max(peak, max(stage_memory(start)))
        for j, part in enumerate(found):
            assert _valid(part, n, p)
            mem = stage_memory(part)
            if j:
                assert all(m <= b for m, b in zip(mem, budgets)) and max(mem) <= cap
                # it came from an earlier partition by moving one unit, and is no slower than that one was
                assert any(_one_move_apart(part, q) and max(stage_time(part)) <= max(stage_time(q))
                           for q in found[:j])
        grew += len(found) > 1
    assert grew >= 5


def _one_move_apart(a, b):
    diff = [k for k in range(len(a)) if a[k] != b[k]]
    return len(diff) == 2 and diff[1] == diff[0] + 1 and abs(a[diff[0]] - b[diff[0]]) == 1


def test_galvatron_walk_stops_after_max_steps():
    unit_time = [1.0] * 12

    def stage_time(part):
        return _loads(part, unit_time)

    found = galvatron_walk([9, 1, 1, 1], stage_time, stage_time, [100.0] * 4, 100.0, max_steps=1)
    assert found == [[9, 1, 1, 1], [8, 2, 1, 1]]
    found = galvatron_walk([9, 1, 1, 1], stage_time, stage_time, [100.0] * 4, 100.0)
    assert found[-1] == [3, 3, 3, 3]
    assert galvatron_walk([9, 1, 1, 1], stage_time, stage_time, [5.0] * 4, 100.0) == [[9, 1, 1, 1]]


def test_large_flat_minmax_bisects_to_the_dp_optimum(monkeypatch):
    import megatron_bmw.planner.partitioners as parts

    rng = random.Random(11)
    for n, stages in ((120, 40), (200, 64), (97, 97)):
        costs = [rng.choice([1.0, 2.0, rng.random() * 3]) for _ in range(n)]
        fast = minmax_partition(costs, stages)  # n x stages above the threshold: bisection
        monkeypatch.setattr(parts, "_LARGE", 10**9)
        exact = minmax_partition(costs, stages)
        monkeypatch.setattr(parts, "_LARGE", 4000)
        assert len(fast) == stages and sum(fast) == n and min(fast) >= 1
        n_, prefix, inf, edge = parts._prepare(costs, stages, None)
        assert max(parts._loads(fast, prefix, inf, edge)) == pytest.approx(max(parts._loads(exact, prefix, inf, edge)),
                                                                            rel=1e-9)


def test_minmax_table_in_blocks_gives_the_same_partitions(monkeypatch):
    """The vectorised DP cut into blocks of a few cuts (big problems) finds what one block finds, with units that
    cost inf among them."""
    import megatron_bmw.planner.partitioners as parts

    rng = random.Random(12)
    for _ in range(200):
        n, p, costs, edge = _random_instance(rng, max_n=12, max_p=5)
        if rng.random() < 0.3:
            flat = costs if not isinstance(costs[0], list) else costs[0]
            flat[rng.randrange(n)] = math.inf
        gas = rng.randint(1, 8)
        whole = (minmax_partition(costs, p, edge), amp_partition(costs, p, gas, edge))
        monkeypatch.setattr(parts, "_TABLE_BLOCK", 1)
        blocks = (minmax_partition(costs, p, edge), amp_partition(costs, p, gas, edge))
        monkeypatch.setattr(parts, "_TABLE_BLOCK", 1 << 20)
        assert blocks == whole, (costs, p, edge)
        best = min(max(_loads(c, costs, edge)) for c in _compositions(n, p))
        assert _close(max(_loads(whole[0], costs, edge)), best)
