"""The checker must reject broken schedules, each with a message naming the problem."""

import pytest

from megatron_bmw.pipeline.checker import check
from megatron_bmw.pipeline.generators import add_communication, generate
from megatron_bmw.pipeline.schedule import Action, DeadlockError, Kind, Schedule, ScheduleError


def _index(acts: list[Action], label: str) -> int:
    return [a.label(show_chunk="." in label) for a in acts].index(label)


def _move(acts: list[Action], label: str, before: str) -> None:
    """Move the action labelled `label` to just before the one labelled `before`."""
    a = acts.pop(_index(acts, label))
    acts.insert(_index(acts, before), a)


def test_valid_schedule_passes():
    check(generate("1f1b", 2, 4))


def test_backward_before_forward():
    s = generate("1f1b", 2, 2)
    _move(s.actions[1], "B0", before="F0")
    with pytest.raises(ScheduleError, match="B0 runs before"):
        check(s)


def test_missing_backward():
    s = generate("gpipe", 2, 3)
    s.actions[0] = [a for a in s.actions[0] if a.label(False) not in ("B2", "RG2<1")]
    with pytest.raises(ScheduleError, match="no BACKWARD"):
        check(s)


def test_duplicate_forward():
    s = generate("gpipe", 1, 3)
    s.actions[0].insert(1, Action(Kind.FORWARD, 0))
    with pytest.raises(ScheduleError, match="appears twice"):
        check(s)


def test_incomplete_halves():
    order = [[Action(Kind.FORWARD, 0, half=0), Action(Kind.BACKWARD, 0, half=0)]]
    with pytest.raises(ScheduleError, match="incomplete set"):
        check(Schedule("custom", 1, 1, 1, order))


def test_dropped_recv():
    s = generate("1f1b", 3, 4)
    s.actions[1].pop(_index(s.actions[1], "RA2<0"))
    with pytest.raises(ScheduleError, match=r"rank 1: F2 has no RECV"):
        check(s)


def test_recv_after_its_consumer():
    s = generate("1f1b", 2, 3)
    _move(s.actions[1], "RA1<0", before="B1")
    with pytest.raises(ScheduleError, match="F1 has no RECV"):
        check(s)


def test_dropped_send():
    s = generate("1f1b", 2, 3)
    s.actions[1].pop(_index(s.actions[1], "SG1>0"))
    with pytest.raises(ScheduleError, match="no matching SEND"):
        check(s)


def test_send_before_producer():
    s = generate("1f1b", 2, 3)
    _move(s.actions[0], "SA2>1", before="F2")
    with pytest.raises(ScheduleError, match="before the compute producing it"):
        check(s)


def test_wrong_peer():
    s = generate("1f1b", 3, 2)
    i = _index(s.actions[1], "SA0>2")
    s.actions[1][i] = Action(Kind.SEND_ACT, 0, 0, peer=0)
    with pytest.raises(ScheduleError, match="consumer is rank 2"):
        check(s)


def test_sends_reordered_on_a_channel():
    s = generate("1f1b", 2, 4)
    # F0 SA0 F1 SA1 -> F0 F1 SA1 SA0: both sends still follow their producers, but rank 1 receives 0 first
    _move(s.actions[0], "SA1>1", before="SA0>1")
    _move(s.actions[0], "F1", before="SA1>1")
    with pytest.raises(ScheduleError, match=r"rank 0 -> rank 1 is not FIFO.*micro-batch 1.*micro-batch 0"):
        check(s)


def test_recvs_reordered_on_a_channel():
    s = generate("interleaved", 2, 4, 2)
    acts = s.actions[1]
    assert acts[0].label() == "RA0.0<0" and acts[1].label() == "RA1.0<0"
    acts[0], acts[1] = acts[1], acts[0]
    with pytest.raises(ScheduleError, match="not FIFO"):
        check(s)


def test_deadlock():
    # rank 0 waits for B0's gradient before sending F1; rank 1 needs F1 before it runs B0
    order = [
        [Action(Kind.FORWARD, 0), Action(Kind.BACKWARD, 0), Action(Kind.FORWARD, 1), Action(Kind.BACKWARD, 1)],
        [Action(Kind.FORWARD, 0), Action(Kind.FORWARD, 1), Action(Kind.BACKWARD, 0), Action(Kind.BACKWARD, 1)],
    ]
    with pytest.raises(DeadlockError, match="deadlock"):
        check(add_communication(Schedule("custom", 2, 2, 1, order)))


def test_local_dependency_order_on_one_rank():
    s = generate("interleaved", 1, 2, 2)
    _move(s.actions[0], "F0.1", before="F0.0")
    with pytest.raises(ScheduleError, match="before its producer on the same rank"):
        check(s)


def test_out_of_range_and_wrong_rank_count():
    s = generate("1f1b", 2, 2)
    s.actions[0].append(Action(Kind.FORWARD, 5))
    with pytest.raises(ScheduleError, match="micro-batch outside"):
        check(s)
    s = generate("1f1b", 2, 2)
    s.actions.pop()
    with pytest.raises(ScheduleError, match="1 rank lists for 2"):
        check(s)


def test_weight_gradient_before_its_b_or_missing():
    s = generate("zb-h1", 2, 3)
    _move(s.actions[1], "W0", before="B0")
    with pytest.raises(ScheduleError, match="W0 runs before .*its input-gradient B"):
        check(s)
    s = generate("zb-h1", 2, 3)
    s.actions[0] = [a for a in s.actions[0] if a.label(False) != "W2"]
    with pytest.raises(ScheduleError, match="B2 has no weight-gradient W"):
        check(s)
    s = generate("zb-h1", 2, 3)
    s.actions[0].append(Action(Kind.BACKWARD, 1))
    with pytest.raises(ScheduleError, match="B1 has both a whole BACKWARD and a split one"):
        check(s)


def test_v_placement_errors():
    """ZB-V: a turn taken too early deadlocks; a RECV posted out of its channel's send order is not FIFO; a
    chunk-1 forward with no RECV of its input fails."""
    s = generate("zbv", 2, 2, 2)
    compute = s.copy([[a for a in acts if a.is_compute] for acts in s.actions])
    _move(compute.actions[0], "F0.1", before="F0.0")  # rank 0's chunk 1 waits on rank 1, which waits on F0.0
    with pytest.raises(DeadlockError):
        check(add_communication(compute))
    s = generate("zbv", 2, 4, 2)
    recvs = [i for i, a in enumerate(s.actions[1]) if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD)]
    first, second = recvs[2], recvs[3]  # RA2.0 and RG0.1, adjacent, sent by rank 0 in this order
    s.actions[1][first], s.actions[1][second] = s.actions[1][second], s.actions[1][first]
    with pytest.raises(ScheduleError, match="channel rank 0 -> rank 1 is not FIFO"):
        check(s)
    s = generate("zbv", 2, 2, 2)
    s.actions[0] = [a for a in s.actions[0] if not (a.kind is Kind.RECV_ACT and a.chunk == 1 and a.microbatch == 1)]
    with pytest.raises(ScheduleError, match="F1.1 has no RECV of its input from rank 1"):
        check(s)
