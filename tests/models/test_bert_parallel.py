"""BERT through the pipeline engine: loss and every gradient equal to the serial model (gloo, fp32) for tensor
parallelism (+SP), pipelines with sub-layer cuts, data parallelism, interleaving, BPipe, slicing and
recomputation."""

import pytest
import torch

from megatron_bmw.config import ParallelConfig
from megatron_bmw.models.bert import drain_reported
from megatron_bmw.parallel.grad_sync import GradSync
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.pipeline.checker import check
from megatron_bmw.pipeline.engine import PipelineEngine, reduce_loss
from megatron_bmw.pipeline.slicing import num_sliced
from megatron_bmw.pipeline.stages import hidden_shape, pipeline_setup
from tests.dist_harness import run_distributed
from tests.models.bert_reference import bert_batch, bert_config, split_micro
from tests.reference import serial_reference  # a BERT config builds BERT's units
from tests.reference import SEED, expected_shard, pipeline_of, reference_name

TOL = dict(rtol=1e-5, atol=1e-6)
MBS = 4  # even: slicing halves micro-batches


def _micro(cfg, dp, m):
    return split_micro(bert_batch(cfg, MBS * m * dp, seed=5), m * dp)


def _reference(ws, tp, pp, m, overrides):
    """The serial model's loss, gradients and (lm, sop) parts, computed once in the parent."""
    cfg = bert_config(**overrides)
    micro = _micro(cfg, ws // (tp * pp), m)
    loss, grads, model = serial_reference(cfg, micro)
    return loss, grads, drain_reported([model]) / len(micro)


def _run_case(rank, world_size, ref, tp, pp, v, m, partition, overrides, extra):
    cfg = bert_config(**overrides)
    dp = world_size // (tp * pp)
    micro = _micro(cfg, dp, m)
    ref_loss, ref_grads, ref_parts = ref
    bpipe, slicing = extra.get("bpipe", False), extra.get("slicing", 0)
    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                            sequence_parallel=extra.get("sp", False),
                                            rank_order="bpipe" if bpipe else "tp-dp-pp"))
    pipeline = pipeline_of(cfg, overrides, MBS, m, pp, v, "1f1b", partition, bpipe=bpipe, slicing=slicing)
    chunks, sched, _ = pipeline_setup(cfg, st, SEED, pipeline)
    check(sched)
    assert num_sliced(sched) == slicing
    params = [p for c in chunks for p in c.parameters()]
    sync = GradSync(params, st, bucket_size=3000, overlap=extra.get("overlap", False))
    engine = PipelineEngine(chunks, st, sched, hidden_shape(cfg, st, MBS), cfg.torch_dtype)
    mine = [micro[i * dp + st.dp_rank] for i in range(m)]
    loss = reduce_loss(engine.run(lambda i: mine[i], grad_sync=sync), st, m)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    parts = drain_reported(chunks)
    if parts is not None:  # this rank holds the head: the (lm, sop) of its micro-batches
        assert parts.shape == (2,)
        if dp == 1:
            torch.testing.assert_close(parts / m, ref_parts, rtol=1e-5, atol=1e-6)
    names = set()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            full = ref_grads[reference_name(name, cfg)]
            torch.testing.assert_close(p.main_grad, expected_shard(full, p, st), **TOL,
                                       msg=lambda msg: f"{name}: {msg}")
            names.add(name)
    # evaluation: the same loss, no gradient touched
    before = [p.main_grad.clone() for p in params]
    assert reduce_loss(engine.run(lambda i: mine[i], forward_only=True), st, m) == pytest.approx(loss, rel=1e-6)
    assert all(torch.equal(a, p.main_grad) for a, p in zip(before, params))
    sync.remove_hooks()
    return sorted(names), sorted(ref_grads)


MIXED = (None, "selective", "full", "full", None, None, "full", "selective", None, None)  # 4 layers, per unit
# world size: (tp, pp, v, m, partition, model overrides, extra)
CASES = {
    2: [
        (2, 1, 1, 2, None, {}, {}),  # tp2
        (2, 1, 1, 2, None, {"attention_backend": "flash", "recompute_granularity": "selective"}, {"sp": True}),
        (1, 2, 1, 3, "4,6", {"num_layers": 4, "_recompute": MIXED}, {}),  # stage 0 ends after attn_1
        (1, 1, 1, 2, None, {"bert_binary_head": False}, {"overlap": True}),  # dp2, no binary head
        (1, 2, 2, 4, None, {"num_layers": 4}, {}),  # interleaved
        (1, 2, 1, 4, None, {"untie_embeddings_and_output_weights": True}, {"slicing": 2}),
    ],
    4: [
        (1, 4, 1, 6, None, {"num_layers": 4}, {"bpipe": True}),
        (2, 2, 1, 3, "5,5", {"num_layers": 4, "recompute_granularity": "full"}, {"sp": True, "slicing": 1}),
    ],
}
PARAMS = [(ws, *case) for ws, cases in CASES.items() for case in cases]
IDS = ["tp2", "tp2-sp-flash-selective", "pp2-cut-recompute", "dp2-overlap-no-binary-head", "pp2-interleaved",
       "pp2-slicing-untied", "pp4-bpipe", "tp2-pp2-sp-full-recompute-slicing"]


@pytest.mark.slow
@pytest.mark.parametrize("ws,tp,pp,v,m,partition,overrides,extra", PARAMS, ids=IDS)
def test_bert_pipeline_equals_serial(ws, tp, pp, v, m, partition, overrides, extra):
    ref = _reference(ws, tp, pp, m, overrides)
    out = run_distributed(ws, _run_case, ref, tp, pp, v, m, partition, overrides, extra)
    covered = {n for names, _ in out for n in names}
    expected = set(out[0][1])
    if pp > 1 and not overrides.get("untie_embeddings_and_output_weights"):
        expected.add("units.head.output_weight")
    assert covered == expected
