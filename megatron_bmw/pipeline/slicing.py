"""AutoPipe's micro-batch slicing (Liu et al., 2022) as a schedule transform, and its slicer (Algorithm 2).

Slicing splits each of the first k micro-batches into two halves along the batch dimension. The halves
flow through the warm-up one after the other, so the last stage starts after about half the start-up
time. Every FORWARD and BACKWARD of a sliced micro-batch becomes two actions, half 0 then half 1, in place,
on every rank: all ranks keep one relative order, so channels stay FIFO and a deadlock-free schedule stays
deadlock-free. The engine weights each half's loss by its share of loss-mask tokens, so loss and gradients
equal the unsliced run. See docs/algorithms.md, "AutoPipe".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..errors import UsageError
from .generators import add_communication
from .schedule import COMPUTE_KINDS, TRANSFER_KINDS, Action, Kind, Schedule, ScheduleError

__all__ = ["check_slicing", "choose_slices", "num_sliced", "parse_slicing", "slice_microbatches",
           "stage_times_from_cost"]

FLAG = "--microbatch-slicing"


def parse_slicing(text: str | int) -> int | str:
    """The flag's value: a count K >= 0, or "auto"."""
    if isinstance(text, str) and text.strip().lower() == "auto":
        return "auto"
    try:
        k = int(text)
    except (TypeError, ValueError):
        raise UsageError(f"{FLAG} {text!r}: expected a number of micro-batches >= 0 or 'auto'") from None
    if k < 0:
        raise UsageError(f"{FLAG} {k}: must be >= 0 or 'auto'")
    return k


def check_slicing(k: int | str, micro_batch_size: int, num_microbatches: int) -> None:
    """Refuse slicing a micro-batch that cannot be halved, or more micro-batches than there are."""
    if k == 0:
        return
    if micro_batch_size < 2 or micro_batch_size % 2:
        raise UsageError(f"{FLAG} needs an even --micro-batch-size >= 2 (to halve micro-batches), "
                         f"got {micro_batch_size}")
    if k != "auto" and k > num_microbatches:
        raise UsageError(f"{FLAG} {k}: more than the {num_microbatches} micro-batches per iteration")


def slice_microbatches(schedule: Schedule, k: int) -> Schedule:
    """Copy of `schedule` whose first k micro-batches run as two halves; SEND/RECV are re-derived."""
    if not 0 <= k <= schedule.num_microbatches:
        raise UsageError(f"{FLAG} {k}: must be between 0 and the {schedule.num_microbatches} micro-batches")
    if k == 0:
        return schedule.copy()
    out = []
    for rank, acts in enumerate(schedule.actions):
        rank_out: list[Action] = []
        for a in acts:
            if a.kind in TRANSFER_KINDS:
                raise ScheduleError("slice micro-batches before inserting BPipe transfers")
            if a.kind not in COMPUTE_KINDS:
                continue
            if a.half is not None:
                raise ScheduleError(f"rank {rank}: {a.label()} is already a half")
            if a.microbatch < k:
                rank_out += [Action(a.kind, a.microbatch, a.chunk, half=h) for h in (0, 1)]
            else:
                rank_out.append(a)
        out.append(rank_out)
    return add_communication(schedule.copy(out))


def choose_slices(forward_times: Sequence[float], backward_times: Sequence[float], comm_time: float,
                  num_microbatches: int) -> int:
    """AutoPipe's slicer: the smallest k such that slicing the first k micro-batches lets stage 0 start the
    first unsliced micro-batch early enough that it does not hold up the pipeline.

    forward_times/backward_times: per pipeline stage, one whole micro-batch (all chunks of the stage);
    comm_time: one whole micro-batch's activation between neighbouring stages (a half takes half).
    """
    f, b, c, m = list(forward_times), list(backward_times), float(comm_time), num_microbatches
    p = len(f)
    if len(b) != p:
        raise ValueError(f"{p} forward times but {len(b)} backward times")
    if p == 1 or m < 1:
        return 0
    # start[i]: when stage i's first 1F1B-phase action starts with micro-batch 0 sliced: the first half
    # reaches the last stage, then the first backward walks down the stages.
    start = [0.0] * p
    start[p - 1] = sum(f[i] / 2 + c / 2 for i in range(p - 1))
    for i in range(p - 2, -1, -1):
        start[i] = start[i + 1] + b[i + 1] + c
    # forward of a whole micro-batch from stage 0 to the start of stage i
    reach = [0.0] * p
    for i in range(1, p):
        reach[i] = reach[i - 1] + f[i - 1] + c
    limit = min(m, p - 1)
    for k in range(1, limit + 1):
        # end[i][h]: finish of half h of the k sliced micro-batches on stage i, halves in order 0a 0b 1a 1b ...
        prev = [0.0] * (2 * k)
        for i in range(p):
            row = []
            for h in range(2 * k):
                arrive = prev[h] + c / 2 if i > 0 else 0.0
                ready = row[h - 1] if h else 0.0
                row.append(max(arrive, ready) + f[i] / 2)
            if i == 0:
                stage0_end = row[-1]
            prev = row
        # micro-batch k opens the 1F1B phase of stage p-1-k; the latest stage 0 may start it
        target = max(p - 1 - k, 0)
        latest = start[target] - reach[target]
        if latest >= stage0_end - 1e-12:
            return k
    return limit


def stage_times_from_cost(compute_time: Callable[[int, Action], float],
                          transfer_time: Callable[[int, int, Action], float],
                          p: int, v: int = 1) -> tuple[list[float], list[float], float]:
    """(forward, backward per stage, activation p2p time) for choose_slices from a cost model's
    compute_time/transfer_time (e.g. the planner's CostModel), summing a stage's chunks."""
    f = [sum(compute_time(r, Action(Kind.FORWARD, 0, c)) for c in range(v)) for r in range(p)]
    b = [sum(compute_time(r, Action(Kind.BACKWARD, 0, c)) for c in range(v)) for r in range(p)]
    comm = transfer_time(0, 1, Action(Kind.SEND_ACT, 0, 0, 1)) if p > 1 else 0.0
    return f, b, comm


def num_sliced(schedule: Schedule) -> int:
    """How many micro-batches of `schedule` run as halves."""
    return len({a.microbatch for acts in schedule.actions for a in acts if a.half is not None})
