"""Data-parallel communication hidden behind compute, modelled the way the runtime does it. Torch-free.

Gradient reduction (parallel/grad_sync.py): a rank's fp32 gradients live in buckets of about `BUCKET_ELEMS`
elements, filled in reverse parameter order (the last chunk's last unit first, as a backward visits them). With
--overlap-grad-reduce a bucket's all-reduce is launched as soon as the last backward of every parameter in it has
run; reductions share one communication stream, so they run one after another in launch order. Without it every
bucket is reduced after the pipeline. Within a chunk's last gradient action (its last BACKWARD, or its last W of a
zero-bubble schedule) the units finish in reverse order, each after its share of the action's time.

While a reduction overlaps compute both run slower (the overlap factor, Galvatron's 1.3): the rank's end moves out
by (factor - 1) x the communication time that overlapped compute. So a bucket reduced during the backward costs
only that slowdown; the last bucket (the first units', usually with the word embedding, whose backward is short
for its size) is what stays exposed.

Parameter all-gather of the distributed optimizer (training/optimizer.py): after the step, in buckets in
forward order. With --overlap-param-gather they are launched one after another and each unit's first forward of the
next iteration waits only for its own bucket, so the gathers hide behind the time a rank waits for its first
input and behind the forwards of earlier units; without it the whole gather follows the step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

BUCKET_ELEMS = 40_000_000  # GradSync's and the optimizer's bucket size (Megatron-core's default too)


def grad_buckets(chunks: Sequence[tuple[float, float, Sequence[tuple[float, float]]]],
                 bucket_elems: float = BUCKET_ELEMS) -> list[tuple[float, float]]:
    """[(elements, ready time)] in launch order. `chunks`: per model chunk of the rank, in order, (start, end) of
    its last gradient action and its units [(parameter elements, backward seconds)] in forward order."""
    out: list[tuple[float, float]] = []
    size = ready = 0.0
    for start, end, units in reversed(chunks):
        total = sum(b for _, b in units)
        t = start
        for elems, backward in reversed(units):
            t += (end - start) * (backward / total if total > 0 else 1.0 / len(units))
            if elems <= 0:
                continue
            size, ready = size + elems, max(ready, min(t, end))
            if size >= bucket_elems:
                out.append((size, ready))
                size = ready = 0.0
    if size > 0:
        out.append((size, ready))
    return out


def overlapped_end(items: Sequence[tuple[float, float]], compute_end: float, overlap: bool,
                   factor: float = 1.0) -> float:
    """When the rank is done with its compute (ending at `compute_end`) and the communications `items`
    [(ready time, seconds)] in launch order: serially after the compute without `overlap`; else each starts when
    it is ready and the stream is free, and both sides are slowed by `factor` while they overlap."""
    if not overlap:
        return compute_end + sum(d for _, d in items)
    t = overlapped = 0.0
    for ready, seconds in items:
        start = max(t, ready)
        t = start + seconds
        overlapped += max(0.0, min(t, compute_end) - start)
    return max(compute_end, t) + (factor - 1.0) * overlapped


def reduce_end(chunks, compute_end: float, seconds: Callable[[float], float], overlap: bool, factor: float,
               bucket_elems: float = BUCKET_ELEMS) -> float:
    """`overlapped_end` of the gradient buckets of `chunks` (see grad_buckets), `seconds(elements)` each."""
    items = [(ready, seconds(elems)) for elems, ready in grad_buckets(chunks, bucket_elems)]
    return overlapped_end(items, compute_end, overlap, factor)


def _landings(elems: Sequence[float], seconds: Callable[[float], float], bucket_elems: float) -> list[float]:
    """Per unit (its parameter elements, in parameter order), when the bucket holding it has been gathered: the
    buckets gathered one after another from time 0."""
    out: list[float] = []
    landed = size = 0.0
    pending = 0
    for n in elems:
        size += n
        pending += 1
        if size >= bucket_elems:
            landed += seconds(size)
            out += [landed] * pending
            size, pending = 0.0, 0
    if pending:
        landed += seconds(size) if size > 0 else 0.0
        out += [landed] * pending
    return out


def exposed_gather(chunks: Sequence[tuple[float, float, Sequence[tuple[float, float]]]],
                   seconds: Callable[[float], float], bucket_elems: float = BUCKET_ELEMS) -> float:
    """How long --overlap-param-gather's gathers delay a rank: `chunks` per model chunk (start, end) of its first
    forward, counted from the end of the previous step, and its units [(parameter elements, forward seconds)].
    The buckets (units in parameter order) are gathered one after another from time 0; a unit's forward starts
    no earlier than its bucket has landed. The largest delay of a chunk's first forward end."""
    landed_at = _landings([n for _, _, units in chunks for n, _ in units], seconds, bucket_elems)
    delay, k = 0.0, 0
    for start, end, units in chunks:
        total = sum(f for _, f in units)
        t = start
        for _, forward in units:
            t = max(t, landed_at[k]) + (end - start) * (forward / total if total > 0 else 1.0 / len(units))
            k += 1
        delay = max(delay, t - end)
    return delay


def gather_lead(units: Sequence[tuple[float, float]], seconds: Callable[[float], float],
                bucket_elems: float = BUCKET_ELEMS) -> float:
    """For one chunk's units [(parameter elements, forward seconds)] gathered from time 0: the delay of a first
    forward that would start at s is max(0, lead - s) (exposed_gather's walk in closed form: the forward ends at
    max(s + sum f, max over units k of landed_k + the forwards from k on))."""
    total = suffix = sum(f for _, f in units)
    lead = total
    for (_, forward), landed in zip(units, _landings([n for n, _ in units], seconds, bucket_elems)):
        lead = max(lead, landed + suffix)
        suffix -= forward
    return lead - total


class RankSpans(NamedTuple):
    """What the overlap model needs of a rank's simulated timeline: per chunk the (start, end) of its last
    gradient action (BACKWARD, or a zero-bubble schedule's W) and of its first FORWARD."""

    last_grad: list[tuple[float, float]]
    first_forward: list[tuple[float, float]]
