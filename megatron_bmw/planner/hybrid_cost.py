"""Time of one unit under a Galvatron-BMW strategy, of the hidden state's re-layout between units, and a cost
model that gives the simulator a hybrid run's durations.

A unit with strategy (t, d) on a stage of N ranks (stage micro-batch B = micro-batch size x N):
  compute and tensor-parallel collectives: the cost model's unit times at tp t and micro-batch B/d, on the
    links of the strategy's tp groups (the slowest of them; their placement follows the rank order);
  plain dp: its fp32 gradients all-reduced over its dp group once per iteration (2(d-1)/d x 4P / B), the units
    of one dp grouping in one bucket;
  sharded dp (FSDP2): per micro-batch its parameters all-gathered before forward and again before backward and
    its gradients reduce-scattered, in the parameter dtype (Galvatron's 1.5 x a DP all-reduce), not overlapped;
  re-layout from the previous unit's strategy (parallel/relayout.py): free when every rank's new samples lie
    inside its old ones (a local slice), else an all-gather of every rank's rows over the stage; the gradient
    moves back the same way (a slice's backward gathers, a gather's backward is usually a slice).
Pipeline p2p carries the sending unit's layout (B/d samples).
"""

from __future__ import annotations

from ..config import PipelineConfig
from ..parallel.layout import RankLayout
from ..pipeline.schedule import Action
from ..strategy import UnitStrategy, local_slice
from ..units import owns_output_weight, unit_kind, unit_names
from .cluster import Cluster, Link
from .comm_cost import allreduce_parts, allreduce_time
from .cost_model import CostModel, CostSettings, optimizer_step_seconds
from .hybrid_memory import local_batch, spec_strategies
from .memory_model import chunk_unit_indices, unit_param_count
from .profile_data import Profiles
from .spec import RunSpec


def strategy_link(cluster: Cluster, stage_ranks: list[int], groups: list[list[int]]) -> Link:
    """The slowest link of any of `groups` (local indices into the stage's global ranks)."""
    links = [cluster.slowest_link([stage_ranks[j] for j in g]) for g in groups if len(g) > 1]
    if not links:
        return Link(float("inf"), 0.0)
    return Link(min(x.bandwidth for x in links), max(x.latency for x in links))


class StageCosts:
    """Unit and re-layout times on one pipeline stage of a hybrid run (width N ranks, per-rank micro-batch
    `mbs`); memoised per strategy."""

    def __init__(self, model, cluster: Cluster, profiles: Profiles | None, settings: CostSettings, pp: int,
                 width: int, mbs: int, stage: int, rank_order: str = "tp-dp-pp", devices=None) -> None:
        self.model, self.cluster, self.profiles, self.settings = model, cluster, profiles or Profiles(), settings
        self.pp, self.width, self.mbs, self.stage = pp, width, mbs, stage
        layout = RankLayout(1, width, pp, rank_order)
        self.ranks = [layout.rank(0, j, stage) for j in range(width)]
        self._devices = devices
        self._models: dict[UnitStrategy, CostModel] = {}
        self._links: dict[tuple, Link] = {}
        self._times: dict[tuple, tuple[float, float]] = {}

    def link(self, groups: list[list[int]]) -> Link:
        key = tuple(tuple(g) for g in groups)
        if key not in self._links:
            self._links[key] = strategy_link(self.cluster, self.ranks, groups)
        return self._links[key]

    def tp_link(self, s: UnitStrategy) -> Link:
        return self.link(s.tp_groups())

    def dp_link(self, s: UnitStrategy) -> Link:
        return self.link(s.dp_groups())

    def cost_model(self, s: UnitStrategy) -> CostModel:
        if s not in self._models:
            units = self.model.num_units
            split = tuple(units // self.pp + (k < units % self.pp) for k in range(self.pp))
            pipe = PipelineConfig(micro_batch_size=local_batch(s, self.mbs), num_microbatches=1, partition=split)
            spec = RunSpec.of(model=self.model, tp=s.tp, pp=self.pp, dp=s.dp, pipeline=pipe)
            placement = {"links": {("tp", self.stage): self.tp_link(s), ("dp", self.stage): self.dp_link(s)}}
            if self._devices is not None:
                placement["devices"] = self._devices
            self._models[s] = CostModel(spec, self.cluster, self.profiles, self.settings, placement)
        return self._models[s]

    @property
    def device(self):
        return self.cost_model(UnitStrategy(1, self.width)).devices[self.stage]

    def overhead(self) -> tuple[float, float]:
        return self.cost_model(UnitStrategy(1, self.width))._overhead(self.device)

    def params(self, kind: str, s: UnitStrategy, own_output: bool = True) -> int:
        """Parameters of the unit's tp shard (before FSDP sharding)."""
        return unit_param_count(kind, self.model, s.tp, own_output)

    @property
    def static_factor(self) -> float:
        """Where CPU ranks share cores: the stretch of CPU work with every rank of the node busy (cost_model.py)."""
        cm = self.cost_model(UnitStrategy(1, self.width))
        return cm.static_factor[self.stage]

    def unit_times(self, kind: str, s: UnitStrategy, recompute: str | None = None, index: int | None = None,
                   own_output: bool = True) -> tuple[float, float]:
        """(forward, backward) of one micro-batch: compute, tp collectives, recomputation and FSDP's gathers."""
        (fw, fl), (bw, bl) = self.unit_parts(kind, s, recompute, index, own_output)
        k = self.static_factor
        return fw * k + fl, bw * k + bl

    def unit_parts(self, kind: str, s: UnitStrategy, recompute: str | None = None, index: int | None = None,
                   own_output: bool = True) -> tuple[tuple[float, float], tuple[float, float]]:
        """unit_times as ((forward work, wait), (backward work, wait)) on a core of its own (cost_model.py's
        split: compute and a collective's bandwidth term are work, its latency waiting)."""
        key = (kind, s, recompute, index, own_output)
        if key not in self._times:
            cm = self.cost_model(s)
            (fw, fl), (bw, bl) = cm.unit_parts(kind, recompute, cm.devices[self.stage], self.stage, index)
            if s.sharded:
                nbytes = self.params(kind, s, own_output) * self.model.dtype_bytes
                work, wait = _gather_parts(nbytes, s.dp, self.dp_link(s))
                fw, fl = fw + work, fl + wait  # gather before forward
                bw, bl = bw + 2 * work, bl + 2 * wait  # gather again before backward, then reduce-scatter
            self._times[key] = ((fw, fl), (bw, bl))
        return self._times[key]

    def sync_time(self, kind: str, s: UnitStrategy, own_output: bool = True) -> float:
        """Plain dp: the unit's fp32 gradient all-reduce, once per iteration (bandwidth term: units of one dp
        grouping reduce in one bucket, see stage_sync_time)."""
        if s.sharded or s.dp == 1:
            return 0.0
        return allreduce_parts(4.0 * self.params(kind, s, own_output), s.dp, self.dp_link(s))[0] * self.static_factor

    def stage_sync_time(self, units: list[tuple[str, UnitStrategy, bool]]) -> float:
        """The plain-dp gradient all-reduces of a stage's units (kind, strategy, owns output): one all-reduce per
        dp grouping, one after the other."""
        work, wait = self.stage_sync_parts(units)
        return work * self.static_factor + wait

    def stage_sync_parts(self, units: list[tuple[str, UnitStrategy, bool]]) -> tuple[float, float]:
        buckets: dict[tuple, list] = {}
        for kind, s, own in units:
            if s.sharded or s.dp == 1:
                continue
            key = tuple(tuple(g) for g in s.dp_groups())
            buckets.setdefault(key, [s, 0.0])[1] += 4.0 * self.params(kind, s, own)
        parts = [allreduce_parts(nbytes, s.dp, self.dp_link(s)) for s, nbytes in buckets.values()]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)

    def hidden_bytes(self, samples: float) -> float:
        return self.model.seq_length * samples * self.model.hidden_size * self.model.dtype_bytes

    def relayout(self, prev: UnitStrategy, nxt: UnitStrategy) -> tuple[float, float]:
        """(forward, backward) seconds to move the hidden state from `prev`'s layout to `nxt`'s (the gradient
        moves back the same way)."""
        k = self.static_factor
        (fw, fl), (bw, bl) = self.relayout_parts(prev, nxt)
        return fw * k + fl, bw * k + bl

    def relayout_parts(self, prev: UnitStrategy, nxt: UnitStrategy):
        return self.move(prev, nxt), self.move(nxt, prev)

    def move(self, src: UnitStrategy, dst: UnitStrategy) -> tuple[float, float]:
        """parallel/relayout.py's move as (work, wait): nothing when every rank's new rows lie inside its old
        ones (a slice), else an all-gather of every rank's `src` rows over the stage."""
        if local_slice(src, dst):
            return 0.0, 0.0
        n = self.width
        got = n * self.hidden_bytes(self.mbs * n / src.dp)
        return _gather_parts(got, n, self.link([list(range(n))]))


def _gather_parts(nbytes: float, n: int, link: Link) -> tuple[float, float]:
    """allgather_time as (bandwidth term, latency term)."""
    if n <= 1:
        return 0.0, 0.0
    return (n - 1) / n * nbytes / link.bandwidth, (n - 1) * link.latency


class HybridCostModel(CostModel):
    """CostModel for a spec with unit_strategies: chunk times from the per-unit strategies (re-layouts included),
    per-unit gradient synchronisation, FSDP-sharded optimizer steps, p2p of the sending unit's layout."""

    def __init__(self, spec: RunSpec, cluster: Cluster, profiles=None, settings: CostSettings = CostSettings(),
                 placement: dict | None = None) -> None:
        super().__init__(spec, cluster, profiles, settings, placement)
        self.strategies = spec_strategies(spec)
        self.stage_costs = [StageCosts(spec.model, cluster, self.profiles, settings, spec.pp, spec.dp,
                                       spec.pipeline.micro_batch_size, r, spec.rank_order, self.devices)
                            for r in range(spec.pp)]
        self._sync: list[float] | None = None

    _bucketed = False  # HybridGradSync reduces per unit group after the pipeline

    def _chunk_tables(self):
        if self._tables is not None:
            return self._tables
        spec = self.spec
        names = unit_names(spec.model.num_layers)
        layout = spec.stage_layout()
        fwd_t, bwd_t, params_t, sync_t, split_t = [], [], [], [], []
        for rank in range(spec.pp):
            sc = self.stage_costs[rank]
            k = self.static_factor[rank]
            chunks = chunk_unit_indices(layout, rank)
            own = owns_output_weight(spec.model.untie_embeddings_and_output_weights, spec.pp,
                                     [names[i] for c in chunks for i in c])
            fwd, bwd, split, params, synced = [], [], [], 0.0, []
            for c in chunks:
                fw = fl = bw = bl = 0.0
                for i in c:
                    s, kind = self.strategies[i], unit_kind(names[i])
                    (a, b), (x, y) = sc.unit_parts(kind, s, layout.unit_recompute(i), i, own)
                    fw, fl, bw, bl = fw + a, fl + b, bw + x, bl + y
                    if i > 0:
                        (a, b), (x, y) = sc.relayout_parts(self.strategies[i - 1], s)
                        fw, fl, bw, bl = fw + a, fl + b, bw + x, bl + y
                    p = sc.params(kind, s, own)
                    params += p / s.dp if s.sharded else p
                    synced.append((kind, s, own))
                over = self._overhead(self.devices[rank])
                fw, bw = fw + over[0], bw + over[1]
                fwd.append(fw * k + fl)
                bwd.append(bw * k + bl)
                split.append((fw, fl, bw, bl))
            fwd_t.append(fwd)
            bwd_t.append(bwd)
            split_t.append(split)
            params_t.append(params)
            work, wait = sc.stage_sync_parts(synced)
            sync_t.append(work * k + wait)
        self._sync = sync_t
        self._split = split_t
        self._tables = (fwd_t, bwd_t, params_t)
        return self._tables

    def dp_sync_time(self, rank: int) -> float:
        self._chunk_tables()
        return self._sync[rank]

    def sp_sync_time(self, rank: int) -> float:
        return 0.0

    def optimizer_gather_time(self, rank: int) -> float:
        return 0.0

    def optimizer_step_time(self, rank: int) -> float:
        return optimizer_step_seconds(self.params[rank], 1, False, self.spec.model.dtype_bytes, self.devices[rank],
                                      self.settings.bandwidth_fraction)

    def embedding_sync_time(self) -> float:
        spec = self.spec
        if spec.pp == 1 or spec.model.untie_embeddings_and_output_weights:
            return 0.0
        tp = self.strategies[0].tp
        nbytes = 4.0 * (spec.model.vocab_size // tp) * spec.model.hidden_size
        first, last = self.layout.rank(0, 0, 0), self.layout.rank(0, 0, spec.pp - 1)
        return allreduce_time(nbytes, 2, self.cluster.link(first, last))

    def transfer_time(self, src: int, dst: int, action: Action) -> float:
        last = chunk_unit_indices(self.spec.stage_layout(), src)[action.chunk][-1] \
            if action.kind.name.startswith("SEND_ACT") else None
        s = self.strategies[last] if last is not None else None
        if s is None:  # gradients travel in the receiving stage's first unit's layout... the sender's of them
            first = chunk_unit_indices(self.spec.stage_layout(), src)[action.chunk][0]
            s = self.strategies[first - 1] if first > 0 else self.strategies[0]
        samples = local_batch(s, self.spec.pipeline.micro_batch_size)
        nbytes = self.stage_costs[src].hidden_bytes(samples) / (2 if action.half is not None else 1)
        return self.p2p_link(src, dst).time(nbytes)
