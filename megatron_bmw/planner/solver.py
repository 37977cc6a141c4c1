"""One layout of the search (degrees, micro-batching, schedule, SP/ZeRO-1/BPipe): the unit partition and the
recomputation of every unit, under each pipeline rank's memory, with a fast estimate of the iteration.

Per unit and recomputation choice the solver knows the forward and backward seconds on each rank's device
(the cost model), the bytes one micro-batch leaves saved and the transient bytes rebuilt in its backward (the
memory model), and the model-state bytes. The schedule says how many micro-batches each rank holds at its peak
(pipeline/holding.py). Then, Galvatron-BMW style: per rank, a knapsack over its units' choices minimises time
under the rank's memory (option_knapsack.py), and partitions are walked from the memory-balanced one toward the
time-balanced one (galvatron_walk), with AutoPipe's min-max and AMP's layer-assignment DP as starts. The
estimate is AMP's pipeline formula (zero-bubble: its variant with the backward split, `_pipeline_time`); the search
simulates the finalists exactly. A zero-bubble schedule's ranks hold micro-batches whole (until B) and as what W
needs (until W): both counts come from the schedule (schedule_shapes.py, ScheduleShapes.counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np

from ..config import ModelConfig, PipelineConfig
from ..pipeline.generators import generate
from ..pipeline.replay import compile_schedule, replay
from ..pipeline.schedule import Action, Kind
from ..units import unit_kind_of, unit_names
from .cluster import Cluster
from .cost_model import CostModel, CostSettings, optimizer_step_seconds
from .evaluate import stage_capacity
from .memory_model import (MemorySettings, layer_checkpoints, layer_transient_extra, shared_output_grad_bytes,
                           unit_param_split)
from .moe_model import Experts
from .option_knapsack import choose_grouped
from .overlap import gather_lead, overlapped_end, reduce_end
from .partitioners import amp_partition, galvatron_walk
from .profile_data import Profiles
from .schedule_shapes import ScheduleShapes, bubble_fill
from .space import Layout, SearchSpace, zero_bubble
from .spec import RunSpec
from .unit_activations import unit_activation_bytes, unit_transient_bytes, unit_wgrad_bytes
from .v_layout import stage_places, v_pipeline_time, v_starts

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
        pipe = PipelineConfig(micro_batch_size=lay.micro_batch_size, num_microbatches=lay.num_microbatches, schedule=lay.schedule,
                              virtual_stages=lay.virtual_stages, partition=self.partition, recompute=self.recompute,
                              bpipe=var.bpipe, slicing=slicing)
        grad_dp = lay.dp * lay.cp  # the gradients' group
        return RunSpec.of(model=model, tp=lay.tp, pp=lay.pp, dp=lay.dp, pipeline=pipe, sequence_parallel=var.sp,
                          rank_order="bpipe" if var.bpipe else "tp-dp-pp", distributed_optimizer=var.zero1,
                          overlap_grad_reduce=grad_dp > 1, overlap_param_gather=var.zero1 and grad_dp > 1, cp=lay.cp,
                          ep=lay.ep, etp=lay.etp)


def even_partition(n_units: int, stages: int) -> tuple[int, ...]:
    base, extra = divmod(n_units, stages)
    return tuple(base + (1 if k >= stages - extra else 0) for k in range(stages))


class LayoutProblem:
    """Unit costs and memory of one layout and variant, and its solver."""

    def __init__(self, layout: Layout, variant: Variant, model: ModelConfig, cluster: Cluster, profiles: Profiles,
                 space: SearchSpace, costs: CostSettings, memory: MemorySettings, shapes: ScheduleShapes,
                 uniform: str | None | bool = False) -> None:
        self.layout, self.variant, self.model, self.space, self.shapes = layout, variant, model, space, shapes
        self.memory = memory.for_layout(model, layout.tp, layout.dp, layout.pp, layout.micro_batch_size, variant.sp,
                                        layout.cp)
        self.uniform = uniform  # False: per-unit choices; else this one choice for every transformer unit
        self.stages = layout.pp * layout.virtual_stages
        self.where, self.rank_stages = stage_places(layout.pp, self.stages, layout.placement)  # (rank, chunk)
        self.names = unit_names(model.num_layers)
        self.cost, self.capacity = self._placement(cluster, profiles, costs)
        self.counts = shapes.counts(layout, variant.bpipe)
        self.zero_bubble = zero_bubble(layout.schedule)
        self.zb_credit = shapes.zero_bubble_credit(layout.schedule, layout.pp, layout.num_microbatches) \
            if self.zero_bubble and layout.placement != "v" else 0.0  # ZB-V's: v_layout.v_pipeline_time
        self._short = None  # a zero-bubble schedule of m < p, compiled once for the estimate
        # per unit kind (units of a kind share their rows): allowed choices, and per choice (forward, backward)
        # per rank, saved bytes and transient bytes
        kinds = [unit_kind_of(model, nm) for nm in self.names]
        self.experts = Experts(layout.ep, layout.etp or layout.tp, memory.moe_imbalance)
        allowed = self._allowed_choices(kinds)
        self.choices: list[tuple[str | None, ...]] = [allowed[k] for k in kinds]
        self.times: list[list[list[tuple[float, float]]]]  # [rank][unit][choice]
        self.wtimes: list[list[float]]  # [rank][unit]: W, part of the backward (zero-bubble only)
        self.times, self.wtimes = self._unit_times(kinds, allowed, profiles)
        self.saved: list[list[float]]  # [unit][choice]: one micro-batch's saved bytes
        self.wsaved: list[float]  # [unit]: what B keeps for W (zero-bubble only)
        self.transient: list[list[float]]  # [unit][choice]: what its backward holds beside the saved bytes
        self.saved, self.wsaved, self.transient = self._unit_bytes(kinds, allowed)
        self.params, self.static = self._model_states(kinds)
        self.p2p = self.cost.transfer_time(0, 1, _SEND) if layout.pp > 1 else 0.0
        self.embedding_sync = self.cost.embedding_sync_time()
        self._knap = shapes.knapsacks  # shared: the same units and room give the same choice in any layout
        self._ranks: dict[tuple, tuple | None] = {}  # interleaved ranks' choices by their chunks
        self._mix_tables: dict[int, np.ndarray] = {}  # per rank, its mixes as one array (_heaviest)
        self._plans: dict[tuple, tuple | None] = {}  # every rank's plan by its chunks (evaluate)
        self._syncs: dict[tuple, tuple[float, float]] = {}  # and its synchronisation (_sync_time)
        self._over: list[tuple[float, float]] | None = None

    # ---- the layout's unit tables -----------------------------------------------------------------------------
    def _placement(self, cluster: Cluster, profiles: Profiles, costs: CostSettings) -> tuple[CostModel, list[float]]:
        """The layout's cost model (devices and links shared by the layouts of its placement), ranks' capacities."""
        lay, model, shapes = self.layout, self.model, self.shapes
        blocks = stage_blocks(model.num_layers, self.space.sublayer)  # (another engine's stages hold whole layers)
        start = block_units(blocks, even_partition(len(blocks), self.stages)) if len(blocks) >= self.stages \
            else even_partition(len(self.names), self.stages)
        base = Solution(lay, self.variant, start, None, 0.0, [], [], [], []).spec(model)
        place_key = (lay.tp, lay.pp, lay.dp, base.rank_order, lay.cp, lay.ep, lay.etp)
        placement = shapes.placements.setdefault(place_key, {})
        cost = CostModel(base, cluster, profiles, costs, placement)
        if "capacity" not in placement:
            placement["capacity"] = [stage_capacity(base, cluster, r) for r in range(lay.pp)]
        return cost, placement["capacity"]

    def _allowed_choices(self, kinds: list[str]) -> dict[str, tuple[str | None, ...]]:
        """Per unit kind, the recomputation choices the space (or the one `uniform` choice) allows it."""
        uniform, allowed = self.uniform, {}
        for kind in set(kinds):
            if kind not in ("attention", "mlp"):
                allowed[kind] = (None,)
            elif uniform is not False:  # one choice for every layer; selective leaves MLP units alone
                allowed[kind] = (None,) if kind == "mlp" and uniform == "selective" else (uniform,)
            else:
                allowed[kind] = tuple(c for c in (None, "selective", "full") if c in self.space.recompute
                                      and (kind == "attention" or c != "selective")) or (None,)
        return allowed

    def _unit_times(self, kinds: list[str], allowed: dict, profiles: Profiles):
        """Per rank, per unit, per choice: (forward, backward) seconds; and per rank, per unit, its W (zero-bubble)."""
        lay, memo = self.layout, self.shapes.unit_times
        sp = self.variant.sp and lay.tp > 1
        per_unit = any(u.unit is not None for ps in profiles.by_type.values() for p in ps for u in p.units)
        times: list[list[list[tuple[float, float]]]] = []
        wtimes: list[list[float]] = []
        by_device: dict[tuple, list] = {}
        for r in range(lay.pp):
            dev = self.cost.devices[r]
            link = self.cost.tp_link(r) if lay.tp > 1 else None
            cp_link = self.cost.cp_link(r) if lay.cp > 1 else None
            place = (dev.name, None if link is None else (link.bandwidth, link.latency), lay.tp, sp, lay.micro_batch_size,
                     self.model.vocab_size, lay.cp, None if cp_link is None else (cp_link.bandwidth, cp_link.latency),
                     lay.ep, lay.etp, self.cost.experts.imbalance)
            if place not in by_device:
                rows: dict = {}
                for i, kind in enumerate(kinds):
                    key = (kind, i if per_unit else None)
                    if key not in rows:
                        row = []
                        for c in allowed[kind]:
                            mkey = place + (kind, c, key[1])
                            if mkey not in memo:
                                memo[mkey] = self.cost.unit_times(kind, c, dev, r, i)
                            row.append(memo[mkey])
                        rows[key] = row
                by_device[place] = [rows[(k, i if per_unit else None)] for i, k in enumerate(kinds)]
            times.append(by_device[place])
            if self.zero_bubble:
                factor = self.cost.static_factor[r]
                if (place, factor) not in by_device:
                    row = []
                    for i, kind in enumerate(kinds):
                        wkey = place + ("wgrad", kind, i if per_unit else None)
                        if wkey not in memo:
                            memo[wkey] = self.cost.wgrad_parts(kind, dev, i)
                        work, wait = memo[wkey]
                        row.append(work * factor + wait)
                    by_device[(place, factor)] = row
                wtimes.append(by_device[(place, factor)])
        return times, wtimes

    def _unit_bytes(self, kinds: list[str], allowed: dict):
        """Per unit: per choice the bytes one micro-batch leaves saved, what B keeps for W, per choice the transient."""
        lay, model, memory, shapes = self.layout, self.model, self.memory, self.shapes
        sp = self.variant.sp and lay.tp > 1

        def saved(kind, c):
            te = memory.engine.megatron_core_runtime  # Transformer Engine's attention saves less (memory_model.py)
            key = (kind, c, lay.micro_batch_size, lay.tp, sp, memory.device, model.vocab_size, lay.cp, self.experts, te)
            if key not in shapes.saved_bytes:
                shapes.saved_bytes[key] = float(unit_activation_bytes(
                    kind, model, lay.micro_batch_size, lay.tp, sp, c, memory.device, lay.cp, experts=self.experts, te=te))
            return shapes.saved_bytes[key]

        # an engine that checkpoints whole layers keeps one input per fully recomputed layer (memory_model.py)
        layered = self.uniform == "full" and not self.space.sublayer and layer_checkpoints(memory.engine)
        kind_saved = {k: [0.0 if layered and k == "mlp" else saved(k, c) for c in allowed[k]] for k in allowed}
        kind_transient = {k: [float(unit_transient_bytes(k, model, lay.micro_batch_size, lay.tp, sp, c, memory.device,
                                                         lay.cp, "p2p", self.experts)
                                    + (layer_transient_extra(model, lay.micro_batch_size, lay.tp, sp, memory.device,
                                                             lay.cp) if layered and k == "mlp" else 0))
                              for c in allowed[k]] for k in allowed}
        wsaved = [float(unit_wgrad_bytes(k, model, lay.micro_batch_size, lay.tp, sp, lay.cp)) for k in kinds] \
            if self.zero_bubble else [0.0] * len(kinds)
        return [kind_saved[k] for k in kinds], wsaved, [kind_transient[k] for k in kinds]

    def _model_states(self, kinds: list[str]) -> tuple[list[float], list[float]]:
        """Per unit: its parameters on one tensor-parallel rank (an MoE unit's expert ones counted as the dense ones
        whose reduction takes as long: CommCosts.reduced_elements), and their model-state bytes (ZeRO-1's shard: the
        dense parameters' over dp x cp, the expert ones' over edp)."""
        lay, model = self.layout, self.model
        precision = self.memory.precision(model, self.variant.zero1)
        base = precision.param_bytes + precision.grad_bytes
        dense_shards, expert_shards = lay.dp * lay.cp, lay.tp * lay.cp * lay.dp // (self.experts.etp * self.experts.ep)
        own_output = model.untie_embeddings_and_output_weights or lay.pp > 1
        splits = [unit_param_split(k, model, lay.tp, own_output, self.experts) for k in kinds]
        static = [d * (base + precision.optimizer_bytes(dense_shards))
                  + x * (base + precision.optimizer_bytes(expert_shards)) for d, x in splits]
        return [self.cost.reduced_elements(0, d, x) for d, x in splits], static

    # ---- one partition --------------------------------------------------------------------------------------
    def _rank_keys(self, partition: tuple[int, ...]) -> list[tuple]:
        """Per rank, its chunks as (first unit, units): what its plan depends on."""
        starts = [0, *accumulate(partition)]
        return [tuple((starts[k], partition[k]) for k in ks) for ks in self.rank_stages]

    def evaluate(self, partition: tuple[int, ...]) -> Solution | None:
        """Per rank the fastest recomputation that fits, then the estimate; None when some rank cannot fit."""
        lay = self.layout
        stages = self.stages
        fwd = [0.0] * stages
        bwd = [0.0] * stages
        wgt = [0.0] * stages
        memory = []
        keys = self._rank_keys(partition)
        plans = []
        recomputes = False
        cache = self._plans
        for r, key in enumerate(keys):
            got = cache.get((r, key), False)
            if got is False:
                got = self._rank_plan(r, key)
            if got is None:
                return None
            mem, chunk_plans, recomputed = got
            memory.append(mem)
            plans.append(chunk_plans)
            if recomputed:
                recomputes = True
            for k, (_, _, f, b, w) in zip(self.rank_stages[r], chunk_plans):
                fwd[k] = f
                bwd[k] = b
                wgt[k] = w
        # zero-bubble: the last gradient actions, which the reduction overlaps, are the W's
        estimate = self._pipeline_time(fwd, bwd, wgt) + self._sync_time(keys, plans, fwd,
                                                                         wgt if self.zero_bubble else bwd)
        rc = None
        if recomputes:  # stage k is chunk c of rank r (where[k]), and stages follow the units
            rc = tuple(x for r, c in self.where for x in plans[r][c][0])
        return Solution(lay, self.variant, tuple(partition), rc, estimate, fwd, bwd, memory, self.capacity, self)

    def _rank_plan(self, rank: int, key: tuple):
        """Memoised per rank and unit ranges (the walk moves one boundary, so most ranks repeat): the rank's peak
        bytes, per chunk (its units' choices and their indices, forward and backward seconds with the stage's
        fixed overheads, and (zero-bubble) weight-gradient seconds), and whether any unit recomputes; or None."""
        plans = self._plans
        full = (rank, key)
        if full in plans:
            return plans[full]
        chunks = [list(range(start, start + size)) for start, size in key]
        got = self._rank_choice(rank, chunks)
        if got is None:
            plans[full] = None
            return None
        picks, mem = got
        out = []
        times = self.times[rank]
        over_f, over_b = self._overheads()[rank]
        for units in chunks:
            f = b = w = 0.0
            picked, idx = [], []
            for i in units:
                j = picks[i]
                idx.append(j)
                picked.append(self.choices[i][j])
                uf, ub = times[i][j]
                f += uf
                b += ub
                if self.zero_bubble:
                    w += self.wtimes[rank][i]
            out.append((picked, idx, f + over_f, b + over_b, w))
        plans[full] = (mem, out, any(x for chunk in out for x in chunk[0]))
        return plans[full]

    def _overheads(self) -> list[tuple[float, float]]:
        if self._over is None:
            self._over = [self.cost._overhead(self.cost.devices[k % self.layout.pp]) for k in range(self.stages)]
        return self._over

    def _rank_choice(self, rank: int, chunks: list[list[int]]) -> tuple[dict[int, int], float] | None:
        """{unit: choice index} with the least time under the rank's memory, and the estimated peak bytes.

        With several mixes (interleaving) the knapsack takes the heaviest mix without recomputation; when its
        choice makes another mix heavier, it runs again on the two mixes' chunk-by-chunk maximum (safe)."""
        mixes = self.counts[rank]
        if len(mixes) == 1:
            return self._choice_for(rank, chunks, mixes[0])
        key = (rank, tuple((units[0], len(units)) for units in chunks))
        if key not in self._ranks:
            self._ranks[key] = self._mixed_choice(rank, chunks, mixes)
        return self._ranks[key]

    def _slot_bytes(self, chunks: list[list[int]], picks) -> list[float]:
        """Per slot of a mix (each chunk; with split backwards then each chunk's part held for W): one
        micro-batch's bytes under `picks` (None: no recomputation)."""
        whole = [sum(self.saved[i][0 if picks is None else picks[i]] for i in units) for units in chunks]
        return whole + [sum(self.wsaved[i] for i in units) for units in chunks] if self.zero_bubble else whole

    def _heaviest(self, rank: int, mixes: list[list[float]], slot_bytes: list[float]) -> list[float]:
        """The first mix holding the most bytes (max over mixes of sum(n x b), the same sums vectorised)."""
        table = self._mix_tables.get(rank)
        if table is None:
            table = self._mix_tables[rank] = np.array(mixes, dtype=float)
        return mixes[int(np.argmax((table * np.array(slot_bytes)).sum(axis=1)))]

    def _mixed_choice(self, rank: int, chunks: list[list[int]], mixes: list[list[float]]):
        counts = self._heaviest(rank, mixes, self._slot_bytes(chunks, None))
        for _ in range(len(chunks) + 1):
            got = self._choice_for(rank, chunks, counts)
            if got is None:
                return None
            picks = got[0]
            chunk_bytes = self._slot_bytes(chunks, picks)
            heaviest = self._heaviest(rank, mixes, chunk_bytes)
            if sum(n * b for n, b in zip(heaviest, chunk_bytes)) <= sum(n * b for n, b in zip(counts, chunk_bytes)):
                return got
            counts = [max(a, b) for a, b in zip(counts, heaviest)]
        return self._choice_for(rank, chunks, counts)

    def _choice_for(self, rank: int, chunks: list[list[int]], counts: list[float]):
        ms = self.memory
        # the tied output weight's gradient, held from the head's backward to the embedding's where one rank has both
        # (memory_model._backward_transient): as the exact model counts it, beside the model states
        held = shared_output_grad_bytes(self.model, self.layout.tp, self.layout.pp,
                                        [self.names[i] for units in chunks for i in units], ms.engine)
        static = sum(self.static[i] for units in chunks for i in units) + held
        room = (self.capacity[rank] - ms.workspace_bytes) / (1 + ms.fragmentation) - static
        held_w = counts[len(chunks):] if self.zero_bubble else [0.0] * len(chunks)  # slots held for W
        items = [(i, counts[c], held_w[c]) for c, units in enumerate(chunks) for i in units]
        options = [[(sum(self.times[rank][i][j]), cnt * self.saved[i][j] + cw * self.wsaved[i], self.transient[i][j])
                    for j in range(len(self.choices[i]))] for i, cnt, cw in items]
        plain = sum(o[0][1] for o in options) + max(o[0][2] for o in options)
        if plain <= room:  # the first (least recomputing) choice everywhere fits
            return {i: 0 for i, _, _ in items}, self._peak(static + plain)
        if room <= 0:
            return None
        order = sorted(range(len(options)), key=lambda n: options[n])  # the same units in any order: one entry
        key = (tuple(tuple(options[n]) for n in order), round(room))
        if key not in self._knap:
            self._knap[key] = choose_grouped([options[n] for n in order], room)
        got = self._knap[key]
        if got is None:
            return None
        choice, _, peak = got
        return {items[n][0]: choice[k] for k, n in enumerate(order)}, self._peak(static + peak)

    def _peak(self, nbytes: float) -> float:
        return self.memory.workspace_bytes + nbytes * (1 + self.memory.fragmentation)

    def _pipeline_time(self, fwd: list[float], bwd: list[float], wgt: list[float] | None = None) -> float:
        """AMP's pipeline formula: one micro-batch through every stage, then m-1 more at the slowest rank's pace;
        interleaving divides the start-up bubble by the chunks per rank. Zero-bubble (`wgt`: each stage's W, part
        of its backward): the micro-batch goes through on forwards and input gradients B only, the last W follows,
        and the schedule's W's fill n bubbles of min(F, B, W) (stage means; n = zb_credit, from the schedule). On
        equal stages that is ZB-H1 exactly for m >= p: m(F + B + W) + (p - 1) max(F + B - W, F, B), Qi et al.'s
        (p - 1)(F + B - W) where W <= F, B; ZB-2p's extra warm-up fills each with min(B, 2W) (bubble_fill), so
        its start-up is (p - 1) max(F, F + B - 2W). With fewer micro-batches than stages (a short schedule) the schedule
        itself is replayed on the stage times."""
        lay = self.layout
        if lay.placement == "v":
            return v_pipeline_time(self, fwd, bwd, wgt)
        fb = [f + b for f, b in zip(fwd, bwd)]
        if self.zero_bubble and lay.num_microbatches < lay.pp:
            if self._short is None:
                self._short = compile_schedule(generate(lay.schedule, lay.pp, lay.num_microbatches))
            kinds = {Kind.FORWARD: fwd, Kind.BACKWARD_WEIGHT: wgt}
            inputs = [b - w for b, w in zip(bwd, wgt)]
            return replay(self._short, lambda r, a: kinds.get(a.kind, inputs)[r], lambda s, d, a: self.p2p,
                          record=False).makespan
        if self.zero_bubble:
            n = len(fb)
            f_mean, w_mean = sum(fwd) / n, sum(wgt) / n
            b_mean = sum(bwd) / n - w_mean
            return sum(fb) - sum(wgt) + (lay.num_microbatches - 1) * max(fb) + w_mean \
                - self.zb_credit * bubble_fill(lay.schedule, f_mean, b_mean, w_mean, lay.pp, lay.num_microbatches) \
                + 2 * (lay.pp - 1) * self.p2p
        if lay.virtual_stages == 1:
            return sum(fb) + (lay.num_microbatches - 1) * max(fb) + 2 * (lay.pp - 1) * self.p2p
        per_rank = [sum(fb[k] for k in range(r, self.stages, lay.pp)) for r in range(lay.pp)]
        return lay.num_microbatches * max(per_rank) + (lay.pp - 1) * max(fb) + 2 * (self.stages - 1) * self.p2p

    def _sync_time(self, keys: list[tuple], plans: list, fwd: list[float], bwd: list[float]) -> float:
        """What the gradient synchronisation adds after the pipeline (CostModel.finish_times, overlap.py): per rank
        the buckets of its chunks, each chunk's last backward taken back to back at the end (chunk 0's last), the
        optimizer step and ZeRO-1's gather (behind the first forward, which starts when the stages before it
        have run one); the tied embedding's sum. Memoised per rank plan, as _rank_plan."""
        lay = self.layout
        worst = first = 0.0
        for r in range(lay.pp):
            key = (r, keys[r])
            got = self._syncs.get(key)
            if got is None:
                units = [[(self.params[i], self._sync_times(r, i, j)) for i, j in zip(range(start, start + size),
                                                                                      plan[1])]
                         for (start, size), plan in zip(keys[r], plans[r])]
                got = self._syncs[key] = self.exposed_sync(units, [bwd[k] for k in self.rank_stages[r]], fwd[r])
            after, lead = got
            total = after + lead - first if lead > first else after
            if total > worst:
                worst = total
            first += fwd[r] + self.p2p
        return worst + self.embedding_sync

    def _sync_times(self, rank: int, unit: int, pick: int) -> tuple[float, float]:
        """(forward, last gradient action) of a unit: its backward, or with split backwards its W."""
        f, b = self.times[rank][unit][pick]
        return (f, self.wtimes[rank][unit]) if self.zero_bubble else (f, b)

    def exposed_sync(self, units: list[list[tuple[float, tuple[float, float]]]], chunk_backward: list[float],
                     first_forward: float) -> tuple[float, float]:
        """For a rank with `units` per chunk [(params, (forward, last gradient action))] whose first forward takes
        `first_forward`: (what follows the pipeline: the part of its gradient reduction its last backwards do not
        hide, the optimizer step; ZeRO-1's gather lead: a first forward starting at s waits max(0, lead - s))."""
        lay = self.layout
        params = sum(n for chunk in units for n, _ in chunk)
        step = optimizer_step_seconds(params, lay.dp * lay.cp, self.variant.zero1, self.model.dtype_bytes,
                                      self.cost.devices[0], self.cost.settings.bandwidth_fraction)
        if lay.dp * lay.cp == 1:
            return step, 0.0
        spans, t = [], 0.0
        for b in reversed(chunk_backward):  # chunk v-1's last backward first, chunk 0's ends the pipeline
            spans.append((t - b, t))
            t -= b
        spans.reverse()
        spans = [(s - t, e - t) for s, e in spans]  # from 0 to the sum
        end = -t
        chunks = [(s, e, [(n, b) for n, (_, b) in chunk]) for (s, e), chunk in zip(spans, units)]
        exposed = reduce_end(chunks, end, self.cost.dp_reduce_seconds(0), True,
                             self.cost.settings.overlap_factor) - end
        lead = 0.0
        if self.variant.zero1:
            total = sum(f for _, (f, _) in units[0])
            scale = first_forward / total if total > 0 else 0.0
            lead = gather_lead([(n, f * scale) for n, (f, _) in units[0]], self.cost.gather_seconds(0))
        return exposed + step, lead

    # ---- the partition search -----------------------------------------------------------------------------
    def blocks(self) -> list[list[int]]:
        return stage_blocks(self.model.num_layers, self.space.sublayer)

    def solve(self) -> Solution | None:
        """The best (estimated) partition with its recomputation, or None when nothing fits."""
        blocks = self.blocks()
        if self.stages > len(blocks):
            return None
        lay = self.layout
        tables = {id(t): t for t in self.times}
        by_table = {key: [sum(sum(t[i][0]) for i in blk) for blk in blocks] for key, t in tables.items()}
        plain_time = next(iter(by_table.values())) if len(by_table) == 1 else \
            tuple(by_table[id(self.times[r])] for r, _ in self.where)  # per stage if devices differ
        cnt = [self.counts[r][0][c] for r, c in self.where]
        if self.zero_bubble:  # every micro-batch a chunk holds, whole or for W
            v = lay.virtual_stages
            cnt = [max(mix[c] + mix[c + v] for mix in self.counts[r]) for r, c in self.where]
        static = [sum(self.static[i] for i in blk) for blk in blocks]
        most = [sum(self.saved[i][0] for i in blk) for blk in blocks]
        least = [sum(self.saved[i][-1] for i in blk) for blk in blocks]
        seen: dict[tuple[int, ...], Solution | None] = {}
        unit_blocks = len(blocks) == len(self.names)

        def score(block_part) -> Solution | None:
            key = tuple(block_part)
            if key not in seen:
                seen[key] = self.evaluate(key if unit_blocks else block_units(blocks, key))
            return seen[key]

        if lay.placement == "v":  # each rank's two chunks balanced together (v_layout.py), for time and memory
            starts = v_starts(self.shapes, lay.pp, plain_time, [(static, most, cnt)])
        else:
            starts = [self.shapes.minmax(plain_time, self.stages),
                      self.shapes.minmax_memory(static, most, cnt), self.shapes.minmax_memory(static, least, cnt)]
        if lay.virtual_stages == 1 and len(by_table) > 1:  # on one device type AMP's objective is min-max plus a constant
            starts.append(amp_partition(plain_time, self.stages, lay.num_microbatches))
        for s in starts:
            score(s)
        feasible = [k for k, v in seen.items() if v is not None]
        if feasible:  # Galvatron's walk from the most memory-balanced feasible start toward time balance
            mem_start = min(feasible, key=lambda k: max(seen[k].memory))
            time_peak = max(seen[feasible[0]].memory) if tuple(starts[0]) in feasible else 0.0
            v_shape = lay.placement == "v"  # a stage's time is its rank's

            def stage_time(part):
                got = score(part)
                if got is None:
                    return [_INF] * len(part)
                fb = [f + b for f, b in zip(got.stage_forward, got.stage_backward)]
                return [sum(fb[j] for j in self.rank_stages[r]) for r, _ in self.where] if v_shape else fb

            def stage_memory(part):
                got = score(part)
                if got is None:
                    return [_INF] * len(part)
                return [got.memory[r] for r, _ in self.where]

            budgets = [self.capacity[r] for r, _ in self.where]
            galvatron_walk(list(mem_start), stage_time, stage_memory, budgets, time_peak, max_steps=24)
        best = [v for v in seen.values() if v is not None]
        return min(best, key=lambda s: s.estimate) if best else None


def lower_bound(problem: LayoutProblem) -> float:
    """No partition beats perfect balance without recomputation (estimate's terms, each at its least)."""
    lay = problem.layout
    tables = list({id(t): t for t in problem.times}.values())  # ranks on one device type share a table
    total = sum(min(sum(t[i][0]) for t in tables) for i in range(len(problem.names)))
    backward = sum(min(t[i][0][1] for t in tables) for i in range(len(problem.names)))
    per_rank = total / lay.pp
    start_up = 0.0 if problem.zero_bubble else (lay.pp - 1) / lay.virtual_stages  # W's may fill every bubble
    return per_rank * (lay.num_microbatches + start_up) + least_sync(problem, backward / lay.pp) + problem.embedding_sync


def least_sync(problem: LayoutProblem, backward: float) -> float:
    """No rank's synchronisation after the pipeline is less than this, for a rank with the mean parameters whose
    backwards take `backward` in all: its gradients cannot be reduced before its last backwards start, and
    overlap.overlapped_end with one bucket ready at their start ends no later than with several ready later
    (for an overlap factor <= 2); ZeRO-1's gather may be hidden entirely."""
    lay, cost = problem.layout, problem.cost
    params = sum(problem.params) / lay.pp
    step = optimizer_step_seconds(params, lay.dp * lay.cp, problem.variant.zero1, problem.model.dtype_bytes,
                                  cost.devices[0], cost.settings.bandwidth_fraction)
    if lay.dp * lay.cp == 1:
        return step
    sync = cost.dp_reduce_seconds(0)(params)
    factor = min(cost.settings.overlap_factor, 2.0)
    return overlapped_end([(0.0, sync)], backward, True, factor) - backward + step


def could_fit(problem: LayoutProblem, zero1: bool) -> bool:
    """Whether any partition could fit, with ZeRO-1 if `zero1`: all ranks together hold the model states and at
    least the fewest micro-batches any rank holds of every unit's smallest saved bytes."""
    lay, ms = problem.layout, problem.memory
    per_param = problem.memory.precision(problem.model, zero1)
    static = sum(problem.params) * (per_param.param_bytes + per_param.grad_bytes
                                    + per_param.optimizer_bytes(lay.dp * lay.cp))
    least = min(max(min(mix) for mix in mixes) for mixes in problem.counts) * sum(min(s) for s in problem.saved)
    room = sum((c - ms.workspace_bytes) / (1 + ms.fragmentation) for c in problem.capacity)
    return static + least <= room


def block_units(blocks: list[list[int]], block_part) -> tuple[int, ...]:
    """Units per stage of a partition given in blocks per stage."""
    out, b = [], 0
    for size in block_part:
        out.append(sum(len(blocks[j]) for j in range(b, b + size)))
        b += size
    return tuple(out)


def stage_blocks(num_layers: int, sublayer: bool) -> list[list[int]]:
    """What a stage is made of: single units, or whole layers (the embedding with the first, the head with the
    last) when stages may not end inside a layer."""
    n = 2 * num_layers + 2
    if sublayer:
        return [[i] for i in range(n)]
    layers = [[2 * i + 1, 2 * i + 2] for i in range(num_layers)]
    layers[0] = [0] + layers[0]
    layers[-1] = layers[-1] + [n - 1]
    return layers
