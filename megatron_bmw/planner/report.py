"""Planner output: JSON objects and text tables for estimate and simulate."""

from __future__ import annotations

from .cluster import Cluster
from .engine import EngineConfig
from .evaluate import Evaluation, stage_capacity
from .memory_model import MemorySettings, RankMemory, total_parameters
from .spec import RunSpec
from .unit_activations import layer_activation_bytes

GiB = 2**30


def _layer_recompute(spec: RunSpec) -> str | None:
    """The recomputation of the model's first layer's attention unit, as the per-layer figure's example."""
    return spec.pipeline.unit_recompute(spec.model.num_units)[1]


def estimate_json(spec: RunSpec, memory: list[RankMemory], cluster: Cluster | None,
                  settings: MemorySettings = MemorySettings()) -> dict:
    stages = []
    for s, m in enumerate(memory):
        entry = {
            "stage": s,
            "params_bytes": m.params_bytes,
            "grads_bytes": m.grads_bytes,
            "optimizer_bytes": m.optimizer_bytes,
            "activation_bytes": m.activation_bytes,
            "transient_bytes": m.transient_bytes,
            "allowance_bytes": m.allowance_bytes,
            "peak_bytes": m.peak_bytes,
            "peak_inflight_microbatches": m.peak_inflight_microbatches,
        }
        if cluster is not None:
            cap = stage_capacity(spec, cluster, s)
            entry["capacity_bytes"] = cap
            entry["fits"] = m.peak_bytes <= cap
        stages.append(entry)
    out = {
        "parameters_total": total_parameters(spec.model),
        "activation_bytes_per_layer": layer_activation_bytes(spec.model, spec.pipeline.micro_batch_size, spec.tp, spec.sp,
                                                             _layer_recompute(spec), settings.device, spec.cp,
                                                             spec.cp_comm_type, spec.experts(settings.moe_imbalance)),
        "layout": {"tp": spec.tp, "cp": spec.cp, "cp_comm_type": spec.cp_comm_type, "pp": spec.pp, "dp": spec.dp,
                   "ep": spec.ep, "etp": spec.etp, "virtual": spec.pipeline.virtual_stages,
                   "micro_batch_size": spec.pipeline.micro_batch_size, "num_microbatches": spec.pipeline.num_microbatches,
                   "schedule": spec.pipeline.schedule, "partition": list(spec.pipeline.partition),
                   "sequence_parallel": spec.sp, "bpipe": spec.pipeline.bpipe,
                   "sliced_microbatches": spec.pipeline.slicing},
        "stages": stages,
    }
    if cluster is not None:
        out["cluster"] = cluster.name
        out["fits"] = all(s["fits"] for s in stages)
    precision = settings.precision(spec.model, spec.distributed_optimizer)
    out["engine"] = {**settings.engine.to_json(), "state_bytes_per_parameter": precision.state_bytes(spec.grad_dp)}
    out["allowance"] = _allowance_json(spec, settings)
    if spec.model.moe is not None:
        out["moe_load_imbalance"] = settings.moe_imbalance
    return out


def _allowance_json(spec: RunSpec, settings: MemorySettings) -> dict:
    """Where the allowance came from: its derived terms (cuda_allowance.py) or the fixed settings."""
    resolved = settings.for_layout(spec.model, spec.tp, spec.dp, spec.pp, spec.pipeline.micro_batch_size, spec.sp,
                                   spec.cp)
    out = {"workspace_bytes": resolved.workspace_bytes, "fragmentation": resolved.fragmentation}
    if settings.derived is not None:
        terms = settings.derived.terms(settings, spec.model, spec.tp, spec.dp, spec.pp,
                                       spec.pipeline.micro_batch_size, spec.sp, spec.cp)
        out["derived"] = [t.to_json() for t in terms]
    return out


def simulate_json(ev: Evaluation, cluster: Cluster, settings: MemorySettings = MemorySettings()) -> dict:
    out = estimate_json(ev.spec, ev.memory, cluster, settings)
    sim = ev.simulation
    out["iteration_time_s"] = sim.iteration_time
    out["pipeline_time_s"] = sim.pipeline_time
    out["bubble_fraction"] = sim.bubble_fraction
    out["master_stage"] = sim.master_stage
    for s, entry in enumerate(out["stages"]):
        entry["busy_s"] = sim.busy[s]
        entry["idle_s"] = sim.idle[s]
        entry["finish_s"] = sim.finish[s]
        entry["simulated_peak_bytes"] = sim.peak_memory[s] + ev.memory[s].transient_bytes \
            + ev.memory[s].allowance_bytes if sim.peak_memory else None
        entry["forward_s"] = sum(ev.cost.chunk_forward[s])
        entry["backward_s"] = sum(ev.cost.chunk_backward[s])
    out["critical_path"] = [{"stage": r, "action": a.label(ev.schedule.virtual_stages > 1), "start_s": t0,
                             "end_s": t1} for r, a, t0, t1 in sim.critical_path]
    return out


def _gib(x: float) -> str:
    return f"{x / GiB:8.3f}"


def memory_table(data: dict) -> str:
    """Text table of an estimate_json/simulate_json object."""
    timed = "busy_s" in data["stages"][0] if data["stages"] else False
    head = f"{'stage':>5} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'peak':>8} {'cap':>8} {'inflight':>8}"
    if timed:
        head += f" {'fwd ms':>8} {'bwd ms':>8} {'busy s':>8} {'idle s':>8}"
    lines = [head + "   (GiB)"]
    for s in data["stages"]:
        cap = _gib(s["capacity_bytes"]) if "capacity_bytes" in s else f"{'-':>8}"
        line = (f"{s['stage']:>5} {_gib(s['params_bytes'])} {_gib(s['grads_bytes'])} {_gib(s['optimizer_bytes'])} "
                f"{_gib(s['activation_bytes'])} {_gib(s['peak_bytes'])} {cap} {s['peak_inflight_microbatches']:>8g}")
        if timed:
            line += (f" {s['forward_s'] * 1e3:8.2f} {s['backward_s'] * 1e3:8.2f} {s['busy_s']:8.3f} "
                     f"{s['idle_s']:8.3f}")
        if s.get("fits") is False:
            line += "  DOES NOT FIT"
        lines.append(line)
    lay = data["layout"]
    lines.append(f"parameters {data['parameters_total']:,}; activations per layer and micro-batch "
                 f"{data['activation_bytes_per_layer'] / 2**20:.2f} MiB; tp {lay['tp']}{_cp_text(lay)} pp {lay['pp']} "
                 f"dp {lay['dp']} "
                 f"v {lay['virtual']}, {lay['schedule']}, {lay['num_microbatches']} micro-batches of "
                 f"{lay['micro_batch_size']}, partition {','.join(map(str, lay['partition']))}")
    if "fits" in data:
        lines.append(f"fits on {data['cluster']}: {'yes' if data['fits'] else 'NO'}")
    if timed:
        lines.append(f"iteration {data['iteration_time_s']:.4f} s (pipeline {data['pipeline_time_s']:.4f} s), "
                     f"bubble {100 * data['bubble_fraction']:.1f}%, master stage {data['master_stage']}")
    return "\n".join(lines)


def _cp_text(lay: dict) -> str:
    """" cp 2 (p2p)" where a layout splits sequences, else nothing."""
    cp = f" cp {lay['cp']} ({lay['cp_comm_type']})" if lay.get("cp", 1) > 1 else ""
    experts = f" ep {lay['ep']} etp {lay['etp']}" if lay.get("ep", 1) > 1 or lay.get("etp", lay["tp"]) != lay["tp"] else ""
    return cp + experts


# ---- search ------------------------------------------------------------------------------------------------------
def device_peak(spec: RunSpec, cluster: Cluster) -> float | None:
    """The peak FLOP/s of the devices a plan runs on, for its MFU; None where there is no trustworthy one: CPU
    ranks, which share their node's cores (a CPU device type's peak, the best rate a CPU profile measured on its
    MLP units, is neither the machine's peak nor a bound on what other units and micro-batch sizes reach)."""
    if cluster.shares_cores:
        return None
    return sum(cluster.device(g).peak(spec.model.params_dtype) for g in range(spec.world_size))


def prediction(ranked, cluster: Cluster) -> dict:
    """What a plan promises: time, throughput, MFU (model FLOPs, no recomputation, over the devices' peak; None
    on CPU ranks: device_peak) and memory per stage."""
    return evaluation_prediction(ranked.evaluation, cluster, ranked.spec)


def evaluation_prediction(ev: Evaluation, cluster: Cluster, spec: RunSpec | None = None) -> dict:
    """prediction() of a simulated plan (the search's ranked plan, or a plan simulated again on another
    profile: tune's calibrated prediction)."""
    from .search import model_flops

    spec = spec or ev.spec
    sim, pl = ev.simulation, spec.pipeline
    t = sim.iteration_time
    samples = spec.dp * pl.micro_batch_size * pl.num_microbatches
    flops = model_flops(spec.model, samples)
    peak = device_peak(spec, cluster)
    stages = [{"stage": s, "peak_bytes": m.peak_bytes, "allowance_bytes": m.allowance_bytes,
               "static_bytes": m.static_bytes, "activation_bytes": m.activation_bytes,
               "capacity_bytes": stage_capacity(spec, cluster, s), "busy_s": sim.busy[s],
               "forward_s": sum(ev.cost.chunk_forward[s]), "backward_s": sum(ev.cost.chunk_backward[s])}
              for s, m in enumerate(ev.memory)]
    return {"iteration_time_s": t, "pipeline_time_s": sim.pipeline_time, "tokens_per_s": samples * spec.model.seq_length / t,
            "tflops_per_gpu": flops / t / spec.world_size / 1e12, "mfu": flops / t / peak if peak else None,
            "bubble_fraction": sim.bubble_fraction, "stages": stages}


def _layout(spec: RunSpec) -> dict:
    pl = spec.pipeline
    return {"tp": spec.tp, "cp": spec.cp, "cp_comm_type": spec.cp_comm_type, "pp": spec.pp, "dp": spec.dp,
            "ep": spec.ep, "etp": spec.etp, "micro_batch_size": pl.micro_batch_size,
            "num_microbatches": pl.num_microbatches, "schedule": pl.schedule, "virtual": pl.virtual_stages,
            "sequence_parallel": spec.sp, "zero1": spec.distributed_optimizer, "bpipe": pl.bpipe,
            "slicing": pl.slicing, "partition": list(pl.partition),
            "recomputed_units": sum(1 for x in pl.recompute or () if x),
            "unit_strategies": list(spec.unit_strategies) if spec.unit_strategies else None}


def plan_from(ranked, result, profiles, orig_vocab: int | None, engine: EngineConfig = EngineConfig()):
    from .plan import Plan

    spec, cluster = ranked.spec, result.cluster
    predicted = prediction(ranked, cluster)
    if spec.model.moe is not None:  # the routing model the prediction assumed (moe_model.py)
        predicted["moe_load_imbalance"] = ranked.evaluation.cost.experts.imbalance
    divisible = result.make_vocab_size_divisible_by
    if spec.unit_strategies:  # the search pads a hybrid plan's vocabulary for every tp degree up to the stage width
        divisible *= spec.dp
    return Plan(spec=spec, global_batch_size=result.global_batch_size, orig_vocab_size=orig_vocab,
                make_vocab_size_divisible_by=divisible,
                devices=[cluster.device(g).name for g in range(spec.world_size)],
                cluster={"name": cluster.name, "source": cluster.source, "num_gpus": cluster.num_gpus},
                profiles=profiles.identity(), prediction=predicted,
                search={"rank": 1, "notes": ranked.notes, "gains_s": ranked.gains,
                        "stats": {k: v for k, v in result.stats.items()}}, engine=engine)


def search_json(result) -> dict:
    return {"plans": [{"layout": _layout(r.spec), "prediction": prediction(r, result.cluster), "notes": r.notes,
                       "gains_s": r.gains, "estimate_s": r.estimate} for r in result.ranked],
            "stats": result.stats, "cluster": result.cluster.name}


TABLE_FOOTER = ("columns: # = rank; iter s = simulated iteration time; tokens/s; MFU = model FLOPs (no "
                "recomputation) / (time x the devices' peak; - on CPU ranks: no trustworthy peak); "
                "tp, cp (context parallel), pp, dp (MoE models: ep, etp = expert (tensor) parallel); mbs = micro-batch size; m = micro-batches per iteration; schedule (vN: virtual stages); "
                "SP = sequence parallel; Z1 = ZeRO-1 (distributed optimizer); BP = BPipe; K = sliced micro-batches; "
                "rc = recomputed units; mem/cap = the fullest stage's peak memory over its capacity; notes = how much "
                "slower than #1, what slicing / partition refinement / BPipe saved, what is recomputed, and a micro-batch "
                "size beyond those --profile timed (its unit times extrapolated linearly from them)")


def extrapolation_note(beyond: list[int], profiled: int) -> str:
    """The line that says which micro-batch sizes (sorted) lie beyond the largest one a profile timed."""
    these = f"size {beyond[0]} is" if len(beyond) == 1 else f"sizes {', '.join(map(str, beyond))} are"
    measure = sorted({1 << i for i in range(beyond[-1].bit_length())} | set(beyond))
    return (f"note: micro-batch {these} beyond the sizes --profile timed (up to {profiled}): unit times extrapolated "
            f"linearly; to measure them, autoconfig.py profile --profile-micro-batch-sizes {','.join(map(str, measure))}")


def summary_line(st: dict) -> str:
    """The search's counts: layouts = solved + pruned + infeasible, and the same for candidates (a layout with
    one choice of SP, ZeRO-1, recomputation mode and BPipe)."""
    return (f"{st['layouts']} layouts: {st['solved']} solved, {st['pruned']} pruned by their bound, "
            f"{st['infeasible']} infeasible (memory); {st['candidates']} candidates: {st['candidates_solved']} "
            f"solved, {st['candidates_pruned']} pruned, {st['candidates_infeasible']} infeasible; "
            f"{st['simulated']} simulations; {st.get('elapsed_s', 0):.1f} s")


def search_table(result) -> str:
    """The ranked plans: time, throughput, MFU, the layout, the worst stage's memory against its device, notes."""
    moe = result.model.moe is not None
    head = (f"{'#':>2} {'iter s':>8} {'tokens/s':>10} {'MFU':>6} {'tp':>3} {'cp':>3} {'pp':>3} {'dp':>4} "
            + (f"{'ep':>3} {'etp':>3} " if moe else "") + f"{'mbs':>4} {'m':>5} "
            f"{'schedule':<13} {'SP':>2} {'Z1':>2} {'BP':>2} {'K':>2} {'rc':>4} {'mem/cap':>8}  notes")
    lines = [head]
    best = result.ranked[0].time if result.ranked else 0.0
    for i, r in enumerate(result.ranked, 1):
        p = prediction(r, result.cluster)
        lay = _layout(r.spec)
        sched = lay["schedule"] + (f" v{lay['virtual']}" if lay["virtual"] > 1 else "")
        mem = max(s["peak_bytes"] / s["capacity_bytes"] for s in p["stages"])
        notes = list(r.notes)
        if i > 1:
            notes.insert(0, f"+{100 * (r.time / best - 1):.1f}% vs #1")
        for key, label in (("slicing_s", "slicing"), ("refinement_s", "partition refinement"),
                           ("bpipe_s", "BPipe")):
            if r.gains.get(key, 0) > 0:
                notes.append(f"{label} -{100 * r.gains[key] / (r.time + r.gains[key]):.1f}%")
        flag = lambda b: "y" if b else "-"  # noqa: E731
        tp = "hyb" if lay["unit_strategies"] else lay["tp"]  # per-unit strategies: in the notes
        mfu = f"{100 * p['mfu']:5.1f}%" if p["mfu"] is not None else f"{'-':>6}"
        lines.append(f"{i:>2} {r.time:8.4f} {p['tokens_per_s']:10.0f} {mfu} {tp:>3} {lay['cp']:>3} "
                     f"{lay['pp']:>3} {lay['dp']:>4} " + (f"{lay['ep']:>3} {lay['etp']:>3} " if moe else "")
                     + f"{lay['micro_batch_size']:>4} {lay['num_microbatches']:>5} "
                     f"{sched:<13} {flag(lay['sequence_parallel']):>2} {flag(lay['zero1']):>2} {flag(lay['bpipe']):>2} "
                     f"{lay['slicing']:>2} {lay['recomputed_units']:>4} {100 * mem:7.1f}%  {'; '.join(notes)}")
    lines.append(summary_line(result.stats))
    lines.append(TABLE_FOOTER)
    if result.ranked:
        best_r = result.ranked[0]
        lines.append(f"best: partition {','.join(map(str, best_r.spec.pipeline.partition))}")
        profiled = result.stats.get("profiled_micro_batch")
        sizes = {r.spec.pipeline.micro_batch_size for r in result.ranked}
        beyond = sorted(b for b in sizes if profiled and b > profiled)
        if beyond:
            lines.append(extrapolation_note(beyond, profiled))
    return "\n".join(lines)
