"""The planner's command-line flags (model flags as pretrain_gpt.py's, plus --cluster, --profile, ...) turned into
planner objects: cluster, profiles, memory and cost settings, a RunSpec; the search on parsed flags and the
plan files it writes. Used by tools/autoconfig.py (cli/autoconfig.py) and the trials."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Callable

from .arguments import add_megatron_args, check_flags, configs_from_args, model_config_from_args
from .config import ModelConfig, RunConfig
from .config.planner import ENGINE, PLANNER, TIMING, PlannerConfig
from .config.schema import add_flags, from_flags, int_list
from .errors import OneLineParser, UsageError
from .paths import check_output_dir
from .pipeline.slicing import choose_slices, stage_times_from_cost
from .planner.cluster import BUILTIN, Cluster, load_cluster, local_cluster
from .planner.cost_model import CostModel, CostSettings
from .planner.cuda_allowance import DerivedAllowance
from .planner.engine import OURS, EngineConfig, engine_from_flags
from .planner.memory_model import MemorySettings
from .planner.profile_data import Profile, Profiles
from .planner.spec import spec_from_run_config



def add_model_type_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model type")
    g.add_argument("--model-type", choices=["gpt", "bert"], default="gpt",
                   help="plan for pretrain_gpt.py (default) or pretrain_bert.py")
    g.add_argument("--bert-no-binary-head", dest="bert_binary_head", action="store_false",
                   help="with --model-type bert: no sentence-order head")
    p.set_defaults(bert_binary_head=True)


def add_planner_args(p: argparse.ArgumentParser, timed: bool) -> None:
    """The planner's flags (config/planner.py); `timed`: with the cost model's (simulate, search)."""
    add_model_type_args(p)
    add_flags(p, {}, [PlannerConfig], lambda group: group in (PLANNER, ENGINE) or (timed and group == TIMING))


def build_autoconfig_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="autoconfig.py", description="megatron_bmw planner: memory, simulation, profiling",
                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, timed, help_text in (("estimate", False, "memory per pipeline stage and whether it fits"),
                                   ("simulate", True, "simulate one iteration on a cluster")):
        p = sub.add_parser(name, help=help_text, allow_abbrev=False)
        add_megatron_args(p)
        add_planner_args(p, timed)
        p.set_defaults(mock_data=True, vocab_size=50257)
    p = sub.add_parser("search", help="the fastest plan that fits, and the runner-ups", allow_abbrev=False,
                       epilog="Output: the ranked plans (their columns are named in the table's footer), then one "
                              "line of counts: layouts = solved + pruned by their bound + infeasible, and the same "
                              "for candidates (a layout with one choice of SP, ZeRO-1, recomputation mode and BPipe),"
                              " which the progress bar counts.")
    add_megatron_args(p)
    add_planner_args(p, True)
    p.set_defaults(mock_data=True, vocab_size=50257)
    g = p.add_argument_group("search")
    g.add_argument("--top-k", type=int, default=5, help="plans in the table")
    g.add_argument("--output", default=None, help="write the best plan (JSON) for pretrain_gpt.py --plan")
    g.add_argument("--output-dir", default=None,
                   help="write the top-k plans as DIR/plan_1.json ... (best first; stale plan_N.json beyond k are "
                        "removed) for tools/grid_search.py --plans DIR")
    g.add_argument("--space", action="append", default=[],
                   help="restrict a dimension, e.g. tp=1,2 pp=4 mbs=1,2 schedule=1f1b virtual=2 sp=off zero1=on "
                        "bpipe=off slicing=off recompute=none,full recompute-granularity=uniform partition=layer")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p = sub.add_parser("profile", help="measure unit times, saved bytes and links on this machine",
                       allow_abbrev=False)
    add_megatron_args(p)
    add_model_type_args(p)
    p.set_defaults(mock_data=True, vocab_size=50257)
    g = p.add_argument_group("profiler")
    g.add_argument("--output", required=True, help="profile JSON to write")
    g.add_argument("--profile-micro-batch-sizes", type=int_list("--profile-micro-batch-sizes"), default=(1, 2, 4))
    g.add_argument("--profile-tp", type=int_list("--profile-tp"), default=(1,))
    g.add_argument("--profile-repeats", type=int, default=5)
    g.add_argument("--profile-warmup", type=int, default=2)
    g.add_argument("--profile-rounds", type=int, default=1, help="sweeps over all entries (spreads samples in time)")
    g.add_argument("--profile-statistic", choices=["median", "min"], default="median")
    g.add_argument("--threads", type=int, default=1, help="CPU threads per process while timing")
    g.add_argument("--no-links", action="store_true", help="skip the p2p/all-reduce measurement")
    g.add_argument("--analytic", action="store_true", help="write FLOPs / (peak x fraction) times instead")
    g.add_argument("--cluster", default=None, help="with --analytic: the cluster whose device type to use")
    g.add_argument("--device-type", default=None,
                   help="the cluster device type this profile is for (with --analytic: which of the cluster's)")
    g.add_argument("--achievable-fraction", type=float, default=None,
                   help="with --analytic: of peak FLOP/s (default: the device type's, else 0.5)")
    sub.add_parser("tune", add_help=False, help="profile, search, measure the top plans, calibrate, re-search: the "
                                                "measured best plan (its own flags: autoconfig.py tune --help)")
    p = sub.add_parser("calibrate", help="fit the cost model to measured trials (tools/grid_search.py results)",
                       allow_abbrev=False)
    p.add_argument("--results", required=True, help="results JSONL written by tools/grid_search.py")
    p.add_argument("--profile", action="append", default=[], help="the profile to calibrate (default: analytic)")
    p.add_argument("--cluster", default="local", help="the cluster the trials ran on (name or YAML)")
    p.add_argument("--output", required=True, help="calibrated profile JSON to write (for search --profile)")
    p.add_argument("--overlap-factor", type=float, default=None,
                   help="overlap factor to start from (default: the profile's, else 1.3)")
    p.add_argument("--achievable-fraction", type=float, default=None, help="for the analytic start")
    return parser


# The flat CUDA allowance used before it was derived (cuda_allowance.py); benchmarks report against it.
CUDA_WORKSPACE_GB = 1.5
CUDA_FRAGMENTATION = 0.10


def load_profiles(paths: list[str]) -> Profiles:
    return Profiles([Profile.load(path) for path in paths])


def cluster_from(planner: PlannerConfig, profiles: Profiles, placeholder_ok: bool = False) -> Cluster:
    """The cluster of --cluster: `local` is this machine as a measured profile describes it; without one it is
    refused (its built-in figures are placeholders) unless `placeholder_ok` (trial predictions shown beside the
    measurements)."""
    measured = [p for ps in profiles.by_type.values() for p in ps if p.mode == "measured"]
    if planner.cluster == "local" and measured:
        profile = measured[0]
        gpus = planner.world_size or 2
        p2p = profile.link("p2p")
        if p2p is None:
            raise UsageError(f"--profile {profile.source}: no measured links (profiled with --no-links); "
                             "use another --cluster")
        memory = float(profile.device.get("memory_bytes") or load_cluster("local").groups[0].device.memory_bytes)
        cores = profile.cores() if profile.device.get("kind") == "cpu" else None  # CPU ranks share the cores
        if cores is not None:  # and the host's memory: each rank's capacity is its share
            memory /= gpus
        return local_cluster(gpus, profile.device_type(memory), p2p, profile.link("allreduce"), cores)
    if planner.cluster == "local" and not placeholder_ok:  # plans on placeholder figures would look real and be wrong
        raise UsageError("--cluster local: this machine has not been measured; run `python tools/autoconfig.py "
                         "profile --output prof.json <the same model flags>` and add --profile prof.json (or name a "
                         f"described cluster: {', '.join(b for b in BUILTIN if b != 'local')}, or a YAML file)")
    return measured_links(planner, load_cluster(planner.cluster, planner.num_nodes))


def measured_links(planner: PlannerConfig, cluster: Cluster) -> Cluster:
    """`cluster` with the bus bandwidths the flags give (--inter-node-bus-bandwidth, --intra-node-bus-bandwidth)."""
    inter, intra = planner.inter_node_bus_bandwidth, planner.intra_node_bus_bandwidth
    if inter is None and intra is None:
        return cluster
    return cluster.with_bus_bandwidth(None if inter is None else inter * 1e9, None if intra is None else intra * 1e9)


def engine_of(planner: PlannerConfig, gradient_accumulation_fusion: bool = True) -> EngineConfig:
    """The engine whose memory the planner counts (`gradient_accumulation_fusion`: the run's flag)."""
    return engine_from_flags(planner.engine, planner.accumulate_allreduce_grads_in_fp32, planner.grad_reduce_in_bf16,
                             planner.tp_comm_overlap, gradient_accumulation_fusion)


ENGINE_FLAGS = ("engine", "accumulate_allreduce_grads_in_fp32", "grad_reduce_in_bf16", "tp_comm_overlap",
                "gradient_accumulation_fusion")


def plan_from_args(args, argv: list[str], parser: argparse.ArgumentParser):
    """estimate/simulate --plan: the plan file, every flag given beside it checked against it (the engine's too);
    None without --plan. `parser`: the subcommand's."""
    if not args.plan:
        return None
    from .plan_overlay import check_flags_against_plan, given_flags
    from .planner.plan import Plan

    plan = Plan.load(args.plan)
    given = given_flags(argv, parser)
    check_flags_against_plan(args, given, plan)
    engine_given = [given[d] for d in ENGINE_FLAGS if d in given]
    mine = engine_of(planner_config(args), args.gradient_accumulation_fusion)
    if engine_given and mine != plan.engine:
        raise UsageError(f"{' '.join(engine_given)}: engine {mine.describe()} disagrees with --plan {args.plan} "
                         f"(engine {plan.engine.describe()})")
    for dest, value in (("rank_order", plan.spec.rank_order), ("model_type", plan.spec.model.model_type)):
        if dest in given and getattr(args, dest) != value:
            raise UsageError(f"{given[dest]} {getattr(args, dest)} disagrees with --plan {args.plan} ({value})")
    return plan


def subcommand_parser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand `name` (its flags name the dests a plan is checked against)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def planned_spec(plan_path: str, plan, planner: PlannerConfig, cluster: Cluster):
    """The RunSpec of the plan at `plan_path` on `cluster`; the planner's --world-size must agree."""
    spec, where = plan.spec, f"--plan {plan_path}"
    if planner.world_size is not None and planner.world_size != spec.world_size:
        raise UsageError(f"--world-size {planner.world_size} disagrees with {where} ({spec.world_size} ranks: "
                         f"{spec.describe_degrees()})")
    if spec.world_size > cluster.num_gpus:
        raise UsageError(f"{where} needs {spec.world_size} GPUs ({spec.describe_degrees()}) but "
                         f"cluster {cluster.name} has {cluster.num_gpus} (--num-nodes resizes it)")
    return spec


def memory_settings(planner: PlannerConfig, profiles: Profiles, cluster: Cluster | None = None,
                    engine: EngineConfig | None = None) -> MemorySettings:
    """The planner's memory settings (`engine`: a plan's, else the planner's). On cuda the allowance is derived per
    layout on the cluster's device types (cuda_allowance.py; no cluster: the default device), the profiles'
    measured CUDA memory replacing its terms; an explicit workspace or fragmentation (flags, else a calibrated
    profile) replaces the derived one. On the CPU: the flags, else a calibrated profile, else what a CPU profile
    measured a training process to hold beyond its tensors (host_memory), else none."""
    device = planner.memory_device
    if device is None:
        cpu = any(p.device.get("kind") == "cpu" for ps in profiles.by_type.values() for p in ps)
        device = "cpu" if cpu and planner.cluster == "local" else "cuda"
    workspace = planner.memory_workspace_gb
    fragmentation = planner.memory_fragmentation
    if workspace is None and profiles.memory_workspace_bytes is not None:  # calibrated
        workspace = profiles.memory_workspace_bytes / 2**30
    if fragmentation is None and profiles.memory_fragmentation is not None:
        fragmentation = profiles.memory_fragmentation
    host = profiles.host_memory() if device == "cpu" else None
    if host is not None:  # measured by a CPU profile (training/host_memory.py)
        workspace = host[0] / 2**30 if workspace is None else workspace
        fragmentation = host[1] if fragmentation is None else fragmentation
    derived = None
    if device == "cuda" and (workspace is None or fragmentation is None):
        devices = tuple({id(g.device): g.device for g in cluster.groups}.values()) if cluster is not None else ()
        if planner.cuda_context_gb is not None:
            devices = tuple(replace(d, cuda_context_bytes=planner.cuda_context_gb * 2**30) for d in devices)
        derived = DerivedAllowance(devices, profiles.measured_cuda_memory(),
                                   None if workspace is None else workspace * 2**30, fragmentation)
    return MemorySettings(device=device, workspace_bytes=(workspace or 0.0) * 2**30, fragmentation=fragmentation or 0.0,
                          engine=engine or engine_of(planner), derived=derived,
                          moe_imbalance=planner.moe_load_imbalance)


def spec_from_flags(args, planner: PlannerConfig, cluster: Cluster, profiles: Profiles,
                    costs: CostSettings = CostSettings()):
    """The RunSpec the model flags (`args`) describe on `cluster`, with the planner's world size and rank order."""
    world = planner.world_size or cluster.num_gpus
    if world < 1:
        raise UsageError(f"--world-size must be >= 1, got {world}")
    if world > cluster.num_gpus:
        raise UsageError(f"--world-size {world} exceeds the {cluster.num_gpus} GPUs of cluster {cluster.name}")
    return spec_of_run(configs_from_args(args, world), world, planner.rank_order, cluster, profiles, costs)


def spec_of_run(cfg: RunConfig, world: int, rank_order: str, cluster: Cluster, profiles: Profiles,
                costs: CostSettings = CostSettings()):
    """A run's RunSpec for the planner: its rank order (BPipe's pairs win) and, for --microbatch-slicing auto,
    AutoPipe's slicer on the cost model's stage times."""
    if not cfg.pipeline.bpipe and rank_order != cfg.parallel.rank_order:
        cfg.parallel.rank_order = rank_order
    if cfg.pipeline.slicing == "auto":
        plain = spec_from_run_config(replace(cfg, pipeline=replace(cfg.pipeline, slicing=0)), world)
        cost = CostModel(plain, cluster, profiles, costs)
        f, b, c = stage_times_from_cost(cost.compute_time, cost.transfer_time, plain.pp,
                                        plain.pipeline.virtual_stages)
        cfg.pipeline.slicing = choose_slices(f, b, c, plain.pipeline.num_microbatches)
    return spec_from_run_config(cfg, world)


def cost_settings(planner: PlannerConfig, profiles: Profiles | None = None, plan=None,
                  model_of: Callable[[], ModelConfig] | None = None, engine: EngineConfig | None = None) -> CostSettings:
    """The planner's cost settings for the model `model_of` gives, where the host's operators are counted (with
    `plan`: its model and engine; else `engine`, by default the planner's); the overlap factor, when not given,
    from the profiles (calibrated), else 1.3."""
    overlap = planner.overlap_factor
    if overlap is None:
        overlap = (profiles.overlap_factor if profiles is not None else None) or CostSettings().overlap_factor
    engine = plan.engine if plan is not None else engine or engine_of(planner)
    host = {}
    if planner.host_op_us is not None:
        host["host_op_s"] = planner.host_op_us * 1e-6
    # the host's time per operator is measured for our runtime: its analytic unit times take at least it (or,
    # with blocking launches, add it); other engines' hosts are not measured, so only where asked for
    if planner.cuda_launch_blocking or (engine.name == OURS and not profiles):
        from .models.op_count import unit_op_counts

        model = plan.spec.model if plan is not None else model_of()
        host.update(launch_blocking=planner.cuda_launch_blocking,
                    host_ops=tuple((k, f, b) for k, (f, b) in unit_op_counts(model).items()))
    elif planner.host_op_us is not None and engine.name == OURS:
        raise UsageError("--host-op-us applies to analytic unit times; a profile's times hold the host already")
    elif planner.host_op_us is not None:
        raise UsageError(f"--host-op-us: engine {engine.name}'s host is not modelled (our runtime's is, and any "
                         "engine's with --cuda-launch-blocking)")
    return CostSettings(achievable_fraction=planner.achievable_fraction, bandwidth_fraction=planner.bandwidth_fraction,
                        overlap_factor=overlap, engine=engine, moe_imbalance=planner.moe_load_imbalance, **host)


def run_search(args, progress: bool | None = None):
    """The search of `autoconfig.py search` on parsed flags: (SearchResult, Profiles, the vocabulary before padding)."""
    from .planner.search import SearchSettings, search
    from .planner.space import SearchSpace

    if args.top_k < 1:
        raise UsageError(f"--top-k must be >= 1, got {args.top_k}")
    if args.global_batch_size is None:
        raise UsageError("search needs --global-batch-size")
    planner = planner_config(args)
    profiles = load_profiles(planner.profile)
    cluster = cluster_from(planner, profiles)
    engine = engine_of(planner, args.gradient_accumulation_fusion)
    space = SearchSpace.parse(args.space).for_engine(engine.name)
    settings = memory_settings(planner, profiles, cluster, engine)
    world = planner.world_size or cluster.num_gpus
    model, orig_vocab = serial_model(args)
    if progress is None:
        progress = not args.no_progress and not args.json
    result = search(model, orig_vocab, args.make_vocab_size_divisible_by, args.global_batch_size,
                    cluster, profiles, space, cost_settings(planner, profiles, model_of=lambda: model, engine=engine), settings,
                    SearchSettings(world_size=world, top_k=args.top_k, progress=progress))
    if result.best is None:
        raise UsageError(f"no plan fits: every layout of the space runs out of memory on cluster {cluster.name} "
                         "(try more GPUs, a smaller --global-batch-size, or relax --space)")
    return result, profiles, orig_vocab


def write_plans(result, profiles: Profiles, orig_vocab_size: int, out_dir: str, top_k: int,
                engine: EngineConfig = EngineConfig()) -> list[str]:
    """The top-k plans of `result` as out_dir/plan_1.json ... (best first, each with its search rank), numbered
    with as many digits as k needs; plan_N.json files beyond them (an earlier, longer search) are removed.
    Returns the paths written."""
    import os
    import re

    from .planner.report import plan_from

    check_output_dir("--output-dir", out_dir)
    ranked = result.ranked[:top_k]
    width = len(str(len(ranked)))
    paths = []
    for i, r in enumerate(ranked, 1):
        plan = plan_from(r, result, profiles, orig_vocab_size, engine)
        plan.search["rank"] = i
        path = os.path.join(out_dir, f"plan_{i:0{width}d}.json")
        plan.save(path)
        paths.append(path)
    kept = {os.path.basename(p) for p in paths}
    for name in os.listdir(out_dir):
        if re.fullmatch(r"plan_\d+\.json", name) and name not in kept:
            os.remove(os.path.join(out_dir, name))
    return paths


def planner_config(args) -> PlannerConfig:
    """The planner's settings from autoconfig.py's parsed flags."""
    return from_flags(PlannerConfig, args)


def serial_model(args) -> tuple:
    """The model alone, as the search reads it from the flags (one rank: the vocabulary padded for tp 1), and the
    vocabulary before padding; the flags' own values checked first."""
    check_flags(args)
    return model_config_from_args(args, 1)
