"""Benchmark: AutoPipe's micro-batch slicing on 4 gloo ranks (issue 6).

A GPT with 2 layers per stage runs 1F1B at pp=4 (one torch thread per rank) with K=0 and with K=auto (AutoPipe's
slicer fed by measure_stage_times). Printed: the K chosen, the time from a common barrier until the last stage
starts its first forward, and the iteration time (medians over rounds; the two settings alternate order each
round), plus what the replay predicts from the measured stage times.

    python benchmarks/slicing.py [--iters 8 --hidden 256 --seq 128 --micro-batch-size 8 --microbatches 8]
"""

from __future__ import annotations

import os
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.args import count, exit_on_usage_error, parser  # noqa: E402
from benchmarks.bpipe_memory import _batches, check_hidden  # noqa: E402
from benchmarks.common import format_table, median, run_gloo  # noqa: E402
from megatron_bmw.config import ModelConfig, ParallelConfig, PipelineConfig  # noqa: E402
from megatron_bmw.parallel.state import ParallelState  # noqa: E402
from megatron_bmw.pipeline.engine import PipelineEngine  # noqa: E402
from megatron_bmw.pipeline.build import build_schedule  # noqa: E402
from megatron_bmw.pipeline.replay import replay  # noqa: E402
from megatron_bmw.pipeline.schedule import Kind  # noqa: E402
from megatron_bmw.pipeline.slicing import check_slicing, num_sliced  # noqa: E402
from megatron_bmw.pipeline.stages import hidden_shape, pipeline_setup  # noqa: E402
from megatron_bmw.training.profiler import measure_stage_times  # noqa: E402


def _body(rank: int, world: int, m: int, iters: int, hidden: int, seq: int, mbs: int) -> dict:
    cfg = ModelConfig(num_layers=2 * world, hidden_size=hidden, num_attention_heads=4, vocab_size=1024,
                      seq_length=seq, hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused")
    st = ParallelState.build(ParallelConfig(pipeline_model_parallel_size=world))
    batches = _batches(cfg, m, mbs)
    shape = hidden_shape(cfg, st, mbs)
    measured = {}

    def times(chunks):
        measured["t"] = measure_stage_times(chunks, st, lambda i: batches[i], shape, cfg.torch_dtype)
        return measured["t"]

    engines, starts = {}, {}
    for name, slicing in (("K=0", 0), ("K=auto", "auto")):
        chunks, sched, _ = pipeline_setup(cfg, st, 1234, PipelineConfig(mbs, m, slicing=slicing), stage_times=times)
        engines[name] = (PipelineEngine(chunks, st, sched, shape, cfg.torch_dtype), num_sliced(sched))
        stamps = starts[name] = []
        if st.is_last_stage:
            chunks[0].register_forward_pre_hook(lambda module, args, s=stamps: s.append(time.perf_counter()))
    for engine, _ in engines.values():
        engine.run(lambda i: batches[i])
    out = {name: {"iter": [], "first": []} for name in engines}
    for i in range(iters):
        for name in (list(engines) if i % 2 == 0 else list(reversed(engines))):
            starts[name].clear()
            dist.barrier()
            t0 = time.perf_counter()
            engines[name][0].run(lambda j: batches[j])
            out[name]["iter"].append(time.perf_counter() - t0)
            out[name]["first"].append(starts[name][0] - t0 if starts[name] else 0.0)
    return {"stage": st.pp_rank, "k": {n: k for n, (_, k) in engines.items()}, "runs": out, "measured": measured["t"]}


def _predicted(f: list[float], b: list[float], c: float, m: int, k: int) -> tuple[float, float]:
    def compute(rank, a):
        t = f[rank] if a.kind is Kind.FORWARD else b[rank]
        return t / 2 if a.half is not None else t

    sched = build_schedule(PipelineConfig(num_microbatches=m, slicing=k), len(f))
    result = replay(sched, compute, lambda s, d, a: c / 2 if a.half is not None else c)
    first = min(t for a, t, _ in result.timeline[-1] if a.kind is Kind.FORWARD)
    return first, result.makespan


@exit_on_usage_error
def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--iters", type=count(1), default=8)
    ap.add_argument("--hidden", type=count(1), default=256)
    ap.add_argument("--seq", type=count(1), default=128)
    ap.add_argument("--micro-batch-size", type=count(1), default=8)
    ap.add_argument("--microbatches", type=count(1), default=8)
    ap.add_argument("--pp", type=count(1), default=4)
    args = ap.parse_args()
    check_slicing("auto", args.micro_batch_size, args.microbatches)  # as the ranks would, before they start
    check_hidden(args.hidden)
    out = run_gloo(_body, args.pp, args.microbatches, args.iters, args.hidden, args.seq, args.micro_batch_size)
    f, b, c = out[0]["measured"]
    print(f"pp={args.pp} m={args.microbatches}: measured forward per stage {[round(x * 1e3, 1) for x in f]} ms, "
          f"backward {[round(x * 1e3, 1) for x in b]} ms, p2p {c * 1e3:.2f} ms")
    rows = []
    for name, k in out[0]["k"].items():
        iters = [max(o["runs"][name]["iter"][i] for o in out) for i in range(args.iters)]
        first = out[-1]["runs"][name]["first"]
        pred_first, pred_iter = _predicted(f, b, c, args.microbatches, k)
        rows.append([name, k, median(first) * 1e3, median(iters) * 1e3, pred_first * 1e3, pred_iter * 1e3])
    print(format_table(["setting", "K", "last stage first F (ms)", "iteration (ms)", "replay first F (ms)",
                        "replay iteration (ms)"], rows))


if __name__ == "__main__":
    sys.exit(main())
