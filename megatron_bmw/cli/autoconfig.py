"""tools/autoconfig.py: search for a plan, estimate memory, simulate an iteration, or profile this machine.

autoconfig.py search --cluster a100-80g-ib --num-nodes 2 <model flags> --global-batch-size 512 \
    [--profile a.json --profile b.json] [--top-k 5] [--space tp=1,2 --space bpipe=off] --output plan.json \
    [--output-dir plans/]   # the top-k plans as plans/plan_1.json ... (tools/grid_search.py --plans plans/)
autoconfig.py estimate --cluster a100-80g-ib --num-nodes 2 <pretrain_gpt.py flags> [--json]
autoconfig.py simulate --cluster FILE.yaml [--profile prof.json] <flags> [--json] [--timeline out.png]
autoconfig.py simulate|estimate --cluster a100-80g-ib --plan plan.json   # a plan file, on this cluster
autoconfig.py profile --output prof.json <model flags> [--profile-tp 1,2] [--analytic --cluster NAME]
autoconfig.py calibrate --results results.jsonl [--profile prof.json] --output calibrated.json
"""

from __future__ import annotations

import json
import sys

from ..arguments import parse_args
from ..errors import UsageError, exit_on_usage_error
from ..paths import check_output_dir, check_output_file
from ..planner.cost_model import CostSettings
from ..planner.evaluate import estimate_memory, simulate_run
from ..planner.report import estimate_json, extrapolation_note, memory_table, simulate_json
from ..planner_args import (build_autoconfig_parser, cluster_from, cost_settings, engine_of, load_profiles,
                            memory_settings, plan_from_args, planned_spec, planner_config, run_search, serial_model,
                            spec_from_flags, subcommand_parser, write_plans)
from .profile_commands import profile_command, run_calibrate


def _planner(args, plan):
    """The planner's settings, profiles, cluster and engine (a plan's own, else the flags')."""
    planner = planner_config(args)
    profiles = load_profiles(planner.profile)
    engine = plan.engine if plan else engine_of(planner, args.gradient_accumulation_fusion)
    return planner, profiles, cluster_from(planner, profiles), engine


def _estimate(args, plan) -> int:
    planner, profiles, cluster, engine = _planner(args, plan)
    spec = planned_spec(args.plan, plan, planner, cluster) if plan else spec_from_flags(args, planner, cluster, profiles)
    settings = memory_settings(planner, profiles, cluster, engine)
    memory = estimate_memory(spec, settings=settings)
    data = estimate_json(spec, memory, cluster, settings)
    print(json.dumps(data) if args.json else memory_table(data))
    return 0


def _simulated(args, plan):
    """(Evaluation, cluster, memory settings, profiles) of `simulate`'s parsed flags."""
    planner, profiles, cluster, engine = _planner(args, plan)
    costs = cost_settings(planner, profiles, plan, model_of=lambda: serial_model(args)[0], engine=engine)
    spec = planned_spec(args.plan, plan, planner, cluster) if plan else \
        spec_from_flags(args, planner, cluster, profiles, costs)
    settings = memory_settings(planner, profiles, cluster, engine)
    ev = simulate_run(spec, cluster, profiles, costs, settings, record_transfers=bool(args.timeline))
    return ev, cluster, settings, profiles


def simulate_flags(argv: list[str]):
    """`autoconfig.py simulate ARGV` without the printing: (Evaluation, cluster, memory settings). Benchmarks that
    check the planner against published runs go through it, so they use only what the command line offers."""
    parser = build_autoconfig_parser()
    args = parse_args(["simulate"] + list(argv), parser)
    return _simulated(args, plan_from_args(args, argv, subcommand_parser(parser, "simulate")))[:3]


def spec_flags(argv: list[str]):
    """The RunSpec `autoconfig.py simulate ARGV` would simulate (a plan-less run), without simulating it."""
    args = parse_args(["simulate"] + list(argv), build_autoconfig_parser())
    planner = planner_config(args)
    profiles = load_profiles(planner.profile)
    return spec_from_flags(args, planner, cluster_from(planner, profiles), profiles)


def _simulate(args, plan) -> int:
    check_output_file("--timeline", args.timeline)
    ev, cluster, settings, profiles = _simulated(args, plan)
    spec = ev.spec
    data = simulate_json(ev, cluster, settings)
    if args.timeline:
        from ..planner.timeline import render_timeline

        render_timeline(ev.simulation, args.timeline)
    profiled = profiles.largest_micro_batch()
    b = spec.pipeline.micro_batch_size
    if profiled and b > profiled:
        data["extrapolated_micro_batch"] = {"micro_batch_size": b, "profiled_up_to": profiled}
    if args.json:
        print(json.dumps(data))
    else:
        print(memory_table(data))
        if "extrapolated_micro_batch" in data:
            print(extrapolation_note([b], profiled))
        if args.timeline:
            print(f"timeline written to {args.timeline}")
    return 0


def _search(args) -> int:
    from ..planner.report import plan_from, search_json, search_table

    check_output_file("--output", args.output)
    check_output_file("--timeline", args.timeline)
    check_output_dir("--output-dir", args.output_dir)
    result, profiles, orig_vocab = run_search(args)
    engine = engine_of(planner_config(args), args.gradient_accumulation_fusion)
    plan = plan_from(result.best, result, profiles, orig_vocab, engine)
    if args.output:
        plan.save(args.output)
    written = write_plans(result, profiles, orig_vocab, args.output_dir, args.top_k, engine) \
        if args.output_dir else []
    if args.timeline:
        from ..planner.timeline import render_timeline

        render_timeline(result.best.evaluation.simulation, args.timeline)
    if args.json:
        print(json.dumps(search_json(result)))
    else:
        print(search_table(result))
        if args.output and not engine.runs_here:
            print(f"plan written to {args.output}, for engine {engine.describe()} (this runtime's pretrain_"
                  f"{args.model_type}.py refuses it)")
        elif args.output:
            print(f"plan written to {args.output}: run it with pretrain_{args.model_type}.py --plan {args.output}")
        if written:
            print(f"{len(written)} plans written to {args.output_dir} (plan_1.json is the best): run them with "
                  f"tools/grid_search.py --plans {args.output_dir}")
        if args.timeline:
            print(f"timeline of the best plan written to {args.timeline}")
    return 0


def _calibrate(args) -> int:
    check_output_file("--output", args.output)
    overlap = args.overlap_factor
    if overlap is None:
        overlap = load_profiles(args.profile).overlap_factor or CostSettings().overlap_factor
    costs = CostSettings(achievable_fraction=args.achievable_fraction, overlap_factor=overlap)
    print(run_calibrate(args.results, args.cluster, args.profile, args.output, costs))
    return 0


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tune"]:  # tune parses its own flags and passes the rest to its trials
        from .tune import main as tune

        return tune(argv[1:])
    parser = build_autoconfig_parser()
    args = parse_args(argv, parser)
    if args.command in ("estimate", "simulate"):
        plan = plan_from_args(args, argv, subcommand_parser(parser, args.command))
        return (_estimate if args.command == "estimate" else _simulate)(args, plan)
    if getattr(args, "plan", None):
        raise UsageError(f"--plan: {args.command} does not read a plan file (estimate and simulate do; "
                         "search writes one with --output)")
    return {"profile": profile_command, "search": _search, "calibrate": _calibrate}[args.command](args)
