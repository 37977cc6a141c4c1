"""Mixtures of experts in the planner (docs/moe.md; planner/moe_model.py, moe_cost.py): the unit kind, parameters and
model states per rank against the design's parameter table, the routing model and what an MoE unit saves, grouped
GEMMs, the dispatchers' exchanges within and across nodes, expert gradients over edp, the search's ep/etp dimension
and the plan file."""

import math
from dataclasses import replace

import pytest

from megatron_bmw.config import ModelConfig, MoEConfig, PipelineConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.pipeline.generators import generate
from megatron_bmw.planner.cluster import Link, load_cluster
from megatron_bmw.planner.cost_model import CostModel
from megatron_bmw.planner.kernel_time import device_kernels, gemm_time, grouped_gemm_time
from megatron_bmw.planner.memory_model import (PrecisionConfig, StageLayout, rank_memory, total_parameters,
                                               unit_param_count, unit_param_split)
from megatron_bmw.planner.moe_cost import all_to_all_seconds
from megatron_bmw.planner.moe_model import Experts, expert_loads, expert_tokens, local_tokens
from megatron_bmw.planner.plan import Plan
from megatron_bmw.planner.space import SearchSpace, layouts
from megatron_bmw.planner.spec import RunSpec
from megatron_bmw.planner.unit_activations import unit_activation_bytes, unit_saved_tensors
from megatron_bmw.plan_overlay import plan_flags
from megatron_bmw.units import model_unit_kinds, unit_kind, unit_kind_of, unit_names

B, SEQ = 2, 64


def _model(**moe) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                swiglu=True, position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
                params_dtype="bf16", seq_length=SEQ, max_position_embeddings=SEQ, vocab_size=256,
                hidden_dropout=0.0, attention_dropout=0.0)
    settings = dict(num_experts=8, router_topk=2)
    settings.update(moe)
    return ModelConfig(**base, moe=MoEConfig(**settings))


def _numel(shape) -> int:
    return math.prod(shape)


# ---- the unit and its parameters ---------------------------------------------------------------------------------
def test_unit_kind_of_names_moe_layers():
    model = _model(layer_freq="[0,1,0,1]")
    kinds = [unit_kind_of(model, n) for n in unit_names(4)]
    assert kinds == ["embedding", "attention", "mlp", "attention", "moe", "attention", "mlp", "attention", "moe",
                     "head"]
    assert unit_kind("mlp_1") == "mlp"  # the name alone keeps answering mlp
    assert model_unit_kinds(model) == ("embedding", "attention", "mlp", "head", "moe")
    dense = replace(model, moe=None)
    assert {unit_kind_of(dense, n) for n in unit_names(4)} == {"embedding", "attention", "mlp", "head"}


@pytest.mark.parametrize("ep,etp,tp,bias,shared,gate", [(1, 1, 1, False, None, False), (2, 1, 2, True, None, False),
                                                         (4, 2, 2, True, 64, True), (8, 1, 1, False, 32, False)])
def test_parameters_per_rank_follow_the_design_table(ep, etp, tp, bias, shared, gate):
    """docs/moe.md's table: router [E, h] and norm replicated, experts.fc1 [E, rows, h] dim 0 over ep and dim 1 over
    etp, fc2 [E, h, F] dim 0 over ep and dim 2 over etp, fc1 bias [E, rows] as fc1, fc2 bias [E, h] over ep, shared
    experts over tp as the dense MLP, their gate [1, h]."""
    model = replace(_model(shared_expert_intermediate_size=shared, shared_expert_gate=gate), add_bias_linear=bias)
    big_e, h, f = 8, model.hidden_size, model.moe_ffn_hidden_size
    rows = 2 * f
    expert = [(big_e // ep, rows // etp, h), (big_e // ep, h, f // etp)]
    dense = [(h,), (big_e, h)]
    if bias:
        expert += [(big_e // ep, rows // etp), (big_e // ep, h)]
    if shared:
        dense += [(2 * shared // tp, h), (h, shared // tp)] + ([(2 * shared // tp,), (h,)] if bias else [])
    if gate:
        dense.append((1, h))
    got = unit_param_split("moe", model, tp, experts=Experts(ep, etp))
    assert got == (sum(map(_numel, dense)), sum(map(_numel, expert)))
    assert unit_param_count("moe", model, tp, experts=Experts(ep, etp)) == sum(got)
    assert unit_param_split("mlp", model, tp) == (unit_param_count("mlp", model, tp), 0)


def test_mixtral_like_total_parameters():
    """8 experts top-2 (32 layers, hidden 4096, 32 heads in 8 groups, experts' FFN 14336, vocabulary 32000 untied):
    the arithmetic of the shapes, 46.7B."""
    model = ModelConfig(**MIXTRAL)
    h, f, v = 4096, 14336, 32000
    layer = (h * (4096 + 2 * 1024) + h * h + h) + (h + 8 * h + 8 * 3 * h * f)
    assert total_parameters(model) == 32 * layer + 2 * v * h + h
    assert total_parameters(model) == pytest.approx(46.70e9, rel=1e-3)


def test_expert_states_shard_over_edp_and_dense_over_dp_cp():
    """tp 2 x dp 4 with ep 4, etp 1: edp = 2 x 4 / 4 = 2; ZeRO-1 shards the expert states over 2, the dense over 4."""
    model = _model()
    sched = generate("1f1b", 1, 2)
    prec = PrecisionConfig(2, distributed_optimizer=True)
    lay = StageLayout(tp=2, dp=4, pp=1, sequence_parallel=True, micro_batch_size=B, partition=(10,), ep=4, etp=1)
    assert lay.expert_shards == 2 and lay.optimizer_shards == 4
    mem = rank_memory(lay, model, sched, 0, prec)
    names = unit_names(4)
    splits = [unit_param_split(unit_kind_of(model, n), model, 2, False, Experts(4, 1)) for n in names]  # tied head
    dense, expert = sum(d for d, _ in splits), sum(x for _, x in splits)
    assert mem.params_bytes == (dense + expert) * prec.param_bytes
    assert mem.optimizer_bytes == pytest.approx(dense * prec.optimizer_bytes(4) + expert * prec.optimizer_bytes(2))


# ---- routing and activations -------------------------------------------------------------------------------------
def test_routing_model_even_imbalanced_and_capacity():
    model = _model()
    tokens = local_tokens(model, B, 2, True)
    assert tokens == SEQ // 2 * B
    # even routing: a rank's E/ep experts receive etp T k in all, whatever ep
    for ep, etp in ((1, 1), (2, 1), (4, 2), (8, 1)):
        loads = expert_loads(model, tokens, Experts(ep, etp))
        assert len(loads) == 8 // ep and sum(loads) == pytest.approx(etp * tokens * 2)
    mean = 2 * tokens * 2 / 8
    hot = expert_loads(model, tokens, Experts(2, 1, 1.5))
    assert hot == pytest.approx([1.5 * mean] + [mean] * 3)
    assert expert_loads(model, tokens, Experts(8, 1, 100.0)) == [8 * tokens]  # at most every token once
    capped = _model(expert_capacity_factor=1.25)
    cap = math.ceil(tokens * 2 / 8 * 1.25)
    assert expert_loads(capped, tokens, Experts(2, 1, 2.0)) == pytest.approx([2 * cap] + [mean] * 3)
    padded = _model(expert_capacity_factor=1.25, pad_expert_input_to_capacity=True)
    assert expert_loads(padded, tokens, Experts(2, 1)) == [2 * cap] * 4


def test_moe_saved_tensors():
    """bf16, SwiGLU (fused), tp 2 with SP, ep 2, etp 1, on cuda, allgather: the norm, the router's fp32 input and weight
    copies, the top-k's flat indices and the probabilities over the k, the permutation's (token, expert) indices, the
    expert input, offsets and activations at the R rows received, the output rows and their probabilities (e). The
    exact check against the runtime: tests/planner/test_memory_model.py (test_saved_bytes_moe_*)."""
    model = _model()
    tp, h = 2, 64
    tokens = SEQ // tp * B
    experts = Experts(2, 1)
    received = expert_tokens(model, tokens, experts)
    assert received == tokens * 2
    f = model.moe_ffn_hidden_size
    got = {t.name: (t.numel, t.itemsize) for t in unit_saved_tensors("moe", model, B, tp, True, None, "cuda", 1,
                                                                        experts=experts)}
    assert got == {
        "rmsnorm input": (tokens * h, 2), "rmsnorm statistics (fp32)": (tokens, 4),
        "router input (fp32 copy)": (tokens * h, 4), "router weight (fp32 copy)": (8 * h, 4),
        "top-k flat indices (picking the k scores and placing the probabilities)": (tokens * 2, 8),
        "top-k probabilities (softmax over the k, fp32)": (tokens * 2, 4),
        "permutation indices (token and expert of each row, int64)": (2 * received, 8),
        "expert input (permuted tokens)": (received * h, 2), "grouped GEMM offsets (int32)": (4, 4),
        "expert fc1 output (gate and up)": (2 * received * f, 2), "expert swiglu output (fc2 input)": (received * f, 2),
        "expert output (fc2 output; alltoall: the rows back)": (received * h, 2),
        "routing probabilities of those rows": (received, 2)}
    assert unit_saved_tensors("moe", model, B, tp, True, "full", "cuda", 1, experts=experts)[0].numel == tokens * h
    unfused = {t.name: (t.numel, t.itemsize) for t in unit_saved_tensors(  # --no-bias-swiglu-fusion: silu's too
        "moe", replace(model, bias_swiglu_fusion=False), B, tp, True, None, "cuda", 1, experts=experts)}
    assert unfused == {**got, "expert silu output": (received * f, 2)}
    # a given routing: its loads and routed pairs instead of the routing model's
    given = Experts(2, 1, loads=(10, 0, 7, 3), sent=tokens * 2)
    assert expert_tokens(model, tokens, given) == 20
    with pytest.raises(UsageError, match="names 3 expert loads"):
        expert_loads(model, tokens, Experts(2, 1, loads=(1, 2, 3)))


def test_moe_scores_losses_and_shared_experts():
    pre = {t.name for t in unit_saved_tensors("moe", _model(pre_softmax=True, aux_loss_coeff=0.01), B)}
    assert "router probabilities (softmax over the experts, fp32)" in pre
    assert "load-balancing scores (over the experts, fp32)" in pre  # a softmax of its own
    aux = {t.name for t in unit_saved_tensors("moe", _model(aux_loss_coeff=0.01, z_loss_coeff=0.001), B)}
    assert {"load-balancing scores (over the experts, fp32)", "z-loss logits and log-sum-exp (fp32)"} <= aux
    sig = {t.name for t in unit_saved_tensors("moe", _model(score_function="sigmoid"), B)}
    assert "router scores (sigmoid, fp32)" in sig
    shared = {t.name: t.numel for t in unit_saved_tensors(
        "moe", _model(shared_expert_intermediate_size=32, shared_expert_gate=True), B, 2, True)}
    assert shared["shared expert fc1 output (gate and up)"] == SEQ * B * 2 * 32 // 2
    assert shared["shared expert gate (sigmoid output)"] == SEQ // 2 * B


def test_activations_grow_with_imbalance_and_fall_with_etp():
    model = _model()
    even = unit_activation_bytes("moe", model, B, 2, True, experts=Experts(2, 1))
    hot = unit_activation_bytes("moe", model, B, 2, True, experts=Experts(2, 1, 2.0))
    assert hot > even
    # etp 2: twice the tokens (gathered over etp), half the FFN columns: the activations stay, the inputs double
    split = {t.name: t.numel for t in unit_saved_tensors("moe", model, B, 2, True, experts=Experts(1, 2))}
    one = {t.name: t.numel for t in unit_saved_tensors("moe", model, B, 2, True, experts=Experts(1, 1))}
    assert split["expert swiglu output (fc2 input)"] == one["expert swiglu output (fc2 input)"]
    assert split["expert input (permuted tokens)"] == 2 * one["expert input (permuted tokens)"]


# ---- time --------------------------------------------------------------------------------------------------------
def test_grouped_gemm_is_less_efficient_at_few_tokens_per_expert():
    cl = load_cluster("h100-80g-ib")
    kd = device_kernels(cl.groups[0].device, "bf16", 0.65)
    n, k = 2 * 14336, 4096
    few = grouped_gemm_time([16.0] * 8, n, k, 2, kd) / (16 * 8)
    many = grouped_gemm_time([4096.0] * 8, n, k, 2, kd) / (4096 * 8)
    assert few > 5 * many
    assert grouped_gemm_time([4096.0], n, k, 2, kd) == pytest.approx(gemm_time(4096, n, k, 2, kd))


def test_all_to_all_within_a_node_is_faster_than_across():
    cl = load_cluster("h100-80g-ib", 2)
    nbytes = 64e6
    inside = all_to_all_seconds(nbytes, [0, 1, 2, 3], cl)
    across = all_to_all_seconds(nbytes, [0, 8, 1, 9], cl)
    assert across > 3 * inside
    group = cl.groups[0]
    assert inside == pytest.approx(nbytes * 3 / 4 / group.intra_node.bandwidth + 3 * group.intra_node.latency)
    remote = cl.link(0, 8)
    assert across == pytest.approx(max(nbytes / 4 / group.intra_node.bandwidth, nbytes * 2 / 4 / remote.bandwidth)
                                   + 3 * remote.latency)
    assert all_to_all_seconds(nbytes, [0], cl) == 0.0


def _cost(model, tp, dp, ep, etp, nodes=2, zero1=False, m=2):
    pl = PipelineConfig(micro_batch_size=1, num_microbatches=m)
    spec = RunSpec.of(model, tp, 1, dp, pl, sequence_parallel=tp > 1, ep=ep, etp=etp, distributed_optimizer=zero1)
    return CostModel(spec, load_cluster("h100-80g-ib", nodes))


def test_dispatch_cost_on_the_links_it_crosses():
    """alltoall over ep: ep 8 inside a node (tp 1 x dp 16: the ep group is 8 neighbouring ranks) against ep 2 across
    nodes (etp 8: the ep group's two ranks sit 8 apart); allgather over etp x ep."""
    model = replace(ModelConfig(**MIXTRAL), num_layers=2)
    a2a = replace(model.moe, token_dispatcher_type="alltoall")
    inside = _cost(replace(model, moe=a2a), 1, 16, 8, 1)
    assert inside.expert_ranks(0, "ep") == list(range(8))
    across = _cost(replace(model, moe=a2a), 8, 2, 2, 8)
    assert across.expert_ranks(0, "ep") == [0, 8]
    f_in, b_in = inside.moe_dispatch(0)
    assert f_in > 0 and b_in == pytest.approx(f_in)
    # the same bytes per rank (T k h e with T the tokens of s/tp rows) cross one node boundary: slower per byte
    per_byte_in = f_in / (4096 * 2 * 4096 * 2)
    f_across, _ = across.moe_dispatch(0)
    assert f_across / (4096 // 8 * 2 * 4096 * 2) > per_byte_in
    assert _cost(model, 1, 16, 1, 1).moe_dispatch(0) == (0.0, 0.0)  # one rank holds all the experts
    ag = _cost(replace(model, moe=replace(model.moe, token_dispatcher_type="allgather")), 1, 16, 8, 1)
    assert ag.expert_ranks(0, "etp_ep") == list(range(8)) and ag.moe_dispatch(0)[0] > 0
    # load imbalance: the busiest rank's exchange and compute grow
    hot = CostModel(inside.spec, inside.cluster, settings=replace(inside.settings, moe_imbalance=2.0))
    dev = inside.devices[0]
    assert hot.moe_dispatch(0)[0] > f_in
    assert hot.unit_times("moe", None, dev, 0)[0] > inside.unit_times("moe", None, dev, 0)[0]


def test_expert_gradients_reduce_over_edp():
    model = replace(ModelConfig(**MIXTRAL), num_layers=2)
    # dp 16, ep 8: edp 2 (expert elements count by the edp ring's per-element time over the dp ring's)
    cost = _cost(model, 1, 16, 8, 1)
    assert cost.spec.edp == 2
    edp, dp = cost.expert_link(0, "edp"), cost.dp_link(0)
    assert cost.reduced_elements(0, 10.0, 100.0) == pytest.approx(10 + 100 * (1 / 2 / edp.bandwidth)
                                                                  / (15 / 16 / dp.bandwidth))
    assert cost.expert_sync_time(0) == 0.0  # in the buckets
    # ep 16 over 16 dp ranks: edp 1, nothing to reduce of the experts
    assert _cost(model, 1, 16, 16 // 2, 2).spec.edp == 1
    # tp 8 (SP), etp 1: dp x cp 1 but edp 8 / ep: reduced after the pipeline
    alone = _cost(model, 8, 1, 2, 1, nodes=1)
    assert alone.spec.grad_dp == 1 and alone.spec.edp == 4
    assert alone.expert_sync_time(0) > 0
    assert alone.finish_times([0.0], [None])[0] >= alone.expert_sync_time(0)


def test_spec_checks_the_expert_layout():
    model, pl = _model(), PipelineConfig(micro_batch_size=1, num_microbatches=2)
    with pytest.raises(UsageError, match="does not divide --num-experts"):
        RunSpec.of(model, 1, 1, 6, pl, ep=3)
    with pytest.raises(UsageError, match="does not divide a stage"):
        RunSpec.of(model, 1, 1, 2, pl, ep=4)
    with pytest.raises(UsageError, match="needs --sequence-parallel"):
        RunSpec.of(model, 2, 1, 1, pl, ep=2, etp=1)
    with pytest.raises(UsageError, match="no experts"):
        RunSpec.of(replace(model, moe=None), 1, 1, 2, pl, ep=2)
    with pytest.raises(UsageError, match="zero-bubble"):
        RunSpec.of(model, 1, 2, 1, replace(pl, schedule="zb-h1"))
    spec = RunSpec.of(model, 2, 1, 4, pl, sequence_parallel=True, ep=4, etp=1)
    assert (spec.ep, spec.etp, spec.edp) == (4, 1, 2)
    assert spec.describe_degrees() == "tp 2 x pp 1 x dp 4 (ep 4, etp 1)"


# ---- search and plan ---------------------------------------------------------------------------------------------
def test_search_space_enumerates_ep_etp_for_moe_only():
    dense = replace(_model(), moe=None)
    assert {(lay.ep, lay.etp) for lay in layouts(SearchSpace(), dense, 8, 8, [1, 2])} == {(1, None)}
    with pytest.raises(UsageError, match="no experts"):
        layouts(SearchSpace.parse(["ep=2"]), dense, 8, 8, [1])
    model = _model()
    got = layouts(SearchSpace(), model, 8, 8, [1, 2])
    assert {lay.ep for lay in got} == {1, 2, 4, 8}
    for lay in got:
        assert 8 % lay.ep == 0 and (lay.tp * lay.cp * lay.dp) % (lay.ep * lay.etp) == 0
        assert lay.etp in (1, lay.tp) and lay.schedule != "zb-h1"
    asked = layouts(SearchSpace.parse(["ep=1,2,4", "etp=1,2"]), model, 8, 8, [2])
    assert {(lay.ep, lay.etp) for lay in asked} <= {(e, t) for e in (1, 2, 4) for t in (1, 2)}
    assert (4, 2) in {(lay.ep, lay.etp) for lay in asked if lay.dp == 4}
    assert all(lay.ep * lay.etp <= lay.tp * lay.dp for lay in asked)


def test_search_space_keeps_to_expert_layouts_the_runtime_builds():
    """run_parts.check_moe's rules: experts with biases stay whole over etp (etp 1 only), the shared experts split
    over tp, and each tp rank routes a whole share of a rank's rows."""
    biased = replace(_model(), add_bias_linear=True)
    got = layouts(SearchSpace(), biased, 8, 8, [1, 2])
    assert {lay.etp for lay in got} == {1} and {lay.tp for lay in got} == {1, 2}
    assert {lay.etp for lay in layouts(SearchSpace.parse(["etp=1,2"]), biased, 8, 8, [2])} == {1}
    from megatron_bmw.planner.space import tp_degrees
    assert tp_degrees(_model(shared_expert_intermediate_size=96), 8, 8) == [1, 2]
    assert tp_degrees(_model(shared_expert_intermediate_size=48), 8, 8) == [1, 2]
    assert tp_degrees(_model(shared_expert_intermediate_size=33), 8, 8) == [1]
    short = replace(_model(), seq_length=6, max_position_embeddings=6)
    assert {lay.tp for lay in layouts(SearchSpace(), short, 8, 8, [1, 2, 4])} == {1, 2}


def test_a_plan_with_ep_etp_round_trips():
    model = _model()
    pl = PipelineConfig(micro_batch_size=1, num_microbatches=2)
    spec = RunSpec.of(model, 2, 1, 4, pl, sequence_parallel=True, ep=4, etp=1, distributed_optimizer=True)
    plan = Plan(spec=spec, global_batch_size=8, devices=["h100"] * 8)
    data = plan.to_json()
    assert data["parallel"]["expert_model_parallel_size"] == 4 and data["parallel"]["expert_tensor_parallel_size"] == 1
    assert data["model"]["moe"]["num_experts"] == 8
    back = Plan.from_json(data)
    assert back.spec == spec and (back.spec.ep, back.spec.etp) == (4, 1)
    flags = plan_flags(back)
    assert (flags["expert_model_parallel_size"], flags["expert_tensor_parallel_size"]) == (4, 1)
    bad = {**data, "parallel": {**data["parallel"], "expert_model_parallel_size": 3}}
    with pytest.raises(UsageError, match="does not divide --num-experts"):
        Plan.from_json(bad)


MIXTRAL = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
               swiglu=True, position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
               params_dtype="bf16", seq_length=4096, max_position_embeddings=4096, vocab_size=32000,
               untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0,
               moe=MoEConfig(num_experts=8, router_topk=2, token_dispatcher_type="alltoall"))


@pytest.mark.slow  # a whole search (about 5 s alone, 15 s on a loaded 2-core machine)
def test_mixtral_like_search_picks_expert_parallelism():
    """On 4 H100 nodes, global batch 256: every ranked plan fits, and the best spreads the experts (ep > 1)."""
    from megatron_bmw.planner.search import SearchSettings, search

    model = ModelConfig(**MIXTRAL)
    cl = load_cluster("h100-80g-ib", 4)
    got = search(model, 32000, 128, 256, cl, settings=SearchSettings(top_k=3))
    assert got.best.spec.ep > 1
    cap = cl.groups[0].device.memory_bytes
    assert all(m.peak_bytes <= cap for r in got.ranked for m in r.evaluation.memory)
    assert all(r.fits for r in got.ranked)
