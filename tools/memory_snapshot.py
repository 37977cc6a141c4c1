"""Summarise a CUDA memory snapshot (pretrain_gpt.py --record-memory-history, or torch.cuda.memory._dump_snapshot):
the allocated and reserved bytes at their peaks over the recorded trace, the caching allocator's overhead at the
peak (peak reserved / peak allocated - 1: the allocator fraction planner/cuda_allowance.py derives), and the most
requested block sizes.

    python tools/memory_snapshot.py snapshot.pickle [--device 0] [--json out.json]
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_bmw.errors import OneLineParser, UsageError, exit_on_usage_error  # noqa: E402
from megatron_bmw.training.memory_history import read_snapshot, summarize  # noqa: E402

GiB, MiB = 2**30, 2**20


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="memory_snapshot.py", description=__doc__.splitlines()[0])
    ap.add_argument("snapshot")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device < 0:
        raise UsageError("--device must be >= 0")
    s = summarize(read_snapshot(args.snapshot), args.device)
    if not s["events"]:
        raise UsageError(f"{args.snapshot}: no recorded events on device {args.device} (was the history recorded?)")
    frac = s["allocator_fraction"]
    print(f"device {args.device}: {s['events']} events ({s['counts']['alloc']} allocations, {s['counts']['free']} "
          f"frees, {s['counts']['segment_alloc']} segments reserved, {s['counts']['segment_free']} released"
          f"{', ' + str(s['counts']['oom']) + ' out of memory' if s['counts']['oom'] else ''})")
    print(f"peak allocated {s['peak_allocated_bytes'] / GiB:.3f} GiB, peak reserved {s['peak_reserved_bytes'] / GiB:.3f}"
          f" GiB: allocator overhead {'-' if frac is None else f'{100 * frac:.1f}%'} (peak reserved / peak allocated"
          " - 1)")
    print("most requested sizes (MiB x count): " + ", ".join(f"{size / MiB:.2f} x {n}" for size, n in
                                                            s["most_requested"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
