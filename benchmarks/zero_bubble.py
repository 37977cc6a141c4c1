"""Benchmark: zero-bubble schedules, ours against torch.distributed.pipelining's, and the simulator against the
measured runs (issue 26).

A GPT split over --pp gloo ranks (default 4, one torch thread each). Every system runs the same model units
(same Parameters, built once per rank) on the same micro-batches; gradients accumulate in p.grad (no GradSync):

  ours <name>  PipelineEngine over our schedule <name>: 1f1b, zb-h1 and every other zero-bubble schedule the
               generator registry has (zb-h2, zbv); each rank's chunks are the virtual stages Schedule.stage_of
               places on it (the partition: default_partition over p x chunks-per-rank stages)
  torch-1f1b   Schedule1F1B, one stage per rank (our 1f1b's chunks)
  torch-zb     ScheduleInterleavedZeroBubble (ZB1P), --torch-zb-stages per rank: 1 (our zb-h1's chunks) or 2
               (stage k on rank k % p)
  torch-zbv    ScheduleZBVZeroBubble: two stages per rank in a V (stages r and 2p-1-r on rank r; needs
               m >= 2p - 1)

torch's stages wrap the chunks in benchmarks/pipelining_adapters.py's adapter; with --torch-linear native (the
default) their linear layers run torch.nn.functional.linear, so that torch's input/weight split does each GEMM
once (see pipelining_adapters.native_linear). Once, before timing, every system's per-micro-batch losses and
every parameter gradient (summed over the ranks) are compared with ours 1f1b.

Timing: rounds, each running every system once in an order rotated by one each round, between two probes (a fixed
matrix product on all ranks, common.cpu_probe); only rounds whose probe ran within --tolerance of the fastest
count (the machine is shared). An iteration's time is the slowest rank's (end - start) from a common barrier.
Ratios are per round against ours 1f1b; the median and quartiles over the kept rounds are printed.

Bubble and simulator: our engine records every timed iteration with a Tracer (pipeline/trace.py). Per rank, an
action's compute is its span minus the wait for its input inside it, the engine's overhead is the time between
spans, and the measured bubble is 1 - compute / iteration. The simulator (pipeline/replay.py, the core
planner/simulator.py runs) replays the same schedule with (a) the mean (--statistic) compute per (rank, kind,
chunk) over the kept iterations plus the rank's mean overhead per action, and (b) each iteration's own durations; transfers
take the median latency seen in the run (a wait's end minus the end of the action that produced its input;
--p2p ping-pong: half a ping-pong between neighbours, measured alone). Its iteration time is the last action's
end (the engine's tail after it, final send waits and loss reads, is printed apart), its bubble 1 - compute /
that. torch's bubble is measured the same way from its stages'
forward_one_chunk / backward_one_chunk / backward_weight_one_chunk spans (its p2p waits lie outside them).

Where ranks share cores (here 2 cores for 4 ranks, and other jobs), an action's duration depends on how many
ranks compute beside it, which the simulator does not model (its durations are this run's averages), and a rank's
bubble is no idle core: the other ranks run on it. A zero-bubble schedule then cannot gain what it gains with a
core (or an accelerator) per rank, and the ratios show its costs (W passes, more actions and messages) instead.
The timings are noisy: compare the quartiles, not one run's median.

    python benchmarks/zero_bubble.py [--pp 4 --iters 10 --warmup 2 --layers 8 --hidden 256 --seq 128
                                     --micro-batch-size 4 --microbatches 8 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.args import count, exit_on_usage_error, output_files, parser  # noqa: E402
from benchmarks.common import (add_pipeline_model_args, check_pipeline_model, cpu_probe, format_table,  # noqa: E402
                               median, run_gloo)
from benchmarks.pipelining_adapters import (identity_loss, make_microbatches, native_linear,  # noqa: E402
                                            torch_stage, torch_step, whole_batch, zero_grads)
from megatron_bmw.config import ModelConfig, ParallelConfig  # noqa: E402
from megatron_bmw.errors import UsageError  # noqa: E402
from megatron_bmw.models.chunk import ModelChunk, build_units  # noqa: E402
from megatron_bmw.parallel.state import ParallelState  # noqa: E402
from megatron_bmw.pipeline import generators  # noqa: E402
from megatron_bmw.pipeline.engine import PipelineEngine  # noqa: E402
from megatron_bmw.pipeline.partition import default_partition, virtual_stage_units  # noqa: E402
from megatron_bmw.pipeline.replay import replay  # noqa: E402
from megatron_bmw.pipeline.schedule import COMPUTE_KINDS, Action, Kind, Schedule  # noqa: E402
from megatron_bmw.pipeline.stages import hidden_shape  # noqa: E402
from megatron_bmw.pipeline.trace import Tracer  # noqa: E402
from megatron_bmw.units import unit_names  # noqa: E402

SEED = 1234
OURS = ("1f1b", "zb-h1", "zb-h2", "zbv")  # taken where generators.SCHEDULES has them
TORCH = ("torch-1f1b", "torch-zb", "torch-zbv")
COMPUTE_CATS = ("forward", "backward", "weight-gradient")


def our_schedules(wanted: list[str] | None = None) -> list[str]:
    names = [s for s in OURS if s in generators.SCHEDULES]
    if wanted is None:
        return names
    unknown = [s for s in wanted if s not in generators.SCHEDULES]
    if unknown:
        raise UsageError(f"--ours {','.join(unknown)}: not a schedule of ours (choose {', '.join(names)})")
    return wanted


def our_schedule(name: str, p: int, m: int) -> Schedule:
    """Schedule `name` with communication; its chunks per rank from the registry (zbv: 2), else 1."""
    return generators.generate(name, p, m, getattr(generators, "CHUNKS", {}).get(name, 1))


# ---- on each rank ------------------------------------------------------------------------------------------------
class _Model:
    """Every unit of the model on this rank (the head with its own word-embedding copy, as at pp > 1), and the
    chunks of any split of it into virtual stages, sharing those units."""

    def __init__(self, cfg: ModelConfig, state: ParallelState) -> None:
        self.cfg, self.names = cfg, unit_names(cfg.num_layers)
        n = len(self.names)
        self.units = build_units(cfg, state, SEED, list(range(n - 1)))
        self.units.update(build_units(cfg, state, SEED, [n - 1]))
        self.params = [p for u in self.units.values() for p in u.parameters() if p.requires_grad]
        self._chunks: dict[tuple[int, int], ModelChunk] = {}

    def chunk(self, vstage: int, stages: int) -> ModelChunk:
        """Virtual stage `vstage` of the model split into `stages` (default_partition)."""
        if (vstage, stages) not in self._chunks:
            idx = virtual_stage_units(default_partition(self.cfg.num_layers, stages, 1))[vstage]
            self._chunks[vstage, stages] = ModelChunk({self.names[i]: self.units[self.names[i]] for i in idx})
        return self._chunks[vstage, stages]

    def summed_grads(self) -> torch.Tensor:
        """Every parameter's gradient, flat, summed over the ranks (each unit runs on one rank per system)."""
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params])
        dist.all_reduce(flat)
        return flat


class _Spans:
    """(kind, start, end) of torch's stage compute calls, wrapped on the stage instances."""

    def __init__(self, stages) -> None:
        self.spans: list[tuple[str, float, float]] = []
        for stage in stages:
            for attr, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                               ("backward_weight_one_chunk", "W")):
                setattr(stage, attr, self._wrap(getattr(stage, attr), kind))

    def _wrap(self, fn, kind):
        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spans.append((kind, t0, time.perf_counter()))
        return timed


def _our_actions(events: list[dict], w0: float) -> list[tuple]:
    """Per compute action of one traced iteration: (kind, microbatch, chunk, half, start, end, wait, wait end),
    seconds from the iteration's start; `wait` is the wait for its input inside the span (recorded with the same
    action), `wait end` when that input was there (None without a wait)."""
    waits = {}
    for e in events:
        if e["cat"] == "wait":
            a = e["args"]
            waits[(a["kind"], a["microbatch"], a["chunk"], a["half"])] = (e["dur"] / 1e6,
                                                                          (e["ts"] + e["dur"]) / 1e6 - w0)
    out = []
    for e in events:
        if e["cat"] in COMPUTE_CATS:
            a = e["args"]
            key = (a["kind"], a["microbatch"], a["chunk"], a["half"])
            start = e["ts"] / 1e6 - w0
            out.append((*key, start, start + e["dur"] / 1e6, *waits.get(key, (0.0, None))))
    return out


def _p2p_time(shape, dtype, reps: int) -> list[float]:
    """One-way times of a hidden-state tensor between neighbouring ranks, pair by pair (half a ping-pong), as
    measured on the lower rank of each pair."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(shape, dtype=dtype)
    out = []
    for a in range(world - 1):
        dist.barrier()
        if rank in (a, a + 1):
            peer = a + 1 if rank == a else a
            for _ in range(reps + 2):
                t0 = time.perf_counter()
                if rank == a:
                    dist.send(buf, peer)
                    dist.recv(buf, peer)
                else:
                    dist.recv(buf, peer)
                    dist.send(buf, peer)
                if rank == a:
                    out.append((time.perf_counter() - t0) / 2)
    return out[2:] if out else out  # the first two of the pair warm the connection up


def _worker(rank: int, world: int, args: argparse.Namespace) -> dict:
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      vocab_size=args.vocab, seq_length=args.seq, hidden_dropout=0.0, attention_dropout=0.0,
                      attention_backend=args.attention)
    p, m, mbs = world, args.microbatches, args.micro_batch_size
    state = ParallelState.build(ParallelConfig(pipeline_model_parallel_size=p))
    model = _Model(cfg, state)
    micro = make_microbatches(cfg, mbs, m, SEED + 1)
    full = whole_batch(micro)
    shape = hidden_shape(cfg, state, mbs)
    chunk = model.chunk
    runs, engines, spans = {}, {}, {}
    for name in args.ours:
        sched = our_schedule(name, p, m)
        v = sched.virtual_stages
        engine = PipelineEngine([chunk(sched.stage_of(state.pp_rank, c), p * v) for c in range(v)], state, sched,
                                shape, cfg.torch_dtype)
        engines[name] = engine

        def run(engine=engine) -> list[float]:
            return engine.run(lambda i: micro[i]).losses
        runs[name] = run

    from torch.distributed.pipelining import (Schedule1F1B, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)

    for name in args.torch:
        if name == "torch-1f1b":
            places = [state.pp_rank]
        elif name == "torch-zb":
            places = [state.pp_rank + k * p for k in range(args.torch_zb_stages)]
        else:
            places = [state.pp_rank, 2 * p - 1 - state.pp_rank]
        n = p * len(places)
        stages = [torch_stage(chunk(s, n), s, n, state.device, shape, cfg.torch_dtype, micro[0]["tokens"])
                  for s in places]
        if name == "torch-1f1b":
            sched = Schedule1F1B(stages[0], m, loss_fn=identity_loss, scale_grads=True)
        elif name == "torch-zb":
            sched = ScheduleInterleavedZeroBubble(stages, m, loss_fn=identity_loss, scale_grads=True)
        else:
            sched = ScheduleZBVZeroBubble(stages, m, loss_fn=identity_loss, scale_grads=True)
        spans[name] = _Spans(stages)

        def run(sched=sched) -> list[float]:
            if args.torch_linear == "native":
                with native_linear():
                    return torch_step(sched, full)
            return torch_step(sched, full)
        runs[name] = run

    systems = list(runs)

    # -- check: losses and every gradient against the first system (ours 1f1b) --
    check = {}
    for name in systems:
        zero_grads(model.params)
        losses = torch.zeros(m, dtype=torch.float64)
        got = runs[name]()
        if got:
            losses += torch.tensor(got, dtype=torch.float64)
        dist.all_reduce(losses)
        check[name] = (losses, model.summed_grads())
        for s in spans.values():
            s.spans.clear()
    ref_losses, ref_grads = check[systems[0]]
    checks = {name: {"losses": losses.tolist(), "loss_diff": (losses - ref_losses).abs().max().item(),
                     "grad_diff": (grads - ref_grads).abs().max().item(), "grad_scale": ref_grads.abs().max().item()}
              for name, (losses, grads) in check.items()}
    zero_grads(model.params)

    p2p = _p2p_time(shape, cfg.torch_dtype, args.p2p_reps)

    # -- timing rounds --
    records: dict[str, list[dict]] = {name: [] for name in systems}
    probes = []
    for r in range(args.warmup + args.iters):
        before = cpu_probe()
        k = r % len(systems)
        for name in systems[k:] + systems[:k]:
            zero_grads(model.params)
            engine = engines.get(name)
            if engine is not None:
                engine.tracer = Tracer(state.rank, state.pp_rank)
            if name in spans:
                spans[name].spans.clear()
            dist.barrier()
            w0, t0 = time.time(), time.perf_counter()
            runs[name]()
            elapsed = time.perf_counter() - t0
            rec = {"elapsed": elapsed}
            if engine is not None:
                rec["w0"] = w0
                rec["actions"] = _our_actions(engine.tracer.events, w0)
                engine.tracer = None
            else:
                rec["spans"] = [(kind, a - t0, b - t0) for kind, a, b in spans[name].spans]
            records[name].append(rec)
        probes.append(max(before, cpu_probe()))
        if rank == 0:
            print(f"  round {r + 1}/{args.warmup + args.iters}{' (warm-up)' if r < args.warmup else ''}: probe "
                  f"{probes[-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    zero_grads(model.params)
    w = args.warmup
    return {"rank": rank, "checks": checks, "p2p": p2p, "probes": probes[w:],
            "records": {k: v[w:] for k, v in records.items()}}


# ---- analysis in the parent --------------------------------------------------------------------------------------
def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    s = sorted(xs)
    q = lambda f: s[min(len(s) - 1, int(f * len(s)))]  # noqa: E731
    return q(0.25), median(s), q(0.75)


def _compute(act: tuple) -> float:
    return act[5] - act[4] - act[6]


def _overhead(acts: list[tuple]) -> float:
    """Time outside the compute spans, from the iteration's start to the last span's end."""
    acts = sorted(acts, key=lambda a: a[4])
    gaps, prev = 0.0, 0.0
    for a in acts:
        gaps += max(0.0, a[4] - prev)
        prev = a[5]
    return gaps


def _action(a: tuple) -> Action:
    return Action(Kind(a[0]), a[1], a[2], None, a[3])


def in_run_latencies(sched: Schedule, per_rank: list[list[dict]], keep: list[int]) -> list[float]:
    """Transfer latencies seen in the traced iterations: for every action that waited for its input from another
    rank, the end of that wait minus the end of the producing action (one clock: the ranks share the machine)."""
    out = []
    for i in keep:
        made = {}
        for q in range(len(per_rank)):
            rec = per_rank[q][i]
            for a in rec["actions"]:
                t = sched.output_tensor(q, _action(a))
                if t is not None:
                    made[t] = (q, rec["w0"] + a[5])
        for q in range(len(per_rank)):
            rec = per_rank[q][i]
            for a in rec["actions"]:
                t = sched.input_tensor(q, _action(a)) if a[7] is not None else None
                if t is not None and t in made and made[t][0] != q:
                    out.append(rec["w0"] + a[7] - made[t][1])
    return out


def simulate_ours(name: str, p: int, m: int, res: list[dict], keep: list[int], p2p_s: float | None,
                  statistic=statistics.mean) -> dict:
    """Measured and simulated iteration time and per-rank bubble of our schedule `name` (see the docstring);
    transfers take `p2p_s`, or with None the median latency seen in the run (in_run_latencies)."""
    sched = our_schedule(name, p, m)
    per_rank = [r["records"][name] for r in res]  # [rank][iteration]
    if p2p_s is None:
        seen = in_run_latencies(sched, per_rank, keep)
        p2p_s = median(seen) if seen else 0.0
    iters = [max(per_rank[q][i]["elapsed"] for q in range(p)) for i in keep]
    measured = median(iters)

    def key(rank, a) -> tuple:
        return rank, a[0], a[2]

    durations: dict[tuple, list[float]] = {}
    overhead = []
    for q in range(p):
        per_action = []
        for i in keep:
            acts = per_rank[q][i]["actions"]
            for a in acts:
                durations.setdefault(key(q, a), []).append(_compute(a))
            per_action.append(_overhead(acts) / max(1, len(acts)))
        overhead.append(statistic(per_action))
    typical = {k: statistic(v) for k, v in durations.items()}

    def transfer(src, dst, a) -> float:
        return p2p_s

    def typical_time(rank, a) -> float:
        return typical[(rank, a.kind.value, a.chunk)] + overhead[rank]

    rep = replay(sched, typical_time, transfer, record=False)
    busy = [sum(typical[(q, a.kind.value, a.chunk)] for a in sched.actions[q] if a.kind in COMPUTE_KINDS)
            for q in range(p)]
    sim_bubble = [1 - b / rep.makespan for b in busy]
    meas_bubble = [median([1 - sum(_compute(a) for a in per_rank[q][i]["actions"]) / it for i, it in zip(keep, iters)])
                   for q in range(p)]

    own_errors = []
    for i, it in zip(keep, iters):
        own = {}
        for q in range(p):
            acts = sorted(per_rank[q][i]["actions"], key=lambda a: a[4])
            prev = 0.0
            for a in acts:
                own[(q, a[0], a[1], a[2], a[3])] = _compute(a) + max(0.0, a[4] - prev)
                prev = a[5]
        own_rep = replay(sched, lambda rank, a: own[(rank, a.kind.value, a.microbatch, a.chunk, a.half)], transfer,
                         record=False)
        own_errors.append((own_rep.makespan - it) / it)
    tail = median([it - max(max(a[5] for a in per_rank[q][i]["actions"]) for q in range(p))
                   for i, it in zip(keep, iters)])
    return {"measured_s": measured, "simulated_s": rep.makespan, "error": (rep.makespan - measured) / measured,
            "own_error": median(own_errors), "p2p_s": p2p_s, "tail_s": tail, "measured_bubble": meas_bubble, "simulated_bubble": sim_bubble,
            "overhead_s": overhead}


def torch_bubble(name: str, p: int, res: list[dict], keep: list[int]) -> list[float]:
    per_rank = [r["records"][name] for r in res]
    iters = [max(per_rank[q][i]["elapsed"] for q in range(p)) for i in keep]
    return [median([1 - sum(b - a for _, a, b in per_rank[q][i]["spans"]) / it for i, it in zip(keep, iters)])
            for q in range(p)]


def parse_args(argv=None) -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--pp", type=int, default=4, help="pipeline ranks (gloo processes)")
    ap.add_argument("--iters", type=count(1), default=10, help="timed rounds")
    ap.add_argument("--warmup", type=count(0), default=2, help="untimed rounds first")
    add_pipeline_model_args(ap)
    ap.add_argument("--ours", default=None,
                    help=f"comma-separated schedules of ours (default: those of {','.join(OURS)} registered); "
                    "the first is the reference")
    ap.add_argument("--torch", default=",".join(TORCH), help=f"comma-separated, of {','.join(TORCH)} ('' for none)")
    ap.add_argument("--torch-zb-stages", type=int, default=1, choices=[1, 2],
                    help="stages per rank of torch's ScheduleInterleavedZeroBubble")
    ap.add_argument("--torch-linear", default="native", choices=["native", "ours"],
                    help="linear layers of torch's systems: F.linear, or our deferrable Function")
    ap.add_argument("--tolerance", type=float, default=1.3,
                    help="a round counts when its probe ran within this factor of the fastest probe")
    ap.add_argument("--statistic", choices=["mean", "median"], default="mean",
                    help="of an action kind's durations (and the overhead per action) for the simulator: the mean "
                    "predicts a sum of durations, the median drops the slow tail other jobs cause")
    ap.add_argument("--p2p", choices=["in-run", "ping-pong"], default="in-run",
                    help="the simulator's transfer time: the median latency seen in the traced iterations (a wait's "
                    "end minus its producer's end), or a ping-pong's between neighbours, measured alone")
    ap.add_argument("--p2p-reps", type=count(1), default=20, help="ping-pongs per neighbour pair")
    ap.add_argument("--json", default=None, help="write all numbers here")
    args = ap.parse_args(argv)
    args.ours = our_schedules(None if args.ours is None else [s for s in args.ours.split(",") if s])
    args.torch = [s for s in args.torch.split(",") if s]
    bad = [s for s in args.torch if s not in TORCH]
    if bad:
        raise UsageError(f"--torch {','.join(bad)}: choose from {','.join(TORCH)}")
    if not args.ours:
        raise UsageError("--ours: at least one schedule of ours (the reference) is needed")
    if args.pp < 2:
        raise UsageError(f"--pp {args.pp}: a pipeline needs at least 2 ranks")
    if "torch-zbv" in args.torch and args.microbatches < 2 * args.pp - 1:
        raise UsageError(f"--microbatches {args.microbatches}: torch-zbv needs at least 2 x pp - 1 = "
                         f"{2 * args.pp - 1}")
    if not args.tolerance >= 1:
        raise UsageError(f"--tolerance {args.tolerance}: must be >= 1 (the fastest round must count)")
    zbv = [s for s in args.ours + args.torch if s.endswith("zbv")]
    check_pipeline_model(args, 2 * args.pp if zbv else args.pp,
                         f" ({zbv[0]}: two per rank of --pp {args.pp})" if zbv else f" (--pp {args.pp})")
    output_files(json=args.json)
    return args


@exit_on_usage_error
def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    p, m = args.pp, args.microbatches
    res = run_gloo(_worker, p, args, threads=1)
    systems = list(res[0]["records"])
    ref = systems[0]
    print(f"GPT {args.layers} layers, hidden {args.hidden}, heads {args.heads}, seq {args.seq}, vocab {args.vocab}; "
          f"pp={p} (gloo, 1 thread/rank), m={m}, micro-batch {args.micro_batch_size}; torch linear "
          f"{args.torch_linear}; {args.iters} timed rounds after {args.warmup} warm-up")

    checks = res[0]["checks"]
    ok = True
    rows = []
    for name in systems:
        c = checks[name]
        rel = c["grad_diff"] / max(c["grad_scale"], 1e-30)
        good = c["loss_diff"] <= 1e-5 and rel <= 1e-4
        ok &= good
        rows.append([name, sum(c["losses"]) / m, f"{c['loss_diff']:.1e}", f"{c['grad_diff']:.1e}",
                     f"{rel:.1e}", "ok" if good else "MISMATCH"])
    print(f"check against {ref} (losses per micro-batch; every gradient summed over the ranks):")
    print(format_table(["system", "mean loss", "max |loss diff|", "max |grad diff|", "relative to max |g|", ""],
                       rows))

    probes = [max(r["probes"][i] for r in res) for i in range(args.iters)]
    fastest = min(probes)
    keep = [i for i, x in enumerate(probes) if x <= args.tolerance * fastest]
    print(f"kept {len(keep)} of {args.iters} rounds whose probe ran within {args.tolerance}x of the fastest "
          f"({fastest * 1e3:.2f} ms; slowest {max(probes) * 1e3:.2f} ms)")
    iters = {name: [max(r["records"][name][i]["elapsed"] for r in res) for i in range(args.iters)]
             for name in systems}
    rows = []
    for name in systems:
        ratios = [iters[name][i] / iters[ref][i] for i in keep]
        lo, mid, hi = _quartiles(ratios)
        rows.append([name, median([iters[name][i] for i in keep]) * 1e3, mid, f"{lo:.3f}..{hi:.3f}"])
    print(format_table(["system", "median iteration (ms)", f"ratio vs {ref} (median of rounds)", "quartiles"],
                       rows))

    pong = median([x for r in res for x in r["p2p"]])
    print(f"p2p: {pong * 1e6:.0f} us one way for a hidden-state tensor (median ping-pong between neighbours, "
          f"alone); the simulator takes {'that' if args.p2p == 'ping-pong' else 'the latency seen in the run'}")
    p2p = pong if args.p2p == "ping-pong" else None
    ours = [n for n in systems if not n.startswith("torch-")]
    stat = statistics.mean if args.statistic == "mean" else statistics.median
    sims = {name: simulate_ours(name, p, m, res, keep, p2p, stat) for name in ours}
    rows = []
    for name, s in sims.items():
        rows.append([name, s["measured_s"] * 1e3, s["simulated_s"] * 1e3, f"{100 * s['error']:+.1f}%",
                     f"{100 * s['own_error']:+.1f}%", s["p2p_s"] * 1e3, s["tail_s"] * 1e3,
                     " ".join(f"{100 * x:.0f}" for x in s["measured_bubble"]),
                     " ".join(f"{100 * x:.0f}" for x in s["simulated_bubble"]),
                     " ".join(f"{x * 1e3:.2f}" for x in s["overhead_s"])])
    for name in systems:
        if name.startswith("torch-"):
            rows.append([name, median([iters[name][i] for i in keep]) * 1e3, "", "", "", "", "",
                         " ".join(f"{100 * x:.0f}" for x in torch_bubble(name, p, res, keep)), "", ""])
    print(f"simulator (pipeline/replay.py) with the {args.statistic} compute per (rank, kind, chunk) measured in the "
          "kept rounds, and with each iteration's own durations; bubble = 1 - compute / iteration per rank (%):")
    print(format_table(["system", "measured (ms)", "simulated (ms)", "error", "error, own durations", "p2p (ms)",
                        "tail (ms)",
                        "bubble measured", "bubble simulated", "overhead/action (ms)"], rows))
    worst = max(abs(s["error"]) for s in sims.values())
    print(f"target: simulated within 10% of measured for every schedule of ours: "
          f"{'met' if worst <= 0.10 else 'NOT met'} (worst {100 * worst:.1f}%); "
          f"losses and gradients: {'equal' if ok else 'MISMATCH'}  (total {time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "checks": checks, "iterations_s": iters,
                       "kept": keep, "probes_s": probes, "ping_pong_s": pong, "simulated": sims}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
