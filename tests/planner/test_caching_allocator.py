"""planner/caching_allocator.py against the rules of PyTorch's CUDA caching allocator (default settings)."""

import pytest

from megatron_bmw.planner.caching_allocator import (ALLOC, FREE, SEGMENT_ALLOC, SEGMENT_FREE, CachingAllocator,
                                                     allocation_size, replay, round_size)

MiB = 2**20


def test_rounding_and_the_segment_a_request_gets():
    assert round_size(1) == 512 and round_size(513) == 1024 and round_size(4096) == 4096
    assert allocation_size(512) == 2 * MiB and allocation_size(MiB) == 2 * MiB  # small pool
    assert allocation_size(MiB + 512) == 20 * MiB and allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB and allocation_size(11 * MiB + 1) == 12 * MiB


def test_a_segment_is_split_and_its_rest_serves_the_next_requests():
    a = CachingAllocator()
    first = a.malloc(3 * MiB)  # a 20 MiB segment, 17 MiB left free
    second = a.malloc(5 * MiB)
    assert a.segments == [20 * MiB] and second.addr == first.addr + 3 * MiB
    assert a.allocated == 8 * MiB and a.reserved == 20 * MiB
    small = a.malloc(1000)  # the small pool has its own 2 MiB segment
    assert a.segments == [20 * MiB, 2 * MiB] and small.size == 1024


def test_a_large_block_is_not_split_for_a_rest_of_one_mib_or_less():
    a = CachingAllocator()
    block = a.malloc(11 * MiB)  # a 12 MiB segment: 1 MiB left, kept in the block
    assert block.size == 12 * MiB and a.allocated == 12 * MiB
    a.free(block)
    again = a.malloc(11 * MiB + 512 * 1024)  # the cached 12 MiB block fits: no new segment
    assert again.addr == block.addr and a.segments == [12 * MiB]


def test_best_fit_takes_the_smallest_free_block_then_the_lowest_address():
    a = CachingAllocator()
    blocks = [a.malloc(n * MiB) for n in (12, 16, 12, 14)]
    for b in blocks:
        a.free(b)
    assert a.malloc(13 * MiB).size == 14 * MiB  # 14 MiB is the smallest that holds 13 MiB
    assert a.malloc(11 * MiB + 512 * 1024).addr == blocks[0].addr  # two 12 MiB blocks: the lower address


def test_freed_neighbours_merge_into_one_block():
    a = CachingAllocator()
    parts = [a.malloc(4 * MiB) for _ in range(5)]  # one 20 MiB segment, cut in five
    for b in (parts[1], parts[3], parts[2]):
        a.free(b)
    merged = a.malloc(12 * MiB)  # 4 + 4 + 4 merged: fits without a new segment
    assert a.segments == [20 * MiB] and merged.addr == parts[1].addr


def test_gaps_between_live_blocks_cost_a_new_segment():
    """A held block between two freed ones: 8 MiB are free in the segment but no 6 MiB piece is whole."""
    a = CachingAllocator()
    x, held, y, rest = a.malloc(4 * MiB), a.malloc(4 * MiB), a.malloc(4 * MiB), a.malloc(8 * MiB)
    a.free(x)
    a.free(y)
    a.malloc(6 * MiB)
    assert a.segments == [20 * MiB, 20 * MiB]
    assert a.peak_allocated == 20 * MiB and a.peak_reserved == 40 * MiB and a.pinned_peak == 40 * MiB
    a.free(held)
    a.free(rest)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(held)


def test_pinned_peak_leaves_out_cached_empty_segments():
    a = CachingAllocator()
    big = a.malloc(40 * MiB)
    a.free(big)  # cached, empty: released if the device ran out
    a.malloc(30 * MiB)  # does not fit the cached 40 MiB? it does: best fit takes it, split
    assert a.segments == [40 * MiB]
    b = a.malloc(50 * MiB)
    assert a.segments == [40 * MiB, 50 * MiB] and a.pinned_peak == 90 * MiB
    a.free(b)
    assert a.reserved == 90 * MiB


def test_replay_sets_the_model_beside_the_recorded_segments():
    # the 12 MiB left in the 20 MiB segment do not hold 13 MiB: a 14 MiB segment, kept whole (1 MiB left)
    events = [(SEGMENT_ALLOC, 20 * MiB, 0), (ALLOC, 3 * MiB, 0), (ALLOC, 5 * MiB, 3 * MiB), (FREE, 3 * MiB, 0),
              (SEGMENT_ALLOC, 14 * MiB, 20 * MiB), (ALLOC, 13 * MiB, 20 * MiB)]
    out = replay(events)
    assert out["same_segments"] and out["model_peak_reserved"] == out["recorded_peak_reserved"] == 34 * MiB
    assert out["model_peak_allocated"] == 19 * MiB  # 5 + 14: the 13 MiB request holds its whole block
    wrong = replay(events[:4] + [(SEGMENT_ALLOC, 20 * MiB, 20 * MiB), (ALLOC, 11 * MiB, 20 * MiB)])
    assert not wrong["same_segments"] and wrong["model_segments"] == 1  # the model fits 11 MiB in the 12 left
    with pytest.raises(ValueError, match="a cut trace"):
        replay(events[3:])


def test_empty_cache_gives_back_the_segments_without_a_live_block():
    a = CachingAllocator()
    kept, gone = a.malloc(4 * MiB), a.malloc(30 * MiB)  # a 20 MiB segment (kept alive) and a 30 MiB one
    part = a.malloc(2 * MiB)  # in the 20 MiB segment too
    a.free(gone)
    a.free(part)
    assert a.release_cached() == 30 * MiB and a.reserved == 20 * MiB  # the 20 MiB one still holds `kept`
    again = a.malloc(30 * MiB)
    assert a.segments == [20 * MiB, 30 * MiB, 30 * MiB] and again.segment == 2
    a.free(kept)
    assert a.release_cached() == 20 * MiB


def test_replay_follows_a_recorded_empty_cache():
    events = [(SEGMENT_ALLOC, 30 * MiB, 0), (ALLOC, 30 * MiB, 0), (FREE, 30 * MiB, 0),
              (SEGMENT_FREE, 30 * MiB, 0), (SEGMENT_ALLOC, 12 * MiB, 0), (ALLOC, 12 * MiB, 0)]
    out = replay(events)  # without the release the model would cut 12 MiB from its cached 30 MiB block
    assert out["same_segments"] and out["model_segments"] == 2
