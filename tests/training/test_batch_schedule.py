"""The global batch over training (Megatron's micro-batch calculator) and the sample-counted LR schedule."""

import math

import pytest

from megatron_bmw.arguments import parse_step_schedule
from megatron_bmw.config import BatchSchedule, LRConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.training.lr_scheduler import LRScheduler


def _megatron_rampup(gbs, start, inc, ramp, consumed):
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update, restated."""
    if consumed > ramp:
        return gbs
    per_increment = ramp / ((gbs - start) // inc)
    return start + int(consumed / per_increment) * inc


def _iterations_by_walking(schedule, train_samples):
    consumed = iters = 0
    while consumed + schedule.at(consumed) <= train_samples:
        consumed += schedule.at(consumed)
        iters += 1
    return iters


def test_rampup_follows_megatron_at_every_sample():
    s = BatchSchedule(1536, rampup=(16, 16, 5_859_375))  # GPT-3 175B's example script
    assert s.sizes() == list(range(16, 1537, 16)) and s.varies
    per = 5_859_375 / 95
    assert s.at(0) == 16 and s.at(math.floor(per)) == 16 and s.at(math.ceil(per)) == 32
    assert s.at(5_859_375) == 1536 and s.at(10**9) == 1536
    for consumed in range(0, 6_000_000, 9973):
        assert s.at(consumed) == _megatron_rampup(1536, 16, 16, 5_859_375, consumed)


@pytest.mark.parametrize("schedule,samples", [
    (BatchSchedule(8), 100),
    (BatchSchedule(32, rampup=(8, 8, 100)), 1000),
    (BatchSchedule(32, rampup=(8, 8, 100)), 50),
    (BatchSchedule(12, rampup=(4, 4, 0)), 70),
    (BatchSchedule(8, steps=((0, 2), (10, 4), (30, 8))), 95),
])
def test_iterations_hold_the_samples(schedule, samples):
    """--train-samples -> iterations: full batches only, the last partial one dropped (Megatron)."""
    assert schedule.iterations(samples) == _iterations_by_walking(schedule, samples)


def test_megatron_update_train_iters_example():
    # start 8, +8 every 100/3 samples up to 32: 5 x 8, 2 x 16, 2 x 24 (120 samples), then 27 x 32 in 1000
    assert BatchSchedule(32, rampup=(8, 8, 100)).iterations(1000) == 36


def test_step_schedule_parse_and_lookup():
    steps = parse_step_schedule("0:8 1K:16, 2k:32", seq_length=16)  # token thresholds -> samples
    assert steps == ((0, 8), (62, 16), (125, 32))
    s = BatchSchedule(32, steps=steps)
    assert [s.at(c) for c in (0, 61, 62, 124, 125, 10**6)] == [8, 8, 16, 16, 32, 32]
    assert s.sizes() == [8, 16, 32]
    assert parse_step_schedule("0:1.5K", 1) == ((0, 1500),)


@pytest.mark.parametrize("text", ["0-8", "a:8", "0:", "0:8 x"])
def test_step_schedule_bad_entries(text):
    with pytest.raises(UsageError, match="--step-batch-size-schedule"):
        parse_step_schedule(text, 16)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(global_batch_size=30, rampup=(8, 8, 100)), "whole number of increments"),
    (dict(global_batch_size=8, rampup=(16, 8, 100)), "whole number of increments"),
    (dict(global_batch_size=8, rampup=(0, 8, 100)), "start >= 1"),
    (dict(global_batch_size=8, rampup=(8, 0, 100)), "increment >= 1"),
    (dict(global_batch_size=8, steps=((5, 8),)), "first threshold must be 0"),
    (dict(global_batch_size=8, steps=((0, 4), (0, 8))), "thresholds must increase"),
])
def test_bad_schedules(kwargs, needle):
    with pytest.raises(UsageError, match=needle):
        BatchSchedule(**kwargs)


def test_lr_counts_samples_like_megatron():
    """Iteration lengths are multiplied by the global batch; the LR at n iterations is unchanged."""
    it = LRConfig(lr=1.0, min_lr=0.1, lr_decay_style="linear", lr_warmup_iters=10, train_iters=110,
                  global_batch_size=8)
    assert (it.decay_steps, it.warmup_steps) == (880, 80.0)
    sched = LRScheduler(None, it)
    ref = LRScheduler(None, LRConfig(lr=1.0, min_lr=0.1, lr_decay_style="linear", lr_warmup_iters=10,
                                     train_iters=110))
    for n in range(0, 130, 7):
        sched.num_steps, ref.num_steps = 8 * n, n
        assert sched.get_lr() == pytest.approx(ref.get_lr())
    sm = LRConfig(lr=1.0, lr_decay_style="cosine", train_samples=1000, lr_warmup_samples=100, lr_decay_samples=900)
    assert (sm.decay_steps, sm.warmup_steps) == (900, 100.0)
    frac = LRConfig(lr=1.0, train_samples=1000, lr_warmup_fraction=0.1)
    assert (frac.decay_steps, frac.warmup_steps) == (1000, 100.0)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(train_samples=100, lr_decay_iters=10), "--lr-decay-iters counts iterations; with --train-samples"),
    (dict(train_samples=100, lr_warmup_iters=2), "--lr-warmup-iters counts iterations"),
    (dict(train_iters=10, lr_decay_samples=50), "--lr-decay-samples needs sample-based training"),
    (dict(train_iters=10, lr_warmup_samples=5), "--lr-warmup-samples needs sample-based training"),
    (dict(train_samples=100, lr_warmup_samples=100), "--lr-warmup-samples must end before --lr-decay-samples"),
    (dict(train_samples=100, lr_warmup_samples=5, lr_warmup_fraction=0.1), "--lr-warmup-fraction and"),
])
def test_bad_sample_based_lr(kwargs, needle):
    with pytest.raises(UsageError, match=needle):
        LRConfig(lr=1.0, **kwargs)


def test_scheduler_steps_by_the_batch_and_converts_legacy_state():
    cfg = LRConfig(lr=1.0, lr_decay_style="linear", train_iters=10, global_batch_size=4)
    a = LRScheduler(None, cfg)
    for batch in (2, 2, 4):  # a ramped-up batch advances the count by what it consumed
        a.step(batch)
    assert a.num_steps == 8 and a.get_lr() == pytest.approx(1 - 8 / 40)
    legacy = {"max_lr": 1.0, "min_lr": 0.0, "lr_warmup_steps": 0.0, "lr_decay_steps": 10,
              "lr_decay_style": "linear", "num_steps": 2}  # counted iterations
    b = LRScheduler(None, cfg)
    b.load_state_dict(legacy, samples_per_iteration=4)
    assert (b.num_steps, b.lr_decay_steps, b.get_lr()) == (8, 40, a.get_lr())
    megatron = dict(legacy, num_steps=8, lr_decay_steps=40, start_wd=0.1)  # Megatron-LM's counts samples
    c = LRScheduler(None, cfg)
    c.load_state_dict(megatron, samples_per_iteration=4)
    assert (c.num_steps, c.lr_decay_steps) == (8, 40)
    d = LRScheduler(None, cfg)
    d.load_state_dict(a.state_dict(), samples_per_iteration=4)
    assert d.num_steps == 8
