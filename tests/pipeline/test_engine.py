"""Pipeline engine: loss and every gradient equal to the serial model on many layouts (gloo, fp32)."""

import pytest
import torch

from megatron_bmw.config import ParallelConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.parallel import deferred_wgrad
from megatron_bmw.parallel.grad_sync import GradSync
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.pipeline.checker import check
from megatron_bmw.pipeline.engine import PipelineEngine, reduce_loss
from megatron_bmw.pipeline.partition import default_partition, parse_partition
from megatron_bmw.pipeline.stages import hidden_shape, pipeline_setup
from tests.dist_harness import run_distributed
from tests.reference import (LLAMA, QK_1P, SEED, expected_shard, make_batch, pipeline_of, reference_name,
                             serial_reference, small_config, split_batch)

TOL = dict(rtol=1e-5, atol=1e-6)
MBS = 2  # micro-batch size


def _micro(cfg, m: int, dp: int):
    return split_batch(make_batch(cfg, MBS * m * dp, seed=11), m * dp)


def _run_case(rank, world_size, tp, pp, v, schedule, partition, m, overrides, overlap, ref_loss, ref_grads):
    sp = overrides.get("_sp", False)
    timed = {"schedule_times": overrides["_times"]} if "_times" in overrides else {}
    overrides = {k: val for k, val in overrides.items() if not k.startswith("_")}
    cfg = small_config(**overrides)
    dp = world_size // (tp * pp)
    micro = _micro(cfg, m, dp)
    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                            sequence_parallel=sp))
    chunks, sched, _ = pipeline_setup(cfg, st, SEED, pipeline_of(cfg, overrides, MBS, m, pp, v, schedule, partition,
                                                                **timed))
    check(sched)
    params = [p for c in chunks for p in c.parameters()]
    sync = GradSync(params, st, bucket_size=2000, overlap=overlap)
    engine = PipelineEngine(chunks, st, sched, hidden_shape(cfg, st, MBS), cfg.torch_dtype)
    mine = [micro[i * dp + st.dp_rank] for i in range(m)]
    result = engine.run(lambda i: mine[i], grad_sync=sync)
    assert not deferred_wgrad.pending()  # every deferred weight gradient ran
    loss = reduce_loss(result, st, m)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    names = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            full = ref_grads[reference_name(name, cfg)]
            torch.testing.assert_close(p.main_grad, expected_shard(full, p, st), **TOL,
                                       msg=lambda msg: f"{name}: {msg}")
            names.append(name)
    # a second iteration after zeroing gives the same gradients (buffers and hooks re-arm correctly)
    sync.zero()
    again = reduce_loss(engine.run(lambda i: mine[i], grad_sync=sync), st, m)
    assert again == pytest.approx(loss, rel=1e-6)
    # forward-only (evaluation) gives the same loss and touches no gradient
    before = [p.main_grad.clone() for p in params]
    ev = reduce_loss(engine.run(lambda i: mine[i], forward_only=True), st, m)
    assert ev == pytest.approx(loss, rel=1e-6)
    assert all(torch.equal(a, p.main_grad) for a, p in zip(before, params))
    return names


def _cfg_names(overrides):
    _, grads, _ = serial_reference(small_config(**overrides), split_batch(make_batch(small_config(**overrides), 2, 1), 1))
    return set(grads)


MIXED = (None, "selective", "full", "full", None, None, "full", "selective", None, None)  # 4 layers, per unit
# (tp, pp, v, schedule, partition, m, overrides)
CASES = {
    2: [
        (1, 2, 1, "1f1b", None, 1, {}),
        (1, 2, 1, "1f1b", None, 2, {}),
        (1, 2, 1, "1f1b", None, 5, {}),
        (1, 2, 1, "gpipe", "3,7", 3, {"num_layers": 4}),  # uneven
        (1, 2, 1, "1f1b", "4,6", 4, {"num_layers": 4}),  # stage 0 ends after an attention unit
        (1, 2, 2, "1f1b", None, 2, {"num_layers": 4}),  # interleaved
        (1, 2, 2, "1f1b", "2,1,2,5", 4, {"num_layers": 4, "untie_embeddings_and_output_weights": True}),
        (2, 1, 1, "1f1b", None, 3, {}),
        (1, 1, 1, "1f1b", None, 3, {}),  # dp=2
        (1, 2, 1, "1f1b", "4,6", 4, {"num_layers": 4, "_recompute": MIXED}),  # per-unit recomputation
        (1, 2, 1, "1f1b", "4,6", 4, {"num_layers": 4, **LLAMA}),  # Llama layers, sub-layer cut
        # Llama with --qk-layernorm and --apply-layernorm-1p, interleaved, recomputation mixed per unit
        (1, 2, 2, "1f1b", None, 2, {"num_layers": 4, **LLAMA, **QK_1P, "_recompute": MIXED}),
        # zero-bubble: B/W split, sub-layer cut, per-unit recomputation
        (1, 2, 1, "zb-h1", "4,6", 4, {"num_layers": 4, "_recompute": MIXED}),
    ],
    4: [
        (1, 4, 1, "1f1b", None, 3, {"num_layers": 4}),
        (1, 4, 1, "1f1b", "2,3,2,3", 6, {"num_layers": 4}),
        (1, 4, 1, "gpipe", None, 4, {"num_layers": 4}),
        (2, 2, 1, "1f1b", "5,1", 3, {}),
        (2, 2, 1, "1f1b", None, 4, {"_sp": True, "recompute_granularity": "full"}),
        (1, 2, 1, "1f1b", "1,5", 3, {}),  # dp=2, first stage is the embedding alone
        (1, 4, 2, "1f1b", None, 4, {"num_layers": 8}),
        (1, 4, 2, "1f1b", None, 8, {"num_layers": 8, "attention_backend": "flash"}),
        (2, 2, 1, "1f1b", "5,5", 4, {"num_layers": 4, "_sp": True, "_recompute": MIXED}),
        # Llama: tp2 + SP, GQA over tp, q/k LayerNorm weights summed over tp
        (2, 2, 1, "1f1b", "5,5", 4, {"num_layers": 4, "_sp": True, **LLAMA, "qk_layernorm": True}),
        (1, 2, 1, "1f1b", None, 3, {**LLAMA, "num_query_groups": 1}),  # multi-query attention, dp2
        (1, 4, 1, "zb-h1", "2,3,2,3", 6, {"num_layers": 4, "_recompute": MIXED}),
        (2, 2, 1, "zb-h1", "5,5", 4, {"num_layers": 4, "_sp": True, "_recompute": MIXED}),  # tp2 + SP
    ],
    8: [
        (2, 2, 1, "1f1b", None, 3, {}),  # dp=2
        (2, 2, 1, "gpipe", "4,2", 2, {"recompute_granularity": "selective"}),
        (1, 4, 1, "1f1b", None, 5, {"num_layers": 4}),  # dp=2
    ],
}

# every case without DP overlap; the data-parallel ones also with the all-reduce overlapped with backward
PARAMS = [(ws, *case, overlap) for ws, cases in CASES.items() for case in cases
          for overlap in ((False, True) if ws > case[0] * case[1] else (False,))]


@pytest.mark.slow
@pytest.mark.parametrize("ws,tp,pp,v,schedule,partition,m,overrides,overlap", PARAMS)
def test_pipeline_equals_serial(ws, tp, pp, v, schedule, partition, m, overrides, overlap):
    clean = {k: val for k, val in overrides.items() if not k.startswith("_")}
    ref_loss, ref_grads, _ = serial_reference(small_config(**clean), _micro(small_config(**clean), m, ws // (tp * pp)))
    names = run_distributed(ws, _run_case, tp, pp, v, schedule, partition, m, overrides, overlap, ref_loss, ref_grads)
    covered = {n for rank_names in names for n in rank_names}
    expected = _cfg_names(clean)
    if pp > 1 and not clean.get("untie_embeddings_and_output_weights"):
        expected.add("units.head.output_weight")
    assert covered == expected


def test_partitions():
    assert default_partition(4, 2) == [5, 5]
    assert default_partition(5, 2) == [5, 7]
    assert default_partition(8, 4, 2) == [3, 2, 2, 2, 2, 2, 2, 3]
    assert parse_partition("4,6", 4, 2) == [4, 6]
    with pytest.raises(UsageError, match="sums to 9"):
        parse_partition("4,5", 4, 2)
    with pytest.raises(UsageError, match="at least one unit"):
        parse_partition("10,0", 4, 2)
    with pytest.raises(UsageError, match="3 entries"):
        parse_partition("4,4,2", 4, 2)
    with pytest.raises(UsageError, match="comma-separated"):
        parse_partition("a,b", 4, 2)


def test_sent_stage_output_is_freed_and_backward_still_runs():
    """After its send completes, a stage output keeps only its graph (Megatron's deallocate_output_tensor)."""
    from megatron_bmw.pipeline.engine import _Slot, _sent, backward_from

    class Done:
        def is_completed(self):
            return True

    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3)
    out = x @ w + x  # like a unit: a residual add, whose output autograd does not save
    expected = torch.autograd.grad((out * 2.0).sum(), x)[0]
    out = x @ w + x
    slot = _Slot(input=x, output=out)
    assert _sent((Done(), out.detach(), slot))
    assert slot.output.numel() == 1
    backward_from(slot.output, torch.full((4, 3), 2.0))
    assert torch.equal(x.grad, expected)


def test_zb_h1_defers_linear_weight_gradients_to_w():
    """One process, zb-h1: after a B the linear weights have no gradient yet (bias and norm ones do); its W brings
    them; the iteration's gradients equal the serial model's."""
    cfg = small_config()
    micro = _micro(cfg, 2, 1)
    ref_loss, ref_grads, _ = serial_reference(cfg, micro)
    st = ParallelState.serial()
    chunks, sched, _ = pipeline_setup(cfg, st, SEED, pipeline_of(cfg, {}, MBS, 2, 1, 1, "zb-h1"))
    assert sched.to_text() == "rank 0: F0 B0 W0 F1 B1 W1"
    params = dict(chunks[0].named_parameters())
    sync = GradSync(list(params.values()), st)
    seen = {}

    class Probe:  # the engine's tracer: called after every action
        def record(self, a, start, end):
            seen[a.label()] = {n: float(p.main_grad.abs().sum()) for n, p in params.items()}

        def record_wait(self, *args):
            pass

    engine = PipelineEngine(chunks, st, sched, hidden_shape(cfg, st, MBS), cfg.torch_dtype, tracer=Probe())
    loss = reduce_loss(engine.run(lambda i: micro[i], grad_sync=sync), st, 2)
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    linear = [n for n in params if n.endswith(("qkv.weight", "proj.weight", "fc1.weight", "fc2.weight"))]
    assert len(linear) == 4 * cfg.num_layers
    assert all(seen["B0.0"][n] == 0 for n in linear)
    kept = [n for n in params if n.endswith(("qkv.bias", "input_layernorm.weight", "final_layernorm.weight"))]
    assert len(kept) == 2 * cfg.num_layers + 1 and all(seen["B0.0"][n] > 0 for n in kept)
    assert all(seen["W0.0"][n] > 0 for n in linear)
    for name, p in params.items():
        torch.testing.assert_close(p.main_grad, ref_grads[reference_name(name, cfg)], **TOL)


def _run_cases(rank, world_size, cases):
    """Several (case, reference) pairs in one call of the pool: the zero-bubble cases below."""
    return [_run_case(rank, world_size, *case, False, ref_loss, ref_grads) for case, ref_loss, ref_grads in cases]


# (tp, pp, v, schedule, partition, m, overrides): zb-h2, zb-1p, zb-2p and zbv with sub-layer cuts and per-unit
# recomputation; zbv's m need not be a multiple of pp, and its rank 0 holds the embedding and the head (one tied
# Parameter); zb-1p/zb-2p searched for unequal stage times (`_times`: the plan's schedule_times) or equal ones
HEAVY_LAST = {2: [(1.0, 1.0, 0.5, 0.1), (1.6, 1.7, 0.8, 0.0)],
              4: [(1.0, 1.1, 0.6, 0.05)] * 3 + [(2.0, 2.1, 0.9, 0.0)]}
ZB_CASES = {
    2: [(1, 2, 1, "zb-h2", "4,6", 4, {"num_layers": 4, "_recompute": MIXED}),
        (1, 2, 1, "zb-1p", "4,6", 4, {"num_layers": 4, "_recompute": MIXED, "_times": HEAVY_LAST[2]}),
        (1, 2, 1, "zb-2p", "4,6", 5, {"num_layers": 4, "_recompute": MIXED, "_times": HEAVY_LAST[2]}),
        (1, 2, 2, "zbv", "2,3,2,3", 3, {"num_layers": 4, "_recompute": MIXED})],
    4: [(1, 4, 1, "zb-h2", "2,3,2,3", 6, {"num_layers": 4, "_recompute": MIXED}),
        (1, 4, 1, "zb-1p", "2,3,2,3", 6, {"num_layers": 4, "_times": HEAVY_LAST[4]}),
        (1, 4, 1, "zb-2p", "2,3,2,3", 7, {"num_layers": 4, "_recompute": MIXED}),
        (1, 2, 1, "zb-2p", "4,6", 4, {"num_layers": 4, "_times": HEAVY_LAST[2]}),
        (2, 2, 1, "zb-1p", "5,5", 3, {"num_layers": 4, "_sp": True}),
        (1, 4, 2, "zbv", "2,1,1,1,1,1,1,2", 5, {"num_layers": 4, "_recompute": MIXED}),
        (2, 2, 1, "zb-h2", "5,5", 3, {"num_layers": 4, "_sp": True, "_recompute": MIXED}),
        (2, 2, 2, "zbv", "3,2,2,3", 3, {"num_layers": 4, "_sp": True, "_recompute": MIXED})],
}


@pytest.mark.slow
@pytest.mark.parametrize("ws", sorted(ZB_CASES))
def test_zero_bubble_schedules_equal_serial(ws):
    cases = []
    for tp, pp, v, schedule, partition, m, overrides in ZB_CASES[ws]:
        clean = {k: val for k, val in overrides.items() if not k.startswith("_")}
        ref_loss, ref_grads, _ = serial_reference(small_config(**clean), _micro(small_config(**clean), m, ws // (tp * pp)))
        cases.append(((tp, pp, v, schedule, partition, m, overrides), ref_loss, ref_grads))
    names = run_distributed(ws, _run_cases, cases)
    for i, (tp, pp, v, schedule, partition, m, overrides) in enumerate(ZB_CASES[ws]):
        clean = {k: val for k, val in overrides.items() if not k.startswith("_")}
        expected = _cfg_names(clean)
        if schedule != "zbv" and not clean.get("untie_embeddings_and_output_weights"):
            expected.add("units.head.output_weight")  # the last rank's copy of the tied embedding
        assert {n for rank_names in names for n in rank_names[i]} == expected, (schedule, partition)


# full recomputation of the last unit of a stage (whose output is sent) among others, dropout on
DROPOUT_RC = (None, "full", "selective", "full", "full", None, "full", None, None, None)


def _recompute_changes_nothing(rank, world_size, cases):
    """Per (schedule, partition): the largest loss and gradient differences between a run without and one with
    recomputation, dropout on (the same forward order draws the same masks)."""
    from megatron_bmw.parallel.random import set_seeds
    out = []
    for schedule, v, partition, m in cases:
        cfg = small_config(num_layers=4, hidden_dropout=0.1, attention_dropout=0.1)
        mine = _micro(cfg, m, 1)
        runs = []
        for recompute in (None, DROPOUT_RC):
            st = ParallelState.build(ParallelConfig(pipeline_model_parallel_size=world_size))
            set_seeds(SEED, st.tp_rank, st.pp_rank, st.rng)
            pipeline = pipeline_of(cfg, {"_recompute": recompute}, MBS, m, world_size, v, schedule, partition)
            chunks, sched, _ = pipeline_setup(cfg, st, SEED, pipeline)
            sync = GradSync([p for c in chunks for p in c.parameters()], st, bucket_size=2000)
            engine = PipelineEngine(chunks, st, sched, hidden_shape(cfg, st, MBS), cfg.torch_dtype)
            loss = reduce_loss(engine.run(lambda i: mine[i], grad_sync=sync), st, m)
            runs.append((loss, {n: p.main_grad.clone() for c in chunks for n, p in c.named_parameters()}))
        (loss0, g0), (loss1, g1) = runs
        out.append((abs(loss0 - loss1), max(float((g0[n] - g1[n]).abs().max()) for n in g0)))
    return out


@pytest.mark.slow
def test_zero_bubble_recomputation_with_dropout():
    """Recomputation replays dropout exactly under zero-bubble schedules: the deferred W of a recomputed unit
    reaches its Parameter (it once went to the recomputed alias that saved_tensors returns)."""
    cases = [("zb-h1", 1, "4,6", 3), ("zbv", 2, "2,3,2,3", 3)]
    for rank_result in run_distributed(2, _recompute_changes_nothing, cases):
        for (schedule, *_), (dloss, dgrad) in zip(cases, rank_result):
            assert dloss <= 1e-6 and dgrad <= 1e-6, (schedule, dloss, dgrad)
