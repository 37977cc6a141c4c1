import pytest

from megatron_bmw.training.loss_scaler import ConstantLossScaler, DynamicLossScaler


def test_constant_scaler_never_changes():
    s = ConstantLossScaler(128.0)
    s.update(True)
    s.update(False)
    assert s.scale == 128.0 and s.inv_scale == 1 / 128.0
    with pytest.raises(ValueError):
        ConstantLossScaler(0.0)


def test_hysteresis_backs_off_after_budget_is_spent():
    s = DynamicLossScaler(2.0**16, 1.0, growth_interval=1000, hysteresis=2)
    s.update(True)
    assert s.scale == 2.0**16  # first overflow only uses up hysteresis
    s.update(False)  # a clean step does not refill the budget (Megatron: only growth does)
    s.update(True)
    assert s.scale == 2.0**15
    s.update(True)  # budget spent: every further overflow backs off
    assert s.scale == 2.0**14


def test_growth_after_window_refills_hysteresis():
    s = DynamicLossScaler(4.0, 1.0, growth_interval=3, hysteresis=2)
    s.update(True)  # hysteresis 2 -> 1, no backoff
    for _ in range(3):
        s.update(False)
    assert s.scale == 8.0
    s.update(True)  # refilled: 2 -> 1, no backoff
    assert s.scale == 8.0
    s.update(True)
    assert s.scale == 4.0


def test_overflow_resets_growth_counter_and_min_scale_holds():
    s = DynamicLossScaler(2.0, 1.0, growth_interval=2, hysteresis=1)
    s.update(False)
    s.update(True)  # backoff to 1.0 and growth counter reset
    assert s.scale == 1.0
    s.update(False)
    assert s.scale == 1.0
    s.update(True)
    assert s.scale == 1.0  # clamped at min_scale


def test_state_dict_round_trip():
    s = DynamicLossScaler(2.0**10, 1.0, growth_interval=5, hysteresis=3)
    s.update(True)
    s.update(False)
    t = DynamicLossScaler(1.0, 1.0, growth_interval=5, hysteresis=3)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() == {"scale": 1024.0, "growth_tracker": 1, "hysteresis_tracker": 2}
