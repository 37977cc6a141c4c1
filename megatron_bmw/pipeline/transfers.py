"""BPipe's transfers at run time: one rank's EVICT/LOAD (evictor) or ACCEPT/RETURN (acceptor), run beside
compute through the activation store.

Protocol. A key travels as one flat byte buffer (see activation_store). Its size is the same for every
micro-batch of a (chunk, whole/half) class, so the evictor announces each class's size once, with a one-int64
header sent right after its first forward of that class; the acceptor posts the header receives when its
first iteration starts and waits for one only at its first ACCEPT of that class (the schedule's replay models
this wait). After that, ACCEPT allocates and posts the receive at once: no handshake at run time.
  EVICT   isend of the key's buffer; the key's memory is released after the next compute (send completed).
  ACCEPT  irecv into a new buffer, held (and counted) by the acceptor.
  RETURN  once the ACCEPT's data is in, isend it back; released after the next compute.
  LOAD    irecv into a new buffer; the key's BACKWARD waits for it and rebuilds the saved tensors from it.

Channels. gloo: isend/irecv on the default group, matched by tag. NCCL: the pair's own directional groups
(`state.transfer_group`, apart from the stage-to-stage ones so the two traffics cannot interleave on one
communicator), a dedicated CUDA stream per direction; see CudaChannel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..device import ping_pong
from ..parallel.state import ParallelState
from .activation_store import ActivationStore, PlainCopier
from .schedule import Action, Kind, Schedule


class _Posted:
    """A gloo (or any host-waited) transfer."""

    def __init__(self, work, buf: torch.Tensor) -> None:
        self.work, self.buf = work, buf

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.buf


class HostChannel(PlainCopier):
    """gloo: asynchronous isend/irecv on the default group, matched by tag."""

    def __init__(self, state: ParallelState) -> None:
        super().__init__(state.device)
        self.state = state

    def send(self, buf: torch.Tensor, dst: int, tag: int) -> _Posted:
        return _Posted(dist.isend(buf, dst, group=self.state.transfer_group(self.state.rank, dst), tag=tag), buf)

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> _Posted:
        return _Posted(dist.irecv(buf, src, group=self.state.transfer_group(src, self.state.rank), tag=tag), buf)


class _CudaSend:
    def __init__(self, work, buf: torch.Tensor, stream) -> None:
        self.work, self.buf, self.stream = work, buf, stream

    def wait(self) -> torch.Tensor:
        # The host does not block: the send stream waits for NCCL, and the caching allocator may reuse the
        # buffer only after the send stream has passed this point.
        with torch.cuda.stream(self.stream):
            self.work.wait()
        self.buf.record_stream(self.stream)
        return self.buf


class _CudaRecv:
    def __init__(self, work, buf: torch.Tensor, stream) -> None:
        self.work, self.buf, self.stream = work, buf, stream
        self.done = False

    def wait(self) -> torch.Tensor:
        # Only the compute stream waits, and only now that the data is needed.
        if not self.done:
            with torch.cuda.stream(self.stream):
                self.work.wait()
            torch.cuda.current_stream(self.buf.device).wait_stream(self.stream)
            self.done = True
        return self.buf


class CudaChannel:
    """NCCL: sends run on a send stream and receives on a receive stream, each ordered after the compute stream
    with an event, so compute never waits for a transfer until it needs the data."""

    def __init__(self, state: ParallelState) -> None:
        self.state = state
        self.device = state.device
        self.send_stream = torch.cuda.Stream(self.device)
        self.recv_stream = torch.cuda.Stream(self.device)

    def gather(self, parts: list[torch.Tensor], offsets: list[int], total: int) -> torch.Tensor:
        """Copy the spans into one buffer on the send stream, after the compute that produced them."""
        self.send_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.send_stream):
            flat = torch.empty(total, dtype=torch.uint8, device=self.device)
            for part, offset in zip(parts, offsets):
                flat[offset: offset + part.numel()].copy_(part, non_blocking=True)
        for part in parts:  # the originals are not reused before the copy has read them
            part.record_stream(self.send_stream)
        return flat

    def send(self, buf: torch.Tensor, dst: int, tag: int) -> _CudaSend:
        self.send_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.send_stream):
            work = dist.isend(buf, dst, group=self.state.transfer_group(self.state.rank, dst))
        return _CudaSend(work, buf, self.send_stream)

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> _CudaRecv:
        self.recv_stream.wait_stream(torch.cuda.current_stream(self.device))  # the buffer's memory is free
        with torch.cuda.stream(self.recv_stream):
            work = dist.irecv(buf, src, group=self.state.transfer_group(src, self.state.rank))
        return _CudaRecv(work, buf, self.recv_stream)


def make_channel(state: ParallelState) -> HostChannel | CudaChannel:
    return CudaChannel(state) if state.device.type == "cuda" else HostChannel(state)


class TransferRunner:
    """Executes one rank's BPipe actions on real tensors."""

    def __init__(self, schedule: Schedule, state: ParallelState, store: ActivationStore, channel) -> None:
        self.state = state
        self.store = store
        self.channel = channel
        self.schedule = schedule
        rank = state.pp_rank
        acts = schedule.actions[rank]
        partners = {a.peer for a in acts if a.kind in (Kind.EVICT, Kind.ACCEPT)}
        if len(partners) != 1:
            raise ValueError(f"pipeline rank {rank} has BPipe partners {sorted(partners)}; expected one")
        self.partner = state.pp_ranks[partners.pop()]
        self.evicted = {self._class(a) for a in acts if a.kind is Kind.EVICT}
        # Acceptor: the evictor sends a class's header after its first forward of the class, between its EVICTs;
        # post the header receive at the same place among the ACCEPTs, so channels stay FIFO (NCCL needs it).
        self.header_before: dict[int, list[tuple[int, bool]]] = {}
        accepted = {self._class(a) for a in acts if a.kind is Kind.ACCEPT}
        if accepted:
            evictor = schedule.actions[next(a.peer for a in acts if a.kind is Kind.ACCEPT)]
            evicts = 0
            for a in evictor:
                if a.kind is Kind.EVICT:
                    evicts += 1
                elif a.kind is Kind.FORWARD and self._class(a) in accepted:
                    accepted.discard(self._class(a))
                    self.header_before.setdefault(evicts, []).append(self._class(a))
        self.class_bytes: dict[tuple[int, bool], int] = {}  # announced (evictor) or received (acceptor)
        self._headers: dict[tuple[int, bool], object] = {}  # class -> header transfer in flight
        self._accepts = 0
        if state.transfer_groups:
            self._connect(evictor=bool(self.evicted))

    def _connect(self, evictor: bool) -> None:
        """NCCL creates a group's communicator at its first use, blocking until both ranks use it. Do that now,
        at construction, for both directions of the pair, rather than at the first transfer."""
        me, peer = self.state.rank, self.partner
        x = torch.zeros(1, device=self.state.device)
        out, back = self.state.transfer_group(me, peer), self.state.transfer_group(peer, me)
        ping_pong(evictor, x, peer, out, back)

    @staticmethod
    def _class(a: Action) -> tuple[int, bool]:
        return (a.chunk, a.half is not None)

    def _tag(self, direction: int, a: Action) -> int:
        return self.schedule.transfer_tag(direction, a.key)

    def _header_tag(self, cls: tuple[int, bool]) -> int:
        return self.schedule.header_tag(*cls)

    # -- iteration hooks ----------------------------------------------------------------------------------------
    def begin(self) -> None:
        self._accepts = 0

    def after_forward(self, a: Action) -> None:
        """Evictor: announce a class's byte size after its first forward."""
        cls = self._class(a)
        if cls not in self.evicted or cls in self.class_bytes:
            return
        size = self.store.transfer_size(a.key)
        self.class_bytes[cls] = size
        header = torch.tensor([size], dtype=torch.int64, device=self.state.device)
        self._headers[cls] = self.channel.send(header, self.partner, self._header_tag(cls))

    def finish(self) -> None:
        """End of iteration: complete the header sends and every transfer still in flight."""
        for cls in [c for c in self._headers if c in self.evicted]:
            self._headers.pop(cls).wait()
        self.store.settle()

    # -- actions --------------------------------------------------------------------------------------------
    def run(self, a: Action) -> None:
        peer = self.partner
        if a.kind is Kind.EVICT:
            size = self.store.transfer_size(a.key)
            if size != self.class_bytes.get(self._class(a)):
                raise RuntimeError(f"BPipe: activations of {a.label()} take {size} bytes, but their class was "
                                   f"announced with {self.class_bytes.get(self._class(a))}")
            self.store.evict(a.key, lambda buf: self.channel.send(buf, peer, self._tag(0, a)))
        elif a.kind is Kind.LOAD:
            self.store.load(a.key, lambda buf: self.channel.recv(buf, peer, self._tag(1, a)))
        elif a.kind is Kind.ACCEPT:
            for cls in self.header_before.get(self._accepts, ()):
                if cls not in self.class_bytes:
                    header = torch.zeros(1, dtype=torch.int64, device=self.state.device)
                    self._headers[cls] = self.channel.recv(header, peer, self._header_tag(cls))
            self._accepts += 1
            cls = self._class(a)
            if cls not in self.class_bytes:
                self.class_bytes[cls] = int(self._headers.pop(cls).wait().item())
            self.store.accept((a.peer, a.key), self.class_bytes[cls], a.weight,
                              lambda buf: self.channel.recv(buf, peer, self._tag(0, a)))
        elif a.kind is Kind.RETURN:
            self.store.give_back((a.peer, a.key), lambda buf: self.channel.send(buf, peer, self._tag(1, a)))
        else:
            raise ValueError(f"not a BPipe transfer: {a}")
