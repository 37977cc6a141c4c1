"""Simulator: exact pipeline formulas, agreement with replay(), critical path and master stage, memory, speed."""

import random

import pytest

from megatron_bmw.pipeline.bpipe import insert_bpipe, mu_opt
from megatron_bmw.pipeline.generators import generate
from megatron_bmw.pipeline.holding import peak_inflight, resident_peaks
from megatron_bmw.pipeline.replay import replay
from megatron_bmw.pipeline.slicing import slice_microbatches
from megatron_bmw.pipeline.schedule import Kind
from megatron_bmw.planner.simulator import compile_schedule, simulate

F, B = 1.0, 2.0


def _uniform(rank, a):
    return F if a.kind is Kind.FORWARD else B


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(1, 1), (2, 2), (4, 8), (4, 3), (8, 16), (5, 1)])
def test_equal_stages_take_m_plus_p_minus_1(name, p, m):
    sim = simulate(generate(name, p, m), _uniform)
    assert sim.iteration_time == pytest.approx((m + p - 1) * (F + B))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert all(busy == pytest.approx(m * (F + B)) for busy in sim.busy)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 3), (3, 6, 2)])
def test_interleaved_bubble_is_divided_by_v(p, m, v):
    """Chunks of forward F/v and backward B/v: bubble (p - 1)(F + B)/v per rank."""
    sim = simulate(generate("interleaved", p, m, v), lambda r, a: _uniform(r, a) / v)
    assert sim.iteration_time == pytest.approx(m * (F + B) + (p - 1) * (F + B) / v)


@pytest.mark.parametrize("p,m", [(4, 8), (4, 2), (6, 6), (1, 3)])
def test_peak_inflight_of_1f1b_is_min_p_minus_s_m(p, m):
    sim = simulate(generate("1f1b", p, m), _uniform, chunk_bytes=[[1.0]] * p)
    assert sim.peak_memory == [min(p - s, m) for s in range(p)]
    assert peak_inflight(generate("1f1b", p, m)) == [min(p - s, m) for s in range(p)]


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1), ("interleaved", 4, 8, 2),
                                        ("interleaved", 2, 4, 3), ("1f1b", 5, 3, 1), ("1f1b", 1, 4, 1),
                                        ("zb-h1", 4, 8, 1), ("zb-h2", 3, 7, 1), ("zbv", 3, 5, 2)])
def test_matches_replay_with_random_durations(name, p, m, v):
    rnd = random.Random(p * 100 + m)
    base = {(r, c): rnd.uniform(0.5, 2.0) for r in range(p) for c in range(v)}

    def compute(rank, a):
        return base[(rank, a.chunk)] * (1.0 if a.kind is Kind.FORWARD else rnd.uniform(1.8, 2.2))

    cache = {}

    def fixed(rank, a):  # the same duration for the same action in both runs
        return cache.setdefault((rank, a), compute(rank, a))

    def transfer(src, dst, a):
        return 0.01 * (1 + src + 2 * dst)

    sched = generate(name, p, m, v)
    ref = replay(sched, fixed, transfer)
    sim = simulate(sched, fixed, transfer)
    assert sim.pipeline_time == pytest.approx(ref.makespan, abs=1e-12)
    assert sim.busy == pytest.approx(ref.busy)
    # the critical path is contiguous: each step starts when its predecessor's effect arrives, and ends the run
    path = sim.critical_path
    assert path[-1][3] == pytest.approx(sim.pipeline_time)
    assert path[0][2] == pytest.approx(0.0)
    for (r0, a0, s0, e0), (r1, a1, s1, e1) in zip(path, path[1:]):
        assert s1 >= e0 - 1e-12
        assert s1 - e0 <= 0.01 * (1 + 3 * p) + 1e-12


def test_critical_path_of_equal_stages_runs_through_last_stage():
    p, m = 4, 8
    sim = simulate(generate("1f1b", p, m), _uniform)
    assert sim.master_stage == p - 1
    assert sum(e - s for _, _, s, e in sim.critical_path) == pytest.approx((m + p - 1) * (F + B))
    steady_ranks = {r for r, a, _, _ in sim.critical_path[p:-p]}
    assert steady_ranks == {p - 1}


@pytest.mark.parametrize("heavy", [0, 1, 2, 3])
def test_master_stage_is_the_heavy_stage(heavy):
    p, m = 4, 12

    def compute(rank, a):
        return _uniform(rank, a) * (1.5 if rank == heavy else 1.0)

    sim = simulate(generate("1f1b", p, m), compute)
    assert sim.master_stage == heavy


def test_autopipe_recurrence_oracle():
    """AutoPipe's 1F1B-phase recurrences (with communication c) give the same start times as the simulator."""
    p, m, c = 4, 8, 0.1
    f = [1.0, 1.3, 0.8, 1.1]
    b = [2.1, 2.5, 1.7, 2.0]
    sched = generate("1f1b", p, m)
    sim = simulate(sched, lambda r, a: f[r] if a.kind is Kind.FORWARD else b[r], lambda s, d, a: c)
    start = {(r, a.kind, a.microbatch): s for r, acts in enumerate(sim.computes) for a, s, _ in acts}
    fw, bw = Kind.FORWARD, Kind.BACKWARD
    for x in range(p):  # warm-up: forwards flow down as soon as possible
        for y in range(min(p - x - 1, m)):
            expect = 0.0 if x == 0 else start[(x - 1, fw, y)] + f[x - 1] + c
            expect = max(expect, (start[(x, fw, y - 1)] + f[x]) if y else 0.0)
            assert start[(x, fw, y)] == pytest.approx(expect)
    for x in range(p):  # steady 1F1B blocks
        w = p - x - 1
        for y in range(w, m):
            k = y - w  # backward index paired after forward y
            prev_end = start[(x, bw, k - 1)] + b[x] if k else start[(x, fw, y - 1)] + f[x] if y else 0.0
            arrive = 0.0 if x == 0 else start[(x - 1, fw, y)] + f[x - 1] + c
            assert start[(x, fw, y)] == pytest.approx(max(prev_end, arrive))
            grad = start[(x, fw, y)] + f[x] if x == p - 1 else start[(x + 1, bw, k)] + b[x + 1] + c
            assert start[(x, bw, k)] == pytest.approx(max(grad, start[(x, fw, y)] + f[x]))


@pytest.mark.parametrize("p,m", [(4, 8), (6, 12)])
def test_bpipe_schedule_moves_memory_and_hides_transfers(p, m):
    """BPipe's transform: evictor memory drops to mu_opt, the acceptor holds more, fast copies cost nothing,
    slow ones show; timings equal replay's, the memory walk equals the activation store's accounting."""
    plain = generate("1f1b", p, m)
    sched = insert_bpipe(plain)
    chunk = [[10.0]] * p
    fast = simulate(sched, _uniform, copy_time=lambda r, a, n: 0.1 * n / 10.0, chunk_bytes=chunk)
    base = simulate(plain, _uniform, chunk_bytes=chunk)
    assert fast.iteration_time == pytest.approx(base.iteration_time)
    limit = mu_opt(p)
    assert max(fast.peak_memory) <= 10.0 * limit < base.peak_memory[0]
    assert fast.peak_memory[p - 1] > base.peak_memory[p - 1]
    assert fast.peak_memory == pytest.approx([10.0 * x for x in resident_peaks(sched)])
    evicts = [a for a, _, _ in fast.copies[0]]
    assert evicts and all(a.kind is Kind.EVICT and a.peer == p - 1 for a in evicts)
    assert all(a.kind is Kind.RETURN for a, _, _ in fast.copies[p - 1])
    slow_copy = lambda r, a, n: 3.0  # noqa: E731
    slow = simulate(sched, _uniform, copy_time=slow_copy, chunk_bytes=chunk)
    ref = replay(sched, _uniform, bpipe_time=lambda s, d, a: 3.0)
    assert slow.pipeline_time == pytest.approx(ref.makespan)
    assert slow.iteration_time > base.iteration_time


def test_sliced_schedule_runs_halves():
    p, m = 4, 8
    sched = slice_microbatches(generate("1f1b", p, m), 2)
    sim = simulate(sched, lambda r, a: _uniform(r, a) * (0.5 if a.half is not None else 1.0),
                   chunk_bytes=[[2.0]] * p)
    plain = simulate(generate("1f1b", p, m), _uniform)
    assert sim.iteration_time < plain.iteration_time  # the last stage starts earlier
    assert sum(1 for a, _, _ in sim.computes[0] if a.half is not None) == 8
    assert sim.peak_memory[0] <= 2.0 * p


def test_sync_after_pipeline_extends_iteration():
    sched = generate("1f1b", 2, 4)
    sim = simulate(sched, _uniform, finish=lambda ends, last: [e + 0.5 for e in ends])
    assert sim.iteration_time == pytest.approx(sim.pipeline_time + 0.5)
    assert sim.idle[0] == pytest.approx(sim.iteration_time - sim.busy[0])


def test_large_schedule_p64_m512():
    """A large schedule runs (its speed is a benchmark's business: benchmarks/search_speed.py), and a compiled
    schedule reused gives the same iteration as compiling it again."""
    sched = generate("1f1b", 64, 512)
    compiled = compile_schedule(sched)
    plain = simulate(sched, _uniform, lambda s, d, a: 0.01)
    again = simulate(compiled, _uniform, lambda s, d, a: 0.01, chunk_bytes=[[1.0]] * 64)
    assert plain.iteration_time == again.iteration_time > 0
    assert again.peak_memory[0] == 64.0 and again.peak_memory[-1] == 1.0  # 1F1B: p - r micro-batches
