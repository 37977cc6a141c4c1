"""After a `--plan` run: the plan's predicted iteration time and per-stage memory beside what was measured."""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from ..planner.profile_data import load_per_core, load_record

GiB, MiB = 2**30, 2**20
LOAD_MARGIN = 0.5  # other work's runnable tasks per core, run against profile, before the check names the load


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


def load_line(plan, start: list[float] | None, seconds: float, own: float) -> str | None:
    """One line when this machine's other work, per core, differed by more than LOAD_MARGIN between the run (the
    load averages at `start` and now, over `seconds`, less the run's `own` busy threads on this node) and the
    plan's profile (its "load" record, profile_data.load_per_core): a CPU plan on a busy machine ran 2-3x its
    prediction with no word why. None where the plan's profiles recorded no load, or they agree."""
    profiled = next((p["load"] for p in getattr(plan, "profiles", None) or []
                     if isinstance(p, dict) and isinstance(p.get("load"), dict)), None)
    run = load_record(start, seconds, own)
    try:
        ours, theirs = load_per_core(run), load_per_core(profiled)
    except (KeyError, IndexError, TypeError):  # a hand-edited plan's record: no word rather than a failed run
        return None
    if ours is None or theirs is None or abs(ours - theirs) <= LOAD_MARGIN:
        return None
    what = ("busier than when its profile was measured: expect the run slower than predicted" if ours > theirs else
            "idler than when its profile was measured: expect the run faster than predicted")
    return (f" plan check | load: other work kept {ours:.2f} tasks per core runnable during this run (1-minute load "
            f"average {run['start'][0]:.2f} at its start, {run['end'][0]:.2f} at its end, {run['cores']} cores), "
            f"{theirs:.2f} during its profile's: the machine was {what}")


def own_threads() -> int:
    """The threads this run keeps busy on this node: its ranks here (torchrun's LOCAL_WORLD_SIZE, else every rank)
    times each one's torch threads."""
    ranks = os.environ.get("LOCAL_WORLD_SIZE")
    if not ranks:
        ranks = dist.get_world_size() if dist.is_initialized() else 1
    return int(ranks) * torch.get_num_threads()


def plan_check_lines(trainer, plan, load_start: list[float] | None = None, seconds: float = 0.0) -> list[str]:
    """Lines for rank 0 (every rank must call this: it reduces over ranks). Iteration time: the median over
    the iterations after the warm-up (warmup_iterations, and the iterations the activation store tracked),
    slowest rank.
    Memory: each pipeline stage's largest rank against the predicted peak. CUDA: the peak allocated, against
    the peak without the allowance for context, workspaces and fragmentation. CPU, with no allocator to ask: the
    rise of the process's peak resident memory from before the model was built (what the process really held:
    the runtime's first use, the C allocator's cache, communication buffers and batches included) against the
    whole peak, allowance included, beside the tensors the run tracks (model states plus the activation store's
    peak, against the prediction of those two).
    Load (`load_start`: the load averages `seconds` ago, when the run started): a line when the machine was markedly
    busier or idler than when the plan's profile was measured (load_line)."""
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
    if load_start is not None:
        load = load_line(plan, load_start, seconds, own_threads())
        if load:
            lines.append(load)
    return lines
