"""ZB-1p and ZB-2p (pipeline/zb_search.py): checked, within their memory limit, never slower than ZB-H1."""

import itertools

import pytest

from megatron_bmw.config import PipelineConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.pipeline.build import build_schedule
from megatron_bmw.pipeline.checker import check
from megatron_bmw.pipeline.generators import compute_schedule, generate, zb_h1
from megatron_bmw.pipeline.holding import resident_peaks
from megatron_bmw.pipeline.zb_search import equal_times, greedy_order, makespan, zb_search


def _heavy_last(p: int, w: float = 0.6, send: float = 0.05, head: float = 1.8) -> list[tuple]:
    """Equal transformer stages and a last stage with the output head (`head` x their time)."""
    return [(1.0, 1.1, w, send)] * (p - 1) + [(head, head * 1.05, w * head, 0.0)]


def _skewed(p: int) -> list[tuple]:
    """Unequal stages: the first carries the embedding (light), the middle ones vary, the last the head."""
    return [(0.7 + 0.1 * (s % 3), 0.8 + 0.15 * (s % 2), 0.4 + 0.1 * (s % 4), 0.02 * (s + 1))
            for s in range(p - 1)] + [(1.5, 1.6, 0.7, 0.0)]


CASES = [(p, m, kind) for p, m, kind in itertools.product((1, 2, 3, 4, 6, 8), (1, 2, 5, 8, 13, 24),
                                                            ("equal", "heavy", "skewed"))]


def _times(kind: str, p: int):
    return {"equal": None, "heavy": _heavy_last(p), "skewed": _skewed(p)}[kind]


@pytest.mark.parametrize("name", ("zb-1p", "zb-2p"))
def test_checked_within_memory_never_slower_than_zb_h1(name):
    for p, m, kind in CASES:
        times = _times(kind, p)
        compute = zb_search(name, p, m, times)
        check(generate(name, p, m, 1, times))
        limit = p if name == "zb-1p" else 2 * p
        assert max(resident_peaks(compute)) <= limit, (p, m, kind)
        timed = times or equal_times(p)
        assert makespan(compute, timed) <= makespan(zb_h1(p, m), timed) + 1e-9, (p, m, kind)
        assert sorted(a.kind.value for a in compute.actions[0]).count("W") == m


def test_zb_2p_fills_the_bubble_zb_h1_leaves():
    """Where W is shorter than F and B, ZB-H1 keeps (p-1)(F+B-W) of bubble; the 2p limit's extra warm-up forwards
    fill it."""
    for p, m in ((4, 8), (4, 16), (8, 24)):
        times = [(1.0, 1.0, 0.5, 0.0)] * p
        assert makespan(zb_search("zb-2p", p, m, times), times) < makespan(zb_h1(p, m), times) - 0.5
        with_comm = [(1.0, 1.1, 0.7, 0.1)] * p
        assert makespan(zb_search("zb-2p", p, m, with_comm), with_comm) < makespan(zb_h1(p, m), with_comm)


def test_the_walk_alone_respects_its_limit_and_fills_with_w():
    """The greedy walk (before the candidates are compared) keeps every limit and places every pass once."""
    for p, m, limit in ((4, 12, 4), (4, 12, 8), (6, 9, 3), (3, 5, 1)):
        order = greedy_order(p, m, _skewed(p), [float(limit)] * p)
        sched = compute_schedule("zb-1p", p, m)  # shape only
        sched.actions = order
        assert max(resident_peaks(sched)) <= limit
        for acts in order:
            assert sorted((a.kind.value, a.microbatch) for a in acts) == sorted(
                (k, i) for k in ("F", "BI", "W") for i in range(m))


def test_deterministic_and_regenerated_from_the_plan_times():
    times = _skewed(4)
    a, b = zb_search("zb-2p", 4, 10, times), zb_search("zb-2p", 4, 10, [list(t) for t in times])
    assert a.to_text() == b.to_text()
    pipeline = PipelineConfig(num_microbatches=10, schedule="zb-2p", schedule_times=times)
    again = PipelineConfig.from_json(pipeline.to_json(), 10)
    assert build_schedule(again, 4).to_text(comm=True) == generate("zb-2p", 4, 10, 1, times).to_text(comm=True)
    assert build_schedule(PipelineConfig(num_microbatches=10, schedule="zb-1p"), 4).to_text() == \
        zb_search("zb-1p", 4, 10, equal_times(4)).to_text()


def test_bad_times_are_usage_errors():
    with pytest.raises(UsageError, match="pipeline.schedule_times: 3 stages of times for 4"):
        build_schedule(PipelineConfig(num_microbatches=4, schedule="zb-2p", schedule_times=_skewed(3)), 4)
    with pytest.raises(UsageError, match="stage 1 needs"):
        zb_search("zb-1p", 2, 4, [(1, 1, 1, 0), (1, -1, 1, 0)])
    with pytest.raises(UsageError, match="only zb-1p, zb-2p take stage times"):
        PipelineConfig(num_microbatches=4, schedule="zb-h1", schedule_times=_skewed(2))
    with pytest.raises(UsageError, match="expected per stage"):
        PipelineConfig(num_microbatches=4, schedule="zb-1p", schedule_times=[1, 2])
