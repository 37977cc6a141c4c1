"""How well does the planner predict real runs? Profile, simulate, run the engine, compare.

On this machine (2 gloo ranks, one thread each): profile the units of a small GPT, then for each
configuration (pp=2 with several partitions incl. sub-layer cuts, 2 to 16 micro-batches, 1F1B and GPipe, and
tp=2) simulate one iteration and run the engine with a pipeline trace (a Tracer, as --pipeline-trace does).
The measured iteration time is the median over iterations after warm-up of the slowest rank's engine.run
(pipeline plus gradient synchronisation). Reports the median |predicted - measured| / measured and the
Spearman rank correlation across configurations; then the memory model against the activation store: per
stage, the peak bytes the engine's store recorded in those runs, and per unit (fp32 and bf16, every
recomputation choice) the bytes one forward leaves in the store (and in our own saved-tensor hooks).

Other jobs share this machine's two cores and come and go. So the two ranks run the profile and the
configurations round-robin, several rounds, each round re-warming every configuration; a small matrix
product timed on both ranks around every measured iteration and profiling step (the probe) tells how much CPU
we had, and only samples taken within --tolerance of the fastest probe count. tp=1 units are timed one rank at
a time (as `autoconfig.py profile` does in one process): timed side by side they came out 30-80% slower than
inside the two-stage pipeline here.

    python benchmarks/simulator_accuracy.py [--rounds 6] [--profile prof.json] [--json out.json] [--trace-dir DIR]
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.args import UsageError, count, exit_on_usage_error, output_dirs, output_files, parser  # noqa: E402
from benchmarks.common import cpu_probe  # noqa: E402
from benchmarks.stats import spearman  # noqa: E402
from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.device import free_port
from megatron_bmw.planner.cluster import local_cluster
from megatron_bmw.planner.evaluate import simulate_run
from megatron_bmw.planner.memory_model import (MemorySettings, activation_walk, chunk_saved_bytes,
                                               unit_activation_bytes)
from megatron_bmw.planner.profile_data import Profile
from megatron_bmw.planner.analytic import ProfileSettings
from megatron_bmw.planner.spec import RunSpec

MODEL = dict(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=1024, seq_length=128,
             attention_backend="unfused")
SEED = 1234


@dataclass(frozen=True)
class Case:
    name: str
    tp: int
    pp: int
    schedule: str
    partition: str | None
    m: int
    mbs: int = 2

    def pipeline(self) -> PipelineConfig:
        return PipelineConfig(self.mbs, self.m, self.schedule, partition=None if self.partition is None else
                              tuple(int(x) for x in self.partition.split(",")))


CASES = [
    Case("pp2 1f1b m2", 1, 2, "1f1b", None, 2),
    Case("pp2 1f1b m4", 1, 2, "1f1b", None, 4),
    Case("pp2 1f1b m8", 1, 2, "1f1b", None, 8),
    Case("pp2 1f1b m16", 1, 2, "1f1b", None, 16),
    Case("pp2 1f1b m8 cut 4,6", 1, 2, "1f1b", "4,6", 8),
    Case("pp2 1f1b m8 cut 7,3", 1, 2, "1f1b", "7,3", 8),
    Case("pp2 1f1b m6 mbs4", 1, 2, "1f1b", None, 6, 4),
    Case("pp2 gpipe m4", 1, 2, "gpipe", None, 4),
    Case("pp2 gpipe m8 cut 3,7", 1, 2, "gpipe", "3,7", 8),
    Case("tp2 m4", 2, 1, "1f1b", None, 4),
    Case("tp2 m8", 2, 1, "1f1b", None, 8),
]


# ---- real runs on two ranks ------------------------------------------------------------------------------------
def _batches(model: ModelConfig, b: int, m: int) -> list[dict]:
    out = []
    for i in range(m):
        g = torch.Generator().manual_seed(100 + i)
        tokens = torch.randint(0, model.vocab_size, (b, model.seq_length + 1), generator=g)
        out.append({"tokens": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone(),
                    "loss_mask": torch.ones(b, model.seq_length)})
    return out


class _Runner:
    """One configuration built on this rank, run an iteration at a time."""

    def __init__(self, model: ModelConfig, case: Case) -> None:
        from megatron_bmw.config import ParallelConfig
        from megatron_bmw.parallel.grad_sync import GradSync
        from megatron_bmw.parallel.random import set_seeds
        from megatron_bmw.parallel.state import ParallelState
        from megatron_bmw.pipeline.engine import PipelineEngine
        from megatron_bmw.pipeline.stages import hidden_shape, pipeline_setup
        from megatron_bmw.pipeline.trace import Tracer

        self.case = case
        self.state = state = ParallelState.build(ParallelConfig(tensor_model_parallel_size=case.tp,
                                                                pipeline_model_parallel_size=case.pp))
        set_seeds(SEED, state.tp_rank, state.pp_rank, state.rng)
        chunks, sched, _ = pipeline_setup(model, state, SEED, case.pipeline())
        self.sync = GradSync([p for c in chunks for p in c.parameters()], state)
        self.tracer = Tracer(state.rank, state.pp_rank)
        self.engine = PipelineEngine(chunks, state, sched, hidden_shape(model, state, case.mbs), model.torch_dtype,
                                     tracer=self.tracer, track_activations=True)
        self.batches = _batches(model, case.mbs, case.m)
        self.walls: list[float] = []
        self.windows: list[tuple[float, float]] = []
        self.probes: list[float] = []

    def iterate(self, record: bool) -> None:
        import torch.distributed as dist

        before = cpu_probe() if record else 0.0
        dist.barrier()
        w0, t0 = time.time(), time.perf_counter()
        self.engine.run(lambda i: self.batches[i], grad_sync=self.sync)
        t1, w1 = time.perf_counter(), time.time()
        self.sync.zero()
        if record:
            self.walls.append(t1 - t0)
            self.windows.append((w0, w1))
            self.probes.append(max(before, cpu_probe()))

    def result(self, trace_dir: str | None) -> dict:
        if trace_dir:  # the same Chrome trace --pipeline-trace writes
            name = self.case.name.replace(" ", "_").replace(",", "-")
            self.tracer.write(os.path.join(trace_dir, f"{name}.json"))
        busy = []
        for w0, w1 in self.windows:
            mine = [e for e in self.tracer.events if w0 <= e["ts"] / 1e6 <= w1]
            compute = sum(e["dur"] for e in mine if e["cat"] in ("forward", "backward")) / 1e6
            waits = sum(e["dur"] for e in mine if e["cat"] == "wait") / 1e6
            busy.append(compute - waits)
        return {"walls": self.walls, "busy": busy, "pp_rank": self.state.pp_rank, "probes": self.probes,
                "store_peak_bytes": self.engine.activation_stats()["peak_bytes"]}


def _profile_round(model: ModelConfig, tp2_state, settings: ProfileSettings) -> dict:
    """One sweep of the profiler: tp=1 units and the engine overhead on each rank in turn, tp=2 units on both,
    links between them."""
    import torch.distributed as dist

    from megatron_bmw.parallel.state import ParallelState
    from megatron_bmw.training.profiler import time_engine_overhead, time_links, time_units

    args = (settings.micro_batch_sizes, settings.warmup, settings.repeats)
    serial = ParallelState.serial()
    tp1 = overhead = None
    before = cpu_probe()
    # One rank at a time, as the profiler times tp=1 in a single process: timed side by side (in lockstep or
    # not) the units came out 30-80% slower than the same units inside the two-stage pipeline on this machine.
    for turn in range(dist.get_world_size()):
        if turn == dist.get_rank():
            tp1 = time_units(model, serial, *args, statistic=settings.statistic)
            overhead = time_engine_overhead(serial, repeats=settings.repeats, statistic=settings.statistic)
        dist.barrier()
    middle = cpu_probe()
    tp2 = time_units(model, tp2_state, *args, barrier=dist.barrier, statistic=settings.statistic)
    after = cpu_probe()
    links = time_links(settings.comm_sizes, settings.repeats, statistic=settings.statistic)
    return {"tp1": tp1, "tp2": tp2, "overhead": overhead, "links": links, "tp1_probe": max(before, middle),
            "tp2_probe": max(middle, after)}


def _worker(rank: int, world: int, port: int, model: ModelConfig, cases, warmup, rounds, per_round, trace_dir,
            settings: ProfileSettings | None, queue) -> None:
    """Round-robin over the configurations, with a profiling sweep in every round, so that load from other
    jobs on the machine spreads over the profile and all configurations alike; a probe kernel timed around
    every measured iteration and profiling step tells how disturbed it was."""
    import torch.distributed as dist

    from megatron_bmw.config import ParallelConfig
    from megatron_bmw.parallel.state import ParallelState

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
        tp2_state = ParallelState.build(ParallelConfig(tensor_model_parallel_size=2))
        runners = [_Runner(model, c) for c in cases]
        profiles = []
        for _ in range(rounds):
            if settings is not None:
                profiles.append(_profile_round(model, tp2_state, settings))
            for r in runners:
                for i in range(warmup + per_round):  # re-warm after the other configurations ran
                    r.iterate(i >= warmup)
        queue.put((rank, {"runs": [r.result(trace_dir) for r in runners], "profiles": profiles}))
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        import traceback

        queue.put((rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _combine_profile(model: ModelConfig, rounds: list[list[dict]], settings: ProfileSettings,
                     quiet: Callable[[float], bool]) -> Profile:
    """Quiet rounds combined with the statistic (all rounds where none was quiet); tp=1 ranks (timed in turn)
    averaged, tp=2 ranks (one group) maxed. rounds[rank][round]."""
    from megatron_bmw.planner.profile_data import UnitTiming, model_signature
    from megatron_bmw.training.profiler import _fit_link

    pick = min if settings.statistic == "min" else statistics.median
    units = []
    for key, merge in (("tp1", statistics.mean), ("tp2", max)):
        chosen = [i for i, r in enumerate(rounds[0]) if quiet(r[f"{key}_probe"])] or list(range(len(rounds[0])))
        per_rank = [[rank_rounds[i][key] for i in chosen] for rank_rounds in rounds]  # [rank][round][entry]
        for i, first in enumerate(per_rank[0][0]):
            fwd = merge(pick(rr[i].forward_s for rr in rank) for rank in per_rank)
            bwd = merge(pick(rr[i].backward_s for rr in rank) for rank in per_rank)
            units.append(UnitTiming(first.kind, first.tp, first.micro_batch_size, fwd, bwd, first.saved_bytes))
    chosen = [i for i, r in enumerate(rounds[0]) if quiet(r["tp1_probe"])] or list(range(len(rounds[0])))
    over = statistics.mean(pick(rank[i]["overhead"]["forward_s"] for i in chosen) for rank in rounds)
    links = {}
    for name in ("p2p", "allreduce"):
        points = rounds[0][0]["links"][name]["points"]
        best = [[x, pick(r["links"][name]["points"][j][1] for r in rounds[0])] for j, (x, _) in enumerate(points)]
        links[name] = _fit_link([(x, y) for x, y in best], 1.0 if name == "p2p" else 2 * (2 - 1) / 2)
    info = {"name": "cpu-1-thread", "kind": "cpu", "threads": 1, "processes": 2, "statistic": settings.statistic,
            "memory_bytes": 8 * 2**30}
    return Profile(device=info, dtype=model.params_dtype, model=model_signature(model), units=units,
                   links=links, overhead={"forward_s": over, "backward_s": over}, mode="measured")


def measure(model: ModelConfig, cases: list[Case], warmup: int, rounds: int, per_round: int, trace_dir: str | None,
            statistic: str = "median", settings: ProfileSettings | None = None,
            tolerance: float = 1.3) -> tuple[list[dict], Profile | None, dict]:
    """Per case: iteration time (median, or min, over iterations of the slowest rank) and busy seconds per stage;
    and the profile measured in between (when `settings` is given). Only quiet rounds count: those whose probe
    kernel around them ran within `tolerance` of its fastest (other jobs share this machine)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, model, cases, warmup, rounds, per_round, trace_dir,
                                               settings, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=3600) for _ in range(2))
    for p in procs:
        p.join()
    for rank, value in got.items():
        if isinstance(value, str):
            raise RuntimeError(f"rank {rank} failed: {value}")
    probes = [x for r in range(2) for run in got[r]["runs"] for x in run["probes"]]
    for r in range(2):
        probes += [x for part in got[r]["profiles"] for x in (part["tp1_probe"], part["tp2_probe"])]
    fastest = min(probes)

    def quiet(probe: float) -> bool:
        return probe <= tolerance * fastest

    pick = min if statistic == "min" else statistics.median
    out = []
    kept_total = 0
    for i, _ in enumerate(cases):
        per_rank = [got[r]["runs"][i] for r in range(2)]
        walls = [max(w) for w in zip(*(x["walls"] for x in per_rank))]
        keep = [j for j, pr in enumerate(per_rank[0]["probes"]) if quiet(pr)] or list(range(len(walls)))
        kept_total += len(keep)
        iters = [walls[j] for j in keep]
        best = keep[iters.index(pick(iters))] if statistic == "min" else None
        busy, store = {}, {}
        for x in per_rank:
            busy[x["pp_rank"]] = x["busy"][best] if best is not None else statistics.median(x["busy"][j] for j in keep)
            store[x["pp_rank"]] = x["store_peak_bytes"]
        out.append({"iteration_s": pick(iters), "busy_s": [busy[s] for s in sorted(busy)], "iterations_s": walls,
                    "kept": keep, "store_peak_bytes": [store[s] for s in sorted(store)]})
    profile = None
    if settings:
        profile = _combine_profile(model, [got[r]["profiles"] for r in range(2)], settings, quiet)
    total = sum(len(x["iterations_s"]) for x in out)
    return out, profile, {"fastest_probe_s": fastest, "kept_iterations": kept_total, "iterations": total}


# ---- predictions -----------------------------------------------------------------------------------------------
def predict(model: ModelConfig, case: Case, profile: Profile) -> dict:
    spec = RunSpec.of(model=model, tp=case.tp, pp=case.pp, dp=1, pipeline=case.pipeline())
    cluster = local_cluster(2, profile.device_type(float(profile.device.get("memory_bytes") or 8 * 2**30)),
                            profile.link("p2p"), profile.link("allreduce"))
    settings = MemorySettings(device="cpu")
    ev = simulate_run(spec, cluster, profile, memory_settings=settings)
    sim = ev.simulation
    layout = spec.stage_layout()
    saved = [activation_walk(ev.schedule, r, lambda q: chunk_saved_bytes(layout, model, q, settings))[0]
             for r in range(spec.pp)]
    return {"iteration_s": sim.iteration_time, "busy_s": sim.busy, "bubble": sim.bubble_fraction,
            "master_stage": sim.master_stage, "saved_peak_bytes": saved}


# ---- memory per unit --------------------------------------------------------------------------------------------
def memory_check(model: ModelConfig, mbs: int = 2) -> list[dict]:
    """Per unit kind and dtype: predicted saved bytes vs the activation store's bytes (and our own hooks')."""
    from megatron_bmw.models.chunk import build_units
    from megatron_bmw.parallel.state import ParallelState
    from megatron_bmw.units import recompute_from_flags, unit_kind
    from megatron_bmw.pipeline.activation_store import ActivationStore
    from megatron_bmw.training.saved_bytes import measure_saved

    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for recompute in (None, "selective", "full"):
            cfg = ModelConfig(**{**MODEL, "num_layers": 1, "params_dtype": dtype})
            per_unit = recompute_from_flags(recompute, None, None, 1, [list(range(cfg.num_units))])
            units = build_units(cfg, ParallelState.serial(), SEED, recompute=per_unit)
            params = [p for u in units.values() for p in u.parameters()]
            choice = dict(zip(units, per_unit or (None,) * cfg.num_units))
            batch = _batches(cfg, mbs, 1)[0]
            for name, unit in units.items():
                hidden = None
                if name != "embedding":
                    hidden = torch.randn(cfg.seq_length, mbs, cfg.hidden_size, dtype=dtype, requires_grad=True)
                saved, _ = measure_saved(lambda: unit(hidden, batch), params)
                store = ActivationStore("cpu", params)
                with store.capture((0, 0, None)):
                    out = unit(hidden, batch)
                kind = unit_kind(name)
                predicted = unit_activation_bytes(kind, cfg, mbs, recompute=choice[name], device="cpu")
                rows.append({"dtype": str(dtype).replace("torch.", ""), "recompute": recompute or "none",
                             "unit": kind, "predicted": predicted, "measured": store.nbytes((0, 0, None)),
                             "hooks": saved.total})
                del out
    return rows


@exit_on_usage_error
def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=count(1), default=6, help="round-robin passes over the configurations")
    ap.add_argument("--per-round", type=count(1), default=2, help="measured iterations per configuration and pass")
    ap.add_argument("--warmup", type=count(0), default=1)
    ap.add_argument("--profile-repeats", type=count(1), default=3, help="samples per unit and round")
    ap.add_argument("--profile", default=None, help="reuse a profile JSON instead of measuring one")
    ap.add_argument("--save-profile", default=None, help="write the measured profile here")
    ap.add_argument("--json", default=None, help="write all numbers to this JSON file")
    ap.add_argument("--trace-dir", default=None, help="write each configuration's Chrome trace here")
    ap.add_argument("--tolerance", type=float, default=1.3,
                    help="a sample counts when the probe kernel around it ran within this factor of its fastest")
    ap.add_argument("--statistic", choices=["median", "min"], default="median",
                    help="over repetitions, for the profile and the measured iterations alike")
    args = ap.parse_args()
    if not args.tolerance >= 1:
        raise UsageError(f"--tolerance {args.tolerance}: must be >= 1 (the fastest sample must count)")
    if args.profile and args.save_profile:
        raise UsageError("--save-profile: saves a measured profile; --profile reuses one instead of measuring")
    output_files(json=args.json, save_profile=args.save_profile)
    output_dirs(trace_dir=args.trace_dir)
    torch.set_num_threads(1)
    model = ModelConfig(**MODEL)
    settings = None
    if args.profile:
        profile = Profile.load(args.profile)
    else:
        settings = ProfileSettings(micro_batch_sizes=(2, 4), tp_sizes=(1, 2), warmup=1, repeats=args.profile_repeats,
                                   statistic=args.statistic)
    t0 = time.time()
    measured, measured_profile, quiet = measure(model, CASES, args.warmup, args.rounds, args.per_round,
                                                args.trace_dir, args.statistic, settings, args.tolerance)
    print(f"profiled and ran {len(CASES)} configurations in {time.time() - t0:.1f} s; kept "
          f"{quiet['kept_iterations']} of {quiet['iterations']} iterations measured while the probe kernel ran "
          f"within {args.tolerance}x of its fastest ({1e3 * quiet['fastest_probe_s']:.1f} ms)")
    if measured_profile is not None:
        profile = measured_profile
        if args.save_profile:
            profile.save(args.save_profile)
    p2p = profile.link("p2p")
    print(f"p2p link: {p2p.bandwidth / 1e9:.2f} GB/s, {p2p.latency * 1e6:.0f} us latency; engine overhead "
          f"{1e3 * profile.overhead.get('forward_s', 0.0):.2f} ms per compute action")
    rows = []
    for case, real in zip(CASES, measured):
        pred = predict(model, case, profile)
        err = (pred["iteration_s"] - real["iteration_s"]) / real["iteration_s"]
        rows.append({"config": case.name, "predicted_s": pred["iteration_s"], "measured_s": real["iteration_s"],
                     "error": err, "predicted_busy_s": pred["busy_s"], "measured_busy_s": real["busy_s"],
                     "bubble": pred["bubble"], "master_stage": pred["master_stage"],
                     "predicted_peak_saved_bytes": pred["saved_peak_bytes"],
                     "store_peak_bytes": real["store_peak_bytes"], "iterations_s": real["iterations_s"]})
    print(f"\n{'configuration':<24} {'predicted s':>11} {'measured s':>10} {'error':>7}   "
          f"{'busy/stage predicted':>22} {'busy/stage measured':>21}")
    for r in rows:
        pb = "/".join(f"{x:.3f}" for x in r["predicted_busy_s"])
        mb = "/".join(f"{x:.3f}" for x in r["measured_busy_s"])
        print(f"{r['config']:<24} {r['predicted_s']:>11.4f} {r['measured_s']:>10.4f} {100 * r['error']:>+6.1f}%   "
              f"{pb:>22} {mb:>21}")
    print(f"\n{'configuration':<24} {'peak saved activations per stage: predicted / activation store (MiB)':<70}")
    stage_errors = []
    for r in rows:
        pairs = list(zip(r["predicted_peak_saved_bytes"], r["store_peak_bytes"]))
        stage_errors += [abs(a - b) / b for a, b in pairs]
        text = "   ".join(f"{a / 2**20:.3f} / {b / 2**20:.3f}" for a, b in pairs)
        print(f"{r['config']:<24} {text}")
    print(f"worst per-stage peak error {100 * max(stage_errors):.2f}%")
    med = statistics.median(abs(r["error"]) for r in rows)
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    print(f"median |error| {100 * med:.1f}% (target <= 10%), Spearman {rho:.3f} (target >= 0.9)")

    mem = memory_check(model)
    worst = max(abs(r["predicted"] - r["measured"]) / r["measured"] for r in mem)
    print(f"\n{'dtype':<9} {'recompute':<10} {'unit':<10} {'predicted B':>12} {'store B':>12} {'hooks B':>12}")
    for r in mem:
        print(f"{r['dtype']:<9} {r['recompute']:<10} {r['unit']:<10} {r['predicted']:>12} {r['measured']:>12} "
              f"{r['hooks']:>12}")
    print(f"worst per-unit memory error {100 * worst:.2f}% (target <= 5%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"timing": rows, "median_abs_error": med, "spearman": rho, "memory": mem, "rounds": quiet,
                       "memory_worst_error": worst, "profile": profile.to_json()}, f, indent=1)
    return 0 if med <= 0.10 and rho >= 0.9 and worst <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
