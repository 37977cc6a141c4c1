"""Benchmark: BPipe's activation balancing on gloo ranks (issue 6).

For pp = 4 and 8 and m = 8 and 16, a GPT with 2 layers per stage runs 1F1B with and without BPipe on the same
ranks (one torch thread each). Printed per configuration: each stage's peak saved-activation bytes and peak
micro-batches as the activation store measured them, without and with BPipe (acceptors include what they hold
for their evictor), and the iteration-time overhead of BPipe as the median over rounds of (BPipe time / plain
time), the two runs alternating order each round. An iteration's time is the maximum over ranks from a common
barrier. On a shared 2-core machine the ranks compete for cores, so transfers cannot truly run beside compute:
read the overhead as an upper bound.

    python benchmarks/bpipe_memory.py [--iters 6 --hidden 128 --seq 128 --micro-batch-size 4]
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.args import UsageError, count, exit_on_usage_error, parser  # noqa: E402
from benchmarks.common import format_table, median, run_gloo  # noqa: E402
from megatron_bmw.config import ModelConfig, ParallelConfig, PipelineConfig  # noqa: E402
from megatron_bmw.parallel.state import ParallelState  # noqa: E402
from megatron_bmw.pipeline.bpipe import mu_opt  # noqa: E402
from megatron_bmw.pipeline.engine import PipelineEngine  # noqa: E402
from megatron_bmw.pipeline.stages import hidden_shape, pipeline_setup  # noqa: E402


def _batches(cfg: ModelConfig, m: int, mbs: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(m):
        tokens = torch.randint(0, cfg.vocab_size, (mbs, cfg.seq_length + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                    "loss_mask": torch.ones(mbs, cfg.seq_length)})
    return out


def check_hidden(hidden: int) -> None:
    """The model below has 4 attention heads."""
    if hidden % 4:
        raise UsageError(f"--hidden {hidden}: must be a multiple of the model's 4 attention heads")


def _body(rank: int, world: int, m: int, iters: int, hidden: int, seq: int, mbs: int) -> dict:
    cfg = ModelConfig(num_layers=2 * world, hidden_size=hidden, num_attention_heads=4, vocab_size=1024,
                      seq_length=seq, hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused")
    st = ParallelState.build(ParallelConfig(pipeline_model_parallel_size=world, rank_order="bpipe"))
    batches = _batches(cfg, m, mbs)
    engines = {}
    for bpipe in (False, True):
        chunks, sched, _ = pipeline_setup(cfg, st, 1234, PipelineConfig(mbs, m, bpipe=bpipe))
        engines[bpipe] = PipelineEngine(chunks, st, sched, hidden_shape(cfg, st, mbs), cfg.torch_dtype,
                                        track_activations=True)
    for engine in engines.values():  # warm-up (and the class-size announcement)
        engine.run(lambda i: batches[i])
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(iters):
        for bpipe in ((False, True) if i % 2 == 0 else (True, False)):
            dist.barrier()
            t0 = time.perf_counter()
            engines[bpipe].run(lambda j: batches[j])
            times[bpipe].append(time.perf_counter() - t0)
    return {"stage": st.pp_rank, "plain": engines[False].activation_stats(), "bpipe": engines[True].activation_stats(),
            "times": times}


@exit_on_usage_error
def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--iters", type=count(1), default=6)
    ap.add_argument("--hidden", type=count(1), default=128)
    ap.add_argument("--seq", type=count(1), default=128)
    ap.add_argument("--micro-batch-size", type=count(1), default=4)
    ap.add_argument("--pp", type=count(1), nargs="+", default=[4, 8])
    ap.add_argument("--microbatches", type=count(1), nargs="+", default=[8, 16])
    args = ap.parse_args()
    check_hidden(args.hidden)
    summary = []
    for p in args.pp:
        for m in args.microbatches:
            out = sorted(run_gloo(_body, p, m, args.iters, args.hidden, args.seq, args.micro_batch_size),
                         key=lambda o: o["stage"])
            rows = []
            for o in out:
                a, b = o["plain"], o["bpipe"]
                rows.append([o["stage"], f"{a['peak_microbatches']:g}", a["peak_bytes"] / 2**20,
                             f"{b['peak_microbatches']:g}", b["peak_bytes"] / 2**20, b["peak_accepted_bytes"] / 2**20])
            print(f"\npp={p} m={m} (mu_opt={mu_opt(p)}), peak saved activations per stage (MiB)")
            print(format_table(["stage", "plain mb", "plain MiB", "BPipe mb", "BPipe MiB", "accepted MiB"], rows))
            plain = [max(o["times"][False][i] for o in out) for i in range(args.iters)]
            bpipe = [max(o["times"][True][i] for o in out) for i in range(args.iters)]
            ratio = median([x / y for x, y in zip(bpipe, plain)])
            top_plain = max(o["plain"]["peak_bytes"] for o in out) / 2**20
            top_bpipe = max(o["bpipe"]["peak_bytes"] for o in out) / 2**20
            summary.append([p, m, top_plain, top_bpipe, median(plain), median(bpipe), ratio])
    print("\nmax over stages of the peak, and iteration time (median; overhead = median of per-round ratios)")
    print(format_table(["pp", "m", "plain max MiB", "BPipe max MiB", "plain s/iter", "BPipe s/iter",
                        "BPipe/plain"], summary))


if __name__ == "__main__":
    sys.exit(main())
