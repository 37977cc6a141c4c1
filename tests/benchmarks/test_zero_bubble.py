"""benchmarks/zero_bubble.py's analysis: a trace made from a known timeline is simulated back to that timeline."""

from benchmarks.zero_bubble import in_run_latencies, our_schedule, simulate_ours
from megatron_bmw.pipeline.replay import replay
from megatron_bmw.pipeline.schedule import COMPUTE_KINDS

DURATION = {"F": 1.0, "B": 2.0, "BI": 1.2, "W": 0.8}
TRANSFER = 0.3


def _records(name: str, p: int, m: int, rounds: int):
    """Per rank, what the benchmark's workers return for `rounds` iterations of a replayed timeline: each action's
    span starts where the rank's previous one ended and holds the wait for its input."""
    sched = our_schedule(name, p, m)
    rep = replay(sched, lambda rank, a: DURATION[a.kind.value] * (1 + 0.1 * rank), lambda *_: TRANSFER)
    out = []
    for rank, line in enumerate(rep.timeline):
        acts, prev = [], 0.0
        for a, start, end in line:
            if a.kind in COMPUTE_KINDS:
                wait = start - prev
                acts.append((a.kind.value, a.microbatch, a.chunk, a.half, prev, end, wait, start if wait else None))
                prev = end
        out.append({"records": {name: [{"elapsed": prev, "actions": acts, "w0": 0.0}] * rounds}})
    return sched, out, rep


def test_simulating_a_replayed_trace_gives_it_back():
    for name in ("1f1b", "zb-h1"):
        sched, res, rep = _records(name, 4, 8, 3)
        seen = in_run_latencies(sched, [r["records"][name] for r in res], [0, 2])
        assert seen and max(abs(x - TRANSFER) for x in seen) < 1e-9
        sim = simulate_ours(name, 4, 8, res, [0, 2], None)
        assert abs(sim["measured_s"] - rep.makespan) < 1e-9 and abs(sim["p2p_s"] - TRANSFER) < 1e-9
        assert abs(sim["error"]) < 1e-9 and abs(sim["own_error"]) < 1e-9 and abs(sim["tail_s"]) < 1e-9
        assert max(abs(a - b) for a, b in zip(sim["measured_bubble"], sim["simulated_bubble"])) < 1e-9
        assert sim["overhead_s"] == [0.0] * 4
        busy = [sum(DURATION[a.kind.value] * (1 + 0.1 * r) for a in acts if a.kind in COMPUTE_KINDS)
                for r, acts in enumerate(sched.actions)]
        assert max(abs(a - (1 - b / rep.makespan)) for a, b in zip(sim["simulated_bubble"], busy)) < 1e-9
        assert simulate_ours(name, 4, 8, res, [0], 0.0)["error"] < -1e-3  # transfers left out: too fast
