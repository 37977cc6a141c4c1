"""SEND/RECV actions for a schedule's compute order (generators.generate's second step). No torch."""

from __future__ import annotations

from .schedule import COMM_KINDS, COMPUTE_KINDS, Action, Kind, Schedule, gc_paused


def add_communication(schedule: Schedule) -> Schedule:
    """Return a copy with SEND/RECV actions inserted (existing SEND/RECV are dropped first).

    After each compute action whose output goes to another rank: its SEND, right away.
    Each RECV sits one compute action ahead of its consumer: immediately before the
    consumer's preceding compute action, or at the very start for the rank's first compute
    action; earlier where its channel needs it: a (src, dst) channel delivers in posting order
    (NCCL), so a RECV is posted no later than the RECV of any message sent after it on that
    channel. Data that stays on the rank (p == 1) needs no communication.
    """
    recv_kind = {Kind.FORWARD: Kind.RECV_ACT, Kind.BACKWARD: Kind.RECV_GRAD, Kind.BACKWARD_INPUT: Kind.RECV_GRAD}
    send_kind = {Kind.FORWARD: Kind.SEND_ACT, Kind.BACKWARD: Kind.SEND_GRAD, Kind.BACKWARD_INPUT: Kind.SEND_GRAD}
    with gc_paused():
        bases = [[a for a in acts if a.kind not in COMM_KINDS] for acts in schedule.actions]
        sent_at: dict = {}  # tensor -> its position in its channel's send order
        count: dict[tuple[int, int], int] = {}
        for rank, base in enumerate(bases):
            for a in base:
                made = schedule.output_tensor(rank, a) if a.kind in COMPUTE_KINDS else None
                if made is not None and schedule.consumer_rank(made) != rank:
                    channel = (rank, schedule.consumer_rank(made))
                    sent_at[made] = count.get(channel, 0)
                    count[channel] = sent_at[made] + 1
        new_actions = []
        for rank, base in enumerate(bases):
            recvs = []  # [slot, src, send position, RECV]: before compute `slot`, -1 the very start
            j = 0
            for a in base:
                if a.kind not in COMPUTE_KINDS:
                    continue
                need = schedule.input_tensor(rank, a)
                src = None if need is None else schedule.rank_of(need[1])
                if src is not None and src != rank:
                    recvs.append([j - 1, src, sent_at.get(need, len(sent_at)),
                                  Action(recv_kind[a.kind], a.microbatch, a.chunk, src, a.half)])
                j += 1
            by_src: dict[int, list] = {}
            for rec in recvs:
                by_src.setdefault(rec[1], []).append(rec)
            for channel in by_src.values():
                channel.sort(key=lambda rec: rec[2])
                for k in range(len(channel) - 2, -1, -1):
                    channel[k][0] = min(channel[k][0], channel[k + 1][0])
            at: dict[int, list[Action]] = {}
            for rec in sorted(recvs, key=lambda rec: (rec[0], rec[1], rec[2])):
                at.setdefault(rec[0], []).append(rec[3])
            out: list[Action] = list(at.get(-1, ()))
            j = 0
            for a in base:
                if a.kind not in COMPUTE_KINDS:
                    out.append(a)
                    continue
                out.extend(at.get(j, ()))
                out.append(a)
                j += 1
                made = schedule.output_tensor(rank, a)
                if made is not None and schedule.consumer_rank(made) != rank:
                    out.append(Action(send_kind[a.kind], a.microbatch, a.chunk, schedule.consumer_rank(made), a.half))
            new_actions.append(out)
    return schedule.copy(new_actions)
