"""Pipeline partitions at unit granularity.

A partition is the number of units per virtual stage, in the order of the model's unit list
[embedding, attn_0, mlp_0, ..., head]. Where virtual stage k lives is the schedule's placement
(pipeline/schedule.py): "interleaved", rank k % p as its chunk k // p; "v", zig-zagging over the ranks.
"""

from __future__ import annotations

from ..errors import UsageError
from ..units import num_units
from .schedule import stage_index


def default_partition(num_layers: int, pp: int, virtual: int = 1) -> list[int]:
    """Megatron-like: layers split evenly over the virtual stages (extra layers to the later stages),
    the embedding joins the first stage and the head the last."""
    stages = pp * virtual
    if num_layers < stages:
        raise UsageError(
            f"--num-layers {num_layers} is smaller than the number of (virtual) pipeline stages {stages}; "
            "give --pipeline-partition to split layers into attention and MLP units"
        )
    base, extra = divmod(num_layers, stages)
    layers = [base + (1 if k >= stages - extra else 0) for k in range(stages)]
    units = [2 * n for n in layers]
    units[0] += 1
    units[-1] += 1
    return units


def parse_partition(text: str | list[int] | None, num_layers: int, pp: int, virtual: int = 1) -> list[int]:
    if text is None:
        return default_partition(num_layers, pp, virtual)
    flag = "--pipeline-partition"
    if isinstance(text, str):
        try:
            sizes = [int(x) for x in text.split(",")]
        except ValueError:
            raise UsageError(f"{flag} {text!r}: expected comma-separated unit counts, e.g. 3,2,2,3") from None
    else:
        sizes = list(text)
    n_units = num_units(num_layers)
    stages = pp * virtual
    if len(sizes) != stages:
        raise UsageError(f"{flag}: {len(sizes)} entries given, but there are {stages} (virtual) pipeline stages")
    if any(n <= 0 for n in sizes):
        raise UsageError(f"{flag} {','.join(map(str, sizes))}: every stage needs at least one unit")
    if sum(sizes) != n_units:
        raise UsageError(
            f"{flag} {','.join(map(str, sizes))}: sums to {sum(sizes)}, but the model has {n_units} units "
            f"(embedding + 2 x {num_layers} layers + head)"
        )
    return sizes


def virtual_stage_units(partition: list[int]) -> list[list[int]]:
    """Unit indices of every virtual stage."""
    out, start = [], 0
    for n in partition:
        out.append(list(range(start, start + n)))
        start += n
    return out


def rank_chunks(partition: list[int], pp: int, rank: int, placement: str = "interleaved") -> list[list[int]]:
    """Unit indices of each model chunk held by pipeline rank `rank`, chunk 0 first."""
    stages = virtual_stage_units(partition)
    return [stages[stage_index(rank, c, pp, placement)] for c in range(len(stages) // pp)]
