"""gpu_check's `launch` step: which per-unit timing sums to what a run of units costs on a GPU.

The profiler times each unit synchronised (training/profiler.py): on a GPU that adds the host's kernel launches to
the device's execution, while a run overlaps them. Here every unit of an 8-layer GPT (hidden 1024, seq 1024: bound
by the host on an H100) is timed five ways per phase (forward, backward), beside a stream of whole micro-batches
through the 8-layer stack with no synchronisation inside, to see which per-unit figure the planner should sum:
  sync           synchronise, call, synchronise (the profiler's figure)
  host           the call's wall time alone, the device idle at the start (its launches; the device may lag)
  span           CUDA events around the call, the device idle at the start
  covered_host   the call's wall time with a sleep kernel queued ahead (the device busy meanwhile)
  covered_device CUDA events around the call behind that sleep: the kernels back to back
and, on a GPU, host_floor: the planner's model of our runtime (each unit max(covered_device, its operators x
HOST_OP_S)); host_us_per_op_if_host_bound is the stream's time over the operators of a micro-batch.
Per micro-batch size the step reports each method's micro-batch sum (embedding + layers x (attention + MLP) + head,
forward and backward) over the stream's measured time per micro-batch. CPU: sync and host only.
Two more streams separate what the synchronised sum adds: the same micro-batches with a backward call per unit
(each unit's input a leaf, as the profiler times them; us_per_backward_call is its cost over the one call a stage
makes), and with every unit fully recomputed (reentrant, one nested backward per unit), against the planner's
figure for it, the synchronised units plus their forwards again.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import torch

from megatron_bmw.device import covered_seconds, sleep_cycles_per_s, synchronize, timed

METHODS = ("sync", "host", "span", "covered_host", "covered_device")


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.cycles_per_s = sleep_cycles_per_s() if self.cuda else None

    @staticmethod
    def _events():
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def sync(self) -> None:
        synchronize(self.device)

    def measure(self, method: str, fn, cover_s: float = 5e-3):
        """(seconds or None, fn()) by `method`."""
        if method == "sync":
            return timed(fn, self.device)
        self.sync()
        if method == "host":
            t0 = time.perf_counter()
            out = fn()
            seconds = time.perf_counter() - t0
            self.sync()
            return seconds, out
        if not self.cuda or (method.startswith("covered") and self.cycles_per_s is None):
            return None, fn()
        if method.startswith("covered"):
            device_s, host_s, out = covered_seconds(fn, self.cycles_per_s, cover_s)
            return (host_s if method == "covered_host" else device_s), out
        start, end = self._events()
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out


def launch_check(small: bool) -> dict:
    from megatron_bmw.config import ModelConfig
    from megatron_bmw.models.chunk import build_units
    from megatron_bmw.parallel.grad_sync import GradSync
    from megatron_bmw.parallel.state import ParallelState
    from megatron_bmw.models.chunk import synthetic_batch as _batch
    from megatron_bmw.models.op_count import unit_op_counts

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    layers = 2 if small else 8
    cfg = ModelConfig(num_layers=layers, hidden_size=64 if small else 1024, num_attention_heads=4 if small else 16,
                      vocab_size=512 if small else 50304, seq_length=64 if small else 1024, hidden_dropout=0.0,
                      attention_dropout=0.0, params_dtype="bf16" if cuda else "fp32",
                      attention_backend="flash" if cuda else "unfused")
    state = ParallelState.serial(device)
    units = build_units(cfg, state, 1234)
    params = [p for u in units.values() for p in u.parameters()]
    grad_sync = GradSync(params, state)
    rc_units = build_units(cfg, state, 1234, recompute=("full",) * len(units))  # reentrant, as the runtime's
    rc_sync = GradSync([p for u in rc_units.values() for p in u.parameters()], state)
    timer = _Timer(device)
    warmup, repeats = (1, 3) if small else (3, 7)

    def backward(y, kind: str) -> None:
        torch.autograd.backward(y) if kind == "head" else torch.autograd.backward(y, torch.ones_like(y))

    def hidden(b: int):
        return torch.randn(cfg.seq_length, b, cfg.hidden_size, dtype=cfg.torch_dtype, device=device,
                           requires_grad=True)

    ops = unit_op_counts(cfg)
    per_microbatch_ops = sum(ops["embedding"]) + layers * (sum(ops["attention"]) + sum(ops["mlp"])) + sum(ops["head"])
    results = {}
    for b in ((1, 2) if small else (1, 2, 4)):
        batch = _batch(cfg, b, device)
        phases: dict[str, dict[str, float | None]] = {}
        for kind, name in (("embedding", "embedding"), ("attention", "attn_0"), ("mlp", "mlp_0"), ("head", "head")):
            unit = units[name]
            samples = {(m, ph): [] for m in METHODS for ph in ("f", "b")}
            for it in range(warmup + repeats):
                for method in METHODS:
                    x = None if kind == "embedding" else hidden(b)
                    tf, y = timer.measure(method, lambda: unit(x, batch))
                    tb, _ = timer.measure(method, partial(backward, y, kind))
                    if it >= warmup and tf is not None:
                        samples[(method, "f")].append(tf)
                        samples[(method, "b")].append(tb)
                    del y
            phases[kind] = {f"{m}_{ph}": statistics.median(v) if v else None for (m, ph), v in samples.items()}
        sums = {}
        for method in METHODS:
            parts = [phases[k].get(f"{method}_{ph}") for k in phases for ph in ("f", "b")]
            if all(p is not None for p in parts):
                per = {k: phases[k][f"{method}_f"] + phases[k][f"{method}_b"] for k in phases}
                sums[method] = per["embedding"] + layers * (per["attention"] + per["mlp"]) + per["head"]
        floor = _host_floor(phases, ops, layers)
        if floor is not None:  # the planner's model: each unit max(its kernels back to back, its host time)
            sums["host_floor"] = floor
        stream = _stream_seconds(partial(_microbatch, units, layers, batch, backward), timer, warmup, repeats)
        calls = _stream_seconds(partial(_microbatch_unit_calls, units, layers, batch, backward), timer, warmup,
                                repeats)
        recomputed = _stream_seconds(partial(_microbatch, rc_units, layers, batch, backward), timer, warmup,
                                     repeats)
        forwards = phases["embedding"]["sync_f"] + layers * (phases["attention"]["sync_f"]
                                                            + phases["mlp"]["sync_f"]) + phases["head"]["sync_f"]
        results[f"mbs{b}"] = {"stream_ms": round(stream * 1e3, 3),
                              "host_us_per_op_if_host_bound": round(stream / per_microbatch_ops * 1e6, 1),
                              **{f"{m}_over_stream": round(v / stream, 3) for m, v in sums.items()},
                              "unit_calls_stream_ms": round(calls * 1e3, 3),
                              "us_per_backward_call": round((calls - stream) / (2 * layers + 1) * 1e6, 1),
                              "sync_over_unit_calls_stream": round(sums["sync"] / calls, 3),
                              "full_recompute_stream_ms": round(recomputed * 1e3, 3),
                              "sync_and_forwards_over_full_recompute": round((sums["sync"] + forwards) / recomputed,
                                                                             3),
                              "units_ms": {k: {m: round(v * 1e3, 4) for m, v in ph.items() if v is not None}
                                           for k, ph in phases.items()}}
    grad_sync.remove_hooks()
    rc_sync.remove_hooks()
    return {"status": "ok", "device": device.type, "layers": layers, "hidden": cfg.hidden_size,
            "seq": cfg.seq_length, "results": results,
            "notes": "sum of each per-unit timing over one micro-batch, over a stream of micro-batches through the "
                     "stack unsynchronised (1.0: the planner's sum is right)" + ("" if cuda else "; CPU run")}


def _host_floor(phases: dict, ops: dict, layers: int) -> float | None:
    """One micro-batch as the planner times our runtime's analytic units on a GPU (planner/cost_model.py): each
    unit's phase takes max(its kernels back to back, its operators x HOST_OP_S); None without device timings."""
    from megatron_bmw.planner.cost_model import HOST_OP_S

    per = {}
    for kind, ph in phases.items():
        device = (ph.get("covered_device_f"), ph.get("covered_device_b"))
        if None in device:
            return None
        per[kind] = sum(max(d, n * HOST_OP_S) for d, n in zip(device, ops[kind]))
    return per["embedding"] + layers * (per["attention"] + per["mlp"]) + per["head"]


def _microbatch(units, layers: int, batch, backward) -> None:
    """Forward through embedding, `layers` x (attention, MLP) and head, then one backward, as the engine runs a
    one-stage pipeline."""
    h = units["embedding"](None, batch)
    for i in range(layers):
        h = units[f"mlp_{i}"](units[f"attn_{i}"](h, batch), batch)
    backward(units["head"](h, batch), "head")


def _microbatch_unit_calls(units, layers: int, batch, backward) -> None:
    """The same micro-batch with a backward call per unit, each unit's input a leaf (as the profiler times them),
    unsynchronised: against `_microbatch`, the host's cost of a backward call."""
    outs, leaves = [], []
    h = units["embedding"](None, batch)
    for i in range(layers):
        for name in (f"attn_{i}", f"mlp_{i}"):
            outs.append(h)
            leaf = h.detach().requires_grad_()
            leaves.append(leaf)
            h = units[name](leaf, batch)
    outs.append(h)
    leaf = h.detach().requires_grad_()
    backward(units["head"](leaf, batch), "head")
    for out, leaf in zip(reversed(outs), [leaf, *reversed(leaves)]):
        torch.autograd.backward(out, leaf.grad)


def _stream_seconds(one, timer: _Timer, warmup: int, repeats: int) -> float:
    """Seconds per micro-batch of `one()`, micro-batches back to back, synchronised only around the whole run."""
    for _ in range(warmup):
        one()
    timer.sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        one()
    timer.sync()
    return (time.perf_counter() - t0) / repeats
