"""Distributed bodies shared by the BPipe and slicing tests: the same iteration with and without a schedule
transform, on one set of ranks, compared bit for bit (and with the serial model)."""

from __future__ import annotations

import re

import torch

from megatron_bmw.config import ParallelConfig
from megatron_bmw.parallel.grad_sync import GradSync
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.pipeline.engine import PipelineEngine, reduce_loss
from megatron_bmw.pipeline.holding import peak_inflight, resident_peaks
from megatron_bmw.pipeline.slicing import num_sliced
from megatron_bmw.pipeline.stages import hidden_shape, pipeline_setup
from megatron_bmw.training.profiler import measure_stage_times
from tests.reference import (SEED, expected_shard, make_batch, pipeline_of, reference_name, serial_reference,
                             small_config, split_batch)

MBS = 4  # micro-batch size (even, so it can be sliced)
REPORT = re.compile(r"activation memory \| stage (\d+) \| peak micro-batches ([\d.]+) \| peak bytes (\d+) \| "
                    r"accepted bytes (\d+)")


def _iteration(cfg, overrides, st, m, v, micro, dp, bpipe, slicing, schedule="1f1b"):
    mine = [micro[i * dp + st.dp_rank] for i in range(m)]
    shape = hidden_shape(cfg, st, MBS)

    def measure(chunks):
        return measure_stage_times(chunks, st, lambda i: mine[i], shape, cfg.torch_dtype)

    pipeline = pipeline_of(cfg, overrides, MBS, m, st.pp_size, v, schedule, bpipe=bpipe, slicing=slicing)
    chunks, sched, _ = pipeline_setup(cfg, st, SEED, pipeline, stage_times=measure)
    params = [p for c in chunks for p in c.parameters()]
    sync = GradSync(params, st, bucket_size=2000)
    engine = PipelineEngine(chunks, st, sched, shape, cfg.torch_dtype, track_activations=True)
    losses, grads = [], []
    for _ in range(2):  # the second iteration runs with the class sizes already known
        sync.zero()
        losses.append(reduce_loss(engine.run(lambda i: mine[i], grad_sync=sync), st, m))
        grads.append({n: p.main_grad.clone() for c in chunks for n, p in c.named_parameters()})
    sync.remove_hooks()
    named = {n: p for c in chunks for n, p in c.named_parameters()}
    return losses, grads, engine.activation_stats(), sched, engine.activation_report(), named


def _micro(cfg, m: int, dp: int):
    return split_batch(make_batch(cfg, MBS * m * dp, seed=11), m * dp)


def run_transformed(world_size, tp, pp, v, m, overrides, bpipe, slicing, base_slicing=0) -> list:
    """`transformed_equals_plain` on `world_size` ranks, with the serial reference computed once, here."""
    from tests.dist_harness import run_distributed

    cfg = small_config(**overrides)
    ref_loss, ref_grads, _ = serial_reference(cfg, _micro(cfg, m, world_size // (tp * pp)))
    return run_distributed(world_size, transformed_equals_plain, tp, pp, v, m, overrides, bpipe, slicing,
                           base_slicing, ref_loss, ref_grads)


def transformed_equals_plain(rank, world_size, tp, pp, v, m, overrides, bpipe, slicing, base_slicing, ref_loss,
                             ref_grads):
    """Loss and gradients with the transform(s) equal those of the plain run (bitwise for BPipe alone) and the
    serial reference; returns this rank's activation numbers for the caller to check."""
    cfg = small_config(**overrides)
    dp = world_size // (tp * pp)
    micro = _micro(cfg, m, dp)
    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                            rank_order="bpipe"))
    plain = _iteration(cfg, overrides, st, m, v, micro, dp, False, base_slicing)
    new = _iteration(cfg, overrides, st, m, v, micro, dp, bpipe, slicing)
    exact = slicing == base_slicing  # BPipe only moves tensors; slicing changes the summation order
    for it in range(2):
        if exact:
            assert new[0][it] == plain[0][it], (new[0][it], plain[0][it])
        else:
            assert abs(new[0][it] - plain[0][it]) <= 1e-6 * abs(plain[0][it])
        assert abs(new[0][it] - ref_loss) <= 1e-5 * abs(ref_loss)
        for name, g in new[1][it].items():
            if exact:
                assert torch.equal(g, plain[1][it][name]), name
            else:
                torch.testing.assert_close(g, plain[1][it][name], rtol=1e-5, atol=1e-7, msg=lambda s: f"{name}: {s}")
            expected = expected_shard(ref_grads[reference_name(name, cfg)], new[5][name], st)
            torch.testing.assert_close(g, expected, rtol=1e-5, atol=1e-6, msg=lambda s: f"{name}: {s}")
    # the schedule's accounting is what the store measured
    stats, sched = new[2], new[3]
    assert stats["peak_microbatches"] == resident_peaks(sched)[st.pp_rank], (stats, resident_peaks(sched))
    assert plain[2]["peak_microbatches"] == peak_inflight(plain[3])[st.pp_rank]
    assert stats["live_microbatches"] == 0 and stats["live_bytes"] == 0 and stats["accepted_bytes"] == 0
    match = REPORT.fullmatch(new[4][0])
    assert match and int(match.group(1)) == st.pp_rank and float(match.group(2)) == stats["peak_microbatches"]
    assert int(match.group(3)) == stats["peak_bytes"]
    transfers = sum(1 for a in sched.actions[st.pp_rank] if a.kind.value in ("EVICT", "ACCEPT"))
    return {"stage": st.pp_rank, "tp": st.tp_rank, "plain": plain[2], "new": new[2], "transfers": transfers,
            "limit": sched.activation_limit, "sliced": num_sliced(sched)}

