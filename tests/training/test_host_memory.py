"""What a CPU profile measures a training process to hold beyond its tensors (training/host_memory.py), and where
it goes: the profile file, the CPU plan's allowance, and the plan check against the process's resident rise."""

import math
from types import SimpleNamespace

import pytest

from megatron_bmw.planner.profile_data import Profile, Profiles
from megatron_bmw.training import host_memory
from megatron_bmw.training.loop import Trainer, build_trainer

GPT = ["--mock-data", "--vocab-size", "64", "--num-layers", "3", "--hidden-size", "16", "--num-attention-heads", "2",
       "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
       "--lr", "1e-3", "--make-vocab-size-divisible-by", "4", "--train-iters", "2"]


def _run():
    return build_trainer(GPT).run


def test_terms_from_the_resident_rises(monkeypatch):
    """The one-layer cut run twice, then the two-layer one, each after the previous one's memory went back:
    fraction from the difference of the last two against the memory model's, runtime from the first less the
    second as counted with it."""
    run, runs, releases = _run(), [], []

    class Spy(Trainer):
        def __init__(self, run, *args, **kwargs):
            super().__init__(run, *args, **kwargs)
            runs.append(self)

    monkeypatch.setattr(host_memory, "_release", lambda: releases.append(len(runs)))
    one, two = (host_memory._counted(host_memory.cut_run(run, n, 2)) for n in (1, 2))
    for rises, per_byte in (([90e6 + 1.2 * one, 1.2 * one, 1.2 * two], 1.2),
                            ([90e6 + one, one, one + 0.5 * (two - one)], 1.0)):  # a fraction below 0 is none
        steps = iter(rises)
        monkeypatch.setattr(host_memory, "ResidentPeak", lambda: SimpleNamespace(growth=lambda: next(steps)))
        runs.clear()
        got, after = host_memory.measure_host_memory(run, 2, Spy, then=lambda t: t.run.model.num_layers)
        assert after == [1, 2]  # `then` on the second one-layer and the two-layer trainers
        assert [(r.run.model.num_layers, r.run.pipeline.micro_batch_size, r.run.pipeline.num_microbatches,
                 len(r.step_times)) for r in runs] == [(1, 2, 2, 3), (1, 2, 2, 3), (2, 2, 2, 3)]
        assert got["fraction"] == pytest.approx(per_byte - 1, abs=1e-9)
        assert got["runtime_bytes"] == pytest.approx(rises[0] - per_byte * one)
    assert releases[:6] == [0, 1, 1, 2, 2, 3]  # before and after each run


def test_measured_for_real_in_this_process():
    got, after = host_memory.measure_host_memory(_run(), 1, Trainer)
    assert after == [None, None]
    assert set(got) == {"runtime_bytes", "fraction"}  # this process trained before: the runtime is mostly paid
    assert all(v >= 0 and math.isfinite(v) for v in got.values())


def test_profile_field_and_the_cpu_allowance():
    from megatron_bmw.planner_args import build_autoconfig_parser, memory_settings, planner_config

    data = {"format": 1, "device": {"name": "cpu-1-thread", "kind": "cpu"}, "dtype": "fp32",
            "model": {"hidden_size": 16, "num_attention_heads": 2, "ffn_hidden_size": 64, "seq_length": 8,
                      "vocab_size": 64, "attention_backend": "auto", "hidden_dropout": 0.0, "attention_dropout": 0.0},
            "units": [], "host_memory": {"runtime_bytes": 9e7, "fraction": 0.25}}
    prof = Profile.from_json(data)
    assert Profile.from_json(prof.to_json()).host_memory == {"runtime_bytes": 9e7, "fraction": 0.25}
    for bad, needle in (({"runtime_bytes": -1, "fraction": 0.1}, "host_memory.runtime_bytes must be a number >= 0"),
                        ({"runtime_bytes": 1.0}, "missing field 'host_memory.fraction'")):
        with pytest.raises(Exception, match=needle):
            Profile.from_json({**data, "host_memory": bad})
    parser = build_autoconfig_parser()

    def settings(*flags):
        args = parser.parse_args(["estimate", "--cluster", "local", *flags])
        return memory_settings(planner_config(args), Profiles([prof]))

    got = settings()
    assert (got.device, got.workspace_bytes, got.fragmentation) == ("cpu", 9e7, 0.25)
    flagged = settings("--memory-workspace-gb", "0", "--memory-fragmentation", "0.1")
    assert (flagged.workspace_bytes, flagged.fragmentation) == (0.0, 0.1)
    assert settings("--memory-device", "cuda").workspace_bytes != 9e7  # a GPU's allowance is derived instead


def test_cpu_plan_check_holds_the_whole_peak():
    """The resident rise holds the runtime and the C allocator's part: it is checked against the peak with its
    allowance (CUDA's peak allocation against the peak without it)."""
    from megatron_bmw.training.plan_check import plan_check_lines

    trainer = build_trainer(GPT)
    trainer.tracked_iterations = 0
    trainer.step_times = [1.0, 1.0]
    trainer.resident = SimpleNamespace(growth=lambda: 150 * 2**20)
    stage = {"stage": 0, "peak_bytes": 150 * 2**20, "allowance_bytes": 100 * 2**20, "static_bytes": 1.0,
             "activation_bytes": 1.0, "capacity_bytes": 2**34}
    plan = SimpleNamespace(prediction={"iteration_time_s": 1.0, "stages": [stage]})
    line = plan_check_lines(trainer, plan)[1]
    assert "memory predicted 150.00 MiB, measured 150.00 MiB (peak resident growth) (+0.0%)" in line, line
