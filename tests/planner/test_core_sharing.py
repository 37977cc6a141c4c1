"""CPU ranks sharing cores: the cluster knows the cores per node, the cost model stretches CPU work when more ranks
compute at once than there are cores (the simulator's timeline says which do), and GPU clusters are unaffected."""

import os

import pytest

from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.planner.cluster import DeviceType, Link, load_cluster, local_cluster, parse_cluster
from megatron_bmw.planner.cost_model import CostModel
from megatron_bmw.planner.evaluate import simulate_run
from megatron_bmw.planner.memory_model import MemorySettings
from megatron_bmw.planner.profile_data import Profile, UnitTiming, model_signature
from megatron_bmw.planner.spec import RunSpec

MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32)
CPU = MemorySettings(device="cpu")
FAST = Link(1e12, 0.0)  # links that cost nothing: only compute differs


def _profile(tp_entries: dict[int, float] | None = None, cores: int = 2) -> Profile:
    """A CPU profile: every unit 1 ms forward and 2 ms backward per sample at tp=1; tp_entries {tp: factor} adds
    entries at that tp of factor x the tp=1 time."""
    units = []
    for tp, k in {1: 1.0, **(tp_entries or {})}.items():
        for b in (1, 2, 4):
            for kind in ("embedding", "attention", "mlp", "head"):
                units.append(UnitTiming(kind, tp, b, 1e-3 * b * k, 2e-3 * b * k))
    return Profile(device={"name": "cpu-test", "kind": "cpu", "threads": 1, "cores": cores}, dtype="fp32",
                   model=model_signature(MODEL), units=units, mode="measured")


def _cpu_cluster(ranks: int, cores: int | None):
    return local_cluster(ranks, DeviceType("cpu-test", 8 * 2**30, {"fp32": 1e10}), FAST, cores=cores)


def _spec(tp=1, pp=1, dp=4, mbs=1, m=4, schedule="1f1b") -> RunSpec:
    partition = {1: (10,), 2: (5, 5), 4: (3, 2, 2, 3)}[pp]
    pipe = PipelineConfig(micro_batch_size=mbs, num_microbatches=m, partition=partition, schedule=schedule)
    return RunSpec.of(model=MODEL, tp=tp, pp=pp, dp=dp, pipeline=pipe)


def _time(spec: RunSpec, cores: int | None, profile: Profile | None = None) -> float:
    ev = simulate_run(spec, _cpu_cluster(spec.world_size, cores), profile or _profile(), memory_settings=CPU)
    return ev.simulation.iteration_time


def test_cluster_cores_per_node():
    data = {"device_types": {"cpu": {"memory_gb": 8, "peak_tflops": {"fp32": 0.1}}},
            "groups": [{"nodes": 2, "gpus_per_node": 4, "device": "cpu", "cores_per_node": 2,
                        "intra_node": {"bandwidth_GBps": 1}}],
            "inter_node": {"bandwidth_GBps": 1}}
    cluster = parse_cluster(data)
    assert cluster.shares_cores and cluster.node_cores(5) == (1, 2)
    with pytest.raises(UsageError, match="cores_per_node"):
        parse_cluster({**data, "groups": [{**data["groups"][0], "cores_per_node": 0}]})
    assert load_cluster("local").groups[0].cores_per_node == os.cpu_count()
    for name in ("a100-80g-ib", "amp-heterogeneous"):
        assert not load_cluster(name).shares_cores


def test_data_parallel_ranks_on_half_the_cores_take_twice_as_long():
    spec = _spec(dp=4, m=4)
    own = _time(spec, None)
    assert _time(spec, 4) == pytest.approx(own)  # enough cores: as before
    assert _time(spec, 2) == pytest.approx(2 * own, rel=1e-6)  # 4 busy ranks on 2 cores
    assert _time(spec, 1) == pytest.approx(4 * own, rel=1e-6)


def test_pipeline_concurrency_follows_the_schedule():
    """One micro-batch through 4 stages: one stage computes at a time, so 2 cores are plenty; many micro-batches
    keep every stage busy in the steady state and approach the 2x of 4 ranks on 2 cores."""
    one = _spec(pp=4, dp=1, m=1)
    assert _time(one, 2) == pytest.approx(_time(one, None), rel=0.02)
    many = _spec(pp=4, dp=1, m=32)
    ratio = _time(many, 2) / _time(many, None)
    assert 1.6 < ratio < 2.0
    few = _spec(pp=4, dp=1, m=4)
    assert 1.05 < _time(few, 2) / _time(few, None) < ratio  # the bubbles leave cores free


def test_tensor_parallel_entries_split_into_work_and_waiting():
    """A tp=2 entry measured with 2 processes on 2 cores holds the tp=1 work / 2 plus waiting; with tp2 x dp2 on
    those 2 cores only the work stretches, and only as far as the busy share of 4 ranks exceeds 2 cores."""
    prof = _profile({2: 1.5})  # tp=2 entries: 1.5 x the tp=1 time = 0.5 work + 1.0 waiting
    spec = _spec(tp=2, dp=2, m=4)
    cost = CostModel(spec, _cpu_cluster(4, 2), prof)
    (fw, fl), (bw, bl) = cost.unit_parts("mlp", None, cost.devices[0], 0)
    assert (fw, fl, bw, bl) == pytest.approx((0.5e-3, 1.0e-3, 1.0e-3, 2.0e-3))
    # a third of the time on the CPU: 4 ranks need 4/3 cores, so no stretch
    assert _time(spec, 2, prof) == pytest.approx(_time(spec, None, prof), rel=0.01)
    # all work: the 2x of 4 busy ranks on 2 cores
    prof = _profile({2: 0.5})
    assert _time(spec, 2, prof) == pytest.approx(2 * _time(spec, None, prof), rel=1e-6)
    # 0.5 work + 0.1 waiting: the fixed point f = (4 ranks x busy share) / 2 cores, busy share 0.5 f / (0.5 f + 0.1),
    # is f = 1.8: 0.5 x 1.8 + 0.1 = 1.0 against 0.6 on cores of their own
    prof = _profile({2: 0.6})
    assert _time(spec, 2, prof) / _time(spec, None, prof) == pytest.approx(1.0 / 0.6, rel=0.03)
    # measured on 1 core (2 processes sharing it): the entry is twice its work, so no waiting is left
    squeezed = CostModel(spec, _cpu_cluster(4, 2), _profile({2: 1.0}, cores=1))
    (fw, fl), _ = squeezed.unit_parts("mlp", None, squeezed.devices[0], 0)
    assert (fw, fl) == pytest.approx((0.5e-3, 0.0))


def test_gpu_clusters_are_unaffected():
    cluster = load_cluster("a100-80g-ib")
    spec = RunSpec.of(model=MODEL, tp=2, pp=2, dp=2, pipeline=PipelineConfig(micro_batch_size=2, num_microbatches=8,
                                                                           partition=(5, 5)))
    ev = simulate_run(spec, cluster)
    assert ev.cost.static_factor == [1.0, 1.0] and ev.cost.action_factors is None
    assert ev.cost.unit_times("mlp", None, cluster.device(0), 0) == \
        pytest.approx(tuple(x + y for x, y in ev.cost.unit_parts("mlp", None, cluster.device(0), 0)))
