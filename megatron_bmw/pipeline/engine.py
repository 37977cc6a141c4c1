"""Executes a pipeline schedule (see schedule.py) on real tensors.

The engine owns no ordering logic: it walks this rank's action list. Consecutive SEND/RECV actions are posted
together as asynchronous point-to-point operations; a compute action waits only for the receive it consumes.
Tensor shapes come from the configuration, never from the wire. With an activation store, each forward's
saved tensors are recorded per (micro-batch, chunk, half), and BPipe's EVICT/LOAD/ACCEPT/RETURN move them
(see transfers.py); the sends they post complete after the next compute.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..device import batch_p2p
from ..parallel import deferred_wgrad
from ..parallel.state import ParallelState
from .activation_store import ActivationStore
from .schedule import TRANSFER_KINDS, Action, Kind, Schedule
from .transfers import TransferRunner, make_channel

COMM = {Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD}
FORWARD_ONLY = {Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT}


@dataclass
class _Slot:
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    weight: float = 1.0


@dataclass
class RunResult:
    losses: list[float] = field(default_factory=list)  # per micro-batch, on the loss rank only
    loss_sum: torch.Tensor | None = None
    loss_rank: int = -1  # the pipeline rank holding the last virtual stage (-1: the last rank)


def _key(a: Action) -> tuple:
    return (a.microbatch, a.chunk, a.half)


def backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """torch.autograd.backward(output, grad) without its shape check: `output`'s data may be freed already."""
    torch.autograd.Variable._execution_engine.run_backward(
        (output,), (grad,), keep_graph=False, create_graph=False, inputs=(), allow_unreachable=True,
        accumulate_grad=True)


def _sent(entry: tuple) -> bool:
    """Has this send completed? Then free the stage output it sent, which backward needs only for its graph
    (Megatron's deallocate_output_tensor): the next stage holds the values."""
    work, _, slot = entry
    if not work.is_completed():
        return False
    out = slot.output if slot is not None else None
    if out is not None and out._base is None and out.numel() > 1:
        out.data = torch.empty((1,), dtype=out.dtype, device=out.device)
    return True


class PipelineEngine:
    def __init__(self, chunks: list[nn.Module], state: ParallelState, schedule: Schedule,
                 hidden_shape: tuple[int, int, int], dtype: torch.dtype, tracer=None,
                 track_activations: bool = False) -> None:
        """hidden_shape: [seq (per tp rank with sequence parallelism), micro-batch, hidden].

        An activation store is kept when `track_activations` is set (for `activation_report`) or when this
        rank's schedule has BPipe transfers."""
        self.chunks = chunks
        self.state = state
        self.schedule = schedule
        self.p = state.pp_size
        self.rank = state.pp_rank
        self.hidden_shape = hidden_shape
        self.dtype = dtype
        self.tracer = tracer
        if len(chunks) != schedule.virtual_stages:
            raise ValueError(f"{len(chunks)} model chunks for a schedule with {schedule.virtual_stages} virtual stages")
        self.num_vstages = self.p * schedule.virtual_stages
        transfers = any(a.kind in TRANSFER_KINDS for a in schedule.actions[self.rank])
        self.store: ActivationStore | None = None
        self.transfers: TransferRunner | None = None
        if track_activations or transfers:
            channel = make_channel(state) if transfers else None
            self.store = ActivationStore(state.device, copier=channel)
            params = state.units.activation_params(chunks)  # e.g. sharded units' gathered parameters
            if params is not None:
                self.store.more_params = params
            if transfers:
                self.transfers = TransferRunner(schedule, state, self.store, channel)

    # -- helpers -----------------------------------------------------------------------------------------
    def _vstage(self, chunk: int) -> int:
        return self.schedule.stage_of(self.rank, chunk)

    def _tag(self, a: Action) -> int:
        return self.schedule.p2p_tag(self.schedule.wire_tensor(self.rank, a))

    def _shape(self, a: Action, kind: Kind = Kind.RECV_ACT) -> tuple[int, int, int]:
        s, b, h = self.hidden_shape
        b = b // 2 if a.half is not None else b
        # hybrid: the rows of the unit before this chunk (activations) or of its last unit (gradients)
        dp = getattr(self.chunks[a.chunk], "input_dp" if kind is Kind.RECV_ACT else "output_dp", None)
        return (s, b // dp if dp else b, h)

    def _batch(self, get_batch: Callable[[int], dict], a: Action) -> tuple[dict, float]:
        batch = get_batch(a.microbatch)
        batch = self.state.units.weigh(batch)
        if a.half is None:
            return batch, 1.0
        halves = {k: v.chunk(2, 0)[a.half] for k, v in batch.items()}
        if "loss_divisors" in batch or "sample_weights" in batch:  # the head's loss shares add up over halves
            return halves, 1.0
        key = "loss_tokens" if "loss_tokens" in batch else "loss_mask"  # context parallel: whole-sequence counts
        weight = (halves[key].sum() / batch[key].sum().clamp(min=1)).item()
        return halves, weight

    # -- execution -----------------------------------------------------------------------------------------
    def run(self, get_batch: Callable[[int], dict], *, forward_only: bool = False, loss_scale: float = 1.0,
            grad_sync=None) -> RunResult:
        """Run one iteration. Each micro-batch's loss is divided by the number of micro-batches before its
        backward (and multiplied by `loss_scale`), so gradients are the mean over micro-batches."""
        actions = self.schedule.actions[self.rank]
        if forward_only:
            actions = [a for a in actions if a.kind in FORWARD_ONLY]
        m = self.schedule.num_microbatches
        slots: dict[tuple, _Slot] = {}
        recvs: dict[tuple, tuple] = {}  # (kind, key) -> (work, buffer)
        sends: list[tuple] = []
        losses: dict[int, torch.Tensor] = {}
        pending: list[tuple[Action, str]] = []
        if grad_sync is not None and not forward_only:
            grad_sync.begin(sum(1 for a in actions if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT)
                                and a.chunk == 0))
        runner = None if forward_only else self.transfers
        if self.store is not None and not forward_only:
            self.store.set_params([p for c in self.chunks for p in c.parameters()])
        if runner is not None:
            runner.begin()

        def flush():
            if pending:
                self._post(pending, slots, recvs, sends)
                pending.clear()
                sends[:] = [entry for entry in sends if not _sent(entry)]  # free what has gone out

        ctx = torch.no_grad() if forward_only else torch.enable_grad()
        settle = False  # BPipe sends posted before the last compute are completed once its own posts are out
        with ctx:
            for a in actions:
                if a.kind in COMM:
                    pending.append((a, a.kind))
                    continue
                flush()
                if settle:
                    self.store.settle()
                    settle = False
                t0 = time.time()
                if a.kind == Kind.FORWARD:
                    self._forward(a, get_batch, slots, recvs, losses, forward_only)
                    if runner is not None:
                        runner.after_forward(a)
                        settle = True
                elif a.kind == Kind.BACKWARD or a.kind == Kind.BACKWARD_INPUT:
                    self._backward(a, slots, recvs, loss_scale / m)
                    settle = runner is not None
                elif a.kind == Kind.BACKWARD_WEIGHT:
                    deferred_wgrad.run_deferred(self._deferred_key(a))
                    if self.store is not None:
                        self.store.release(_key(a))
                elif a.kind in TRANSFER_KINDS:
                    if runner is None:
                        raise RuntimeError(f"{a.label()}: BPipe transfer without a transfer runner")
                    runner.run(a)
                if self.tracer is not None:
                    self.tracer.record(a, t0, time.time())
            flush()
            for entry in sends:
                entry[0].wait()
                _sent(entry)
            if runner is not None:
                runner.finish()
        if grad_sync is not None and not forward_only:
            grad_sync.finish()
        result = RunResult(loss_rank=self.schedule.loss_rank)
        if losses:
            per_mb = [losses[i] for i in sorted(losses)]
            result.loss_sum = torch.stack(per_mb).sum()
            result.losses = [x.item() for x in per_mb]
        return result

    def _post(self, ops: list, slots, recvs, sends) -> None:
        p2p, targets = [], []
        for a, kind in ops:
            peer = self.state.pp_ranks[a.peer]
            grad = kind in (Kind.SEND_GRAD, Kind.RECV_GRAD)
            if kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                slot = slots[_key(a)]
                tensor = (slot.input.grad if grad else slot.output).detach().contiguous()
                if grad or not torch.is_grad_enabled():  # nothing of this slot is needed after the send
                    slots.pop(_key(a))
                    slot = None
                group = self.state.p2p_group(self.state.rank, peer)
                p2p.append(dist.P2POp(dist.isend, tensor, peer, group=group, tag=self._tag(a)))
                targets.append((tensor, slot))
            else:
                buf = torch.empty(self._shape(a, kind), dtype=self.dtype, device=self.state.device)
                group = self.state.p2p_group(peer, self.state.rank)
                p2p.append(dist.P2POp(dist.irecv, buf, peer, group=group, tag=self._tag(a)))
                targets.append((kind, _key(a), buf))
        works = self._start(p2p)
        for target, work in zip(targets, works):
            if len(target) == 3:
                kind, key, buf = target
                recvs[(kind, key)] = (work, buf)
            else:
                sends.append((work, *target))  # keep the tensor alive until the send completes

    def _start(self, ops: list) -> list:
        """Post operations asynchronously; on NCCL, those sharing a (one-direction) group go in one batch."""
        if not self.state.p2p_groups:  # gloo: plain isend/irecv on the default group, matched by tag
            return [op.op(op.tensor, op.peer, tag=op.tag) for op in ops]
        works: list = [None] * len(ops)
        by_group: dict = {}
        for i, op in enumerate(ops):
            by_group.setdefault(id(op.group), []).append(i)
        for idx in by_group.values():
            batch = batch_p2p([ops[i] for i in idx])  # a work per op, also when NCCL coalesces the batch
            for i, w in zip(idx, batch):
                works[i] = w
        return works

    def _wait(self, recvs, kind: Kind, a: Action) -> torch.Tensor:
        work, buf = recvs.pop((kind, _key(a)))
        t0 = time.time()
        work.wait()
        if self.tracer is not None:
            self.tracer.record_wait(kind, a, t0, time.time())
        return buf

    def _forward(self, a: Action, get_batch, slots, recvs, losses, forward_only: bool) -> None:
        vstage = self._vstage(a.chunk)
        batch, weight = self._batch(get_batch, a)
        local = self._local_peer(a)
        if vstage == 0:
            x = None
        else:
            if local is None:
                x = self._wait(recvs, Kind.RECV_ACT, a)
            else:  # the previous virtual stage is this rank's (the V placement's turn): its output, detached
                producer = slots[local] if not forward_only else slots.pop(local)
                x = producer.output.detach()
            if not forward_only:
                x.requires_grad_()
        capture = nullcontext() if forward_only or self.store is None else \
            self.store.capture(_key(a), a.weight)
        self.state.aux_loss_share = _share(a)  # MoE auxiliary losses' value for the log (models/moe.py)
        with capture:
            out = self.chunks[a.chunk](x, batch)
        if vstage == self.num_vstages - 1:
            out = out * weight
            losses[a.microbatch] = losses.get(a.microbatch, 0.0) + out.detach()
        if forward_only:
            if vstage != self.num_vstages - 1:
                slots[_key(a)] = _Slot(output=out)
        else:
            slots[_key(a)] = _Slot(input=x, output=out, weight=weight)

    def _local_peer(self, a: Action) -> tuple | None:
        """Slot key of the chunk on this rank that produces `a`'s input (the V placement's turn), else None."""
        need = self.schedule.input_tensor(self.rank, a)
        if need is None:
            return None
        rank, chunk = self.schedule.location(need[1])
        return (a.microbatch, chunk, a.half) if rank == self.rank else None

    def _deferred_key(self, a: Action) -> tuple:
        return (id(self), *_key(a))

    def _backward(self, a: Action, slots, recvs, scale: float) -> None:
        """A whole BACKWARD, or a BACKWARD_INPUT whose linear layers' weight gradients wait for its W."""
        vstage = self._vstage(a.chunk)
        slot = slots[_key(a)]
        split = a.kind is Kind.BACKWARD_INPUT
        if vstage != self.num_vstages - 1:
            local = self._local_peer(a)
            grad = self._wait(recvs, Kind.RECV_GRAD, a) if local is None else slots.pop(local).input.grad
        if self.store is not None:
            self.store.ready(_key(a))
        # MoE auxiliary losses' gradient (models/moe.py): per sample, so a half's is half its micro-batch's
        self.state.aux_loss_share = _share(a)
        self.state.aux_loss_scale = scale * _share(a)
        with deferred_wgrad.deferring(self._deferred_key(a)) if split else nullcontext():
            if vstage == self.num_vstages - 1:
                torch.autograd.backward(slot.output * scale)
            else:
                backward_from(slot.output, grad)
        if self.store is not None:  # autograd has freed the rest of what the key saved; W keeps its stash
            if split:
                self.store.keep_only(_key(a), deferred_wgrad.stashed(self._deferred_key(a)))
            else:
                self.store.release(_key(a))
        slot.output = None
        if vstage == 0:
            slots.pop(_key(a))

    # -- activation memory ---------------------------------------------------------------------------------
    def activation_stats(self) -> dict[str, float]:
        """This rank's activation-store numbers (peaks over the engine's lifetime); see ActivationStore.stats."""
        if self.store is None:
            raise RuntimeError("activation memory is tracked only with PipelineEngine(track_activations=True)")
        return {"stage": self.rank, **self.store.stats()}

    def activation_report(self) -> list[str]:
        """This rank's line for --log-activation-memory. Micro-batches and bytes count what the rank holds,
        its own and accepted ones; accepted bytes is the peak held on behalf of its BPipe evictor."""
        st = self.activation_stats()
        return [f"activation memory | stage {self.rank} | peak micro-batches {st['peak_microbatches']:g} | "
                f"peak bytes {int(st['peak_bytes'])} | accepted bytes {int(st['peak_accepted_bytes'])}"]


def _share(a: Action) -> float:
    """The share of its micro-batch's samples an action runs: a sliced half holds half of them."""
    return 1.0 if a.half is None else 0.5


def reduce_loss(result: RunResult, state: ParallelState, num_microbatches: int) -> float:
    """Mean loss over micro-batches and data-parallel (and context-parallel) ranks, known on every rank."""
    t = torch.zeros(1, dtype=torch.float32, device=state.device)
    src = state.pp_ranks[result.loss_rank]
    if state.rank == src and result.loss_sum is not None:
        t += result.loss_sum.float() / num_microbatches
    if state.pp_group is not None:
        dist.broadcast(t, src=src, group=state.pp_group)
    if state.grad_group is not None:
        dist.all_reduce(t, group=state.grad_group)
        t /= state.units.loss_divisor(state)
    return t.item()
