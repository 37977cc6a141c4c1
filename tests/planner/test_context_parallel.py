"""Context parallelism in the planner: per-rank activations of the local sequence with the context-parallel core's
contract (unit_activations.py), its time (cp_cost.py: 1/cp of the whole causal core, the ring's exposed exchange,
the all-to-alls), the gradients over dp x cp, the search's cp dimension and the plan file."""

from dataclasses import replace

import pytest

from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.pipeline.generators import generate
from megatron_bmw.planner.cluster import Link, load_cluster
from megatron_bmw.planner.comm_cost import allreduce_time
from megatron_bmw.planner.cost_model import CostModel
from megatron_bmw.planner.cp_cost import (a2a_times, all_to_all_time, cp_core_times, core_times, kv_block_bytes,
                                          ring_exposed, ring_times)
from megatron_bmw.planner.evaluate import estimate_memory
from megatron_bmw.planner.memory_model import PrecisionConfig, StageLayout, rank_memory
from megatron_bmw.planner.plan import Plan
from megatron_bmw.planner.search import search
from megatron_bmw.planner.space import CP_MIN_SEQ, SearchSpace, cp_degrees, layouts
from megatron_bmw.planner.spec import RunSpec
from megatron_bmw.planner.unit_activations import (cp_attention_buffers, unit_activation_bytes, unit_backward_bytes,
                                                   unit_saved_tensors, unit_wgrad_bytes)
from megatron_bmw.units import UNIT_KINDS

SEQ, B = 64, 2
# Llama-like: rope, 8 heads in 2 groups, SwiGLU, RMSNorm, no biases, bf16
LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
             swiglu=True, position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
             params_dtype="bf16", vocab_size=128, seq_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0)


def _model(**kw) -> ModelConfig:
    return ModelConfig(**{**LLAMA, **kw})


def _names(tensors) -> list[str]:
    return [t.name for t in tensors]


# ---- memory: the saved tensors of one cp rank --------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, dict(position_embedding_type="learned_absolute"), dict(qk_layernorm=True),
                                dict(num_query_groups=None), dict(attention_backend="unfused")])
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_cp1_is_the_default(kw, device):
    model = _model(**kw)
    for kind in UNIT_KINDS:
        for rc in (None, "selective", "full"):
            assert unit_saved_tensors(kind, model, B, 2, True, rc, device, cp=1) == \
                unit_saved_tensors(kind, model, B, 2, True, rc, device)


def test_attention_saved_under_cp_is_the_contract():
    """cp 2, tp 2, SP: the norm and QKV input hold s/(C t) rows; the fused rope's angles s/C x r; q rotated (s/C rows
    of the rank's heads), k rotated and grouped (not repeated), v a view of the QKV output; the core's output and
    the log-sum-exp; the context copy; nothing of s^2."""
    model, cp, tp = _model(), 2, 2
    s, h, e = SEQ // cp, model.hidden_size, 2
    heads, d, per = model.num_attention_heads // tp, model.head_dim, 4
    local_h = s * B * h // tp
    got = {t.name: t for t in unit_saved_tensors("attention", model, B, tp, True, None, "cuda", cp)}
    assert list(got) == ["rmsnorm input", "rmsnorm statistics (fp32)", "qkv input", "rotary angles (fp32)",
                         "query (normed or rotated)", "keys (normed or rotated, grouped)", "qkv output",
                         "context-parallel attention output", "log-sum-exp (fp32)",
                         "context (output projection input)"]
    assert got["rmsnorm input"].numel == got["qkv input"].numel == s // tp * B * h
    assert got["rmsnorm statistics (fp32)"].numel == s // tp * B
    assert got["rotary angles (fp32)"].numel == s * model.rotary_dim
    unfused = {t.name: t for t in unit_saved_tensors("attention", replace(model, apply_rope_fusion=False), B, tp, True,
                                                     None, "cuda", cp)}
    assert unfused["rotary cos and sin (fp32)"].numel == 4 * s * model.rotary_dim  # for q and again for k
    assert got["query (normed or rotated)"].numel == local_h == B * heads * s * d
    assert got["keys (normed or rotated, grouped)"].numel == local_h // per
    assert got["qkv output"].numel == s * B * model.qkv_rows // tp
    assert (got["context-parallel attention output"].numel, got["context-parallel attention output"].itemsize) \
        == (local_h, e)
    assert (got["log-sum-exp (fp32)"].numel, got["log-sum-exp (fp32)"].itemsize) == (B * heads * s, 4)
    assert got["context (output projection input)"].numel == local_h
    assert all(t.numel < s * s * B * heads for t in got.values() if t.name != "qkv output")
    assert not any("repeated" in n for n in got)


def test_cp_core_ignores_the_attention_backend_and_the_device_for_its_core():
    model = _model()
    flash = unit_saved_tensors("attention", model, B, 1, False, None, "cuda", 2)
    assert unit_saved_tensors("attention", _model(attention_backend="unfused"), B, 1, False, None, "cuda", 2) == flash
    assert unit_saved_tensors("attention", _model(attention_dropout=0.1), B, 1, False, None, "cuda", 2) == flash
    # without rope or q/k norms q, k and v are views of the QKV output: the core keeps that alone (MHA, or one
    # group per rank); with several groups of several heads per rank q is copied out of the grouped rows
    for tp, groups, copied in ((1, None, False), (2, 2, False), (1, 2, True)):
        plain = _names(unit_saved_tensors("attention", _model(position_embedding_type="learned_absolute",
                                                              num_query_groups=groups), B, tp, False, None, "cuda", 2))
        assert plain.count("qkv output") == 1 and "query (normed or rotated)" not in plain
        assert ("query (copied out of the grouped rows)" in plain) == copied


@pytest.mark.parametrize("groups,tp,cp,kv_heads", [(2, 1, 2, 1), (1, 1, 2, 1), (1, 1, 4, 1), (2, 2, 2, 1),
                                                    (None, 1, 2, 4), (2, 1, 4, 1)])
def test_a2a_core_keeps_q_k_v_as_the_all_to_all_lays_them(groups, tp, cp, kv_heads):
    """a2a: q [b, n/C, s, d], k and v [b, lcm(g, C)/C, s, d] (kv_heads: per rank), the output, the log-sum-exp;
    not the given q, k (nor the QKV output v was a view of); under selective recomputation, the ring's set."""
    model = _model(num_query_groups=groups)
    got = {t.name: t.numel for t in unit_saved_tensors("attention", model, B, tp, False, None, "cuda", cp, "a2a")}
    heads, d = model.num_attention_heads // tp, model.head_dim
    assert got["query (after the all-to-all)"] == B * heads // cp * SEQ * d
    assert got["keys (after the all-to-all)"] == got["values (after the all-to-all)"] == B * kv_heads * SEQ * d
    assert got["log-sum-exp (fp32)"] == B * heads * SEQ // cp
    assert "qkv output" not in got and "query (normed or rotated)" not in got
    assert unit_saved_tensors("attention", model, B, tp, False, "selective", "cuda", cp, "a2a") == \
        unit_saved_tensors("attention", model, B, tp, False, "selective", "cuda", cp)
    with pytest.raises(UsageError, match="p2p or a2a"):
        unit_saved_tensors("attention", model, B, tp, False, None, "cuda", cp, "ring")


def test_selective_under_cp_keeps_the_core_inputs_only():
    model = _model()
    none = _names(unit_saved_tensors("attention", model, B, 1, False, None, "cuda", 2))
    sel = _names(unit_saved_tensors("attention", model, B, 1, False, "selective", "cuda", 2))
    assert set(none) - set(sel) == {"context-parallel attention output", "log-sum-exp (fp32)"}
    assert _names(unit_saved_tensors("attention", model, B, 1, False, "full", "cuda", 2)) == \
        ["unit input (full recomputation)"]


@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_other_units_hold_the_local_sequence(tp, sp):
    """The embedding, MLP and head of a cp rank save what the same units save for a sequence of s/cp tokens."""
    model, cp = _model(), 4
    local = replace(model, seq_length=SEQ // cp)
    for kind in ("embedding", "mlp", "head"):
        for rc in (None, "full"):
            assert unit_saved_tensors(kind, model, B, tp, sp, rc, "cuda", cp) == \
                unit_saved_tensors(kind, local, B, tp, sp, rc, "cuda")
        assert unit_wgrad_bytes(kind, model, B, tp, sp, cp) == unit_wgrad_bytes(kind, local, B, tp, sp)
        assert unit_backward_bytes(kind, model, B, tp, sp, cp) == unit_backward_bytes(kind, local, B, tp, sp)


def test_cp_refuses_a_sequence_it_does_not_split():
    with pytest.raises(UsageError, match="does not split the sequence"):
        unit_saved_tensors("mlp", _model(seq_length=66), B, 1, False, None, "cuda", 4)


def test_cp_attention_buffers_and_backward():
    """The ring's transient bytes (planner/cp_buffers.py; against the CPU allocator in test_cp_buffers.py), bf16 on
    cuda: forward 2 K/V blocks, the fp32 output accumulator, a pair's output and log-sum-exp, the merge's rows;
    backward 2 K/V blocks, 3 fp32 dK/dV blocks, the fp32 dQ accumulator, a pair's gradients and flash-attention's
    workspace (fp32 dq accumulator and rowsum(dO * O), dk/dv expanded to the query heads). No s^2 term: doubling
    the sequence doubles them. The backward holds the larger of those and the q, k, v gradients."""
    model, cp, tp = _model(), 2, 2
    s, d, n, g, e = SEQ // cp, model.head_dim, model.num_attention_heads // tp, model.query_groups // tp, 2
    kv, q, r = 2 * B * g * s * d, B * n * s * d, B * n * s
    lower = (q * e + kv // 2 * e, q * 4 + r * 4 + (n // g) * kv // 2 * e)  # kernel grads, workspace: (1, 1/2)
    fwd = 1 * kv * e + q * 4 + q * e + r * 4 + 3 * r * 4
    bwd = 1 * kv * e + 3 * kv * 4 + q * 4 + sum(lower)
    assert cp_attention_buffers(model, B, tp, cp) == (fwd, bwd)
    assert cp_attention_buffers(model, B, tp, 1) == (0, 0)
    long = cp_attention_buffers(_model(seq_length=2 * SEQ), B, tp, cp)
    assert long == (2 * fwd, 2 * bwd)
    grads = (q + 2 * q // 4) * 2
    assert unit_backward_bytes("attention", model, B, tp, False, cp) == max(grads, fwd, bwd)
    a2a = cp_attention_buffers(model, B, tp, cp, "a2a")
    assert a2a[0] >= 2 * q * e and a2a[1] >= (q + kv) * 4  # B > 1: the re-lay copies; fp32 accumulators
    assert cp_attention_buffers(model, B, tp, cp, device="cpu") != cp_attention_buffers(model, B, tp, cp)


def test_rank_memory_under_cp_shards_zero1_over_dp_and_cp():
    """Parameters and gradients are replicated over cp; ZeRO-1 shards the optimizer state over dp x cp; the
    activations are those of the local sequence."""
    model = _model()
    sched = generate("1f1b", 1, 2)
    prec = PrecisionConfig(2, distributed_optimizer=True)
    base = StageLayout(tp=1, dp=2, pp=1, sequence_parallel=False, micro_batch_size=B, partition=(6,))
    one, two = (rank_memory(replace(base, cp=c), model, sched, 0, prec) for c in (1, 2))
    assert (two.params_bytes, two.grads_bytes) == (one.params_bytes, one.grads_bytes)
    assert two.optimizer_bytes == pytest.approx(one.optimizer_bytes / 2)
    saved = sum(unit_activation_bytes(k, model, B, 1, False, None, "cuda", 2)
                for k in ("embedding", "attention", "mlp", "attention", "mlp", "head"))
    assert two.activation_bytes == saved < one.activation_bytes


def test_spec_under_cp():
    model = _model()
    pl = PipelineConfig(micro_batch_size=1, num_microbatches=2)
    spec = RunSpec.of(model, tp=2, pp=1, dp=2, pipeline=pl, sequence_parallel=True, cp=2)
    assert (spec.world_size, spec.grad_dp, spec.cp) == (8, 4, 2)
    assert spec.global_batch_size == 2 * 1 * 2  # cp splits sequences, not the batch
    assert spec.hidden_bytes() == SEQ // 2 // 2 * 1 * model.hidden_size * 2
    assert sorted(r for s in range(spec.pp) for r in spec.stage_ranks(s)) == list(range(8))
    with pytest.raises(UsageError, match="not divisible by 2 x 4"):
        RunSpec.of(_model(seq_length=36), tp=1, pp=1, dp=1, pipeline=pl, cp=4)
    with pytest.raises(UsageError, match="--unit-strategies"):
        RunSpec.of(model, tp=1, pp=1, dp=2, pipeline=pl, cp=2, unit_strategies=("dp2",) * model.num_units)


# ---- cost ----------------------------------------------------------------------------------------------------------
def test_ring_exposed_zero_when_compute_dominates_else_transfer_bound():
    model, cp, tp = _model(seq_length=8192), 4, 1
    block = kv_block_bytes(model, 1, tp, cp, 2)
    fast, slow = Link(1e15, 0.0), Link(1e5, 1e-5)
    core = (1.0, 2.5)
    assert ring_times(model, 1, tp, cp, fast, core) == (0.0, 0.0)
    f, b = ring_times(model, 1, tp, cp, slow, core)
    assert f == pytest.approx((cp - 1) * (slow.time(block) - core[0] / cp))
    dkv = kv_block_bytes(model, 1, tp, cp, 4)
    assert b == pytest.approx((cp - 1) * (slow.time(block) + slow.time(dkv) - core[1] / cp))
    assert ring_exposed(3, 1.0, 2.0) == 0.0 and ring_exposed(3, 2.0, 0.5) == 4.5


def test_a2a_cost_is_two_all_to_alls_each_way():
    model, cp, tp = _model(seq_length=8192), 4, 2
    link = Link(1e11, 1e-5)
    local_h = 8192 // cp * 1 * model.hidden_size // tp
    qkv, out = (local_h + 2 * local_h // 4) * 2, local_h * 2
    want = all_to_all_time(qkv, cp, link) + all_to_all_time(out, cp, link)
    assert a2a_times(model, 1, tp, cp, link) == pytest.approx((want, want))
    assert all_to_all_time(out, 4, link) == pytest.approx(0.75 * out / 1e11 + 3e-5)
    assert all_to_all_time(out, 1, link) == 0.0


def test_cp_core_is_the_whole_causal_core_over_cp():
    model = _model(seq_length=8192)
    cl = load_cluster("h100-80g-ib")
    spec = RunSpec.of(model, 1, 1, 1, PipelineConfig(), cp=2)
    cost = CostModel(spec, cl)
    kd = cost.kernel_device(cost.devices[0])
    whole = core_times(model, 1, 1, kd, 1.0)
    assert cp_core_times(model, 1, 1, 2, kd, 1.0) == pytest.approx((whole[0] / 2, whole[1] / 2))
    local = core_times(replace(model, seq_length=4096), 1, 1, kd, 1.0)
    assert whole[0] / 2 > local[0] * 1.5  # quadratic: a rank's share is not the local sequence's core
    assert core_times(model, 1, 1, None, 1e12) == pytest.approx((4.0 * 8192 ** 2 * 64 / 1e12, 8.0 * 8192 ** 2 * 64 / 1e12))


def test_unit_times_under_cp():
    """An MLP of a cp rank is the MLP of s/cp tokens; its attention adds the core's share beyond the local core and
    the ring's exposed time; selective recomputation runs that core again."""
    model = _model(seq_length=8192, num_layers=2)
    cl = load_cluster("h100-80g-ib")
    pl = PipelineConfig(micro_batch_size=1, num_microbatches=1)
    cp2 = CostModel(RunSpec.of(model, 1, 1, 1, pl, cp=2), cl)
    local = CostModel(RunSpec.of(replace(model, seq_length=4096), 1, 1, 1, pl), cl)
    dev = cp2.devices[0]
    assert cp2.unit_times("mlp", None, dev, 0) == pytest.approx(local.unit_times("mlp", None, dev, 0))
    (xf, lf), (xb, lb), again = cp2.cp_attention_parts(dev, 0)
    plain = local.unit_times("attention", None, dev, 0)
    f, b = cp2.unit_times("attention", None, dev, 0)
    assert (f, b) == pytest.approx((plain[0] + xf + lf, plain[1] + xb + lb))
    assert xf > 0 and again[0] > xf
    sel = cp2.unit_times("attention", "selective", dev, 0)
    assert sel[1] == pytest.approx(b + again[0] + again[1])


def test_gradients_reduce_over_dp_and_cp():
    model = _model(num_layers=2)
    cl = load_cluster("h100-80g-ib")
    pl = PipelineConfig(micro_batch_size=1, num_microbatches=2)
    alone = CostModel(RunSpec.of(model, 1, 1, 1, pl), cl)
    assert alone.spec.grad_dp == 1 and alone.finish_times([0.0], [None]) == [alone.optimizer_step_time(0)]
    cp2 = CostModel(RunSpec.of(model, 1, 1, 1, pl, cp=2, distributed_optimizer=True), cl)
    dp2 = CostModel(RunSpec.of(model, 1, 1, 2, pl, distributed_optimizer=True), cl)
    assert cp2.spec.grad_dp == 2
    n = float(cp2.params[0])
    assert cp2.dp_reduce_seconds(0)(n) == pytest.approx(dp2.dp_reduce_seconds(0)(n))
    assert cp2.dp_reduce_seconds(0)(n) == pytest.approx(allreduce_time(4 * n, 2, cp2.dp_link(0)))
    assert cp2.optimizer_gather_time(0) == pytest.approx(dp2.optimizer_gather_time(0))
    assert cp2.optimizer_gather_time(0) > 0
    assert cp2.optimizer_step_time(0) == pytest.approx(dp2.optimizer_step_time(0))


def test_cp_link_within_and_across_nodes():
    """The ring's neighbours share a node while tp x cp fits in it, else the node's NICs carry it."""
    model = _model(seq_length=8192)
    cl = load_cluster("h100-80g-ib", 2)
    pl = PipelineConfig(micro_batch_size=1, num_microbatches=1)
    inside = CostModel(RunSpec.of(model, 4, 1, 1, pl, cp=2), cl).cp_link(0)
    across = CostModel(RunSpec.of(model, 8, 1, 1, pl, cp=2), cl).cp_link(0)
    assert inside.bandwidth > across.bandwidth


# ---- search and plan -----------------------------------------------------------------------------------------------
def test_short_sequences_never_enumerate_cp_unless_asked():
    model = _model(seq_length=2048)
    assert cp_degrees(SearchSpace(), model, 16) == [1]
    got = {lay.cp for lay in layouts(SearchSpace(), model, 16, 16, [1, 2])}
    assert got == {1}
    asked = SearchSpace.parse(["cp=1,2"])
    assert {lay.cp for lay in layouts(asked, model, 16, 16, [1, 2])} == {1, 2}
    long = _model(seq_length=CP_MIN_SEQ)
    assert cp_degrees(SearchSpace(), long, 24) == [1, 2, 4, 8]
    assert cp_degrees(SearchSpace(), _model(seq_length=CP_MIN_SEQ, max_position_embeddings=CP_MIN_SEQ), 12) == [1, 2, 4]
    for lay in layouts(SearchSpace(), long, 16, 16, [1, 2]):
        assert lay.tp * lay.cp * lay.pp * lay.dp == 16
    with pytest.raises(UsageError, match="not engine megatron-core"):
        SearchSpace.parse(["cp=2"]).for_engine("megatron-core")


LLAMA3_8B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
                 swiglu=True, position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
                 params_dtype="bf16", seq_length=131072, max_position_embeddings=131072, vocab_size=128256,
                 untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0)


@pytest.mark.slow  # a whole search
def test_128k_needs_cp_on_h100():
    """A Llama-3-8B-like model at 128k tokens, tp 8 with SP and ZeRO-1 on H100-80GB: without full recomputation
    cp 1 runs out of memory and cp 2 fits; the search on two nodes picks cp > 1, and a space without full
    recomputation holds no cp 1 plan that fits with SwiGLU and rope unfused (fused, as by default, tp 8 x pp 2 at
    cp 1 saves enough to fit)."""
    model = ModelConfig(**LLAMA3_8B)
    cl = load_cluster("h100-80g-ib", 2)
    n = model.num_units
    pl = PipelineConfig(micro_batch_size=1, num_microbatches=8, recompute=(None,) + ("selective",) * (n - 2) + (None,))
    peaks = {}
    for cp in (1, 2, 4):
        spec = RunSpec.of(model, tp=8, pp=1, dp=1, pipeline=pl, sequence_parallel=True, cp=cp,
                          distributed_optimizer=True)
        peaks[cp] = estimate_memory(spec)[0].peak_bytes
    cap = cl.groups[0].device.memory_bytes
    assert peaks[1] > cap > peaks[2] > peaks[4]
    got = search(model, 128256, 128, 16, cl)
    assert got.best.spec.cp > 1
    assert all(r.fits for r in got.ranked)
    no_full = search(model, 128256, 128, 16, cl, space=SearchSpace.parse(["recompute=none,selective"]))
    assert no_full.best is not None and all(r.spec.cp > 1 for r in no_full.ranked)
    cp1 = SearchSpace.parse(["recompute=none,selective", "cp=1"])
    unfused = replace(model, bias_swiglu_fusion=False, apply_rope_fusion=False)
    assert search(unfused, 128256, 128, 16, cl, space=cp1).best is None
    fused = search(model, 128256, 128, 16, cl, space=cp1).best.spec
    assert (fused.tp, fused.pp, fused.cp) == (8, 2, 1)


def test_a_plan_with_cp_round_trips():
    model = _model(seq_length=8192, max_position_embeddings=8192)
    pl = PipelineConfig(micro_batch_size=1, num_microbatches=4)
    spec = RunSpec.of(model, tp=2, pp=1, dp=2, pipeline=pl, sequence_parallel=True, cp=2, cp_comm_type="a2a",
                      distributed_optimizer=True)
    plan = Plan(spec=spec, global_batch_size=8, devices=["h100"] * 8)
    data = plan.to_json()
    assert data["parallel"]["context_parallel_size"] == 2 and data["parallel"]["cp_comm_type"] == "a2a"
    back = Plan.from_json(data)
    assert back.spec == spec and back.spec.world_size == 8
    bad = {**data, "devices": ["h100"] * 4}
    with pytest.raises(UsageError, match="tp 2 x cp 2 x pp 1 x dp 2 = 8 ranks"):
        Plan.from_json(bad)
    odd = {**data, "parallel": {**data["parallel"], "context_parallel_size": 3}, "devices": []}
    with pytest.raises(UsageError, match="parallel.context_parallel_size"):
        Plan.from_json(odd)


def _cpu_profile(model, cp_core):
    from megatron_bmw.planner.profile_data import Profile, UnitTiming, model_signature

    units = [UnitTiming(kind, 1, 1, f, 2 * f) for kind, f in
             (("embedding", 1e-3), ("attention", 4e-3), ("mlp", 2e-3), ("head", 1e-3))]
    link = {"bandwidth_Bps": 1e9, "latency_s": 1e-5}
    return Profile(device={"name": "cpu-1-thread", "kind": "cpu", "threads": 1, "cores": 2, "memory_bytes": 2 ** 33},
                   dtype=model.params_dtype, model=model_signature(model), units=units,
                   links={"p2p": link, "allreduce": link}, cp_core=cp_core)


def test_a_profile_that_timed_the_cp_tiles_prices_the_core_by_them():
    """A CPU profile's timing of the runtime's context-parallel core (Profile.cp_core: one cp rank, tp 1) replaces
    the core's FLOPs at the device's rate: rescaled by the tiles' FLOPs (the diagonal tile whole, the others half)
    to another micro-batch size, tp or cp; the local core the unit time holds is its FLOP share of it."""
    from megatron_bmw.planner.cluster import local_cluster
    from megatron_bmw.planner.flops import core_attention_share, cp_tile_flops
    from megatron_bmw.planner.profile_data import Profile

    model = _model(seq_length=1024)
    timed = {"2": {"1": {"forward_s": 0.03, "backward_s": 0.05}}}
    prof = _cpu_profile(model, timed)
    assert Profile.from_json(prof.to_json()).cp_core == timed
    assert prof.cp_core_time(model, 1, 1, 2) == pytest.approx((0.03, 0.05))
    assert prof.cp_core_time(model, 2, 2, 2) == pytest.approx((0.03, 0.05))  # twice the batch, half the heads
    assert cp_tile_flops(model, 1, 1, 4) / cp_tile_flops(model, 1, 1, 2) == pytest.approx(1 / 2)  # 1/C of the causal scores
    assert prof.cp_core_time(model, 1, 1, 4) == pytest.approx((0.03 / 2, 0.05 / 2))
    assert _cpu_profile(model, {}).cp_core_time(model, 1, 1, 2) is None

    cluster = local_cluster(2, prof.device_type(2 ** 33), prof.link("p2p"), prof.link("allreduce"))
    spec = RunSpec.of(model, 1, 1, 1, PipelineConfig(micro_batch_size=1, num_microbatches=1), cp=2)
    cost = CostModel(spec, cluster, prof)
    dev = cost.devices[0]
    (fw, fl), (bw, bl), _ = cost._compute_parts("attention", dev, None)
    share = core_attention_share(cost.unit_model)
    (xf, _), (xb, _), again = cost.cp_attention_parts(dev, 0)
    assert (xf, xb) == pytest.approx((0.03 - (fw + fl) * share, 0.05 - (bw + bl) * share))
    assert again[0] == pytest.approx(0.03)
    by_flops = CostModel(spec, cluster, replace(prof, cp_core={}))
    assert by_flops.cp_attention_parts(dev, 0)[2][0] != pytest.approx(0.03)


@pytest.mark.parametrize("cp_core, needle", [
    ({"1": {"1": {"forward_s": 1.0, "backward_s": 1.0}}}, "cp_core.1 must map"),
    ({"2": {"0": {"forward_s": 1.0, "backward_s": 1.0}}}, "cp_core.2.0 must be"),
    ({"2": {"1": {"forward_s": -1.0, "backward_s": 1.0}}}, "cp_core.2.1.forward_s must be a number >= 0"),
    ({"2": {"1": {"forward_s": 1.0}}}, "missing field 'cp_core.2.1.backward_s'"),
    ([1], "cp_core must be a mapping"),
])
def test_a_malformed_cp_core_is_refused_in_one_line(cp_core, needle):
    from megatron_bmw.planner.profile_data import Profile

    data = _cpu_profile(_model(), {}).to_json()
    data["cp_core"] = cp_core
    with pytest.raises(UsageError, match=None) as err:
        Profile.from_json(data, "p.json")
    assert needle in str(err.value) and "\n" not in str(err.value)
