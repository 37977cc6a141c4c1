"""Where Megatron-LM's own schedules post their transfers, for simulating them (planner/evaluate.compiled_for).

Megatron-LM's p2p_communication posts a batch of isend/irecv after a compute and waits for all of it before the
next compute (replay's synchronous_p2p). In 1F1B every compute is followed by such a batch: the output's send and
the receive of the next compute's input (send_forward_recv_backward, send_backward_recv_forward). Interleaved 1F1B
without --overlap-p2p-comm runs its steady phase in forward/backward pairs with one batch after each pair
(send_forward_backward_recv_forward_backward): a forward's output leaves only after the backward beside it, and the
receives of the next forward's and the next backward's inputs are posted together. Our engine instead posts every
send at once and each receive one compute ahead (generators.add_communication).

Sends and receives are placed at batch points; the replay matches them by tensor, so the channel order the runtime
needs (the checker's) is not kept: these schedules are simulated, never run.
"""

from __future__ import annotations

from .generators import interleaved_warmup
from .schedule import COMPUTE_KINDS, Action, Kind, Schedule

_RECV = {Kind.FORWARD: Kind.RECV_ACT, Kind.BACKWARD: Kind.RECV_GRAD, Kind.BACKWARD_INPUT: Kind.RECV_GRAD}
_SEND = {Kind.FORWARD: Kind.SEND_ACT, Kind.BACKWARD: Kind.SEND_GRAD, Kind.BACKWARD_INPUT: Kind.SEND_GRAD}


def batch_points(computes: list[Action], warmup: int | None) -> list[bool]:
    """Per compute, whether a batch of transfers follows it: after every one, except (interleaved 1F1B, `warmup`
    its warm-up forwards) after a steady-phase forward, which its backward follows before the batch."""
    out, forwards = [], 0
    for a in computes:
        steady = warmup is not None and a.kind is Kind.FORWARD and forwards >= warmup
        forwards += a.kind is Kind.FORWARD
        out.append(not steady)
    return out


def megatron_communication(schedule: Schedule) -> Schedule:
    """A copy of `schedule` (its compute order kept) with SEND/RECV where Megatron-LM posts them (module doc)."""
    p, m, v = schedule.pp, schedule.num_microbatches, schedule.virtual_stages
    new_actions = []
    for rank, acts in enumerate(schedule.actions):
        computes = [a for a in acts if a.kind in COMPUTE_KINDS]
        points = batch_points(computes, interleaved_warmup(p, m, v, rank) if v > 1 else None)
        at: dict[int, list[Action]] = {}  # batch after compute j (-1: before the first) -> its posts
        pending: list[Action] = []  # sends waiting for the next batch
        last = -1  # the latest batch before the compute at hand
        for j, a in enumerate(computes):
            need = schedule.input_tensor(rank, a)
            if need is not None and schedule.rank_of(need[1]) != rank:
                at.setdefault(last, []).append(Action(_RECV[a.kind], a.microbatch, a.chunk,
                                                      schedule.rank_of(need[1]), a.half))
            made = schedule.output_tensor(rank, a) if a.kind in _SEND else None
            if made is not None and schedule.consumer_rank(made) != rank:
                pending.append(Action(_SEND[a.kind], a.microbatch, a.chunk, schedule.consumer_rank(made), a.half))
            if points[j]:  # its sends first; the receives of the computes up to the next batch join it
                at[j] = pending
                pending = []
                last = j
        out = list(at.get(-1, ()))
        for j, a in enumerate(computes):
            out.append(a)
            out.extend(at.get(j, ()))
        new_actions.append(out + pending)
    return schedule.copy(new_actions)
