"""Profiles without measuring: unit times from FLOPs for a device that is not here, and the settings of a
measured profile (training/profiler.py measures). No torch."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import UsageError
from .cluster import DeviceType
from .flops import unit_forward_flops
from .kernel_time import device_kernels, unit_kernel_times
from ..units import model_unit_kinds
from .profile_data import Profile, UnitTiming, model_signature
from .unit_activations import unit_activation_bytes


@dataclass(frozen=True)
class ProfileSettings:
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4)
    tp_sizes: tuple[int, ...] = (1,)
    warmup: int = 2
    repeats: int = 5
    threads: int = 1
    links: bool = True  # measure p2p and all-reduce between two local ranks
    overhead: bool = True  # measure the engine's per-action overhead
    rounds: int = 1  # sweeps over all entries; more spread the samples over time
    statistic: str = "median"  # or "min": robust to other jobs on a shared machine
    comm_sizes: tuple[int, ...] = (1 << 12, 1 << 16, 1 << 18, 1 << 20, 1 << 22)
    gradient_accumulation_fusion: bool = True  # the backward accumulates as the run will (parallel/wgrad_accum.py)
    cp_sizes: tuple[int, ...] = ()  # context-parallel sizes whose core (the runtime's tiles) is timed at tp 1

    def __post_init__(self) -> None:
        if not self.micro_batch_sizes or min(self.micro_batch_sizes) < 1:
            raise UsageError("--profile-micro-batch-sizes needs positive integers, e.g. 1,2,4")
        if not self.tp_sizes or min(self.tp_sizes) < 1:
            raise UsageError("--profile-tp needs positive integers, e.g. 1,2")
        if self.repeats < 1 or self.warmup < 0:
            raise UsageError(f"--profile-repeats must be >= 1 (got {self.repeats})")
        if self.statistic not in ("median", "min"):
            raise UsageError(f"--profile-statistic must be median or min, not {self.statistic!r}")



def analytic_profile(model: ModelConfig, device: DeviceType, settings: ProfileSettings = ProfileSettings(),
                     achievable_fraction: float = 0.5) -> Profile:
    """Unit times for a device that is not here: by GEMM shape where the device type gives its SM count
    (kernel_time.py), else FLOPs / (peak x achievable fraction) with backward = 2 x forward.
    Tensor-parallel collectives are left to the cost model (so only tp=1 entries are written)."""
    if not 0 < achievable_fraction <= 1:
        raise UsageError(f"--achievable-fraction must be in (0, 1], got {achievable_fraction}")
    dtype = model.params_dtype
    rate = device.peak(dtype) * achievable_fraction
    kernels = device_kernels(device, dtype, achievable_fraction)
    units = []
    for b in settings.micro_batch_sizes:
        for kind in model_unit_kinds(model):
            if kernels is not None:  # by GEMM shape (kernel_time.py)
                fwd, bwd = unit_kernel_times(kind, model, b, 1, kernels)
            else:
                fwd = unit_forward_flops(kind, model, b) / rate
                bwd = 2 * fwd
            units.append(UnitTiming(kind, 1, b, fwd, bwd, unit_activation_bytes(kind, model, b)))
    info = {"name": device.name, "kind": "analytic", "achievable_fraction": achievable_fraction,
            "memory_bytes": device.memory_bytes}
    return Profile(device=info, dtype=dtype, model=model_signature(model), units=units, mode="analytic")
