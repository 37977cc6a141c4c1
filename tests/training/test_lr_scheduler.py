import math

import pytest

from megatron_bmw.errors import UsageError
from megatron_bmw.config import LRConfig
from megatron_bmw.training.lr_scheduler import LRScheduler


class _Opt:
    lr = decoupled = None

    def set_lr(self, lr, decoupled_lr=None):
        self.lr, self.decoupled = lr, decoupled_lr


def _lr_at(sched, n):
    sched.num_steps = n
    return sched.get_lr()


@pytest.mark.parametrize(
    "style, expected",
    [
        ("constant", {0: 0.0, 5: 0.5, 10: 1.0, 35: 1.0, 60: 1.0, 110: 1.0, 500: 1.0}),
        ("linear", {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.1 + 0.9 * 0.75, 60: 0.55, 110: 0.1, 500: 0.1}),
        (
            "cosine",
            {0: 0.0, 5: 0.5, 10: 1.0, 35: 0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1), 60: 0.55, 110: 0.1, 500: 0.1},
        ),
    ],
)
def test_schedule_values(style, expected):
    sched = LRScheduler(None, LRConfig(lr=1.0, min_lr=0.1, lr_decay_style=style, lr_warmup_iters=10, train_iters=110))
    for n, lr in expected.items():
        assert _lr_at(sched, n) == pytest.approx(lr, abs=1e-12), (style, n)


def test_warmup_fraction_and_step_pushes_lr():
    opt = _Opt()
    sched = LRScheduler(opt, LRConfig(lr=2.0, lr_decay_style="linear", lr_warmup_fraction=0.1, lr_decay_iters=100))
    assert opt.lr == 0.0  # Megatron: the first iteration of a warm-up runs at lr 0
    for _ in range(5):
        sched.step()
    assert opt.lr == pytest.approx(1.0) and sched.get_lr() == pytest.approx(1.0)
    sched.step(50)
    assert opt.lr == pytest.approx(2.0 * (1 - 45 / 90))


def test_state_dict_round_trip_and_override():
    cfg = LRConfig(lr=1.0, lr_decay_style="cosine", lr_warmup_iters=2, train_iters=20)
    a = LRScheduler(None, cfg)
    a.step(7)
    b = LRScheduler(_Opt(), LRConfig(lr=0.5, lr_decay_style="linear", train_iters=40))
    b.load_state_dict(a.state_dict())
    assert b.get_lr() == a.get_lr() and b.optimizer.lr == a.get_lr() and b.num_steps == 7
    c = LRScheduler(None, LRConfig(lr=0.5, lr_decay_style="constant", train_iters=40))
    c.load_state_dict(a.state_dict(), override=True)
    assert c.num_steps == 7 and c.get_lr() == 0.5


@pytest.mark.parametrize("floor", [0.3, None])
def test_decoupled_lr_follows_the_schedule(floor):
    """--decoupled-lr: the embedding and output layer's peak (and floor, default --min-lr) on the same warm-up
    and cosine decay; without it the optimizer gets None (every group at lr)."""
    opt = _Opt()
    sched = LRScheduler(opt, LRConfig(lr=1.0, min_lr=0.1, lr_decay_style="cosine", lr_warmup_iters=10,
                                      train_iters=110, decoupled_lr=3.0, decoupled_min_lr=floor))
    for n in (1, 5, 10, 35, 60, 110, 200):
        sched.step(n - sched.num_steps)
        coeff = min(n, 10) / 10 if n <= 10 else 0.0 if n > 110 else 0.5 * (math.cos(math.pi * (n - 10) / 100) + 1)
        low = 0.3 if floor else 0.1
        expected = 3.0 * coeff if n <= 10 else low + coeff * (3.0 - low)
        assert opt.decoupled == pytest.approx(expected, abs=1e-12) and opt.lr == sched.get_lr(), n
    LRScheduler(opt, LRConfig(lr=1.0, train_iters=10))
    assert opt.decoupled is None


def test_a_changed_schedule_needs_one_of_megatrons_flags():
    """Megatron's _check_and_set: a setting that differs from the checkpoint's stops the load (naming it and its
    flags) unless the checkpoint's schedule is kept or this run's overrides it."""
    from megatron_bmw.errors import UsageError

    saved = LRScheduler(None, LRConfig(lr=1.0, lr_decay_style="cosine", lr_warmup_iters=2, train_iters=20))
    saved.step(7)
    longer = LRConfig(lr=1.0, lr_decay_style="cosine", lr_warmup_iters=2, train_iters=40)
    with pytest.raises(UsageError) as info:
        LRScheduler(None, longer).load_state_dict(saved.state_dict(), use_checkpoint=False, where="--load ck")
    assert str(info.value) == (
        "--load ck: the checkpoint's learning-rate schedule has lr_decay_steps = 20, this run 40 (samples: "
        "--lr-decay-iters or --lr-decay-samples, by default --train-iters or --train-samples); give "
        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's schedule or --override-opt_param-scheduler "
        "to use this run's")
    kept = LRScheduler(None, longer)
    kept.load_state_dict(saved.state_dict(), use_checkpoint=True)
    assert kept.lr_decay_steps == 20 and kept.get_lr() == saved.get_lr()
    overridden = LRScheduler(None, longer)
    overridden.load_state_dict(saved.state_dict(), override=True, use_checkpoint=False)
    assert overridden.lr_decay_steps == 40 and overridden.num_steps == 7
    same = LRScheduler(None, LRConfig(lr=1.0, lr_decay_style="cosine", lr_warmup_iters=2, train_iters=20))
    same.load_state_dict(saved.state_dict(), use_checkpoint=False)
    assert same.get_lr() == saved.get_lr()


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(lr=1.0, train_iters=10, decoupled_min_lr=0.1), "--decoupled-min-lr needs --decoupled-lr"),
        (dict(lr=1.0, train_iters=10, decoupled_lr=0.1, decoupled_min_lr=0.2), "--decoupled-min-lr 0.2 exceeds"),
        (dict(lr=1.0, min_lr=0.5, train_iters=10, decoupled_lr=0.1), "--min-lr 0.5 exceeds --decoupled-lr"),
        (dict(lr=1.0, train_iters=10, decoupled_lr=-1.0), "--decoupled-lr must be >= 0"),
        (dict(lr=1.0, lr_decay_style="step", train_iters=10), "--lr-decay-style"),
        (dict(lr=1.0, lr_warmup_iters=2, lr_warmup_fraction=0.1, train_iters=10), "--lr-warmup-fraction"),
        (dict(lr=1.0), "--lr-decay-iters"),
        (dict(lr=1.0, min_lr=2.0, train_iters=10), "--min-lr"),
        (dict(lr=1.0, lr_warmup_iters=10, train_iters=10), "--lr-warmup-iters"),
    ],
)
def test_bad_config(kwargs, flag):
    with pytest.raises(UsageError, match=flag):
        LRConfig(**kwargs)
