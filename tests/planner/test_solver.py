"""The search's per-layout solver: its peak counts equal walking the schedules, its knapsack grouping is exact,
its estimate is exact for 1F1B on one device type without communication, and hopeless layouts are skipped."""


import pytest

from megatron_bmw.config import ModelConfig
from megatron_bmw.pipeline.build import build_schedule
from megatron_bmw.pipeline.generators import interleaved_1f1b
from megatron_bmw.pipeline.holding import holding_events, resident_peaks
from megatron_bmw.planner.cluster import parse_cluster
from megatron_bmw.planner.cost_model import CostSettings
from megatron_bmw.planner.memory_model import MemorySettings
from megatron_bmw.planner.partitioners import choose_options
from megatron_bmw.planner.profile_data import Profiles
from megatron_bmw.planner.solver import (LayoutProblem, ScheduleShapes, Variant, choose_grouped, could_fit,
                                         interleaved_peak_mixes)
from megatron_bmw.planner.space import Layout, SearchSpace
from megatron_bmw.config import PipelineConfig


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 3), (8, 2), (8, 4)])
def test_interleaved_mixes_give_the_walks_byte_peak(p, v):
    """Chunks of unequal size (up to 4x): the heaviest moment is one of the mixes (also for schedules longer
    than the 3p micro-batches the mixes are taken from)."""
    import random

    from megatron_bmw.pipeline.holding import peak

    rng = random.Random(p * 10 + v)
    for m in (p, 2 * p, 6 * p):
        sched, mixes = interleaved_1f1b(p, m, v), interleaved_peak_mixes(p, m, v)
        for r in range(p):
            size = [rng.uniform(1.0, 4.0) for _ in range(v)]
            exact = peak(holding_events(sched.actions[r], r), lambda h: h.share * size[h.chunk])
            assert max(sum(n * b for n, b in zip(mix, size)) for mix in mixes[r]) == pytest.approx(exact)


def test_bpipe_counts_stay_within_mu_opt():
    shapes = ScheduleShapes()
    for p, m in ((4, 8), (8, 16), (6, 12)):
        lay = Layout(1, p, 1, 1, m, "1f1b")
        counts = [mixes[0] for mixes in shapes.counts(lay, True)]
        exact = resident_peaks(build_schedule(PipelineConfig(1, m, bpipe=True), p))
        assert all(abs(sum(c) - e) <= 1.0 for c, e in zip(counts, exact)), (counts, exact)
        assert max(sum(c) for c in counts) <= max(exact) + 1e-9


def test_grouped_knapsack_equals_the_plain_one():
    options = [[(1.0, 10.0, 0.0), (1.5, 4.0, 6.0), (2.0, 1.0, 9.0)]] * 4 + [[(0.5, 3.0, 0.0), (0.8, 1.0, 2.0)]] * 3
    for budget in (20.0, 30.0, 40.0, 60.0):
        plain, grouped = choose_options(options, budget), choose_grouped(options, budget)
        assert (plain is None) == (grouped is None)
        if plain is not None:
            assert grouped[1] == pytest.approx(plain[1]) and grouped[2] <= budget


def _problem(memory_gb, tp=1, pp=2, dp=1, mbs=2, m=4, schedule="1f1b", v=1):
    cluster = parse_cluster({
        "name": "t", "inter_node": {"bandwidth_GBps": 1e6, "latency_us": 0},
        "device_types": {"d": {"memory_gb": memory_gb, "peak_tflops": {"fp32": 0.05}}},
        "groups": [{"nodes": 1, "gpus_per_node": 4, "device": "d",
                    "intra_node": {"bandwidth_GBps": 1e6, "latency_us": 0}}]})
    model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=64,
                        hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused")
    return LayoutProblem(Layout(tp, pp, dp, mbs, m, schedule, v), Variant(), model, cluster, Profiles(), SearchSpace(),
                         CostSettings(), MemorySettings(), ScheduleShapes())


def test_estimate_is_amps_formula_and_memory_is_checked():
    prob = _problem(1.0)
    sol = prob.evaluate((5, 5))
    fb = [f + b for f, b in zip(sol.stage_forward, sol.stage_backward)]
    assert sol.estimate == pytest.approx(sum(fb) + 3 * max(fb) + 2 * prob.p2p + prob.embedding_sync)
    assert sol.recompute is None and all(x <= c for x, c in zip(sol.memory, sol.capacity))
    assert prob.evaluate((9, 1)).estimate > sol.estimate
    tight = _problem(0.0016)
    got = tight.evaluate((5, 5))
    assert got is None or got.recompute is not None  # less memory: recomputation or nothing


def test_hopeless_layouts_are_skipped():
    assert could_fit(_problem(1.0), zero1=False)
    assert not could_fit(_problem(1e-5), zero1=False)


def _fields(sol):
    return None if sol is None else (sol.partition, sol.recompute, sol.estimate, sol.stage_forward,
                                     sol.stage_backward, sol.memory)


@pytest.mark.parametrize("schedule,v,memory_gb", [("1f1b", 1, 0.0036), ("1f1b", 1, 0.005),
                                                  ("interleaved", 2, 0.0033)])
def test_memoised_evaluate_equals_a_fresh_problem(schedule, v, memory_gb):
    """evaluate() reuses each rank's plan across partitions (the walk moves one boundary at a time): every
    partition, scored after many others on one problem, equals scoring it alone on a fresh problem."""
    from itertools import combinations

    def fresh():
        return _problem(memory_gb, schedule=schedule, v=v)

    shared = fresh()
    n, stages = len(shared.names), shared.stages
    parts = [tuple(b - a for a, b in zip((0,) + cuts, cuts + (n,)))
             for cuts in combinations(range(1, n), stages - 1)]
    got = [_fields(shared.evaluate(p)) for p in parts]
    assert any(g is not None and g[1] is not None for g in got), "the case must need recomputation somewhere"
    assert any(g is None for g in got) or any(g[1] is None for g in got), "and fit somewhere else"
    for part, mine in zip(parts, got):
        assert mine == _fields(fresh().evaluate(part)), part
