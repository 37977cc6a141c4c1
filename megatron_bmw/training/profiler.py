"""Profiler: measure unit times, saved bytes and link speeds on this machine (planner/analytic.py writes
profiles for devices that are not here).

Measured mode runs each unit kind (embedding, attention, MLP, head; a mixture of experts' MoE unit, at ep 1) of a
one-layer model exactly as the
engine does (the unit called on the hidden state, one autograd.backward per micro-batch, gradients
accumulated into fp32 main_grad, fused into the weight-gradient GEMM unless --no-gradient-accumulation-fusion),
over micro-batch sizes and tensor-parallel degrees; a tensor-parallel degree t runs on t local processes (gloo
on CPU, NCCL on GPUs). It also times the engine's
own per-action overhead (a one-stage pipeline against the sum of its units) and fits latency + bytes /
bandwidth to point-to-point and all-reduce timings between local ranks. On a GPU it records the allocator's and
the device's memory around the timed steps (cuda_memory.py): the measured terms of the CUDA allowance.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import ModelConfig, ParallelConfig, PipelineConfig, RunConfig
from ..models.chunk import synthetic_batch as _batch
from ..device import choose_backend, ping_pong, set_device, synchronize, timed
from ..planner.analytic import ProfileSettings
from ..planner.profile_data import Profile, UnitTiming, load_now, load_record, model_signature
from ..units import model_unit_kinds
from . import cuda_memory
from .host_memory import measure_host_memory
from .optimizer_time import fit_optimizer_step, step_seconds
from .saved_bytes import measure_saved

if TYPE_CHECKING:
    from ..parallel.state import ParallelState

_UNIT_OF_KIND = {"embedding": "embedding", "attention": "attn_0", "mlp": "mlp_0", "head": "head", "moe": "moe_0"}


def _stat(values: list[float], statistic: str) -> float:
    return min(values) if statistic == "min" else statistics.median(values)


def _one_layer_units(model: ModelConfig, state, seed: int, fusion: bool):
    """A one-layer model's units by name (`_UNIT_OF_KIND`); for a mixture of experts its layer's MLP slot holds the
    experts (`moe_0`), and `mlp_0` is a dense MLP where some layer of `model` is dense (a second one-layer model's)."""
    from ..config import MoEConfig
    from ..models.chunk import build_units
    from ..parallel.grad_sync import GradSync

    kinds = model_unit_kinds(model)
    one = {**model.__dict__, "num_layers": 1}
    if model.moe is not None:  # one expert layer, whatever --moe-layer-freq says of the whole model
        one["moe"] = MoEConfig(**{**model.moe.to_json(), "layer_freq": "1"})
    units = dict(build_units(ModelConfig(**one), state, seed))
    if model.moe is not None:
        units["moe_0"] = units.pop("mlp_0")
        if "mlp" in kinds:
            units["mlp_0"] = build_units(ModelConfig(**{**one, "moe": None}), state, seed)["mlp_0"]
    return units, GradSync([p for u in units.values() for p in u.parameters()], state, fusion=fusion)


def _layer_mlp(units: dict):
    """The unit in the one layer's MLP slot: the experts where the model has them."""
    return units.get("moe_0", units.get("mlp_0"))


RECOMPUTED = [("attention", "full"), ("attention", "selective"), ("mlp", "full")]  # (kind, recomputation) timed


def _recompute(unit, how: str | None) -> None:
    """Set `unit` to run recomputed as `how` says (None: as built, keeping its activations)."""
    unit.recompute = "full" if how == "full" else None
    if hasattr(unit, "selective"):
        unit.selective = how == "selective"


def time_units(model: ModelConfig, state, micro_batch_sizes, warmup: int = 2, repeats: int = 5,
               seed: int = 1234, barrier=None, statistic: str = "median", rounds: int = 1,
               fusion: bool = True, recomputed=None) -> list[UnitTiming]:
    """Forward/backward seconds and saved bytes of every unit kind on this process (tp from `state`), and of the
    (kind, recomputation) pairs `recomputed` (default RECOMPUTED) with the unit recomputed so.

    The sweep over micro-batch sizes and kinds runs `rounds` times with `repeats` samples each, so the samples
    of one entry spread over the whole profiling time; `barrier` (all profiling processes) starts each entry's
    samples together (not each sample: lock-stepped identical kernels contend more than a pipeline's do)."""
    units, sync = _one_layer_units(model, state, seed, fusion)
    params = [p for u in units.values() for p in u.parameters()]
    shared = [units["embedding"].word_embeddings.weight]
    tp = state.tp_size
    seq = model.seq_length // tp if state.sequence_parallel else model.seq_length
    samples: dict[tuple[int, str, str | None], tuple[list[float], list[float]]] = {}
    saved: dict[tuple[int, str, str | None], int] = {}
    batches = {b: _batch(model, b, state.device) for b in micro_batch_sizes}
    kinds = model_unit_kinds(model)
    pairs = [(k, None) for k in kinds] + [(k, rc) for k, rc in (RECOMPUTED if recomputed is None else recomputed)
                                          if k in kinds]
    entries = [(b, kind, rc) for b in micro_batch_sizes for kind, rc in pairs]
    for r in range(rounds):
        for b, kind, rc in entries:
            unit = units[_UNIT_OF_KIND[kind]]
            key = (b, kind, rc)
            fwd, bwd = samples.setdefault(key, ([], []))
            if barrier is not None:
                barrier()
            _recompute(unit, rc)
            for it in range(warmup + repeats):
                hidden = None
                if kind != "embedding":
                    hidden = torch.randn(seq, b, model.hidden_size, dtype=model.torch_dtype,
                                         device=state.device, requires_grad=True)
                synchronize(state.device)
                t0 = time.perf_counter()
                if key not in saved:  # the hooks cost time: measure bytes in a warm-up iteration only
                    rec, y = measure_saved(lambda: unit(hidden, batches[b]), params + shared)
                    saved[key] = rec.total
                else:
                    y = unit(hidden, batches[b])
                synchronize(state.device)
                t1 = time.perf_counter()
                if kind == "head":
                    torch.autograd.backward(y)
                else:
                    torch.autograd.backward(y, torch.ones_like(y))
                synchronize(state.device)
                t2 = time.perf_counter()
                if it >= warmup:
                    fwd.append(t1 - t0)
                    bwd.append(t2 - t1)
                del y
            _recompute(unit, None)
    sync.remove_hooks()
    return [UnitTiming(kind, tp, b, _stat(samples[(b, kind, rc)][0], statistic),
                       _stat(samples[(b, kind, rc)][1], statistic), saved[(b, kind, rc)], recompute=rc)
            for b, kind, rc in entries]


STEADY_DEPTH, STEADY_MICROBATCHES = 4, 3
STREAM_DEPTH, STREAM_MICROBATCHES = 8, 4  # the deepest stack timed, and micro-batches per sample


def _stack_microbatch(units: dict, batch: dict, depth: int) -> None:
    """One micro-batch as a one-stage run has it: embedding, `depth` x the one layer's attention and MLP, head,
    one backward."""
    h = units["embedding"](None, batch)
    for _ in range(depth):
        h = _layer_mlp(units)(units["attn_0"](h, batch), batch)
    torch.autograd.backward(units["head"](h, batch))


def steady_microbatches(model: ModelConfig, state, micro_batch_size: int, seed: int = 1234, fusion: bool = True,
                        cuda=None) -> dict | None:
    """Micro-batches run as training runs them (`_stack_microbatch` at STEADY_DEPTH) from an emptied cache; with
    `cuda` (torch.cuda on a GPU) the allocator's readings after them, whose maxima cover these micro-batches only:
    the fragmentation a training run sees."""
    units, sync = _one_layer_units(model, state, seed, fusion)
    batch = _batch(model, micro_batch_size, state.device)
    if cuda is not None:
        cuda.synchronize(state.device)
        cuda.empty_cache()
        cuda.reset_peak_memory_stats(state.device)
    for _ in range(STEADY_MICROBATCHES):
        _stack_microbatch(units, batch, STEADY_DEPTH)
    synchronize(state.device)
    got = cuda_memory.reading(cuda, state.device) if cuda is not None else None
    sync.remove_hooks()
    return got


def _stream_seconds(units: dict, batch: dict, depth: int, device, warmup: int, repeats: int,
                    statistic: str) -> float:
    """A micro-batch's seconds through `_stack_microbatch`, micro-batches back to back and synchronised only
    around each sample of STREAM_MICROBATCHES."""
    for _ in range(max(1, warmup)):
        _stack_microbatch(units, batch, depth)
    samples = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(STREAM_MICROBATCHES):
            _stack_microbatch(units, batch, depth)
        synchronize(device)
        samples.append((time.perf_counter() - t0) / STREAM_MICROBATCHES)
    return _stat(samples, statistic)


def time_stream(model: ModelConfig, state, timings: list[UnitTiming], seed: int = 1234, fusion: bool = True,
                warmup: int = 2, repeats: int = 5, statistic: str = "median") -> dict:
    """Per micro-batch size of `timings`: a micro-batch's seconds through a stack of min(layers, STREAM_DEPTH)
    (`_stream_seconds`), beside the sum of the synchronised unit times for the same stack:
    {str(mbs): {depth, stream_s, units_s}}."""
    depth = min(model.num_layers, STREAM_DEPTH)
    units, sync = _one_layer_units(model, state, seed, fusion)
    out = {}
    for b in sorted({t.micro_batch_size for t in timings}):
        per = {t.kind: t.forward_s + t.backward_s for t in timings if t.micro_batch_size == b and t.recompute is None}
        got = _stream_seconds(units, _batch(model, b, state.device), depth, state.device, warmup, repeats, statistic)
        out[str(b)] = {"depth": depth, "stream_s": got,
                       "units_s": per["embedding"] + depth * (per["attention"] + per.get("moe", per.get("mlp")))
                       + per["head"]}
    sync.remove_hooks()
    return out


def time_engine_overhead(state, num_microbatches: int = 8, repeats: int = 5, seed: int = 1234, barrier=None,
                         statistic: str = "median") -> dict:
    """Per compute action, the engine's own time beside its units (slots, batches, loss, tracing, the
    gradient hooks' bookkeeping), measured on a tiny one-layer model whose units cost next to nothing: the
    engine's run time minus the same units timed alone (on a GPU: streamed through as `time_stream` does, the
    time a GPU profile's units are taken at). Unit times of the real model carry no such cost."""
    from ..parallel.grad_sync import GradSync
    from ..pipeline.engine import PipelineEngine
    from ..pipeline.stages import hidden_shape, pipeline_setup

    tiny = ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8,
                       attention_backend="unfused")
    b = 1
    cuda = state.device.type == "cuda"
    if not cuda:
        units = time_units(tiny, state, (b,), warmup=1, repeats=repeats, seed=seed, barrier=barrier,
                           statistic=statistic, recomputed=())
        per_mb = sum(u.forward_s + u.backward_s for u in units)
    chunks, sched, _ = pipeline_setup(tiny, state, seed, PipelineConfig(micro_batch_size=b,
                                                                         num_microbatches=num_microbatches))
    params = [p for c in chunks for p in c.parameters()]
    sync = GradSync(params, state)
    engine = PipelineEngine(chunks, state, sched, hidden_shape(tiny, state, b), tiny.torch_dtype)
    batches = [_batch(tiny, b, state.device, seed=i) for i in range(num_microbatches)]
    times = []
    for it in range(repeats + 1):
        synchronize(state.device)
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        engine.run(lambda i: batches[i], grad_sync=sync)
        synchronize(state.device)
        if it:
            times.append(time.perf_counter() - t0)
        sync.zero()
    sync.remove_hooks()
    if cuda:
        one, hooks = _one_layer_units(tiny, state, seed, True)
        per_mb = _stream_seconds(one, batches[0], 1, state.device, 2, repeats, statistic)
        hooks.remove_hooks()
    extra = max(0.0, (_stat(times, statistic) / num_microbatches - per_mb) / 2)
    return {"forward_s": extra, "backward_s": extra}


def _fit_link(points: list[tuple[int, float]], scale: float = 1.0) -> dict:
    """Least-squares t = latency + scale * bytes / bandwidth."""
    n = len(points)
    xs = [scale * x for x, _ in points]
    ys = [y for _, y in points]
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    big_x, big_y = max(zip(xs, ys))
    if slope <= 0 or slope * big_x > big_y:  # noise: fall back to the largest message alone
        slope = max(big_y - min(ys), 1e-12) / big_x
    latency = max(0.0, my - slope * mx)
    return {"bandwidth_Bps": 1.0 / slope, "latency_s": latency, "points": [[x, y] for x, y in points]}


def time_links(sizes, repeats: int = 5, device: torch.device | None = None, statistic: str = "median") -> dict:
    """Between global ranks 0 and 1: one-way p2p time by ping-pong, and all-reduce over all ranks."""
    import torch.distributed as dist

    device = device or torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    p2p, ar = [], []
    for size in sizes:
        buf = torch.zeros(size // 4, dtype=torch.float32, device=device)
        samples = []
        for it in range(repeats + 1):
            dist.barrier()
            if rank < 2:
                elapsed, _ = timed(lambda: ping_pong(rank == 0, buf, 1 - rank, None, None), device)
                if it:
                    samples.append(elapsed / 2)
        p2p.append((size, _stat(samples, statistic) if samples else 0.0))  # ranks above 1 only wait
        samples = []
        for it in range(repeats + 1):
            dist.barrier()
            elapsed, _ = timed(lambda: dist.all_reduce(buf), device)
            if it:
                samples.append(elapsed)
        ar.append((size, _stat(samples, statistic)))
    links = {"p2p": _fit_link(p2p)}
    # ring all-reduce moves 2(n-1)/n of the bytes over the slowest link
    links["allreduce"] = _fit_link(ar, 2 * (world - 1) / world)
    links["allreduce"]["ranks"] = world
    return links


# ---- multi-process driver -----------------------------------------------------------------------------------
def _worker(rank: int, world: int, init_file: str, model: ModelConfig, settings: ProfileSettings, tp: int, sp: bool,
            queue) -> None:
    import datetime

    import torch.distributed as dist

    from ..parallel.state import ParallelState

    torch.set_num_threads(settings.threads)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    backend = choose_backend(None, world)
    set_device(rank, backend)
    try:
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=5))
        result: dict = {}
        if tp:
            state = ParallelState.build(ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp))
            result["tp_group"] = state.dp_rank
            units = time_units(model, state, settings.micro_batch_sizes, settings.warmup, settings.repeats,
                               barrier=dist.barrier, statistic=settings.statistic, rounds=settings.rounds,
                               fusion=settings.gradient_accumulation_fusion)
            result["units"] = units
            if backend == "nccl":  # after the tp collectives: the communicators' buffers are allocated
                result["cuda_memory"] = cuda_memory.reading(torch.cuda, torch.device("cuda", rank))
            state.destroy()
        else:
            device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
            result["links"] = time_links(settings.comm_sizes, settings.repeats, device, settings.statistic)
        queue.put((rank, result))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        queue.put((rank, {"error": f"{type(exc).__name__}: {exc}"}))


def _spawn(world: int, model: ModelConfig, settings: ProfileSettings, tp: int, sp: bool) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    rendezvous = tempfile.TemporaryDirectory(prefix="mbmw-profile-")  # a file store: no port to race for
    init_file = os.path.join(rendezvous.name, "store")
    procs = [ctx.Process(target=_worker, args=(r, world, init_file, model, settings, tp, sp, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    try:
        while len(results) < world:
            rank, value = queue.get(timeout=900)
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        rendezvous.cleanup()
    errors = [f"rank {r}: {v['error']}" for r, v in sorted(results.items()) if "error" in v]
    if errors:
        raise RuntimeError("profiling failed: " + "; ".join(errors))
    return [results[r] for r in range(world)]


def _merge_ranks(results: list[dict]) -> list[UnitTiming]:
    """Tensor-parallel ranks wait for each other: the slowest rank of the group (groups, were there several,
    averaged)."""
    groups: dict[int, list[list[UnitTiming]]] = {}
    for r in results:
        groups.setdefault(r["tp_group"], []).append(r["units"])
    slowest = []
    for members in groups.values():
        slowest.append([replace(e[0], forward_s=max(x.forward_s for x in e), backward_s=max(x.backward_s for x in e))
                        for e in zip(*members)])
    return [replace(e[0], forward_s=statistics.mean(x.forward_s for x in e),
                    backward_s=statistics.mean(x.backward_s for x in e)) for e in zip(*slowest)]


def run_profile(model: ModelConfig, settings: ProfileSettings = ProfileSettings(),
                sequence_parallel: bool = False, run: RunConfig | None = None,
                trainer_class: Callable | None = None) -> Profile:
    """Measure everything on this machine. tp=1 runs in this process; larger degrees in spawned processes.
    With `run` (the run's whole configuration) on the CPU, first what a training process holds beyond the
    counted tensors (host_memory.py) and its optimizer step (optimizer_time.py), on trainers of `trainer_class`
    (training/loop.Trainer, passed in: the loop imports this module)."""
    if run is not None and trainer_class is None:
        raise ValueError("run_profile: a profile with `run` needs `trainer_class` (training/loop.Trainer)")

    load_start = load_now()  # the machine's load the profile is taken under (profile_data.load_per_core)
    previous = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    steps = len(settings.tp_sizes) + bool(settings.links)
    start = time.monotonic()

    def progress(k: int, what: str) -> None:  # on stderr: a profile takes minutes on a big model
        bar = "#" * k + "." * (steps - k)
        print(f"[profile] [{bar}] {k}/{steps} {what} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)

    try:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        host, step = {}, {}
        if run is not None and not cuda:  # before anything else runs: the runtime's first use is measured
            progress(0, "measuring what a training process holds beyond its tensors, and its optimizer step")
            host, timed_steps = measure_host_memory(replace(run, model=model), max(settings.micro_batch_sizes),
                                                    trainer_class, then=step_seconds)
            step = fit_optimizer_step(timed_steps, model.dtype_bytes)
        units: list[UnitTiming] = []
        overhead: dict = {}
        measured: dict = {}
        stream: dict = {}
        tp_readings: list[dict] = []
        for k, tp in enumerate(settings.tp_sizes):
            model.check_tensor_parallel(tp)
            progress(k, f"timing the units at tp {tp}, micro-batch sizes "
                        f"{','.join(map(str, settings.micro_batch_sizes))}")
            if tp == 1:
                timed, measured, stream, overhead = _time_in_this_process(model, settings, device)
                units += timed
            else:
                ranks = _spawn(tp, model, settings, tp, sequence_parallel)
                tp_readings += [r["cuda_memory"] for r in ranks if "cuda_memory" in r]
                units += _merge_ranks(ranks)
        if settings.links:
            progress(len(settings.tp_sizes), "timing point-to-point and all-reduce links on 2 processes")
        links = _spawn(2, model, settings, 0, False)[0]["links"] if settings.links else {}
        progress(steps, "done")
        load = load_record(load_start, time.monotonic() - start, settings.threads)
    finally:
        torch.set_num_threads(previous)
    name = torch.cuda.get_device_name(0) if cuda else f"cpu-{settings.threads}-thread"
    info = {"name": name, "kind": "cuda" if cuda else "cpu", "threads": settings.threads,
            "cores": os.cpu_count() or 1,  # the tp > 1 entries ran tp processes on these (cost_model.py)
            "statistic": settings.statistic,
            "memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else _host_memory()}
    if cuda:  # the kernel model rescales this profile's times to other shapes by it (kernel_time.py)
        info["sm_count"] = torch.cuda.get_device_properties(0).multi_processor_count
    if sequence_parallel:
        info["sequence_parallel"] = True
    terms = cuda_memory.measured_terms(measured["before"], measured["after"], tp_readings,
                                       measured["steady"]) if measured else {}
    return Profile(device=info, dtype=model.params_dtype, model=model_signature(model), units=units,
                   links=links, overhead=overhead, mode="measured", cuda_memory=terms, stream=stream,
                   host_memory=host, optimizer=step, machine_load=load or {})


def _time_in_this_process(model: ModelConfig, settings: ProfileSettings, device) -> tuple[list, dict, dict, dict]:
    """tp 1's measurements: the unit times; on a GPU the allocator's readings and the streamed units; the engine's
    overhead where asked."""
    from ..parallel.state import ParallelState

    cuda = device.type == "cuda"
    state = ParallelState.serial(device)
    if cuda:
        torch.cuda.init()  # the allocator's statistics refuse a device CUDA has not set up yet
        torch.cuda.reset_peak_memory_stats(device)
        before = cuda_memory.reading(torch.cuda, device)
    fusion = settings.gradient_accumulation_fusion
    timed = time_units(model, state, settings.micro_batch_sizes, settings.warmup, settings.repeats,
                       statistic=settings.statistic, rounds=settings.rounds, fusion=fusion)
    measured, stream, overhead = {}, {}, {}
    if cuda:
        measured = {"before": before, "after": cuda_memory.reading(torch.cuda, device),
                    "steady": steady_microbatches(model, state, max(settings.micro_batch_sizes), fusion=fusion,
                                                  cuda=torch.cuda)}
        stream = time_stream(model, state, timed, fusion=fusion, warmup=settings.warmup, repeats=settings.repeats,
                             statistic=settings.statistic)
    if settings.overhead:
        overhead = time_engine_overhead(state, repeats=max(5, settings.repeats * settings.rounds),
                                        statistic=settings.statistic)
    return timed, measured, stream, overhead


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


# ---- per-stage times of the model being trained (for --microbatch-slicing auto) --------------------------------
def measure_stage_times(chunks: list[nn.Module], state: ParallelState, get_batch: Callable[[int], dict],
                        hidden_shape: tuple[int, int, int], dtype: torch.dtype,
                        repeats: int = 2) -> tuple[list[float], list[float], float]:
    """(forward, backward seconds per pipeline stage for one micro-batch, p2p seconds of one activation).

    Every rank times its chunks on micro-batch 0 (after one untimed run), stages 0 and 1 time a ping-pong of
    one activation, and the numbers are combined with a MAX all-reduce over all ranks, so every rank gets the
    same answer. Gradients go through torch.autograd.grad: parameters' .grad and gradient hooks are untouched,
    and the random-number state is restored afterwards. All ranks must call this together.
    """
    import torch.distributed as dist

    from ..parallel.random import get_rng_state, set_rng_state

    p, rank, device = state.pp_size, state.pp_rank, state.device
    rng = get_rng_state(state.rng)
    batch = get_batch(0)
    fwd = bwd = float("inf")
    for attempt in range(repeats + 1):
        f_total = b_total = 0.0
        for c, chunk in enumerate(chunks):
            vstage = c * p + rank
            x = None if vstage == 0 else torch.zeros(hidden_shape, dtype=dtype, device=device, requires_grad=True)
            forward, out = timed(lambda: chunk(x, batch), device)
            inputs = [q for q in chunk.parameters() if q.requires_grad] + ([x] if x is not None else [])
            backward, _ = timed(lambda: torch.autograd.grad(out, inputs, grad_outputs=torch.ones_like(out),
                                                            allow_unused=True), device)
            f_total += forward
            b_total += backward
        if attempt:
            fwd, bwd = min(fwd, f_total), min(bwd, b_total)
    set_rng_state(rng, state.rng)
    comm = _ping(state, hidden_shape, dtype, repeats) if p > 1 else 0.0
    table = torch.zeros(p + 1, 2, dtype=torch.float64, device=device)
    table[rank, 0], table[rank, 1] = fwd, bwd
    table[p, 0] = comm
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
    table = table.cpu()
    return table[:p, 0].tolist(), table[:p, 1].tolist(), float(table[p, 0])


def _ping(state: ParallelState, hidden_shape: tuple[int, int, int], dtype: torch.dtype, repeats: int) -> float:
    """Half the round trip of one activation between stages 0 and 1 (0 on the other stages)."""
    if state.pp_rank > 1:
        return 0.0
    me, other = state.pp_ranks[state.pp_rank], state.pp_ranks[1 - state.pp_rank]
    out, back = state.p2p_group(me, other), state.p2p_group(other, me)
    x = torch.zeros(hidden_shape, dtype=dtype, device=state.device)
    best = float("inf")
    for attempt in range(repeats + 1):
        elapsed, _ = timed(lambda: ping_pong(state.pp_rank == 0, x, other, out, back), state.device)
        if attempt:
            best = min(best, elapsed / 2)
    return best
