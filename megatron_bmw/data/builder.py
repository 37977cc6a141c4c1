"""Entry point for the training loop: train/valid/test datasets from a DataConfig."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from megatron_bmw.config import DataConfig
from megatron_bmw.data.blended_dataset import BlendedDataset, parse_data_path, samples_per_dataset
from megatron_bmw.data.gpt_dataset import (
    SPLIT_NAMES,
    GPTDataset,
    MockGPTDataset,
    default_cache_dir,
    parse_split,
    split_ranges,
)
from megatron_bmw.data.indexed_dataset import IndexedDataset
from megatron_bmw.data.tokenizers import build_tokenizer
from megatron_bmw.errors import UsageError

if TYPE_CHECKING:
    from megatron_bmw.data.bert_dataset import BertSampleConfig

Datasets = tuple[object | None, object | None, object | None]


def _mock_datasets(cfg: DataConfig, seq_length: int, seed: int, num_samples: tuple[int, int, int]) -> Datasets:
    if cfg.tokenizer_type is not None:
        vocab_size = build_tokenizer(cfg).vocab_size
    elif cfg.vocab_size is not None:
        vocab_size = cfg.vocab_size
    else:
        raise UsageError("--vocab-size: required with --mock-data when no --tokenizer-type is given")
    weights = parse_split(cfg.split)
    return tuple(
        MockGPTDataset(vocab_size, n, seq_length, seed, name) if n and w > 0 else None
        for name, n, w in zip(SPLIT_NAMES, num_samples, weights)
    )


def build_gpt_datasets(
    cfg: DataConfig,
    seq_length: int,
    seed: int,
    num_samples: tuple[int, int, int],
    check_vocab_size: int | None = None,
) -> Datasets:
    """(train, valid, test) datasets; None where the split is empty or 0 samples are requested.

    Each item is `{"text": int64 array of seq_length + 1 tokens}` (blends add `"dataset_id"`).
    Every prefix of `cfg.data_path` is split by `cfg.split` on its own; a blend draws
    `ceil(weight * n * 1.005)` samples per prefix. A prefix whose split is empty leaves that
    split's blend and the other weights are renormalised. Index files are cached under
    `cfg.data_cache_path` (default `<prefix dir>/cache`). `check_vocab_size` scans every `.bin`
    for ids out of range (reads all data once).
    In multi-process runs, build on one rank first (e.g. rank 0, then a barrier) so the others load the cache.
    """
    num_samples = tuple(int(n or 0) for n in num_samples)
    if len(num_samples) != 3:
        raise ValueError("num_samples must hold (train, valid, test)")
    if cfg.mock_data:
        return _mock_datasets(cfg, seq_length, seed, num_samples)
    if not cfg.data_path:
        raise UsageError("--data-path: required unless --mock-data is set")
    blend = _weighted(parse_data_path(cfg.data_path))

    def make(ds: IndexedDataset, rng: tuple[int, int], count: int, name: str) -> GPTDataset:
        cache = cfg.data_cache_path or default_cache_dir(ds.path_prefix)
        return GPTDataset(ds, np.arange(*rng), count, seq_length, seed, cache, name)

    def tokens(ds: IndexedDataset, rng: tuple[int, int]) -> int:
        return int(ds.sequence_lengths[rng[0]:rng[1]].sum(dtype=np.int64))

    return _split_and_blend(cfg, blend, num_samples, check_vocab_size, len, tokens, make,
                            lambda first: cfg.data_cache_path or default_cache_dir(first.path_prefix))


def describe(datasets: Datasets) -> str:
    """One line per split: its class and length, for logs."""
    lines = []
    for name, ds in zip(SPLIT_NAMES, datasets):
        lines.append(f"{name}: {'none' if ds is None else f'{type(ds).__name__} with {len(ds)} samples'}")
    return "\n".join(lines)


def build_bert_datasets(cfg: DataConfig, sample: "BertSampleConfig", num_samples: tuple[int, int, int],
                        tokenizer=None, check_vocab_size: int | None = None) -> Datasets:
    """(train, valid, test) BERT datasets (data/bert_dataset.py) over sentence-level prefixes
    (`preprocess_data.py --split-sentences`); each prefix's documents are split by `cfg.split` and blends mix
    the prefixes as for GPT. Mock data uses the tokenizer's special ids, or [PAD] 0 [CLS] 1 [SEP] 2 [MASK] 3."""
    from megatron_bmw.data.bert_dataset import BertDataset, BertVocab, MockBertDataset

    num_samples = tuple(int(n or 0) for n in num_samples)
    if tokenizer is not None:
        vocab = BertVocab.of(tokenizer)
    elif cfg.mock_data and cfg.vocab_size is not None:
        vocab = BertVocab.synthetic(cfg.vocab_size)
    else:
        raise UsageError("--tokenizer-type: BERT data needs BertWordPieceLowerCase or BertWordPieceCase "
                         "(or --mock-data with --vocab-size)")
    weights = parse_split(cfg.split)
    if cfg.mock_data:
        return tuple(MockBertDataset(vocab, n, sample, name) if n and w > 0 else None
                     for name, n, w in zip(SPLIT_NAMES, num_samples, weights))
    if not cfg.data_path:
        raise UsageError("--data-path: required unless --mock-data is set")
    blend = _weighted(parse_data_path(cfg.data_path))
    def make(ds: IndexedDataset, rng: tuple[int, int], count: int, name: str):
        return BertDataset(ds, np.arange(*rng), count, sample, vocab, name)

    def tokens(ds: IndexedDataset, rng: tuple[int, int]) -> int:
        first, last = ds.document_indices[rng[0]], ds.document_indices[rng[1]]
        return int(ds.sequence_lengths[first:last].sum(dtype=np.int64))

    return _split_and_blend(cfg, blend, num_samples, check_vocab_size, lambda ds: len(ds.document_indices) - 1,
                            tokens, make, lambda first: None)


def _weighted(blend: list[tuple[float | None, str]]) -> list[tuple[float | None, str]]:
    """The prefixes of weight > 0 (or None: by size); one of weight 0 is still opened, as Megatron does, so a
    misspelt one is named."""
    if len(blend) == 1:
        return blend
    for _, prefix in (b for b in blend if b[0] == 0):
        IndexedDataset(prefix)
    return [b for b in blend if b[0] is None or b[0] > 0]


def _split_and_blend(cfg: DataConfig, blend: list, num_samples: tuple[int, int, int], check_vocab_size: int | None,
                     length, tokens, make, blend_cache) -> Datasets:
    """Split each prefix of `blend` by `cfg.split` (over `length(ds)` items) and, per split, one dataset
    (`make(ds, range, count, split name)`) or a BlendedDataset of the prefixes that have items there. A prefix
    given without a weight weighs its `tokens(ds, range)` in the split (Megatron: weights from the datasets'
    sizes; it concatenates them exhaustively, here they are sampled in those proportions)."""
    indexed = [IndexedDataset(prefix) for _, prefix in blend]
    if all(length(ds) == 0 for ds in indexed):
        names = ", ".join(prefix for _, prefix in blend)
        plural = "s" if len(blend) > 1 else ""
        raise UsageError(f"--data-path {names}: no documents to train on (empty dataset{plural})")
    if check_vocab_size is not None:
        for ds in indexed:
            ds.check_vocab(check_vocab_size)
    ranges = [split_ranges(cfg.split, length(ds)) for ds in indexed]
    out: list[object | None] = []
    for s, (name, n) in enumerate(zip(SPLIT_NAMES, num_samples)):
        members = [(tokens(ds, r[s]) if w is None else w, ds, r[s])
                   for (w, _), ds, r in zip(blend, indexed, ranges) if r[s][1] > r[s][0]]
        members = [m for m in members if m[0] > 0]
        if n == 0 or not members:
            out.append(None)
            continue
        if len(blend) == 1:
            _, ds, rng = members[0]
            out.append(make(ds, rng, n, name))
            continue
        total = sum(w for w, _, _ in members)
        member_weights = [w / total for w, _, _ in members]
        parts = [make(ds, rng, c, name) for (_, ds, rng), c in zip(members, samples_per_dataset(member_weights, n))]
        out.append(BlendedDataset(parts, member_weights, n, blend_cache(members[0][1]), name))
    return tuple(out)
