"""--from-search: run `autoconfig.py search --output-dir` on the sweep's model flags, so each of its top-k plans
runs as a trial with --plan."""

from __future__ import annotations

from ..arguments import parse_args
from ..errors import UsageError
from .. import planner_args as cli


def search_plans(flags: list[str], cluster: str, profile_paths: list[str], world_size: int | None, top_k: int,
                 space: list[str], out_dir: str, progress: bool = True) -> list[str]:
    """Paths of the written plans plan_1.json ... (best first)."""
    argv = ["search", *flags, "--cluster", cluster, "--top-k", str(top_k), "--output-dir", out_dir]
    for p in profile_paths:
        argv += ["--profile", p]
    for s in space:
        argv += ["--space", s]
    if world_size:
        argv += ["--world-size", str(world_size)]
    args = parse_args(argv, cli.build_autoconfig_parser())
    if args.global_batch_size is None:
        raise UsageError("--from-search needs --global-batch-size")
    try:
        result, profiles, orig_vocab = cli.run_search(args, progress)
    except UsageError as exc:
        raise UsageError(f"--from-search: {exc}") from None
    return cli.write_plans(result, profiles, orig_vocab, args.output_dir, top_k)
