"""Galvatron-BMW's per-unit hybrid parallelism: each unit of a pipeline stage runs with its own strategy
(strategy.py) over the stage's N ranks (N = world / pp; Megatron's top-level tp is 1).

Membership: the stage's ranks and each rank's position `local` come from the base layout RankLayout(1, N, pp,
order): local is that layout's dp coordinate. A unit's tp and dp groups are the stage ranks at the local indices
strategy.tp_groups() / dp_groups(). Each unit gets a ParallelView (`UnitState`) whose tp group and dp group
are its strategy's, so the tensor-parallel layers work unchanged per unit.

Data: every rank of a stage holds the whole stage micro-batch (micro-batch size x N samples, what dp ranks 0..N-1
of a uniform run would load, in dp order); a unit works on its dp shard of it, and the hidden state is re-laid out
between units whose strategies differ (relayout.py), across pipeline boundaries too.

Loss and gradients: the head returns its shard's *share* of the loss: sum of token losses x mask x the sample's
weight 1 / (N x mask tokens of its micro-batch-size group), so the shares of the head's dp shards add up to
uniform Megatron's loss (mean over N dp ranks of each rank's mean). The gradient of the sum is then the SUM over a
unit's dp group of its ranks' gradients (plain dp: all-reduce, no division; sharded dp: FSDP2 reduce-scatter
with divide factor 1). So `main_grad` holds the gradient of the same loss as a uniform run, as before.

Tied word embedding: the embedding and the head must have the same strategy, not sharded (then each rank holds the
same vocab shard in both, and the pp>1 copy is summed over the embedding group as in a uniform run); otherwise
untie them (--untie-embeddings-and-output-weights).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, fields

import torch
import torch.distributed as dist
from torch import nn

from ..errors import UsageError
from ..strategy import UnitStrategy, parse_unit_strategies
from ..units import unit_names
from .counting import counted_once
from .layout import RankLayout
from .random import TP_RNG
from .relayout import relayout
from .placement import Uniform
from .view import ParallelView

PARAM_FLAGS = ("tensor_model_parallel", "partition_dim", "sequence_parallel", "shared_embedding", "counts_in_norm",
               "shared_embedding_copy", "embedding_or_output")


class UnitRNG:
    """The rank's RNG tracker as a unit sees it: its tensor-parallel stream is the one of its tp rank (Megatron's
    seed + 2718 + tp rank, see Hybrid.seed), so dropout inside tp regions differs over the unit's tp ranks."""

    def __init__(self, tracker, tp_rank: int) -> None:
        self.tracker, self.name = tracker, f"{TP_RNG}-tp{tp_rank}"

    @property
    def device(self):
        return self.tracker.device

    def fork(self, name: str = TP_RNG):
        return self.tracker.fork(self.name if name == TP_RNG else name)

    def get_states(self):
        return self.tracker.get_states()

    def set_states(self, states) -> None:
        self.tracker.set_states(states)


@dataclass
class UnitState(ParallelView):
    """A ParallelView as one unit sees it: its strategy's tp and dp groups and coordinates."""

    strategy: UnitStrategy = field(default_factory=lambda: UnitStrategy(1, 1))
    local: int = 0

    @property
    def tp_rank(self) -> int:
        return self.strategy.coords(self.local)[0]

    @property
    def tp_size(self) -> int:
        return self.strategy.tp

    @property
    def dp_rank(self) -> int:
        return self.strategy.coords(self.local)[1]

    @property
    def dp_size(self) -> int:
        return self.strategy.dp


@dataclass
class Hybrid(Uniform):
    """This rank's hybrid set-up: one strategy per unit of the model, and the groups of every strategy. The
    placement interface of parallel/placement.py."""

    strategies: tuple[UnitStrategy, ...]
    width: int
    local: int
    stage_group: object  # the N ranks of this rank's stage (the base layout's dp group)
    groups: dict = field(default_factory=dict)  # strategy -> (tp group, dp group) of this rank
    norms_over_world = True  # each distinct gradient element is counted on one rank of the world

    @classmethod
    def build(cls, text, n_units: int, layout: RankLayout, rank: int, stage_group,
              timeout_minutes: float | None = None) -> "Hybrid":
        """Create every distinct strategy's groups (all ranks, same order)."""
        if layout.tp != 1:
            raise UsageError("--unit-strategies needs --tensor-model-parallel-size 1 (each unit sets its own tp)")
        width = layout.dp
        strategies = parse_unit_strategies(text, n_units, width)
        _, local, stage = layout.coords(rank)
        timeout = None if timeout_minutes is None else datetime.timedelta(minutes=timeout_minutes)
        groups = {}
        for s in sorted(set(strategies), key=str):
            mine = [None, None]
            for k, local_groups in enumerate((s.tp_groups(), s.dp_groups())):
                for p in range(layout.pp):
                    for members in local_groups:
                        if len(members) == 1:
                            continue
                        ranks = [layout.rank(0, i, p) for i in members]
                        g = dist.new_group(ranks, timeout=timeout)
                        if p == stage and local in members:
                            mine[k] = g
            groups[s] = tuple(mine)
        return cls(strategies, width, local, stage_group, groups)

    def names(self) -> list[str]:
        return [str(s) for s in self.strategies]

    def unit_state(self, state: ParallelView, index: int) -> UnitState:
        return self.view(state, index)

    def check(self, cfg) -> None:
        check_hybrid(self, cfg)

    def chunks(self, cfg, state: ParallelView, units: dict, chunk_units: list[list[int]], make_chunk=None) -> list:
        """HybridModel chunks: each unit's parameters reduce over its own dp group; sharded units wrapped by FSDP2."""
        names = unit_names(cfg.num_layers)
        for i in (i for c in chunk_units for i in c):
            for p in units[names[i]].parameters():
                if not hasattr(p, "grad_group"):
                    p.grad_group = self.groups[self.strategies[i]][1]
                if getattr(p, "sequence_parallel", False):  # replicated over tp, each rank's gradient partial
                    p.tp_sum_group = self.groups[self.strategies[i]][0]
        chunks = []
        for c in chunk_units:
            mine = {names[i]: units[names[i]] for i in c}
            shard_units(mine, c, self, state.device)
            chunks.append(HybridModel(mine, c, self))
        mark_norm_counting(chunks, self)
        return chunks

    def loader(self, state: ParallelView, micro_batch_size: int) -> tuple[int, int, int]:
        """Every rank of a stage loads the stage micro-batch: what dp ranks 0..N-1 of a uniform run would."""
        return micro_batch_size * self.width, 1, 0

    def hidden_shape(self, cfg, state: ParallelView, micro_batch_size: int) -> tuple[int, int, int]:
        """The whole stage micro-batch (the engine divides it by the dp of the unit before a chunk)."""
        return (cfg.seq_length, micro_batch_size * self.width, cfg.hidden_size)

    def loss_divisor(self, state: ParallelView) -> int:
        return self.loss_replicas()

    def trainable(self, named: list) -> list:
        return local_params(named)

    def grad_sync(self, params: list, state: ParallelView, overlap: bool = False, fusion: bool = True):
        return HybridGradSync(params, state)  # unfused: FSDP's units take their gradients through autograd

    def activation_params(self, chunks: list):
        return lambda: unsharded_storages(chunks)

    def checkpoint_shard(self, state: ParallelView) -> tuple[int, int, bool]:
        """Every rank of a stage holds its own shards: each writes mp_rank_<position in stage>_<stage>."""
        return self.local, self.width, True

    def state_dict(self, chunk) -> dict:
        return local_state_dict(chunk)

    def load_state_dict(self, chunk, sd: dict) -> None:
        load_local_state_dict(chunk, sd)

    def destroy(self) -> None:
        """Drop DTensor's process-wide sharding caches, which keep the FSDP2 meshes (and their groups) alive."""
        try:  # private helpers of torch 2.13; an older or newer torch without them keeps its caches
            from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
            from torch.distributed.tensor.debug import _clear_sharding_prop_cache

            _clear_sharding_prop_cache()
            clear_redistribute_planner_cache()
        except (ImportError, AttributeError):
            pass

    def view(self, state: ParallelView, index: int) -> UnitState:
        """The ParallelView unit `index` is built with."""
        s = self.strategies[index]
        kw = {f.name: getattr(state, f.name) for f in fields(ParallelView)}
        kw.update(tp_group=self.groups[s][0], dp_group=self.groups[s][1], sequence_parallel=False,
                  rng=UnitRNG(state.rng, s.coords(self.local)[0]))
        return UnitState(**kw, strategy=s, local=self.local)

    def seed(self, tracker, seed: int) -> None:
        """Add the tensor-parallel stream of every tp rank a unit may have here (after random.set_seeds)."""
        for t in range(self.width):
            tracker.add(f"{TP_RNG}-tp{t}", seed + 2718 + t)

    # -- data ------------------------------------------------------------------------------------------------
    def weigh(self, batch: dict) -> dict:
        """Add `sample_weights` (see the module doc) to a stage micro-batch, before any slicing into halves."""
        if "sample_weights" in batch or "loss_mask" not in batch:
            return batch
        mask = batch["loss_mask"].float()
        b = mask.size(0)
        if b % self.width:
            raise UsageError(f"a stage micro-batch of {b} samples does not split over {self.width} ranks")
        per = mask.view(self.width, -1).sum(1).clamp(min=1.0)  # tokens of each micro-batch-size group
        weights = (1.0 / (self.width * per)).repeat_interleave(b // self.width)
        return {**batch, "sample_weights": weights}

    def input_dp(self, first_unit: int) -> int | None:
        """dp of the unit before `first_unit` (the layout a chunk receives), None for the embedding."""
        return self.strategies[first_unit - 1].dp if first_unit > 0 else None

    def loss_replicas(self) -> int:
        """How often each head dp shard's loss share is counted over a stage: the head's tp."""
        return self.strategies[-1].tp


def shard_batch(batch: dict, strategy: UnitStrategy, local: int) -> dict:
    """The rows of a unit's dp shard of every batch tensor."""
    if strategy.dp == 1:
        return batch
    b = next(iter(batch.values())).size(0)
    lo, hi = strategy.samples(local, b)
    return {k: v[lo:hi] for k, v in batch.items()}


class HybridModel(nn.Module):
    """A contiguous run of units, each on its strategy: slices its batch shard and re-lays out the hidden state
    coming from the previous unit (of this chunk, or of the previous pipeline stage). State-dict names equal
    ModelChunk's."""

    def __init__(self, units: dict[str, nn.Module], indices: list[int], hybrid: Hybrid) -> None:
        super().__init__()
        self.units = nn.ModuleDict(units)
        self.indices = list(indices)
        self.hybrid = hybrid
        self.input_dp = hybrid.input_dp(self.indices[0])  # batch divisor of the hidden state received ...
        self.output_dp = hybrid.strategies[self.indices[-1]].dp  # ... and of the one sent

    def forward(self, hidden, batch):
        h = self.hybrid
        for i, unit in zip(self.indices, self.units.values()):
            s = h.strategies[i]
            if hidden is not None and i > 0:
                hidden = relayout(hidden, h.strategies[i - 1], s, h.local, h.stage_group)
            hidden = unit(hidden, shard_batch(batch, s, h.local))
        return hidden


def check_hybrid(hybrid: Hybrid, cfg) -> None:
    """Refuse what the hybrid runtime cannot run, in one line."""
    st = hybrid.strategies
    if cfg.model_type != "gpt":
        raise UsageError("--unit-strategies: hybrid strategies run GPT models only")
    for s in sorted(set(st), key=str):
        try:
            cfg.check_tensor_parallel(s.tp)
        except UsageError as err:
            raise UsageError(f"--unit-strategies {s}: " + str(err).replace("--tensor-model-parallel-size ", "tp "))
    if not cfg.untie_embeddings_and_output_weights and (st[0] != st[-1] or st[0].sharded):
        raise UsageError(f"--unit-strategies: a tied word embedding needs the same, unsharded strategy for the "
                         f"embedding and the head (got {st[0]} and {st[-1]}); give "
                         "--untie-embeddings-and-output-weights to use different ones")


# -- sharded units (FSDP2) -----------------------------------------------------------------------------------
def shard_units(units: dict[str, nn.Module], indices: list[int], hybrid: Hybrid, device: torch.device) -> None:
    """fully_shard every unit whose strategy shards dp, over the unit's dp group (gradients summed)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    for i, (name, unit) in zip(indices, units.items()):
        s = hybrid.strategies[i]
        if not s.sharded:
            continue
        flags = {n: {f: getattr(p, f) for f in PARAM_FLAGS if hasattr(p, f)} for n, p in unit.named_parameters()}
        mesh = DeviceMesh.from_group(hybrid.groups[s][1], device_type=device.type)
        fully_shard(unit, mesh=mesh)
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        for n, p in unit.named_parameters():
            for f, v in flags[n].items():
                setattr(p, f, v)
            p.fsdp_sharded = True


def is_sharded(p: torch.Tensor) -> bool:
    return getattr(p, "fsdp_sharded", False)


def local_params(named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
    """What the optimizer updates: FSDP parameters as their local shard (sharing memory), others as they are."""
    out = []
    for n, p in named:
        if is_sharded(p):
            local = p.to_local().detach().requires_grad_(p.requires_grad)  # trainable, outside any graph
            for f in PARAM_FLAGS:
                if hasattr(p, f):
                    setattr(local, f, getattr(p, f))
            local.fsdp_param = p
            out.append((n, local))
        else:
            out.append((n, p))
    return out


def mark_norm_counting(chunks: list[HybridModel], hybrid: Hybrid) -> None:
    """Set `counts_in_norm` on every parameter: each distinct gradient element counted once over the world
    (replicas over a unit's tp and plain dp groups once; sharded dp shards each; the tied copy never)."""
    for chunk in chunks:
        for i, unit in zip(chunk.indices, chunk.units.values()):
            s = hybrid.strategies[i]
            tp_rank, dp_rank = s.coords(hybrid.local)
            for p in unit.parameters():
                p.counts_in_norm = counted_once(p, tp_rank) and (s.sharded or dp_rank == 0)


class HybridGradSync:
    """GradSync's contract for hybrid units: after `finish`, each `main_grad` holds the gradient of the loss (see
    the module doc). Plain parameters accumulate into fp32 buckets (one set per dp group) summed over their unit's
    dp group; sharded ones (their local handles from `local_params`) take FSDP2's reduce-scattered sum; the tied
    embedding copy is summed over the embedding group as in a uniform run."""

    def __init__(self, params: list[torch.Tensor], state: ParallelView, bucket_size: int = 40_000_000) -> None:
        from .grad_sync import _Bucket, weak_grad_hooks
        from .wgrad_accum import set_sinks

        self.state = state
        self.params = [p for p in params if getattr(p, "fsdp_param", None) is not None or p.requires_grad]
        self.sharded = [p for p in self.params if getattr(p, "fsdp_param", None) is not None]
        plain = [p for p in self.params if getattr(p, "fsdp_param", None) is None]
        self.buckets: list = []
        self.groups: list = []
        by_group: dict[int, list] = {}
        keep: dict[int, object] = {}
        for p in reversed(plain):
            g = getattr(p, "grad_group", None)
            by_group.setdefault(id(g), []).append(p)
            keep[id(g)] = g
        for key, ps in by_group.items():
            current: list = []
            for p in ps:
                current.append(p)
                if sum(q.numel() for q in current) >= bucket_size:
                    self.buckets.append(_Bucket(current, state.device))
                    self.groups.append(keep[key])
                    current = []
            if current:
                self.buckets.append(_Bucket(current, state.device))
                self.groups.append(keep[key])
        self._sharded_buffer = _Bucket(self.sharded, state.device) if self.sharded else None
        tp_sums: dict[int, tuple] = {}  # replicated parameters whose gradients are partial over a unit's tp group
        for p in self.params:
            if hasattr(p, "tp_sum_group"):
                tp_sums.setdefault(id(p.tp_sum_group), (p.tp_sum_group, []))[1].append(p)
        self._tp_sums = list(tp_sums.values())
        self._hooks = weak_grad_hooks(self, [p for p in plain if p.requires_grad])
        set_sinks(self, self.params, None)  # unfused: every gradient through autograd and the hooks

    def _on_grad(self, p) -> None:
        if p.grad is None:  # its gradient was deferred (deferred_wgrad)
            return
        p.main_grad.add_(p.grad)
        p.grad = None

    def buffer_bytes(self) -> int:
        bufs = self.buckets + ([self._sharded_buffer] if self._sharded_buffer else [])
        return sum(b.buffer.numel() * b.buffer.element_size() for b in bufs)

    def zero(self) -> None:
        for b in self.buckets + ([self._sharded_buffer] if self._sharded_buffer else []):
            b.buffer.zero_()
        for p in self.sharded:
            p.fsdp_param.grad = None

    def begin(self, backwards_per_param: int) -> None:
        del backwards_per_param

    def finish(self) -> None:
        from .grad_sync import _sum_over

        for b, g in zip(self.buckets, self.groups):
            if g is not None:
                dist.all_reduce(b.buffer, group=g)
        for p in self.sharded:
            grad = p.fsdp_param.grad
            if grad is not None:
                p.main_grad.add_(grad.to_local().reshape(p.shape))
                p.fsdp_param.grad = None
        for group, params in self._tp_sums:  # e.g. the query and key norms of a tp unit
            _sum_over(params, "sequence_parallel", group)
        _sum_over(self.params, "shared_embedding", self.state.embedding_group)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()


def unsharded_storages(modules: list[nn.Module]) -> set[int]:
    """Storage addresses of the sharded units' parameters while gathered (FSDP2's all-gather outputs)."""
    from torch.distributed.fsdp import FSDPModule

    out = set()
    for root in modules:
        for m in root.modules():
            if not isinstance(m, FSDPModule):
                continue
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group is not None else ():
                for t in fp.all_gather_outputs:
                    ptr = t.untyped_storage().data_ptr()
                    if ptr:
                        out.add(ptr)
    return out


def local_state_dict(module: nn.Module) -> dict:
    """module.state_dict() with FSDP2's DTensors as this rank's local shards (what a hybrid checkpoint holds)."""
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in module.state_dict().items()}


@torch.no_grad()
def load_local_state_dict(module: nn.Module, sd: dict) -> None:
    """Inverse of local_state_dict (strict: the same names and shapes), into the parameters' memory."""
    own = module.state_dict()
    missing, extra = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
    if missing or extra:
        raise RuntimeError(f"missing keys {missing[:3]}, unexpected keys {extra[:3]}")
    for k, v in own.items():
        target = v.to_local() if hasattr(v, "to_local") else v
        if tuple(target.shape) != tuple(sd[k].shape):
            raise RuntimeError(f"size mismatch for {k}: checkpoint {tuple(sd[k].shape)}, model {tuple(target.shape)}")
        target.copy_(sd[k])
