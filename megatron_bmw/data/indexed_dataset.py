"""Reader and writer for Megatron-LM's memory-mapped `.bin/.idx` token datasets (`MMIDIDX`, version 1).

Layout of `<prefix>.idx` (little endian):
    magic b"MMIDIDX\\x00\\x00" | uint64 version=1 | uint8 dtype code | uint64 sequence count N
    | uint64 document count D (= documents + 1) | int32[N] sequence lengths | int64[N] byte pointers
    | int64[D] document indices (sequence index where each document starts, first 0, last N).
`<prefix>.bin` holds the token ids of all sequences back to back.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Iterable

import numpy as np

from megatron_bmw.errors import UsageError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8

DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def dtype_code(dtype: np.dtype | type) -> int:
    """Megatron's numeric code for a numpy dtype."""
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} has no MMIDIDX code") from None


def optimal_dtype(vocab_size: int) -> type:
    """Token dtype Megatron picks for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def index_path(prefix: str) -> str:
    return prefix + ".idx"


def data_path(prefix: str) -> str:
    return prefix + ".bin"


def _write_index(
    path: str, dtype: np.dtype, sequence_lengths: np.ndarray, document_indices: np.ndarray
) -> None:
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths) > 1:
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
    pointers *= np.dtype(dtype).itemsize
    docs = np.asarray(document_indices, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", dtype_code(dtype)))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(docs)))
        f.write(lengths.astype("<i4", copy=False).tobytes(order="C"))
        f.write(pointers.astype("<i8", copy=False).tobytes(order="C"))
        f.write(docs.astype("<i8", copy=False).tobytes(order="C"))


class _Index:
    """Parsed `.idx` file; the three arrays are views into a read-only memmap."""

    def __init__(self, path: str) -> None:
        if not os.path.isfile(path):
            raise UsageError(f"{path}: no such index file")
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < len(MAGIC) or header[: len(MAGIC)] != MAGIC:
            raise UsageError(f"{path}: not a Megatron MMIDIDX index (bad magic)")
        if len(header) < HEADER_SIZE:
            raise UsageError(f"{path}: truncated index header ({size} bytes)")
        version, code, count, doc_count = struct.unpack("<QBQQ", header[len(MAGIC) :])
        if version != VERSION:
            raise UsageError(f"{path}: unsupported index version {version} (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise UsageError(f"{path}: unknown dtype code {code}")
        expected = HEADER_SIZE + count * (4 + 8) + doc_count * 8
        if size < expected:
            raise UsageError(f"{path}: truncated index ({size} bytes, header promises {expected})")
        if doc_count < 1:
            raise UsageError(f"{path}: document index is empty (needs at least the leading 0)")
        self.path = path
        self.dtype = np.dtype(DTYPE_CODES[code])
        mm = np.memmap(path, dtype=np.uint8, mode="r", offset=0, shape=(expected,))
        offset = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(mm, dtype="<i4", count=count, offset=offset)
        offset += count * 4
        self.sequence_pointers = np.frombuffer(mm, dtype="<i8", count=count, offset=offset)
        offset += count * 8
        self.document_indices = np.frombuffer(mm, dtype="<i8", count=doc_count, offset=offset)
        self._mmap = mm
        _check_index(path, self.sequence_lengths, self.sequence_pointers, self.document_indices, self.dtype.itemsize)


CHECK_CHUNK = 1 << 22  # entries checked at a time (bounded temporaries on indexes of 1e8+ sequences)


def _first(bad: np.ndarray, start: int) -> int:
    return start + int(np.flatnonzero(bad)[0])


def _check_index(path: str, lengths: np.ndarray, pointers: np.ndarray, docs: np.ndarray, itemsize: int) -> None:
    """What Megatron's writer guarantees and the readers rely on: lengths >= 0, each sequence starting where the one
    before ends (the first at 0), and a document index rising from 0 to at most the sequence count. A hand-made or
    damaged index failed mid-training (a negative slice, arrays of unequal shape) or sampled past its sequences."""
    count = len(lengths)
    if count and int(pointers[0]) != 0:
        raise UsageError(f"{path}: sequence 0 starts at byte {int(pointers[0])}, not 0 (damaged index?)")
    for start in range(0, count, CHECK_CHUNK):
        ln = lengths[start:start + CHECK_CHUNK]
        if (ln < 0).any():
            i = _first(ln < 0, start)
            raise UsageError(f"{path}: sequence {i} has length {int(lengths[i])} (damaged index?)")
        ends = pointers[start:start + CHECK_CHUNK] + ln.astype(np.int64) * itemsize
        nxt = pointers[start + 1:start + CHECK_CHUNK + 1]
        gap = ends[:len(nxt)] != nxt
        if gap.any():
            i = _first(gap, start) + 1
            raise UsageError(f"{path}: sequence {i} starts at byte {int(pointers[i])}, not where sequence {i - 1} "
                             f"ends ({int(pointers[i - 1]) + int(lengths[i - 1]) * itemsize}) (damaged index?)")
    if int(docs[0]) != 0 or int(docs[-1]) > count:
        raise UsageError(f"{path}: the document index runs from {int(docs[0])} to {int(docs[-1])}, not from 0 to at "
                         f"most the {count} sequences (damaged index?)")
    for start in range(0, len(docs) - 1, CHECK_CHUNK):
        falls = docs[start + 1:start + CHECK_CHUNK + 1] < docs[start:start + CHECK_CHUNK][:len(docs) - 1 - start]
        if falls.any():
            i = _first(falls, start) + 1
            raise UsageError(f"{path}: document {i} starts at sequence {int(docs[i])}, before document {i - 1} "
                             f"({int(docs[i - 1])}) (damaged index?)")


class IndexedDataset:
    """Memory-mapped reader: `ds[i]` is sequence i as a read-only numpy array; nothing is loaded into RAM."""

    def __init__(self, prefix: str) -> None:
        self.path_prefix = prefix
        self._open()

    def _open(self) -> None:
        prefix = self.path_prefix
        idx, binf = index_path(prefix), data_path(prefix)
        for path in (idx, binf):
            if not os.path.isfile(path):
                raise UsageError(f"{path}: no such file (data prefix {prefix!r})")
        self._index = _Index(idx)
        self.dtype = self._index.dtype
        itemsize = self.dtype.itemsize
        lengths, pointers = self._index.sequence_lengths, self._index.sequence_pointers
        needed = int(pointers[-1]) + int(lengths[-1]) * itemsize if len(lengths) else 0
        size = os.path.getsize(binf)
        if size < needed:
            raise UsageError(f"{binf}: data file is {size} bytes but the index needs {needed}")
        if size == 0:
            self._bin = np.empty(0, dtype=self.dtype)
        else:
            self._bin = np.memmap(binf, dtype=self.dtype, mode="r", shape=(size // itemsize,))
        # Plain-ndarray view of the same mapping, so slices are not memmap subclasses.
        self._tokens = self._bin.view(np.ndarray)

    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict) -> None:
        self.path_prefix = state["path_prefix"]
        self._open()

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32 length of every sequence."""
        return self._index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64 byte offset of every sequence in the `.bin` file."""
        return self._index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64 sequence index where each document starts, plus a final entry equal to len(self)."""
        return self._index.document_indices

    def __len__(self) -> int:
        return len(self._index.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of sequence `i` (to its end when length is None)."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences")
        seq_len = int(self._index.sequence_lengths[i])
        if length is None:
            length = seq_len - offset
        if offset < 0 or length < 0 or offset + length > seq_len:
            raise IndexError(f"tokens {offset}:{offset + length} out of range for sequence {i} of length {seq_len}")
        start = int(self._index.sequence_pointers[i]) // self.dtype.itemsize + offset
        return self._tokens[start : start + length]

    def check_vocab(self, vocab_size: int) -> None:
        """Raise UsageError if any token id lies outside [0, vocab_size). Scans the `.bin` once per bound."""
        if self._bin.size == 0:
            return
        top = self._bin.max()
        if top >= vocab_size:
            raise UsageError(f"{data_path(self.path_prefix)}: token id {top} >= vocab size {vocab_size}")
        if np.issubdtype(self.dtype, np.signedinteger) or np.issubdtype(self.dtype, np.floating):
            low = self._bin.min()
            if low < 0:
                raise UsageError(f"{data_path(self.path_prefix)}: negative token id {low}")


class IndexedDatasetBuilder:
    """Append sequences to a `.bin` file, then write the matching `.idx` with `finalize`."""

    def __init__(self, bin_path: str, dtype: np.dtype | type = np.int32) -> None:
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self.bin_path = bin_path
        self._file = open(bin_path, "wb")
        self._lengths: list[int] = []
        self._documents: list[int] = [0]
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._bounds: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._bounds = None

    def add_item(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence."""
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if self._bounds is not None and arr.size:
            lo, hi = self._bounds
            if arr.min() < lo or arr.max() > hi:
                raise ValueError(f"{self.bin_path}: token ids outside the range of {self.dtype}")
        self._file.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes(order="C"))
        self._lengths.append(int(arr.size))

    def end_document(self) -> None:
        """Close the current document: the sequences added since the last call form one document."""
        self._documents.append(len(self._lengths))

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> None:
        """Append one sequence and close it as a document."""
        self.add_item(tokens)
        self.end_document()

    def add_index(self, prefix: str) -> None:
        """Append every sequence and document of the dataset at `prefix` (same dtype required)."""
        other = _Index(index_path(prefix))
        if other.dtype != self.dtype:
            raise UsageError(f"{index_path(prefix)}: dtype {other.dtype} differs from the builder's {self.dtype}")
        binf = data_path(prefix)
        if not os.path.isfile(binf):
            raise UsageError(f"{binf}: no such file (data prefix {prefix!r})")
        offset = len(self._lengths)
        self._lengths.extend(other.sequence_lengths.tolist())
        self._documents.extend((other.document_indices[1:] + offset).tolist())
        self._file.flush()
        with open(binf, "rb") as src:
            shutil.copyfileobj(src, self._file, length=16 << 20)

    def finalize(self, idx_path: str) -> None:
        """Close the `.bin` file and write the `.idx` file."""
        self._file.close()
        _write_index(idx_path, self.dtype, np.asarray(self._lengths, dtype=np.int64), np.asarray(self._documents))

    def abort(self) -> None:
        """Close and delete the unfinished `.bin` file, leaving nothing behind (also after a failed write)."""
        if not self._file.closed:
            try:
                self._file.close()
            except OSError:  # the buffered tail cannot be written (a full disk): the file goes anyway
                pass
        if os.path.exists(self.bin_path):
            os.remove(self.bin_path)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._file.closed:
            self._file.close()
