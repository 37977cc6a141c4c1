"""An MoE layer against a dense MLP of equal active parameters: forward+backward of one MLP slot (models/moe.py's
unit, post-attention norm to residual add) where each token's top-k experts together are the dense MLP's size
(dense FFN = k x the expert FFN), on 1 rank (ep 1) and with ep 2 on 2 gloo ranks (each rank its own tokens, half
the experts; the dense MLP beside it as data parallelism runs it, with nothing to exchange), both dispatchers.

    python benchmarks/moe_vs_dense.py [--hidden 256] [--experts 8] [--topk 2] [--expert-ffn 512] [--seq 256]
        [--micro-batch-size 2] [--rounds 5] [--repeats 3] [--ranks 1 2] [--json out.json]

One torch thread per rank; the configurations are interleaved within each round (the machine is shared), each
round's sample is the median of --repeats forward+backward passes after a warm-up one, on the slowest rank; the
table gives the median over rounds. The gradients go into fp32 main_grad as in training (no reduction: that is
the same for both and outside the layer). What the MoE adds is routing (router GEMM, softmax, top-k), the
dispatcher's permutation and exchanges, and the experts' GEMMs at a few hundred rows each instead of one GEMM.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.args import UsageError, count, exit_on_usage_error, output_files, parser  # noqa: E402
from benchmarks.common import format_table, run_gloo  # noqa: E402

DISPATCHERS = ("allgather", "alltoall")


def _configs(opts) -> dict:
    """name -> ModelConfig of one layer: the dense MLP and the MoE per dispatcher."""
    from megatron_bmw.config import ModelConfig, MoEConfig

    base = dict(num_layers=1, hidden_size=opts.hidden, num_attention_heads=opts.heads, seq_length=opts.seq,
                max_position_embeddings=opts.seq, vocab_size=1024, hidden_dropout=0.0, attention_dropout=0.0)
    out = {"dense": ModelConfig(**base, ffn_hidden_size=opts.topk * opts.expert_ffn)}
    for disp in DISPATCHERS:
        out[disp] = ModelConfig(**base, ffn_hidden_size=opts.expert_ffn, moe=MoEConfig(
            num_experts=opts.experts, router_topk=opts.topk, ffn_hidden_size=opts.expert_ffn,
            token_dispatcher_type=disp))
    return out


def _pass(unit, hidden, batch) -> None:
    import torch

    y = unit(hidden, batch)
    torch.autograd.backward(y, torch.ones_like(y))


def _rank(rank: int, world: int, opts) -> dict:
    """Every configuration's per-round seconds (this rank's; the caller takes the slowest rank's)."""
    import torch
    import torch.distributed as dist

    from megatron_bmw.config import ParallelConfig
    from megatron_bmw.models.chunk import build_units, synthetic_batch
    from megatron_bmw.models.moe_experts import _grouped_available
    from megatron_bmw.parallel.grad_sync import GradSync
    from megatron_bmw.parallel.state import ParallelState

    state = ParallelState.build(ParallelConfig(expert_model_parallel_size=world))
    units, syncs, counts = {}, {}, {}
    for name, cfg in _configs(opts).items():
        unit = build_units(cfg, state, 1234)["mlp_0"]
        units[name] = unit
        syncs[name] = GradSync(list(unit.parameters()), state)
        counts[name] = sum(p.numel() for p in unit.parameters())
    batch = synthetic_batch(_configs(opts)["dense"], opts.micro_batch_size, state.device)
    gen = torch.Generator().manual_seed(rank)
    hidden = torch.randn(opts.seq, opts.micro_batch_size, opts.hidden, generator=gen).requires_grad_()
    times: dict[str, list[float]] = {name: [] for name in units}
    for r in range(opts.rounds + 1):  # round 0 warms up
        order = list(units) if r % 2 == 0 else list(reversed(units))
        for name in order:
            dist.barrier()
            _pass(units[name], hidden, batch)
            samples = []
            for _ in range(opts.repeats):
                dist.barrier()
                t0 = time.perf_counter()
                _pass(units[name], hidden, batch)
                samples.append(time.perf_counter() - t0)
            t = torch.tensor([statistics.median(samples)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's
            if r:
                times[name].append(t.item())
            syncs[name].zero()
            hidden.grad = None
    out = {"times": times, "params": counts, "grouped_gemm": _grouped_available(torch.device("cpu"), torch.float32)}
    state.destroy()
    return out


def _active(opts) -> tuple[int, int]:
    """Parameters a token passes through in the dense MLP and in the MoE (its k experts and the router)."""
    h, f, k = opts.hidden, opts.expert_ffn, opts.topk
    dense = 2 * h * k * f + k * f + h
    return dense, k * (2 * h * f + f + h) + opts.experts * h


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--hidden", type=count(1), default=256)
    ap.add_argument("--heads", type=count(1), default=4)
    ap.add_argument("--experts", type=count(1), default=8)
    ap.add_argument("--topk", type=count(1), default=2)
    ap.add_argument("--expert-ffn", type=count(1), default=512, help="each expert's FFN size")
    ap.add_argument("--seq", type=count(1), default=256)
    ap.add_argument("--micro-batch-size", type=count(1), default=2)
    ap.add_argument("--rounds", type=count(1), default=5)
    ap.add_argument("--repeats", type=count(1), default=3)
    ap.add_argument("--ranks", type=count(1), nargs="+", default=[1, 2],
                    help="rank counts: each runs the experts over ep = ranks")
    ap.add_argument("--json", default=None)
    opts = ap.parse_args(argv)
    if opts.hidden % opts.heads:
        raise UsageError(f"--hidden {opts.hidden}: not divisible by --heads {opts.heads}")
    if opts.topk > opts.experts:
        raise UsageError(f"--topk {opts.topk}: more than the {opts.experts} experts")
    bad = [n for n in opts.ranks if opts.experts % n]
    if bad:
        raise UsageError(f"--ranks {bad[0]}: does not divide the {opts.experts} experts (ep = ranks)")
    output_files(json=opts.json)
    t0 = time.time()
    dense_active, moe_active = _active(opts)
    print(f"one MLP slot: hidden {opts.hidden}, {opts.experts} experts of FFN {opts.expert_ffn}, top-{opts.topk} "
          f"(dense FFN {opts.topk * opts.expert_ffn}), {opts.seq} tokens x micro-batch {opts.micro_batch_size} per "
          f"rank; active parameters per token: dense {dense_active}, MoE {moe_active}", flush=True)
    rows, record = [], {}
    for world in opts.ranks:
        got = run_gloo(_rank, world, opts)[0]
        med = {name: statistics.median(ts) for name, ts in got["times"].items()}
        record[world] = {**got, "median_s": med}
        for disp in DISPATCHERS:
            spread = (max(got["times"][disp]) - min(got["times"][disp])) / med[disp]
            rows.append([world, world, disp, med[disp] * 1e3, med["dense"] * 1e3, med[disp] / med["dense"],
                         f"{100 * spread:.0f}%", got["params"][disp], got["params"]["dense"]])
        print(f"  {world} rank(s) done ({time.time() - t0:.0f} s); torch._grouped_mm for the experts: "
              f"{'yes' if got['grouped_gemm'] else 'no (a loop of GEMMs)'}", flush=True)
    print(format_table(["ranks", "ep", "dispatcher", "MoE ms", "dense ms", "MoE / dense", "MoE spread",
                        "MoE params/rank", "dense params/rank"], rows))
    print(f"ms: forward+backward of the slot, slowest rank, median of {opts.rounds} interleaved rounds; spread: "
          f"(max - min) / median over rounds; total {time.time() - t0:.0f} s")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"args": vars(opts), "results": record}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
