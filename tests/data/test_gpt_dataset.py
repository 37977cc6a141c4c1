"""GPT dataset indices: coverage, document order, splits, epochs, caching and mock data."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from megatron_bmw.data.builder import build_gpt_datasets
from megatron_bmw.config import DataConfig
from megatron_bmw.data.gpt_dataset import (
    GPTDataset,
    MockGPTDataset,
    build_indices,
    build_sample_index,
    index_bytes,
    parse_split,
    split_ranges,
)
from megatron_bmw.data.indexed_dataset import IndexedDataset
from megatron_bmw.errors import UsageError

from .conftest import counting_docs, write_dataset


def reference_sample_index(lengths, document_index, seq_length, num_samples):
    """Megatron-LM's sample-boundary walk, written as a plain loop."""
    out = [(0, 0)]
    pos, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining:
            available = lengths[document_index[pos]] - offset
            remaining -= available
            if remaining <= 0:
                offset += remaining + available - 1
                remaining = 0
            else:
                pos, offset = pos + 1, 0
        out.append((pos, offset))
    return np.array(out)


@pytest.mark.parametrize("seed", range(5))
def test_sample_index_matches_reference_walk(seed):
    rng = np.random.RandomState(seed)
    lengths = rng.randint(0, 12, size=40)
    lengths[0] = 0
    document_index = rng.permutation(40)
    seq_length = int(rng.randint(1, 9))
    num_samples = (int(lengths.sum()) - 1) // seq_length
    ours = build_sample_index(lengths, document_index, seq_length, num_samples)
    assert ours.tolist() == reference_sample_index(lengths, document_index, seq_length, num_samples).tolist()


def test_split_ranges_follow_megatron_rounding():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("8/2") == pytest.approx([0.8, 0.2, 0.0])
    assert split_ranges("949,50,1", 1000) == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges("1,1,1", 10) == [(0, 4), (4, 7), (7, 10)]
    assert split_ranges("969,30,1", 10) == [(0, 10), (10, 10), (10, 10)]
    for bad in ["", "a,b", "1,2,3,4", "-1,2", "0,0,0"]:
        with pytest.raises(UsageError, match="--split"):
            parse_split(bad)


@pytest.fixture
def counting(tmp_path):
    """30 documents of unequal length whose tokens are 0, 1, 2, ... in storage order."""
    lengths = [int(n) for n in np.random.RandomState(1).randint(1, 20, size=30)]
    prefix = write_dataset(tmp_path / "count", counting_docs(lengths), dtype=np.int32)
    return IndexedDataset(prefix), lengths


def samples_in_order(ds: GPTDataset) -> list[np.ndarray]:
    """Samples in sample-index order (undoing the shuffle)."""
    order = np.argsort(np.asarray(ds.shuffle_index))
    return [ds[int(k)]["text"] for k in order]


def test_one_epoch_covers_every_token_once_in_document_order(counting, tmp_path):
    indexed, lengths = counting
    docs = np.arange(5, 25)
    total = sum(lengths[5:25])
    seq_length = 7
    num_samples = (total - 1) // seq_length
    ds = GPTDataset(indexed, docs, num_samples, seq_length, seed=3, cache_dir=str(tmp_path / "c"), name="train")
    assert len(ds) == num_samples
    assert sorted(ds.document_index.tolist()) == docs.tolist()
    stream = np.concatenate([indexed[int(d)] for d in ds.document_index])

    samples = samples_in_order(ds)
    assert all(s.dtype == np.int64 and len(s) == seq_length + 1 for s in samples)
    for a, b in zip(samples, samples[1:]):
        assert a[-1] == b[0]
    covered = np.concatenate([s[:-1] for s in samples] + [samples[-1][-1:]])
    assert covered.tolist() == stream[: len(covered)].tolist()
    assert len(covered) >= total - seq_length + 1
    assert len(set(covered.tolist())) == len(covered)
    assert any(np.diff(s).max() > 1 for s in samples), "some sample should cross a document boundary"
    shuffled = [int(i) for i in ds.shuffle_index]
    assert sorted(shuffled) == list(range(num_samples)) and shuffled != sorted(shuffled)


def test_exact_fit_covers_all_tokens(tmp_path):
    prefix = write_dataset(tmp_path / "fit", counting_docs([4, 6, 3, 4]), dtype=np.int32)  # 17 tokens = 4 * 4 + 1
    ds = GPTDataset(IndexedDataset(prefix), np.arange(4), 4, 4, seed=0, cache_dir=str(tmp_path / "c"))
    samples = samples_in_order(ds)
    covered = np.concatenate([s[:-1] for s in samples] + [samples[-1][-1:]])
    assert sorted(covered.tolist()) == list(range(17))


def test_epochs_and_separate_final_epoch(counting, tmp_path):
    indexed, lengths = counting
    docs = np.arange(30)
    per_epoch = (sum(lengths) - 1) // 5
    # 2.1 epochs: the last epoch is needed for < 80% of its samples, so it is shuffled on its own.
    ds = GPTDataset(indexed, docs, int(2.1 * per_epoch), 5, seed=0, cache_dir=str(tmp_path / "c"))
    index = ds.document_index.tolist()
    assert len(index) == 90
    assert sorted(index[:60]) == sorted(docs.tolist() * 2)
    assert sorted(index[60:]) == docs.tolist()
    assert len(ds) >= int(2.1 * per_epoch)
    boundary = (2 * sum(lengths) - 1) // 5
    assert sorted(int(i) for i in ds.shuffle_index[:boundary]) == list(range(boundary))
    # 1.9 epochs: the two epochs are shuffled together.
    ds = GPTDataset(indexed, docs, int(1.9 * per_epoch), 5, seed=0, cache_dir=str(tmp_path / "c"))
    assert len(ds.document_index) == 60 and sorted(ds.document_index[:30].tolist()) != docs.tolist()


def test_cache_reused_and_rebuilt_when_seed_changes(counting, tmp_path):
    indexed, _ = counting
    cache = tmp_path / "cache"
    args = dict(indexed=indexed, document_ids=np.arange(30), num_samples=20, seq_length=6, cache_dir=str(cache))
    first = GPTDataset(seed=1, **args)
    assert not first.built_from_cache and len(list(cache.glob("*.npy"))) == 3
    second = GPTDataset(seed=1, **args)
    assert second.built_from_cache
    assert [second[i]["text"].tolist() for i in range(20)] == [first[i]["text"].tolist() for i in range(20)]
    other = GPTDataset(seed=2, **args)
    assert not other.built_from_cache and len(list(cache.glob("*.npy"))) == 6
    assert [other[i]["text"].tolist() for i in range(20)] != [first[i]["text"].tolist() for i in range(20)]
    assert GPTDataset(seed=2, **args).built_from_cache


def test_default_cache_dir_and_pickle(counting):
    indexed, _ = counting
    ds = GPTDataset(indexed, np.arange(30), 10, 4, seed=0, cache_dir=None)
    assert ds.cache_dir.endswith("cache")
    blob = pickle.dumps(ds)
    again = pickle.loads(blob)
    assert again[3]["text"].tolist() == ds[3]["text"].tolist()


def test_builder_splits_share_no_document(tmp_path):
    lengths = [5 + i % 7 for i in range(100)]
    prefix = write_dataset(tmp_path / "d", counting_docs(lengths), dtype=np.int32)
    starts = np.cumsum([0] + lengths)
    cfg = DataConfig(data_path=[prefix], split="80,15,5")
    train, valid, test = build_gpt_datasets(cfg, seq_length=8, seed=0, num_samples=(50, 10, 5))
    seen = []
    for ds, (lo, hi) in zip((train, valid, test), [(0, 80), (80, 95), (95, 100)]):
        assert set(ds.document_index.tolist()) <= set(range(lo, hi))
        tokens = np.concatenate([ds[i]["text"] for i in range(len(ds))])
        assert tokens.min() >= starts[lo] and tokens.max() < starts[hi]
        seen.append(set(ds.document_index.tolist()))
    assert not (seen[0] & seen[1]) and not (seen[1] & seen[2])
    assert build_gpt_datasets(cfg, 8, 0, (50, 0, 5))[1] is None
    assert build_gpt_datasets(DataConfig(data_path=[prefix], split="100,0,0"), 8, 0, (5, 5, 5))[1:] == (None, None)


def test_builder_errors(tmp_path):
    with pytest.raises(UsageError, match="--data-path: required"):
        build_gpt_datasets(DataConfig(), 8, 0, (1, 1, 1))
    with pytest.raises(UsageError, match="nope.idx: no such file"):
        build_gpt_datasets(DataConfig(data_path=[str(tmp_path / "nope")]), 8, 0, (1, 1, 1))
    prefix = write_dataset(tmp_path / "d", [[1, 2, 30]])
    with pytest.raises(UsageError, match="--split"):
        build_gpt_datasets(DataConfig(data_path=[prefix], split="x"), 8, 0, (1, 1, 1))
    with pytest.raises(UsageError, match="token id 30 >= vocab size 10"):
        build_gpt_datasets(DataConfig(data_path=[prefix]), 8, 0, (1, 0, 0), check_vocab_size=10)
    empty = write_dataset(tmp_path / "e", [[]])
    with pytest.raises(UsageError, match="no tokens"):
        build_gpt_datasets(DataConfig(data_path=[empty]), 8, 0, (1, 0, 0))


def test_mock_data_is_a_pure_function_of_seed_split_index():
    cfg = DataConfig(mock_data=True, vocab_size=50, split="90,10,0")
    train, valid, test = build_gpt_datasets(cfg, seq_length=16, seed=7, num_samples=(100, 10, 10))
    assert test is None and isinstance(train, MockGPTDataset) and len(train) == 100
    later = train[99]["text"]
    again = MockGPTDataset(50, 1000, 16, 7, "train")
    assert again[99]["text"].tolist() == later.tolist()
    assert later.dtype == np.int64 and len(later) == 17 and later.max() < 50
    assert valid[0]["text"].tolist() != train[0]["text"].tolist()
    assert MockGPTDataset(50, 100, 16, 8, "train")[0]["text"].tolist() != train[0]["text"].tolist()
    with pytest.raises(UsageError, match="--vocab-size"):
        build_gpt_datasets(DataConfig(mock_data=True), 16, 0, (1, 0, 0))
    null = DataConfig(mock_data=True, tokenizer_type="NullTokenizer", vocab_size=9)
    assert build_gpt_datasets(null, 4, 0, (1, 0, 0))[0].vocab_size == 10


def test_index_estimate_covers_the_arrays_built(counting, tmp_path):
    indexed, lengths = counting
    docs = np.arange(len(lengths))
    for samples in (3, 40, 500):
        arrays = build_indices(np.asarray(lengths), docs, samples, 8, 0)
        assert index_bytes(sum(lengths), len(lengths), samples, 8) >= sum(a.nbytes for a in arrays)


def test_a_sample_index_beyond_memory_names_the_training_length(counting, tmp_path):
    indexed, _ = counting
    with pytest.raises(UsageError, match=r"--train-iters/--train-samples: .*more than this machine's"):
        GPTDataset(indexed, np.arange(len(indexed)), 10**15, 8, 0, str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
