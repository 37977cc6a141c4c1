"""Rank layout: global rank <-> (tp, cp, dp, pp) coordinates.

`tp-dp-pp`: tp fastest, then cp, then dp, then pp (Megatron-LM's tp-cp-dp-pp; the runtime's default; cp is 1
unless --context-parallel-size).
`bpipe` (with --bpipe): tp fastest, then cp, then pipeline stages in pair-adjacent order 0, p-1, 1, p-2, ... (so
each BPipe pair (s, p-1-s) sits on neighbouring ranks), then dp.

The experts' layout (docs/moe.md): a stage's tp x cp x dp ranks, by local index L = tp_rank + tp * (cp_rank + cp *
dp_rank), are also etp x ep x edp: etp_rank = L % etp, ep_rank = L // etp % ep, edp_rank = L // (etp * ep).
"""

from __future__ import annotations

from dataclasses import dataclass

from itertools import product

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
    cp: int = 1
    ep: int = 1  # --expert-model-parallel-size
    etp: int = 1  # --expert-tensor-parallel-size

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise UsageError(f"unknown rank order {self.order!r}; choose one of {', '.join(ORDERS)}")
        if self.ep < 1 or self.etp < 1 or self.stage_width % (self.ep * self.etp):
            raise UsageError(
                f"--expert-model-parallel-size {self.ep} x --expert-tensor-parallel-size {self.etp} must divide a "
                f"stage's tensor x context x data parallel ranks ({self.tp} x {self.cp} x {self.dp} = "
                f"{self.stage_width})")

    @property
    def stage_width(self) -> int:
        """Ranks of one pipeline stage: tp x cp x dp."""
        return self.tp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert data parallel size: the stage's ranks holding the same expert shards."""
        return self.stage_width // (self.ep * self.etp)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def rank(self, tp: int, dp: int, pp: int, cp: int = 0) -> int:
        inner = tp + self.tp * cp
        if self.order == "tp-dp-pp":
            return inner + self.tp * self.cp * (dp + self.dp * pp)
        return inner + self.tp * self.cp * (pair_adjacent_slot(pp, self.pp) + self.pp * dp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, dp_rank, pp_rank) of a global rank."""
        tp, _, dp, pp = self.all_coords(rank)
        return tp, dp, pp

    def all_coords(self, rank: int) -> tuple[int, int, int, int]:
        """(tp_rank, cp_rank, dp_rank, pp_rank) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        tp, cp, rest = rank % self.tp, rank // self.tp % self.cp, rank // (self.tp * self.cp)
        if self.order == "tp-dp-pp":
            return tp, cp, rest % self.dp, rest // self.dp
        slot, dp = rest % self.pp, rest // self.pp
        stage = slot // 2 if slot % 2 == 0 else self.pp - 1 - slot // 2
        return tp, cp, dp, stage

    def _groups(self, vary: str) -> list[list[int]]:
        """Every group of ranks that differ only in the coordinates named in `vary` (a subset of "tcdp")."""
        sizes = {"t": self.tp, "c": self.cp, "d": self.dp, "p": self.pp}
        fixed = [k for k in "pdct" if k not in vary]  # outer loops, pp slowest (the order groups are made in)
        out = []
        for outer in _product([range(sizes[k]) for k in fixed]):
            at = dict(zip(fixed, outer))
            members = []
            for inner in _product([range(sizes[k]) for k in vary]):
                at.update(zip(vary, inner))
                members.append(self.rank(at["t"], at["d"], at["p"], at["c"]))
            out.append(members)
        return out

    def tp_groups(self) -> list[list[int]]:
        return self._groups("t")

    def cp_groups(self) -> list[list[int]]:
        return self._groups("c")

    def dp_groups(self) -> list[list[int]]:
        return self._groups("d")

    def dp_cp_groups(self) -> list[list[int]]:
        """Ranks that hold the same parameters: gradients are reduced (and ZeRO-1 shards) over dp x cp."""
        return self._groups("dc")

    def pp_groups(self) -> list[list[int]]:
        return self._groups("p")

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: all tp x pp ranks holding one replica of the model (one per cp and dp rank)."""
        return [sorted(g) for g in self._groups("pt")]

    def node_of(self, rank: int, gpus_per_node: int) -> int:
        """Node holding global `rank` when each node has `gpus_per_node` consecutive ranks."""
        if gpus_per_node < 1:
            raise UsageError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
        return rank // gpus_per_node

    def split_pairs(self, gpus_per_node: int) -> list[tuple[int, int]]:
        """Global ranks of BPipe pairs (stage s, stage p-1-s, same tp and dp rank) that sit on different nodes."""
        return [(g[s], g[-1 - s]) for g in self.pp_groups() for s in range(self.pp // 2)
                if self.node_of(g[s], gpus_per_node) != self.node_of(g[-1 - s], gpus_per_node)]

    def local_index(self, rank: int) -> int:
        """L = tp_rank + tp * (cp_rank + cp * dp_rank): a rank's place among its stage's tp x cp x dp ranks."""
        tp, cp, dp, _ = self.all_coords(rank)
        return tp + self.tp * (cp + self.cp * dp)

    def expert_coords(self, rank: int) -> tuple[int, int, int]:
        """(etp_rank, ep_rank, edp_rank) of a global rank."""
        local = self.local_index(rank)
        return local % self.etp, local // self.etp % self.ep, local // (self.etp * self.ep)

    def _expert_groups(self, vary: str) -> list[list[int]]:
        """Every group of ranks on one stage differing only in the expert coordinates named in `vary` (a subset of
        "tea": etp, ep, edp): stage by stage, groups in order of their lowest local index, members by L."""
        out = []
        for stage in range(self.pp):
            groups: dict[tuple, list[int]] = {}
            for local in range(self.stage_width):
                tp, cp, dp = local % self.tp, local // self.tp % self.cp, local // (self.tp * self.cp)
                rank = self.rank(tp, dp, stage, cp)
                coords = dict(zip("tea", self.expert_coords(rank)))
                groups.setdefault(tuple(v for k, v in coords.items() if k not in vary), []).append(rank)
            out += groups.values()
        return out

    def ep_groups(self) -> list[list[int]]:
        """Ranks holding different experts (the alltoall dispatcher's group), by ep rank."""
        return self._expert_groups("e")

    def etp_groups(self) -> list[list[int]]:
        """Ranks holding the tensor-parallel shards of the same experts, by etp rank."""
        return self._expert_groups("t")

    def edp_groups(self) -> list[list[int]]:
        """Ranks holding the same expert shards (expert gradients are summed over them), by edp rank."""
        return self._expert_groups("a")

    def etp_ep_groups(self) -> list[list[int]]:
        """etp x ep (the allgather dispatcher's group), by etp_rank + etp * ep_rank."""
        return self._expert_groups("te")

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of each pipeline (they share the tied word embedding)."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]


def _product(ranges: list) -> list[tuple[int, ...]]:
    """Every combination, the last range fastest."""
    return list(product(*ranges))
