"""Transformer Engine's tensor-parallel communication overlap as the planner models it (planner/tp_overlap.py)."""

import pytest

from megatron_bmw.planner.kernel_time import KernelDevice, gemm_time
from megatron_bmw.planner.tp_overlap import (COMM_SMS, PIPELINE_SPLITS, SET_SM_MARGIN, bulk, bulk_shared,
                                             margin_device, pipelined, pipelined_shared, ring_exchange,
                                             unit_overlap_cost)

H100 = KernelDevice(peak_flops=989e12, achievable_fraction=0.65, sm_count=132, memory_bandwidth=3.35e12)


def test_ring_exchange_hides_a_gather_faster_than_its_gemm_and_exposes_the_rest():
    """tp chunks, the first local: a gather whose shards arrive faster than the chunks compute costs nothing; a
    slower one costs its whole time plus the first chunk, less the GEMM."""
    assert ring_exchange(8.0, 5.0, 8) == 0.0
    assert ring_exchange(8.0, 7.0, 8) == 0.0  # 7 shards of 1 s beside 7 chunks of 1 s
    assert ring_exchange(8.0, 14.0, 8) == pytest.approx(1.0 + 14.0 - 8.0)


def test_pipelined_reduce_scatter_costs_the_sm_margin_and_its_last_split():
    g, gm = 4.0, 4.6
    assert pipelined(g, gm, 2.0) == pytest.approx(gm - g + 2.0 / PIPELINE_SPLITS)
    # a reduce-scatter slower than its GEMM: every split waits for the one before
    assert pipelined(g, gm, 8.0) == pytest.approx(gm / PIPELINE_SPLITS + 8.0 - g)


def test_bulk_costs_the_sm_margin_or_the_collective_whichever_is_longer():
    assert bulk(4.0, 4.6, 1.0) == pytest.approx(0.6)
    assert bulk(4.0, 4.6, 5.0) == pytest.approx(1.0)


def test_the_margin_device_has_fewer_sms_each_as_fast():
    low = margin_device(H100)
    assert low.sm_count == 132 - COMM_SMS
    assert low.peak_flops / low.sm_count == pytest.approx(H100.peak_flops / H100.sm_count)
    # a GEMM of many waves slows by about the SMs taken; one that fits a wave of the fewer SMs not at all
    big = gemm_time(8192, 8192, 8192, 2, low) / gemm_time(8192, 8192, 8192, 2, H100)
    assert big == pytest.approx(132 / 116, rel=0.05)
    assert gemm_time(1024, 1024, 8192, 2, low) == pytest.approx(gemm_time(1024, 1024, 8192, 2, H100))


def test_a_unit_pays_the_margin_on_its_pipelined_and_bulk_gemms_only():
    """With TE 2.x's set_sm_margin: forward: QKV's ring exchange free, the projection's pipeline on fewer SMs plus its last split; backward: the
    projection's input gradient free, QKV's input and weight gradients each on fewer SMs."""
    first, last, e, tp, c = (4096, 4608, 12288), (4096, 12288, 1536), 2, 8, 1e-5
    low = margin_device(H100)
    fwd, bwd = unit_overlap_cost(first, last, e, c, tp, H100, sm_margin=True)
    m, n, k = last
    assert fwd == pytest.approx(gemm_time(m, n, k, e, low) - gemm_time(m, n, k, e, H100) + c / PIPELINE_SPLITS)
    m, n, k = first
    margin = [gemm_time(*shape, e, d) for d in (low, H100) for shape in ((m, k, n), (k, n, m))]
    assert bwd == pytest.approx(margin[0] + margin[1] - margin[2] - margin[3])
    assert fwd > 0 and bwd > 0


def test_te_1x_takes_no_sm_margin_by_default():
    """TE 1.4-1.13 (the 2024 runs) default set_sm_margin to False: the GEMMs keep every SM."""
    assert SET_SM_MARGIN is False


def test_without_a_margin_the_gemm_loses_the_communications_sms_only_while_it_runs():
    share = COMM_SMS / 132
    # a short collective beside a long GEMM: the GEMM runs at 1 - share for the collective's length
    assert bulk_shared(4.0, 1.0, share) == pytest.approx(1.0 * share)
    assert bulk_shared(4.0, 5.0, share) == pytest.approx(1.0)  # a longer collective: its excess
    # pipelined: each of the last 3 chunks slowed while the previous chunk's reduce-scatter runs, the last exposed
    assert pipelined_shared(4.0, 2.0, share) == pytest.approx(3 * 0.5 * share + 0.5)
    assert pipelined_shared(4.0, 8.0, share) == pytest.approx(1.0 + 8.0 - 4.0)


def test_a_unit_without_a_margin_pays_less_than_with_one():
    """GPT-3 175B at tp 4 (the NeMo layout): the sequence-parallel collective (about 0.1 ms on NVLink) is a tenth of
    the bulk GEMMs beside it, so sharing SMs for its length costs far less than a margin for the whole GEMM."""
    first, last, e, tp, c = (2048, 9216, 12288), (2048, 12288, 3072), 2, 4, 1e-4
    shared = unit_overlap_cost(first, last, e, c, tp, H100)
    margin = unit_overlap_cost(first, last, e, c, tp, H100, sm_margin=True)
    assert shared == unit_overlap_cost(first, last, e, c, tp, H100, sm_margin=False)
    assert shared[0] < margin[0] and shared[1] < 0.25 * margin[1]
    share = COMM_SMS / H100.sm_count
    assert shared[1] == pytest.approx(2 * c * share)  # QKV's bulk input and weight gradients; dgrad's ring is free
