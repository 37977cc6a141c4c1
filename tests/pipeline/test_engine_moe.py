"""Mixtures of experts through the pipeline engine: loss and every gradient equal to the serial model (gloo, fp32,
the serial model run micro-batch by micro-batch as each dp rank holds them) on ep2 (dp2), ep2 x tp2 + SP, tp2
without SP, etp2, ep2 x pp2 (a stage ending between attention and the MoE unit), ep4 beside tp2, cp2, both
dispatchers, the auxiliary losses, capacity dropping and padding, shared experts and full recomputation.

Every gradient goes through GradSync (expert ones summed over the edp group and scaled by 1 / (dp x cp))."""

import pytest
import torch

from megatron_bmw.config import MoEConfig, ParallelConfig
from megatron_bmw.models.chunk import cp_shard
from megatron_bmw.models.moe import drain_aux_losses
from megatron_bmw.parallel.grad_sync import GradSync
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.pipeline.engine import PipelineEngine, reduce_loss
from megatron_bmw.pipeline.stages import hidden_shape, pipeline_setup
from tests.dist_harness import run_distributed
from tests.reference import (LLAMA, SEED, expected_shard, make_batch, pipeline_of, reference_name, serial_reference,
                             small_config, split_batch)

TOL = dict(rtol=1e-5, atol=1e-6)
MBS = 2
SEQ = 16
AUX = dict(aux_loss_coeff=0.01, z_loss_coeff=0.001)
SWIGLU = {**LLAMA, "seq_length": SEQ}  # no biases: experts split over etp
GPT2 = {"seq_length": SEQ}  # biases (experts' too: etp 1 only)
FULL = (None, None, "full", None, "full", None)


def _config(overrides: dict):
    moe = MoEConfig(**{"num_experts": 4, "ffn_hidden_size": 16, **overrides.get("_moe", {})})
    return small_config(moe=moe, **{k: v for k, v in overrides.items() if not k.startswith("_")})


def _micro(cfg, m: int, dp: int):
    return split_batch(make_batch(cfg, MBS * m * dp, seed=11), m * dp)


def _run_case(rank, world_size, case, ref_loss, ref_grads):
    tp, cp, pp, ep, etp, m, overrides = case
    cfg = _config(overrides)
    st = ParallelState.build(ParallelConfig(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        sequence_parallel=overrides.get("_sp", False), expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp))
    dp = st.dp_size
    pipe = pipeline_of(cfg, overrides, MBS, m, pp, 1, "1f1b", overrides.get("_partition"))
    chunks, sched, _ = pipeline_setup(cfg, st, SEED, pipe)
    named = [(n, p) for c in chunks for n, p in c.named_parameters()]
    sync = GradSync([p for _, p in named], st, bucket_size=2000, overlap=dp > 1)
    engine = PipelineEngine(chunks, st, sched, hidden_shape(cfg, st, MBS), cfg.torch_dtype)
    micro = _micro(cfg, m, dp)
    mine = [cp_shard(micro[i * dp + st.dp_rank], cp, st.cp_rank) for i in range(m)]
    loss = reduce_loss(engine.run(lambda i: mine[i], grad_sync=sync), st, m)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss)
    names = []
    for name, p in named:
        full = ref_grads[reference_name(name, cfg)]
        torch.testing.assert_close(p.main_grad, expected_shard(full, p, st), **TOL, msg=lambda msg: f"{case} {name}: {msg}")
        names.append(name)
    reported = drain_aux_losses(chunks)
    ev = reduce_loss(engine.run(lambda i: mine[i], forward_only=True), st, m)
    assert ev == pytest.approx(loss, rel=1e-6)
    assert drain_aux_losses(chunks) == {}  # evaluation computes no auxiliary losses
    st.destroy()
    counted = st.tp_rank == 0 and st.cp_rank == 0  # the sequence group's ranks report the same whole values
    return names, {k: v.item() for k, v in reported.items()} if counted else {}


def _run_cases(rank, world_size, cases):
    return [_run_case(rank, world_size, *c) for c in cases]


A2A = {"token_dispatcher_type": "alltoall"}
# (tp, cp, pp, ep, etp, m, overrides); "_" options: _moe (MoEConfig), _sp, _partition, _recompute
CASES = {
    2: [
        (1, 1, 1, 2, 1, 2, {**GPT2, "_moe": AUX}),  # ep2 (dp2), allgather, biases
        (1, 1, 1, 2, 1, 2, {**SWIGLU, "_moe": {**AUX, **A2A}}),
        (2, 1, 1, 1, 2, 2, {**SWIGLU, "_sp": True, "_moe": {**AUX, **A2A}}),  # etp2 (= tp2 + SP)
        (2, 1, 1, 1, 2, 1, {**SWIGLU, "_sp": True, "_moe": AUX}),
        (2, 1, 1, 2, 1, 2, {**GPT2, "_moe": {**AUX, **A2A}}),  # tp2 without SP, ep2 etp1: each tp rank routes half
        (1, 2, 1, 2, 1, 2, {**SWIGLU, "_moe": {**AUX, **A2A, "expert_capacity_factor": 0.75,
                                                 "token_drop_policy": "position"}}),  # cp2: serial token order
        (1, 1, 1, 2, 1, 2, {**SWIGLU, "_moe": {**A2A, "expert_capacity_factor": 0.75}}),  # probs drop
        (1, 1, 1, 2, 1, 2, {**GPT2, "_moe": {"expert_capacity_factor": 0.5, "pad_expert_input_to_capacity": True,
                                             "load_balancing_type": "seq_aux_loss", "aux_loss_coeff": 0.1}}),
        (1, 1, 1, 2, 1, 1, {**SWIGLU, "_moe": {**A2A, "router_topk": 1, "load_balancing_type": "sinkhorn"}}),
    ],
    4: [
        (2, 1, 1, 2, 2, 2, {**SWIGLU, "_sp": True, "_moe": AUX}),  # ep2 x tp2 + SP (etp2)
        (2, 1, 1, 2, 2, 2, {**SWIGLU, "_sp": True, "_moe": {**AUX, **A2A}}),
        (2, 1, 1, 4, 1, 2, {**GPT2, "_sp": True, "_moe": {**AUX, **A2A}}),  # ep4 etp1 beside tp2 x dp2
        (2, 1, 1, 4, 1, 2, {**GPT2, "_sp": True, "_moe": AUX}),
        (1, 1, 2, 2, 1, 3, {**SWIGLU, "_partition": "2,4", "_moe": {**AUX, **A2A}}),  # ep2 x pp2
        (1, 1, 2, 2, 1, 3, {**GPT2, "_partition": "3,3", "_recompute": FULL, "_moe": AUX}),
        (2, 2, 1, 2, 1, 2, {**SWIGLU, "_sp": True, "_moe": {**AUX, **A2A, "expert_capacity_factor": 1.0,
                                                            "shared_expert_intermediate_size": 24,
                                                            "shared_expert_gate": True}}),  # cp2 x tp2 + SP
        (1, 1, 1, 4, 1, 2, {**SWIGLU, "_moe": {**AUX, "score_function": "sigmoid", "router_topk": 2,
                                               "load_balancing_type": "seq_aux_loss", "num_experts": 8}}),
    ],
}


def _case_refs(world_size):
    out = []
    for case in CASES[world_size]:
        tp, cp, pp, _, _, m, overrides = case
        cfg = _config(overrides)
        ref_loss, ref_grads, model = serial_reference(cfg, _micro(cfg, m, world_size // (tp * cp * pp)))
        out.append((case, ref_loss, ref_grads, {k: v.item() for k, v in drain_aux_losses([model]).items()}))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ws", sorted(CASES))
def test_moe_equals_serial(ws):
    cases = _case_refs(ws)
    results = run_distributed(ws, _run_cases, [c[:3] for c in cases])
    for i, (case, _, grads, reported) in enumerate(cases):
        covered = {n for rank_results in results for n in rank_results[i][0]}
        assert set(grads) <= covered <= set(grads) | {"units.head.output_weight"}, case  # (the tied copy)
        # the reported auxiliary losses, summed over dp and pipeline ranks, are the serial model's
        total = {}
        for rank_results in results:
            for name, value in rank_results[i][1].items():
                total[name] = total.get(name, 0.0) + value
        assert total.keys() == reported.keys(), case
        for name, value in reported.items():
            assert total[name] == pytest.approx(value, rel=1e-5), (case, name)
