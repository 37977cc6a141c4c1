"""Communication costs (AMP's formulas, B the slowest link of the group, plus per-step latency):
  ring all-reduce 2(n-1)/n x M / B; all-gather and reduce-scatter (n-1)/n x M / B; p2p v / b + latency;
and the cost model's communication (`CommCosts`, part of cost_model.CostModel): the links between a layout's
ranks, the tensor-parallel collectives inside units, the pipeline's transfers and BPipe's copies, and the
synchronisation after the pipeline.

Each rank reduces its gradients over data parallel in buckets (our runtime all-reduces fp32 ones; another engine
its own gradient bytes, reduce-scattered under its distributed optimizer: grad_reduction), after the pipeline or,
with --overlap-grad-reduce, each as soon as its gradients are ready (overlap.py; overlapped compute and
communication both slowed by the overlap factor, Galvatron's 1.3); it sums the sequence-parallel gradients over
tensor parallel, and the first and last stage all-reduce the tied embedding (with context parallelism the
data-parallel group is dp x cp: the cp ranks hold the same parameters); then the optimizer steps
(memory-bound, cost_model.py) and, with ZeRO-1, the parameters are all-gathered (hidden behind the next first
forwards with --overlap-param-gather). An MoE unit's expert gradients are summed over its expert data-parallel
group (edp ranks, moe_cost.py) in the same buckets: each expert element counts as the dense elements whose reduction
over dp x cp takes as long (`reduced_elements`); with dp x cp 1 and edp > 1 they are reduced after the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable

from ..pipeline.schedule import Action, Kind
from ..units import unit_kind_of
from .cluster import Link
from .engine import OURS
from .kernel_time import unit_edge_shapes
from .memory_model import chunk_units
from .moe_model import group_local_indices, local_to_coords
from .overlap import RankSpans, exposed_gather, reduce_end
from .tp_overlap import unit_overlap_cost


def allreduce_time(nbytes: float, n: int, link: Link) -> float:
    return sum(allreduce_parts(nbytes, n, link))


def allreduce_parts(nbytes: float, n: int, link: Link) -> tuple[float, float]:
    """(bandwidth term, latency term) of a ring all-reduce."""
    if n <= 1:
        return 0.0, 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth, 2 * (n - 1) * link.latency


def allgather_time(nbytes: float, n: int, link: Link) -> float:
    """All-gather (or reduce-scatter) of a tensor of `nbytes` in total."""
    return sum(allgather_parts(nbytes, n, link))


def allgather_parts(nbytes: float, n: int, link: Link) -> tuple[float, float]:
    """(bandwidth term, latency term) of a ring all-gather or reduce-scatter."""
    if n <= 1:
        return 0.0, 0.0
    return (n - 1) / n * nbytes / link.bandwidth, (n - 1) * link.latency


class CommCosts:
    """The communication of cost_model.CostModel, which it is part of: links, tensor-parallel collectives, pipeline
    transfers and BPipe copies, and after the pipeline the gradient synchronisation and ZeRO-1's gather
    (finish_times, with the cost model's optimizer step). It reads the cost model's spec, cluster, rank layout,
    settings, static core-sharing factors, parameters per rank and unit times."""

    # ---- links between the layout's ranks -------------------------------------------------------------------------
    def _group_link(self, kind: str, stage: int, ranks) -> Link:
        key = (kind, stage)
        if key not in self._p2p:
            self._p2p[key] = self.cluster.slowest_link(list(ranks))
        return self._p2p[key]

    def tp_link(self, stage: int) -> Link:
        return self._group_link("tp", stage, (self.layout.rank(t, 0, stage) for t in range(self.spec.tp)))

    def dp_link(self, stage: int) -> Link:
        """The gradients' group: dp x cp ranks of the stage."""
        return self._group_link("dp", stage, (self.layout.rank(0, d, stage, c) for d in range(self.spec.dp)
                                              for c in range(self.spec.cp)))

    def cp_link(self, stage: int, ring: bool = True) -> Link:
        """The context-parallel group's link: with `ring`, what each rank gets sending to its ring neighbour while
        every tp/cp/dp rank of the stage sends at once (Cluster.concurrent_link: a node's ranks share its NICs);
        else the group's slowest link (the all-to-alls)."""
        spec = self.spec
        if not ring:
            return self._group_link("cp", stage, (self.layout.rank(0, 0, stage, c) for c in range(spec.cp)))
        key = ("cp-ring", stage)
        if key not in self._p2p:
            self._p2p[key] = self.cluster.concurrent_link(
                [(self.layout.rank(t, d, stage, c), self.layout.rank(t, d, stage, (c + 1) % spec.cp))
                 for d in range(spec.dp) for c in range(spec.cp) for t in range(spec.tp)])
        return self._p2p[key]

    def expert_ranks(self, stage: int, group: str) -> list[int]:
        """Global ranks of the stage's first expert group `group` ("ep", "etp", "etp_ep", "edp"; moe_cost.py)."""
        spec = self.spec
        if group == "etp":
            local = list(range(self.experts.etp))
        else:
            local = group_local_indices(spec.tp, spec.cp, spec.dp, self.experts, group)
        out = []
        for index in local:
            t, c, d = local_to_coords(index, spec.tp, spec.cp)
            out.append(self.layout.rank(t, d, stage, c))
        return out

    def expert_link(self, stage: int, group: str) -> Link:
        return self._group_link(("expert", group), stage, self.expert_ranks(stage, group))

    def reduced_elements(self, rank: int, dense: float, expert: float) -> float:
        """Dense gradient elements reduced over dp x cp in the time `dense` of them and `expert` expert ones (over
        edp) take: expert ones count by the ratio of the two rings' per-element times (0 where edp is 1)."""
        spec = self.spec
        if not expert or spec.edp == 1 or spec.grad_dp == 1:
            return float(dense)
        per = [(n - 1) / n / link.bandwidth for n, link in ((spec.edp, self.expert_link(rank, "edp")),
                                                            (spec.grad_dp, self.dp_link(rank)))]
        return dense + expert * per[0] / per[1]

    def expert_sync_time(self, rank: int) -> float:
        """Expert gradients reduced over edp after the pipeline where dp x cp is 1 (else in the buckets)."""
        spec = self.spec
        if spec.edp == 1 or spec.grad_dp > 1:
            return 0.0
        nbytes, scatter = self.grad_reduction()
        parts = allgather_parts if scatter else allreduce_parts
        return sum(parts(nbytes * self.expert_params(rank), spec.edp, self.expert_link(rank, "edp")))

    def p2p_link(self, src: int, dst: int) -> Link:
        """Slowest of the links joining the tensor-/data-parallel replicas of two pipeline stages, all sending at
        once (Cluster.concurrent_link: a node's replicas share its NICs)."""
        key = (src, dst)
        if key not in self._p2p:
            self._p2p[key] = self.cluster.concurrent_link(
                [(self.layout.rank(t, d, src, c), self.layout.rank(t, d, dst, c))
                 for d in range(self.spec.dp) for c in range(self.spec.cp) for t in range(self.spec.tp)])
        return self._p2p[key]

    # ---- tensor-parallel collectives ------------------------------------------------------------------------------
    def tp_comm(self, kind: str, stage: int) -> tuple[float, float]:
        """Tensor-parallel collectives of one unit: (forward, backward) seconds."""
        (fw, fl), (bw, bl) = self.tp_comm_parts(kind, stage)
        return fw + fl, bw + bl

    def tp_comm_parts(self, kind: str, stage: int) -> tuple[tuple[float, float], tuple[float, float]]:
        """Tensor-parallel collectives of one unit: ((forward bandwidth term, latency), (backward ...))."""
        tp = self.spec.tp
        if tp == 1:
            return (0.0, 0.0), (0.0, 0.0)
        link = self.tp_link(stage)
        m = self.unit_model.seq_length * self.spec.pipeline.micro_batch_size * self.spec.model.hidden_size \
            * self.spec.model.dtype_bytes
        ar = allreduce_parts(m, tp, link)
        ag = ((tp - 1) / tp * m / link.bandwidth, (tp - 1) * link.latency)
        zero = (0.0, 0.0)

        def add(*xs):
            return sum(x[0] for x in xs), sum(x[1] for x in xs)

        sp = self.spec.sp
        if kind == "moe" and not (self.spec.model.moe.shared_expert_intermediate_size and sp):
            return zero, zero  # the dispatcher moves the tokens (moe_cost.py); under tp only with SP
        if kind == "moe":  # the shared experts: a sequence-parallel MLP's collectives
            return add(ag, ag), add(ag, ag, ag)
        if kind in ("attention", "mlp"):
            # sequence parallel: forward gathers the input and reduce-scatters the output; backward gathers the
            # output's gradient, reduce-scatters the input's and gathers the input again for the weight gradient
            if sp and self.settings.engine.tp_comm_overlap:
                overlapped = self._overlapped_sp(kind, stage, ag)
                if overlapped is not None:
                    return overlapped
            return (add(ag, ag), add(ag, ag, ag)) if sp else (ar, ar)
        if kind == "embedding":  # Megatron-core reduce-scatters the lookup under SP; ours all-reduces, then splits
            return (ag if sp and self.settings.engine.name != OURS else ar), (ag if sp else zero)
        small = allreduce_parts(self.unit_model.seq_length * self.spec.pipeline.micro_batch_size * 4, tp, link)
        return add(ag if sp else zero, small, small, small), (add(ag, ag) if sp else ar)

    def _overlapped_sp(self, kind: str, stage: int, one: tuple[float, float]):
        """--tp-comm-overlap (Megatron-core with Transformer Engine's userbuffers, tp_overlap.py): what a unit's
        sequence-parallel collectives (`one`: (bandwidth term, latency) of each) add beside the GEMMs that hide
        them, the SMs the overlaps take from those GEMMs included. None without the device's SM count: no GEMM times
        to pair with, so nothing is hidden."""
        c = one[0] + one[1]
        kd = self.kernel_device(self.devices[stage])
        if kd is None or c <= 0:
            return None
        first, last = unit_edge_shapes(kind, self.unit_model, self.spec.pipeline.micro_batch_size, self.spec.tp)
        added = unit_overlap_cost(first, last, self.spec.model.dtype_bytes, c, self.spec.tp, kd)
        return tuple((one[0] * a / c, one[1] * a / c) for a in added)

    # ---- pipeline transfers and BPipe copies ----------------------------------------------------------------------
    def transfer_time(self, src: int, dst: int, action: Action) -> float:
        if self.blocking_p2p:  # (held by the compute on both sides: _held_transfers)
            return 0.0
        return self._link_time(src, dst, action.half is not None)

    def _link_time(self, src: int, dst: int, half: bool) -> float:
        key = (src, dst, half)
        got = self._transfers.get(key)
        if got is None:
            got = self._transfers[key] = self.p2p_link(src, dst).time(self.spec.hidden_bytes(half))
        return got

    def _held_transfers(self, rank: int, action: Action) -> float:
        """Under an engine whose transfers hold the compute stream (EngineConfig.blocking_p2p): a forward's receive
        and send of the activation, a backward's of the gradient, with the neighbouring stages (with tp, a 1/tp
        part each and the tp all-gathers after it). The transfer itself then takes no time of its own
        (transfer_time): its data is there when the sender's action ends."""
        if action.kind not in (Kind.FORWARD, Kind.BACKWARD):
            return 0.0
        key = (rank, action.kind, action.half is not None)
        got = self._held.get(key)
        if got is None:
            got = self._held[key] = self._held_seconds(*key)
        return got

    def _held_seconds(self, rank: int, kind: Kind, half: bool) -> float:
        # DeepSpeed partitions what it sends over tp (is_pipe_partitioned, is_grad_partitioned): each tp rank sends
        # its 1/tp part and the receiver all-gathers the whole over its tp group; a backward also gathers its own
        # partitioned output again before back-propagating through it (no gathers at tp 1)
        tp, nbytes = self.spec.tp, self.spec.hidden_bytes(half)
        near = [q for q in (rank - 1, rank + 1) if 0 <= q < self.spec.pp]
        sent = sum(self.p2p_link(min(rank, q), max(rank, q)).time(nbytes / tp) for q in near)
        receives = rank > 0 if kind is Kind.FORWARD else rank < self.spec.pp - 1
        gathers = 0 if not receives else 1 if kind is Kind.FORWARD else 2
        return sent + gathers * allgather_time(nbytes, tp, self.tp_link(rank))

    def copy_time(self, rank: int, action: Action, nbytes: float) -> float:
        """An EVICT or LOAD of `nbytes` between `rank` and its peer (or host memory when it has none)."""
        if action.peer is None:
            return nbytes / self.cluster.inter_node.bandwidth
        return self.p2p_link(rank, action.peer).time(nbytes)

    # ---- after the pipeline ---------------------------------------------------------------------------------------
    def grad_reduction(self) -> tuple[float, bool]:
        """(bytes per gradient element reduced, whether it is a reduce-scatter): the engine's (EngineConfig)."""
        return self.settings.engine.grad_reduction(self.dtype, self.spec.distributed_optimizer)

    def dp_sync_time(self, rank: int) -> float:
        """The gradient reduction over data parallel; on shared cores its bandwidth term (gloo reduces on the CPU)
        is stretched by the stage's static factor (every rank of the node reduces at about the same time)."""
        return self.dp_reduce_seconds(rank)(self.params[rank])

    def sp_sync_time(self, rank: int) -> float:
        """Sequence-parallel replicated gradients (LayerNorms, row-parallel biases) summed over tp."""
        if not self.spec.sp:
            return 0.0
        h = self.spec.model.hidden_size
        names = [n for c in chunk_units(self.spec.stage_layout(), self.spec.model, rank) for n in c]
        moe = self.spec.model.moe
        router = 3 * h + (moe.num_experts * h if moe is not None else 0)
        count = sum({"attention": 3 * h, "mlp": 3 * h, "head": 2 * h, "moe": router}.get(
            unit_kind_of(self.spec.model, n), 0) for n in names)
        return allreduce_time(4.0 * count, self.spec.tp, self.tp_link(rank))

    def embedding_sync_time(self) -> float:
        spec = self.spec
        if spec.pp == 1 or spec.model.untie_embeddings_and_output_weights:
            return 0.0
        nbytes = 4.0 * (spec.model.vocab_size // spec.tp) * spec.model.hidden_size
        first, last = self.layout.rank(0, 0, 0), self.layout.rank(0, 0, spec.pp - 1)
        return allreduce_time(nbytes, 2, self.cluster.link(first, last))

    def optimizer_gather_time(self, rank: int) -> float:
        """ZeRO-1: the updated parameters are all-gathered over data parallel (dp x cp), the expert ones over edp."""
        if not self.spec.distributed_optimizer:
            return 0.0
        e, expert = self.spec.model.dtype_bytes, self.expert_params(rank)
        dense = allgather_time((self.params[rank] - expert) * e, self.spec.grad_dp, self.dp_link(rank))
        return dense + (allgather_time(expert * e, self.spec.edp, self.expert_link(rank, "edp")) if expert else 0.0)

    def dp_reduce_seconds(self, rank: int) -> Callable[[float], float]:
        """Seconds to reduce a bucket of `elements` gradients over data parallel (grad_reduction; dp_sync_time)."""
        link, k = self.dp_link(rank), self.static_factor[rank]
        nbytes, scatter = self.grad_reduction()
        parts = allgather_parts if scatter else allreduce_parts

        def seconds(elements: float) -> float:
            bw, lat = parts(nbytes * elements, self.spec.grad_dp, link)
            return bw * k + lat
        return seconds

    def gather_seconds(self, rank: int) -> Callable[[float], float]:
        """Seconds to all-gather `elements` updated parameters over data parallel (ZeRO-1)."""
        link, nbytes = self.dp_link(rank), self.spec.model.dtype_bytes
        return lambda elements: allgather_time(elements * nbytes, self.spec.grad_dp, link)

    def finish_times(self, pipeline_end: list[float], spans: list[RankSpans]) -> list[float]:
        """Per rank, when its iteration ends, given when its pipeline work ends and its chunks' spans (overlap.py):
        the data-parallel reduction in buckets (hidden behind the backward with --overlap-grad-reduce), the
        sequence-parallel and tied-embedding sums, the optimizer step and ZeRO-1's gather (hidden behind the next
        iteration's first forwards with --overlap-param-gather)."""
        factor = self.settings.overlap_factor
        spec = self.spec
        out = []
        for rank, end in enumerate(pipeline_end):
            t = end
            if spec.grad_dp > 1:
                if self._bucketed:
                    chunks = [(s, e, [(n, b) for n, _, b in units])
                              for (s, e), units in zip(spans[rank].last_grad, self.grad_units(rank))]
                    t = reduce_end(chunks, end, self.dp_reduce_seconds(rank), spec.overlap_grad_reduce, factor)
                else:
                    t = end + self.dp_sync_time(rank)
            out.append(t + self.sp_sync_time(rank) + self.expert_sync_time(rank))
        emb = self.embedding_sync_time()
        if emb > 0:
            both = max(out[0], out[-1]) + emb
            out[0] = out[-1] = both
        return [t + self.optimizer_step_time(r) + self.param_gather_time(r, spans[r]) for r, t in enumerate(out)]
    _bucketed = True  # the hybrid model syncs per unit group, after the pipeline (HybridGradSync)

    def param_gather_time(self, rank: int, spans: RankSpans) -> float:
        """ZeRO-1's all-gather after the step, or with --overlap-param-gather what of it the next iteration's first
        forwards on this rank do not hide."""
        if not self.spec.distributed_optimizer or self.spec.grad_dp == 1:
            return 0.0
        if not self.spec.overlap_param_gather:
            return self.optimizer_gather_time(rank)
        chunks = [(s, e, [(n, f) for n, f, _ in units])
                  for (s, e), units in zip(spans.first_forward, self.grad_units(rank))]
        return exposed_gather(chunks, self.gather_seconds(rank))
