"""Galvatron-BMW's per-unit hybrid strategies against uniform layouts: what the search predicts, and what runs.

(a) modelled: Galvatron-BMW's setting, 8 GPUs of one A100 node with the device memory cut to a budget (8 to 32
    GiB; 1.5 GiB workspace and 10% fragmentation as on CUDA by default), BERT-large and a GPT of 1.3B sizes:
    predicted throughput of the best uniform plan (`--space strategy=uniform`: Megatron's tp x pp x dp with SP,
    ZeRO-1, interleaving, per-unit recomputation) and of the best hybrid plan (`--space strategy=hybrid`).
(b) measured: a small GPT on 4 local gloo ranks, profiled on this machine (`autoconfig.py profile`, tp 1, 2, 4),
    planned on the profile's cluster with the device memory cut to the budget where the hybrid's predicted
    advantage is largest; both plans run with `pretrain_gpt.py --plan` (via `tools/grid_search.py --plans`),
    in interleaved rounds (the machine is shared): predicted and measured iteration times (median of each
    run's iterations after warm-up, then the median over rounds) and the measured hybrid / uniform ratio.
    Needs the runtime for `parallel.unit_strategies` (pretrain_gpt.py --unit-strategies).

    python benchmarks/hybrid_vs_uniform.py [--modelled-only] [--out DIR] [--rounds 3] [--trial-iters 10]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.args import UsageError, count, exit_on_usage_error, output_dirs, output_files, parser  # noqa: E402
from benchmarks.common import format_table, median, run_command  # noqa: E402
from megatron_bmw.config import ModelConfig  # noqa: E402
from megatron_bmw.planner.cluster import load_cluster  # noqa: E402
from megatron_bmw.planner.memory_model import MemorySettings  # noqa: E402
from megatron_bmw.planner.search import SearchSettings, search  # noqa: E402
from megatron_bmw.planner.space import SearchSpace  # noqa: E402

GiB = 2**30
MODELLED = {  # name: (layers, hidden, heads, seq, global batch, vocabulary, untied)
    "BERT-large": (24, 1024, 16, 512, 256, 30592, False),
    "GPT-1.3B": (24, 2048, 16, 1024, 64, 50304, False),
    # a vocabulary as large as today's (256k, untied): the embedding and the head outweigh a layer, Galvatron's case
    # for giving them their own strategy
    "GPT-8x2048-v256k": (8, 2048, 16, 1024, 64, 256000, True),
}
BUDGETS_GB = (6, 8, 12, 16, 24, 32)
PLAIN = ["sp=off", "zero1=off", "schedule=1f1b", "bpipe=off", "slicing=off"]  # the features hybrid plans lack
WORLD = 4
SMALL = dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=128, vocab_size=8192,
             untie_embeddings_and_output_weights=True)  # untied: the embedding and the head may differ
SMALL_GBS = 8


def with_memory(cluster, nbytes: float):
    return replace(cluster, groups=tuple(replace(g, device=replace(g.device, memory_bytes=nbytes))
                                         for g in cluster.groups))


def best(model, gbs, cluster, strategy: str, memory: MemorySettings, profiles=None, world=None, extra=()):
    space = SearchSpace.parse([f"strategy={strategy}", *extra])
    settings = SearchSettings(world_size=world, top_k=1)
    return search(model, model.vocab_size, 128, gbs, cluster, profiles, space, memory=memory, settings=settings)


def modelled() -> None:
    cuda = MemorySettings(workspace_bytes=1.5 * GiB, fragmentation=0.1)
    rows = []
    for name, (layers, hidden, heads, seq, gbs, vocab, untied) in MODELLED.items():
        model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq,
                            vocab_size=vocab, max_position_embeddings=seq, params_dtype="bf16",
                            untie_embeddings_and_output_weights=untied)
        for gb in BUDGETS_GB:
            cluster = with_memory(load_cluster("a100-80g-ib"), gb * GiB)
            res = {s: best(model, gbs, cluster, s, cuda).best for s in ("uniform", "hybrid")}
            res["plain"] = best(model, gbs, cluster, "uniform", cuda, extra=PLAIN).best
            tok = {s: (gbs * seq / r.time if r else None) for s, r in res.items()}
            ratio = lambda a: tok["hybrid"] / tok[a] if tok[a] and tok["hybrid"] else None  # noqa: E731
            rows.append([name, gb, _num(tok["uniform"]), _num(tok["plain"]), _num(tok["hybrid"]),
                         _num(ratio("uniform"), 3), _num(ratio("plain"), 3), _layout(res["uniform"]),
                         _layout(res["plain"]), _layout(res["hybrid"])])
            print(f"  {name} {gb} GiB done", flush=True)
    print("\n(a) modelled, 8 x A100 with the memory cut to a budget: predicted tokens/s")
    print(format_table(["model", "GiB", "uniform", "uniform 1F1B plain", "hybrid", "hybrid/uniform",
                        "hybrid/plain", "uniform plan", "plain plan", "hybrid plan"], rows))
    print("uniform: the whole uniform space; plain: uniform without SP, ZeRO-1, interleaving, BPipe, slicing (what "
          "hybrid plans do without: Galvatron-BMW's baselines); tok/s predicted by the simulator")


def _num(x, digits=0):
    return "-" if x is None else (f"{x:.{digits}f}" if digits else f"{x:.0f}")


def _layout(r) -> str:
    if r is None:
        return "no fit"
    s, pl = r.spec, r.spec.pipeline
    head = f"pp{s.pp} mbs{pl.micro_batch_size}"
    if s.unit_strategies:
        return f"{head}: {r.notes[0] if r.notes else ''}"
    extra = [x for x, on in (("sp", s.sp), ("zero1", s.distributed_optimizer)) if on]
    rc = sum(1 for x in pl.recompute or () if x)
    return f"tp{s.tp} dp{s.dp} {head} {pl.schedule}" + "".join(f" {x}" for x in extra) + (f" rc{rc}" if rc else "")


# ---- (b) measured ------------------------------------------------------------------------------------------------
def _run(cmd: list[str], what: str) -> str:
    return run_command(cmd, what, ROOT)


def _model_flags(gbs=SMALL_GBS):
    return ["--num-layers", str(SMALL["num_layers"]), "--hidden-size", str(SMALL["hidden_size"]),
            "--num-attention-heads", str(SMALL["num_attention_heads"]), "--seq-length", str(SMALL["seq_length"]),
            "--vocab-size", str(SMALL["vocab_size"]), "--global-batch-size", str(gbs),
            "--untie-embeddings-and-output-weights"]


def measured(opts) -> None:
    from megatron_bmw.config.planner import PlannerConfig
    from megatron_bmw.planner_args import cluster_from
    from megatron_bmw.planner.profile_data import Profile, Profiles
    from megatron_bmw.planner.report import plan_from
    from megatron_bmw.trials.results import load_results

    os.makedirs(opts.out, exist_ok=True)
    prof = os.path.join(opts.out, f"profile_v{SMALL['vocab_size']}.json")
    if not os.path.exists(prof):
        _run([sys.executable, "tools/autoconfig.py", "profile", "--output", prof, *_model_flags(),
              "--profile-micro-batch-sizes", "1,2,4", "--profile-tp", "1,2,4"], "autoconfig.py profile")
    profiles = Profiles([Profile.load(prof)])
    base = cluster_from(PlannerConfig(cluster="local", world_size=WORLD), profiles)
    model = ModelConfig(**SMALL, max_position_embeddings=SMALL["seq_length"])
    cpu = MemorySettings(device="cpu")
    # the budget where the hybrid's predicted advantage is largest, among fractions of the uniform plan's peak
    ample = best(model, SMALL_GBS, base, "uniform", cpu, profiles, WORLD).best
    top = max(s["peak_bytes"] for s in _prediction(ample, base)["stages"])
    chosen = None
    for frac in (1.0, 0.8, 0.7, 0.6, 0.5, 0.45, 0.4, 0.35, 0.3):
        cluster = with_memory(base, top * frac)
        uni = best(model, SMALL_GBS, cluster, "uniform", cpu, profiles, WORLD)
        hyb = best(model, SMALL_GBS, cluster, "hybrid", cpu, profiles, WORLD)
        if hyb.best is None:
            continue
        gain = (uni.best.time / hyb.best.time) if uni.best else float("inf")
        print(f"  budget {top * frac / 2**20:.1f} MiB: uniform {_t(uni.best)} s, hybrid {_t(hyb.best)} s", flush=True)
        if uni.best and (chosen is None or gain > chosen[0]):
            chosen = (gain, top * frac, uni, hyb)
    if chosen is None:
        raise SystemExit("no budget where both a uniform and a hybrid plan fit")
    gain, budget, uni, hyb = chosen
    print(f"  chosen budget {budget / 2**20:.1f} MiB: predicted uniform / hybrid time {gain:.3f}", flush=True)
    for tag, r in (("uniform", uni.best), ("hybrid", hyb.best)):
        print(f"    {tag}: {_layout(r)}; predicted {r.time:.4f} s", flush=True)
    if opts.predict_only:
        return
    plans = {}
    for tag, result in (("uniform", uni), ("hybrid", hyb)):
        path = os.path.join(opts.out, f"plan_{tag}.json")
        plan_from(result.best, result, profiles, model.vocab_size).save(path)
        plans[tag] = (path, result.best.time)
    times = {tag: [] for tag in plans}
    for k in range(opts.rounds):
        for tag, (path, _) in plans.items():
            results = os.path.join(opts.out, f"round{k}_{tag}.jsonl")
            if os.path.exists(results):
                os.remove(results)
            _run([sys.executable, "tools/grid_search.py", "--plans", path, "--mock-data", "--trial-iters",
                  str(opts.trial_iters), "--warmup-iters", str(opts.warmup_iters), "--results", results,
                  "--log-dir", os.path.join(opts.out, "logs")], f"round {k + 1}: {tag} plan")
            recs = [r for r in load_results(results) if r.get("status") == "ok"]
            if recs:
                times[tag].append(recs[0]["median_iteration_s"])
    rows = []
    for tag, (path, pred) in plans.items():
        meas = median(times[tag]) if times[tag] else None
        rows.append([tag, _layout((uni if tag == "uniform" else hyb).best), f"{pred:.4f}",
                     "-" if meas is None else f"{meas:.4f}", " ".join(f"{x:.4f}" for x in times[tag])])
    print(f"\n(b) measured: GPT {SMALL} on {WORLD} gloo ranks, memory budget {budget / 2**20:.1f} MiB per rank")
    print(format_table(["plan", "layout", "predicted s", "measured s (median)", "rounds"], rows))
    if times["uniform"] and times["hybrid"]:
        print(f"predicted hybrid/uniform time {plans['hybrid'][1] / plans['uniform'][1]:.3f}; measured "
              f"{median(times['hybrid']) / median(times['uniform']):.3f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"budget_bytes": budget, "plans": {t: p for t, (p, _) in plans.items()}, "times": times}, f)


def _prediction(ranked, cluster):
    from megatron_bmw.planner.report import prediction
    return prediction(ranked, cluster)


def _t(r) -> str:
    return "-" if r is None else f"{r.time:.4f}"


@exit_on_usage_error
def main() -> None:
    p = parser(__doc__, epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modelled-only", action="store_true", help="only (a)")
    p.add_argument("--measured-only", action="store_true", help="only (b)")
    p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "megatron_bmw_hybrid_vs_uniform"))
    p.add_argument("--rounds", type=count(1), default=3)
    p.add_argument("--trial-iters", type=count(1), default=10)
    p.add_argument("--warmup-iters", type=count(0), default=3)
    p.add_argument("--json", default=None, help="(b)'s plans and measured times")
    p.add_argument("--predict-only", action="store_true", help="(b): plan, but run nothing")
    p.add_argument("--vocab-size", type=count(1), default=SMALL["vocab_size"],
                   help="(b): the small GPT's vocabulary (a large one makes the embedding and head outweigh a layer)")
    opts = p.parse_args()
    if opts.modelled_only and opts.measured_only:
        raise UsageError("--modelled-only, --measured-only: give one (each leaves out the other part)")
    if opts.modelled_only and opts.predict_only:
        raise UsageError("--predict-only: plans (b), which --modelled-only leaves out")
    if opts.json and (opts.modelled_only or opts.predict_only):
        raise UsageError(f"--json: holds (b)'s measured times, which "
                         f"{'--modelled-only' if opts.modelled_only else '--predict-only'} does not run")
    if opts.warmup_iters >= opts.trial_iters:
        raise UsageError(f"--warmup-iters {opts.warmup_iters} leaves no measured iteration of --trial-iters "
                         f"{opts.trial_iters}")
    output_files(json=opts.json)
    if not opts.modelled_only:
        output_dirs(out=opts.out)
    SMALL["vocab_size"] = opts.vocab_size
    if not opts.measured_only:
        modelled()
    if not opts.modelled_only:
        measured(opts)


if __name__ == "__main__":
    sys.exit(main())
