"""Megatron-LM's transfer batches (pipeline/megatron_p2p.py) and the replay's synchronous p2p."""

import pytest

from megatron_bmw.pipeline.generators import compute_schedule, generate
from megatron_bmw.pipeline.megatron_p2p import megatron_communication
from megatron_bmw.pipeline.replay import replay, unit_times
from megatron_bmw.pipeline.schedule import Kind


def _labels(schedule, rank):
    return schedule.to_text(comm=True).splitlines()[rank].split(": ")[1].split()


def test_1f1b_posts_each_receive_with_the_sends_after_the_compute_before_it():
    s = megatron_communication(compute_schedule("1f1b", 2, 3))
    assert _labels(s, 0) == "F0 SA0>1 F1 SA1>1 RG0<1 B0 F2 SA2>1 RG1<1 B1 RG2<1 B2".split()
    assert _labels(s, 1) == "RA0<0 F0 B0 SG0>0 RA1<0 F1 B1 SG1>0 RA2<0 F2 B2 SG2>0".split()


def test_interleaved_steady_forward_sends_after_its_backward():
    p, m, v = 2, 4, 2
    s = megatron_communication(compute_schedule("interleaved", p, m, v))
    acts = s.actions[0]  # its forwards' outputs all go to rank 1
    computes = [i for i, a in enumerate(acts) if a.kind in (Kind.FORWARD, Kind.BACKWARD)]
    pairs = [(i, j) for i, j in zip(computes, computes[1:])
             if acts[i].kind is Kind.FORWARD and acts[j].kind is Kind.BACKWARD]
    assert pairs
    for i, j in pairs:
        assert j == i + 1  # no transfer between a steady forward and its backward
        assert any(a.kind is Kind.SEND_ACT and (a.microbatch, a.chunk) == (acts[i].microbatch, acts[i].chunk)
                   for a in acts[j + 1:j + 6])


@pytest.mark.parametrize("p,m,v", [(2, 2, 1), (4, 8, 1), (4, 3, 1), (2, 4, 2), (4, 4, 2), (4, 8, 2), (8, 24, 3),
                                   (3, 6, 3), (8, 8, 4)])
def test_synchronous_replay_completes_and_matches_async_without_transfer_time(p, m, v):
    name = "interleaved" if v > 1 else "1f1b"
    sched = megatron_communication(compute_schedule(name, p, m, v))
    sync = replay(sched, unit_times(), synchronous_p2p=True)
    assert sync.makespan == pytest.approx(replay(sched, unit_times()).makespan)
    assert sum(sync.busy) == pytest.approx(p * m * v * 3)


def test_a_sender_waits_for_its_transfer_and_for_the_receiver():
    """With transfers taking time, waiting for each send costs the sender that time (here at every step of the
    steady phase), where our engine's sender runs on."""
    sched = megatron_communication(compute_schedule("1f1b", 2, 4))
    hop = lambda src, dst, a: 0.25  # noqa: E731
    sync = replay(sched, unit_times(), hop, synchronous_p2p=True).makespan
    free = replay(generate("1f1b", 2, 4), unit_times(), hop).makespan
    assert sync > free
