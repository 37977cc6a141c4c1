"""AutoPipe's micro-batch slicing: the transform, the slicer (Algorithm 2), flag checks, and real runs whose
loss and gradients equal the unsliced run."""

import pytest

from megatron_bmw.errors import UsageError
from megatron_bmw.pipeline.checker import check
from megatron_bmw.pipeline.generators import generate
from megatron_bmw.pipeline.holding import peak_inflight
from megatron_bmw.pipeline.replay import replay
from megatron_bmw.pipeline.schedule import Action, Kind, ScheduleError
from megatron_bmw.pipeline.slicing import (
    check_slicing,
    choose_slices,
    num_sliced,
    parse_slicing,
    slice_microbatches,
    stage_times_from_cost,
)
from tests.pipeline.bpipe_cases import run_transformed
from tests.reference import LLAMA


def test_halves_in_place_on_every_rank():
    s = slice_microbatches(generate("1f1b", 2, 3), 1)
    assert s.to_text() == "rank 0: F0a F0b F1 B0a B0b F2 B1 B2\nrank 1: F0a F0b B0a B0b F1 B1 F2 B2"
    assert "SA0a>1" in s.to_text(comm=True) and "RG0b<1" in s.to_text(comm=True)
    assert num_sliced(s) == 1
    assert slice_microbatches(generate("1f1b", 2, 3), 0).actions == generate("1f1b", 2, 3).actions


@pytest.mark.parametrize("name,p,v", [("1f1b", 2, 1), ("1f1b", 4, 1), ("1f1b", 7, 1), ("gpipe", 3, 1),
                                      ("interleaved", 2, 2), ("interleaved", 4, 2), ("interleaved", 3, 3)])
def test_sliced_schedules_pass_the_checker(name, p, v):
    for m in sorted({p, 2 * p, 3 * p} if v > 1 else {1, 2, p - 1, p, p + 1, 2 * p} - {0}):
        base = generate(name, p, m, v)
        for k in sorted({0, 1, 2, p, m} & set(range(m + 1))):
            s = slice_microbatches(base, k)
            check(s)
            assert num_sliced(s) == k
            assert max(peak_inflight(s)) <= max(peak_inflight(base))  # halves never raise the peak


def _times(f, b):
    def compute(rank, a):
        t = f[rank] if a.kind is Kind.FORWARD else b[rank]
        return t / 2 if a.half is not None else t

    return compute


def _comm(c):
    return lambda src, dst, a: c / 2 if a.half is not None else c


def _last_stage_start(schedule, f, b, c=0.0):
    result = replay(schedule, _times(f, b), _comm(c))
    line = result.timeline[schedule.pp - 1]
    return min(t for a, t, _ in line if a.kind is Kind.FORWARD), result.makespan


def test_last_stage_starts_after_half_the_start_up_time():
    p, m = 8, 16
    f, b = [1.0] * p, [2.0] * p
    start0, _ = _last_stage_start(generate("1f1b", p, m), f, b)
    start1, _ = _last_stage_start(slice_microbatches(generate("1f1b", p, m), 1), f, b)
    assert start0 == 7.0 and start1 == 3.5


@pytest.mark.parametrize("f,b,c,expected", [
    ([1.0] * 4, [2.0] * 4, 0.0, 1),
    ([1.0] * 6, [2.0] * 6, 0.0, 2),
    ([1.0] * 8, [2.0] * 8, 0.0, 2),
    ([1.0, 2.0, 1.0, 2.0], [2.0, 4.0, 2.0, 4.0], 0.0, 1),
    ([2.0, 1.0, 1.0, 1.0, 1.0, 1.0], [4.0, 2.0, 2.0, 2.0, 2.0, 2.0], 0.0, 3),  # heavy first stage
    ([1.0, 1.0, 1.0, 2.0], [2.0, 2.0, 2.0, 4.0], 0.1, 1),
    ([1.0] * 8, [2.0] * 8, 0.5, 2),
])
def test_slicer_against_the_replay(f, b, c, expected):
    """The slicer's k shortens the iteration; without p2p time no other k < p is faster (the replay says)."""
    p, m = len(f), 4 * len(f)
    k = choose_slices(f, b, c, m)
    assert k == expected
    base = generate("1f1b", p, m)
    spans = [_last_stage_start(slice_microbatches(base, j), f, b, c)[1] for j in range(p)]
    assert spans[k] < spans[0]
    if c == 0:
        assert spans[k] == min(spans)


def test_slicer_edge_cases():
    assert choose_slices([1.0], [2.0], 0.0, 8) == 0
    assert choose_slices([1.0] * 8, [2.0] * 8, 0.0, 1) == 1  # never more than there are micro-batches
    with pytest.raises(ValueError, match="backward times"):
        choose_slices([1.0, 1.0], [2.0], 0.0, 4)


def test_stage_times_from_a_cost_model():
    def compute(rank, a):
        return (1.0 + rank) * (2.0 if a.kind is Kind.BACKWARD else 1.0) * (0.5 if a.chunk else 1.0)

    f, b, c = stage_times_from_cost(compute, lambda src, dst, a: 0.25, p=3, v=2)
    assert f == [1.5, 3.0, 4.5] and b == [3.0, 6.0, 9.0] and c == 0.25


def test_flag_values_and_refusals():
    assert parse_slicing("auto") == "auto" and parse_slicing("3") == 3 and parse_slicing(0) == 0
    with pytest.raises(UsageError, match="--microbatch-slicing -1: must be >= 0"):
        parse_slicing("-1")
    with pytest.raises(UsageError, match="expected a number"):
        parse_slicing("many")
    for mbs in (1, 3):
        with pytest.raises(UsageError, match=f"needs an even --micro-batch-size >= 2 .* got {mbs}$"):
            check_slicing(2, mbs, 8)
    with pytest.raises(UsageError, match="more than the 4 micro-batches"):
        check_slicing(5, 2, 4)
    check_slicing(0, 1, 4)
    check_slicing("auto", 2, 4)
    with pytest.raises(UsageError, match="between 0 and the 3"):
        slice_microbatches(generate("1f1b", 2, 3), 4)
    with pytest.raises(ScheduleError, match="already a half"):
        slice_microbatches(slice_microbatches(generate("1f1b", 2, 3), 1), 1)
    from megatron_bmw.pipeline.bpipe import insert_bpipe

    with pytest.raises(ScheduleError, match="before inserting BPipe"):
        slice_microbatches(insert_bpipe(generate("1f1b", 4, 8)), 1)


# (world size, tp, pp, v, m, overrides, bpipe, slicing, base slicing)
DIST_CASES = [
    (2, 1, 2, 1, 4, {}, False, 1, 0),
    (2, 1, 2, 1, 4, {}, False, 2, 0),
    (2, 1, 2, 1, 3, {}, False, "auto", 0),
    (4, 1, 4, 1, 6, {"num_layers": 4}, False, 1, 0),
    (4, 1, 4, 1, 6, {"num_layers": 4}, False, 2, 0),
    (4, 1, 4, 1, 6, {"num_layers": 4}, False, "auto", 0),
    (4, 1, 4, 2, 8, {"num_layers": 8}, False, 2, 0),  # interleaved
    (4, 1, 4, 1, 6, {"num_layers": 4}, True, 2, 2),  # BPipe on a sliced schedule: bit for bit
    (4, 1, 4, 1, 6, {"num_layers": 4}, True, "auto", 0),  # both, against the plain run
    (4, 2, 2, 1, 4, {"num_layers": 4, **LLAMA}, False, 1, 0),  # Llama layers (GQA and SwiGLU over tp2)
]


@pytest.mark.slow
@pytest.mark.parametrize("ws,tp,pp,v,m,overrides,bpipe,slicing,base", DIST_CASES)
def test_sliced_run_equals_unsliced_run(ws, tp, pp, v, m, overrides, bpipe, slicing, base):
    out = run_transformed(ws, tp, pp, v, m, overrides, bpipe, slicing, base)
    sliced = {o["sliced"] for o in out}
    assert len(sliced) == 1  # every rank runs the same schedule
    k = sliced.pop()
    assert k == slicing if slicing != "auto" else 1 <= k <= pp - 1
    if bpipe:
        assert all(o["new"]["peak_microbatches"] <= o["limit"] for o in out)
        assert sum(o["transfers"] for o in out) > 0


def test_halves_unit():
    a = Action(Kind.FORWARD, 0, half=1)
    assert a.label(False) == "F0b"
