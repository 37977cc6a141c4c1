"""A CPU profile's optimizer step (training/optimizer_time.py): timed on the trainers of a one- and a two-layer cut
of the model, and the step the planner then prices for the profile's device type."""

import math

import pytest

from megatron_bmw.planner.cost_model import optimizer_step_bytes, optimizer_step_seconds
from megatron_bmw.planner.profile_data import Profile
from megatron_bmw.training import optimizer_time
from megatron_bmw.training.loop import Trainer, build_trainer

GPT = ["--mock-data", "--vocab-size", "64", "--num-layers", "3", "--hidden-size", "16", "--num-attention-heads", "2",
       "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
       "--lr", "1e-3", "--make-vocab-size-divisible-by", "4", "--train-iters", "2"]


def test_rate_and_fixed_part_from_two_cuts():
    got = optimizer_time.fit_optimizer_step([(1e6, 0.012), (3e6, 0.020)], 4)
    b1, b2 = optimizer_step_bytes(1e6, 1, False, 4), optimizer_step_bytes(3e6, 1, False, 4)
    assert got["bytes_per_s"] == pytest.approx((b2 - b1) / 0.008)
    assert got["fixed_s"] == pytest.approx(0.012 - b1 * 0.008 / (b2 - b1))
    assert optimizer_time.fit_optimizer_step([(1e6, 0.01), (2e6, 0.01)], 4) == {}  # no longer for more: noise


def test_measured_for_real_on_the_host_memory_trainers():
    """The step timed on the cut trainers host_memory.py runs: the one-layer one first, each with its parameters."""
    from megatron_bmw.training.host_memory import measure_host_memory

    run = build_trainer(GPT).run
    _, points = measure_host_memory(run, 1, Trainer, then=optimizer_time.step_seconds)
    assert [p for p, _ in points][0] < points[1][0] and all(t > 0 for _, t in points)
    got = optimizer_time.fit_optimizer_step(points, run.model.dtype_bytes)
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
