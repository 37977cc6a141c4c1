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
from megatron_bmw.planner.option_knapsack import choose_grouped, choose_options
from megatron_bmw.planner.profile_data import Profiles
from megatron_bmw.planner.schedule_shapes import ScheduleShapes, interleaved_peak_mixes, split_peak_mixes
from megatron_bmw.planner.solver import LayoutProblem, Variant, could_fit
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


def _problem(memory_gb, tp=1, pp=2, dp=1, mbs=2, m=4, schedule="1f1b", v=1, shapes=None, variant=Variant()):
    cluster = parse_cluster({
        "name": "t", "inter_node": {"bandwidth_GBps": 1e6, "latency_us": 0},
        "device_types": {"d": {"memory_gb": memory_gb, "peak_tflops": {"fp32": 0.05}}},
        "groups": [{"nodes": 1, "gpus_per_node": 4, "device": "d",
                    "intra_node": {"bandwidth_GBps": 1e6, "latency_us": 0}}]})
    model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=64,
                        hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused")
    return LayoutProblem(Layout(tp, pp, dp, mbs, m, schedule, v), variant, model, cluster, Profiles(), SearchSpace(),
                         CostSettings(), MemorySettings(), shapes or ScheduleShapes())


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
                                                  ("interleaved", 2, 0.0033), ("zb-h1", 1, 0.006)])
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


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zero_bubble_mixes_give_the_walks_byte_peak(p):
    """ZB-H1: whatever a micro-batch keeps whole and for its W, the heaviest moment is one of the [whole, for W]
    mixes the solver takes from the schedule (also beyond the 3p micro-batches they are taken from)."""
    import random

    from megatron_bmw.pipeline.generators import generate
    from megatron_bmw.pipeline.holding import bytes_size, peak

    rng = random.Random(p)
    for m in (1, p, 2 * p, 6 * p):
        sched, mixes = generate("zb-h1", p, m), split_peak_mixes("zb-h1", p, min(m, 3 * p))
        for r in range(p):
            whole, wgrad = rng.uniform(1.0, 4.0), rng.uniform(0.5, 6.0)
            exact = peak(holding_events(sched.actions[r], r), bytes_size(lambda o: [whole], lambda o: [wgrad]))
            assert max(a * whole + b * wgrad for a, b in mixes[r]) == pytest.approx(exact)


@pytest.mark.parametrize("p,m", [(2, 2), (2, 6), (4, 4), (4, 12), (4, 2), (3, 2)])
def test_zero_bubble_estimate_on_equal_stages(p, m):
    """The zero-bubble variant of AMP's formula against the simulated ZB-H1 on equal stages, for splits of the
    backward into B and W either way: exact for m >= p (Qi et al.'s bubble (p - 1)(F + B - W) where W <= F, B);
    for m < p the estimate replays the short schedule."""
    from megatron_bmw.pipeline.generators import generate
    from megatron_bmw.pipeline.schedule import Kind
    from megatron_bmw.planner.simulator import simulate

    prob = _problem(1.0, pp=p, m=m, schedule="zb-h1")
    from megatron_bmw.planner.schedule_shapes import replayed_credit

    assert ScheduleShapes().zero_bubble_credit("zb-h1", p, m) == replayed_credit("zb-h1", p, m) == min(m, p) - 1
    for f, b, w in ((1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (0.8, 1.0, 1.2), (1.5, 0.5, 1.0), (0.5, 1.5, 0.3)):
        times = {Kind.FORWARD: f, Kind.BACKWARD_INPUT: b, Kind.BACKWARD_WEIGHT: w}
        sim = simulate(generate("zb-h1", p, m), lambda r, a: times[a.kind]).pipeline_time
        got = prob._pipeline_time([f] * p, [b + w] * p, [w] * p) - 2 * (p - 1) * prob.p2p
        if m >= p:
            assert got == pytest.approx(sim)
            if w <= min(f, b):
                assert sim == pytest.approx(m * (f + b + w) + (p - 1) * (f + b - w))
        else:
            assert got == pytest.approx(sim, rel=1e-6)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_searched_zero_bubble_estimate_is_admissible_on_equal_stages(p):
    """ZB-1p and ZB-2p (searched for the stage times): the estimate (zb_credit bubbles, each filled by
    bubble_fill) is never above the replayed schedule on equal stages for m >= p, and at most 3% below it."""
    from megatron_bmw.pipeline.zb_search import makespan, zb_search
    from megatron_bmw.planner.schedule_shapes import bubble_fill, replayed_credit

    for m in range(p, 3 * p + 1, max(1, p // 2)):
        for name in ("zb-1p", "zb-2p"):
            credit = ScheduleShapes().zero_bubble_credit(name, p, m)
            assert credit == replayed_credit(name, p, m) == min(m, p) - 1
            for f, b, w in ((1, 1, 1), (1, 1, 0.5), (1, 1.1, 0.7), (1, 2, 1), (1, 1, 0.2), (2, 1, 0.5)):
                times = [(f, b, w, 0.0)] * p
                real = makespan(zb_search(name, p, m, times), times)
                est = m * (f + b + w) + (p - 1) * (f + b) - credit * bubble_fill(name, f, b, w, p, m)
                assert real * (1 - 1e-9) <= est <= real * 1.03, (name, m, (f, b, w))


def test_searched_zero_bubble_memory_counts_respect_the_limit():
    """The solver's [whole, for W] mixes of ZB-1p and ZB-2p (from the equal-stage order) hold at most p and 2p."""
    for p in (2, 4, 8):
        for name, limit in (("zb-1p", p), ("zb-2p", 2 * p)):
            mixes = split_peak_mixes(name, p, 3 * p)
            assert max(sum(mix) for rank in mixes for mix in rank) == limit


def test_zero_bubble_solution_memory_is_the_walks():
    """The solver's memory for ZB-H1 (counts from the schedule, what W needs per unit) is the exact memory
    model's, and more than 1F1B's on the last rank (it holds micro-batches awaiting their W)."""
    from megatron_bmw.planner.evaluate import estimate_memory

    zb, base = _problem(1.0, pp=2, m=4, schedule="zb-h1"), _problem(1.0, pp=2, m=4)
    for part in ((5, 5), (3, 7), (7, 3)):
        sol = zb.evaluate(part)
        exact = estimate_memory(sol.spec(zb.model))
        assert sol.memory == pytest.approx([x.peak_bytes for x in exact], rel=1e-12)
        assert sol.memory[1] > base.evaluate(part).memory[1]


def test_layouts_sharing_their_memo_tables_solve_as_alone():
    """ScheduleShapes shares min-max starts and knapsacks between the layouts of a search: solving many layouts
    on one gives every layout the solution it gets on its own."""
    shapes = {g: ScheduleShapes() for g in (0.0033, 0.0036, 0.005)}  # one per cluster, as in a search
    cases = [dict(memory_gb=g, pp=pp, dp=dp, m=m, mbs=mbs, schedule=sch, v=v, variant=Variant(zero1=z))
             for g in shapes for pp, dp, m, mbs in ((2, 1, 4, 2), (2, 1, 8, 1), (4, 1, 4, 2), (2, 2, 4, 2))
             for sch, v in (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)) if not (v == 2 and pp == 4)
             for z in {False, dp > 1}]  # ZeRO-1 leaves the units' options alone and changes the room
    together = [_fields(_problem(shapes=shapes[c["memory_gb"]], **c).solve()) for c in cases]
    assert sum(x is not None for x in together) >= 3 and any(x is None for x in together)
    assert any(x is not None and x[1] is not None for x in together), "some must recompute"
    assert together == [_fields(_problem(**c).solve()) for c in cases]


@pytest.mark.parametrize("schedule,v,part,layers", [("1f1b", 1, (5, 5), [[2], [2]]), ("1f1b", 1, (3, 7), [[1], [3]]),
                                                     ("interleaved", 2, (3, 2, 2, 3), [[1, 1], [1, 1]])])
def test_whole_layer_checkpoints_of_other_engines_match_the_memory_model(schedule, v, part, layers):
    """Under Megatron-core, full recomputation keeps one input per layer (the attention unit's) and the MLP's
    backward holds the rebuilt layer: the solver's memory of a uniform full, layer-bounded problem is the memory
    model's, and below ours."""
    from megatron_bmw.planner.engine import EngineConfig
    from megatron_bmw.planner.evaluate import estimate_memory

    cluster = parse_cluster({
        "name": "t", "inter_node": {"bandwidth_GBps": 1e6, "latency_us": 0},
        "device_types": {"d": {"memory_gb": 1.0, "peak_tflops": {"fp32": 0.05}}},
        "groups": [{"nodes": 1, "gpus_per_node": 4, "device": "d",
                    "intra_node": {"bandwidth_GBps": 1e6, "latency_us": 0}}]})
    model = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=64,
                        hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused")
    space = SearchSpace().for_engine("megatron-core")
    got = {}
    for engine in ("megatron_bmw", "megatron-core"):
        memory = MemorySettings(engine=EngineConfig(engine))
        prob = LayoutProblem(Layout(1, 2, 1, 2, 4, schedule, v), Variant(), model, cluster, Profiles(), space,
                             CostSettings(), memory, ScheduleShapes(), uniform="full")
        sol = prob.evaluate(part)
        exact = estimate_memory(sol.spec(model), settings=memory)
        assert sol.memory == pytest.approx([x.peak_bytes for x in exact], rel=1e-12)
        got[engine] = exact
    hidden = 64 * 2 * 64 * 4  # one layer's input: s x b x h in fp32
    for ours, core, n in zip(got["megatron_bmw"], got["megatron-core"], layers):
        assert core.activation_bytes < ours.activation_bytes
        # one MLP input fewer per layer of the chunk
        assert [x - y for x, y in zip(ours.chunk_activation_bytes, core.chunk_activation_bytes)] == [
            hidden * k for k in n]
        assert core.transient_bytes > ours.transient_bytes  # the MLP's backward holds the whole rebuilt layer


@pytest.mark.parametrize("moe", [False, True])
def test_one_stage_solution_memory_holds_the_tied_output_gradient(moe):
    """One stage holds the embedding and the tied head: the output weight's gradient, held from the head's backward
    to the embedding's, is in the solver's memory as in the exact model's (it was missing: a finalist just under the
    capacity by the estimate failed the exact check, and with --top-k 1 the search found no plan)."""
    from dataclasses import replace

    from megatron_bmw.config import MoEConfig
    from megatron_bmw.planner.evaluate import estimate_memory
    from megatron_bmw.planner.memory_model import shared_output_grad_bytes
    from megatron_bmw.units import unit_names

    prob = _problem(1.0, pp=1, dp=4, mbs=2, m=1)
    if moe:
        model = replace(prob.model, moe=MoEConfig(num_experts=8, router_topk=2))
        prob = LayoutProblem(replace(prob.layout, ep=4, etp=1), Variant(), model, prob.cost.cluster, Profiles(),
                             SearchSpace(), CostSettings(), MemorySettings(), ScheduleShapes())
    sol = prob.evaluate((10,))
    exact = estimate_memory(sol.spec(prob.model))
    assert sol.memory == pytest.approx([x.peak_bytes for x in exact], rel=1e-12)
    assert shared_output_grad_bytes(prob.model, 1, 1, unit_names(4), MemorySettings().engine) == 256 * 64 * 4


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zbv_mixes_give_the_walks_byte_peak(p):
    """ZB-V: per rank [whole chunk 0, whole chunk 1, for W chunk 0, for W chunk 1] mixes; whatever each chunk
    keeps whole and for its W, the heaviest moment is one of them (also beyond the 3p micro-batches)."""
    import random

    from megatron_bmw.pipeline.generators import generate
    from megatron_bmw.pipeline.holding import bytes_size, peak

    rng = random.Random(p)
    for m in (1, p, 2 * p, 6 * p):
        sched, mixes = generate("zbv", p, m, 2), split_peak_mixes("zbv", p, min(m, 3 * p))
        for r in range(p):
            whole, wgrad = [rng.uniform(1.0, 4.0) for _ in range(2)], [rng.uniform(0.5, 6.0) for _ in range(2)]
            exact = peak(holding_events(sched.actions[r], r), bytes_size(lambda o: whole, lambda o: wgrad))
            assert max(sum(n * b for n, b in zip(mix, whole + wgrad)) for mix in mixes[r]) == pytest.approx(exact)
    assert max(sum(mix) for rank in split_peak_mixes("zbv", p, 3 * p) for mix in rank) == 2 * p  # p whole ones


def test_zbv_solution_memory_is_the_walks():
    """The solver's memory for ZB-V (rank r holds stages r and 2p-1-r: rank 0 the embedding's and the head's) is
    the exact memory model's on the built schedule, for partitions balanced or not."""
    from megatron_bmw.planner.evaluate import estimate_memory

    prob = _problem(1.0, pp=2, m=4, schedule="zbv", v=2)
    assert prob.where == [(0, 0), (1, 0), (1, 1), (0, 1)] and prob.rank_stages == [[0, 3], [1, 2]]
    for part in ((3, 2, 2, 3), (2, 3, 3, 2), (1, 4, 4, 1), (4, 1, 1, 4), (1, 1, 1, 7)):
        sol = prob.evaluate(part)
        exact = estimate_memory(sol.spec(prob.model))
        assert sol.memory == pytest.approx([x.peak_bytes for x in exact], rel=1e-12), part


@pytest.mark.parametrize("p,m", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (3, 12)])
def test_zbv_estimate_on_equal_chunks(p, m):
    """ZB-V's estimate against the simulated schedule on equal chunks: the replay itself up to 2p micro-batches;
    beyond, m x a rank's two chunks plus the equal-chunk bubble (its ratios rounded to 1/20): within 2%."""
    from megatron_bmw.pipeline.generators import generate
    from megatron_bmw.pipeline.schedule import Kind
    from megatron_bmw.planner.simulator import simulate

    prob = _problem(1.0, pp=p, m=m, schedule="zbv", v=2)
    for f, b, w in ((1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (1.5, 0.5, 1.0), (0.5, 1.5, 0.3), (1.0, 2.0, 1.0)):
        times = {Kind.FORWARD: f, Kind.BACKWARD_INPUT: b, Kind.BACKWARD_WEIGHT: w}
        sim = simulate(generate("zbv", p, m, 2), lambda r, a: times[a.kind]).pipeline_time
        got = prob._pipeline_time([f] * 2 * p, [b + w] * 2 * p, [w] * 2 * p)
        assert got == pytest.approx(sim, rel=1e-6 if m <= 2 * p else 0.02), (f, b, w)


def test_v_partitions_balance_each_ranks_two_chunks():
    """v_fold then v_balance against every split into 2p stages (the least largest per-rank sum, rank r holding
    stages r and 2p-1-r): as good within the smallest unit, and a heavy last unit (the head) leaves rank 0 less."""
    import itertools

    from megatron_bmw.planner.v_layout import v_balance, v_fold

    p = 3
    for costs in ([0.2] + [1.0, 1.5] * 5 + [4.0], [1.0] * 12, [0.1] + [1.0, 2.0] * 5 + [6.0]):
        n = len(costs)

        def worst(part):
            cuts = [0, *itertools.accumulate(part)]
            loads = [sum(costs[cuts[k]:cuts[k + 1]]) for k in range(2 * p)]
            return max(loads[r] + loads[2 * p - 1 - r] for r in range(p))

        best = min(worst(tuple(b - a for a, b in zip((0,) + c, c + (n,))))
                   for c in itertools.combinations(range(1, n), 2 * p - 1))
        got = v_balance(costs, v_fold(costs, p), p)
        assert len(got) == 2 * p and sum(got) == n and min(got) >= 1
        assert worst(got) <= best + min(costs) + 1e-12, (costs, got)
        if costs[-1] > 2:
            assert got[0] + got[-1] < min(got[r] + got[2 * p - 1 - r] for r in range(1, p)), got
