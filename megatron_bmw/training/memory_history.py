"""Megatron's --record-memory-history: the CUDA caching allocator records every allocation, free and segment
(torch.cuda.memory._record_memory_history) from start-up on, and the last rank writes a snapshot
(torch.cuda.memory._snapshot(), a pickle that https://pytorch.org/memory_viz opens) to --memory-snapshot-path at
every log interval, replacing the file whole. `summarize` replays a snapshot's trace: what was allocated and what
the allocator reserved (its segments), at their peaks: what planner/cuda_allowance.py's allocator fraction
stands for."""

from __future__ import annotations

import os
import pickle
import sys

from ..errors import UsageError
from ..planner.caching_allocator import ALLOC, FREE, SEGMENT_ALLOC, SEGMENT_FREE
from ..safe_load import Refused, unpickle

MAX_ENTRIES = 100_000  # trace entries kept (Megatron's trace_alloc_max_entries)


def start(cuda) -> None:
    """Begin recording on this process's device; `cuda` is torch.cuda (or a stand-in with .memory)."""
    cuda.memory._record_memory_history(max_entries=MAX_ENTRIES)


def write_snapshot(path: str, cuda) -> bool:
    """Write the snapshot atomically; a failure (a full disk) is one warning line and training goes on."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            pickle.dump(cuda.memory._snapshot(), f)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        print(f"warning: --memory-snapshot-path {path}: cannot write the memory snapshot ({exc.strerror}); "
              "training goes on", file=sys.stderr, flush=True)
        try:
            os.remove(tmp)
        except OSError:
            pass
        return False


def read_snapshot(path: str) -> dict:
    """A snapshot as data: it holds dicts, lists, strings and numbers only, so a pickle naming any global (a class,
    a function: what a crafted file runs) is refused before anything in it runs."""
    try:
        with open(path, "rb") as f:
            snap = unpickle(f)
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the memory snapshot ({exc.strerror})") from None
    except Refused as exc:
        raise UsageError(f"{path}: names the global {exc.name}, which a memory snapshot never holds (plain data "
                         "only); refused, nothing in it was run") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, ValueError, KeyError,
            TypeError):
        raise UsageError(f"{path}: not a memory snapshot (torch.cuda.memory._snapshot pickle)") from None
    if not isinstance(snap, dict) or "segments" not in snap:
        raise UsageError(f"{path}: not a memory snapshot (no segments)")
    return snap


def summarize(snapshot: dict, device: int = 0) -> dict:
    """Allocated and reserved bytes over the device's recorded trace, at their peaks, walked back from what the
    snapshot's segments hold at its end (so a trace cut to its last MAX_ENTRIES events still counts right); the
    allocator's overhead at the peak (peak reserved / peak allocated - 1) and the most requested block sizes."""
    segments = [s for s in snapshot.get("segments", []) if s.get("device", 0) == device]
    reserved = sum(int(s.get("total_size", 0)) for s in segments)
    allocated = sum(int(b.get("requested_size", b.get("size", 0))) for s in segments for b in s.get("blocks", [])
                    if b.get("state") in ("active_allocated", "active_pending_free"))  # the trace's sizes
    end = (allocated, reserved)
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    peak_allocated, peak_reserved = allocated, reserved
    sizes: dict[int, int] = {}
    counts = {"alloc": 0, "free": 0, "segment_alloc": 0, "segment_free": 0, "oom": 0}
    for event in reversed(trace):  # undo each event: the state before it
        action, size = event.get("action"), int(event.get("size", 0))
        if action == "alloc":
            allocated -= size
            sizes[size] = sizes.get(size, 0) + 1
            counts["alloc"] += 1
        elif action == "free_completed":
            allocated += size
            counts["free"] += 1
        elif action in ("segment_alloc", "segment_map"):
            reserved -= size
            counts["segment_alloc"] += 1
        elif action in ("segment_free", "segment_unmap"):
            reserved += size
            counts["segment_free"] += 1
        elif action == "oom":
            counts["oom"] += 1
        peak_allocated, peak_reserved = max(peak_allocated, allocated), max(peak_reserved, reserved)
    return {"events": len(trace), "counts": counts, "peak_allocated_bytes": peak_allocated,
            "peak_reserved_bytes": peak_reserved,
            "allocator_fraction": peak_reserved / peak_allocated - 1 if peak_allocated else None,
            "allocated_end_bytes": end[0], "reserved_end_bytes": end[1],
            "most_requested": sorted(sizes.items(), key=lambda kv: -kv[0] * kv[1])[:10]}


TRACE_CODES = {"alloc": ALLOC, "free_completed": FREE, "segment_alloc": SEGMENT_ALLOC, "segment_free": SEGMENT_FREE}


def trace_events(snapshot: dict, device: int = 0) -> list[tuple[int, int, int]]:
    """The device's trace as (code, size, address): allocations, completed frees, segments reserved and released
    (planner/caching_allocator.replay's input)."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    return [(TRACE_CODES[e["action"]], int(e.get("size", 0)), int(e.get("addr", 0))) for e in trace
            if e.get("action") in TRACE_CODES]
