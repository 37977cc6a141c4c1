"""BPipe: the transfer schedule (paper's algorithm, checker, replay), pair placement, and real runs whose loss
and gradients equal the run without BPipe while every rank stays within mu_opt micro-batches."""

import pytest

from megatron_bmw.errors import UsageError
from megatron_bmw.parallel.layout import RankLayout
from megatron_bmw.pipeline.bpipe import ActivationLimitError, bpipe_pairs, insert_bpipe, mu_opt
from megatron_bmw.pipeline.checker import check
from megatron_bmw.pipeline.generators import generate
from megatron_bmw.pipeline.holding import peak_inflight, resident_peaks
from megatron_bmw.pipeline.replay import replay, unit_times
from megatron_bmw.pipeline.schedule import COMPUTE_KINDS, TRANSFER_KINDS, Action, Kind, ScheduleError
from tests.reference import LLAMA
from tests.tiers import sample
from tests.pipeline.bpipe_cases import run_transformed


def _text(schedule, rank):
    show = schedule.virtual_stages > 1
    return " ".join(a.label(show) for a in schedule.actions[rank] if a.kind in COMPUTE_KINDS | TRANSFER_KINDS)


def test_mu_opt():
    assert [mu_opt(p) for p in (1, 2, 3, 4, 5, 8, 16)] == [2, 2, 3, 3, 4, 5, 9]
    assert mu_opt(4, 2) == 9 and mu_opt(8, 4) == 33


def test_paper_transfer_schedule_p8():
    # warm-up: evict the newest micro-batch once 5 would be exceeded; steady: evict the furthest-needed one at
    # the backward before and load one action ahead; cool-down: load in the idle slot before the backward
    s = insert_bpipe(generate("1f1b", 8, 16))
    assert _text(s, 0) == (
        "F0 F1 F2 F3 EV3>7 F4 EV4>7 F5 EV5>7 F6 F7 B0 F8 B1 F9 EV9>7 B2 LD3<7 F10 EV10>7 B3 LD4<7 F11 "
        "EV11>7 B4 LD5<7 F12 B5 F13 B6 F14 B7 F15 B8 LD9<7 B9 LD10<7 B10 LD11<7 B11 B12 B13 B14 B15")
    assert _text(s, 7).startswith("AC3<0 AC4<0 AC5<0 F0 B0")
    assert s.activation_limit == 5
    assert resident_peaks(s) == [5, 5, 5, 5, 4, 5, 5, 5]
    assert peak_inflight(s) == [8, 7, 6, 5, 4, 3, 2, 1]  # what each rank computes is unchanged


@pytest.mark.parametrize("p", range(1, 17))
def test_only_early_stages_evict(p):
    s = insert_bpipe(generate("1f1b", p, 64))
    evictors = {r for r in range(p) if any(a.kind is Kind.EVICT for a in s.actions[r])}
    assert evictors == set(range((p - 4) // 2 + 1)) if p >= 4 else not evictors
    assert set(bpipe_pairs(generate("1f1b", p, 64)).items()) == {(e, p - 1 - e) for e in evictors}
    untouched = generate("1f1b", p, 64)
    for r in range(p):
        if r not in evictors and p - 1 - r not in evictors:
            assert s.actions[r] == untouched.actions[r]


def _all_configs():
    """Every pp <= 16 and v <= 4 with the micro-batch counts where the schedule's shape changes (up to 2p + 2: fewer
    than, as many as and more than the warm-up holds) and a few large ones, up to 64."""
    for p in range(1, 17):
        counts = sorted(set(range(1, 2 * p + 3)) | {32, 48, 64})
        for v in range(1, 5):
            for m in counts:
                if v == 1 or (p > 1 and m % p == 0):
                    yield p, v, m


def test_every_transfer_schedule_passes_the_checker():
    """pp <= 16, m <= 64 (_all_configs), v <= 4: the checker finds no backward without its activations, matched FIFO
    transfers, no deadlock, and no rank (acceptors included) above mu_opt."""
    configs = list(_all_configs())
    assert len(configs) > 400
    for p, v, m in sample(configs, 4):  # the fast tier checks a quarter of them
        base = generate("1f1b" if v == 1 else "interleaved", p, m, v)
        s = insert_bpipe(base)
        check(s)
        assert max(resident_peaks(s)) <= mu_opt(p, v)


def test_interleaved_limit_and_sliced_input():
    s = insert_bpipe(generate("interleaved", 4, 16, 3))
    assert s.activation_limit == 13 and max(resident_peaks(s)) <= 13
    assert max(peak_inflight(s)) > 13
    from megatron_bmw.pipeline.slicing import slice_microbatches

    for p, m, k in ((4, 8, 2), (8, 16, 3), (6, 6, 6)):
        s = insert_bpipe(slice_microbatches(generate("1f1b", p, m), k))
        check(s)
        assert max(resident_peaks(s)) <= mu_opt(p)


def test_heavy_slicing_with_bpipe_is_refused_or_fitted():
    """Slicing most micro-batches can leave an acceptor half a micro-batch over mu_opt: an explicit K is
    refused in one line, an automatic one is reduced until BPipe fits."""
    from megatron_bmw.config import PipelineConfig
    from megatron_bmw.pipeline.build import build_schedule
    from megatron_bmw.pipeline.slicing import num_sliced, slice_microbatches

    base = generate("1f1b", 8, 16)
    with pytest.raises(ActivationLimitError, match="rank 5 would hold 5.5"):
        insert_bpipe(slice_microbatches(base, 9))
    with pytest.raises(UsageError, match="^--bpipe with --microbatch-slicing 9: rank 5 would hold 5.5 micro-batches "
                                         "of activations, above mu_opt 5; slice fewer micro-batches$"):
        build_schedule(PipelineConfig(2, 16, bpipe=True, slicing=9), 8)
    fitted = build_schedule(PipelineConfig(2, 16, bpipe=True, slicing="auto"), 8, slicing=9)
    assert num_sliced(fitted) == 8 and max(resident_peaks(fitted)) <= 5


def test_insert_bpipe_is_pure_and_refuses_gpipe():
    base = generate("1f1b", 6, 12)
    before = [list(a) for a in base.actions]
    insert_bpipe(base)
    assert base.actions == before and base.activation_limit is None
    with pytest.raises(UsageError, match="--bpipe needs the 1f1b or interleaved schedule"):
        insert_bpipe(generate("gpipe", 4, 8))
    with pytest.raises(ScheduleError, match="already has transfers"):
        insert_bpipe(insert_bpipe(base))


def _index(acts, label):
    return [a.label(False) for a in acts].index(label)


def test_checker_rejects_broken_transfers():
    good = insert_bpipe(generate("1f1b", 4, 6))
    assert _text(good, 0) == "F0 F1 EV1>3 F2 F3 EV3>3 B0 LD1<3 F4 B1 F5 B2 LD3<3 B3 B4 B5"
    check(good)

    s = good.copy()  # the load comes after the backward that needs it
    acts = s.actions[0]
    load = acts.pop(_index(acts, "LD1<3"))
    acts.insert(_index(acts, "B1") + 1, load)
    with pytest.raises(ScheduleError, match="rank 0: B1 runs while its activations are away on rank 3"):
        check(s)

    s = good.copy()  # the acceptor never returns them
    s.actions[3] = [a for a in s.actions[3] if a.label(False) != "RT1>0"]
    with pytest.raises(ScheduleError, match="never returned"):
        check(s)

    s = good.copy()  # eviction before the forward
    acts = s.actions[0]
    ev = acts.pop(_index(acts, "EV1>3"))
    acts.insert(0, ev)
    with pytest.raises(ScheduleError, match="not saved"):
        check(s)

    s = good.copy()  # an ACCEPT for a key never evicted
    s.actions[3].insert(0, Action(Kind.ACCEPT, 5, 0, 0))
    s.actions[3].append(Action(Kind.RETURN, 5, 0, 0))
    with pytest.raises(ScheduleError, match="evict channel rank 0 -> rank 3 does not match"):
        check(s)

    s = good.copy()  # the limit is enforced
    s.activation_limit = 2
    with pytest.raises(ScheduleError, match="rank 0: holds 3 chunk-micro-batches of activations, above the limit 2"):
        check(s)

    s = good.copy()  # bad peer
    i = _index(s.actions[0], "EV1>3")
    s.actions[0][i] = Action(Kind.EVICT, 1, 0, 0)
    with pytest.raises(ScheduleError, match="bad peer"):
        check(s)


def test_replay_times_transfers_beside_compute():
    s = insert_bpipe(generate("1f1b", 8, 16))
    base = replay(generate("1f1b", 8, 16), unit_times(1.0, 2.0)).makespan
    assert replay(s, unit_times(1.0, 2.0)).makespan == base  # free transfers cost nothing
    hidden = replay(s, unit_times(1.0, 2.0), bpipe_time=lambda src, dst, a: 0.5)
    assert hidden.makespan == base  # a transfer shorter than the compute it overlaps is hidden
    slow = replay(s, unit_times(1.0, 2.0), bpipe_time=lambda src, dst, a: 3.0)
    assert slow.makespan > base
    for result, cost in ((hidden, 0.5), (slow, 3.0)):  # a backward starts only once its load has arrived
        line = result.timeline[0]
        load = next(t for a, t, _ in line if a.label(False) == "LD9<7")
        b9 = next(t for a, t, _ in line if a.label(False) == "B9")
        assert b9 >= load + cost
    assert [len(x) for x in slow.timeline] == [len(a) for a in s.actions]


def test_replay_of_a_large_bpipe_schedule():
    """64 ranks, 512 micro-batches, BPipe on: the replay finishes and BPipe costs no time with free transfers."""
    s = insert_bpipe(generate("1f1b", 64, 512))
    assert replay(s, unit_times(1.0, 2.0), record=False).makespan == (512 + 63) * 3


@pytest.mark.parametrize("tp,dp,pp,node", [(1, 1, 4, 2), (1, 1, 8, 2), (2, 1, 4, 4), (2, 2, 4, 8), (1, 2, 6, 2),
                                           (2, 1, 8, 4), (1, 3, 4, 4), (4, 1, 4, 8)])
def test_pairs_share_a_node(tp, dp, pp, node):
    """With the bpipe order, stage s and stage p-1-s of every pipeline sit on one node when the node holds a
    multiple of 2 x tp ranks (--gpus-per-node); with Megatron's order they do not."""
    layout = RankLayout(tp, dp, pp, "bpipe")
    assert layout.split_pairs(node) == []
    for g in layout.pp_groups():
        for s in range(pp // 2):
            assert abs(g[s] - g[-1 - s]) == tp
    assert RankLayout(tp, dp, pp).split_pairs(node) != []


def test_pipeline_setup_needs_the_bpipe_order():
    from megatron_bmw.config import ParallelConfig, PipelineConfig
    from megatron_bmw.parallel.state import ParallelState
    from megatron_bmw.pipeline.stages import pipeline_setup
    from tests.reference import small_config

    state = ParallelState.build(ParallelConfig())
    with pytest.raises(UsageError, match="--bpipe needs the pair-adjacent rank order"):
        pipeline_setup(small_config(), state, 1, PipelineConfig(num_microbatches=4, bpipe=True))


# (world size, tp, pp, v, m, model overrides): BPipe alone, loss and gradients bit for bit
DIST_CASES = [
    (4, 1, 4, 1, 6, {"num_layers": 4}),
    (4, 1, 4, 2, 8, {"num_layers": 8}),
    (4, 1, 4, 1, 5, {"num_layers": 4, "recompute_granularity": "full"}),
    (8, 1, 8, 1, 10, {"num_layers": 8}),
    (8, 2, 4, 1, 6, {"num_layers": 4}),
    (8, 1, 4, 1, 4, {"num_layers": 4, "recompute_granularity": "selective"}),  # dp=2
    (4, 1, 4, 1, 6, {"num_layers": 4, **LLAMA}),  # Llama-family layers
]


def _check_memory(out, p, v, m):
    limit = mu_opt(p, v)
    moved = 0
    for o in out:
        s = o["stage"]
        assert o["limit"] == limit
        assert o["new"]["peak_microbatches"] <= limit
        if v == 1:
            assert o["plain"]["peak_microbatches"] == min(p - s, m)
        moved += o["transfers"]
        plain, new = o["plain"], o["new"]
        if new["peak_accepted_bytes"] == 0:  # own activations only: bytes scale with the micro-batch count
            per_mb = plain["peak_bytes"] / plain["peak_microbatches"]
            assert new["peak_bytes"] == pytest.approx(per_mb * new["peak_microbatches"], rel=0.02)
    assert moved > 0
    assert max(o["plain"]["peak_microbatches"] for o in out) > limit


@pytest.mark.slow
@pytest.mark.parametrize("ws,tp,pp,v,m,overrides", DIST_CASES)
def test_bpipe_run_equals_plain_run(ws, tp, pp, v, m, overrides):
    out = run_transformed(ws, tp, pp, v, m, overrides, True, 0)
    _check_memory(out, pp, v, m)


@pytest.mark.slow
def test_bpipe_run_pp6():
    """pp=6 on its own pool of six ranks, several cases in one go."""
    for v, m, overrides in ((1, 7, {"num_layers": 6}), (1, 12, {"num_layers": 6, "recompute_granularity": "full"})):
        out = run_transformed(6, 1, 6, v, m, overrides, True, 0)
        _check_memory(out, 6, v, m)
