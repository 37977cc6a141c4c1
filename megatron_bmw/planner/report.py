"""Planner output: JSON objects and text tables for estimate and simulate."""

from __future__ import annotations

from .cluster import Cluster
from .evaluate import Evaluation, stage_capacity
from .memory_model import MemorySettings, RankMemory, layer_activation_bytes, total_parameters
from .spec import RunSpec

GiB = 2**30


def _layer_recompute(spec: RunSpec) -> str | None:
    return spec.model.recompute_granularity


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
        "activation_bytes_per_layer": layer_activation_bytes(spec.model, spec.micro_batch_size, spec.tp, spec.sp,
                                                             _layer_recompute(spec), settings.device),
        "layout": {"tp": spec.tp, "pp": spec.pp, "dp": spec.dp, "virtual": spec.virtual,
                   "micro_batch_size": spec.micro_batch_size, "num_microbatches": spec.num_microbatches,
                   "schedule": spec.schedule, "partition": list(spec.partition),
                   "sequence_parallel": spec.sp, "bpipe": spec.bpipe, "sliced_microbatches": spec.slicing},
        "stages": stages,
    }
    if cluster is not None:
        out["cluster"] = cluster.name
        out["fits"] = all(s["fits"] for s in stages)
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
                 f"{data['activation_bytes_per_layer'] / 2**20:.2f} MiB; tp {lay['tp']} pp {lay['pp']} dp {lay['dp']} "
                 f"v {lay['virtual']}, {lay['schedule']}, {lay['num_microbatches']} micro-batches of "
                 f"{lay['micro_batch_size']}, partition {','.join(map(str, lay['partition']))}")
    if "fits" in data:
        lines.append(f"fits on {data['cluster']}: {'yes' if data['fits'] else 'NO'}")
    if timed:
        lines.append(f"iteration {data['iteration_time_s']:.4f} s (pipeline {data['pipeline_time_s']:.4f} s), "
                     f"bubble {100 * data['bubble_fraction']:.1f}%, master stage {data['master_stage']}")
    return "\n".join(lines)
