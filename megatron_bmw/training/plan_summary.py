"""A plan in a few lines of text, beside another one: what --plan auto prints when it re-plans (old -> new)."""

from __future__ import annotations

from ..planner.plan import Plan


def plan_rows(plan: Plan) -> dict[str, str]:
    """The plan's layout and prediction, a row per fact."""
    s, pl = plan.spec, plan.spec.pipeline
    schedule = pl.schedule + (f" x{pl.virtual_stages} virtual" if pl.virtual_stages > 1 else "")
    on = [name for name, yes in (("SP", s.sp), ("ZeRO-1", s.distributed_optimizer), ("BPipe", pl.bpipe),
                                 (f"slicing {pl.slicing}", bool(pl.slicing))) if yes]
    predicted = plan.prediction.get("iteration_time_s")
    return {
        "ranks": str(s.world_size),
        "tp x pp x dp": f"{s.tp} x {s.pp} x {s.dp}",
        "micro-batch": f"{pl.micro_batch_size} x {pl.num_microbatches} per rank",
        "global batch": str(plan.global_batch_size),
        "schedule": schedule,
        "partition": ",".join(map(str, pl.partition)),
        "recomputed units": str(sum(1 for x in pl.recompute or () if x)),
        "options": ", ".join(on) or "-",
        "predicted s/iter": f"{predicted:.4g}" if isinstance(predicted, (int, float)) else "?",
    }


def plan_block(plan: Plan, old: Plan | None = None, old_path: str | None = None) -> list[str]:
    """The plan as rows, with the earlier plan's beside it where there is one (changed rows marked '*')."""
    new = plan_rows(plan)
    width = max(map(len, new))
    if old is None:
        return [f">   {k:<{width}}  {v}" for k, v in new.items()]
    before = plan_rows(old)
    col = max(len(v) for v in before.values())
    lines = [f">   {'':<{width}}  {'before':<{col}}    now   (before: {old_path})"]
    for k, v in new.items():
        mark = "*" if before[k] != v else " "
        lines.append(f"> {mark} {k:<{width}}  {before[k]:<{col}} -> {v}")
    return lines
