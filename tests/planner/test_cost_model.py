"""Cost model: collective formulas, analytic and profiled unit times, device scaling, gradient sync."""

from dataclasses import replace
import pytest
import torch

from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.pipeline.schedule import Action, Kind
from megatron_bmw.planner.cluster import Link, load_cluster, parse_cluster
from megatron_bmw.planner.comm_cost import allgather_time, allreduce_time
from megatron_bmw.planner.cost_model import CostModel, CostSettings
from megatron_bmw.planner.evaluate import simulate_run
from megatron_bmw.planner.flops import unit_forward_flops
from megatron_bmw.planner.elementwise import unit_elementwise_bytes
from megatron_bmw.planner.engine import EngineConfig
from megatron_bmw.planner.memory_model import unit_param_count
from megatron_bmw.planner.profile_data import Profile, UnitTiming, model_signature
from megatron_bmw.planner.overlap import RankSpans, grad_buckets
from megatron_bmw.planner.spec import RunSpec
from megatron_bmw.planner.kernel_time import KernelDevice, unit_kernel_times

MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32)


def _spec(**kw) -> RunSpec:
    pipe = dict(micro_batch_size=2, num_microbatches=4, partition=(5, 5), schedule="1f1b", recompute=None,
                virtual_stages=1)
    pipe.update({k: kw.pop(k) for k in list(kw) if k in pipe})
    base = dict(model=MODEL, tp=1, pp=2, dp=1, pipeline=PipelineConfig(**pipe))
    base.update(kw)
    return RunSpec.of(**base)


def test_weight_gradient_accumulation_follows_the_engine():
    """Per micro-batch: ours and Megatron-core accumulate inside the weight-gradient GEMM by default; unfused
    (--no-gradient-accumulation-fusion) ours adds each 16-bit weight gradient into fp32 main_grad (read 2, read and
    write 4 bytes a parameter) and Megatron-core into its fp16 buffer (read 2, read and write 2); DeepSpeed's
    autograd adds into the fp16 .grad (read 4, write 2)."""
    half = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32,
                       params_dtype="fp16")
    cluster = load_cluster("a100-80g-ib")
    device, rate = cluster.device(0), 2039e9 * 0.8

    def backward(engine: str, kind: str = "mlp", fusion: bool = True) -> float:
        settings = CostSettings(engine=EngineConfig(engine, gradient_accumulation_fusion=fusion))
        return CostModel(_spec(model=half), cluster, settings=settings).unit_times(kind, None, device, 0)[1]

    params = unit_param_count("mlp", half)
    # fused, ours differs from Megatron-core only by the fp32 gradient buffer its elementwise kernels write
    grads = unit_elementwise_bytes("mlp", half, 2, grad_bytes=4)[1] - unit_elementwise_bytes(
        "mlp", half, 2, grad_bytes=2)[1]
    assert backward("megatron_bmw") - backward("megatron-core") == pytest.approx(grads / rate, abs=1e-15)
    assert backward("megatron_bmw", fusion=False) - backward("megatron_bmw") == pytest.approx(params * 10 / rate)
    assert backward("megatron-core", fusion=False) - backward("megatron-core") == pytest.approx(params * 6 / rate)
    assert backward("deepspeed") - backward("megatron-core") == pytest.approx(params * 6 / rate)
    assert backward("deepspeed", fusion=False) == backward("deepspeed")  # Megatron's flag; not DeepSpeed's
    # the head's own output matrix on a last stage accumulates like any weight; the table's dense gradient is the
    # embedding's elementwise work, not counted again
    head = unit_param_count("head", half, 1, True)
    assert backward("megatron_bmw", "head", False) - backward("megatron_bmw", "head") == pytest.approx(
        head * 10 / rate)
    emb = unit_elementwise_bytes("embedding", half, 2, grad_bytes=4)[1] - unit_elementwise_bytes(
        "embedding", half, 2, grad_bytes=2)[1]
    assert backward("megatron_bmw", "embedding") - backward("megatron-core", "embedding") == pytest.approx(emb / rate)


def test_collective_formulas():
    link = Link(10e9, 1e-5)
    assert allreduce_time(1e9, 4, link) == pytest.approx(2 * 3 / 4 * 0.1 + 6e-5)
    assert allgather_time(1e9, 4, link) == pytest.approx(3 / 4 * 0.1 + 3e-5)
    assert allreduce_time(1e9, 1, link) == 0.0
    assert link.time(1e6) == pytest.approx(1e-5 + 1e-4)


def test_analytic_unit_times():
    cluster = load_cluster("a100-80g-ib")
    cost = CostModel(_spec(), cluster, settings=CostSettings(achievable_fraction=0.5))
    shaped = cluster.device(0)
    device = replace(shaped, sm_count=None)  # the flat rate: FLOPs at the achievable fraction of peak
    fwd, bwd = cost.unit_times("mlp", None, device, 0)
    flops = unit_forward_flops("mlp", MODEL, 2)
    moved_f, moved_b = unit_elementwise_bytes("mlp", MODEL, 2)  # elementwise kernels over HBM
    # (fp32 weight gradients go into main_grad inside their GEMM: no bytes of their own)
    rate = 2039e9 * 0.8  # bandwidth fraction 0.8
    assert fwd == pytest.approx(flops / (19.5e12 * 0.5) + moved_f / rate)
    assert bwd == pytest.approx(2 * flops / (19.5e12 * 0.5) + moved_b / rate)
    own = CostModel(_spec(), cluster).unit_times("mlp", None, device, 0)[0]  # the cluster file's fraction, 0.75
    assert own == pytest.approx(flops / (19.5e12 * 0.75) + moved_f / rate)
    # with the device's SM count, the matrix work follows the GEMM shapes (kernel_time.py)
    kf, kb = unit_kernel_times("mlp", MODEL, 2, 1, KernelDevice(19.5e12, 0.5, 108, 2039e9))
    assert cost.unit_times("mlp", None, shaped, 0) == pytest.approx((kf + moved_f / rate, kb + moved_b / rate))
    full_f, full_b = cost.unit_times("mlp", "full", device, 0)
    assert full_b == pytest.approx(bwd + fwd)
    sel_f, sel_b = cost.unit_times("attention", "selective", device, 0)
    plain_f, plain_b = cost.unit_times("attention", None, device, 0)
    assert plain_b < sel_b < plain_b + plain_f


def test_blocking_launches_add_each_units_host_time():
    """CUDA_LAUNCH_BLOCKING=1: a unit's operators x the host time per operator add to its device time, with its
    tensor-parallel collectives; recomputation repeats them; nothing changes without it."""
    cluster = load_cluster("a100-80g-ib")
    ops = (("embedding", 8, 4), ("attention", 21, 25), ("mlp", 10, 11), ("head", 21, 12))
    blocking = CostSettings(launch_blocking=True, host_ops=ops, host_op_s=50e-6)
    device = cluster.device(0)
    for tp, sp, extra in ((1, False, (0, 0)), (2, False, (1, 1)), (2, True, (2, 3))):
        spec = _spec(tp=tp, sequence_parallel=sp)
        plain = CostModel(spec, cluster).unit_times("attention", None, device, 0)
        held = CostModel(spec, cluster, settings=blocking).unit_times("attention", None, device, 0)
        assert held[0] == pytest.approx(plain[0] + (21 + extra[0]) * 50e-6)
        assert held[1] == pytest.approx(plain[1] + (25 + extra[1]) * 50e-6)
    full = CostModel(_spec(), cluster, settings=blocking).unit_times("mlp", "full", device, 0)
    assert full[1] == pytest.approx(CostModel(_spec(), cluster).unit_times("mlp", "full", device, 0)[1]
                                    + (10 + 11) * 50e-6)  # the forward's operators again
    with pytest.raises(UsageError, match="operator counts"):
        CostSettings(launch_blocking=True)
    # launches running ahead: a unit takes at least its host time, never less than its device time
    ahead = CostSettings(host_ops=ops, host_op_s=50e-6)
    for host_s, bound in ((50e-6, "host"), (1e-9, "device")):
        got = CostModel(_spec(), cluster, settings=replace(ahead, host_op_s=host_s)).unit_times("attention", None,
                                                                                                device, 0)
        plain = CostModel(_spec(), cluster).unit_times("attention", None, device, 0)
        want = (max(plain[0], 21 * host_s), max(plain[1], 25 * host_s))
        assert got == pytest.approx(want) and (got[0] > plain[0]) == (bound == "host")
    profile = Profile(device={"name": "local", "kind": "cpu"}, dtype="fp32", model=model_signature(MODEL),
                      units=[UnitTiming(k, 1, 2, 1e-3, 2e-3, 0) for k in ("embedding", "attention", "mlp", "head")])
    with pytest.raises(UsageError, match="CUDA_LAUNCH_BLOCKING=1"):
        CostModel(_spec(), cluster, profile, blocking)


def test_a_profile_of_the_other_model_type_is_refused():
    """Probe, session 12: a GPT profile timed a BERT search (another head and embedding, which no shape ratio
    rescales); the model type is part of a profile's model, GPT for profiles written before it was."""
    profile = Profile(device={"name": "local", "kind": "cpu"}, dtype="fp32", model=model_signature(MODEL),
                      units=[UnitTiming(k, 1, 2, 1e-3, 2e-3, 0) for k in ("embedding", "attention", "mlp", "head")],
                      source="gpt.json")
    assert profile.model["model_type"] == "gpt" and profile.unit_time("mlp", 1, 2, MODEL) is not None
    bert = replace(MODEL, model_type="bert")
    with pytest.raises(UsageError, match=r"--profile gpt.json: timed a GPT model, this is BERT; profile it with "
                                         r"`autoconfig.py profile --model-type bert`"):
        profile.unit_time("mlp", 1, 2, bert)


def test_heterogeneous_stages_scale_with_peak():
    data = {"device_types": {"fast": {"memory_gb": 16, "peak_tflops": {"fp32": 20}},
                             "slow": {"memory_gb": 16, "peak_tflops": {"fp32": 10}}},
            "groups": [{"nodes": 1, "gpus_per_node": 1, "device": "fast", "intra_node": {"bandwidth_GBps": 50}},
                       {"nodes": 1, "gpus_per_node": 1, "device": "slow", "intra_node": {"bandwidth_GBps": 50}}],
            "inter_node": {"bandwidth_GBps": 2, "latency_us": 10}}
    cluster = parse_cluster(data)
    cost = CostModel(_spec(partition=(5, 5)), cluster)
    assert [d.name for d in cost.devices] == ["fast", "slow"]
    fast = cost.unit_times("mlp", None, cost.devices[0], 0)[0]
    assert cost.unit_times("mlp", None, cost.devices[1], 1)[0] == pytest.approx(2 * fast)
    nbytes = 32 * 2 * 64 * 4
    assert cost.transfer_time(0, 1, Action(Kind.SEND_ACT, 0)) == pytest.approx(10e-6 + nbytes / 2e9)


def _profile(name="profdev") -> Profile:
    units = []
    for b, scale in ((1, 1.0), (4, 3.0)):
        for kind, t in (("embedding", 1e-4), ("attention", 1e-3), ("mlp", 2e-3), ("head", 5e-4)):
            units.append(UnitTiming(kind, 1, b, t * scale, 2 * t * scale))
    units.append(UnitTiming("mlp", 2, 1, 1.5e-3, 3e-3))
    return Profile(device={"name": name, "kind": "cpu"}, dtype="fp32", model=model_signature(MODEL), units=units,
                   links={"p2p": {"bandwidth_Bps": 1e9, "latency_s": 1e-4}})


def test_profile_interpolation_and_tp():
    prof = _profile()
    fwd, bwd = prof.unit_time("mlp", 1, 2, MODEL)
    assert fwd == pytest.approx(2e-3 * (1 + (3 - 1) / 3))  # linear between mbs 1 and 4
    assert prof.unit_time("mlp", 2, 1, MODEL) == (1.5e-3, 3e-3)
    assert prof.unit_time("attention", 2, 1, MODEL) is None
    bigger = ModelConfig(num_layers=4, hidden_size=128, num_attention_heads=4, vocab_size=256, seq_length=32)
    assert prof.unit_time("mlp", 1, 1, bigger)[0] == pytest.approx(4 * 2e-3)  # FLOPs scale with h^2


def test_profiled_device_matches_local_cluster_exactly():
    from megatron_bmw.planner.cluster import local_cluster

    prof = _profile()
    cluster = local_cluster(2, prof.device_type(8e9), prof.link("p2p"))
    cost = CostModel(_spec(micro_batch_size=1), cluster, prof)
    # stage 0 = embedding + 2 layers; stage 1 = 2 layers + head
    assert cost.chunk_forward[0][0] == pytest.approx(1e-4 + 2 * (1e-3 + 2e-3))
    assert cost.chunk_backward[1][0] == pytest.approx(2 * (2 * (1e-3 + 2e-3) + 5e-4))
    # a device type without a profile is an error, not a silent rescale
    with pytest.raises(UsageError, match="no profile for device type a100-80g"):
        CostModel(_spec(micro_batch_size=1), load_cluster("a100-80g-ib"), prof)


def test_recomputation_as_the_profile_timed_it():
    """A profile that timed a unit recomputed gives its forward and backward as they were (the recomputation and
    whatever it cost beside the forward); without such an entry the backward adds the forward (full) or the
    attention core's share of it (selective). At tp 2 from tp 1 timings, the recomputed forward's collectives are
    in the backward too."""
    from megatron_bmw.planner.cluster import local_cluster
    from megatron_bmw.planner.flops import core_attention_share

    prof = _profile()
    prof.units += [UnitTiming("attention", 1, b, 0.9e-3 * s, 3.5e-3 * s, recompute="full") for b, s in ((1, 1), (4, 3))]
    cluster = local_cluster(4, prof.device_type(8e9), prof.link("p2p"))
    cost = CostModel(_spec(micro_batch_size=1), cluster, prof)
    dev = cluster.device(0)
    assert cost.unit_times("attention", "full", dev, 0) == pytest.approx((0.9e-3, 3.5e-3))
    assert cost.unit_times("mlp", "full", dev, 0) == pytest.approx((2e-3, 4e-3 + 2e-3))  # not timed: modelled
    share = core_attention_share(MODEL)
    assert cost.unit_times("attention", "selective", dev, 0) == pytest.approx((1e-3, 2e-3 + share * 1e-3))
    tp2 = CostModel(_spec(micro_batch_size=1, tp=2), cluster, prof)
    (a, b), (c, d) = tp2.tp_comm_parts("attention", 0)
    (fw, fl), (bw, bl) = tp2.unit_parts("attention", "full", dev, 0)
    assert fw + fl == pytest.approx(0.9e-3 / 2 + a + b)
    assert bw + bl == pytest.approx(3.5e-3 / 2 + c + d + a + b)


def test_profiles_match_device_types_and_per_unit_times():
    from megatron_bmw.planner.profile_data import Profiles

    a100 = load_cluster("a100-80g-ib")
    prof = Profile(device={"name": "A100-SXM4-80GB", "type": "a100-80g"}, dtype="fp32", model=model_signature(MODEL),
                   units=[UnitTiming("mlp", 1, 2, 1e-3, 2e-3), UnitTiming("attention", 1, 2, 3e-3, 6e-3),
                          UnitTiming("attention", 1, 2, 9e-3, 18e-3, unit=3)])
    cost = CostModel(_spec(), a100, Profiles([prof]))
    # stage 1 holds units 5..9: attn_2, mlp_2, attn_3, mlp_3, head (analytic); unit 3 (attn_1) is on stage 0
    head = cost.unit_times("head", None, a100.device(0), 1)
    assert cost.chunk_forward[1][0] == pytest.approx(2 * (3e-3 + 1e-3) + head[0])
    embedding = cost.unit_times("embedding", None, a100.device(0), 0)
    assert cost.chunk_forward[0][0] == pytest.approx(embedding[0] + 3e-3 + 1e-3 + 9e-3 + 1e-3)


def test_gradient_sync_and_overlap():
    """Without --overlap-grad-reduce the reduction follows the pipeline; with it the buckets (overlap.py) start as
    their gradients are ready. A model this small has one bucket per rank, ready when the last backward ends."""
    cluster = load_cluster("a100-80g-ib", num_nodes=2)
    plain = CostModel(_spec(dp=4), cluster)
    sync = plain.dp_sync_time(0)
    assert sync == pytest.approx(allreduce_time(4.0 * plain.params[0], 4, plain.dp_link(0)))
    assert plain.dp_reduce_seconds(0)(plain.params[0]) == pytest.approx(sync)
    ends = [1.0, 1.0]
    spans = [RankSpans([(0.9, 1.0)], [(0.0, 0.1)])] * 2
    emb = plain.embedding_sync_time()
    assert emb > 0
    out = plain.finish_times(ends, spans)
    step = [plain.optimizer_step_time(r) for r in range(2)]
    assert 0 < step[0] < 1.0  # memory-bound: params x (8 + 2 + 28) bytes at the A100's bandwidth
    assert step[0] == pytest.approx(plain.params[0] * (8 + 4 + 28) / (2039e9 * 0.8))
    assert out[0] == pytest.approx(max(1.0 + sync, 1.0 + plain.dp_sync_time(1)) + emb + step[0])
    over = CostModel(_spec(dp=4, overlap_grad_reduce=True), cluster, settings=CostSettings(overlap_factor=1.3))
    assert over.finish_times(ends, spans) == pytest.approx(out)  # one bucket, ready at the end: nothing hidden


def test_bucketed_overlap_hides_early_buckets_and_zero1_gather():
    """GPT with 200M-element layers on dp 4: the later layers' buckets reduce during the last backward, the first
    (with the embedding) stays exposed; ZeRO-1's gather hides behind the first forward with
    --overlap-param-gather."""
    big = ModelConfig(num_layers=4, hidden_size=4096, num_attention_heads=32, vocab_size=50304, seq_length=1024)
    cluster = load_cluster("a100-80g-ib", num_nodes=2)
    kw = dict(model=big, dp=4, pp=1, partition=(10,))
    plain = CostModel(_spec(**kw), cluster)
    over = CostModel(_spec(**kw, overlap_grad_reduce=True), cluster, settings=CostSettings(overlap_factor=1.0))
    assert len(grad_buckets([(0.0, 1.0, [(n, b) for n, _, b in over.grad_units(0)[0]])])) > 2
    backward = sum(b for _, _, b in over.grad_units(0)[0])
    spans = [RankSpans([(1.0 - backward, 1.0)], [(0.0, 0.1)])]
    serial = plain.finish_times([1.0], spans)[0]
    hidden = over.finish_times([1.0], spans)[0]
    step = over.optimizer_step_time(0)
    assert 1.0 + step < hidden < serial
    first = grad_buckets([(0.0, 1.0, [(n, b) for n, _, b in over.grad_units(0)[0]])])[-1][0]
    assert hidden - 1.0 - step >= over.dp_reduce_seconds(0)(first) - 1e-12  # the last bucket is exposed
    z = CostModel(_spec(**kw, distributed_optimizer=True), cluster)
    zo = CostModel(_spec(**kw, distributed_optimizer=True, overlap_param_gather=True), cluster)
    gather = z.optimizer_gather_time(0)
    assert gather > 0 and z.param_gather_time(0, spans[0]) == pytest.approx(gather)
    assert 0 < zo.param_gather_time(0, spans[0]) < gather  # the forward waits for the first bucket only
    late = RankSpans(spans[0].last_grad, [(10.0, 10.1)])  # a later stage's first input arrives late: all hidden
    assert zo.param_gather_time(0, late) == 0.0


def test_layout_must_fit_cluster():
    with pytest.raises(UsageError, match="needs 16 GPUs"):
        CostModel(_spec(pp=2, dp=8), load_cluster("aws-p3.8xlarge"))


def test_simulate_run_end_to_end():
    cluster = load_cluster("aws-g4dn.12xlarge")
    spec = _spec(pp=4, partition=(3, 2, 2, 3), num_microbatches=8, model=ModelConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32, params_dtype=torch.float16))
    ev = simulate_run(spec, cluster)
    sim = ev.simulation
    assert sim.iteration_time > sim.pipeline_time > 0
    assert [m.peak_inflight_microbatches for m in ev.memory] == [4, 3, 2, 1]
    assert 0 < sim.bubble_fraction < 1
    assert sim.master_stage in range(4)


def test_split_backward_times_and_zero_bubble_simulation():
    """W takes the weight-gradient share of a unit's backward (FLOPs on the flat rate, GEMM shapes with SMs),
    B the rest with recomputation; ZB-H1 simulated on the cost model is as busy as 1F1B, shorter, and its memory
    over time peaks where the memory model's walk does."""
    from megatron_bmw.planner.flops import unit_weight_grad_flops
    from megatron_bmw.planner.kernel_time import unit_weight_grad_time

    cluster = load_cluster("a100-80g-ib")
    shaped = cluster.device(0)
    flat = replace(shaped, sm_count=None)
    cost = CostModel(_spec(schedule="zb-h1"), cluster)
    assert cost.wgrad_share("mlp", flat) == pytest.approx(0.5)  # both GEMMs' weight gradients: half the backward
    assert cost.wgrad_share("embedding", flat) == 0.0
    attention = unit_weight_grad_flops("attention", MODEL, 2) / (2 * unit_forward_flops("attention", MODEL, 2))
    assert cost.wgrad_share("attention", flat) == pytest.approx(attention) and attention < 0.5  # the core is B's
    kd = KernelDevice(shaped.peak(MODEL.params_dtype), 0.75, shaped.sm_count, shaped.memory_bandwidth)
    for kind in ("attention", "mlp", "head"):
        w = unit_weight_grad_time(kind, MODEL, 2, 1, kd)
        assert 0 < w < unit_kernel_times(kind, MODEL, 2, 1, kd)[1]
        assert cost.wgrad_share(kind, shaped) == pytest.approx(w / unit_kernel_times(kind, MODEL, 2, 1, kd)[1])
    full = CostModel(_spec(schedule="zb-h1", recompute=(None, "full") * 5), cluster)
    for model in (cost, full):
        for r in range(2):
            whole = model.compute_time(r, Action(Kind.BACKWARD, 0))
            b = model.compute_time(r, Action(Kind.BACKWARD_INPUT, 0))
            w = model.compute_time(r, Action(Kind.BACKWARD_WEIGHT, 0))
            assert b + w == pytest.approx(whole) and 0 < w < b
    assert [w for ws in full.chunk_wgrad for w in ws] == pytest.approx([w for ws in cost.chunk_wgrad for w in ws])
    zb = simulate_run(_spec(schedule="zb-h1"), cluster)
    base = simulate_run(_spec(), cluster)
    assert zb.simulation.busy == pytest.approx(base.simulation.busy)
    assert zb.simulation.pipeline_time < base.simulation.pipeline_time
    assert zb.simulation.peak_memory == pytest.approx([m.static_bytes + m.activation_bytes for m in zb.memory])
    assert zb.memory[1].activation_bytes > base.memory[1].activation_bytes


def test_the_gradient_reduction_follows_the_engine():
    """Ours all-reduces fp32 gradients even under ZeRO-1; Megatron-core reduces its gradient buffer's bytes (16-bit
    under fp16 without --accumulate-allreduce-grads-in-fp32) and reduce-scatters under its distributed optimizer."""
    from megatron_bmw.planner.engine import EngineConfig

    cluster = load_cluster("a100-80g-ib", 2)
    model = replace(MODEL, params_dtype="fp16")
    elements = 1e8

    def reduce(engine, zero1):
        spec = _spec(model=model, pp=1, dp=8, partition=(10,), distributed_optimizer=zero1)
        cost = CostModel(spec, cluster, settings=CostSettings(engine=engine))
        return cost.grad_reduction(), cost.dp_reduce_seconds(0)(elements)

    link = CostModel(_spec(model=model, pp=1, dp=8, partition=(10,)), cluster).dp_link(0)

    ours = EngineConfig()
    assert reduce(ours, False) == reduce(ours, True) == ((4.0, False), pytest.approx(allreduce_time(4e8, 8, link)))
    mcore = EngineConfig("megatron-core")
    assert reduce(mcore, False) == ((2.0, False), pytest.approx(allreduce_time(2e8, 8, link)))
    assert reduce(mcore, True) == ((2.0, True), pytest.approx(allgather_time(2e8, 8, link)))
    fp32 = EngineConfig("megatron-core", accumulate_allreduce_grads_in_fp32=True)
    assert reduce(fp32, True) == ((4.0, True), pytest.approx(allgather_time(4e8, 8, link)))


def test_sequence_parallel_collectives_per_unit_follow_the_runtime():
    """Sequence parallel (parallel/deferred_wgrad.py): an attention or MLP unit's forward all-gathers its input
    and reduce-scatters its output; its backward all-gathers the output's gradient, reduce-scatters the input's and
    all-gathers the saved input shard again for the weight gradient: two collectives forward, three backward. The
    head gathers its input forward; backward reduce-scatters the input's gradient and gathers the input again."""
    cluster = load_cluster("a100-80g-ib")
    model = ModelConfig(num_layers=2, hidden_size=4096, num_attention_heads=32, vocab_size=51200, seq_length=2048,
                        params_dtype="bf16")
    cost = CostModel(_spec(model=model, tp=8, pp=1, dp=1, partition=(6,), sequence_parallel=True), cluster)
    one = allgather_time(2048 * 2 * 4096 * 2, 8, cost.tp_link(0))
    for kind in ("attention", "mlp"):
        assert cost.tp_comm(kind, 0) == pytest.approx((2 * one, 3 * one))
    assert cost.tp_comm("head", 0)[1] == pytest.approx(2 * one)


def test_tp_comm_overlap_costs_what_transformer_engine_leaves_exposed():
    """Megatron-core's --tp-comm-overlap: a unit's sequence-parallel collectives add what tp_overlap.py's model of
    Transformer Engine's overlaps gives beside the unit's own GEMMs (the SMs the overlaps take included): less than
    running them after the GEMMs, more than nothing; the embedding's and head's collectives are not overlapped;
    refused for other engines."""
    from megatron_bmw.planner.engine import EngineConfig
    from megatron_bmw.planner.kernel_time import unit_edge_shapes
    from megatron_bmw.planner.tp_overlap import unit_overlap_cost

    cluster = load_cluster("a100-80g-ib")
    model = ModelConfig(num_layers=2, hidden_size=4096, num_attention_heads=32, vocab_size=51200, seq_length=2048,
                        params_dtype="bf16")
    spec = _spec(model=model, tp=8, pp=1, dp=1, partition=(6,), sequence_parallel=True)
    plain = CostModel(spec, cluster, settings=CostSettings(engine=EngineConfig("megatron-core")))
    overlap = CostSettings(engine=EngineConfig("megatron-core", tp_comm_overlap=True))
    hidden = CostModel(spec, cluster, settings=overlap)
    one = allgather_time(2048 * 2 * 4096 * 2, 8, hidden.tp_link(0))
    for kind in ("attention", "mlp"):
        pf, pb = plain.tp_comm(kind, 0)
        fwd, bwd = hidden.tp_comm(kind, 0)
        first, last = unit_edge_shapes(kind, model, 2, 8)
        assert (fwd, bwd) == pytest.approx(unit_overlap_cost(first, last, 2, one, 8,
                                                             hidden.kernel_device(hidden.devices[0])))
        assert 0 < fwd < pf and 0 < bwd < pb, kind
    assert hidden.tp_comm("head", 0) == plain.tp_comm("head", 0)
    # a device type without SMs has no GEMM times to hide behind: the collectives stay whole
    flat = replace(cluster.groups[0].device, sm_count=None)
    bare = CostModel(spec, replace(cluster, groups=(replace(cluster.groups[0], device=flat),)), settings=overlap)
    assert bare.tp_comm("mlp", 0) == pytest.approx(plain.tp_comm("mlp", 0))
    with pytest.raises(UsageError, match="--tp-comm-overlap"):
        EngineConfig("megatron_bmw", tp_comm_overlap=True)


@pytest.mark.parametrize("tp", [1, 8])
def test_deepspeeds_transfers_hold_the_compute(tp):
    """DeepSpeed's pipeline engine sends with a synchronous broadcast: a stage's forward holds its activation's
    receive and send, a backward its gradient's, and the transfer adds no arrival time of its own. With tp each
    rank sends its 1/tp part (pipe_partitioned, grad_partitioned: DeepSpeed's defaults); a forward that received
    all-gathers the whole over tp, a backward that received all-gathers the gradient and its own output again."""
    half = replace(MODEL, params_dtype="fp16")
    cluster = load_cluster("a100-80g-ib", num_nodes=3)
    spec = _spec(model=half, partition=(3, 4, 3), tp=tp, pp=3)
    ours = CostModel(spec, cluster)
    ds = CostModel(spec, cluster, settings=CostSettings(engine=EngineConfig("deepspeed")))
    send = Action(Kind.SEND_ACT, 0, 0)
    assert ds.transfer_time(0, 1, send) == 0.0
    link = [ours.p2p_link(0, 1).time(spec.hidden_bytes() / tp), ours.p2p_link(1, 2).time(spec.hidden_bytes() / tp)]
    gather = allgather_time(spec.hidden_bytes(), tp, ours.tp_link(0))
    assert min(link) > 0 and (gather > 0) == (tp > 1)
    if tp == 1:
        assert link == [ours.transfer_time(0, 1, send), ours.transfer_time(1, 2, send)]
    for rank, held, gathers in ((0, link[0], (0, 2)), (1, link[0] + link[1], (1, 2)), (2, link[1], (1, 0))):
        forward, backward = Action(Kind.FORWARD, 0, 0), Action(Kind.BACKWARD, 0, 0)
        assert ds.compute_time(rank, forward) - ours.compute_time(rank, forward) == pytest.approx(
            held + gathers[0] * gather)
        # (the backward's own work differs by engine: DeepSpeed accumulates fp16 gradients)
        assert ds.compute_time(rank, backward) - ds._compute_time(rank, backward) == pytest.approx(
            held + gathers[1] * gather)
    interleaved = _spec(model=half, partition=(3, 2, 2, 3), schedule="interleaved", virtual_stages=2)
    with pytest.raises(UsageError, match="runs the 1F1B"):
        CostModel(interleaved, cluster, settings=CostSettings(engine=EngineConfig("deepspeed")))


def test_megatron_core_plans_pay_no_host_floor_unless_launches_block():
    """The per-operator host time is measured for our runtime: Megatron-core with Transformer Engine runs its
    launches ahead of the GPU, so its analytic units carry no host floor; --cuda-launch-blocking adds the host for
    any engine."""
    from megatron_bmw.planner_args import build_autoconfig_parser, cost_settings, planner_config, serial_model

    base = ["simulate", "--cluster", "h100-80g-ib", "--num-layers", "2", "--hidden-size", "1024",
            "--num-attention-heads", "8", "--seq-length", "1024", "--max-position-embeddings", "1024",
            "--vocab-size", "51200", "--micro-batch-size", "1", "--global-batch-size", "8", "--bf16"]
    parser = build_autoconfig_parser()

    def settings(*extra):
        args = parser.parse_args(base + list(extra))
        return cost_settings(planner_config(args), model_of=lambda: serial_model(args)[0])

    core = settings("--engine", "megatron-core")
    assert core.host_ops is None and not core.launch_blocking
    assert settings("--engine", "megatron_bmw").host_ops is not None
    blocking = settings("--engine", "megatron-core", "--cuda-launch-blocking")
    assert blocking.launch_blocking and blocking.host_ops is not None
