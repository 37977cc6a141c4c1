"""Record executed actions and write them in Chrome trace format (opens in Perfetto / chrome://tracing)."""

from __future__ import annotations

import json

import torch.distributed as dist

from .schedule import Action, Kind


class Tracer:
    def __init__(self, rank: int, pp_rank: int) -> None:
        self.rank = rank
        self.pp_rank = pp_rank
        self.events: list[dict] = []

    def record(self, a: Action, start: float, end: float) -> None:
        cat = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.BACKWARD_INPUT: "backward",
               Kind.BACKWARD_WEIGHT: "weight-gradient"}.get(a.kind, "transfer")
        self.events.append(self._event(a.label(show_chunk=a.chunk > 0), cat, start, end, a))

    def record_wait(self, kind: Kind, a: Action, start: float, end: float) -> None:
        self.events.append(self._event(f"wait {kind.value} {a.microbatch}", "wait", start, end, a, tid=1))

    def _event(self, name, cat, start, end, a: Action, tid: int = 0) -> dict:
        return {"name": name, "cat": cat, "ph": "X", "pid": self.rank, "tid": tid, "ts": start * 1e6,
                "dur": max(0.0, end - start) * 1e6,
                "args": {"kind": a.kind.value, "microbatch": a.microbatch, "chunk": a.chunk, "half": a.half,
                         "pp_rank": self.pp_rank}}

    def write(self, path: str) -> None:
        """Gather every rank's events to global rank 0, which writes one JSON file."""
        events = self.events
        if dist.is_initialized() and dist.get_world_size() > 1:
            gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            dist.gather_object(events, gathered, dst=0)
            if dist.get_rank() != 0:
                return
            events = [e for part in gathered for e in part]
        t0 = min((e["ts"] for e in events), default=0.0)
        for e in events:
            e["ts"] -= t0
        meta = [{"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}}
                for r in sorted({e["pid"] for e in events})]
        with open(path, "w") as f:
            json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms"}, f)
