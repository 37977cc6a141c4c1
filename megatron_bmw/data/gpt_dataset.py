"""GPT pretraining samples over an IndexedDataset, following Megatron-LM's index scheme.

Three arrays define the dataset, all built with one `numpy.random.RandomState(seed)`:
- document index: the split's sequence ids repeated for enough epochs, shuffled (int32);
- sample index: `(position in document index, token offset)` of every sample boundary; boundaries
  lie `seq_length` tokens apart, so a sample of `seq_length + 1` tokens may span documents and
  consecutive samples share one token;
- shuffle index: a permutation of the samples.
As in Megatron-LM, when the last epoch is needed for fewer than 80% of its samples it is shuffled
separately (document and shuffle index), so that its samples do not mix with the full epochs.
The arrays are cached as `.npy` files named by a hash of everything that determines them.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib

import numpy as np

from megatron_bmw.data.indexed_dataset import IndexedDataset
from megatron_bmw.config import parse_split  # noqa: F401 - re-exported for the data layer
from megatron_bmw.errors import UsageError

SPLIT_NAMES = ("train", "valid", "test")
_CACHE_FORMAT = 1
_FINAL_EPOCH_THRESHOLD = 0.80


def split_ranges(split: str, num_elements: int) -> list[tuple[int, int]]:
    """Half-open `[begin, end)` ranges of sequence ids for train/valid/test, rounded as in Megatron-LM."""
    bounds = [0]
    for w in parse_split(split):
        bounds.append(bounds[-1] + int(round(w * float(num_elements))))
    excess = bounds[-1] - num_elements
    bounds = [0] + [max(0, b - excess) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def _num_epochs(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """`documents` tiled `num_epochs` times and shuffled (the last epoch on its own if separate)."""
    if separate_final_epoch and num_epochs > 1:
        head = build_document_index(documents, num_epochs - 1, rng, False)
        tail = build_document_index(documents, 1, rng, False)
        return np.concatenate((head, tail))
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int, num_samples: int
) -> np.ndarray:
    """Boundaries `(document position, offset)` of samples `0..num_samples`; shape `(num_samples + 1, 2)`.

    Sample i covers tokens `[i * seq_length, (i + 1) * seq_length]` of the concatenated document index;
    a boundary on a document end falls at offset 0 of the next non-empty document (Megatron-LM's rule).
    """
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    ends = np.cumsum(lengths)
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc_pos = np.searchsorted(ends, positions, side="right")
    offsets = positions - (ends[doc_pos] - lengths[doc_pos])
    dtype = np.int32 if max(len(document_index), int(lengths.max(initial=0))) < 2**31 - 1 else np.int64
    index = np.stack((doc_pos, offsets), axis=1).astype(dtype)
    index[0] = 0
    return index


def build_shuffle_index(num_shuffled: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    """Permutation of `range(total)`: the first `num_shuffled` and the rest are shuffled apart."""
    dtype = np.uint32 if total < np.iinfo(np.uint32).max - 1 else np.int64
    head = np.arange(num_shuffled, dtype=dtype)
    rng.shuffle(head)
    if num_shuffled == total:
        return head
    tail = np.arange(num_shuffled, total, dtype=dtype)
    rng.shuffle(tail)
    return np.concatenate((head, tail))


def build_indices(
    sequence_lengths: np.ndarray, documents: np.ndarray, num_samples: int, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document index, sample index, shuffle index) for `num_samples` samples over `documents`."""
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    num_epochs = _num_epochs(tokens_per_epoch, seq_length, num_samples)
    separate = False
    if num_epochs > 1:
        before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = num_samples - before_last < int(_FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    total = (num_epochs * tokens_per_epoch - 1) // seq_length
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length, total)
    shuffled = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if separate else total
    shuffle_index = build_shuffle_index(shuffled, total, rng)
    return document_index, sample_index, shuffle_index


_LENGTH_FLAGS = {"train": "--train-iters/--train-samples", "valid": "--eval-iters/--eval-interval",
                 "test": "--eval-iters"}


def index_bytes(tokens_per_epoch: int, num_documents: int, num_samples: int, seq_length: int) -> int:
    """Peak bytes build_indices allocates: the tiled document index, its lengths and cumulative sums, and the
    sample boundaries (with their temporaries) and shuffle index over every epoch's samples."""
    epochs = _num_epochs(tokens_per_epoch, seq_length, num_samples)
    total = (epochs * tokens_per_epoch - 1) // seq_length + 1
    return epochs * num_documents * (4 + 8 + 8) + total * (8 * 5 + 8)


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _check_index_fits(lengths, documents: np.ndarray, num_samples: int, seq_length: int, name: str,
                      prefix: str) -> None:
    tokens = int(np.asarray(lengths)[documents].sum(dtype=np.int64))
    need, have = index_bytes(tokens, documents.size, num_samples, seq_length), _memory_bytes()
    if have is not None and need > have:
        epochs = _num_epochs(tokens, seq_length, num_samples)
        raise UsageError(f"{_LENGTH_FLAGS.get(name, name)}: {num_samples} {name} samples are {epochs} epochs of "
                         f"{prefix!r}; their sample index needs {need / 2**30:.0f} GiB, more than this machine's "
                         f"{have / 2**30:.0f} GiB of memory (train for fewer samples or add data)")


def _save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.{os.getpid()}.tmp.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def default_cache_dir(prefix: str) -> str:
    """`<directory of the data prefix>/cache`."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache")


class GPTDataset:
    """Samples of `seq_length + 1` tokens drawn from `document_ids` of `indexed`; `ds[i]["text"]` is int64.

    `len(ds)` is the number of samples in the built epochs (>= num_samples, like Megatron-LM).
    `built_from_cache` tells whether the indices were loaded from `cache_dir` instead of built.
    """

    ARRAYS = ("document_index", "sample_index", "shuffle_index")

    def __init__(
        self,
        indexed: IndexedDataset,
        document_ids: np.ndarray,
        num_samples: int,
        seq_length: int,
        seed: int,
        cache_dir: str | None,
        name: str = "train",
    ) -> None:
        if seq_length < 1:
            raise UsageError(f"--seq-length: must be positive, got {seq_length}")
        if num_samples < 1:
            raise UsageError(f"{name}: number of samples must be positive, got {num_samples}")
        documents = np.asarray(document_ids, dtype=np.int64)
        if documents.size == 0:
            raise UsageError(f"--split: the {name} split of {indexed.path_prefix!r} has no documents")
        if documents.min() < 0 or documents.max() >= len(indexed):
            raise ValueError(f"document ids outside [0, {len(indexed)}) for {indexed.path_prefix!r}")
        lengths = indexed.sequence_lengths
        if int(lengths[documents].sum(dtype=np.int64)) == 0:
            raise UsageError(f"--split: the {name} split of {indexed.path_prefix!r} holds no tokens")
        self.indexed = indexed
        self.name = name
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.cache_dir = cache_dir or default_cache_dir(indexed.path_prefix)
        self.description = {
            "class": "GPTDataset",
            "format": _CACHE_FORMAT,
            "prefix": os.path.abspath(indexed.path_prefix),
            "split": name,
            "documents": [int(documents[0]), int(documents[-1]), int(documents.size)],
            "documents_md5": hashlib.md5(documents.tobytes()).hexdigest(),
            "num_samples": self.num_samples,
            "seq_length": self.seq_length,
            "seed": self.seed,
        }
        self.unique_id = hashlib.md5(json.dumps(self.description, sort_keys=True).encode()).hexdigest()
        paths = self._cache_paths()
        if all(os.path.isfile(p) for p in paths.values()):
            self.built_from_cache = True
        else:
            self.built_from_cache = False
            _check_index_fits(lengths, documents, self.num_samples, self.seq_length, name, indexed.path_prefix)
            try:
                arrays = build_indices(lengths, documents, self.num_samples, self.seq_length, self.seed)
            except MemoryError:
                raise UsageError(f"{_LENGTH_FLAGS.get(name, name)}: the {name} split's sample index for "
                                 f"{self.num_samples} samples of {indexed.path_prefix!r} does not fit in memory") from None
            self._write_cache(paths, arrays)
        self._load(paths)

    def _cache_paths(self) -> dict[str, str]:
        base = os.path.join(self.cache_dir, f"{self.unique_id}-GPTDataset-{self.name}")
        return {name: f"{base}-{name}.npy" for name in self.ARRAYS}

    def _write_cache(self, paths: dict[str, str], arrays: tuple[np.ndarray, ...]) -> None:
        try:
            os.makedirs(self.cache_dir, exist_ok=True)
            for name, array in zip(self.ARRAYS, arrays):
                _save_atomic(paths[name], array)
            desc = os.path.join(self.cache_dir, f"{self.unique_id}-GPTDataset-{self.name}-description.json")
            with open(desc, "w") as f:
                json.dump(self.description, f, indent=2)
        except OSError as exc:
            raise UsageError(f"--data-cache-path: cannot write index cache in {self.cache_dir!r}: {exc.strerror}") from None

    def _load(self, paths: dict[str, str]) -> None:
        self.document_index = np.load(paths["document_index"], mmap_mode="r")
        self.sample_index = np.load(paths["sample_index"], mmap_mode="r")
        self.shuffle_index = np.load(paths["shuffle_index"], mmap_mode="r")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in self.ARRAYS:
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._load(self._cache_paths())

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def tokens(self, i: int) -> np.ndarray:
        """The `seq_length + 1` tokens of sample `i` (after shuffling), as int64."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples in {self.name}")
        j = int(self.shuffle_index[i])
        doc_beg, off_beg = (int(x) for x in self.sample_index[j])
        doc_end, off_end = (int(x) for x in self.sample_index[j + 1])
        get = self.indexed.get
        if doc_beg == doc_end:
            return get(int(self.document_index[doc_beg]), off_beg, off_end - off_beg + 1).astype(np.int64)
        pieces = [get(int(self.document_index[doc_beg]), off_beg)]
        pieces += [get(int(self.document_index[k])) for k in range(doc_beg + 1, doc_end)]
        pieces.append(get(int(self.document_index[doc_end]), 0, off_end + 1))
        return np.concatenate(pieces).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"text": self.tokens(i)}


class MockGPTDataset:
    """Learnable synthetic tokens: sample i is an arithmetic progression modulo vocab_size whose start and step
    (1..8) are drawn from (seed, name, i) only, so every parallel layout sees the same data and the loss falls."""

    def __init__(self, vocab_size: int, num_samples: int, seq_length: int, seed: int, name: str = "train") -> None:
        if vocab_size < 1:
            raise UsageError(f"--vocab-size: must be positive for mock data, got {vocab_size}")
        if seq_length < 1:
            raise UsageError(f"--seq-length: must be positive, got {seq_length}")
        self.vocab_size = int(vocab_size)
        self.num_samples = int(num_samples)
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.name = name
        self._name_key = zlib.crc32(name.encode())
        self.built_from_cache = False

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {i} out of range for {self.num_samples} samples in {self.name}")
        rng = np.random.default_rng([self.seed, self._name_key, int(i)])
        start = int(rng.integers(0, self.vocab_size))
        step = int(rng.integers(1, 9))
        return {"text": (start + step * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size}
