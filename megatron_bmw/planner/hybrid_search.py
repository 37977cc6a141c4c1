"""One hybrid layout of the search (pp, micro-batch size, 1F1B; top-level tp 1 and dp = the stage width N):
every unit's strategy (strategy.py) and recomputation, and the unit partition.

Per stage the per-layer DP (hybrid_dp.stage_dp) picks (strategy, recomputation) per unit minimising
m x (forward + backward) + the unit's gradient synchronisation (HybridGradSync runs it after the pipeline, not
overlapped) + m x re-layouts, under the stage's memory (model
states + the micro-batches 1F1B holds at its peak x saved activations + the worst backward). Stages are solved
in order, each entering from the previous stage's last strategy. Partitions are walked as for uniform layouts
(solver.py): from the memory-balanced start toward time balance (Galvatron-BMW's bi-objective walk). The
estimate is AMP's pipeline formula plus the exposed gradient synchronisation and the optimizer step; the search
simulates the finalists with HybridCostModel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig, PipelineConfig
from ..strategy import UnitStrategy, stage_strategies
from ..units import owns_output_weight, unit_kind, unit_names
from .cluster import Cluster
from .cost_model import CostSettings, optimizer_step_seconds
from .evaluate import stage_capacity
from .hybrid_cost import StageCosts
from .hybrid_dp import stage_dp
from .hybrid_memory import unit_memory
from .memory_model import MemorySettings
from .partitioners import galvatron_walk, minmax_partition
from .profile_data import Profiles
from .schedule_shapes import ScheduleShapes
from .solver import Solution, Variant, block_units, even_partition, stage_blocks
from .space import Layout, SearchSpace
from .spec import RunSpec

_INF = math.inf


@dataclass
class HybridSolution(Solution):
    strategies: tuple[str, ...] = ()

    def spec(self, model: ModelConfig, slicing: int = 0) -> RunSpec:
        lay = self.layout
        pipe = PipelineConfig(micro_batch_size=lay.micro_batch_size, num_microbatches=lay.num_microbatches, schedule=lay.schedule,
                              partition=self.partition, recompute=self.recompute)
        return RunSpec.of(model=model, tp=1, pp=lay.pp, dp=lay.dp, pipeline=pipe, unit_strategies=self.strategies)


def hybrid_strategies(model: ModelConfig, width: int, max_tp: int | None = None) -> list[UnitStrategy]:
    """The stage strategies whose tp degree splits heads, query groups, hidden and FFN (and is at most `max_tp`: tensor
    parallelism stays inside a node, as for uniform layouts)."""
    return [s for s in stage_strategies(width) if model.splits_over(s.tp) and (max_tp is None or s.tp <= max_tp)]


class HybridProblem:
    """Unit options of one hybrid layout, its per-stage DP and its partition walk."""

    uniform = "hybrid"

    def __init__(self, layout: Layout, model: ModelConfig, cluster: Cluster, profiles: Profiles | None,
                 space: SearchSpace, costs: CostSettings, memory: MemorySettings, shapes: ScheduleShapes,
                 strategies: list[UnitStrategy] | None = None, resolution: int = 512) -> None:
        self.layout, self.model, self.space, self.cluster = layout, model, space, cluster
        self.memory = memory.for_layout(model, 1, layout.dp, layout.pp, layout.micro_batch_size, False)
        self.variant = Variant()
        self.resolution = resolution
        lay = layout
        self.stages = lay.pp
        self.names = unit_names(model.num_layers)
        self.kinds = [unit_kind(n) for n in self.names]
        node = min(g.gpus_per_node for g in cluster.groups)
        self.strategies = strategies or hybrid_strategies(model, lay.dp, node)
        self.index = {s: k for k, s in enumerate(self.strategies)}
        base = RunSpec.of(model=model, tp=1, pp=lay.pp, dp=lay.dp,
                       pipeline=PipelineConfig(micro_batch_size=lay.micro_batch_size, num_microbatches=lay.num_microbatches,
                                               partition=even_partition(model.num_units, lay.pp)))
        self.capacity = [stage_capacity(base, cluster, r) for r in range(lay.pp)]
        self.counts = [shapes.counts(lay, False)[r][0][0] for r in range(lay.pp)]
        self.stage_costs = [StageCosts(model, cluster, profiles, costs, lay.pp, lay.dp, lay.micro_batch_size, r)
                            for r in range(lay.pp)]
        self.per_unit = profiles is not None and any(u.unit is not None for ps in profiles.by_type.values()
                                                     for p in ps for u in p.units)
        self.recompute = tuple(c for c in (None, "selective", "full") if c in space.recompute) or (None,)
        # a tied word embedding: the embedding and the head take one unsharded strategy (parallel/hybrid.py)
        self.ties = [None] if model.untie_embeddings_and_output_weights else \
            [k for k, s in enumerate(self.strategies) if not s.sharded]
        n_s = len(self.strategies)
        self.relayout = []  # per stage [p][s]: (forward, backward) seconds
        for sc in self.stage_costs:
            self.relayout.append([[sc.relayout(p, s) for s in self.strategies] for p in self.strategies])
        self._rows: dict[tuple, list] = {}
        self._stage: dict[tuple, tuple | None] = {}
        self._seen: dict[tuple, HybridSolution | None] = {}
        # the fastest option per unit on stage 0 (partition starts, lower bound, the finalist's refinement)
        fast = [min(self.rows(0, i, True), key=lambda o: o[1]) for i in range(len(self.names))]
        self.times = [[[(o[4], o[5])] for o in fast]]
        self.p2p = self._p2p_time() if lay.pp > 1 else 0.0
        self._n_s = n_s

    def _p2p_time(self) -> float:
        sc = self.stage_costs[0]
        nbytes = sc.hidden_bytes(self.layout.micro_batch_size)
        a, b = self.stage_costs[0].ranks[0], self.stage_costs[1].ranks[0]
        return self.cluster.link(a, b).time(nbytes)

    def rows(self, rank: int, i: int, own_output: bool) -> list[tuple]:
        """Options of unit i on `rank`: (strategy index, objective seconds, memory bytes, transient bytes,
        forward, backward, sync, params kept, recompute)."""
        kind = self.kinds[i]
        key = (rank, kind, own_output, i if self.per_unit else None)
        if key in self._rows:
            return self._rows[key]
        sc, lay, cnt = self.stage_costs[rank], self.layout, self.counts[rank]
        choices = self.recompute if kind in ("attention", "mlp") else (None,)
        out = []
        for k, s in enumerate(self.strategies):
            mine = []
            for c in choices:
                if c == "selective" and kind != "attention":
                    continue
                f, b = sc.unit_times(kind, s, c, i if self.per_unit else None, own_output)
                sync = sc.sync_time(kind, s, own_output)
                um = unit_memory(kind, self.model, s, lay.micro_batch_size, c, self.memory.device, own_output)
                mine.append((k, lay.num_microbatches * (f + b) + sync, um.state_bytes + cnt * um.saved_bytes, um.transient_bytes,
                             f, b, sync, um.params, c))
            keep = [o for o in mine if not any(x is not o and x[1] <= o[1] and x[2] <= o[2] and x[3] <= o[3]
                                               and (x[1], x[2], x[3]) != (o[1], o[2], o[3]) for x in mine)]
            out += keep
        self._rows[key] = out
        return out

    def room(self, rank: int) -> float:
        ms = self.memory
        return (self.capacity[rank] - ms.workspace_bytes) / (1 + ms.fragmentation)

    def solve_stage(self, rank: int, start: int, stop: int, enter: int | None, tie: int | None = None,
                    only: int | None = None):
        """Units start..stop-1 on pipeline rank `rank`, entering from strategy index `enter` (None: the model's
        first unit); `tie`: the strategy index the embedding and the head must take. Returns (options picked,
        forward, backward, sync, params, peak bytes) or None."""
        last = len(self.names) - 1
        tie = tie if start == 0 or stop == last + 1 else None
        key = (rank, start, stop, enter, tie, only)
        if key in self._stage:
            return self._stage[key]
        own = owns_output_weight(self.model.untie_embeddings_and_output_weights, self.layout.pp,
                                 self.names[start:stop])
        options = [self.rows(rank, i, own) for i in range(start, stop)]
        if tie is not None:
            options = [[o for o in opts if o[0] == tie] if start + u in (0, last) else opts
                       for u, opts in enumerate(options)]
        if only is not None:  # one strategy for every unit
            options = [[o for o in opts if o[0] == only] for opts in options]
        m = self.layout.num_microbatches
        rel = [[m * (f + b) for f, b in row] for row in self.relayout[rank]]
        enter_cost = [0.0] * self._n_s if enter is None else rel[enter]
        got = stage_dp([[o[:4] for o in opts] for opts in options], rel, enter_cost, self.room(rank),
                       self.resolution)
        out = None
        if got is not None:
            choice, _, peak = got
            picked = [options[u][j] for u, j in enumerate(choice)]
            fwd = sum(o[4] for o in picked)
            bwd = sum(o[5] for o in picked)
            prev = enter
            for o in picked:
                if prev is not None:
                    rf, rb = self.relayout[rank][prev][o[0]]
                    fwd, bwd = fwd + rf, bwd + rb
                prev = o[0]
            sc = self.stage_costs[rank]
            over = sc.overhead()
            ms = self.memory
            out = (picked, fwd + over[0] * sc.static_factor, bwd + over[1] * sc.static_factor, self.stage_costs[rank].stage_sync_time(
                [(self.kinds[start + u], self.strategies[o[0]], own) for u, o in enumerate(picked)]), sum(o[7] for o in picked),
                   ms.workspace_bytes + peak * (1 + ms.fragmentation))
        self._stage[key] = out
        return out

    def evaluate(self, partition: tuple[int, ...]) -> HybridSolution | None:
        """The partition's best plan; with a tied word embedding, the best over the embedding's and the head's
        common (unsharded) strategy, as the runtime needs (parallel/hybrid.py)."""
        key = tuple(partition)
        if key not in self._seen:
            got = [self._evaluate(key, tie) for tie in self.ties]
            got = [x for x in got if x is not None]
            self._seen[key] = min(got, key=lambda x: x.estimate) if got else None
        return self._seen[key]

    def single_strategy(self, partition: tuple[int, ...]) -> list[HybridSolution]:
        """The partition with one strategy for every unit (each that fits; recomputation still per unit): the
        uniform plans of the hybrid space, which the search's finalists are also simulated with, since the
        static estimate can misjudge a mix against them (e.g. tensor parallelism on CPU ranks sharing cores)."""
        out = []
        for k, s in enumerate(self.strategies):
            tie = k if not s.sharded and self.ties != [None] else None
            if self.ties != [None] and s.sharded:
                continue
            got = self._evaluate(tuple(partition), tie, only=k)
            if got is not None:
                out.append(got)
        return out

    def _evaluate(self, partition: tuple[int, ...], tie: int | None, only: int | None = None
                  ) -> HybridSolution | None:
        lay = self.layout
        strategies, recompute = [], []
        fwd, bwd, syncs, params, memory = [], [], [], [], []
        start, enter = 0, None
        for r, size in enumerate(partition):
            got = self.solve_stage(r, start, start + size, enter, tie, only)
            if got is None:
                return None
            picked, f, b, sync, p, peak = got
            strategies += [str(self.strategies[o[0]]) for o in picked]
            recompute += [o[8] for o in picked]
            fwd.append(f)
            bwd.append(b)
            syncs.append(sync)
            params.append(p)
            memory.append(peak)
            enter = picked[-1][0]
            start += size
        fb = [f + b for f, b in zip(fwd, bwd)]
        estimate = sum(fb) + (lay.num_microbatches - 1) * max(fb) + 2 * (lay.pp - 1) * self.p2p
        estimate += max(self._exposed(r, syncs[r], params[r]) for r in range(lay.pp))
        rc = tuple(recompute) if any(recompute) else None
        return HybridSolution(lay, self.variant, tuple(partition), rc, estimate, fwd, bwd, memory, self.capacity,
                              self, tuple(strategies))

    def _exposed(self, rank: int, sync: float, params: float) -> float:
        """After the pipeline: the unit groups' reductions (HybridGradSync runs them after the last backward, not
        overlapped) and the optimizer step."""
        sc = self.stage_costs[rank]
        return sync + optimizer_step_seconds(params, 1, False, self.model.dtype_bytes, sc.device,
                                             sc.settings.bandwidth_fraction)

    def lower_bound(self) -> float:
        """Perfect balance with every unit at its fastest option, no re-layouts, no synchronisation."""
        lay = self.layout
        total = sum(f + b for f, b in (t[0] for t in self.times[0]))
        return total / lay.pp * (lay.num_microbatches + lay.pp - 1)

    def could_fit(self) -> bool:
        """Every unit at its lightest option, the least-holding rank's count, all ranks' memory together."""
        least = 0.0
        for i in range(len(self.names)):
            least += min(o[2] for o in self.rows(self.stages - 1, i, True))
        return least <= sum(self.room(r) for r in range(self.stages))

    # ---- the partition search ---------------------------------------------------------------------------------
    def blocks(self) -> list[list[int]]:
        return stage_blocks(self.model.num_layers, self.space.sublayer)

    def solve(self) -> HybridSolution | None:
        blocks = self.blocks()
        p = self.stages
        if p > len(blocks):
            return None
        fast = [sum(self.times[0][i][0][0] + self.times[0][i][0][1] for i in blk) for blk in blocks]
        light = [[sum(min(o[2] for o in self.rows(k, i, True)) for i in blk) for blk in blocks] for k in range(p)]


        def score(block_part):
            return self.evaluate(block_units(blocks, block_part))

        starts = [minmax_partition(fast, p), minmax_partition(light, p, exact=False),
                  list(even_partition(len(blocks), p))]
        scored = {tuple(s): score(s) for s in starts}
        feasible = [k for k, v in scored.items() if v is not None]
        if feasible and p > 1:
            mem_start = min(feasible, key=lambda k: max(scored[k].memory))
            first = scored[tuple(starts[0])]
            time_peak = max(first.memory) if first is not None else 0.0

            def stage_time(part):
                got = score(part)
                return [_INF] * p if got is None else [f + b for f, b in zip(got.stage_forward, got.stage_backward)]

            def stage_memory(part):
                got = score(part)
                return [_INF] * p if got is None else list(got.memory)

            for part in galvatron_walk(list(mem_start), stage_time, stage_memory, self.capacity, time_peak,
                                       max_steps=24):
                scored[tuple(part)] = score(part)
        best = [v for v in self._seen.values() if v is not None]
        return min(best, key=lambda s: s.estimate) if best else None


def hybrid_layouts(space: SearchSpace, model: ModelConfig, world: int, global_batch: int) -> list[Layout]:
    """(pp, mbs) with 1F1B, tp 1, dp = world / pp: the layouts whose stages the per-unit strategies fill."""
    from .space import layouts
    from dataclasses import replace
    sub = replace(space, tp=(1,), dp=None, schedule=tuple(s for s in space.schedule if s == "1f1b") or ("1f1b",))
    return [lay for lay in layouts(sub, model, world, global_batch, [1]) if lay.virtual_stages == 1]


def summarize(strategies, recompute=None, names=None) -> str:
    """Run-length text of per-unit strategies: 'emb tp4 | 12x attn tp2-dp2, mlp sdp4 | head tp4'."""
    if not strategies:
        return ""
    n_layers = (len(strategies) - 2) // 2
    names = names or unit_names(n_layers)
    tags = []
    for i, s in enumerate(strategies):
        rc = recompute[i] if recompute else None
        tags.append(f"{s}{'+' + rc[0] if rc else ''}")
    parts = [f"emb {tags[0]}"]
    pairs = [(tags[1 + 2 * k], tags[2 + 2 * k]) for k in range(n_layers)]
    k = 0
    while k < len(pairs):
        j = k
        while j + 1 < len(pairs) and pairs[j + 1] == pairs[k]:
            j += 1
        a, m = pairs[k]
        parts.append(f"{j - k + 1}x attn {a}, mlp {m}" if a != m else f"{j - k + 1}x {a}")
        k = j + 1
    parts.append(f"head {tags[-1]}")
    return " | ".join(parts)
