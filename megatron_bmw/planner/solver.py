"""One layout of the search (degrees, micro-batching, schedule, SP/ZeRO-1/BPipe): the unit partition and the
recomputation of every unit, under each pipeline rank's memory, with a fast estimate of the iteration.

Per unit and recomputation choice the solver knows the forward and backward seconds on each rank's device
(the cost model), the bytes one micro-batch leaves saved and the transient bytes rebuilt in its backward (the
memory model), and the model-state bytes. The schedule says how many micro-batches each rank holds at its peak
(pipeline/holding.py). Then, Galvatron-BMW style: per rank, a knapsack over its units' choices minimises time
under the rank's memory (choose_options), and partitions are walked from the memory-balanced one toward the
time-balanced one (galvatron_walk), with AutoPipe's min-max and AMP's layer-assignment DP as starts. The
estimate is AMP's pipeline formula; the search simulates the finalists exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..config import ModelConfig, PipelineConfig
from ..pipeline.build import pipeline_schedule
from ..pipeline.holding import holding_events
from ..pipeline.partition import rank_chunks
from ..pipeline.schedule import Action, Kind
from ..units import unit_kind, unit_names
from .cluster import Cluster
from .cost_model import CostModel, CostSettings, allgather_time, allreduce_time
from .evaluate import stage_capacity
from .memory_model import MemorySettings, PrecisionConfig, unit_activation_bytes, unit_param_count
from .partitioners import amp_partition, choose_options, galvatron_walk, minmax_partition
from .profile_data import Profiles
from .space import Layout, SearchSpace
from .spec import RunSpec

_INF = math.inf
_SEND = Action(Kind.SEND_ACT, 0, 0, 1)


@dataclass(frozen=True)
class Variant:
    """The memory savers of a layout."""

    sp: bool = False
    zero1: bool = False
    bpipe: bool = False


@dataclass
class Solution:
    layout: Layout
    variant: Variant
    partition: tuple[int, ...]
    recompute: tuple[str | None, ...] | None
    estimate: float  # seconds per iteration (AMP's formula)
    stage_forward: list[float]  # per virtual stage, one micro-batch
    stage_backward: list[float]
    memory: list[float]  # estimated peak bytes per pipeline rank
    capacity: list[float]
    problem: LayoutProblem | None = field(default=None, repr=False, compare=False)

    @property
    def recomputed(self) -> int:
        return sum(1 for x in self.recompute or () if x)

    def spec(self, model: ModelConfig, slicing: int = 0) -> RunSpec:
        lay, var = self.layout, self.variant
        pipe = PipelineConfig(micro_batch_size=lay.mbs, num_microbatches=lay.m, schedule=lay.schedule,
                              virtual_stages=lay.virtual, partition=self.partition, recompute=self.recompute,
                              bpipe=var.bpipe, slicing=slicing)
        return RunSpec(model=model, tp=lay.tp, pp=lay.pp, dp=lay.dp, pipeline=pipe, sequence_parallel=var.sp,
                       rank_order="bpipe" if var.bpipe else "tp-dp-pp", distributed_optimizer=var.zero1,
                       overlap_grad_reduce=lay.dp > 1)


def even_partition(n_units: int, stages: int) -> tuple[int, ...]:
    base, extra = divmod(n_units, stages)
    return tuple(base + (1 if k >= stages - extra else 0) for k in range(stages))


class ScheduleShapes:
    """Per (pp, m, v, schedule, bpipe): the chunk-micro-batches each rank holds at its peak, per chunk (cached)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, list[list[float]]] = {}

    def counts(self, layout: Layout, bpipe: bool) -> list[list[float]]:
        key = (layout.pp, layout.m, layout.virtual, layout.schedule, bpipe)
        if key not in self._cache:
            pipe = PipelineConfig(micro_batch_size=layout.mbs, num_microbatches=layout.m, schedule=layout.schedule,
                                  virtual_stages=layout.virtual, bpipe=bpipe)
            sched = pipeline_schedule(pipe, layout.pp)
            self._cache[key] = [_counts_at_peak(sched.actions[r], r, layout.virtual) for r in range(layout.pp)]
        return self._cache[key]


def _counts_at_peak(actions, rank: int, v: int) -> list[float]:
    """Chunk-micro-batches per chunk held when the rank holds the most (own and accepted ones alike)."""
    level, best, per, at_best = 0.0, -1.0, [0.0] * v, [0.0] * v
    for h in holding_events(actions, rank):
        level += h.share
        per[h.chunk] += h.share
        if level > best:
            best, at_best = level, list(per)
    return at_best


class LayoutProblem:
    """Unit costs and memory of one layout and variant, and its solver."""

    def __init__(self, layout: Layout, variant: Variant, model: ModelConfig, cluster: Cluster, profiles: Profiles,
                 space: SearchSpace, costs: CostSettings, memory: MemorySettings, shapes: ScheduleShapes,
                 uniform: str | None | bool = False) -> None:
        self.layout, self.variant, self.model, self.space, self.memory = layout, variant, model, space, memory
        self.uniform = uniform  # False: per-unit choices; else this one choice for every transformer unit
        lay = layout
        self.stages = lay.pp * lay.virtual
        self.names = unit_names(model.num_layers)
        n = len(self.names)
        base = Solution(lay, variant, even_partition(n, self.stages), None, 0.0, [], [], [], []).spec(model)
        self.cost = CostModel(base, cluster, profiles, costs)
        self.capacity = [stage_capacity(base, cluster, r) for r in range(lay.pp)]
        self.counts = shapes.counts(lay, variant.bpipe)
        sp = variant.sp and lay.tp > 1
        # per unit: allowed choices, and per choice (forward, backward) per rank, saved bytes, transient bytes
        self.choices: list[tuple[str | None, ...]] = []
        for name in self.names:
            kind = unit_kind(name)
            if kind not in ("attention", "mlp"):
                allowed = (None,)
            elif uniform is not False:  # one choice for every layer; selective leaves MLP units alone
                allowed = (None,) if kind == "mlp" and uniform == "selective" else (uniform,)
            else:
                allowed = tuple(c for c in (None, "selective", "full") if c in space.recompute
                                and (kind == "attention" or c != "selective")) or (None,)
            self.choices.append(allowed)
        kinds = [unit_kind(nm) for nm in self.names]
        per_unit = any(u.unit is not None for ps in profiles.by_type.values() for p in ps for u in p.units)
        self.times: list[list[list[tuple[float, float]]]] = []  # [rank][unit][choice]
        by_device: dict[str, list] = {}
        for r in range(lay.pp):
            dev = self.cost.devices[r]
            key = dev.name
            if key not in by_device:
                table, memo = [], {}
                for i, kind in enumerate(kinds):
                    row = []
                    for c in self.choices[i]:
                        mkey = (kind, c, i if per_unit else None)
                        if mkey not in memo:
                            memo[mkey] = self.cost.unit_times(kind, c, dev, r, i)
                        row.append(memo[mkey])
                    table.append(row)
                by_device[key] = table
            self.times.append(by_device[key])
        act = {}
        self.saved: list[list[float]] = []  # [unit][choice]
        self.transient: list[list[float]] = []
        for i, kind in enumerate(kinds):
            row, trow = [], []
            for c in self.choices[i]:
                if (kind, c) not in act:
                    act[(kind, c)] = float(unit_activation_bytes(kind, model, lay.mbs, lay.tp, sp, c, memory.device))
                row.append(act[(kind, c)])
            full = act.get((kind, None)) or float(unit_activation_bytes(kind, model, lay.mbs, lay.tp, sp, None,
                                                                        memory.device))
            for j, c in enumerate(self.choices[i]):
                trow.append(full - row[j] if c is not None else 0.0)
            self.saved.append(row)
            self.transient.append(trow)
        precision = PrecisionConfig(param_bytes=model.dtype_bytes, distributed_optimizer=variant.zero1)
        per_param = precision.param_bytes + precision.grad_bytes + precision.optimizer_bytes(lay.dp)
        own_output = model.untie_embeddings_and_output_weights or lay.pp > 1
        self.params = [unit_param_count(k, model, lay.tp, output_weight=own_output) for k in kinds]
        self.static = [p * per_param for p in self.params]
        s = model.seq_length // lay.tp if sp else model.seq_length
        self.held = float(s * lay.mbs * model.hidden_size * model.dtype_bytes) if memory.engine_holds_output else 0.0
        self.p2p = self.cost.transfer_time(0, 1, _SEND) if lay.pp > 1 else 0.0
        self._knap: dict[tuple, tuple | None] = {}

    # ---- one partition --------------------------------------------------------------------------------------
    def _rank_units(self, partition: tuple[int, ...], rank: int) -> list[list[int]]:
        return rank_chunks(list(partition), self.layout.pp, rank)

    def evaluate(self, partition: tuple[int, ...]) -> Solution | None:
        """Per rank the fastest recomputation that fits, then the estimate; None when some rank cannot fit."""
        lay = self.layout
        recompute: list[str | None] = [None] * len(self.names)
        fwd = [0.0] * self.stages
        bwd = [0.0] * self.stages
        memory = []
        for r in range(lay.pp):
            chunks = self._rank_units(partition, r)
            got = self._rank_choice(r, chunks)
            if got is None:
                return None
            picks, mem = got
            memory.append(mem)
            for c, units in enumerate(chunks):
                k = c * lay.pp + r
                for i in units:
                    j = picks[i]
                    recompute[i] = self.choices[i][j]
                    f, b = self.times[r][i][j]
                    fwd[k] += f
                    bwd[k] += b
        over = [self.cost._overhead(self.cost.devices[k % lay.pp]) for k in range(self.stages)]
        fwd = [f + o[0] for f, o in zip(fwd, over)]
        bwd = [b + o[1] for b, o in zip(bwd, over)]
        estimate = self._pipeline_time(fwd, bwd) + self._sync_time(partition)
        rc = tuple(recompute) if any(recompute) else None
        return Solution(lay, self.variant, tuple(partition), rc, estimate, fwd, bwd, memory, self.capacity, self)

    def _rank_choice(self, rank: int, chunks: list[list[int]]) -> tuple[dict[int, int], float] | None:
        """{unit: choice index} with the least time under the rank's memory, and the estimated peak bytes."""
        ms = self.memory
        counts = self.counts[rank]
        static = sum(self.static[i] for units in chunks for i in units)
        last = self.stages - 1
        held = sum(counts[c] * self.held for c, _ in enumerate(chunks) if c * self.layout.pp + rank != last)
        room = (self.capacity[rank] - ms.workspace_bytes) / (1 + ms.fragmentation) - static - held
        items = [(i, counts[c]) for c, units in enumerate(chunks) for i in units]
        options = [[(sum(self.times[rank][i][j]), cnt * self.saved[i][j], self.transient[i][j])
                    for j in range(len(self.choices[i]))] for i, cnt in items]
        plain = sum(o[0][1] for o in options) + max(o[0][2] for o in options)
        if plain <= room:  # the first (least recomputing) choice everywhere fits
            picks = {i: 0 for i, _ in items}
            return picks, self._peak(static + held + plain)
        if room <= 0:
            return None
        key = (rank, tuple(tuple(o) for o in options), round(room))
        if key not in self._knap:
            self._knap[key] = choose_options(options, room)
        got = self._knap[key]
        if got is None:
            return None
        choice, _, peak = got
        return {i: choice[n] for n, (i, _) in enumerate(items)}, self._peak(static + held + peak)

    def _peak(self, nbytes: float) -> float:
        return self.memory.workspace_bytes + nbytes * (1 + self.memory.fragmentation)

    def _pipeline_time(self, fwd: list[float], bwd: list[float]) -> float:
        """AMP's pipeline formula: one micro-batch through every stage, then m-1 more at the slowest rank's pace;
        interleaving divides the start-up bubble by the chunks per rank."""
        lay = self.layout
        fb = [f + b for f, b in zip(fwd, bwd)]
        if lay.virtual == 1:
            return sum(fb) + (lay.m - 1) * max(fb) + 2 * (lay.pp - 1) * self.p2p
        per_rank = [sum(fb[k] for k in range(r, self.stages, lay.pp)) for r in range(lay.pp)]
        return lay.m * max(per_rank) + (lay.pp - 1) * max(fb) + 2 * (self.stages - 1) * self.p2p

    def _sync_time(self, partition: tuple[int, ...]) -> float:
        """Data-parallel (and ZeRO-1) gradient synchronisation of the rank with the most parameters."""
        lay = self.layout
        if lay.dp == 1:
            return 0.0
        worst = max(sum(self.params[i] for units in self._rank_units(partition, r) for i in units)
                    for r in range(lay.pp))
        link = self.cost.dp_link(0)
        t = allreduce_time(4.0 * worst, lay.dp, link)
        if self.variant.zero1:
            t += allgather_time(worst * self.model.dtype_bytes, lay.dp, link)
        return t

    # ---- the partition search -----------------------------------------------------------------------------
    def blocks(self) -> list[list[int]]:
        """What a stage is made of: single units, or whole layers (the embedding with the first, the head with
        the last) when stages may not end inside a layer."""
        n = len(self.names)
        if self.space.sublayer:
            return [[i] for i in range(n)]
        layers = [[2 * i + 1, 2 * i + 2] for i in range(self.model.num_layers)]
        layers[0] = [0] + layers[0]
        layers[-1] = layers[-1] + [n - 1]
        return layers

    def solve(self) -> Solution | None:
        """The best (estimated) partition with its recomputation, or None when nothing fits."""
        blocks = self.blocks()
        if self.stages > len(blocks):
            return None
        lay = self.layout
        plain_time = [[sum(sum(self.times[k % lay.pp][i][0]) for i in blk) for blk in blocks]
                      for k in range(self.stages)]
        cnt = [self.counts[k % lay.pp][k // lay.pp] for k in range(self.stages)]
        plain_mem = [[sum(self.static[i] + cnt[k] * (self.saved[i][0]) for i in blk) for blk in blocks]
                     for k in range(self.stages)]
        tight_mem = [[sum(self.static[i] + cnt[k] * self.saved[i][-1] for i in blk) for blk in blocks]
                     for k in range(self.stages)]
        seen: dict[tuple[int, ...], Solution | None] = {}

        def units_of(block_part) -> tuple[int, ...]:
            out, b = [], 0
            for size in block_part:
                out.append(sum(len(blocks[j]) for j in range(b, b + size)))
                b += size
            return tuple(out)

        def score(block_part) -> Solution | None:
            key = tuple(block_part)
            if key not in seen:
                seen[key] = self.evaluate(units_of(key))
            return seen[key]

        starts = [minmax_partition(plain_time, self.stages), minmax_partition(plain_mem, self.stages),
                  minmax_partition(tight_mem, self.stages)]
        if lay.virtual == 1:
            starts.append(amp_partition(plain_time, self.stages, lay.m))
        for s in starts:
            score(s)
        feasible = [k for k, v in seen.items() if v is not None]
        if feasible:  # Galvatron's walk from the most memory-balanced feasible start toward time balance
            mem_start = min(feasible, key=lambda k: max(seen[k].memory))
            time_peak = max(seen[feasible[0]].memory) if tuple(starts[0]) in feasible else 0.0

            def stage_time(part):
                got = score(part)
                if got is None:
                    return [_INF] * len(part)
                return [f + b for f, b in zip(got.stage_forward, got.stage_backward)]

            def stage_memory(part):
                got = score(part)
                if got is None:
                    return [_INF] * len(part)
                return [got.memory[k % lay.pp] for k in range(len(part))]

            budgets = [self.capacity[k % lay.pp] for k in range(self.stages)]
            galvatron_walk(list(mem_start), stage_time, stage_memory, budgets, time_peak, max_steps=24)
        best = [v for v in seen.values() if v is not None]
        return min(best, key=lambda s: s.estimate) if best else None


def lower_bound(problem: LayoutProblem) -> float:
    """No partition beats perfect balance without recomputation (estimate's terms, each at its least)."""
    lay = problem.layout
    total = sum(min(sum(problem.times[r][i][0]) for r in range(lay.pp)) for i in range(len(problem.names)))
    per_rank = total / lay.pp
    return per_rank * (lay.m + (lay.pp - 1) / lay.virtual)


def memory_floor(problem: LayoutProblem) -> float:
    """The least any rank needs: model states spread perfectly, nothing saved."""
    return sum(problem.static) / problem.layout.pp

