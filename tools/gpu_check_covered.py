"""gpu_check's `covered` step: device.covered_seconds, the kernel model's timing on a GPU (benchmarks/kernel_model.py
times every kernel behind a sleep kernel since the third H100 session; no GPU has run it there yet).

covered_seconds queues a sleep kernel of `cover_s` before the call, so the GPU is busy while the host dispatches
and CUDA events around the call time its kernels back to back, without the host's gaps. Checked here:
  sleep          a known sleep kernel timed covered: its length back (the clock torch.cuda._sleep counts by)
  small_kernels  a run of tiny kernels: covered (device), CUDA events without the cover (the host's dispatch rate
                 shows through) and the host's own time, per kernel
  kernel_model   kernel_model.layout_kernels of the 1.3B at tp 1, micro-batch 1 (where uncovered events read the
                 layer 1.36x the model on an H100, against 0.93x at micro-batch 4), each kernel timed covered and
                 with plain events beside its modelled time: the layer's per-sample sums over the model both ways,
                 and the longest host dispatch against the cover (a dispatch longer than the cover lets the GPU idle,
                 and the covered figure then holds the host's gap again)
On the CPU (the dry run) the kernel model's kernels run tiny and timed synchronised (device.timed): the code runs,
the covered figures need CUDA.
"""

from __future__ import annotations

import statistics

import torch

from megatron_bmw.device import covered_seconds, sleep_cycles_per_s

COVER_S = 3e-3  # covered_seconds' default cover
SMALL_KERNELS = 200


def _events_seconds(fn) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _median(fn, repeats: int = 7, warmup: int = 2):
    """Element-wise medians of fn()'s tuples over `repeats` calls after `warmup`."""
    got = [fn() for _ in range(warmup + repeats)][warmup:]
    return tuple(statistics.median(x) for x in zip(*got))


def sleep_numbers(cycles_per_s: float) -> dict:
    want = 2e-3
    device_s, host_s = _median(lambda: covered_seconds(lambda: torch.cuda._sleep(int(want * cycles_per_s)),
                                                       cycles_per_s)[:2])
    return {"sleep_clock_ghz": round(cycles_per_s / 1e9, 3), "sleep_2ms_covered_ms": round(device_s * 1e3, 4),
            "sleep_covered_over_asked": round(device_s / want, 3)}


def small_kernel_numbers(cycles_per_s: float) -> dict:
    x = torch.zeros(4096, device="cuda")

    def run():
        for _ in range(SMALL_KERNELS):
            x.add_(1.0)

    covered, host = _median(lambda: covered_seconds(run, cycles_per_s)[:2])
    (plain,) = _median(lambda: (_events_seconds(run),))
    per = 1e6 / SMALL_KERNELS
    return {"small_kernels": SMALL_KERNELS, "small_covered_us": round(covered * per, 2),
            "small_events_us": round(plain * per, 2), "small_host_us": round(host * per, 2),
            "small_events_over_covered": round(plain / covered, 2)}


def _kernel_times(kernel, device: torch.device, repeats: int, cycles_per_s: float | None) -> dict:
    """Milliseconds of one kernel_model Kernel: on CUDA its covered device and host times (medians) and
    `uncovered_ms`, plain CUDA events as kernel_model timed before the cover; on the CPU `uncovered_ms` only,
    synchronised."""
    from benchmarks.kernel_model import time_kernel

    if device.type != "cuda":
        return {"covered_ms": None, "host_ms": None, "uncovered_ms": 1e3 * time_kernel(kernel, device, repeats)}

    def covered():
        if kernel.setup is not None:
            kernel.setup()
        return covered_seconds(kernel.run, cycles_per_s, COVER_S)[:2]

    device_s, host_s = _median(covered, repeats)
    return {"covered_ms": 1e3 * device_s, "host_ms": 1e3 * host_s,
            "uncovered_ms": 1e3 * time_kernel(kernel, device, repeats, None)}


def kernel_model_numbers(small: bool, device: torch.device, cycles_per_s: float | None) -> tuple[dict, list]:
    from benchmarks.kernel_model import device_type_for, layout_kernels, model_config
    from megatron_bmw.planner.cost_model import CostSettings
    from megatron_bmw.planner.kernel_time import device_kernels

    dtype = "bf16" if device.type == "cuda" else "fp32"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "H100"
    memory = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 80e9
    dev = device_type_for(name, memory, None, None)
    settings = CostSettings()
    kd = device_kernels(dev, dtype, settings.fraction(dev))
    cfg, _ = model_config("1.3b", small, dtype)
    kernels = layout_kernels(cfg, 1, 1, kd, dev.memory_bandwidth * settings.bandwidth_fraction, cfg.torch_dtype,
                             device)
    rows = []
    for k in kernels:
        got = _kernel_times(k, device, 3 if small else 10, cycles_per_s)
        rows.append({"kernel": k.name, "unit": k.unit, "category": k.category, "modelled_ms": 1e3 * k.modelled_s,
                     **got})
    layer = [r for r in rows if r["unit"] in ("attention", "mlp") and r["category"] != "memory-bound"]
    modelled = sum(r["modelled_ms"] for r in layer)
    out = {"device_type": dev.name, "layer_uncovered_over_modelled": round(sum(r["uncovered_ms"] for r in layer) / modelled, 3)}
    if device.type == "cuda":
        out["layer_covered_over_modelled"] = round(sum(r["covered_ms"] for r in layer) / modelled, 3)
        out["max_host_over_cover"] = round(max(r["host_ms"] for r in rows) / (1e3 * COVER_S), 3)
    return out, rows


def covered_check(small: bool) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    cycles = sleep_cycles_per_s() if cuda else None
    out: dict = {"status": "ok", "device": device.type}
    problems = []
    if cuda and cycles is None:
        problems.append("no torch.cuda._sleep: nothing covers the host's dispatch (kernel_model falls back to "
                        "plain events)")
    if cycles is not None:
        out.update(sleep_numbers(cycles))
        out.update(small_kernel_numbers(cycles))
        if not 0.9 < out["sleep_covered_over_asked"] < 1.1:
            problems.append(f"a 2 ms sleep timed covered reads {out['sleep_2ms_covered_ms']} ms")
        if not out["small_covered_us"] < out["small_events_us"]:
            problems.append("tiny kernels covered are not faster than with plain events: the cover hid nothing")
    numbers, rows = kernel_model_numbers(small, device, cycles)
    out.update(numbers)
    out["rows"] = rows
    if out.get("max_host_over_cover", 0) >= 1:
        problems.append(f"a kernel's dispatch outlasted the {COVER_S * 1e3:g} ms cover "
                        f"({out['max_host_over_cover']}x): its covered time holds the host's gap")
    if problems:
        out["status"] = "failed"
    notes = ["; ".join(problems)] if problems else []
    if not cuda:
        notes.append("CPU: covered timings need CUDA; the kernel model's tiny kernels timed synchronised")
    out["notes"] = "; ".join(notes)
    return out
