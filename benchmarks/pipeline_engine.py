"""Benchmark: our PipelineEngine against torch.distributed.pipelining.Schedule1F1B (issue 3).

A GPT (default 8 layers, hidden 256) split over 2 gloo ranks (one torch thread each), 1F1B, 8 micro-batches.
Both systems run the *same* model chunk objects (same Parameters) on the same micro-batches:

  - ours:  PipelineEngine.run over the 1f1b schedule, gradients accumulated in p.grad (no GradSync, like torch);
  - torch: PipelineStage wrapping the same chunk (benchmarks/pipelining_adapters.py) + Schedule1F1B. Stage 0
           takes the token tensor; the last stage takes (hidden, labels=, loss_mask=) and returns the chunk's own
           scalar loss (the very code our engine runs), so loss_fn is the identity and scale_grads=True divides
           the accumulated gradients by m, which equals our engine's loss/m before each backward.

Once, before timing, both systems' per-micro-batch losses and every parameter gradient are compared.
Timing rounds alternate the order (ours, torch) / (torch, ours) and each round also probes one forward and one
backward of one micro-batch per stage (both ranks at once, as in the 1F1B steady state). An iteration's time is
the maximum over the ranks of (end - start) measured from a common barrier. The ideal is
(m + p - 1) * max over stages of (median f + median b).

After timing, --breakdown N instrumented iterations per system split each rank's time into compute (forward and
backward spans), waiting on p2p, posting p2p and the rest; --trace PATH writes them as a Chrome trace (one process
per system, two threads per rank: compute, and p2p post/wait). Medians and ratios are noisy on a shared 2-core
machine: compare the per-round ratio quartiles, not one run's median.

    python benchmarks/pipeline_engine.py [--iters 20 --warmup 3 --layers 8 --hidden 256 --seq 128
                                         --micro-batch-size 4 --microbatches 8 --vocab 1024]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.args import UsageError, count, exit_on_usage_error, output_files, parser  # noqa: E402
from benchmarks.common import (add_pipeline_model_args, check_pipeline_model, format_table, median,  # noqa: E402
                               run_gloo)
from benchmarks.pipelining_adapters import (identity_loss, make_microbatches, torch_stage,  # noqa: E402
                                            torch_step, whole_batch, zero_grads as _zero)
from megatron_bmw.config import ModelConfig, ParallelConfig, PipelineConfig  # noqa: E402
from megatron_bmw.parallel.state import ParallelState  # noqa: E402
from megatron_bmw.pipeline.engine import PipelineEngine  # noqa: E402
from megatron_bmw.pipeline.stages import hidden_shape, pipeline_setup  # noqa: E402

P = 2  # pipeline ranks
SEED = 1234


class _Recorder:
    """Timed spans (name, category, start, end) for the breakdown of one iteration."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] = []

    def wrap(self, fn, name, cat):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spans.append((name(*a, **kw) if callable(name) else name, cat, t0, time.perf_counter()))
        return timed


def _breakdown(iters: int, state, engine, run_ours, run_torch, stage, params) -> list[dict]:
    """Instrumented extra iterations of each system: per rank, compute (forward/backward) vs waiting on p2p.

    Ours: the engine's Tracer (its F/B spans include the wait for the consumed receive, recorded separately and
    subtracted here) and a timed wrapper on PipelineEngine._post. Torch: forward_one_chunk / backward_one_chunk and
    the schedule module's _batch_p2p / _wait_batch_p2p wrapped for the duration."""
    from torch.distributed.pipelining import schedules as tsched_mod

    from megatron_bmw.pipeline.trace import Tracer

    out = []
    if iters <= 0:
        return out
    rec = _Recorder()
    orig = (stage.forward_one_chunk, stage.backward_one_chunk, tsched_mod._wait_batch_p2p, tsched_mod._batch_p2p)
    stage.forward_one_chunk = rec.wrap(orig[0], lambda i, *a, **k: f"F{i}", "forward")
    stage.backward_one_chunk = rec.wrap(orig[1], lambda i, *a, **k: f"B{i}", "backward")
    tsched_mod._wait_batch_p2p = rec.wrap(orig[2], lambda work: f"wait x{len(work)}", "wait")
    tsched_mod._batch_p2p = rec.wrap(orig[3], lambda ops, *a, **k: f"post x{len(ops)}", "post")
    wrap_post = callable(getattr(engine, "_post", None))  # an engine internal: skip if it is ever renamed
    if wrap_post:
        engine._post = rec.wrap(engine._post, lambda ops, *a: f"post x{len(ops)}", "post")  # instance attribute
    try:
        for it in range(iters):
            for name in ("ours", "torch") if it % 2 == 0 else ("torch", "ours"):
                _zero(params)
                tracer = engine.tracer = Tracer(state.rank, state.pp_rank) if name == "ours" else None
                rec.spans.clear()
                dist.barrier()
                wall0, t0 = time.time(), time.perf_counter()  # the Tracer stamps with time.time()
                (run_ours if name == "ours" else run_torch)()
                total = time.perf_counter() - t0
                spans = [(n, c, a - t0, b - t0) for n, c, a, b in rec.spans]
                if name == "ours":
                    spans += [(e["name"], e["cat"], e["ts"] / 1e6 - wall0, (e["ts"] + e["dur"]) / 1e6 - wall0)
                              for e in tracer.events]
                waits, posts = (sum(b - a for _, c, a, b in spans if c == cat) for cat in ("wait", "post"))
                fb = sum(b - a for _, c, a, b in spans if c in ("forward", "backward"))
                compute = fb - waits if name == "ours" else fb  # our F/B spans contain their receive waits
                out.append({"system": name, "iter": it, "total": total, "compute": compute, "wait": waits,
                            "post": posts, "other": total - compute - waits - posts, "spans": spans})
    finally:
        stage.forward_one_chunk, stage.backward_one_chunk, tsched_mod._wait_batch_p2p, tsched_mod._batch_p2p = orig
        if wrap_post:
            del engine._post
        engine.tracer = None
        _zero(params)
    return out


def _write_trace(path: str, res: list[dict]) -> None:
    """Chrome trace of the last instrumented iteration of each system (process = system, thread = rank)."""
    import json

    events = []
    for pid, name in enumerate(("ours", "torch")):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}})
        for r in res:
            last = [b for b in r["breakdown"] if b["system"] == name][-1]
            for label, cat, a, b in last["spans"]:
                tid = r["rank"] * 2 + (1 if cat in ("wait", "post") else 0)
                events.append({"name": label, "cat": cat, "ph": "X", "pid": pid, "tid": tid,
                               "ts": a * 1e6, "dur": (b - a) * 1e6})
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      vocab_size=args.vocab, seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0,
                      attention_backend=args.attention)
    m, mbs = args.microbatches, args.micro_batch_size
    state = ParallelState.build(ParallelConfig(pipeline_model_parallel_size=P))
    chunks, sched, parts = pipeline_setup(cfg, state, SEED, PipelineConfig(mbs, m))
    chunk = chunks[0]
    params = [p for p in chunk.parameters() if p.requires_grad]
    micro = make_microbatches(cfg, mbs, m, SEED + 1)
    shape = hidden_shape(cfg, state, mbs)
    first, last = state.is_first_stage, state.is_last_stage

    # -- ours --
    engine = PipelineEngine(chunks, state, sched, shape, cfg.torch_dtype)

    def run_ours() -> list[float]:
        return engine.run(lambda i: micro[i]).losses

    # -- torch.distributed.pipelining on the same chunk --
    from torch.distributed.pipelining import Schedule1F1B

    stage = torch_stage(chunk, state.pp_rank, P, state.device, shape, cfg.torch_dtype, micro[0]["tokens"])
    tsched = Schedule1F1B(stage, m, loss_fn=identity_loss, scale_grads=True)
    full = whole_batch(micro)

    def run_torch() -> list[float]:
        return torch_step(tsched, full)

    # -- verification: same losses and same gradients --
    _zero(params)
    ours_losses = run_ours()
    ours_grads = [p.grad.clone() for p in params]
    _zero(params)
    torch_losses = run_torch()
    grad_diff = max((p.grad - g).abs().max().item() for p, g in zip(params, ours_grads))
    grad_scale = max(g.abs().max().item() for g in ours_grads)
    _zero(params)

    # -- per-stage forward / backward probe of one micro-batch --
    probe_in = None if first else torch.randn(shape, dtype=cfg.torch_dtype, generator=torch.Generator().manual_seed(7))
    probe_grad = torch.randn(shape, dtype=cfg.torch_dtype, generator=torch.Generator().manual_seed(8))

    def probe() -> tuple[float, float]:
        x = None if first else probe_in.detach().requires_grad_()
        t0 = time.perf_counter()
        out = chunk(x, micro[0])
        t1 = time.perf_counter()
        if last:
            torch.autograd.backward(out / m)
        else:
            torch.autograd.backward(out, grad_tensors=probe_grad)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1

    systems = {"ours": run_ours, "torch": run_torch}
    times: dict[str, list[float]] = {name: [] for name in systems}
    fwd, bwd = [], []
    for r in range(args.warmup + args.iters):
        order = ["ours", "torch"] if r % 2 == 0 else ["torch", "ours"]
        for name in order:
            _zero(params)
            dist.barrier()
            t0 = time.perf_counter()
            systems[name]()
            times[name].append(time.perf_counter() - t0)
        for _ in range(args.stage_reps):
            _zero(params)
            dist.barrier()
            f, b = probe()
            fwd.append(f)
            bwd.append(b)
    _zero(params)
    breakdown = _breakdown(args.breakdown, state, engine, run_ours, run_torch, stage, params)
    w = args.warmup
    return {
        "rank": rank, "partition": parts, "losses": {"ours": ours_losses, "torch": torch_losses},
        "grad_diff": grad_diff, "grad_scale": grad_scale,
        "times": {k: v[w:] for k, v in times.items()},
        "f": median(fwd[w * args.stage_reps:]), "b": median(bwd[w * args.stage_reps:]),
        "breakdown": breakdown,
    }


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--iters", type=count(1), default=20)
    ap.add_argument("--warmup", type=count(0), default=3)
    add_pipeline_model_args(ap)
    ap.add_argument("--stage-reps", type=count(1), default=1, help="per-stage f/b probes per timing round")
    ap.add_argument("--breakdown", type=count(0), default=2,
                    help="instrumented iterations per system after timing (compute vs p2p wait per rank)")
    ap.add_argument("--trace", default=None, help="write a Chrome trace of the instrumented iterations here")
    args = ap.parse_args(argv)
    if args.trace and not args.breakdown:
        raise UsageError("--trace: traces the --breakdown iterations; --breakdown 0 has none")
    check_pipeline_model(args, P, f" (this benchmark's {P} ranks)")
    output_files(trace=args.trace)
    return args


@exit_on_usage_error
def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    res = run_gloo(_worker, P, args, threads=1)
    m = args.microbatches
    print(f"GPT {args.layers} layers, hidden {args.hidden}, heads {args.heads}, seq {args.seq}, vocab {args.vocab}; "
          f"pp={P} (gloo, 1 thread/rank), 1F1B, m={m}, micro-batch {args.micro_batch_size}; "
          f"partition (units per stage) {res[0]['partition']}; {args.iters} timed rounds after {args.warmup} warm-up")

    ours_l, torch_l = res[-1]["losses"]["ours"], res[-1]["losses"]["torch"]
    loss_diff = max(abs(a - b) for a, b in zip(ours_l, torch_l))
    print(f"check: mean loss ours {sum(ours_l) / m:.6f}  torch {sum(torch_l) / m:.6f}  "
          f"max |diff| per micro-batch {loss_diff:.2e}; max |grad diff| "
          + ", ".join(f"rank {r['rank']}: {r['grad_diff']:.1e} (of max |g| {r['grad_scale']:.1e})" for r in res))

    # per round: the slowest rank's elapsed time
    per_round = {k: [max(r["times"][k][i] for r in res) for i in range(args.iters)] for k in ("ours", "torch")}
    med = {k: median(v) * 1e3 for k, v in per_round.items()}
    stage_fb = [(r["f"] * 1e3, r["b"] * 1e3) for r in res]
    for i, (f, b) in enumerate(stage_fb):
        print(f"stage {i}: forward {f:.1f} ms, backward {b:.1f} ms per micro-batch (median)")
    ideal = (m + P - 1) * max(f + b for f, b in stage_fb)
    wins = sum(o < t for o, t in zip(per_round["ours"], per_round["torch"]))
    print(f"ideal = (m + p - 1) x max stage (f + b) = {m + P - 1} x {max(f + b for f, b in stage_fb):.1f} ms; "
          f"ours faster than torch in {wins}/{args.iters} rounds")
    ratios = sorted(o / t for o, t in zip(per_round["ours"], per_round["torch"]))
    q = lambda f: ratios[min(len(ratios) - 1, int(f * len(ratios)))]  # noqa: E731
    print(f"per-round ratio ours/torch: median {median(ratios):.3f}, quartiles {q(0.25):.3f}..{q(0.75):.3f}; "
          f"min iteration ours "
          f"{min(per_round['ours']) * 1e3:.1f} ms, torch {min(per_round['torch']) * 1e3:.1f} ms")
    if args.breakdown > 0:
        rows = []
        for name in ("ours", "torch"):
            for r in res:
                mine = [b for b in r["breakdown"] if b["system"] == name]
                tot, comp, wait, post, other = (median([b[k] for b in mine]) * 1e3
                                                for k in ("total", "compute", "wait", "post", "other"))
                f, b = stage_fb[r["rank"]]
                rows.append([name, r["rank"], tot, comp, m * (f + b), wait, post, other])
        print(f"breakdown (per column, median of {args.breakdown} instrumented iterations per system; "
              "other = iteration - compute - wait - post: final send waits, schedule bookkeeping):")
        print(format_table(["system", "rank", "iteration (ms)", "compute F+B (ms)", "m x probe f+b (ms)",
                            "p2p wait (ms)", "p2p post (ms)", "other (ms)"], rows))
        if args.trace:
            _write_trace(args.trace, res)
            print(f"Chrome trace: {args.trace}")
    rows = [[name, med[name], med[name] / med["torch"], ideal, med[name] / ideal] for name in ("ours", "torch")]
    print(format_table(["system", "median iteration (ms)", "ratio vs torch", "ideal (ms)", "ratio vs ideal"], rows))
    ok_torch, ok_ideal = med["ours"] / med["torch"] <= 1.05, med["ours"] / ideal <= 1.10
    print(f"target: ours/torch <= 1.05: {'met' if ok_torch else 'NOT met'}; "
          f"ours within 10% of ideal: {'met' if ok_ideal else 'NOT met'}  (total {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
