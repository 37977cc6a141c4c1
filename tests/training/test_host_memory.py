"""What a CPU profile measures a training process to hold beyond its tensors (training/host_memory.py), and where
it goes: the profile file, the CPU plan's allowance, and the plan check against the process's resident rise."""

import math
from types import SimpleNamespace

import pytest

from megatron_bmw.planner.profile_data import Profile, Profiles
from megatron_bmw.training import host_memory
from megatron_bmw.training.loop import build_trainer

GPT = ["--mock-data", "--vocab-size", "64", "--num-layers", "3", "--hidden-size", "16", "--num-attention-heads", "2",
       "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
       "--lr", "1e-3", "--make-vocab-size-divisible-by", "4", "--train-iters", "2"]


def _run():
    return build_trainer(GPT).run


def test_terms_from_the_resident_rise(monkeypatch):
    """runtime: the tiny run's rise over its tracked tensors; fraction: the two-layer run's rise over what the
    memory model counts for it, minus one."""
    from megatron_bmw.planner.evaluate import estimate_memory
    from megatron_bmw.planner.memory_model import MemorySettings
    from megatron_bmw.planner.spec import spec_from_run_config

    run, runs, rises = _run(), [], iter([50e6, 3e6])

    class Peak:
        def growth(self):
            return next(rises)

    monkeypatch.setattr(host_memory, "ResidentPeak", Peak)
    from megatron_bmw.training import loop

    class Spy(loop.Trainer):
        def __init__(self, run, *args, **kwargs):
            super().__init__(run, *args, **kwargs)
            runs.append(self)

    monkeypatch.setattr(loop, "Trainer", Spy)
    got = host_memory.measure_host_memory(run, 2)
    tiny, cut = runs
    assert tiny.run.model.num_layers == 1 and tiny.run.model.hidden_size == 16
    assert (cut.run.model.num_layers, cut.run.pipeline.micro_batch_size, cut.run.pipeline.num_microbatches) == (2, 2, 2)
    assert len(tiny.step_times) == len(cut.step_times) == host_memory.STEPS
    counted = estimate_memory(spec_from_run_config(cut.run, 1), settings=MemorySettings(device="cpu"))[0]
    total = sum((counted.params_bytes, counted.grads_bytes, counted.optimizer_bytes, counted.activation_bytes,
                 counted.transient_bytes))
    assert got["runtime_bytes"] == pytest.approx(50e6 - tiny.memory_in_use())
    assert got["fraction"] == pytest.approx(max(0.0, 3e6 / total - 1))


def test_measured_for_real_in_this_process():
    got = host_memory.measure_host_memory(_run(), 1)
    assert set(got) == {"runtime_bytes", "fraction"}  # this process trained before: the runtime is mostly paid
    assert all(v >= 0 and math.isfinite(v) for v in got.values())


def test_profile_field_and_the_cpu_allowance():
    from megatron_bmw.planner_args import build_autoconfig_parser, memory_settings

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
        return memory_settings(args, Profiles([prof]))

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
