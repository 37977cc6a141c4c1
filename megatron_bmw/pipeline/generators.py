"""Schedule generators: GPipe, 1F1B (PipeDream-Flush), Megatron's interleaved 1F1B, zero-bubble ZB-H1, and
ZB-H2 and ZB-V (list-scheduled, pipeline/zero_bubble.py), ZB-1p and ZB-2p (searched for the stages' times,
pipeline/zb_search.py).

Each generator returns the compute order only; `add_communication` inserts the SEND/RECV
actions and `generate` does both.
"""

from __future__ import annotations

from ..errors import UsageError
from .communication import add_communication
from .schedule import Action, Kind, Schedule
from .zb_search import SEARCHED_ZB, zb_search
from .zero_bubble import list_schedule, zb_h1_order, zb_h2_budgets, zbv_order

__all__ = ["CHUNKS", "SCHEDULES", "TIMED", "add_communication", "compute_schedule", "generate", "gpipe",
           "interleaved_1f1b", "interleaved_warmup", "one_f_one_b", "zb_h1", "zb_h2", "zbv"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zb-1p", "zb-2p", "zbv")
TIMED = tuple(SEARCHED_ZB)  # schedules whose order depends on the stages' (f, b, w, send) times
CHUNKS = {"zbv": 2}  # model chunks per rank, where a schedule fixes them


def _check_sizes(p: int, m: int, v: int = 1) -> None:
    if p < 1:
        raise UsageError(f"--pipeline-model-parallel-size must be >= 1, got {p}")
    if m < 1:
        raise UsageError(f"micro-batches per iteration must be >= 1, got {m}")
    if v < 1:
        raise UsageError(f"--virtual-pipeline-model-parallel-size must be >= 1, got {v}")


def _f(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.FORWARD, mb, chunk)


def _b(mb: int, chunk: int = 0) -> Action:
    return Action(Kind.BACKWARD, mb, chunk)


def gpipe(p: int, m: int) -> Schedule:
    """Every rank runs all forwards, then all backwards (compute order only)."""
    _check_sizes(p, m)
    order = [_f(i) for i in range(m)] + [_b(i) for i in range(m)]
    return Schedule("gpipe", p, m, 1, [list(order) for _ in range(p)])


def _one_f_one_b_order(p: int, m: int) -> list[list[Action]]:
    fwd = [_f(i) for i in range(m)]  # actions are immutable, so ranks share them
    bwd = [_b(i) for i in range(m)]
    actions = []
    for rank in range(p):
        warmup = min(p - rank - 1, m)
        acts = fwd[:warmup]
        for i in range(m - warmup):
            acts += (fwd[warmup + i], bwd[i])
        acts += bwd[m - warmup :]
        actions.append(acts)
    return actions


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush: p-r-1 warm-up forwards, steady (F, B) pairs, cool-down backwards."""
    _check_sizes(p, m)
    return Schedule("1f1b", p, m, 1, _one_f_one_b_order(p, m))


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B with each backward split into its input gradient B and weight gradient W.

    Same warm-up forwards as 1F1B (p-r-1 on rank r); each B's W follows it, delayed on rank r by r W's (the
    later ranks idle longest in 1F1B's cool-down, and hold fewest micro-batches): the delayed W's fill the
    cool-down bubbles. Rank r holds at most p micro-batches (1F1B's p-r plus r awaiting their W), so the peak
    over ranks is 1F1B's."""
    _check_sizes(p, m)
    return zb_h1_order(p, m)


def zb_h2(p: int, m: int) -> Schedule:
    """ZB-H2 (Qi et al. 2024): B/W split, up to 2p - 1 micro-batches held per rank (zero_bubble.py)."""
    _check_sizes(p, m)
    return list_schedule("zb-h2", p, m, 1, "interleaved", zb_h2_budgets(p))


def zbv(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024): two chunks per rank placed in a V, B/W split, at most 2p chunk-micro-batches
    held per rank (zero_bubble.py)."""
    _check_sizes(p, m)
    return zbv_order(p, m)


def interleaved_warmup(p: int, m: int, v: int, rank: int) -> int:
    """Number of warm-up forwards (virtual micro-batches) on `rank` in Megatron's interleaved order."""
    if v == 1:
        return min(p - rank - 1, m)
    total = m * v
    if m == p:
        return total
    return min((p - rank - 1) * 2 + (v - 1) * p, total)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B with v model chunks per rank (compute order only).

    Virtual micro-batch k runs micro-batch (k // (p*v)) * p + k % p; its forward uses chunk
    (k % (p*v)) // p and its backward the mirrored chunk v-1 - (k % (p*v)) // p.
    With v == 1 this is exactly 1F1B.
    """
    _check_sizes(p, m, v)
    if v == 1:
        return Schedule("interleaved", p, m, 1, _one_f_one_b_order(p, m))
    if m % p:
        raise UsageError(
            f"micro-batches per iteration {m}: the interleaved schedule needs a multiple of the pipeline size {p}"
        )
    group = p * v
    total = m * v
    fwd = []
    bwd = []
    for k in range(total):
        g, rem = divmod(k, group)
        mb = g * p + rem % p
        fwd.append(_f(mb, rem // p))
        bwd.append(_b(mb, v - 1 - rem // p))
    actions = []
    for rank in range(p):
        warmup = interleaved_warmup(p, m, v, rank)
        acts = fwd[:warmup]
        for k in range(total - warmup):
            acts += (fwd[k + warmup], bwd[k])
        acts += bwd[total - warmup :]
        actions.append(acts)
    return Schedule("interleaved", p, m, v, actions)


def generate(name: str, p: int, m: int, v: int = 1, times=None) -> Schedule:
    """Build a schedule with communication. `name` in SCHEDULES; zbv has v = 2 (CHUNKS); `times`: per stage
    (f, b, w, send) for the TIMED ones (default: equal stages), ignored by the others."""
    return add_communication(compute_schedule(name, p, m, v, times))


def compute_schedule(name: str, p: int, m: int, v: int = 1, times=None) -> Schedule:
    """generate's compute actions only (what pipeline/holding.py counts), without SEND/RECV."""
    if name not in SCHEDULES:
        raise UsageError(f"unknown pipeline schedule {name!r} (choose {', '.join(SCHEDULES)})")
    _check_sizes(p, m, v)
    if name in CHUNKS:
        if v != CHUNKS[name]:
            raise UsageError(f"--pipeline-schedule {name} holds {CHUNKS[name]} model chunks per rank, not {v}")
    elif v > 1 and name != "interleaved":
        raise UsageError(
            f"--virtual-pipeline-model-parallel-size {v} needs the interleaved schedule, not {name!r}"
        )
    if name == "gpipe":
        compute = gpipe(p, m)
    elif name == "1f1b":
        compute = one_f_one_b(p, m)
    elif name == "zb-h1":
        compute = zb_h1(p, m)
    elif name == "zb-h2":
        compute = zb_h2(p, m)
    elif name == "zbv":
        compute = zbv(p, m)
    elif name in SEARCHED_ZB:
        compute = zb_search(name, p, m, times)
    else:
        compute = interleaved_1f1b(p, m, v)
    return compute
