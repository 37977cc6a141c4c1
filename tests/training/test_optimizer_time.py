"""A CPU profile's optimizer step (training/optimizer_time.py): measured through the trainer on a one- and a
two-layer cut of the model, and the step the planner then prices for the profile's device type."""

import math

import pytest

from megatron_bmw.planner.cost_model import optimizer_step_bytes, optimizer_step_seconds
from megatron_bmw.planner.profile_data import Profile
from megatron_bmw.training import optimizer_time
from megatron_bmw.training.loop import build_trainer

GPT = ["--mock-data", "--vocab-size", "64", "--num-layers", "3", "--hidden-size", "16", "--num-attention-heads", "2",
       "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
       "--lr", "1e-3", "--make-vocab-size-divisible-by", "4", "--train-iters", "2"]


def test_rate_and_fixed_part_from_two_cuts(monkeypatch):
    run, seen = build_trainer(GPT).run, []

    def step(cut):
        seen.append((cut.model.num_layers, cut.pipeline.micro_batch_size))
        return {1: (1e6, 0.012), 2: (3e6, 0.020)}[cut.model.num_layers]

    monkeypatch.setattr(optimizer_time, "_step_seconds", step)
    got = optimizer_time.measure_optimizer_step(run, 2)
    assert seen == [(1, 2), (2, 2)]
    b1, b2 = optimizer_step_bytes(1e6, 1, False, 4), optimizer_step_bytes(3e6, 1, False, 4)
    assert got["bytes_per_s"] == pytest.approx((b2 - b1) / 0.008)
    assert got["fixed_s"] == pytest.approx(0.012 - b1 * 0.008 / (b2 - b1))
    monkeypatch.setattr(optimizer_time, "_step_seconds", lambda cut: (1e6 * cut.model.num_layers, 0.01))
    assert optimizer_time.measure_optimizer_step(run, 2) == {}  # no longer for more: noise, nothing to say


def test_measured_for_real():
    got = optimizer_time.measure_optimizer_step(build_trainer(GPT).run, 1)
    assert got == {} or (got["bytes_per_s"] > 0 and got["fixed_s"] >= 0 and math.isfinite(got["bytes_per_s"]))


def test_the_profiles_device_type_steps_at_the_measured_rate():
    data = {"format": 1, "device": {"name": "cpu-1-thread", "kind": "cpu"}, "dtype": "fp32",
            "model": {"hidden_size": 16, "num_attention_heads": 2, "ffn_hidden_size": 64, "seq_length": 8,
                      "vocab_size": 64, "attention_backend": "auto", "hidden_dropout": 0.0, "attention_dropout": 0.0},
            "units": [{"kind": "mlp", "tp": 1, "micro_batch_size": 1, "forward_s": 1e-3, "backward_s": 2e-3}],
            "optimizer": {"bytes_per_s": 4e9, "fixed_s": 2e-3}}
    prof = Profile.from_json(data)
    assert Profile.from_json(prof.to_json()).optimizer == data["optimizer"]
    device = prof.device_type(2**30)
    # 1M parameters, ZeRO-1 over 2: the norm and zeroing of all, Adam of half
    assert optimizer_step_seconds(1e6, 2, True, 4, device, 0.8) == pytest.approx(2e-3 + (1e6 * 12 + 5e5 * 28) / 4e9)
    plain = Profile.from_json({k: v for k, v in data.items() if k != "optimizer"}).device_type(2**30)
    assert optimizer_step_seconds(1e6, 1, False, 4, plain, 0.8) == 0.0  # no bandwidth, no measurement
    for bad, needle in (({"bytes_per_s": 0, "fixed_s": 0}, "optimizer.bytes_per_s must be a number > 0"),
                        ({"bytes_per_s": 1e9}, "missing field 'optimizer.fixed_s'")):
        with pytest.raises(Exception, match=needle):
            Profile.from_json({**data, "optimizer": bad})
