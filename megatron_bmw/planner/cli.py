"""tools/autoconfig.py: estimate memory, simulate an iteration, or profile this machine.

    autoconfig.py estimate --cluster a100-80g-ib --num-nodes 2 <pretrain_gpt.py flags> [--json]
    autoconfig.py simulate --cluster FILE.yaml [--profile prof.json] <flags> [--json] [--timeline out.png]
    autoconfig.py profile --output prof.json <model flags> [--profile-tp 1,2] [--analytic --cluster NAME]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from ..arguments import _Parser, add_megatron_args, configs_from_args, parse_args
from ..errors import UsageError, exit_on_usage_error
from .cluster import BUILTIN, Cluster, load_cluster, local_cluster
from ..pipeline.slicing import choose_slices, stage_times_from_cost
from .cost_model import CostModel, CostSettings
from .evaluate import estimate_memory, simulate_run
from .memory_model import MemorySettings
from .profile_data import Profile
from .report import estimate_json, memory_table, simulate_json
from .spec import spec_from_run_config


def _ints(flag: str):
    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} expects comma-separated integers, got {text!r}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag} expects positive integers, got {text!r}")
        return values

    return parse


def _planner_args(p: argparse.ArgumentParser, timed: bool) -> None:
    g = p.add_argument_group("planner")
    g.add_argument("--cluster", default="local", help=f"built-in ({', '.join(BUILTIN)}) or a YAML file")
    g.add_argument("--num-nodes", type=int, default=None, help="resize a single-group cluster")
    g.add_argument("--world-size", type=int, default=None, help="GPUs used (default: all of the cluster)")
    g.add_argument("--profile", default=None, help="profile JSON (autoconfig.py profile); else analytic times")
    g.add_argument("--rank-order", choices=["tp-dp-pp", "bpipe"], default="tp-dp-pp")
    g.add_argument("--memory-device", choices=["cuda", "cpu"], default=None,
                   help="kernel behaviour the activation count follows (default: cpu only for a local CPU profile)")
    g.add_argument("--memory-workspace-gb", type=float, default=0.0, help="fixed allowance per GPU")
    g.add_argument("--memory-fragmentation", type=float, default=0.0, help="fractional allowance on top")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    if timed:
        g.add_argument("--achievable-fraction", type=float, default=0.5, help="of peak FLOP/s (analytic times)")
        g.add_argument("--overlap-factor", type=float, default=1.3, help="slowdown of overlapped DP sync")
        g.add_argument("--timeline", default=None, help="write the simulated timeline as a PNG")


def build_autoconfig_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autoconfig.py", description="megatron_bmw planner: memory, simulation, profiling",
                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, timed, help_text in (("estimate", False, "memory per pipeline stage and whether it fits"),
                                   ("simulate", True, "simulate one iteration on a cluster")):
        p = sub.add_parser(name, help=help_text, allow_abbrev=False)
        add_megatron_args(p)
        _planner_args(p, timed)
        p.set_defaults(mock_data=True, vocab_size=50257)
    p = sub.add_parser("profile", help="measure unit times, saved bytes and links on this machine",
                       allow_abbrev=False)
    add_megatron_args(p)
    p.set_defaults(mock_data=True, vocab_size=50257)
    g = p.add_argument_group("profiler")
    g.add_argument("--output", required=True, help="profile JSON to write")
    g.add_argument("--profile-micro-batch-sizes", type=_ints("--profile-micro-batch-sizes"), default=(1, 2, 4))
    g.add_argument("--profile-tp", type=_ints("--profile-tp"), default=(1,))
    g.add_argument("--profile-repeats", type=int, default=5)
    g.add_argument("--profile-warmup", type=int, default=2)
    g.add_argument("--profile-rounds", type=int, default=1, help="sweeps over all entries (spreads samples in time)")
    g.add_argument("--profile-statistic", choices=["median", "min"], default="median")
    g.add_argument("--threads", type=int, default=1, help="CPU threads per process while timing")
    g.add_argument("--no-links", action="store_true", help="skip the p2p/all-reduce measurement")
    g.add_argument("--analytic", action="store_true", help="write FLOPs / (peak x fraction) times instead")
    g.add_argument("--cluster", default=None, help="with --analytic: the cluster whose device type to use")
    g.add_argument("--device-type", default=None, help="with --analytic: which of the cluster's device types")
    g.add_argument("--achievable-fraction", type=float, default=0.5)
    return parser


def _cluster(args, profile: Profile | None) -> Cluster:
    if args.cluster == "local" and profile is not None and profile.mode == "measured":
        gpus = args.world_size or 2
        p2p = profile.link("p2p")
        if p2p is None:
            raise UsageError(f"--profile {args.profile}: no measured links (profiled with --no-links); "
                             "use another --cluster")
        memory = float(profile.device.get("memory_bytes") or load_cluster("local").groups[0].device.memory_bytes)
        return local_cluster(gpus, profile.device_type(memory), p2p, profile.link("allreduce"))
    return load_cluster(args.cluster, args.num_nodes)


def _memory_settings(args, profile: Profile | None) -> MemorySettings:
    device = args.memory_device
    if device is None:
        device = "cpu" if profile is not None and profile.device.get("kind") == "cpu" and args.cluster == "local" \
            else "cuda"
    return MemorySettings(device=device, workspace_bytes=args.memory_workspace_gb * 2**30,
                          fragmentation=args.memory_fragmentation)


def _spec(args, cluster: Cluster, profile: Profile | None = None, costs: CostSettings = CostSettings()):
    world = args.world_size or cluster.num_gpus
    if world < 1:
        raise UsageError(f"--world-size must be >= 1, got {world}")
    if world > cluster.num_gpus:
        raise UsageError(f"--world-size {world} exceeds the {cluster.num_gpus} GPUs of cluster {cluster.name}")
    cfg = configs_from_args(args, world)  # also checks --bpipe and --microbatch-slicing
    bpipe, slicing = cfg.train.bpipe, cfg.train.microbatch_slicing
    order = cfg.parallel.rank_order if bpipe else args.rank_order
    spec = spec_from_run_config(cfg, world, order, bpipe, 0 if slicing == "auto" else slicing)
    if slicing == "auto":  # AutoPipe's slicer on the cost model's stage times
        cost = CostModel(spec, cluster, profile, costs)
        f, b, c = stage_times_from_cost(cost.compute_time, cost.transfer_time, spec.pp, spec.virtual)
        spec = replace(spec, slicing=choose_slices(f, b, c, spec.num_microbatches))
    return spec


def _estimate(args) -> int:
    profile = Profile.load(args.profile) if args.profile else None
    cluster = _cluster(args, profile)
    spec = _spec(args, cluster, profile)
    settings = _memory_settings(args, profile)
    memory = estimate_memory(spec, settings=settings)
    data = estimate_json(spec, memory, cluster, settings)
    print(json.dumps(data) if args.json else memory_table(data))
    return 0


def _simulate(args) -> int:
    profile = Profile.load(args.profile) if args.profile else None
    cluster = _cluster(args, profile)
    costs = CostSettings(achievable_fraction=args.achievable_fraction, overlap_factor=args.overlap_factor)
    spec = _spec(args, cluster, profile, costs)
    settings = _memory_settings(args, profile)
    ev = simulate_run(spec, cluster, profile, costs, settings, record_transfers=bool(args.timeline))
    data = simulate_json(ev, cluster, settings)
    if args.timeline:
        from .timeline import render_timeline

        render_timeline(ev.simulation, args.timeline)
    if args.json:
        print(json.dumps(data))
    else:
        print(memory_table(data))
        if args.timeline:
            print(f"timeline written to {args.timeline}")
    return 0


def _profile(args) -> int:
    from .profiler import ProfileSettings, analytic_profile, run_profile

    cfg = configs_from_args(args, args.tensor_model_parallel_size)
    settings = ProfileSettings(micro_batch_sizes=args.profile_micro_batch_sizes, tp_sizes=args.profile_tp,
                               warmup=args.profile_warmup, repeats=args.profile_repeats, threads=args.threads,
                               links=not args.no_links, rounds=args.profile_rounds,
                               statistic=args.profile_statistic)
    if args.analytic:
        if not args.cluster:
            raise UsageError("--analytic needs --cluster to name the device type's peak FLOP/s")
        cluster = load_cluster(args.cluster)
        types = {g.device.name: g.device for g in cluster.groups}
        name = args.device_type or next(iter(types))
        if name not in types:
            raise UsageError(f"--device-type {name} is not in cluster {cluster.name} ({', '.join(types)})")
        profile = analytic_profile(cfg.model, types[name], settings, args.achievable_fraction)
    else:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        profile = run_profile(cfg.model, settings, cfg.parallel.sequence_parallel)
    profile.save(args.output)
    print(f"profile of {len(profile.units)} unit timings ({profile.mode}, {profile.device.get('name')}) "
          f"written to {args.output}")
    return 0


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    parser = build_autoconfig_parser()
    args = parse_args(list(sys.argv[1:] if argv is None else argv), parser)
    return {"estimate": _estimate, "simulate": _simulate, "profile": _profile}[args.command](args)
