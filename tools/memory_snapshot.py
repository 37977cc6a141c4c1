"""Summarise a CUDA memory snapshot (pretrain_gpt.py --record-memory-history, or torch.cuda.memory._dump_snapshot):
the allocated and reserved bytes at their peaks over the recorded trace, the caching allocator's overhead at the
peak (peak reserved / peak allocated - 1: the allocator fraction planner/cuda_allowance.py derives), and the most
requested block sizes. --replay runs the trace's requests through planner/caching_allocator.py, the model of the
allocator, and sets what it reserves beside what the allocator did (also for gpu_check's allocator_trace.json).

    python tools/memory_snapshot.py snapshot.pickle [--device 0] [--replay] [--json out.json]
    python tools/memory_snapshot.py allocator_trace.json --replay
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_bmw.errors import OneLineParser, UsageError, exit_on_usage_error  # noqa: E402
from megatron_bmw.planner.caching_allocator import replay  # noqa: E402
from megatron_bmw.planner.files import read_json  # noqa: E402
from megatron_bmw.training.memory_history import read_snapshot, summarize, trace_events  # noqa: E402

GiB, MiB = 2**30, 2**20


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="memory_snapshot.py", description=__doc__.splitlines()[0])
    ap.add_argument("snapshot", help="a snapshot pickle, or gpu_check's allocator_trace.json (with --replay)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--replay", action="store_true", help="replay the requests through the allocator model")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device < 0:
        raise UsageError("--device must be >= 0")
    if args.snapshot.endswith(".json"):
        if not args.replay:
            raise UsageError(f"{args.snapshot}: a trace file (gpu_check's allocator_trace.json) takes --replay")
        trace = read_json(args.snapshot, "trace", "trace")
        out = {"replay": replayed(args.snapshot, trace.get("events") if isinstance(trace, dict) else None)}
    else:
        snap = read_snapshot(args.snapshot)
        out = summary(args.snapshot, snap, args.device)
        if args.replay:
            out["replay"] = replayed(args.snapshot, trace_events(snap, args.device))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


def summary(path: str, snap: dict, device: int) -> dict:
    s = summarize(snap, device)
    if not s["events"]:
        raise UsageError(f"{path}: no recorded events on device {device} (was the history recorded?)")
    c, frac = s["counts"], s["allocator_fraction"]
    oom = f", {c['oom']} out of memory" if c["oom"] else ""
    print(f"device {device}: {s['events']} events ({c['alloc']} allocations, {c['free']} frees, {c['segment_alloc']} "
          f"segments reserved, {c['segment_free']} released{oom})")
    print(f"peak allocated {s['peak_allocated_bytes'] / GiB:.3f} GiB, peak reserved "
          f"{s['peak_reserved_bytes'] / GiB:.3f} GiB: allocator overhead {'-' if frac is None else f'{100 * frac:.1f}%'} (peak reserved / peak allocated"
          " - 1)")
    print("most requested sizes (MiB x count): " + ", ".join(f"{size / MiB:.2f} x {n}" for size, n in
                                                            s["most_requested"]))
    return s


def replayed(path: str, events) -> dict:
    """planner/caching_allocator.py replaying the trace's requests, beside what the allocator reserved."""
    if not isinstance(events, list) or not events or not all(isinstance(e, (list, tuple)) and len(e) == 3
                                                             for e in events):
        raise UsageError(f"{path}: no (code, size, address) events to replay")
    bad = next((i for i, e in enumerate(events) if not all(isinstance(x, int) and not isinstance(x, bool)
                                                           for x in e) or e[1] < 0 or e[2] < 0), None)
    if bad is not None:
        raise UsageError(f"{path}: event {bad} {events[bad]!r} is not (code, size >= 0, address >= 0) in integers")
    try:
        r = replay(events)
    except ValueError as exc:
        raise UsageError(f"{path}: cannot replay: {exc}") from None
    print(f"allocator model: peak reserved {r['model_peak_reserved'] / GiB:.3f} GiB in {r['model_segments']} "
          f"segments (of which must stay reserved: {r['model_pinned_peak'] / GiB:.3f} GiB); recorded "
          f"{r['recorded_peak_reserved'] / GiB:.3f} GiB in {r['recorded_segments']} segments: "
          f"{'the same segments' if r['same_segments'] else 'other segments'}")
    return r


if __name__ == "__main__":
    sys.exit(main())
