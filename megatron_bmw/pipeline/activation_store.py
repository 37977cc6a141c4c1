"""Saved activations of each (micro-batch, chunk, half), captured with saved-tensor hooks, so that BPipe can
move one micro-batch's activations off the rank and back as a unit; with live and peak accounting.

While `capture(key)` is open, every tensor autograd saves (parameters and views of them excepted: they are
not activations) is recorded under `key`; autograd keeps only a small handle, and unpacking the handle in
backward returns the recorded tensor, or its copy once the key has been evicted and loaded back. Activation
recomputation (torch.utils.checkpoint) installs its own hooks inside the checkpointed region; only the
checkpoint's saved inputs reach ours, which is exactly what such a region keeps.

A key's tensors are moved as one flat byte buffer: every storage the saved tensors view contributes the byte
span they cover (16-byte aligned), and the tensors come back as views of the received buffer with their
original dtype, offset, size and stride, so views that shared memory still share it.

Accounting (the same as pipeline/holding.py's): a key counts from the start of its forward to the end of its
backward (a split backward's B leaves it only what its W needs, `keep_only`, until W's end); an evicted or returned key still counts until `settle()` (called after the compute its send
overlaps); a loaded or accepted key counts from the moment its receive buffer exists. Counts are in
chunk-micro-batches (a half counts 0.5); bytes are the spans above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from .schedule import Key

_ALIGN = 64


class Transfer(Protocol):
    """A posted send or receive. `wait()` returns once the data may be used (receive) or dropped (send)."""

    def wait(self) -> torch.Tensor: ...


class Copier(Protocol):
    """Copies byte spans into one new buffer (on a side stream for CUDA: see transfers.CudaChannel)."""

    def gather(self, parts: list[torch.Tensor], offsets: list[int], total: int) -> torch.Tensor: ...


class PlainCopier:
    """Gather byte spans into one new buffer on the current stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def gather(self, parts: list[torch.Tensor], offsets: list[int], total: int) -> torch.Tensor:
        flat = torch.empty(total, dtype=torch.uint8, device=self.device)
        for part, offset in zip(parts, offsets):
            flat[offset: offset + part.numel()].copy_(part)
        return flat


class _Handle:
    """What autograd keeps for a recorded tensor."""

    __slots__ = ("entry", "index")

    def __init__(self, entry: _Entry, index: int) -> None:
        self.entry = entry
        self.index = index


@dataclass
class _Entry:
    key: Key
    weight: float
    tensors: list[torch.Tensor] | None = field(default_factory=list)  # None while away
    nbytes: int = 0
    spans: list[tuple[torch.Tensor | None, int, int]] = field(default_factory=list)  # (storage bytes, lo, hi)
    views: list[tuple[int, torch.dtype, int, tuple, tuple]] = field(default_factory=list)
    incoming: Transfer | None = None  # the LOAD in flight


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


class ActivationStore:
    """Per-rank store of saved activations keyed by (micro-batch, chunk, half)."""

    def __init__(self, device: torch.device | str = "cpu", params: list[nn.Parameter] = (),
                 copier: Copier | None = None) -> None:
        self.device = torch.device(device)
        self.copier = copier or PlainCopier(self.device)
        self._param_storages: set[int] = set()
        self.more_params: Callable[[], set[int]] | None = None  # storages of parameters that come and go (FSDP2)
        self.set_params(params)
        self._entries: dict[Key, _Entry] = {}
        self._accepted: dict[tuple[int, Key], tuple[torch.Tensor, float, Transfer]] = {}
        self._leaving: list[tuple[Transfer, float, int, bool]] = []  # (send, weight, bytes, accepted?)
        self.live_microbatches = 0.0
        self.live_bytes = 0
        self.accepted_bytes = 0
        self.peak_microbatches = 0.0
        self.peak_bytes = 0
        self.peak_accepted_bytes = 0
        self.peak_accepted_microbatches = 0.0
        self._accepted_units = 0.0

    def set_params(self, params: list[nn.Parameter]) -> None:
        """Tensors sharing these parameters' memory are never recorded (refresh if parameters are replaced)."""
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # FSDP2's DTensor shards
        self._param_storages = {p.untyped_storage().data_ptr() for p in local}

    # -- capture ----------------------------------------------------------------------------------------------
    @contextmanager
    def capture(self, key: Key, weight: float = 1.0) -> Iterator[None]:
        """Record what autograd saves while the forward of `key` runs."""
        if key in self._entries:
            raise RuntimeError(f"activations of {key} are already stored")
        entry = self._entries[key] = _Entry(key, weight)
        self._add(weight, 0)

        def pack(t: torch.Tensor):
            if not self._is_activation(t):
                return t
            entry.tensors.append(t)
            return _Handle(entry, len(entry.tensors) - 1)

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack):
            yield
        self._index(entry)
        self._add(0.0, entry.nbytes)

    def _is_activation(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor or t.device != self.device or t.layout != torch.strided:
            return False
        if isinstance(t._base, nn.Parameter):
            return False
        ptr = t.untyped_storage().data_ptr()
        if self.more_params is not None and ptr in self.more_params():
            return False
        return ptr != 0 and ptr not in self._param_storages

    def _index(self, entry: _Entry) -> None:
        """Byte spans of the storages the saved tensors view, and where each tensor lies in them."""
        spans: dict[int, int] = {}
        entry.spans, entry.views = [], []
        for t in entry.tensors:
            size = t.element_size()
            lo = t.storage_offset() * size
            extent = 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
            hi = lo + extent * size
            ptr = t.untyped_storage().data_ptr()
            i = spans.setdefault(ptr, len(entry.spans))
            if i == len(entry.spans):
                entry.spans.append((_storage_bytes(t), lo, hi))
            else:
                whole, a, b = entry.spans[i]
                entry.spans[i] = (whole, min(a, lo), max(b, hi))
            entry.views.append((i, t.dtype, lo, tuple(t.shape), tuple(t.stride())))
        entry.nbytes = sum(hi - (lo - lo % 16) for _, lo, hi in entry.spans)

    def nbytes(self, key: Key) -> int:
        return self._entries[key].nbytes

    def release(self, key: Key) -> None:
        """Forget `key` after its backward."""
        entry = self._entries.pop(key)
        self._add(-entry.weight, -entry.nbytes)

    def keep_only(self, key: Key, tensors: list[torch.Tensor]) -> None:
        """After a split backward's B: `key` now holds only `tensors` (what its W needs), until `release`."""
        entry = self._entries[key]
        self._add(0.0, -entry.nbytes)
        entry.tensors = [t for t in tensors if self._is_activation(t)]
        self._index(entry)
        self._add(0.0, entry.nbytes)

    def __contains__(self, key: Key) -> bool:
        return key in self._entries

    # -- evictor side -----------------------------------------------------------------------------------------
    def evict(self, key: Key, send: Callable[[torch.Tensor], Transfer]) -> None:
        """Copy `key`'s saved tensors into one buffer, hand it to `send`, and drop them. The key keeps counting
        until the next `settle()`."""
        entry = self._entries[key]
        if entry.tensors is None:
            raise RuntimeError(f"activations of {key} are already away")
        parts, offsets, total = [], [], 0
        for whole, lo, hi in entry.spans:
            lo -= lo % 16
            parts.append(whole[lo:hi])
            offsets.append(total)
            total += -(-(hi - lo) // _ALIGN) * _ALIGN
        flat = self.copier.gather(parts, offsets, max(total, _ALIGN))
        entry.tensors = None
        entry.spans = [(None, lo - lo % 16, hi) for _, lo, hi in entry.spans]  # keep where each span sat
        self._leaving.append((send(flat), entry.weight, entry.nbytes, False))

    def load(self, key: Key, recv: Callable[[torch.Tensor], Transfer]) -> None:
        """Allocate `key`'s buffer and post its receive (via `recv`); it counts from now."""
        entry = self._entries[key]
        if entry.tensors is not None or entry.incoming is not None:
            raise RuntimeError(f"activations of {key} are not away")
        entry.incoming = recv(torch.empty(self.transfer_size(key), dtype=torch.uint8, device=self.device))
        self._add(entry.weight, entry.nbytes)

    def ready(self, key: Key) -> None:
        """Before `key`'s backward: wait for its LOAD (if any) and rebuild the saved tensors from the buffer."""
        entry = self._entries[key]
        if entry.tensors is not None:
            return
        if entry.incoming is None:
            raise RuntimeError(f"activations of {key} are away on the acceptor and were never loaded back")
        flat = entry.incoming.wait()
        entry.incoming = None
        storage = flat.untyped_storage()
        offsets, total = [], 0
        for _, lo, hi in entry.spans:
            offsets.append(total - lo)  # flat position of storage byte 0 of this span
            total += -(-(hi - lo) // _ALIGN) * _ALIGN
        tensors = []
        for i, dtype, byte, shape, stride in entry.views:
            t = torch.empty(0, dtype=dtype, device=self.device)
            t.set_(storage, (offsets[i] + byte) // dtype.itemsize, shape, stride)
            tensors.append(t)
        entry.tensors = tensors

    def transfer_size(self, key: Key) -> int:
        """Bytes of `key`'s flat buffer on the wire."""
        entry = self._entries[key]
        total = sum(-(-(hi - (lo - lo % 16)) // _ALIGN) * _ALIGN for _, lo, hi in entry.spans)
        return max(total, _ALIGN)

    # -- acceptor side ----------------------------------------------------------------------------------------
    def accept(self, owner: tuple[int, Key], nbytes: int, weight: float,
               recv: Callable[[torch.Tensor], Transfer]) -> None:
        """Hold a peer's key: allocate its buffer and post the receive; it counts as accepted from now."""
        if owner in self._accepted:
            raise RuntimeError(f"already holding {owner}")
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._accepted[owner] = (buf, weight, recv(buf))
        self._add(weight, nbytes, accepted=True)

    def give_back(self, owner: tuple[int, Key], send: Callable[[torch.Tensor], Transfer]) -> None:
        """Send a held key back (via `send`) once it has arrived; it keeps counting until the next `settle()`."""
        buf, weight, incoming = self._accepted.pop(owner)
        incoming.wait()
        self._leaving.append((send(buf), weight, buf.numel(), True))

    # -- completion ---------------------------------------------------------------------------------------------
    def settle(self) -> None:
        """Complete the sends posted before the compute that just ran and stop counting what they carried."""
        leaving, self._leaving = self._leaving, []
        for transfer, weight, nbytes, accepted in leaving:
            transfer.wait()
            self._add(-weight, -nbytes, accepted)

    def _add(self, weight: float, nbytes: int, accepted: bool = False) -> None:
        self.live_microbatches += weight
        self.live_bytes += nbytes
        if accepted:
            self._accepted_units += weight
            self.accepted_bytes += nbytes
            self.peak_accepted_bytes = max(self.peak_accepted_bytes, self.accepted_bytes)
            self.peak_accepted_microbatches = max(self.peak_accepted_microbatches, self._accepted_units)
        self.peak_microbatches = max(self.peak_microbatches, self.live_microbatches)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    # -- report -------------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        return {
            "live_microbatches": self.live_microbatches,
            "live_bytes": self.live_bytes,
            "peak_microbatches": self.peak_microbatches,
            "peak_bytes": self.peak_bytes,
            "accepted_bytes": self.accepted_bytes,
            "peak_accepted_bytes": self.peak_accepted_bytes,
            "peak_accepted_microbatches": self.peak_accepted_microbatches,
        }

    def reset_peaks(self) -> None:
        self.peak_microbatches = self.live_microbatches
        self.peak_bytes = self.live_bytes
        self.peak_accepted_bytes = self.accepted_bytes
        self.peak_accepted_microbatches = self._accepted_units


def _unpack(packed):
    if not isinstance(packed, _Handle):
        return packed
    tensors = packed.entry.tensors
    if tensors is None:
        raise RuntimeError(f"saved activations of {packed.entry.key} are away: LOAD them before the BACKWARD")
    return tensors[packed.index]
