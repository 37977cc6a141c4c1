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
from ..strategy import UnitStrategy
from ..units import owns_output_weight, unit_kind, unit_names
from .cluster import Cluster, Link
from .cost_model import CostModel, CostSettings, allgather_time, allreduce_time, optimizer_step_seconds
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
            spec = RunSpec(model=self.model, tp=s.tp, pp=self.pp, dp=s.dp, pipeline=pipe)
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

    def unit_times(self, kind: str, s: UnitStrategy, recompute: str | None = None, index: int | None = None,
                   own_output: bool = True) -> tuple[float, float]:
        """(forward, backward) of one micro-batch: compute, tp collectives, recomputation and FSDP's gathers."""
        key = (kind, s, recompute, index, own_output)
        if key not in self._times:
            cm = self.cost_model(s)
            fwd, bwd = cm.unit_times(kind, recompute, cm.devices[self.stage], self.stage, index)
            if s.sharded:
                nbytes = self.params(kind, s, own_output) * self.model.dtype_bytes
                gather = allgather_time(nbytes, s.dp, self.dp_link(s))
                fwd, bwd = fwd + gather, bwd + 2 * gather  # gather again before backward, then reduce-scatter
            self._times[key] = (fwd, bwd)
        return self._times[key]

    def sync_time(self, kind: str, s: UnitStrategy, own_output: bool = True) -> float:
        """Plain dp: the unit's fp32 gradient all-reduce, once per iteration (bandwidth term: units of one dp
        grouping reduce in one bucket, see stage_sync_time)."""
        if s.sharded or s.dp == 1:
            return 0.0
        return allreduce_time(4.0 * self.params(kind, s, own_output), s.dp, Link(self.dp_link(s).bandwidth, 0.0))

    def stage_sync_time(self, units: list[tuple[str, UnitStrategy, bool]]) -> float:
        """The plain-dp gradient all-reduces of a stage's units (kind, strategy, owns output): one all-reduce per
        dp grouping, one after the other."""
        buckets: dict[tuple, list] = {}
        for kind, s, own in units:
            if s.sharded or s.dp == 1:
                continue
            key = tuple(tuple(g) for g in s.dp_groups())
            buckets.setdefault(key, [s, 0.0])[1] += 4.0 * self.params(kind, s, own)
        return sum(allreduce_time(nbytes, s.dp, self.dp_link(s)) for s, nbytes in buckets.values())

    def hidden_bytes(self, samples: float) -> float:
        return self.model.seq_length * samples * self.model.hidden_size * self.model.dtype_bytes

    def relayout(self, prev: UnitStrategy, nxt: UnitStrategy) -> tuple[float, float]:
        """(forward, backward) seconds to move the hidden state from `prev`'s layout to `nxt`'s (the gradient
        moves back the same way)."""
        return self.move(prev, nxt), self.move(nxt, prev)

    def move(self, src: UnitStrategy, dst: UnitStrategy) -> float:
        """parallel/relayout.py's move: nothing when every rank's new rows lie inside its old ones (a slice),
        else an all-gather of every rank's `src` rows over the stage."""
        if _inside_everywhere(src, dst):
            return 0.0
        n = self.width
        got = n * self.hidden_bytes(self.mbs * n / src.dp)
        return allgather_time(got, n, self.link([list(range(n))]))


def _inside_everywhere(src: UnitStrategy, dst: UnitStrategy) -> bool:
    n = src.dp * dst.dp
    for pos in range(src.width):
        s0, s1 = src.samples(pos, n)
        d0, d1 = dst.samples(pos, n)
        if not (s0 <= d0 and d1 <= s1):
            return False
    return True


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

    def _chunk_tables(self):
        if self._tables is not None:
            return self._tables
        spec = self.spec
        names = unit_names(spec.model.num_layers)
        layout = spec.stage_layout()
        fwd_t, bwd_t, params_t, sync_t = [], [], [], []
        for rank in range(spec.pp):
            sc = self.stage_costs[rank]
            chunks = chunk_unit_indices(layout, rank)
            own = owns_output_weight(spec.model.untie_embeddings_and_output_weights, spec.pp,
                                     [names[i] for c in chunks for i in c])
            fwd, bwd, params, synced = [], [], 0.0, []
            for c in chunks:
                f = b = 0.0
                for i in c:
                    s, kind = self.strategies[i], unit_kind(names[i])
                    uf, ub = sc.unit_times(kind, s, layout.unit_recompute(i), i, own)
                    if i > 0:
                        rf, rb = sc.relayout(self.strategies[i - 1], s)
                        uf, ub = uf + rf, ub + rb
                    f, b = f + uf, b + ub
                    p = sc.params(kind, s, own)
                    params += p / s.dp if s.sharded else p
                    synced.append((kind, s, own))
                over = self._overhead(self.devices[rank])
                fwd.append(f + over[0])
                bwd.append(b + over[1])
            fwd_t.append(fwd)
            bwd_t.append(bwd)
            params_t.append(params)
            sync_t.append(sc.stage_sync_time(synced))
        self._sync = sync_t
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
