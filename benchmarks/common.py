"""Small helpers shared by the benchmarks: spawning gloo ranks, medians, plain-text tables."""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.args import UsageError, count
from megatron_bmw.device import free_port


def _gloo_worker(rank: int, world_size: int, port: int, threads: int, fn, args, results) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=10))
    try:
        results.put((rank, True, fn(rank, world_size, *args)))
    except UsageError as exc:  # bad input a rank found: the parent raises it (one line, no traceback here)
        results.put((rank, None, str(exc)))
    except BaseException:  # noqa: BLE001 - report to the parent
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world_size: int, *args, threads: int = 1) -> list:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned gloo processes with `threads` torch threads
    each; return the per-rank results (they must be picklable). `fn` must be a module-level function. A UsageError
    raised on a rank is raised here."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world_size, port, threads, fn, args, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors, usage = [], None
    for _ in range(world_size):
        rank, ok, value = results.get()
        if ok:
            out[rank] = value
            continue
        if ok is None:
            usage = value
        else:
            errors.append((rank, value))
        break
    for p in procs:
        if errors or usage is not None:
            p.terminate()
        p.join()
    if errors:
        rank, tb = errors[0]
        raise RuntimeError(f"rank {rank} failed:\n{tb}")
    if usage is not None:
        raise UsageError(usage)
    return [out[r] for r in range(world_size)]


def cpu_probe(repeats: int = 3) -> float:
    """A fixed matrix product timed on every rank at once: how much CPU the ranks get now (other jobs share the
    machine). Every rank returns the slowest rank's time."""
    a, w = torch.ones(256, 512), torch.ones(512, 512)
    samples = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(2):
            a @ w
        samples.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def torch_device(text: str) -> torch.device:
    """--device's value as a device here; a bad name or CUDA without a GPU is a UsageError naming the flag."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"--device {text}: not a device (cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device here")
    return device


def median(xs) -> float:
    return statistics.median(xs)


def format_table(headers: list[str], rows: list[list]) -> str:
    """A Markdown table; floats are written with 3 significant decimals."""
    def cell(v) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in text])


def run_command(cmd: list[str], what: str, root: str) -> str:
    """Run a tool of this repository (one thread, the repository on PYTHONPATH); its stdout, or exit with its tail."""
    t0 = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    if proc.returncode != 0:
        sys.exit(f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  {what}: {time.time() - t0:.0f} s", flush=True)
    return proc.stdout


def add_pipeline_model_args(ap) -> None:
    """The GPT and micro-batching flags the pipeline benchmarks share (check them with check_pipeline_model)."""
    ap.add_argument("--layers", type=count(1), default=8)
    ap.add_argument("--hidden", type=count(1), default=256)
    ap.add_argument("--heads", type=count(1), default=8)
    ap.add_argument("--seq", type=count(1), default=128)
    ap.add_argument("--micro-batch-size", type=count(1), default=4)
    ap.add_argument("--microbatches", type=count(1), default=8)
    ap.add_argument("--vocab", type=count(1), default=1024)
    ap.add_argument("--attention", default="auto", choices=["auto", "flash", "unfused"])


def check_pipeline_model(args, stages: int = 1, why: str = "") -> None:
    """What the ranks' ModelConfig and partition would refuse, said before any rank starts in the benchmark's own
    flags: `stages` pipeline stages (`why`: where the count comes from) each take whole layers."""
    if args.hidden % args.heads:
        raise UsageError(f"--hidden {args.hidden}: not divisible by --heads {args.heads}")
    if args.layers < stages:
        raise UsageError(f"--layers {args.layers}: fewer than the {stages} pipeline stages{why}; each stage takes "
                         "whole layers")
