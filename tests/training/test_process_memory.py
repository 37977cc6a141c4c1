"""The CPU plan check's measure: the rise of this process's peak resident memory."""

import torch

from megatron_bmw.training.process_memory import ResidentPeak


def test_growth_sees_a_freed_allocation_and_ignores_what_came_before():
    before = torch.ones(48 * 2**20 // 4)  # held before the start: not growth
    peak = ResidentPeak()
    assert peak.base is not None and peak.base >= before.numel() * 4
    x = torch.ones(96 * 2**20 // 4)  # touched pages: resident
    del x  # freed again: the peak remembers it
    grown = peak.growth()
    assert 90 * 2**20 <= grown <= 200 * 2**20, grown
    del before
