"""Measure the activation bytes a piece of model code keeps for backward, with saved-tensor hooks.

Every tensor autograd saves passes through the pack hook; we count its storage once (views share one) and
skip parameters. Non-reentrant activation checkpointing saves its inputs through the same hooks, so
recomputation is measured as it really is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class SavedBytes:
    """Storages saved during the measured region: data_ptr -> (bytes, element size)."""

    storages: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(n for n, _ in self.storages.values())

    def by_itemsize(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for n, size in self.storages.values():
            out[size] = out.get(size, 0) + n
        return out


@contextmanager
def record_saved(exclude: Iterable[torch.Tensor] = ()):
    """Context manager yielding a SavedBytes filled with what autograd saves inside it.

    `exclude`: tensors (parameters) whose storages are not activations."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    result = SavedBytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in skip and ptr not in result.storages:
            result.storages[ptr] = (storage.nbytes(), t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield result


def measure_saved(fn: Callable[[], torch.Tensor], exclude: Iterable[torch.Tensor] = ()) -> tuple[SavedBytes, torch.Tensor]:
    """Run `fn()` under `record_saved`; return what it saved and its output (keep it alive while reading)."""
    with record_saved(exclude) as saved:
        out = fn()
    return saved, out
