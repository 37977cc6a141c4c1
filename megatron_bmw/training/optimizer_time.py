"""The optimizer step as this machine runs it, for a CPU profile.

The planner prices a GPU's step from its memory bandwidth (cost_model.optimizer_step_seconds: the bytes the
gradient norm, the zeroing and Adam move). A CPU device type states no bandwidth, and a CPU's step has a fixed
part too (Python and a kernel per tensor group) that a small model's step is mostly made of. So the profile times
the trainer's own zeroing and step on the profiled model cut to one layer and to two layers (the trainers
host_memory.py runs): the rate is the difference of their bytes over the difference of their times, the fixed
part what the one-layer step took beyond its bytes at that rate.
"""

from __future__ import annotations

import statistics
import time

REPEATS = 5


def step_seconds(trainer) -> tuple[float, float]:
    """(parameters stepped, median seconds of zeroing the gradients and stepping) of a trainer that has trained."""
    samples = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        trainer.grad_sync.zero()
        trainer.optimizer.step()
        samples.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in {id(p): p for _, p in trainer.named_params}.values())
    return float(params), statistics.median(samples)


def fit_optimizer_step(points: list[tuple[float, float]], dtype_bytes: int) -> dict:
    """{"bytes_per_s", "fixed_s"} from step_seconds of the one-layer and the two-layer cut; {} where the two-layer
    step did not take longer (noise)."""
    from ..planner.cost_model import optimizer_step_bytes

    (p1, t1), (p2, t2) = points
    b1, b2 = (optimizer_step_bytes(p, 1, False, dtype_bytes) for p in (p1, p2))
    if not t2 > t1:
        return {}
    rate = (b2 - b1) / (t2 - t1)
    return {"bytes_per_s": rate, "fixed_s": max(0.0, t1 - b1 / rate)}
