"""The overlap model: gradient buckets in backward order, reductions on one stream, the exposed part; the
parameter gathers behind the first forwards."""

import pytest

from megatron_bmw.planner.overlap import exposed_gather, gather_lead, grad_buckets, overlapped_end, reduce_end


def test_buckets_fill_in_backward_order_and_are_ready_when_their_units_are():
    # one chunk, last backward from 2 to 6: units (forward order) 10, 30, 30, 30 elements, 1 s of backward each
    chunk = (2.0, 6.0, [(10, 1.0), (30, 1.0), (30, 1.0), (30, 1.0)])
    assert grad_buckets([chunk], bucket_elems=50) == [(60, 4.0), (40, 6.0)]
    assert grad_buckets([chunk], bucket_elems=1000) == [(100, 6.0)]
    # interleaving: chunk 1's last backward ends before chunk 0's, its buckets come first
    early = (0.0, 1.0, [(60, 1.0)])
    assert grad_buckets([chunk, early], bucket_elems=50) == [(60, 1.0), (60, 4.0), (40, 6.0)]


def test_a_bucket_reduced_during_the_backward_costs_nothing_the_last_one_does():
    assert overlapped_end([(4.0, 1.0), (6.0, 1.5)], 6.0, overlap=True) == pytest.approx(7.5)
    assert overlapped_end([(4.0, 1.0), (6.0, 1.5)], 6.0, overlap=False) == pytest.approx(8.5)
    # a slow first reduction delays the next: one stream
    assert overlapped_end([(4.0, 3.0), (6.0, 1.5)], 6.0, overlap=True) == pytest.approx(8.5)
    # the overlap factor slows both sides by what overlapped
    assert overlapped_end([(4.0, 1.0), (6.0, 1.5)], 6.0, overlap=True, factor=1.3) == pytest.approx(7.8)
    chunk = (2.0, 6.0, [(10, 1.0), (30, 1.0), (30, 1.0), (30, 1.0)])
    assert reduce_end([chunk], 6.0, lambda n: n / 40, True, 1.0, bucket_elems=50) == pytest.approx(7.0)


def test_gathers_hide_behind_the_first_forward_except_the_first_bucket():
    units = [(50, 1.0), (50, 1.0)]
    assert exposed_gather([(0.0, 2.0, units)], lambda n: 0.5, bucket_elems=50) == pytest.approx(0.5)
    assert exposed_gather([(3.0, 5.0, units)], lambda n: 0.5, bucket_elems=50) == 0.0
    # gathers slower than the forwards: the second unit waits too
    assert exposed_gather([(0.0, 2.0, units)], lambda n: 2.0, bucket_elems=50) == pytest.approx(3.0)


@pytest.mark.parametrize("gather", [0.1, 0.5, 2.0])
def test_gather_lead_is_the_walk_in_closed_form(gather):
    units = [(30, 0.5), (30, 1.0), (60, 0.2), (10, 0.3)]
    lead = gather_lead(units, lambda n: gather * n / 50, bucket_elems=50)
    for start in (0.0, 0.3, 1.0, 4.0):
        walk = exposed_gather([(start, start + 2.0, units)], lambda n: gather * n / 50, bucket_elems=50)
        assert max(0.0, lead - start) == pytest.approx(walk)
