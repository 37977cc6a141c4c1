"""Rank layout: global rank <-> (tp, dp, pp) coordinates.

`tp-dp-pp`: tp fastest, then dp, then pp (Megatron-LM's order; the runtime's default).
`bpipe` (with --bpipe): tp fastest, then pipeline stages in pair-adjacent order 0, p-1, 1, p-2, ... (so each BPipe pair
(s, p-1-s) sits on neighbouring ranks), then dp.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError

ORDERS = ("tp-dp-pp", "bpipe")


def pair_adjacent_slot(stage: int, pp: int) -> int:
    """Position of pipeline stage `stage` in the order 0, p-1, 1, p-2, ..."""
    return 2 * stage if stage < (pp + 1) // 2 else 2 * (pp - 1 - stage) + 1


@dataclass(frozen=True)
class RankLayout:
    tp: int
    dp: int
    pp: int
    order: str = "tp-dp-pp"

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise UsageError(f"unknown rank order {self.order!r}; choose one of {', '.join(ORDERS)}")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def rank(self, tp: int, dp: int, pp: int) -> int:
        if self.order == "tp-dp-pp":
            return tp + self.tp * (dp + self.dp * pp)
        return tp + self.tp * (pair_adjacent_slot(pp, self.pp) + self.pp * dp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        tp, rest = rank % self.tp, rank // self.tp
        if self.order == "tp-dp-pp":
            return tp, rest % self.dp, rest // self.dp
        slot, dp = rest % self.pp, rest // self.pp
        stage = slot // 2 if slot % 2 == 0 else self.pp - 1 - slot // 2
        return tp, dp, stage

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: all tp x pp ranks holding one replica of the model."""
        return [sorted(self.rank(t, d, p) for p in range(self.pp) for t in range(self.tp)) for d in range(self.dp)]

    def node_of(self, rank: int, gpus_per_node: int) -> int:
        """Node holding global `rank` when each node has `gpus_per_node` consecutive ranks."""
        if gpus_per_node < 1:
            raise UsageError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
        return rank // gpus_per_node

    def split_pairs(self, gpus_per_node: int) -> list[tuple[int, int]]:
        """Global ranks of BPipe pairs (stage s, stage p-1-s, same tp and dp rank) that sit on different nodes."""
        return [(g[s], g[-1 - s]) for g in self.pp_groups() for s in range(self.pp // 2)
                if self.node_of(g[s], gpus_per_node) != self.node_of(g[-1 - s], gpus_per_node)]

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline (they share the tied word embedding)."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]
