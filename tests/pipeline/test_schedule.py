"""Pipeline schedule IR, generators and replay."""


import pytest

from megatron_bmw.config import PipelineConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.pipeline.checker import check
from megatron_bmw.pipeline.generators import (
    add_communication,
    generate,
    gpipe,
    interleaved_1f1b,
    interleaved_warmup,
    one_f_one_b,
)
from megatron_bmw.pipeline.holding import peak_inflight, resident_peaks
from megatron_bmw.pipeline.replay import (
    DeadlockError,
    ScheduleError,
    compile_schedule,
    replay,
    unit_times,
)
from megatron_bmw.pipeline.partition import rank_chunks
from megatron_bmw.pipeline.schedule import COMM_KINDS, RECV_KINDS, SEND_KINDS, Action, Kind, Schedule


def _labels(schedule: Schedule, rank: int) -> str:
    return " ".join(a.label(schedule.virtual_stages > 1) for a in schedule.compute_actions(rank))


def _microbatch_counts(p: int) -> list[int]:
    return sorted(m for m in {1, 2, 3, p - 1, p, p + 1, 2 * p, 63, 64} if m >= 1)


def _interleaved_counts(p: int) -> list[int]:
    """Multiples of p up to 64: all small ones and the largest few."""
    multiples = list(range(p, 65, p))
    return multiples[:6] + [m for m in multiples[6:] if m > 64 - 2 * p]


# ---------------------------------------------------------------- IR


def test_virtual_stage_placement():
    s = Schedule("interleaved", 4, 8, 3, [[] for _ in range(4)])
    assert s.stage_of(1, 2) == 9
    for k in range(12):
        assert s.stage_of(*s.location(k)) == k
    f, b = Action(Kind.FORWARD, 5, 0), Action(Kind.BACKWARD, 5, 1)
    assert s.output_tensor(3, f) == (False, 3, 5, None) and s.consumer_rank((False, 3, 5, None)) == 0
    assert s.input_tensor(0, b) == (True, 5, 5, None) and s.consumer_rank((True, 5, 5, None)) == 0
    assert s.input_tensor(0, f) is None and s.output_tensor(0, Action(Kind.BACKWARD, 1, 0)) is None
    assert s.input_tensor(3, Action(Kind.BACKWARD, 1, 2)) is None  # the last stage's backward starts the loss
    assert s.wire_tensor(3, Action(Kind.SEND_ACT, 5, 0, 0)) == s.wire_tensor(0, Action(Kind.RECV_ACT, 5, 1, 3))


def test_tensor_ids_and_tags_are_distinct():
    s = Schedule("interleaved", 2, 3, 2, [[] for _ in range(2)])
    tensors = [(g, vs, mb, h) for g in (False, True) for vs in range(4) for mb in range(3) for h in (None, 0, 1)]
    ids = {s.tensor_id(t) for t in tensors}
    assert ids == set(range(s.num_tensor_ids))
    keys = [(mb, c, h) for mb in range(3) for c in range(2) for h in (None, 0, 1)]
    tags = {s.p2p_tag(t) for t in tensors} | {s.transfer_tag(d, k) for d in (0, 1) for k in keys}
    tags |= {s.header_tag(c, h) for c in range(2) for h in (False, True)}
    assert len(tags) == len(tensors) + 2 * len(keys) + 4


def test_text_format():
    s = generate("1f1b", 2, 3)
    assert s.to_text() == "rank 0: F0 F1 B0 F2 B1 B2\nrank 1: F0 B0 F1 B1 F2 B2"
    assert str(s) == s.to_text()
    assert "SA0>1" in s.to_text(comm=True) and "RG0<1" in s.to_text(comm=True)
    assert Action(Kind.FORWARD, 3, 1).label() == "F3.1"
    assert Action(Kind.BACKWARD, 3, 0, half=1).label(show_chunk=False) == "B3b"
    assert generate("interleaved", 2, 2, 2).to_text().startswith("rank 0: F0.0 F1.0 F0.1")


# ---------------------------------------------------------------- generators


def test_gpipe_order_and_peak():
    s = gpipe(3, 4)
    for r in range(3):
        assert _labels(s, r) == "F0 F1 F2 F3 B0 B1 B2 B3"
    assert peak_inflight(s) == [4, 4, 4]


def test_one_f_one_b_order():
    s = one_f_one_b(4, 8)
    assert _labels(s, 0) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert _labels(s, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 7, 16])
def test_one_f_one_b_warmup_and_peak(p, m):
    s = one_f_one_b(p, m)
    for r in range(p):
        kinds = [a.kind for a in s.compute_actions(r)]
        warmup = min(p - r - 1, m)
        assert kinds[:warmup] == [Kind.FORWARD] * warmup
        steady = kinds[warmup : warmup + 2 * (m - warmup)]
        assert steady == [Kind.FORWARD, Kind.BACKWARD] * (m - warmup)
        assert kinds[warmup + 2 * (m - warmup) :] == [Kind.BACKWARD] * warmup
    assert peak_inflight(s) == [min(p - r, m) for r in range(p)]


def test_interleaved_hand_computed():
    s = interleaved_1f1b(2, 4, 2)
    assert _labels(s, 0) == "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0"
    assert _labels(s, 1) == "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0"
    # m == p: every forward is warm-up
    s = interleaved_1f1b(2, 2, 2)
    assert _labels(s, 1) == "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0"


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (4, 16, 3), (3, 9, 4), (8, 16, 2)])
def test_interleaved_warmup_counts(p, m, v):
    s = interleaved_1f1b(p, m, v)
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, m * v)
        assert interleaved_warmup(p, m, v, r) == warmup
        kinds = [a.kind for a in s.compute_actions(r)]
        leading = kinds.index(Kind.BACKWARD)
        assert leading == min(warmup + 1, m * v)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_interleaved_v1_equals_1f1b(p, m):
    assert interleaved_1f1b(p, m, 1).actions == one_f_one_b(p, m).actions
    assert generate("interleaved", p, m, 1).actions == generate("1f1b", p, m).actions


@pytest.mark.parametrize("p", list(range(1, 17)))
def test_checker_accepts_generated_schedules(p):
    for name in ("gpipe", "1f1b"):
        for m in _microbatch_counts(p):
            check(generate(name, p, m))
    for v in (2, 3, 4):
        for m in _interleaved_counts(p):
            check(generate("interleaved", p, m, v))


def test_build_schedule_errors():
    cases = [
        (("1f1b", 0, 4), "--pipeline-model-parallel-size"),
        (("1f1b", 4, 0), "micro-batches per iteration must be >= 1"),
        (("interleaved", 4, 8, 0), "--virtual-pipeline-model-parallel-size"),
        (("1f1b", 4, 8, 2), "needs the interleaved schedule"),
        (("zigzag", 4, 8), "unknown pipeline schedule"),
        (("interleaved", 4, 6, 2), "multiple of the pipeline size"),
    ]
    for args, text in cases:
        with pytest.raises(UsageError, match=text) as info:
            generate(*args)
        assert "\n" not in str(info.value)


# ---------------------------------------------------------------- communication


def test_no_communication_on_one_rank():
    for s in (generate("1f1b", 1, 4), generate("gpipe", 1, 3), generate("interleaved", 1, 3, 3)):
        assert not any(a.kind in COMM_KINDS for a in s.actions[0])
        check(s)


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1), ("interleaved", 2, 6, 3)])
def test_recv_sits_one_compute_ahead_and_send_right_after(name, p, m, v):
    s = generate(name, p, m, v)
    for rank, acts in enumerate(s.actions):
        computes = [i for i, a in enumerate(acts) if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
        for i, a in enumerate(acts):
            if a.kind in RECV_KINDS:
                want = Kind.FORWARD if a.kind is Kind.RECV_ACT else Kind.BACKWARD
                consumer = next(j for j in computes if acts[j].kind is want and acts[j].key == a.key)
                n = computes.index(consumer)
                if n == 0:
                    assert all(x.kind in RECV_KINDS for x in acts[:consumer])
                else:
                    # only other RECVs between it and the compute action preceding the consumer
                    nxt = next(j for j in range(i + 1, len(acts)) if acts[j].kind not in RECV_KINDS)
                    assert nxt == computes[n - 1]
            elif a.kind in SEND_KINDS:
                produced = Kind.FORWARD if a.kind is Kind.SEND_ACT else Kind.BACKWARD
                assert acts[i - 1].kind is produced and acts[i - 1].key == a.key


def _channel_sequences(s: Schedule):
    """Per directed channel: tensors in send order and in receive order, named by (kind, mb, producer vstage)."""
    sends, recvs = {}, {}
    for rank, acts in enumerate(s.actions):
        for a in acts:
            vstage = s.stage_of(rank, a.chunk)
            if a.kind is Kind.SEND_ACT or a.kind is Kind.SEND_GRAD:
                sends.setdefault((rank, a.peer), []).append((a.kind.value[5:], a.microbatch, vstage))
            elif a.kind is Kind.RECV_ACT:
                recvs.setdefault((a.peer, rank), []).append(("ACT", a.microbatch, vstage - 1))
            elif a.kind is Kind.RECV_GRAD:
                recvs.setdefault((a.peer, rank), []).append(("GRAD", a.microbatch, vstage + 1))
    return sends, recvs


@pytest.mark.parametrize("m", [2, 4, 6, 10])
@pytest.mark.parametrize("v", [2, 3])
def test_fifo_per_channel_interleaved_two_ranks(m, v):
    s = generate("interleaved", 2, m, v)
    sends, recvs = _channel_sequences(s)
    assert set(sends) == set(recvs) == {(0, 1), (1, 0)}
    for channel in sends:
        assert sends[channel] == recvs[channel]
        # both kinds share each channel, so FIFO holds across kinds, not just within one
        assert {kind for kind, _, _ in sends[channel]} == {"ACT", "GRAD"}


@pytest.mark.parametrize("name,p,m,v", [("gpipe", 4, 6, 1), ("1f1b", 5, 9, 1), ("interleaved", 3, 9, 2)])
def test_fifo_per_channel(name, p, m, v):
    sends, recvs = _channel_sequences(generate(name, p, m, v))
    assert sends == recvs


def test_add_communication_is_idempotent():
    s = generate("interleaved", 3, 6, 2)
    assert add_communication(s).actions == s.actions


# ---------------------------------------------------------------- replay


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(1, 1), (1, 5), (2, 1), (4, 8), (4, 3), (7, 20)])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0)])
def test_makespan_1f1b_gpipe(name, p, m, f, b):
    result = replay(generate(name, p, m), unit_times(f, b))
    assert result.makespan == (m + p - 1) * (f + b)
    assert result.busy == [m * (f + b)] * p
    assert result.bubble_time == pytest.approx(p * (p - 1) * (f + b))


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0)])
def test_interleaved_bubble(p, v, f, b):
    # f, b are per-chunk times, so one whole stage costs v*f and v*b and the textbook
    # bubble (p-1)(F+B)/v is (p-1)(f+b). The replay matches it exactly for every m % p == 0
    # (including m == p, where all forwards are warm-up) with zero transfer time.
    for m in (p, 2 * p, 4 * p):
        result = replay(generate("interleaved", p, m, v), unit_times(f, b))
        bubble = result.makespan - m * v * (f + b)
        assert bubble == (p - 1) * (v * f + v * b) / v


def test_transfer_time_delays_consumer():
    s = generate("1f1b", 2, 1)
    result = replay(s, unit_times(1.0, 2.0), lambda src, dst, a: 0.5)
    assert result.makespan == 1 + 0.5 + 1 + 2 + 0.5 + 2
    starts = {(r, a.label(False)): (start, end) for r, line in enumerate(result.timeline) for a, start, end in line}
    assert starts[(1, "F0")] == (1.5, 2.5)
    assert starts[(0, "B0")] == (5.0, 7.0)
    assert starts[(0, "SA0>1")] == (1.0, 1.0)


def test_replay_compiled_and_unrecorded_agree():
    s = generate("interleaved", 4, 8, 2)
    full = replay(s, unit_times(1.0, 2.0))
    fast = replay(compile_schedule(s), unit_times(1.0, 2.0), record=False)
    assert fast.makespan == full.makespan and fast.busy == full.busy
    assert fast.timeline == [[] for _ in range(4)]
    assert [len(line) for line in full.timeline] == [len(acts) for acts in s.actions]


def test_replay_deadlock_names_ranks():
    order = [
        [Action(Kind.FORWARD, 0), Action(Kind.BACKWARD, 0), Action(Kind.FORWARD, 1), Action(Kind.BACKWARD, 1)],
        [Action(Kind.FORWARD, 0), Action(Kind.FORWARD, 1), Action(Kind.BACKWARD, 0), Action(Kind.BACKWARD, 1)],
    ]
    s = add_communication(Schedule("custom", 2, 2, 1, order))
    with pytest.raises(DeadlockError, match=r"rank 0 at B0.*rank 1 at F1"):
        replay(s, unit_times())
    assert issubclass(DeadlockError, ScheduleError)


def test_halves():
    f0, b0 = Action(Kind.FORWARD, 0), Action(Kind.BACKWARD, 0)
    fa, fb = Action(Kind.FORWARD, 1, half=0), Action(Kind.FORWARD, 1, half=1)
    ba, bb = Action(Kind.BACKWARD, 1, half=0), Action(Kind.BACKWARD, 1, half=1)
    order = [[f0, fa, fb, b0, ba, bb], [f0, b0, fa, ba, fb, bb]]
    s = add_communication(Schedule("custom", 2, 2, 1, order))
    check(s)
    assert peak_inflight(s) == [2.0, 1.0]
    assert "F1a" in s.to_text() and "RA1b<0" in s.to_text(comm=True)
    result = replay(s, lambda rank, a: 0.5 if a.half is not None else 1.0)
    assert result.makespan == 5.5  # rank 1 ends B1b at 5.0, then rank 0 runs its B1b


def test_replay_of_a_large_schedule():
    """64 ranks, 512 micro-batches (its speed is benchmarks/search_speed.py's concern, not a test's)."""
    s = generate("1f1b", 64, 512)
    result = replay(s, unit_times(1.0, 2.0))
    assert result.makespan == (512 + 63) * 3


def test_zb_h1_hand_computed_and_labels():
    s = generate("zb-h1", 4, 6)
    assert s.to_text() == "\n".join([
        "rank 0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5",
        "rank 1: F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5",
        "rank 2: F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5",
        "rank 3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5",
    ])
    assert "SG0.0>2" in [a.label() for a in s.actions[3]]  # the input-gradient B sends the gradient


@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (2, 5), (3, 7), (4, 4), (4, 9), (8, 16)])
def test_zb_h1_checked_at_1f1b_memory_and_shorter(p, m):
    zb, base = generate("zb-h1", p, m), generate("1f1b", p, m)
    check(zb)
    # every rank holds at most min(p, m) micro-batches (W keeps its inputs): 1F1B's peak over ranks
    assert resident_peaks(zb) == [float(min(p, m))] * p
    assert max(resident_peaks(zb)) == max(resident_peaks(base))
    f, b = 1.0, 2.0  # B and W half a backward each
    got, before = replay(zb, unit_times(f, b)).makespan, replay(base, unit_times(f, b)).makespan
    # Qi et al.: the bubble falls from (p-1)(F+B+W) to (p-1)(F+B-W), here from 3(p-1) to p-1
    assert got == before - (p - 1) * b if m >= p else got <= before


@pytest.mark.parametrize("kw,flag", [({"bpipe": True}, "--bpipe"), ({"slicing": 2}, "--microbatch-slicing"),
                                     ({"slicing": "auto"}, "--microbatch-slicing")])
def test_zb_h1_refuses_bpipe_and_slicing(kw, flag):
    with pytest.raises(UsageError, match=f"--pipeline-schedule zb-h1 does not combine with {flag}"):
        PipelineConfig(num_microbatches=4, schedule="zb-h1", **kw)


# ---------------------------------------------------------------- ZB-H2 and ZB-V


def _excess(s: Schedule, f: float, b: float, w: float) -> float:
    """Makespan beyond one rank's work, with F, input-gradient B and W times per whole stage."""
    v = s.virtual_stages
    times = {Kind.FORWARD: f / v, Kind.BACKWARD_INPUT: b / v, Kind.BACKWARD_WEIGHT: w / v, Kind.BACKWARD: (b + w) / v}
    return replay(s, lambda r, a: times[a.kind]).makespan - s.num_microbatches * (f + b + w)


def test_v_placement():
    s = Schedule("zbv", 4, 8, 2, [[] for _ in range(4)], placement="v")
    assert [s.stage_of(r, c) for c in (0, 1) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    for k in range(8):
        assert s.stage_of(*s.location(k)) == k
    assert s.loss_rank == 0 and Schedule("1f1b", 4, 8, 1, [[] for _ in range(4)]).loss_rank == 3
    # the turn: rank 3's chunk 0 feeds its own chunk 1, and chunk 1 of rank 1 feeds chunk 1 of rank 0
    assert s.consumer_rank(s.output_tensor(3, Action(Kind.FORWARD, 0, 0))) == 3
    assert s.consumer_rank(s.output_tensor(1, Action(Kind.FORWARD, 0, 1))) == 0
    assert s.consumer_rank(s.output_tensor(0, Action(Kind.BACKWARD_INPUT, 0, 1))) == 1
    assert s.output_tensor(0, Action(Kind.FORWARD, 0, 1)) is None  # the loss
    assert rank_chunks([1, 2, 3, 4, 5, 6, 7, 8], 4, 0, "v") == [[0], list(range(28, 36))]  # embedding, head
    assert rank_chunks([1, 1, 1, 1], 2, 1, "v") == [[1], [2]] and rank_chunks([1, 1, 1, 1], 2, 1) == [[1], [3]]
    with pytest.raises(ScheduleError, match="unknown stage placement 'w'"):
        Schedule("x", 2, 2, 2, [[], []], placement="w")


def test_zb_h2_and_zbv_hand_computed():
    assert generate("zb-h2", 2, 4).to_text() == "\n".join([
        "rank 0: F0 F1 F2 B0 W0 B1 F3 B2 W1 W2 B3 W3",
        "rank 1: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3",
    ])
    assert generate("zbv", 2, 4, 2).to_text() == "\n".join([
        "rank 0: F0.0 F1.0 F2.0 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 F3.0 B0.0 W0.0 F2.1 B2.1 W2.1 B1.0 W1.0 F3.1 B3.1 "
        "W3.1 B2.0 W2.0 B3.0 W3.0",
        "rank 1: F0.0 F0.1 F1.0 F1.1 B0.1 W0.1 F2.0 B0.0 W0.0 F2.1 B1.1 W1.1 F3.0 B1.0 W1.0 F3.1 B2.1 W2.1 B2.0 "
        "B3.1 B3.0 W2.0 W3.0 W3.1",
    ])


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_zb_h2_and_zbv_checked_within_their_memory(p):
    """Every micro-batch count from 1 to 3p + 2: checked (dependencies, FIFO channels, no deadlock); ZB-H2 holds
    at most 2p - 1 micro-batches per rank, ZB-V at most 2p chunks (1F1B's p micro-batches of a whole stage)."""
    for m in range(1, 3 * p + 3):
        h2, v = generate("zb-h2", p, m), generate("zbv", p, m, 2)
        check(h2)
        check(v)
        assert max(resident_peaks(h2)) == min(2 * p - 1, m)
        assert max(resident_peaks(v)) <= min(2 * p, 2 * m)
        sends, recvs = _channel_sequences(v)
        assert sends == recvs
        assert add_communication(v).actions == v.actions


@pytest.mark.parametrize("p", [2, 4, 8])
def test_zero_bubble_makespans(p):
    m = 4 * p
    h1, h2, v, base = (generate("zb-h1", p, m), generate("zb-h2", p, m), generate("zbv", p, m, 2),
                       generate("1f1b", p, m))
    # equal F, B, W: ZB-H1 and ZB-H2 leave the (p-1) start-up skew only (1F1B: 3(p-1)); ZB-V less than that
    assert _excess(base, 1, 1, 1) == 3 * (p - 1)
    assert _excess(h1, 1, 1, 1) == _excess(h2, 1, 1, 1) == p - 1
    assert _excess(v, 1, 1, 1) < p - 1
    # a cheaper W: ZB-H2's extra warm-up forwards pay (Qi et al.: (p-1)(F+B-W) for ZB-H1, less for ZB-H2)
    assert _excess(h2, 1, 1, 0.5) < _excess(h1, 1, 1, 0.5)
    # the orders stay good away from equal times: the excess does not grow with the micro-batches
    for f, b, w in ((1, 1.5, 0.5), (1, 0.5, 1), (1, 2, 1)):
        for s in (h2, v):
            longer = generate(s.name, p, 2 * m, s.virtual_stages)
            assert _excess(longer, f, b, w) == pytest.approx(_excess(s, f, b, w))
        assert _excess(v, f, b, w) < _excess(h1, f, b, w)


def test_zbv_needs_two_chunks_and_no_multiple_of_p():
    assert PipelineConfig(num_microbatches=3, schedule="zbv").virtual_stages == 2
    assert PipelineConfig(num_microbatches=3, schedule="zbv").placement == "v"
    assert PipelineConfig(num_microbatches=3, schedule="zb-h2").placement == "interleaved"
    with pytest.raises(UsageError, match="zbv holds 2 model chunks per rank, not 3"):
        PipelineConfig(num_microbatches=3, schedule="zbv", virtual_stages=3)
    with pytest.raises(UsageError, match="zbv holds 2 model chunks per rank, not 1"):
        generate("zbv", 2, 4)
    with pytest.raises(UsageError, match="--pipeline-schedule zb-h2 cannot interleave"):
        PipelineConfig(num_microbatches=4, schedule="zb-h2", virtual_stages=2)
    for name in ("zb-h2", "zbv"):
        with pytest.raises(UsageError, match=f"--pipeline-schedule {name} does not combine with --bpipe"):
            PipelineConfig(num_microbatches=4, schedule=name, bpipe=True)
        with pytest.raises(UsageError, match=f"--pipeline-schedule {name} does not combine with --microbatch-slic"):
            PipelineConfig(num_microbatches=4, schedule=name, micro_batch_size=2, slicing=1)
