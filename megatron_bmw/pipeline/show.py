"""Print a pipeline schedule and its replayed timeline as text.

    python -m megatron_bmw.pipeline.show --pp 4 --microbatches 8 --schedule 1f1b [--virtual-stages 2]

As in Megatron-LM, 1F1B with more than one virtual stage per rank is the interleaved 1F1B schedule.
"""

from __future__ import annotations

import argparse
import math

from ..config import SCHEDULES, PipelineConfig
from ..errors import UsageError, exit_on_usage_error
from .build import build_schedule
from .checker import check
from .replay import Replay, replay, unit_times
from .schedule import COMPUTE_KINDS, Schedule


def render_timeline(result: Replay) -> str:
    """One row per rank, one column per time unit; compute labels, '.' for idle."""
    schedule = result.schedule
    show_chunk = schedule.virtual_stages > 1
    slots = math.ceil(result.makespan - 1e-9)
    rows = []
    width = 1
    for line in result.timeline:
        row = ["."] * slots
        for action, start, end in line:
            if action.kind not in COMPUTE_KINDS:
                continue
            label = action.label(show_chunk)
            width = max(width, len(label))
            for slot in range(int(math.floor(start + 1e-9)), math.ceil(end - 1e-9)):
                row[slot] = label
        rows.append(row)
    cell = width + 1
    name_width = len(f"rank {max(schedule.pp - 1, 0)}")
    ruler = [" "] * (slots * cell)
    for slot in range(0, slots, 5):
        for i, ch in enumerate(str(slot)):
            if slot * cell + i < len(ruler):
                ruler[slot * cell + i] = ch
    lines = [" " * (name_width + 1) + "".join(ruler).rstrip()]
    for rank, row in enumerate(rows):
        body = "".join(label.ljust(cell) for label in row)
        lines.append(f"{f'rank {rank}':<{name_width}} {body}".rstrip())
    return "\n".join(lines)


def describe(schedule: Schedule, result: Replay, show_comm: bool = False) -> str:
    """Full text report: action order, timeline, makespan and bubble."""
    ideal = max(result.busy) if result.busy else 0.0
    parts = [
        f"schedule {schedule.name}: p={schedule.pp} m={schedule.num_microbatches} v={schedule.virtual_stages}",
        "",
        "action order:" + (" (with communication)" if show_comm else ""),
        schedule.to_text(comm=show_comm),
        "",
        "timeline (one column per time unit):",
        render_timeline(result),
        "",
        f"makespan {result.makespan:g}, busiest rank computes {ideal:g}, "
        f"bubble fraction {result.bubble_fraction:.1%}",
    ]
    return "\n".join(parts)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m megatron_bmw.pipeline.show", description=__doc__.splitlines()[0])
    ap.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, required=True,
                    help="pipeline ranks p")
    ap.add_argument("--microbatches", "--num-microbatches", dest="microbatches", type=int, required=True,
                    help="micro-batches m per iteration")
    ap.add_argument("--schedule", "--pipeline-schedule", dest="schedule", choices=SCHEDULES, default="1f1b")
    ap.add_argument("--virtual-stages", "--virtual-pipeline-model-parallel-size", dest="virtual_stages", type=int,
                    default=1, help="model chunks per rank v; v > 1 makes 1f1b the interleaved schedule "
                    "(micro-batches a multiple of pp); not with gpipe")
    ap.add_argument("--forward-time", type=int, default=1, help="time units per FORWARD action (one chunk)")
    ap.add_argument("--backward-time", type=int, default=2, help="time units per BACKWARD action (one chunk)")
    ap.add_argument("--transfer-time", type=int, default=0, help="time units per point-to-point transfer")
    ap.add_argument("--show-comm", action="store_true", help="list SEND/RECV actions in the action order")
    return ap


@exit_on_usage_error
def main(argv: list[str] | None = None) -> None:
    """Build, check and print a schedule."""
    args = _parser().parse_args(argv)
    for flag, value, low in (
        ("--forward-time", args.forward_time, 1),
        ("--backward-time", args.backward_time, 1),
        ("--transfer-time", args.transfer_time, 0),
    ):
        if value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    # PipelineConfig reads 1F1B over virtual stages as the interleaved schedule (Megatron's meaning)
    pipeline = PipelineConfig(num_microbatches=args.microbatches, schedule=args.schedule,
                              virtual_stages=args.virtual_stages)
    schedule = build_schedule(pipeline, args.pp)
    check(schedule)
    transfer = float(args.transfer_time)
    result = replay(
        schedule,
        unit_times(float(args.forward_time), float(args.backward_time)),
        lambda src, dst, action: transfer,
    )
    print(describe(schedule, result, args.show_comm))


if __name__ == "__main__":
    main()
