"""The search: equal to exhaustive enumeration scored by the same simulator on small spaces; memory savers only
where memory is short; the space switches; the CLI's table, plan file and errors."""

import itertools
import json

import pytest

from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.cli.autoconfig import main
from megatron_bmw.planner.cluster import parse_cluster
from megatron_bmw.planner.cost_model import CostSettings
from megatron_bmw.planner.evaluate import simulate_run, stage_capacity
from megatron_bmw.planner.memory_model import MemorySettings
from megatron_bmw.planner.plan import Plan
from megatron_bmw.planner.search import SearchSettings, padded_model, search
from megatron_bmw.planner.space import SearchSpace, layouts, tp_degrees
from megatron_bmw.planner.spec import RunSpec

MEM = MemorySettings(device="cuda")  # no allowance: the budgets below are what the activations may take
COSTS = CostSettings()


def _cluster(memory_gb: float, nodes: int = 1) -> object:
    return parse_cluster({
        "name": "tiny", "inter_node": {"bandwidth_GBps": 0.5, "latency_us": 50},
        "device_types": {"d": {"memory_gb": memory_gb, "peak_tflops": {"fp32": 0.05}, "memory_bandwidth_GBps": 20}},
        "groups": [{"nodes": nodes, "gpus_per_node": 2, "device": "d",
                    "intra_node": {"bandwidth_GBps": 2, "latency_us": 20}}]})


def _model(layers: int) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=64,
                       hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused")


def _compositions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0,) + cuts + (n,)
        yield tuple(b[i + 1] - b[i] for i in range(k))


def _exhaustive(model, gbs, cluster, space):
    """Every layout x SP x ZeRO-1 x partition x per-unit recomputation of the space, simulated; the fastest
    that fits (time, spec)."""
    world = cluster.num_gpus
    n = model.num_units
    choices = [(None,) if i in (0, n - 1) else
               tuple(c for c in ((None, "selective", "full") if i % 2 else (None, "full")) if c in space.recompute)
               for i in range(n)]
    best = (float("inf"), None)
    for lay in layouts(space, model, world, gbs, tp_degrees(model, 2, world)):
        m = padded_model(model, 256, 8, lay.tp)
        for sp, zero1 in itertools.product((s for s in space.sp if not s or lay.tp > 1),
                                           (z for z in space.zero1 if not z or lay.dp > 1)):
            for part in _compositions(n, lay.pp * lay.virtual_stages):
                for rc in itertools.product(*choices):
                    pipe = PipelineConfig(lay.micro_batch_size, lay.num_microbatches, lay.schedule, lay.virtual_stages, part, rc if any(rc) else None)
                    spec = RunSpec.of(m, lay.tp, lay.pp, lay.dp, pipe, sp, distributed_optimizer=zero1,
                                   overlap_grad_reduce=lay.dp > 1)
                    ev = simulate_run(spec, cluster, None, COSTS, MEM)
                    fits = all(x.peak_bytes <= stage_capacity(spec, cluster, s) for s, x in enumerate(ev.memory))
                    if fits and ev.simulation.iteration_time < best[0]:
                        best = (ev.simulation.iteration_time, spec)
    return best


@pytest.mark.parametrize("memory_gb", [0.004, 0.002, 0.0016, 0.0014])
def test_two_gpus_equal_exhaustive_with_per_unit_recomputation(memory_gb):
    """Less and less memory: pipelining, tensor parallelism, SP, ZeRO-1 and then recomputation take over."""
    model, cluster = _model(2), _cluster(memory_gb)
    space = SearchSpace(schedule=("1f1b",), bpipe=(False,), slicing=(False,))
    expected, _ = _exhaustive(model, 8, cluster, space)
    got = search(model, 256, 8, 8, cluster, space=space, costs=COSTS, memory=MEM).best
    assert got is not None and got.time == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("memory_gb", [0.003, 0.0015])
def test_four_gpus_equal_exhaustive(memory_gb):
    model, cluster = _model(3), _cluster(memory_gb, nodes=2)
    space = SearchSpace(schedule=("1f1b",), bpipe=(False,), slicing=(False,), recompute=(None, "full"), mbs=(2,),
                        sp=(False,))
    expected, _ = _exhaustive(model, 8, cluster, space)
    got = search(model, 256, 8, 8, cluster, space=space, costs=COSTS, memory=MEM).best
    assert got is not None and got.time == pytest.approx(expected, rel=1e-12)


def test_interleaved_equal_exhaustive():
    model, cluster = _model(4), _cluster(1.0, nodes=1)
    space = SearchSpace(schedule=("interleaved",), virtual=(2,), pp=(2,), bpipe=(False,), slicing=(False,),
                        recompute=(None,), mbs=(1,), sp=(False,), zero1=(False,))
    expected, _ = _exhaustive(model, 4, cluster, space)
    got = search(model, 256, 8, 4, cluster, space=space, costs=COSTS, memory=MEM).best
    assert got is not None and got.time == pytest.approx(expected, rel=1e-12)


def test_memory_savers_only_where_memory_is_short():
    model = _model(8)
    space = SearchSpace(tp=(1,), pp=(8,), mbs=(2,), schedule=("1f1b",), slicing=(False,))
    roomy = search(model, 256, 8, 32, _cluster(1.0, nodes=4), space=space, costs=COSTS, memory=MEM).best
    assert not roomy.spec.pipeline.bpipe and not roomy.spec.distributed_optimizer and roomy.spec.pipeline.recompute is None
    # stage 0 holds 8 micro-batches, the last one 1: BPipe evens them out so less is recomputed
    tight = search(model, 256, 8, 32, _cluster(0.0035, nodes=4), space=space, costs=COSTS, memory=MEM)
    assert tight.best is not None
    without = search(model, 256, 8, 32, _cluster(0.0035, nodes=4), space=SearchSpace(**{**space.describe(),
                                                                                           "bpipe": (False,)}),
                     costs=COSTS, memory=MEM).best
    assert tight.best.time <= without.time
    if tight.best.spec.pipeline.bpipe:
        assert "bpipe_s" in tight.best.gains or any("BPipe" in n for n in tight.best.notes)


def test_space_parsing():
    space = SearchSpace.parse(["tp=1,2", "bpipe=off", "recompute=none,full", "schedule=1f1b,gpipe,zb-h1",
                               "recompute-granularity=uniform", "partition=layer", "sp=on"])
    assert space.tp == (1, 2) and space.bpipe == (False,) and space.recompute == (None, "full")
    assert space.schedule == ("1f1b", "gpipe", "zb-h1") and not space.per_unit_recompute and not space.sublayer
    assert space.sp == (True,)
    assert "zbv" in SearchSpace().schedule and SearchSpace.parse(["schedule=zbv"]).schedule == ("zbv",)
    for bad, needle in (("tp", "expected DIM=VALUES"), ("tp=a", "takes integers"), ("bpipe=maybe", "on, off or both"),
                        ("color=red", "unknown dimension 'color'"), ("schedule=zigzag", "unknown schedule"),
                        ("tp=0", ">= 1"), ("recompute=half", "unknown recomputation")):
        with pytest.raises(UsageError, match=needle):
            SearchSpace.parse([bad])


def test_space_for_other_engines_holds_only_what_they_run():
    full = SearchSpace()
    assert full.for_engine("megatron_bmw") is full
    mcore = full.for_engine("megatron-core")
    assert mcore.schedule == ("1f1b", "interleaved") and mcore.bpipe == (False,) and mcore.slicing == (False,)
    assert not mcore.per_unit_recompute and not mcore.sublayer and mcore.strategy == ("uniform",)
    assert mcore.sp == (False, True)
    ds = full.for_engine("deepspeed")
    assert ds.schedule == ("1f1b",) and ds.sp == (False,) and ds.zero1 == (False, True)
    for items, engine, needle in ((["schedule=zb-h1"], "megatron-core", "runs only 1f1b, interleaved"),
                                  (["schedule=zbv"], "megatron-core", "runs only 1f1b, interleaved"),
                                  (["schedule=interleaved"], "deepspeed", "runs only 1f1b"),
                                  (["sp=on"], "deepspeed", "no sequence parallelism"),
                                  (["strategy=hybrid"], "megatron-core", "one layout for all units")):
        with pytest.raises(UsageError, match=needle):
            SearchSpace.parse(items).for_engine(engine)


def test_uniform_recomputation_and_layer_partitions_are_a_restriction():
    model, cluster = _model(4), _cluster(0.003)
    space = SearchSpace(schedule=("1f1b",), bpipe=(False,), slicing=(False,), per_unit_recompute=False,
                        sublayer=False)
    best = search(model, 256, 8, 8, cluster, space=space, costs=COSTS, memory=MEM).best
    rc = best.spec.pipeline.recompute or ()
    assert rc and len(set(rc[1:-1:2])) == 1 and len(set(rc[2:-1:2])) == 1  # one choice for all layers
    bounds = [sum(best.spec.pipeline.partition[:k + 1]) for k in range(best.spec.pp - 1)]
    assert bounds and all(b % 2 == 1 for b in bounds)  # every stage ends after an MLP unit
    free = search(model, 256, 8, 8, cluster, space=SearchSpace(schedule=("1f1b",), bpipe=(False,), slicing=(False,)),
                  costs=COSTS, memory=MEM).best
    assert free.time < best.time  # per-unit choices and sub-layer cuts buy time here


MODEL_FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
               "--vocab-size", "256", "--make-vocab-size-divisible-by", "8"]


def test_cli_search_writes_plan_table_and_timeline(tmp_path, capsys):
    plan_path, png = tmp_path / "plan.json", tmp_path / "best.png"
    assert main(["search", "--cluster", "a100-80g-ib", *MODEL_FLAGS, "--global-batch-size", "16", "--top-k", "3",
                 "--output", str(plan_path), "--timeline", str(png), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:3] == ["#", "iter", "s"] and "plan written to" in out
    plan = Plan.load(str(plan_path))
    assert plan.spec.world_size == 8 and plan.prediction["iteration_time_s"] > 0
    assert png.stat().st_size > 0
    data = json.loads(plan_path.read_text())
    assert data["format"] == "megatron_bmw-plan" and len(data["devices"]) == 8
    assert main(["search", "--cluster", "a100-80g-ib", *MODEL_FLAGS, "--global-batch-size", "16", "--top-k", "2",
                 "--json", "--space", "pp=2", "--space", "tp=1"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [p["layout"]["pp"] for p in got["plans"]] == [2, 2] and {p["layout"]["tp"] for p in got["plans"]} == {1}


@pytest.mark.parametrize("extra,needle", [
    ([], "search needs --global-batch-size"),
    (["--global-batch-size", "8", "--space", "tp=3"], "holds no layout"),
    (["--global-batch-size", "8", "--memory-workspace-gb", "100"], "no plan fits"),
    (["--global-batch-size", "8", "--output", "/nonexistent/dir/plan.json"], "does not exist"),
    (["--global-batch-size", "8", "--top-k", "0"], "--top-k must be >= 1"),
])
def test_cli_search_errors(extra, needle, capsys):
    with pytest.raises(SystemExit) as err:
        main(["search", "--cluster", "a100-80g-ib", *MODEL_FLAGS, *extra, "--no-progress"])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], lines


def test_heterogeneous_cluster_gives_slow_devices_less():
    """AMP's setting: 3 nodes of V100 then 1 node of T4; a 4-stage pipeline puts little on the T4 stage."""
    from megatron_bmw.planner.cluster import load_cluster

    model = ModelConfig(num_layers=12, hidden_size=1024, num_attention_heads=16, vocab_size=32768, seq_length=512,
                        params_dtype="fp16")
    best = search(model, 32768, 128, 32, load_cluster("amp-heterogeneous"),
                  space=SearchSpace(pp=(4,), tp=(4,), slicing=(False,))).best
    part = best.spec.pipeline.partition
    assert part[-1] < min(part[:-1]), part


def test_zero_bubble_kept_only_where_it_wins_under_the_memory_limit():
    """ZB-H1 in the space: chosen where memory allows (it is faster), 1F1B where ZB-H1's last rank, holding
    micro-batches for their W, would not fit; both as exhaustive enumeration finds."""
    model = _model(2)
    space = SearchSpace(schedule=("1f1b", "zb-h1"), tp=(1,), pp=(2,), mbs=(2,), bpipe=(False,), slicing=(False,),
                        recompute=(None,), sp=(False,), zero1=(False,))
    for memory_gb, schedule in ((0.004, "zb-h1"), (2.8e6 / 2**30, "1f1b")):
        cluster = _cluster(memory_gb)
        expected, spec = _exhaustive(model, 8, cluster, space)
        got = search(model, 256, 8, 8, cluster, space=space, costs=COSTS, memory=MEM).best
        assert got.spec.pipeline.schedule == spec.pipeline.schedule == schedule
        assert got.time == pytest.approx(expected, rel=1e-12)


def test_zero_bubble_plans_are_ones_the_runtime_accepts():
    """With dropout, BPipe and slicing in the space and memory short: no zero-bubble plan uses BPipe or slices
    (config.py refuses those); recomputation under dropout is allowed (deferred_wgrad keeps W's Parameter)."""
    from megatron_bmw.planner.search import SearchSettings

    model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=64,
                        hidden_dropout=0.1, attention_dropout=0.1, attention_backend="unfused")
    space = SearchSpace(schedule=("1f1b", "zb-h1"), tp=(1,), pp=(4,), mbs=(2,), sp=(False,), zero1=(False,))
    assert "zb-2p" in SearchSpace().schedule and "zbv" in SearchSpace().schedule
    seen = set()
    for memory_gb in (1.0, 0.006, 0.004):
        result = search(model, 256, 8, 16, _cluster(memory_gb, nodes=2), space=space, costs=COSTS, memory=MEM,
                        settings=SearchSettings(top_k=4))
        for plan in result.ranked:
            pipe = plan.spec.pipeline
            seen.add((pipe.schedule, pipe.recompute is not None, pipe.bpipe, bool(pipe.slicing)))
            if pipe.schedule == "zb-h1":
                assert not pipe.bpipe and not pipe.slicing
    assert ("zb-h1", False, False, False) in seen and any(s == "1f1b" and (r or b) for s, r, b, _ in seen), seen


def test_a_searched_zb_plan_carries_the_stage_times_it_was_simulated_with(tmp_path, capsys):
    """ZB-1p/ZB-2p are searched for the cost model's stage times of each finalist; the plan carries them, so the
    runtime's build_schedule regenerates the simulated order and `simulate --plan` predicts the same time."""
    from megatron_bmw.pipeline.build import build_schedule
    from megatron_bmw.pipeline.zb_search import zb_search

    for name in ("zb-1p", "zb-2p"):
        path = tmp_path / f"{name}.json"
        assert main(["search", "--cluster", "a100-80g-ib", *MODEL_FLAGS, "--global-batch-size", "16", "--top-k", "1",
                     "--space", "pp=4", "--space", "tp=1", "--space", f"schedule={name}", "--output", str(path),
                     "--no-progress"]) == 0
        capsys.readouterr()
        plan = Plan.load(str(path))
        pipe = plan.spec.pipeline
        assert pipe.schedule == name and len(pipe.schedule_times) == 4
        assert all(f > 0 and b > 0 for f, b, _, _ in pipe.schedule_times)
        order = build_schedule(pipe, 4).to_text()
        assert order == zb_search(name, 4, pipe.num_microbatches, pipe.schedule_times).to_text()
        assert main(["simulate", "--cluster", "a100-80g-ib", "--plan", str(path), "--json"]) == 0
        again = json.loads(capsys.readouterr().out)
        assert again["iteration_time_s"] == pytest.approx(plan.prediction["iteration_time_s"], rel=1e-9)


HEAVY_HEAD = ["--num-layers", "8", "--hidden-size", "2304", "--num-attention-heads", "24", "--seq-length", "1024",
              "--vocab-size", "50257", "--bf16"]  # the output layer takes about two layers' time


def test_a_searched_zbv_plan_is_v_balanced_and_simulates_at_its_prediction(tmp_path, capsys):
    """`--space schedule=zbv`: a plan of 2p stages placed in a V (rank r holds stages r and 2p-1-r); with a heavy
    output layer rank 0 (embedding and head) gets fewer transformer units than any other rank; the plan runs as
    simulated."""
    path = tmp_path / "zbv.json"
    assert main(["search", "--cluster", "a100-80g-ib", *HEAVY_HEAD, "--global-batch-size", "32", "--top-k", "1",
                 "--space", "pp=4", "--space", "tp=1", "--space", "mbs=1", "--space", "schedule=zbv", "--output", str(path),
                 "--no-progress"]) == 0
    capsys.readouterr()
    plan = Plan.load(str(path))
    pipe = plan.spec.pipeline
    assert (pipe.schedule, pipe.virtual_stages, pipe.placement) == ("zbv", 2, "v")
    part = pipe.partition
    assert len(part) == 8 and sum(part) == 18
    per_rank = [part[r] + part[7 - r] for r in range(4)]
    assert per_rank[0] - 2 < min(per_rank[1:]), part  # rank 0 holds the embedding and the head besides
    assert main(["simulate", "--cluster", "a100-80g-ib", "--plan", str(path), "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["iteration_time_s"] == pytest.approx(plan.prediction["iteration_time_s"], rel=1e-9)


def test_the_default_search_picks_zbv_where_it_wins(capsys):
    """ZB-V is in the default space beside 1F1B, interleaving and the one-chunk zero-bubble schedules: on a deep
    pipeline with a heavy head and few micro-batches its halved bubble wins, and the others are ranked too."""
    assert main(["search", "--cluster", "a100-80g-ib", "--num-nodes", "1", "--num-layers", "22", "--hidden-size",
                 "2304", "--num-attention-heads", "24", "--seq-length", "1024", "--vocab-size", "50257", "--bf16",
                 "--global-batch-size", "16", "--space", "pp=8", "--space", "tp=1", "--json", "--no-progress"]) == 0
    plans = [p["layout"] for p in json.loads(capsys.readouterr().out)["plans"]]
    assert (plans[0]["schedule"], plans[0]["virtual"]) == ("zbv", 2)
    assert {p["schedule"] for p in plans[1:]} & {"zb-h1", "zb-1p", "zb-2p"}
