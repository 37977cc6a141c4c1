"""Context parallelism through the pipeline engine: loss and every gradient equal to the serial model (gloo, fp32)
on cp2, cp4, cp2 x tp2 + SP, cp2 x pp2 (sub-layer cut, interleaved, zero-bubble, BPipe, slicing), cp2 x dp2, with
grouped-query attention and rope, learned positions, both attention kinds (p2p ring, a2a) and recomputation."""

import pytest
import torch

from megatron_bmw.config import ParallelConfig
from megatron_bmw.models.chunk import cp_shard
from megatron_bmw.parallel import deferred_wgrad
from megatron_bmw.parallel.grad_sync import GradSync
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.pipeline.checker import check
from megatron_bmw.pipeline.engine import PipelineEngine, reduce_loss
from megatron_bmw.pipeline.stages import hidden_shape, pipeline_setup
from tests.dist_harness import run_distributed
from tests.reference import (LLAMA, SEED, expected_shard, make_batch, pipeline_of, reference_name, serial_reference,
                             small_config, split_batch)

TOL = dict(rtol=1e-5, atol=1e-6)
MBS = 2
SEQ = 128
GQA = {**LLAMA, "num_layers": 2, "seq_length": SEQ}  # rope over half the head, 2 query groups, SwiGLU, RMSNorm
GPT2 = {"num_layers": 2, "seq_length": SEQ}  # learned absolute positions, biases, tied output
MIXED = (None, "selective", "full", "selective", None, None)  # per unit over 2 layers


def _micro(cfg, m: int, dp: int):
    return split_batch(make_batch(cfg, MBS * m * dp, seed=11), m * dp)


def _run_case(rank, world_size, case, ref_loss, ref_grads):
    tp, cp, pp, v, schedule, m, overrides = case
    opts = {k: val for k, val in overrides.items() if k.startswith("_")}
    cfg = small_config(**{k: val for k, val in overrides.items() if not k.startswith("_")})
    order = "bpipe" if opts.get("_bpipe") else "tp-dp-pp"
    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                            context_parallel_size=cp, sequence_parallel=opts.get("_sp", False),
                                            cp_comm_type=opts.get("_comm", "p2p"), rank_order=order))
    dp = st.dp_size
    pipe = pipeline_of(cfg, overrides, MBS, m, pp, v, schedule, opts.get("_partition"), bpipe=opts.get("_bpipe", False),
                       slicing=opts.get("_slicing", 0))
    chunks, sched, _ = pipeline_setup(cfg, st, SEED, pipe)
    check(sched)
    params = [p for c in chunks for p in c.parameters()]
    sync = GradSync(params, st, bucket_size=2000, overlap=dp > 1)
    engine = PipelineEngine(chunks, st, sched, hidden_shape(cfg, st, MBS), cfg.torch_dtype)
    micro = _micro(cfg, m, dp)
    mine = [cp_shard(micro[i * dp + st.dp_rank], cp, st.cp_rank) for i in range(m)]
    loss = reduce_loss(engine.run(lambda i: mine[i], grad_sync=sync), st, m)
    assert not deferred_wgrad.pending()
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (case, loss, ref_loss)
    names = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            full = ref_grads[reference_name(name, cfg)]
            torch.testing.assert_close(p.main_grad, expected_shard(full, p, st), **TOL,
                                       msg=lambda msg: f"{case} {name}: {msg}")
            names.append(name)
    ev = reduce_loss(engine.run(lambda i: mine[i], forward_only=True), st, m)
    assert ev == pytest.approx(loss, rel=1e-6)
    st.destroy()
    return names


def _run_cases(rank, world_size, cases):
    return [_run_case(rank, world_size, *c) for c in cases]


# (tp, cp, pp, v, schedule, m, overrides); "_" options: _sp, _comm (p2p | a2a), _partition, _bpipe, _slicing
CASES = {
    2: [
        (1, 2, 1, 1, "1f1b", 2, GQA),
        (1, 2, 1, 1, "1f1b", 2, {**GPT2, "_comm": "a2a"}),
        (1, 2, 1, 1, "1f1b", 2, {**GQA, "num_attention_heads": 4, "num_query_groups": 1}),  # multi-query
        (1, 2, 1, 1, "1f1b", 2, {**GQA, "_comm": "a2a", "_recompute": MIXED}),
        (1, 2, 1, 1, "1f1b", 1, {**GPT2, "_recompute": MIXED}),
    ],
    4: [
        (2, 2, 1, 1, "1f1b", 2, {**GQA, "_sp": True}),  # cp2 x tp2 + SP
        (2, 2, 1, 1, "1f1b", 2, {**GPT2, "_sp": True, "_comm": "a2a"}),
        (1, 2, 2, 1, "1f1b", 3, {**GQA, "_partition": "2,4"}),  # cp2 x pp2, a stage ends after an attention unit
        (1, 2, 2, 2, "1f1b", 2, {**GPT2, "num_layers": 4}),  # interleaved
        (1, 2, 2, 1, "zb-h1", 3, {**GQA, "_partition": "2,4", "_recompute": MIXED}),
        (1, 2, 2, 2, "zbv", 2, {**GQA, "_partition": "2,1,1,2"}),
        (1, 2, 2, 1, "1f1b", 4, {**GPT2, "_bpipe": True}),
        (1, 2, 2, 1, "1f1b", 3, {**GQA, "_slicing": 2}),
        (1, 4, 1, 1, "1f1b", 2, GQA),  # cp4
        (1, 4, 1, 1, "1f1b", 2, {**GPT2, "_comm": "a2a"}),
        (1, 2, 1, 1, "1f1b", 2, GQA),  # cp2 x dp2: gradients over dp x cp
    ],
}


def _case_refs(world_size):
    out = []
    for case in CASES[world_size]:
        tp, cp, pp, *_ = case
        m, overrides = case[5], case[6]
        cfg = small_config(**{k: val for k, val in overrides.items() if not k.startswith("_")})
        ref_loss, ref_grads, _ = serial_reference(cfg, _micro(cfg, m, world_size // (tp * cp * pp)))
        out.append((case, ref_loss, ref_grads))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ws", sorted(CASES))
def test_context_parallel_equals_serial(ws):
    cases = _case_refs(ws)
    names = run_distributed(ws, _run_cases, cases)
    for i, (case, _, grads) in enumerate(cases):
        covered = {n for rank_names in names for n in rank_names[i]}
        assert set(grads) <= covered <= set(grads) | {"units.head.output_weight"}, case  # (the tied copy)
