"""Weighted mixture of datasets with Megatron-LM's greedy, deterministic blending."""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Sequence

import numpy as np

from megatron_bmw.errors import UsageError

SIZE_MARGIN = 1.005


def _as_float(token: str) -> float | None:
    try:
        return float(token)
    except ValueError:
        return None


def parse_data_path(data_path: list[str]) -> list[tuple[float | None, str]]:
    """Parse Megatron's `--data-path` into `[(weight, prefix), ...]` with weights summing to 1.

    Accepted forms: `[prefix]`, `[w1, prefix1, w2, prefix2, ...]` (recognised by a number as first token) and
    `[prefix1, prefix2, ...]`, whose weights are None: as in Megatron they follow the datasets' sizes, which the
    builder knows (data/builder.py: each prefix's tokens in each split).
    """
    if not data_path:
        raise UsageError("--data-path: no data prefix given")
    if len(data_path) == 1:
        return [(1.0, data_path[0])]
    if _as_float(data_path[0]) is None:
        numeric = [t for t in data_path if _as_float(t) is not None]
        if numeric:
            raise UsageError(
                f"--data-path: mixes prefixes and weights ({numeric[0]!r}); use 'w1 prefix1 w2 prefix2 ...'"
            )
        return [(None, p) for p in data_path]
    if len(data_path) % 2:
        raise UsageError(f"--data-path: weighted form needs weight/prefix pairs, got {len(data_path)} tokens")
    pairs: list[tuple[float, str]] = []
    for raw_weight, prefix in zip(data_path[0::2], data_path[1::2]):
        weight = _as_float(raw_weight)
        if weight is None or not math.isfinite(weight) or weight < 0:
            raise UsageError(f"--data-path: weight {raw_weight!r} is not a non-negative number")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise UsageError("--data-path: weights sum to zero")
    if not math.isfinite(total):
        raise UsageError("--data-path: the weights' sum overflows; give smaller weights (only their ratios count)")
    return [(w / total, p) for w, p in pairs]


def samples_per_dataset(weights: Sequence[float], size: int) -> list[int]:
    """Samples to request from each dataset so a blend of `size` never runs short (0.5% margin)."""
    return [int(math.ceil(size * w * SIZE_MARGIN)) for w in weights]


def build_blending_indices(weights: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset id, sample id within that dataset) for each of `size` samples.

    Sample i goes to the dataset whose count lags its target `weight * max(i, 1)` the most
    (lowest id on ties), so every prefix of the blend keeps the proportions within one sample.
    """
    w = [float(x) for x in weights]
    n = len(w)
    counts = [0] * n
    dataset_index = np.empty(size, dtype=np.int16 if n < 2**15 else np.int32)
    sample_index = np.empty(size, dtype=np.int64)
    others = range(1, n)
    for i in range(size):
        scale = float(max(i, 1))
        best, best_err = 0, w[0] * scale - counts[0]
        for d in others:
            err = w[d] * scale - counts[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, sample_index


class BlendedDataset:
    """`size` samples mixed from `datasets` in proportion to `weights`; items gain a `dataset_id` key."""

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        size: int,
        cache_dir: str | None = None,
        name: str = "train",
    ) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("BlendedDataset needs one weight per dataset and at least one dataset")
        w = np.asarray(weights, dtype=np.float64)
        if (w < 0).any() or w.sum() <= 0:
            raise UsageError(f"--data-path: blend weights {list(weights)} must be non-negative with a positive sum")
        self.datasets = list(datasets)
        self.weights = w / w.sum()
        self.size = int(size)
        self.name = name
        ids = [getattr(d, "unique_id", f"{type(d).__name__}:{len(d)}") for d in self.datasets]
        self.description = {"class": "BlendedDataset", "datasets": ids, "weights": self.weights.tolist(), "size": self.size}
        self.unique_id = hashlib.md5(json.dumps(self.description, sort_keys=True).encode()).hexdigest()
        self.built_from_cache = False
        paths = None
        if cache_dir is not None:
            base = os.path.join(cache_dir, f"{self.unique_id}-BlendedDataset-{name}")
            paths = (f"{base}-dataset_index.npy", f"{base}-dataset_sample_index.npy")
        if paths is not None and all(os.path.isfile(p) for p in paths):
            self.dataset_index = np.load(paths[0], mmap_mode="r")
            self.dataset_sample_index = np.load(paths[1], mmap_mode="r")
            self.built_from_cache = True
        else:
            self.dataset_index, self.dataset_sample_index = build_blending_indices(self.weights, self.size)
            if paths is not None:
                self._save(cache_dir, paths)
        self._check_sizes()

    def _save(self, cache_dir: str, paths: tuple[str, str]) -> None:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for path, array in zip(paths, (self.dataset_index, self.dataset_sample_index)):
                tmp = f"{path}.{os.getpid()}.tmp.npy"
                np.save(tmp, array, allow_pickle=False)
                os.replace(tmp, path)
        except OSError as exc:
            raise UsageError(f"--data-cache-path: cannot write blend cache in {cache_dir!r}: {exc.strerror}") from None

    def _check_sizes(self) -> None:
        counts = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for d, dataset in enumerate(self.datasets):
            if counts[d] > len(dataset):
                raise ValueError(f"dataset {d} of the {self.name} blend has {len(dataset)} samples, needs {counts[d]}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.size:
            raise IndexError(f"sample {i} out of range for {self.size} samples in {self.name}")
        d = int(self.dataset_index[i])
        item = dict(self.datasets[d][int(self.dataset_sample_index[i])])
        item["dataset_id"] = d
        return item
