"""Context parallelism's p2p ring (parallel/context_parallel.py) against all-gathering K/V, forward and backward on
gloo ranks, and the share of the ring's time its overlap of transfers with computation saves.

    python benchmarks/context_parallel_ring.py [--cp 2 4] [--seqs 1024 4096] [--batch 1] [--heads 4] [--kv-heads 4]
                                               [--head-dim 32] [--repeats 5]

Three ways to the same causal attention of a rank's s/C rows (chunks r and 2C-1-r) over the whole sequence, each
computing the same pairs with the same kernels (parallel/cp_blocks.py: torch's CPU flash-attention kernel per
pair, half a block off the diagonal):
- ring: context_attention's p2p ring, the next K/V block's transfer in flight while this one is attended, and in
  backward the fp32 dK/dV accumulators one step behind;
- ring, waited: the same ring with each transfer waited on before the computation that could hide it;
- all-gather: every rank all-gathers the whole K/V (kept for backward), attends its queries, and in backward sums
  the whole dK/dV over the group (gloo has no reduce-scatter: an all-reduce) and keeps its own rows.
Times are per forward+backward, the slowest rank's, median of --repeats rounds after one warm-up round, the methods
interleaved within a round. One torch thread per rank; on a machine with fewer cores than ranks the ranks share
cores, so the transfers (gloo works on the CPU too) compete with the computation they overlap.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.args import count, parser  # noqa: E402
from benchmarks.common import format_table, median  # noqa: E402
from megatron_bmw.errors import UsageError, exit_on_usage_error  # noqa: E402
from megatron_bmw.parallel import context_parallel as cpa  # noqa: E402
from megatron_bmw.parallel import cp_blocks  # noqa: E402
from megatron_bmw.parallel.mappings import gather_along  # noqa: E402

METHODS = ("ring", "ring, waited", "all-gather")


class _GatherKV(torch.autograd.Function):
    """The baseline: all-gather K/V (in cp-rank order: block j holds rank j's rows), attend the local queries pair by
    pair (the same pairs and kernels as the ring), and in backward all-reduce the whole dK/dV and keep this rank's
    rows."""

    @staticmethod
    def forward(ctx, q, k, v, group, c, scale):
        r, rows = dist.get_rank(group), q.size(2)
        kf, vf = gather_along(k, 2, group), gather_along(v, 2, group)
        out, lse = cpa._accumulators(q)
        for n, j in enumerate([r] + [j for j in range(c) if j != r]):
            r_sel, c_sel, causal = cpa._pair(r, j, rows)
            keys = range(j * rows, (j + 1) * rows)[c_sel]
            cols = slice(keys.start, keys.stop)
            cp_blocks.block_forward(q[:, :, r_sel], kf[:, :, cols], vf[:, :, cols], causal, scale, out[:, :, r_sel],
                                    lse[:, :, r_sel], first=n == 0)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kf, vf, out, lse)
        ctx.group, ctx.c, ctx.scale = group, c, scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, kf, vf, out, lse = ctx.saved_tensors
        r, rows = dist.get_rank(ctx.group), q.size(2)
        dq = torch.zeros(q.shape, dtype=torch.float32)
        dkv = torch.zeros((2, *kf.shape), dtype=torch.float32)
        for j in range(ctx.c):
            r_sel, c_sel, causal = cpa._pair(r, j, rows)
            keys = range(j * rows, (j + 1) * rows)[c_sel]
            cols = slice(keys.start, keys.stop)
            cp_blocks.block_backward(do[:, :, r_sel], q[:, :, r_sel], kf[:, :, cols], vf[:, :, cols],
                                     out[:, :, r_sel], lse[:, :, r_sel].contiguous(), causal, ctx.scale,
                                     dq[:, :, r_sel], dkv[0][:, :, cols], dkv[1][:, :, cols])
        dist.all_reduce(dkv, group=ctx.group)
        mine = dkv.narrow(3, r * rows, rows)
        return dq.to(q.dtype), mine[0].to(kf.dtype), mine[1].to(vf.dtype), None, None, None


def _attend(method: str, q, k, v, positions, c: int, scale: float):
    ranks, group = tuple(range(c)), dist.group.WORLD
    if method == "ring":
        return cpa.ring_attention(q, k, v, positions, group, ranks, scale, overlap=True)
    if method == "ring, waited":
        return cpa.ring_attention(q, k, v, positions, group, ranks, scale, overlap=False)
    return _GatherKV.apply(q, k, v, group, c, scale)


def _body(rank: int, c: int, seqs, batch: int, heads: int, kv_heads: int, d: int, repeats: int):
    """{(seq, method): [seconds per round]} (the slowest rank's) and the largest output difference from the ring."""
    times, diff = {}, {}
    for s in seqs:
        gen = torch.Generator().manual_seed(s)
        pos = cpa.chunk_positions(s, c, rank)
        full = [torch.randn(batch, h, s, d, generator=gen) for h in (heads, kv_heads, kv_heads, heads)]
        q, k, v, do = (cpa.split_sequence(x, 2, c, rank) for x in full)
        outs = {}
        for rnd in range(repeats + 1):
            for method in METHODS:
                leaves = [x.clone().requires_grad_() for x in (q, k, v)]
                dist.barrier()
                t0 = time.perf_counter()
                out = _attend(method, *leaves, pos, c, 1.0 / math.sqrt(d))
                out.backward(do)
                took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if rnd:
                    times.setdefault((s, method), []).append(took.item())
                outs[method] = [out.detach(), *(x.grad for x in leaves)]
        diff[s] = max((a - b).abs().max().item() for m in METHODS[1:] for a, b in zip(outs[m], outs["ring"]))
    return times, diff


def _worker(rank: int, world: int, init_file: str, fn, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10))
    try:
        results.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - report to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _spawn(fn, world: int, *args) -> list:
    """fn(rank, world, *args) on `world` spawned gloo ranks rendezvousing on a file store (no port to race for)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="mbmw-cp-bench-") as tmp:
        procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "store"), fn, args, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        out = {}
        for _ in range(world):
            rank, ok, value = results.get()
            if not ok:
                for p in procs:
                    p.terminate()
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
        for p in procs:
            p.join()
    return [out[r] for r in range(world)]


def _check(args) -> None:
    if args.heads % args.kv_heads:
        raise UsageError(f"--heads {args.heads}: not a multiple of --kv-heads {args.kv_heads}")
    for c in args.cp:
        if c < 2:
            raise UsageError(f"--cp {c}: a ring needs at least 2 ranks")
        for s in args.seqs:
            if s % (2 * c):
                raise UsageError(f"--seqs {s}: not divisible by 2 x --cp {c} (each rank holds two chunks)")


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--cp", type=count(1), nargs="+", default=[2, 4], help="context-parallel sizes (ranks)")
    ap.add_argument("--seqs", type=count(1), nargs="+", default=[1024, 4096], help="sequence lengths")
    ap.add_argument("--batch", type=count(1), default=1)
    ap.add_argument("--heads", type=count(1), default=4)
    ap.add_argument("--kv-heads", type=count(1), default=4)
    ap.add_argument("--head-dim", type=count(1), default=32)
    ap.add_argument("--repeats", type=count(1), default=5)
    args = ap.parse_args(argv)
    _check(args)
    print(f"batch {args.batch}, {args.heads} heads ({args.kv_heads} kv), head dim {args.head_dim}, fp32, gloo, "
          f"1 thread per rank, {os.cpu_count()} CPUs; ms per forward+backward, median of {args.repeats}")
    rows = []
    for c in args.cp:
        t0 = time.time()
        results = _spawn(_body, c, args.seqs, args.batch, args.heads, args.kv_heads, args.head_dim, args.repeats)
        times = results[0][0]  # the slowest rank's, the same on every rank
        diff = {s: max(d[s] for _, d in results) for s in args.seqs}
        for s in args.seqs:
            ms = {m: median(times[(s, m)]) * 1e3 for m in METHODS}
            rows.append([c, s, ms["ring"], ms["ring, waited"], ms["all-gather"], ms["ring"] / ms["all-gather"],
                         f"{100 * (1 - ms['ring'] / ms['ring, waited']):.1f}%", f"{diff[s]:.1e}"])
        print(f"  cp {c}: {time.time() - t0:.0f} s", flush=True)
    print(format_table(["cp", "seq", "ring ms", "ring, waited ms", "all-gather ms", "ring / all-gather",
                        "overlap saves", "max |diff|"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
