"""After a `--plan` run: the plan's predicted iteration time and per-stage memory beside what was measured."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

GiB, MiB = 2**30, 2**20


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.3f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.2f} MiB"


def _max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().tolist()


def warmup_iterations(iterations: int) -> int:
    """Iterations the time check skips: the first quarter, at least one (where there are two), at most 5."""
    return min(5, max(1, iterations // 4)) if iterations > 1 else 0


def plan_check_lines(trainer, plan) -> list[str]:
    """Lines for rank 0 (every rank must call this: it reduces over ranks). Iteration time: the median over
    the iterations after the warm-up (warmup_iterations, and the iterations the activation store tracked),
    slowest rank.
    Memory: each pipeline stage's largest rank against the predicted peak. CUDA: the peak allocated, against
    the peak without the allowance for context, workspaces and fragmentation. CPU, with no allocator to ask: the
    rise of the process's peak resident memory from before the model was built (what the process really held:
    the runtime's first use, the C allocator's cache, communication buffers and batches included) against the
    whole peak, allowance included, beside the tensors the run tracks (model states plus the activation store's
    peak, against the prediction of those two)."""
    st = trainer.state
    times = trainer.step_times
    warm = warmup_iterations(len(times))
    if trainer.tracked_iterations < len(times):  # the later ones ran without the store's hooks (host time)
        warm = max(warm, trainer.tracked_iterations)
    kept = times[warm:]
    measured = statistics.median(kept) if kept else float("nan")
    cpu = st.device.type != "cuda"
    resident = getattr(trainer, "resident", None)
    grown = resident.growth() if cpu and resident is not None else None
    memory, tracked = [0.0] * st.pp_size, [0.0] * st.pp_size
    memory[st.pp_rank] = grown if grown is not None else trainer.memory_in_use()
    tracked[st.pp_rank] = trainer.memory_in_use()
    measured, *both = _max_over_ranks([measured] + memory + tracked, st.device)
    memory, tracked = both[:st.pp_size], both[st.pp_size:]
    pred = plan.prediction
    lines = []
    predicted = pred.get("iteration_time_s")
    if predicted:
        lines.append(f" plan check | iteration time predicted {predicted:.4f} s, measured {measured:.4f} s (median of "
                     f"{len(kept)} iterations after {warm} warm-up) | error {100 * (measured / predicted - 1):+.1f}%")
    for s, stage in enumerate(pred.get("stages", [])):
        if s >= len(memory):
            break
        # CUDA's peak allocation leaves the allowance out; a process's resident rise holds all of it
        expected = stage["peak_bytes"] - (0.0 if cpu and grown is not None else stage.get("allowance_bytes", 0.0))
        what = ""
        if cpu and grown is not None:
            what = " (peak resident growth)"
        line = (f" plan check | stage {s} | memory predicted {_size(expected)}, measured {_size(memory[s])}{what} "
                f"({100 * (memory[s] / expected - 1):+.1f}%)")
        if cpu:
            states = stage["static_bytes"] + stage["activation_bytes"]
            line += (f" | tracked tensors {_size(tracked[s])} against model states + activations {_size(states)} "
                     f"({100 * (tracked[s] / states - 1):+.1f}%)")
        lines.append(line + f" | capacity {_size(stage['capacity_bytes'])}")
    return lines
