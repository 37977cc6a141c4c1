"""Ranks agree on a step's bad input, so that an error met by one rank stops all of them cleanly.

`agree(fn)` runs `fn` on every rank. If it raised a UsageError on any rank, the lowest such rank prints its one
`error:` line and every rank raises Reported (exit code 2) together, instead of the others running on into a
collective that can never complete. `fn` must not run collectives itself (a rank that failed early would be
missing from them).
"""

from __future__ import annotations

import torch.distributed as dist

from ..errors import Reported, UsageError, say


def agree(fn, *args, **kwargs):
    error = None
    result = None
    try:
        result = fn(*args, **kwargs)
    except UsageError as exc:
        error = str(exc)
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise UsageError(error)
        return result
    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [(rank, text) for rank, text in enumerate(errors) if text is not None]
    if failed:
        rank, text = failed[0]
        if rank == dist.get_rank():
            say(f"rank {rank}: {text}")
        raise Reported(2)
    return result
