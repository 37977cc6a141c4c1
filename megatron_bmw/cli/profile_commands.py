"""The autoconfig.py subcommands that write a profile, which tune (tune.py) runs too: `profile_command` measures this
machine (or writes an analytic profile), `run_calibrate` fits one to measured trials."""

from __future__ import annotations

from ..errors import UsageError
from ..paths import check_output_file
from ..planner.calibrate import calibrate, calibrated_profile_json, calibration_table
from ..planner.cluster import load_cluster
from ..planner.cost_model import CostSettings
from ..planner.files import write_json
from ..planner_args import configs_from_args
from ..trials.results import load_results
from ..trials.specs import TrialModel


def profile_command(args) -> int:
    """The `profile` subcommand: measure this machine (or write an analytic profile) into --output."""
    from ..planner.analytic import ProfileSettings, analytic_profile
    from ..training.loop import Trainer
    from ..training.profiler import run_profile

    check_output_file("--output", args.output)
    # one tp x cp group: --context-parallel-size C also times the context-parallel core at C (training/profiler.py)
    cfg = configs_from_args(args, args.tensor_model_parallel_size * args.context_parallel_size)
    for tp in args.profile_tp:
        try:
            cfg.model.check_tensor_parallel(tp)
        except UsageError as exc:
            raise UsageError(str(exc).replace(f"--tensor-model-parallel-size {tp}", f"--profile-tp {tp}")) from None
    settings = ProfileSettings(micro_batch_sizes=args.profile_micro_batch_sizes, tp_sizes=args.profile_tp,
                               warmup=args.profile_warmup, repeats=args.profile_repeats, threads=args.threads,
                               links=not args.no_links, rounds=args.profile_rounds,
                               statistic=args.profile_statistic,
                               gradient_accumulation_fusion=getattr(args, "gradient_accumulation_fusion", True),
                               cp_sizes=(cfg.parallel.context_parallel_size,)
                               if cfg.parallel.context_parallel_size > 1 else ())
    if args.analytic:
        if not args.cluster:
            raise UsageError("--analytic needs --cluster to name the device type's peak FLOP/s")
        cluster = load_cluster(args.cluster)
        types = {g.device.name: g.device for g in cluster.groups}
        name = args.device_type or next(iter(types))
        if name not in types:
            raise UsageError(f"--device-type {name} is not in cluster {cluster.name} ({', '.join(types)})")
        profile = analytic_profile(cfg.model, types[name], settings,
                                   CostSettings(achievable_fraction=args.achievable_fraction).fraction(types[name]))
    else:
        if args.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {args.threads}")
        profile = run_profile(cfg.model, settings, cfg.parallel.sequence_parallel, run=cfg, trainer_class=Trainer)
        if args.device_type:
            profile.device["type"] = args.device_type
    profile.save(args.output)
    print(f"profile of {len(profile.units)} unit timings ({profile.mode}, {profile.device.get('name')}) "
          f"written to {args.output}")
    return 0


def measure_micro_batches(args, base, need: dict[int, set[int]]) -> list:
    """Unit timings of the model of `args` at the micro-batch sizes `need` (tp degree -> sizes) on this machine,
    timed as `base` (a measured profile of the same model: its threads, statistic and sequence parallelism) timed
    its own: tune adds the sizes its plans run to its profile. Only the units (no links, engine overhead, host
    memory or optimizer step: the profile has those already)."""
    from ..planner.analytic import ProfileSettings
    from ..training.profiler import run_profile

    cfg = configs_from_args(args, args.tensor_model_parallel_size)
    units = []
    for tp, sizes in sorted(need.items()):
        settings = ProfileSettings(micro_batch_sizes=tuple(sorted(sizes)), tp_sizes=(tp,),
                                   threads=int(base.device.get("threads") or 1), links=False, overhead=False,
                                   statistic=base.device.get("statistic", "median"),
                                   gradient_accumulation_fusion=getattr(args, "gradient_accumulation_fusion", True))
        units += run_profile(cfg.model, settings, bool(base.device.get("sequence_parallel"))).units
    return units


def run_calibrate(results_path: str, cluster: str, profile_paths: list[str], output: str,
                  costs: CostSettings = CostSettings()) -> str:
    """The `calibrate` subcommand: fit, write the profile, return the text to print."""
    model = TrialModel.from_paths(cluster, profile_paths, costs)
    out = calibrate(load_results(results_path), model, costs)
    data = calibrated_profile_json(out, results_path)
    write_json(output, data, "--output", "profile")
    return (calibration_table(out) + f"\nprofile written to {output}: autoconfig.py search --profile {output} "
            f"(it carries the overlap factor and the memory allowance; flags given beside it win)")
