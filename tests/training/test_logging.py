import math
import re

from megatron_bmw.training.logging import TensorBoardWriter, format_train_log, format_validation_log

MEGATRON_LINE = re.compile(
    r"iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \| elapsed time per iteration \(ms\): ([\d.]+) \| "
    r"learning rate: ([\d.E+-]+) \| global batch size:\s+(\d+) \| lm loss: ([\d.E+-]+) \| loss scale: ([\d.]+) \| "
    r"grad norm: ([\d.]+) \|"
)


def _line(**over):
    kwargs = dict(
        iteration=5,
        train_iters=10,
        consumed_samples=40,
        elapsed_ms=123.44,
        learning_rate=1e-4,
        global_batch_size=8,
        losses={"lm loss": 12.345671},
        loss_scale=1.0,
        grad_norm=1.2344,
        skipped_iters=0,
        nan_iters=0,
    )
    kwargs.update(over)
    return format_train_log(**kwargs)


def test_train_line_is_megatrons():
    line = _line()
    assert line == (
        " iteration        5/      10 | consumed samples:           40 | elapsed time per iteration (ms): 123.4 |"
        " learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 1.234567E+01 | loss scale: 1.0 |"
        " grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |"
    )
    m = MEGATRON_LINE.search(line)
    assert m and m.groups() == ("5", "10", "40", "123.4", "1.000000E-04", "8", "1.234567E+01", "1.0", "1.234")


def test_grad_norm_omitted_when_none():
    line = _line(grad_norm=None, loss_scale=65536.0, skipped_iters=3)
    assert "grad norm" not in line and "loss scale: 65536.0 |" in line
    assert line.endswith(" number of skipped iterations:   3 | number of nan iterations:   0 |")


def test_validation_line():
    assert format_validation_log(7, 2.5) == (
        f"validation loss at iteration 7 | lm loss value: 2.500000E+00 | lm loss PPL: {math.exp(2.5):.6E} | "
    )
    assert f"lm loss PPL: {math.exp(20):.6E} |" in format_validation_log(1, 50.0)


def test_tensorboard_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = TensorBoardWriter(str(tmp_path))
    assert w.enabled
    for step in (1, 2, 3):
        w.add_scalars({"lm loss": 10.0 - step, "learning-rate": 1e-4 * step}, step)
    w.flush()
    w.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert {"lm loss", "learning-rate"} <= set(acc.Tags()["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("lm loss")] == [(1, 9.0), (2, 8.0), (3, 7.0)]


def test_tensorboard_disabled_is_noop():
    w = TensorBoardWriter(None)
    w.add_scalars({"x": 1.0}, 1)
    w.flush()
    w.close()
    assert not w.enabled


def test_megatron_prefix_throughput_and_omitted_loss():
    import re

    from megatron_bmw.training.logging import IntervalStats, timestamp

    assert re.fullmatch(r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\]", timestamp())
    line = _line(prefix=" [2024-01-02 03:04:05]", throughput=123.456, losses={"lm loss": None}, grad_norm=None)
    assert line.startswith(" [2024-01-02 03:04:05] iteration        5/      10 |")
    assert " elapsed time per iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 123.5 | learning rate:" in line
    assert "lm loss" not in line
    stats = IntervalStats()
    stats.add(float("nan"), False)
    stats.add(3.0, False)  # an fp16 overflow: skipped, its loss not averaged
    assert (stats.loss, stats.skipped, stats.nan, stats.iterations) == (None, 2, 1, 2)
    stats.add(2.0, True)
    stats.add(4.0, True)
    assert stats.loss == 3.0
    stats.reset()
    assert stats.loss is None and stats.iterations == 0
