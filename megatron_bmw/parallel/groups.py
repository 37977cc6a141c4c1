"""A process group's size and this rank's place in it, None standing for a group of one rank."""

from __future__ import annotations

import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)
