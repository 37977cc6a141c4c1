"""Ranks agree on a step's errors, so that an error met by one rank stops all of them cleanly.

`agree(fn)` runs `fn` on every rank. If it raised a UsageError (bad input) or a RunError (e.g. a full disk) on
any rank, the lowest such rank prints its one `error:` line and every rank raises Reported with that error's
exit code together, instead of the others running on into a collective that can never complete. `fn` must not
run collectives itself (a rank that failed early would be missing from them).
"""

from __future__ import annotations

import torch.distributed as dist

from ..errors import Reported, RunError, UsageError, say


def agree(fn, *args, **kwargs):
    error = None
    result = None
    try:
        result = fn(*args, **kwargs)
    except (UsageError, RunError) as exc:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            raise
        error = (exc.exit_code, str(exc))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return result
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
    if failed:
        rank, (code, text) = failed[0]
        if rank == dist.get_rank():
            say(f"rank {rank}: {text}")
        raise Reported(code)
    return result
