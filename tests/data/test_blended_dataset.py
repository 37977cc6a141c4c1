"""Blending: exact proportions, per-dataset sample counts, `--data-path` parsing."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_bmw.data.blended_dataset import BlendedDataset, build_blending_indices, samples_per_dataset
from megatron_bmw.data.builder import build_gpt_datasets
from megatron_bmw.config import DataConfig
from megatron_bmw.data.blended_dataset import parse_data_path
from megatron_bmw.data.gpt_dataset import MockGPTDataset
from megatron_bmw.errors import UsageError

from .conftest import write_dataset


def test_proportions_within_one_percent_over_10k():
    weights = np.array([0.5, 0.3, 0.15, 0.05])
    ids, sample_ids = build_blending_indices(weights, 10_000)
    counts = np.bincount(ids, minlength=4)
    assert np.all(np.abs(counts / 10_000 - weights) < 0.01)
    for d in range(4):
        assert sample_ids[ids == d].tolist() == list(range(counts[d]))
    for n in (100, 1000, 5000):
        prefix_counts = np.bincount(ids[:n], minlength=4)
        assert np.all(np.abs(prefix_counts - weights * n) <= 1.0)


def test_blended_dataset_items_and_cache(tmp_path):
    parts = [MockGPTDataset(100, 700, 8, 0, f"p{i}") for i in range(2)]
    blend = BlendedDataset(parts, [0.6, 0.4], 1000, cache_dir=str(tmp_path), name="train")
    assert len(blend) == 1000 and not blend.built_from_cache
    item = blend[5]
    d = item["dataset_id"]
    assert item["text"].tolist() == parts[d][int(blend.dataset_sample_index[5])]["text"].tolist()
    again = BlendedDataset(parts, [0.6, 0.4], 1000, cache_dir=str(tmp_path), name="train")
    assert again.built_from_cache and np.array_equal(again.dataset_index, blend.dataset_index)
    with pytest.raises(ValueError, match="needs"):
        BlendedDataset([MockGPTDataset(100, 10, 8, 0, "a"), parts[1]], [0.6, 0.4], 1000)


def test_samples_per_dataset_margin():
    assert samples_per_dataset([0.5, 0.5], 1000) == [503, 503]
    assert samples_per_dataset([0.7, 0.3], 10) == [8, 4]


def test_parse_data_path():
    assert parse_data_path(["a"]) == [(1.0, "a")]
    assert parse_data_path(["a", "b"]) == [(None, "a"), (None, "b")]  # by size: the builder weighs them
    assert parse_data_path(["3", "a", "1", "b"]) == [(0.75, "a"), (0.25, "b")]
    for bad, why in [([], "no data prefix"), (["1", "a", "2"], "pairs"), (["1", "a", "x", "b"], "'x' is not"),
                     (["a", "0.5"], "mixes"), (["0", "a", "0", "b"], "sum to zero"), (["-1", "a", "2", "b"], "'-1'"),
                     (["1e308", "a", "1e308", "b"], "the weights' sum overflows")]:
        with pytest.raises(UsageError, match=why) as info:
            parse_data_path(bad)
        assert str(info.value).startswith("--data-path: ") and "\n" not in str(info.value)


def test_builder_blends_two_prefixes(tmp_path):
    a = write_dataset(tmp_path / "a", [[1] * 30 for _ in range(40)])
    b = write_dataset(tmp_path / "b", [[2] * 30 for _ in range(40)])
    cfg = DataConfig(data_path=["0.7", a, "0.3", b], split="90,10,0", data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_gpt_datasets(cfg, seq_length=16, seed=0, num_samples=(1000, 100, 10))
    assert test is None and len(train) == 1000 and len(valid) == 100
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert counts.tolist() == [700, 300]
    assert [len(d) >= c for d, c in zip(train.datasets, samples_per_dataset([0.7, 0.3], 1000))] == [True, True]
    tokens = {d: set(train[i]["text"].tolist()) for i in range(50) for d in [train[i]["dataset_id"]]}
    assert tokens == {0: {1}, 1: {2}}
    again = build_gpt_datasets(cfg, seq_length=16, seed=0, num_samples=(1000, 100, 10))[0]
    assert again.built_from_cache and all(d.built_from_cache for d in again.datasets)


def test_prefixes_without_weights_weigh_their_tokens_in_each_split(tmp_path):
    """Megatron's `--data-path a b`: weights from the datasets' sizes (probe, session 12: here they were equal,
    so a tiny dataset filled half the training samples)."""
    a = write_dataset(tmp_path / "a", [[1] * 30 for _ in range(90)])
    b = write_dataset(tmp_path / "b", [[2] * 10 for _ in range(30)])
    cfg = DataConfig(data_path=[a, b], split="100,0,0", data_cache_path=str(tmp_path / "cache"))
    train = build_gpt_datasets(cfg, seq_length=16, seed=0, num_samples=(1000, 0, 0))[0]
    counts = np.bincount(np.asarray(train.dataset_index), minlength=2)
    assert counts.tolist() == [900, 100]  # 2700 tokens against 300


def test_empty_datasets_are_named_not_the_split(tmp_path):
    """Probe, session 12: a dataset of no sequences said '--split gives the training split no data'."""
    empty = write_dataset(tmp_path / "e", [])
    cfg = DataConfig(data_path=[empty], split="100,0,0", data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(UsageError, match=r"--data-path .*e: no documents to train on \(empty dataset\)"):
        build_gpt_datasets(cfg, seq_length=16, seed=0, num_samples=(10, 0, 0))


def test_a_prefix_of_weight_zero_is_still_opened(tmp_path):
    """As Megatron opens every prefix: a misspelt one with weight 0 is named, not silently skipped."""
    a = write_dataset(tmp_path / "a", [[1] * 30 for _ in range(40)])
    cfg = DataConfig(data_path=["1", a, "0", str(tmp_path / "typo")], split="100,0,0",
                     data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(UsageError, match="typo"):
        build_gpt_datasets(cfg, seq_length=16, seed=0, num_samples=(100, 0, 0))
    b = write_dataset(tmp_path / "b", [[2] * 30 for _ in range(40)])
    cfg = DataConfig(data_path=["1", a, "0", b], split="100,0,0", data_cache_path=str(tmp_path / "cache"))
    train = build_gpt_datasets(cfg, seq_length=16, seed=0, num_samples=(100, 0, 0))[0]
    assert {t for i in range(len(train)) for t in train[i]["text"].tolist()} == {1}  # weight 0: never drawn
