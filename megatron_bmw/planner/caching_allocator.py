"""A model of PyTorch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, default settings: no
max_split_size, no expandable segments, one stream), to replay a sequence of allocations and frees and see what it
reserves from the device. Torch-free.

  rounding     a request is rounded up to a multiple of 512 bytes.
  pools        requests up to 1 MiB come from the small pool, larger ones from the large pool; a block never moves
               between pools.
  segments     a request no cached block fits gets a new segment from the device: 2 MiB for the small pool, 20 MiB
               for requests below 10 MiB, else the request rounded up to 2 MiB.
  best fit     the smallest free block of the pool that holds the request (ties: the lowest address).
  splitting    the block is cut to the request where what is left is at least 512 bytes (small pool) or more than
               1 MiB (large pool); the rest stays free in the pool.
  freeing      a freed block merges with free neighbours of its segment; segments are kept (cached) and given back
               only by `release_cached` (torch.cuda.empty_cache, or the allocator's retry when the device runs out:
               every segment without a live block). Running out is not modelled: `pinned_peak` is what must fit,
               the segments that hold a live block, since cached empty ones would be released and the request
               retried.

`replay` takes a recorded trace (tools/gpu_check.py's allocator step, from torch.cuda.memory._snapshot()) and
returns what the model reserves beside what was recorded, so the model can be checked against a real run.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20  # largest small-pool request
SMALL_BUFFER = 2 << 20  # small-pool segment
LARGE_BUFFER = 20 << 20  # segment for large-pool requests below MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 << 20
ROUND_LARGE = 2 << 20
ALLOC, FREE, SEGMENT_ALLOC, SEGMENT_FREE = 0, 1, 2, 3  # the codes of gpu_check's allocator_trace.json


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK


def allocation_size(size: int) -> int:
    """The segment a (rounded) request no cached block fits gets from the device."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False)
class _Block:
    addr: int
    size: int
    segment: int
    small: bool
    allocated: bool = False
    prev: _Block | None = field(default=None, repr=False)
    next: _Block | None = field(default=None, repr=False)


@dataclass
class CachingAllocator:
    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    pinned_peak: int = 0  # the largest total of segments holding a live block (what must fit on the device)
    segments: list[int] = field(default_factory=list)  # sizes, in the order they were reserved
    _free: dict[bool, list[tuple[int, int, _Block]]] = field(default_factory=lambda: {True: [], False: []})
    _live_per_segment: list[int] = field(default_factory=list)
    _pinned: int = 0
    _next_addr: int = 0

    def malloc(self, size: int) -> _Block:
        size = round_size(size)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            block = self._new_segment(allocation_size(size), small)
        rest = block.size - size
        if (rest >= MIN_BLOCK) if small else (rest > SMALL_SIZE):
            tail = _Block(block.addr + size, rest, block.segment, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            bisect.insort(pool, (tail.size, tail.addr, tail))
        block.allocated = True
        self.allocated += block.size
        if self._live_per_segment[block.segment] == 0:
            self._pinned += self.segments[block.segment]
        self._live_per_segment[block.segment] += 1
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.pinned_peak = max(self.pinned_peak, self._pinned)
        return block

    def free(self, block: _Block) -> None:
        if not block.allocated:
            raise ValueError(f"block at {block.addr} freed twice")
        block.allocated = False
        self.allocated -= block.size
        self._live_per_segment[block.segment] -= 1
        if self._live_per_segment[block.segment] == 0:
            self._pinned -= self.segments[block.segment]
        pool = self._free[block.small]
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                pool.pop(bisect.bisect_left(pool, (other.size, other.addr)))
                if other is block.prev:
                    other.size += block.size
                    other.next = block.next
                    if block.next is not None:
                        block.next.prev = other
                    block = other
                else:
                    block.size += other.size
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
        bisect.insort(pool, (block.size, block.addr, block))

    def release_cached(self) -> int:
        """Give back every segment that holds no live block (torch.cuda.empty_cache); the bytes released."""
        released = 0
        for small, pool in self._free.items():
            keep = []
            for entry in pool:
                block = entry[2]
                if block.prev is None and block.next is None and self._live_per_segment[block.segment] == 0:
                    released += block.size
                else:
                    keep.append(entry)
            self._free[small] = keep
        self.reserved -= released
        return released

    def _new_segment(self, size: int, small: bool) -> _Block:
        block = _Block(self._next_addr, size, len(self.segments), small)
        self._next_addr += size
        self.segments.append(size)
        self._live_per_segment.append(0)
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block


def replay(events: list[list[int]] | list[tuple[int, int, int]]) -> dict:
    """Replay a recorded trace of (code, size, address) events through the model: its allocations and frees (by the
    recorded address) drive the model, its segment events are what the real allocator reserved; where the allocator
    gave segments back (empty_cache), the model gives back its empty ones too. The trace must start at an empty
    allocator (recorded from start-up, not cut)."""
    model = CachingAllocator()
    live: dict[int, _Block] = {}
    recorded, recorded_peak, recorded_segments = 0, 0, []
    releasing = False  # within a run of recorded segment frees: the model released its empty segments at the first
    for i, (code, size, addr) in enumerate(events):
        if code != SEGMENT_FREE:
            releasing = False
        if code == ALLOC:
            live[addr] = model.malloc(size)
        elif code == FREE:
            block = live.pop(addr, None)
            if block is None:
                raise ValueError(f"event {i}: a free at {addr:#x} of no recorded allocation (a cut trace?)")
            model.free(block)
        elif code == SEGMENT_ALLOC:
            recorded += size
            recorded_peak = max(recorded_peak, recorded)
            recorded_segments.append(size)
        elif code == SEGMENT_FREE:
            recorded -= size
            if not releasing:
                model.release_cached()
                releasing = True
    return {"model_peak_reserved": model.peak_reserved, "model_pinned_peak": model.pinned_peak,
            "model_peak_allocated": model.peak_allocated, "model_segments": len(model.segments),
            "recorded_peak_reserved": recorded_peak, "recorded_segments": len(recorded_segments),
            "same_segments": model.segments == recorded_segments}
