"""The planner's predicted iteration time against the trainer's measured one for context parallelism on this machine:
cp 1 x dp 2, cp 2 with the p2p ring and cp 2 with the all-to-alls, on 2 gloo ranks, for a GPT-2-style and a
Llama-style (rope, GQA, SwiGLU, RMSNorm) small GPT at a long-ish sequence.

    python benchmarks/context_parallel_planner.py [--models gpt2,llama] [--seq 1024] [--hidden 128] [--layers 2]
        [--heads 4] [--rounds 3] [--per-round 2] [--warmup 1] [--profile-repeats 3] [--json out.json]

Both ranks (one torch thread each) build the trainers of every (model, configuration) from pretrain_gpt.py's flags
(training/loop.build_trainer, mock data, global batch 2 of micro-batch 1: one sequence per dp rank at cp 1, both
sequences on both ranks at cp 2) and then run --rounds rounds; each round first profiles the model's units at the
full sequence as `autoconfig.py profile --context-parallel-size 2` does (one rank at a time, tp 1, micro-batch 1,
the runtime's cp 2 core, the engine's per-action overhead, and the p2p and all-reduce links between the two ranks),
then runs --warmup + --per-round training iterations of every trainer in turn, so load from other jobs spreads over
the profile and all configurations alike. A measured iteration is the slowest rank's Trainer.train_step (pipeline,
gradient reduction over dp x cp, optimizer step). As in simulator_accuracy.py, a small matrix product timed on both
ranks around every iteration and profiling step (the probe) tells how much CPU we had; only samples within
--tolerance of the fastest probe count.

The prediction is the planner's simulate_run of the run's own RunSpec (planner/spec.spec_from_run_config) on the
local cluster the profile describes, as `autoconfig.py simulate --profile P --context-parallel-size 2` gives it:
at cp 2 the units are the profiled ones rescaled to the rank's s/2 tokens, the attention core is 1/2 of the whole
sequence's causal core and the ring's or the all-to-alls' exposed time is added (planner/cp_cost.py). The
optimizer step is fitted from the trainers' own steps (the model cut to one and two layers, optimizer_time.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.args import UsageError, count, exit_on_usage_error, names, output_files, parser  # noqa: E402
from benchmarks.common import cpu_probe, format_table, run_gloo  # noqa: E402
from benchmarks.stats import spearman  # noqa: E402

CONFIGS = (("cp1 x dp2", 1, "p2p"), ("cp2 p2p", 2, "p2p"), ("cp2 a2a", 2, "a2a"))
MODELS = ("gpt2", "llama")


def model_flags(name: str, a: dict) -> list[str]:
    """pretrain_gpt.py's model flags of the GPT-2-style or Llama-style model at the benchmark's size."""
    seq, hidden = str(a["seq"]), a["hidden"]
    flags = ["--num-layers", str(a["layers"]), "--hidden-size", str(hidden), "--num-attention-heads", str(a["heads"]),
             "--seq-length", seq, "--max-position-embeddings", seq, "--vocab-size", str(a["vocab"]),
             "--make-vocab-size-divisible-by", "128", "--attention-dropout", "0", "--hidden-dropout", "0"]
    if name == "llama":
        flags += ["--position-embedding-type", "rope", "--swiglu", "--ffn-hidden-size", str(8 * hidden // 3 // 8 * 8),
                  "--group-query-attention", "--num-query-groups", str(a["groups"]), "--normalization", "RMSNorm",
                  "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-5"]
    return flags


def run_argv(name: str, cp: int, comm: str, a: dict, iters: int) -> list[str]:
    return model_flags(name, a) + [
        "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", str(iters),
        "--lr", "1e-4", "--log-interval", "1000000", "--eval-interval", "1000000", "--eval-iters", "1",
        "--context-parallel-size", str(cp), "--cp-comm-type", comm]


def check(a: dict) -> None:
    """What the trainers' flags would refuse, said before any rank starts."""
    if a["hidden"] % a["heads"]:
        raise UsageError(f"--hidden {a['hidden']}: not divisible by --heads {a['heads']}")
    if a["seq"] % 4:
        raise UsageError(f"--seq {a['seq']}: cp 2 cuts a sequence into 4 chunks; give a multiple of 4")
    if "llama" in a["models"] and a["heads"] % a["groups"]:
        raise UsageError(f"--groups {a['groups']}: must divide --heads {a['heads']} (Llama's grouped-query attention)")
    if a["heads"] % 2:
        raise UsageError(f"--heads {a['heads']}: cp 2's all-to-all splits the heads over 2 ranks; give an even count")


# ---- on each rank ------------------------------------------------------------------------------------------------
def _iteration(trainer) -> tuple[float, float]:
    """(seconds of one train_step on this rank, the probe around it)."""
    import torch.distributed as dist

    before = cpu_probe()
    dist.barrier()
    t0 = time.perf_counter()
    trainer.train_step()
    t = time.perf_counter() - t0
    return t, max(before, cpu_probe())


def _profile_round(models: dict, repeats: int) -> dict:
    """One profiling sweep, per model: the tp 1 units at micro-batch 1 and the engine overhead, one rank at a time
    (as `autoconfig.py profile` times them in one process); then the links between the two ranks."""
    import torch.distributed as dist

    from megatron_bmw.parallel.state import ParallelState
    from megatron_bmw.planner.analytic import ProfileSettings
    from megatron_bmw.training.profiler import time_cp_core, time_engine_overhead, time_links, time_units

    serial = ParallelState.serial()
    out = {}
    for name, model in models.items():
        got, before = None, cpu_probe()
        for turn in range(dist.get_world_size()):
            if turn == dist.get_rank():
                units = time_units(model, serial, (1,), 1, repeats)
                over = time_engine_overhead(serial, repeats=repeats)
                got = {"units": [(u.kind, u.forward_s, u.backward_s, u.saved_bytes) for u in units
                                 if u.recompute is None], "overhead": over["forward_s"],
                       "cp_core": time_cp_core(model, (2,), (1,), 1, repeats)["2"]["1"]}
            dist.barrier()
        got["probe"] = max(before, cpu_probe())
        out[name] = got
    before = cpu_probe()
    out["links"] = time_links(ProfileSettings().comm_sizes, repeats)
    out["links_probe"] = max(before, cpu_probe())
    return out


def _ranks(rank: int, world: int, a: dict) -> dict:
    from megatron_bmw.training.loop import build_trainer
    from megatron_bmw.training.optimizer_time import step_seconds

    iters = a["rounds"] * (a["warmup"] + a["per_round"]) + 2
    trainers, models = {}, {}
    for name in a["models"]:
        for label, cp, comm in CONFIGS:
            t = build_trainer(run_argv(name, cp, comm, a, iters))
            trainers[(name, label)] = t
            models[name] = t.run.model
    rounds, runs = [], {key: {"walls": [], "probes": []} for key in trainers}
    for _ in range(a["rounds"]):
        rounds.append(_profile_round(models, a["profile_repeats"]))
        for key, t in trainers.items():
            for i in range(a["warmup"] + a["per_round"]):
                wall, probe = _iteration(t)
                if i >= a["warmup"]:
                    runs[key]["walls"].append(wall)
                    runs[key]["probes"].append(probe)
    steps = {}
    for name in a["models"]:  # the optimizer step of the model cut to one and to two layers (optimizer_time.py)
        steps[name] = []
        for layers in (1, 2):
            cut = build_trainer(run_argv(name, 1, "p2p", {**a, "layers": layers}, 2))
            cut.train_step()
            steps[name].append(step_seconds(cut))
    return {"runs": {f"{n}|{c}": v for (n, c), v in runs.items()}, "profiles": rounds, "steps": steps}


# ---- in the parent -----------------------------------------------------------------------------------------------
def build_profile(name: str, model, per_rank: list[dict], steps, quiet, threads: int = 1):
    """The rounds whose probe was quiet (all where none was), each entry's median over them, averaged over the
    two ranks (each timed alone); the links from rank 0's quiet rounds."""
    from megatron_bmw.planner.profile_data import Profile, UnitTiming, model_signature
    from megatron_bmw.training.optimizer_time import fit_optimizer_step
    from megatron_bmw.training.profiler import _fit_link

    rounds0 = per_rank[0]["profiles"]
    chosen = [i for i, r in enumerate(rounds0) if quiet(r[name]["probe"])] or list(range(len(rounds0)))
    units = []
    for j, (kind, _, _, saved) in enumerate(rounds0[0][name]["units"]):
        fwd = statistics.mean(statistics.median(rk["profiles"][i][name]["units"][j][1] for i in chosen)
                              for rk in per_rank)
        bwd = statistics.mean(statistics.median(rk["profiles"][i][name]["units"][j][2] for i in chosen)
                              for rk in per_rank)
        units.append(UnitTiming(kind, 1, 1, fwd, bwd, saved))
    over = statistics.mean(statistics.median(rk["profiles"][i][name]["overhead"] for i in chosen) for rk in per_rank)
    core = {key: statistics.mean(statistics.median(rk["profiles"][i][name]["cp_core"][key] for i in chosen)
                                 for rk in per_rank) for key in ("forward_s", "backward_s")}
    lchosen = [i for i, r in enumerate(rounds0) if quiet(r["links_probe"])] or list(range(len(rounds0)))
    links = {}
    for link in ("p2p", "allreduce"):
        points = rounds0[0]["links"][link]["points"]
        best = [(x, statistics.median(rounds0[i]["links"][link]["points"][j][1] for i in lchosen))
                for j, (x, _) in enumerate(points)]
        links[link] = _fit_link(best, 1.0 if link == "p2p" else 2 * (2 - 1) / 2)
    info = {"name": f"cpu-{threads}-thread", "kind": "cpu", "threads": threads, "cores": os.cpu_count() or 1,
            "statistic": "median", "memory_bytes": 8 * 2**30}
    step = fit_optimizer_step([tuple(s) for s in steps], model.dtype_bytes)
    return Profile(device=info, dtype=model.params_dtype, model=model_signature(model), units=units, links=links,
                   overhead={"forward_s": over, "backward_s": over}, mode="measured", optimizer=step,
                   cp_core={"2": {"1": core}})


def predict(argv: list[str], profile) -> float:
    """The planner's simulated iteration of the run these flags describe, on the local cluster of `profile`."""
    from megatron_bmw.arguments import run_config_from_argv
    from megatron_bmw.planner.cluster import local_cluster
    from megatron_bmw.planner.evaluate import simulate_run
    from megatron_bmw.planner.memory_model import MemorySettings
    from megatron_bmw.planner.spec import spec_from_run_config

    run = run_config_from_argv(argv, 2, "gpt").run
    spec = spec_from_run_config(run, 2)
    cluster = local_cluster(2, profile.device_type(4 * 2**30), profile.link("p2p"), profile.link("allreduce"),
                            profile.cores())
    return simulate_run(spec, cluster, profile, memory_settings=MemorySettings(device="cpu")).simulation.iteration_time


def load_line() -> str:
    try:
        one, five, _ = os.getloadavg()
        return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} cores"
    except OSError:
        return "load average unknown"


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--models", default="gpt2,llama", help="comma list of gpt2, llama")
    ap.add_argument("--seq", type=count(4), default=1024)
    ap.add_argument("--hidden", type=count(2), default=128)
    ap.add_argument("--layers", type=count(1), default=2)
    ap.add_argument("--heads", type=count(2), default=4)
    ap.add_argument("--groups", type=count(1), default=2, help="Llama's query groups (GQA)")
    ap.add_argument("--vocab", type=count(1), default=1024)
    ap.add_argument("--rounds", type=count(1), default=3, help="passes over profile and configurations")
    ap.add_argument("--per-round", type=count(1), default=2, help="measured iterations per configuration and pass")
    ap.add_argument("--warmup", type=count(0), default=1, help="iterations per configuration and pass not counted")
    ap.add_argument("--profile-repeats", type=count(1), default=3, help="samples per unit and round")
    ap.add_argument("--tolerance", type=float, default=1.3,
                    help="a sample counts when the probe around it ran within this factor of its fastest")
    ap.add_argument("--json", default=None, help="write all numbers to this JSON file")
    args = ap.parse_args(argv)
    models = names("--models", args.models, MODELS)
    if not args.tolerance >= 1:
        raise UsageError(f"--tolerance {args.tolerance}: must be >= 1 (the fastest sample must count)")
    output_files(json=args.json)
    a = {k: getattr(args, k) for k in ("seq", "hidden", "layers", "heads", "groups", "vocab", "rounds", "per_round",
                                       "warmup", "profile_repeats")}
    a["models"] = models
    check(a)
    torch.set_num_threads(1)
    before = load_line()
    t0 = time.time()
    per_rank = run_gloo(_ranks, 2, a)
    took = time.time() - t0
    probes = [x for rk in per_rank for run in rk["runs"].values() for x in run["probes"]]
    probes += [r[n]["probe"] for rk in per_rank for r in rk["profiles"] for n in models]
    fastest = min(probes)

    def quiet(p: float) -> bool:
        return p <= args.tolerance * fastest

    from megatron_bmw.arguments import run_config_from_argv

    rows, out, kept, total, profiles = [], [], 0, 0, {}
    for name in models:
        model = run_config_from_argv(run_argv(name, 1, "p2p", a, 10), 2, "gpt").run.model
        profile = build_profile(name, model, per_rank, per_rank[0]["steps"][name], quiet)
        profiles[name] = profile.to_json()
        preds, meas = [], []
        for label, cp, comm in CONFIGS:
            key = f"{name}|{label}"
            walls = [max(w) for w in zip(*(rk["runs"][key]["walls"] for rk in per_rank))]
            keep = [w for w, p in zip(walls, per_rank[0]["runs"][key]["probes"]) if quiet(p)] or walls
            kept, total = kept + len(keep), total + len(walls)
            pred = predict(run_argv(name, cp, comm, a, 10), profile)
            flops = predict(run_argv(name, cp, comm, a, 10), replace(profile, cp_core={}))
            med = statistics.median(keep)
            preds.append(pred)
            meas.append(med)
            rows.append([name, label, pred, med, f"{min(keep):.3f}-{max(keep):.3f}", f"{pred / med:.2f}",
                         f"{flops:.3f} ({flops / med:.2f})" if cp > 1 else "-"])
            out.append({"model": name, "config": label, "predicted_s": pred, "measured_median_s": med,
                        "predicted_core_by_flops_s": flops, "measured_kept_s": keep, "measured_all_s": walls})
        order = lambda xs: [CONFIGS[i][0] for i in sorted(range(len(xs)), key=xs.__getitem__)]  # noqa: E731
        agree = order(preds) == order(meas)
        rows.append([name, "ranking", " < ".join(order(preds)), " < ".join(order(meas)),
                     f"rho {spearman(preds, meas):.2f}", "agree" if agree else "differ", ""])
    print(f"{', '.join(models)}: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
          f"global batch 2 of micro-batch 1, 2 gloo ranks of 1 thread; {took:.0f} s")
    print(f"kept {kept} of {total} measured iterations (probe within {args.tolerance}x of its fastest, "
          f"{1e3 * fastest:.1f} ms); {before} before, {load_line()} after")
    print(format_table(["model", "config", "predicted s/iter", "measured s/iter (median)", "measured min-max",
                        "predicted/measured", "core by FLOPs: predicted (/measured)"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": out, "fastest_probe_s": fastest, "kept": kept, "iterations": total,
                       "load_before": before, "load_after": load_line(), "profiles": profiles}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
