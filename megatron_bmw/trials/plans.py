"""--from-search: run `autoconfig.py search` on the sweep's model flags and write its top-k plans as files
(`autoconfig.py search --output` writes only the best one), so each runs as a trial with --plan."""

from __future__ import annotations

import argparse
import os

from ..arguments import configs_from_args, parse_args
from ..errors import UsageError
from ..planner import cli


def search_plans(flags: list[str], cluster: str, profile_paths: list[str], world_size: int | None, top_k: int,
                 space: list[str], out_dir: str, progress: bool = True) -> list[str]:
    """Paths of the written plans plan_01.json ... (best first)."""
    from ..planner.report import plan_from
    from ..planner.search import SearchSettings, search
    from ..planner.space import SearchSpace

    argv = ["search", *flags, "--cluster", cluster, "--top-k", str(top_k)]
    for p in profile_paths:
        argv += ["--profile", p]
    for s in space:
        argv += ["--space", s]
    if world_size:
        argv += ["--world-size", str(world_size)]
    args = parse_args(argv, cli.build_autoconfig_parser())
    if args.global_batch_size is None:
        raise UsageError("--from-search needs --global-batch-size")
    profiles = cli._profiles(args)
    cluster_obj = cli._cluster(args, profiles)
    one = configs_from_args(argparse.Namespace(**{**vars(args), **cli.SERIAL_FLAGS}), 1)
    result = search(one.model, one.orig_vocab_size, args.make_vocab_size_divisible_by, args.global_batch_size,
                    cluster_obj, profiles, SearchSpace.parse(args.space), cli._costs(args),
                    cli._memory_settings(args, profiles),
                    SearchSettings(world_size=args.world_size or cluster_obj.num_gpus, top_k=top_k, progress=progress))
    if not result.ranked:
        raise UsageError(f"--from-search: no plan fits on cluster {cluster_obj.name}")
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for i, ranked in enumerate(result.ranked[:top_k], 1):
        plan = plan_from(ranked, result, profiles, one.orig_vocab_size)
        plan.search["rank"] = i
        path = os.path.join(out_dir, f"plan_{i:02d}.json")
        plan.save(path)
        paths.append(path)
    return paths
