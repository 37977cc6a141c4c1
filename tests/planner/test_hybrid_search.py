"""Galvatron-BMW's per-unit strategies in the planner: memory and cost per strategy, the per-stage DP against
exhaustive enumeration, hybrid against uniform, the --space restriction, plans with unit_strategies."""

import random
from dataclasses import replace

import pytest

from megatron_bmw.config import ModelConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.planner.cluster import Link, load_cluster
from megatron_bmw.planner.comm_cost import allgather_time, allreduce_time
from megatron_bmw.planner.cost_model import CostSettings
from megatron_bmw.planner.evaluate import simulate_run
from megatron_bmw.planner.hybrid_cost import StageCosts
from megatron_bmw.planner.hybrid_dp import exhaustive, stage_dp
from megatron_bmw.planner.hybrid_memory import unit_memory
from megatron_bmw.planner.hybrid_search import HybridProblem, hybrid_layouts, summarize
from megatron_bmw.planner.memory_model import MemorySettings
from megatron_bmw.planner.plan import Plan
from megatron_bmw.planner.search import search
from megatron_bmw.planner.schedule_shapes import ScheduleShapes
from megatron_bmw.planner.space import SearchSpace
from megatron_bmw.planner.unit_activations import unit_activation_bytes
from megatron_bmw.strategy import galvatron_space_size, parse_strategy, stage_strategies

MODEL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16, vocab_size=128,
                    max_position_embeddings=16)


def test_unit_memory_by_hand():
    # attention, tp 2: 2h LN + 3h*h/2 QKV + 3h/2 bias + h*h/2 proj + h bias = 128 + 6144 + 96 + 2048 + 64
    params = 8480
    plain = unit_memory("attention", MODEL, parse_strategy("tp2-dp2"), 1)
    assert plain.params == params
    assert plain.state_bytes == params * (4 + 4 + 8)  # fp32: param, fp32 grad, two Adam moments
    assert plain.saved_bytes == unit_activation_bytes("attention", MODEL, 2, 2)  # B/d = 1 x 4 / 2 samples
    sharded = unit_memory("attention", MODEL, parse_strategy("tp2-sdp2"), 1)
    assert sharded.state_bytes == params * 16 / 2
    assert sharded.saved_bytes == plain.saved_bytes
    # FSDP: the gathered half and the unsharded gradient, beside the shard
    assert sharded.transient_bytes == plain.transient_bytes + params / 2 * 4 + params * 4
    full = unit_memory("mlp", MODEL, parse_strategy("dp4"), 1, recompute="full")
    assert full.saved_bytes == 16 * 1 * 64 * 4  # the unit's input only, one sample per rank


def _stage(cluster="a100-80g-ib", width=4, mbs=1):
    return StageCosts(MODEL, load_cluster(cluster), None, CostSettings(), 1, width, mbs, 0)


def test_unit_cost_by_hand():
    sc = _stage()
    link = load_cluster("a100-80g-ib").groups[0].intra_node
    plain = parse_strategy("tp2-dp2")
    sharded = parse_strategy("tp2-sdp2")
    f, b = sc.unit_times("attention", plain)
    fs, bs = sc.unit_times("attention", sharded)
    gather = allgather_time(8480 * 4, 2, link)
    assert fs == pytest.approx(f + gather) and bs == pytest.approx(b + 2 * gather)
    assert sc.sync_time("attention", plain) == pytest.approx(allreduce_time(4.0 * 8480, 2, Link(link.bandwidth, 0)))
    # a stage's plain units of one dp grouping reduce in one bucket (one latency)
    both = sc.stage_sync_time([("attention", plain, True), ("mlp", plain, True), ("mlp", sharded, True)])
    mlp = sc.params("mlp", plain)
    assert both == pytest.approx(allreduce_time(4.0 * (8480 + mlp), 2, link))
    assert sc.sync_time("attention", sharded) == 0.0
    # compute at (t, B/d): tp2-dp2 works on 2 samples split 2 ways, dp4 on 1 sample whole: same FLOPs
    f1, _ = sc.cost_model(parse_strategy("dp4")).unit_times("attention", None, sc.device, 0)
    assert f1 > 0


def test_relayout_by_hand():
    sc = _stage()
    link = load_cluster("a100-80g-ib").groups[0].intra_node
    hidden = lambda samples: 16 * samples * 64 * 4  # noqa: E731
    tp2dp2, dp4, dp2tp2 = (parse_strategy(x) for x in ("tp2-dp2", "dp4", "dp2-tp2"))
    # tp2-dp2 -> dp4: every rank's one sample lies in its old two (a slice); backward gathers dp4's rows
    fwd, bwd = sc.relayout(tp2dp2, dp4)
    assert fwd == 0.0 and bwd == pytest.approx(allgather_time(4 * hidden(1), 4, link))
    fwd, bwd = sc.relayout(dp4, tp2dp2)
    assert fwd == pytest.approx(allgather_time(4 * hidden(1), 4, link)) and bwd == 0.0
    fwd, bwd = sc.relayout(tp2dp2, dp2tp2)  # rank order changes: rows move both ways
    assert fwd == pytest.approx(allgather_time(4 * hidden(2), 4, link)) and bwd == fwd
    assert sc.relayout(dp4, dp4) == (0.0, 0.0)


def _random_case(rng, units, strategies, choices):
    options = [[(s, rng.uniform(1, 10), float(rng.randint(1, 8)), 0.0) for s in range(strategies)
                for _ in range(choices)] for _ in range(units)]
    relayout = [[0.0 if p == s else rng.uniform(0, 3) for s in range(strategies)] for p in range(strategies)]
    enter = [rng.uniform(0, 2) for _ in range(strategies)]
    return options, relayout, enter


def test_dp_equals_exhaustive():
    rng = random.Random(0)
    for trial in range(30):
        options, relayout, enter = _random_case(rng, rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 2))
        budget = float(rng.randint(4, 30))
        want = exhaustive(options, relayout, enter, budget)
        got = stage_dp(options, relayout, enter, budget, resolution=int(budget))  # integer memory: exact
        if want is None:
            assert got is None
            continue
        assert got is not None and got[1] == pytest.approx(want[1]), trial
        assert got[2] <= budget


def test_dp_respects_transient_peak():
    # option 0 fast but its backward needs 6; budget 8 leaves room only with the slower option
    options = [[(0, 1.0, 2.0, 6.0), (0, 2.0, 2.0, 1.0)], [(0, 1.0, 2.0, 0.0)]]
    got = stage_dp(options, [[0.0]], [0.0], 8.0, resolution=8)
    assert got[0] == [1, 0] and got[2] <= 8.0
    assert stage_dp(options, [[0.0]], [0.0], 3.0, resolution=8) is None


def test_hybrid_beats_uniform_under_tight_memory_and_ties_when_ample():
    # two strategies: A fast and heavy, B slow and light; moving between them costs a little
    a, b = (0, 1.0, 5.0, 0.0), (1, 2.0, 1.0, 0.0)
    options = [[a, b] for _ in range(4)]
    relayout = [[0.0, 0.1], [0.1, 0.0]]
    uniform = lambda budget: min(  # noqa: E731
        (r for r in (stage_dp([[o[k]] for o in options], relayout, [0, 0], budget, 64) for k in (0, 1)) if r),
        key=lambda r: r[1], default=None)
    tight = 12.0  # uniform: all B (8 s); hybrid: two A, two B, one switch (6.1 s)
    hyb = stage_dp(options, relayout, [0, 0], tight, 48)
    assert hyb[1] == pytest.approx(6.1) and hyb[1] < uniform(tight)[1]
    ample = 40.0
    assert stage_dp(options, relayout, [0, 0], ample, 80)[1] == pytest.approx(uniform(ample)[1]) == 4.0


def test_galvatron_space_for_8_gpus():
    assert len(stage_strategies(8)) == 11
    assert galvatron_space_size(8) == 44
    model = replace(MODEL, num_layers=4, num_attention_heads=8, ffn_hidden_size=256, vocab_size=1024)
    cluster = load_cluster("a100-80g-ib")
    space = SearchSpace.parse(["recompute=none,full"])
    offered = set()
    for lay in hybrid_layouts(space, model, 8, 8):
        prob = HybridProblem(lay, model, cluster, None, space, CostSettings(), MemorySettings(), ScheduleShapes())
        offered |= {(lay.pp, str(s), c) for s in prob.strategies for c in prob.recompute}
    assert len(offered) == 44
    assert {pp for pp, _, _ in offered} == {1, 2, 4, 8}


def test_hybrid_problem_matches_simulation_and_round_trips(tmp_path):
    cluster = load_cluster("a100-80g-ib")
    model = replace(MODEL, num_layers=4)
    lay = [x for x in hybrid_layouts(SearchSpace(), model, 4, 8) if x.pp == 2 and x.micro_batch_size == 1][0]
    prob = HybridProblem(lay, model, cluster, None, SearchSpace(), CostSettings(), MemorySettings(), ScheduleShapes())
    sol = prob.solve()
    spec = sol.spec(model)
    assert spec.unit_strategies is not None and len(spec.unit_strategies) == model.num_units
    ev = simulate_run(spec, cluster)
    for r, m in enumerate(ev.memory):
        assert m.peak_bytes == pytest.approx(sol.memory[r], rel=1e-6)
    fwd = [sum(x) for x in ev.cost.chunk_forward]
    assert fwd == pytest.approx(sol.stage_forward)
    plan = Plan(spec=spec, global_batch_size=8)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    back = Plan.load(str(path))
    assert back.spec.unit_strategies == spec.unit_strategies
    assert summarize(spec.unit_strategies).startswith("emb ")


def test_space_restriction():
    assert SearchSpace().strategy == ("uniform",)
    assert SearchSpace.parse(["strategy=hybrid"]).strategy == ("hybrid",)
    assert SearchSpace.parse(["strategy=both"]).strategy == ("uniform", "hybrid")
    with pytest.raises(UsageError):
        SearchSpace.parse(["strategy=mixed"])
    cluster = load_cluster("a100-80g-ib")
    model = replace(MODEL, num_layers=4)
    fast = dict(space=SearchSpace.parse(["strategy=hybrid", "pp=1,2"]))
    hybrid = search(model, 100, 128, 8, cluster, **fast)
    assert hybrid.ranked and all(r.spec.unit_strategies for r in hybrid.ranked)
    for r in hybrid.ranked:  # a tied word embedding: one unsharded strategy for the embedding and the head
        first, last = r.spec.unit_strategies[0], r.spec.unit_strategies[-1]
        assert first == last and not parse_strategy(first).sharded
    from megatron_bmw.planner.profile_data import Profiles
    from megatron_bmw.planner.report import plan_from, search_table
    plan = plan_from(hybrid.best, hybrid, Profiles(), 100)  # the runtime pads 100 by 128 x dp (tp 1) alike
    multiple = plan.make_vocab_size_divisible_by
    assert multiple == 128 * hybrid.best.spec.dp
    assert plan.spec.model.vocab_size == -(-100 // multiple) * multiple
    assert " hyb " in search_table(hybrid)
    uniform = search(model, 128, 128, 8, cluster, space=SearchSpace.parse(["pp=1,2"]))
    assert uniform.ranked and not any(r.spec.unit_strategies for r in uniform.ranked)
    both = search(model, 128, 128, 8, cluster, space=SearchSpace.parse(["strategy=both", "pp=1,2"]))
    assert both.best.time <= min(hybrid.best.time, uniform.best.time) * (1 + 1e-9)


def test_dp_with_transients_equals_exhaustive():
    rng = random.Random(1)
    for trial in range(100):
        options, relayout, enter = _random_case(rng, rng.randint(1, 4), rng.randint(1, 3), 2)
        options = [[(s, t, m, float(rng.randint(0, 5))) for s, t, m, _ in opts] for opts in options]
        budget = float(rng.randint(4, 30))
        want = exhaustive(options, relayout, enter, budget)
        got = stage_dp(options, relayout, enter, budget, resolution=int(budget), max_caps=None)
        assert (got is None) == (want is None), trial
        if want is not None:
            assert got[1] == pytest.approx(want[1]) and got[2] <= budget, trial


@pytest.mark.parametrize("cluster", ["a100-80g-ib", "local"])
def test_uniform_strategies_simulate_as_the_uniform_layout(cluster):
    """Every unit on tp2-dp2 (micro-batch 1 x 4 ranks, 2 samples per rank) is Megatron's tp 2, dp 2, micro-batch
    2: the same time and memory (core sharing included on the local cluster)."""
    from megatron_bmw.config import PipelineConfig
    from megatron_bmw.planner.spec import RunSpec
    c = load_cluster(cluster, 2 if cluster == "local" else None)
    model = replace(MODEL, num_layers=2)
    ms = MemorySettings(device="cpu")
    for pp, part in ((1, (6,)), (2, (3, 3))):
        n = 4 // pp
        uniform = RunSpec.of(model=model, tp=2, pp=pp, dp=n // 2, overlap_grad_reduce=n > 2,
                          pipeline=PipelineConfig(micro_batch_size=2, num_microbatches=8 // n, partition=part))
        hybrid = RunSpec.of(model=model, tp=1, pp=pp, dp=n, overlap_grad_reduce=True,
                         unit_strategies=("tp2-dp2" if n == 4 else "tp2",) * model.num_units,
                         pipeline=PipelineConfig(micro_batch_size=1, num_microbatches=8 // n, partition=part))
        a, b = simulate_run(uniform, c, memory_settings=ms), simulate_run(hybrid, c, memory_settings=ms)
        assert b.simulation.iteration_time == pytest.approx(a.simulation.iteration_time)
        assert [m.peak_bytes for m in b.memory] == pytest.approx([m.peak_bytes for m in a.memory])


def test_hybrid_plans_gpt_only():
    bert = replace(MODEL, model_type="bert")
    with pytest.raises(UsageError, match="GPT"):
        search(bert, 128, 128, 8, load_cluster("a100-80g-ib"), space=SearchSpace.parse(["strategy=hybrid"]))


def test_stage_dp_on_model_rows_equals_exhaustive():
    """The DP on a real stage (a 1-layer GPT on 4 ranks: embedding, attention, MLP, head; every strategy and
    recomputation the cost and memory models give) finds what enumerating every combination finds."""
    model = replace(MODEL, num_layers=1, untie_embeddings_and_output_weights=True)
    lay = [x for x in hybrid_layouts(SearchSpace(), model, 4, 8) if x.pp == 1 and x.micro_batch_size == 1][0]
    prob = HybridProblem(lay, model, load_cluster("a100-80g-ib"), None, SearchSpace(), CostSettings(),
                         MemorySettings(), ScheduleShapes())
    options = [[o[:4] for o in prob.rows(0, i, True)] for i in range(model.num_units)]
    relayout = [[lay.num_microbatches * (f + b) for f, b in row] for row in prob.relayout[0]]
    enter = [0.0] * len(prob.strategies)
    heaviest = sum(max(o[2] for o in opts) for opts in options) + max(o[3] for opts in options for o in opts)
    lightest = sum(min(o[2] for o in opts) for opts in options)
    for budget in (heaviest, 0.5 * (heaviest + lightest), 0.3 * heaviest + 0.7 * lightest):
        want = exhaustive(options, relayout, enter, budget)
        got = stage_dp(options, relayout, enter, budget, resolution=1 << 14, max_caps=None)  # fine buckets
        assert want is not None and got is not None
        assert got[1] == pytest.approx(want[1], rel=1e-9) and got[2] <= budget


def test_single_strategy_plans_of_a_partition():
    model = replace(MODEL, num_layers=2)
    lay = [x for x in hybrid_layouts(SearchSpace(), model, 4, 8) if x.pp == 1 and x.micro_batch_size == 1][0]
    prob = HybridProblem(lay, model, load_cluster("a100-80g-ib"), None, SearchSpace(), CostSettings(),
                         MemorySettings(), ScheduleShapes())
    best = prob.solve()
    plans = prob.single_strategy(best.partition)
    assert {len(set(p.strategies)) for p in plans} == {1}
    assert {p.strategies[0] for p in plans} == {str(s) for s in prob.strategies if not s.sharded}  # tied
    assert min(p.estimate for p in plans) >= best.estimate * (1 - 1e-9)  # the DP's mix is at least as good
