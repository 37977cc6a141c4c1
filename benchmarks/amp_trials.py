"""The planner against AMP's real trials: GPT-2 (24 layers, hidden 1024) on 16 T4s, global batch 32.

Data: ../shared/data/amp_gpt2_homogeneous.json (AMP's public artifact): 52 strategies AMP ran for real (5 ran
out of memory) and AMP's own per-layer forward times on T4 at batch 1 for tp 1, 2 and 4. Those times become a
per-unit profile (a layer's time split between its attention and MLP units by FLOPs; backward = 2 x forward,
as AMP assumes); every trial becomes a RunSpec (its stage boundaries mapped onto units) and is simulated on
the aws-g4dn.12xlarge cluster (50 Gb/s links). Reported: Spearman's rank correlation of predicted and real
seconds per iteration (AMP's own model: 0.935), the real time of the trial predicted fastest against the real
best, which out-of-memory trials are predicted not to fit and which trials that ran are wrongly flagged, and
the planner's search on the same profile and cluster. Nothing here is fitted to the real times.

The trials ran Megatron-LM v1.1.5's GPT-2 on DeepSpeed's pipeline engine (AMP's repository): fp16 with gradients
all-reduced in fp32 (`fp32_allreduce` in its ds_config), no activation recomputation, the rank order tp-dp-pp,
and a pipeline model whose last layer casts the logits to fp32. Our cost model assumes the same, so nothing is
changed for time. Memory is the memory model on CUDA with DeepSpeed's model states (planner/engine.py: fp16
gradients, fp32 master weights, gradient copy and moments), the CUDA allowance derived for the T4 nodes
(planner/cuda_allowance.py), plus what the engine holds beyond our runtime: the last stage's previous fp32
logits (deepspeed_held_bytes). `--engine ours` counts our runtime's states and leaves the logits out;
`--flat-allowance` uses the fixed 1.5 GiB + 10% the derived allowance replaced.

    python benchmarks/amp_trials.py [--batch-scaling linear|fixed] [--engine deepspeed|ours] [--flat-allowance]
                                    [--json out.json]

Batch scaling: the profile has batch 1 only. `linear` scales the whole time with the batch, as AMP does.
`fixed` (default) splits each profiled time at tp > 1 into a part that grows with the batch - the tp=1 time
of the same unit divided by tp (the same kernels on 1/tp of the columns) plus the bytes of its tensor-parallel
all-reduce over the node's link - and a fixed rest (kernel launches, all-reduce latency, synchronisation of
the tp ranks) that does not; at tp = 1 the whole time grows with the batch.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.args import UsageError, exit_on_usage_error, output_files, parser  # noqa: E402
from benchmarks.stats import spearman  # noqa: E402
from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.planner.cluster import load_cluster
from megatron_bmw.planner.cost_model import CostSettings, allreduce_time
from megatron_bmw.planner.evaluate import simulate_run, stage_capacity
from megatron_bmw.planner.flops import unit_forward_flops
from megatron_bmw.planner.cuda_allowance import DerivedAllowance
from megatron_bmw.planner.engine import EngineConfig
from megatron_bmw.planner.memory_model import MemorySettings
from megatron_bmw.planner.profile_data import Profile, Profiles, UnitTiming, model_signature
from megatron_bmw.planner.search import SearchSettings, search
from megatron_bmw.planner.space import SearchSpace
from megatron_bmw.planner.spec import RunSpec

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data",
                    "amp_gpt2_homogeneous.json")
GLOBAL_BATCH = 32
OVERLAP = False
MODEL = ModelConfig(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=52256, seq_length=1024,
                    params_dtype="fp16", attention_backend="unfused", hidden_dropout=0.1, attention_dropout=0.1)
# AMP's 30 profile entries: [embedding, no-op, 24 layers, no-op, no-op, head, no-op]
EMBEDDING, LAYERS, HEAD = (0, 1), range(2, 26), (26, 27, 28, 29)


def entry_units(entry: int) -> int:
    """Our units per AMP entry: a layer is two (attention, MLP), the first entry the embedding, the head entry
    the head; the no-ops none."""
    if entry in LAYERS:
        return 2
    return 1 if entry in (0, 28) else 0


def partition(boundaries: list[int]) -> tuple[int, ...]:
    """AMP's stage boundaries over its 30 entries as units per stage; a stage holding only a no-op takes the
    first unit of the next stage (our stages cannot be empty)."""
    sizes = [sum(entry_units(e) for e in range(a, b)) for a, b in zip(boundaries, boundaries[1:])]
    for k, size in enumerate(sizes):
        if size == 0:  # the stages in between pass one unit along: only the counts of k and the donor change
            donor = next(j for j in range(k + 1, len(sizes)) if sizes[j] > 1)
            sizes[donor] -= 1
            sizes[k] += 1
    return tuple(sizes)


def profile(data: dict, batch_scaling: str) -> Profile:
    """AMP's per-layer forward times (ms, batch 1) as per-unit timings for tp 1, 2, 4 (backward = 2 x forward).
    With `fixed` batch scaling a second point at batch 2 carries the fixed part (see the module doc)."""
    share = unit_forward_flops("attention", MODEL, 1) / (unit_forward_flops("attention", MODEL, 1)
                                                       + unit_forward_flops("mlp", MODEL, 1))
    link = load_cluster("aws-g4dn.12xlarge").groups[0].intra_node
    sample = MODEL.seq_length * MODEL.hidden_size * MODEL.dtype_bytes  # one sample's hidden state
    tables = {}
    for tp in (1, 2, 4):
        ms = data["profiles_ms"][f"gpt2_G4_{tp}"]
        per_unit = [("embedding", 0, sum(ms[e] for e in EMBEDDING))]
        for layer, e in enumerate(LAYERS):
            per_unit += [("attention", 1 + 2 * layer, ms[e] * share), ("mlp", 2 + 2 * layer, ms[e] * (1 - share))]
        per_unit.append(("head", 2 * MODEL.num_layers + 1, sum(ms[e] for e in HEAD)))
        tables[tp] = [(kind, index, fwd_ms / 1e3) for kind, index, fwd_ms in per_unit]
    units = []
    for tp, rows in tables.items():
        for (kind, index, fwd), (_, _, fwd1) in zip(rows, tables[1]):
            units.append(UnitTiming(kind, tp, 1, fwd, 2 * fwd, unit=index))
            if batch_scaling == "fixed":
                # what grows with the batch: the tp=1 kernels on 1/tp of the columns, and the all-reduce bytes
                comm = allreduce_time(sample, tp, link) - allreduce_time(0.0, tp, link) \
                    if kind in ("attention", "mlp") else 0.0
                work = min(fwd, fwd1 / tp + comm)
                units.append(UnitTiming(kind, tp, 2, fwd + work, 2 * (fwd + work), unit=index))
    return Profile(device={"name": "t4", "type": "t4"}, dtype="fp16", model=model_signature(MODEL), units=units,
                   mode="measured")


def deepspeed_held_bytes(spec: RunSpec) -> float:
    """What DeepSpeed's pipeline engine, which ran AMP's trials, keeps beyond the memory our runtime needs: on
    the last stage, the previous micro-batch's output. The engine stores each forward's output in a pipe buffer
    (the last stage has two) and its last-stage backward returns without freeing it, so the buffer lives until
    a later forward overwrites it. The GPT-2 pipeline model's last layer casts the logits to fp32, and the
    cross entropy works in place on them, so that output is the micro-batch's fp32 logits."""
    if spec.pipeline.num_microbatches < 2:
        return 0.0
    model = spec.model
    return float(model.seq_length * spec.pipeline.micro_batch_size * (model.vocab_size // spec.tp) * 4)


def evaluate(data: dict, batch_scaling: str, memory: MemorySettings, engine: str = "deepspeed") -> dict:
    cluster = load_cluster("aws-g4dn.12xlarge", num_nodes=4)
    profiles = Profiles([profile(data, batch_scaling)])
    rows = []
    for t in data["trials"]:
        m = GLOBAL_BATCH // (t["dp"] * t["mbs"])
        pipe = PipelineConfig(micro_batch_size=t["mbs"], num_microbatches=m, partition=partition(t["boundaries"]))
        spec = RunSpec.of(MODEL, t["tp"], t["pp"], t["dp"], pipe, overlap_grad_reduce=OVERLAP)
        ev = simulate_run(spec, cluster, profiles, CostSettings(), memory, memory_over_time=False)
        held = [0.0] * (t["pp"] - 1) + [deepspeed_held_bytes(spec) if engine == "deepspeed" else 0.0]
        need = max((x.peak_bytes + held[s]) / stage_capacity(spec, cluster, s) for s, x in enumerate(ev.memory))
        rows.append({**t, "predicted_s": ev.simulation.iteration_time, "memory_vs_capacity": need,
                     "fits": need <= 1.0})
    ran = [r for r in rows if r["real_s"] is not None]
    rho = spearman([r["predicted_s"] for r in ran], [r["real_s"] for r in ran])
    rho_amp = spearman([r["amp_predicted_s"] for r in ran], [r["real_s"] for r in ran])
    best_real = min(r["real_s"] for r in ran)
    pick = min((r for r in rows if r["fits"]), key=lambda r: r["predicted_s"])
    amp_pick = min(rows, key=lambda r: r["amp_predicted_s"])
    by_tp = {tp: statistics.median(r["predicted_s"] / r["real_s"] for r in ran if r["tp"] == tp) for tp in (1, 2, 4)}
    return {"rows": rows, "spearman": rho, "spearman_amp": rho_amp, "best_real_s": best_real,
            "pick": pick, "pick_off": (pick["real_s"] or float("inf")) / best_real - 1,
            "amp_pick_off": (amp_pick["real_s"] or float("inf")) / best_real - 1,
            "oom_caught": sum(1 for r in rows if r["real_s"] is None and not r["fits"]),
            "oom_total": sum(1 for r in rows if r["real_s"] is None),
            "false_oom": sum(1 for r in ran if not r["fits"]), "ratio_by_tp": by_tp}


@exit_on_usage_error
def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--batch-scaling", choices=["fixed", "linear"], default="fixed")
    ap.add_argument("--engine", choices=["deepspeed", "ours"], default="deepspeed",
                    help="memory of the engine that ran the trials (deepspeed) or of our runtime alone")
    ap.add_argument("--flat-allowance", action="store_true", help="1.5 GiB + 10%% instead of the derived one")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    output_files(json=args.json)
    try:
        with open(DATA) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{os.path.normpath(DATA)}: cannot read AMP's trials ({exc})") from None
    engine = EngineConfig("deepspeed") if args.engine == "deepspeed" else EngineConfig()
    memory = MemorySettings(device="cuda", engine=engine, derived=DerivedAllowance(
        (load_cluster("aws-g4dn.12xlarge").groups[0].device,)))
    if args.flat_allowance:
        memory = MemorySettings(device="cuda", workspace_bytes=1.5 * 2**30, fragmentation=0.10, engine=engine)
    out = {}
    for scaling in (["linear", "fixed"] if args.batch_scaling == "fixed" else ["linear"]):
        out[scaling] = evaluate(data, scaling, memory, args.engine)
    res = out[args.batch_scaling]
    print(f"{'mbs':>3} {'tp':>2} {'dp':>2} {'pp':>2} {'real s':>7} {'AMP s':>7} {'ours s':>7} {'ours/real':>9} "
          f"{'mem/cap':>7}")
    for r in sorted(res["rows"], key=lambda r: r["predicted_s"]):
        real = f"{r['real_s']:7.2f}" if r["real_s"] is not None else "    OOM"
        ratio = f"{r['predicted_s'] / r['real_s']:9.2f}" if r["real_s"] is not None else f"{'-':>9}"
        flag = "" if r["fits"] else "  predicted OOM"
        print(f"{r['mbs']:>3} {r['tp']:>2} {r['dp']:>2} {r['pp']:>2} {real} {r['amp_predicted_s']:7.2f} "
              f"{r['predicted_s']:7.2f} {ratio} {100 * r['memory_vs_capacity']:6.0f}%{flag}")
    print()
    print(f"{'batch scaling':<14} {'Spearman':>8} {'pick off best':>13} {'OOM caught':>10} {'ran, flagged':>12} "
          f"{'ours/real tp1':>13} {'tp2':>5} {'tp4':>5}")
    for scaling, r in out.items():
        print(f"{scaling:<14} {r['spearman']:8.3f} {100 * r['pick_off']:12.1f}% {r['oom_caught']:>5}/{r['oom_total']:<4} "
              f"{r['false_oom']:>12} {r['ratio_by_tp'][1]:13.2f} {r['ratio_by_tp'][2]:5.2f} {r['ratio_by_tp'][4]:5.2f}")
    print(f"{'AMP (paper)':<14} {res['spearman_amp']:8.3f} {100 * res['amp_pick_off']:12.1f}%")
    started = time.time()
    result = search(MODEL, 52256, 1, GLOBAL_BATCH, load_cluster("aws-g4dn.12xlarge", num_nodes=4),
                    Profiles([profile(data, args.batch_scaling)]), SearchSpace(), CostSettings(), memory,
                    SearchSettings(top_k=3))
    best = result.best.spec
    recompute = sorted({r for r in best.pipeline.recompute or () if r})
    print(f"search on this profile ({time.time() - started:.1f} s): tp {best.tp} pp {best.pp} dp {best.dp} "
          f"mbs {best.pipeline.micro_batch_size} {best.pipeline.schedule} v{best.pipeline.virtual_stages}"
          f"{' zero1' if best.distributed_optimizer else ''}{' recompute ' + '/'.join(recompute) if recompute else ''}"
          f", predicted {result.best.time:.3f} s (our runtime's memory, not DeepSpeed's)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
