"""Galvatron-BMW's per-unit hybrid strategies, in numbers only (no torch): what the runtime, the memory and cost
models and the search agree on.

A pipeline stage holds `width` ranks (world size / pp). Each unit runs on them with its own strategy: tensor
parallel degree tp, data parallel degree dp (tp * dp == width), the data-parallel dimension plain (replicated
weights, gradients all-reduced) or sharded (ZeRO-3 style, PyTorch FSDP2), and which dimension sits on
neighbouring ranks. The stage's micro-batch (micro-batch size x width samples) is split into dp contiguous
shards; a unit's dp rank j works on shard j, replicated over its tp group.

Text form, fastest-varying (rank-adjacent) dimension first, degree-1 dimensions left out:
  "tp2-dp2"  tp on neighbouring ranks (Megatron's order)   "dp2-tp2"  dp on neighbouring ranks
  "sdp4"     sharded data parallel over 4 ranks           "tp4"      tensor parallel over 4 ranks
  "dp1"      the only strategy of a 1-rank stage
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import UsageError

_TOKEN = re.compile(r"^(tp|dp|sdp)([1-9][0-9]*)$")


@dataclass(frozen=True)
class UnitStrategy:
    tp: int
    dp: int
    sharded: bool = False  # the dp dimension shards weights, gradients and optimizer state (FSDP2)
    tp_consecutive: bool = True  # tp ranks are neighbours (local index = tp_rank + tp * dp_rank)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.dp < 1:
            raise UsageError(f"strategy degrees must be >= 1, got tp {self.tp} dp {self.dp}")
        if self.sharded and self.dp == 1:
            object.__setattr__(self, "sharded", False)
        if self.tp == 1 or self.dp == 1:
            object.__setattr__(self, "tp_consecutive", True)

    @property
    def width(self) -> int:
        return self.tp * self.dp

    def __str__(self) -> str:
        dp = f"{'sdp' if self.sharded else 'dp'}{self.dp}"
        if self.tp == 1:
            return dp
        if self.dp == 1:
            return f"tp{self.tp}"
        return f"tp{self.tp}-{dp}" if self.tp_consecutive else f"{dp}-tp{self.tp}"

    def coords(self, local: int) -> tuple[int, int]:
        """(tp_rank, dp_rank) of the rank at position `local` of its stage."""
        if not 0 <= local < self.width:
            raise ValueError(f"local rank {local} outside a stage of {self.width}")
        if self.tp_consecutive:
            return local % self.tp, local // self.tp
        return local // self.dp, local % self.dp

    def local_rank(self, tp_rank: int, dp_rank: int) -> int:
        return tp_rank + self.tp * dp_rank if self.tp_consecutive else dp_rank + self.dp * tp_rank

    def tp_groups(self) -> list[list[int]]:
        """Local indices of every tensor-parallel group of the stage."""
        return [[self.local_rank(t, d) for t in range(self.tp)] for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """Local indices of every data-parallel group of the stage."""
        return [[self.local_rank(t, d) for d in range(self.dp)] for t in range(self.tp)]

    def samples(self, local: int, stage_batch: int) -> tuple[int, int]:
        """[start, stop) of the stage micro-batch that the rank at `local` works on."""
        if stage_batch % self.dp:
            raise UsageError(f"strategy {self}: stage micro-batch of {stage_batch} samples does not split into "
                             f"{self.dp} data-parallel shards")
        n = stage_batch // self.dp
        j = self.coords(local)[1]
        return j * n, (j + 1) * n


def parse_strategy(text: str, width: int | None = None, where: str = "--unit-strategies") -> UnitStrategy:
    """'tp2-sdp2' -> UnitStrategy(2, 2, sharded=True); `width`: the stage's rank count it must fill."""
    degrees: dict[str, int] = {}
    order = []
    for token in str(text).strip().split("-"):
        m = _TOKEN.match(token)
        if not m:
            raise UsageError(f"{where}: {text!r} is not a strategy (e.g. tp2-dp2, dp2-tp2, sdp4, tp4)")
        kind = "dp" if m.group(1) == "sdp" else m.group(1)
        if kind in degrees:
            raise UsageError(f"{where}: {text!r} names {kind} twice")
        degrees[kind] = int(m.group(2))
        order.append(m.group(1))
    sharded = "sdp" in order
    tp, dp = degrees.get("tp", 1), degrees.get("dp", 1)
    strategy = UnitStrategy(tp, dp, sharded, order[0] == "tp" or len(order) == 1)
    if width is not None and strategy.width != width:
        raise UsageError(f"{where}: {text!r} spans {strategy.width} ranks, but a pipeline stage has {width}")
    return strategy


def parse_unit_strategies(text, n_units: int, width: int, where: str = "--unit-strategies"
                          ) -> tuple[UnitStrategy, ...]:
    """One strategy per unit from a comma list (or a list of strings / UnitStrategy); a single entry applies to
    every unit."""
    items = text.split(",") if isinstance(text, str) else list(text)
    if len(items) == 1:
        items = items * n_units
    if len(items) != n_units:
        raise UsageError(f"{where}: {len(items)} strategies given, but the model has {n_units} units")
    out = []
    for x in items:
        s = x if isinstance(x, UnitStrategy) else parse_strategy(x, width, where)
        if s.width != width:
            raise UsageError(f"{where}: {s} spans {s.width} ranks, but a pipeline stage has {width}")
        out.append(s)
    return tuple(out)


def stage_strategies(width: int) -> list[UnitStrategy]:
    """Every strategy for a stage of `width` ranks: tp x dp factorisations, plain or sharded dp, and both rank
    orders where tp and dp are both > 1 (Galvatron-BMW's set: 11 for 8 ranks)."""
    out = []
    for tp in (t for t in range(1, width + 1) if width % t == 0):
        dp = width // tp
        for sharded in ((False, True) if dp > 1 else (False,)):
            for consecutive in ((True, False) if tp > 1 and dp > 1 else (True,)):
                out.append(UnitStrategy(tp, dp, sharded, consecutive))
    return out


def galvatron_space_size(world: int) -> int:
    """Galvatron-BMW's per-layer strategy count: over every pp dividing the world, the stage strategies, each
    with and without recomputation (44 for 8 GPUs)."""
    return 2 * sum(len(stage_strategies(world // pp)) for pp in range(1, world + 1) if world % pp == 0
                   and (pp & (pp - 1)) == 0)


def local_slice(src: UnitStrategy, dst: UnitStrategy) -> bool:
    """Does every stage position find its `dst` batch rows among its `src` rows (a re-layout without traffic)?"""
    n = src.dp * dst.dp
    for pos in range(src.width):
        s0, s1 = src.samples(pos, n)
        d0, d1 = dst.samples(pos, n)
        if not (s0 <= d0 and d1 <= s1):
            return False
    return True
