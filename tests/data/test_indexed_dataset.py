"""The `.bin/.idx` format: exact bytes, reading back, merging, and every broken-file error."""

from __future__ import annotations

import pickle
import struct

import numpy as np
import pytest

from megatron_bmw.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, optimal_dtype
from megatron_bmw.errors import UsageError

from .conftest import write_dataset

# Two documents: the first of sequences [5, 6, 7] and [8], the second of [9, 10].
SEQUENCES = [[5, 6, 7], [8], [9, 10]]


def expected_bytes(dtype_code: int, itemsize: int, np_dtype) -> tuple[bytes, bytes]:
    """The `.idx` and `.bin` bytes written by hand from the format description."""
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", dtype_code)
    idx += struct.pack("<Q", 3) + struct.pack("<Q", 3)
    idx += struct.pack("<3i", 3, 1, 2)
    idx += struct.pack("<3q", 0, 3 * itemsize, 4 * itemsize)
    idx += struct.pack("<3q", 0, 2, 3)
    data = np.array([5, 6, 7, 8, 9, 10], dtype=np.dtype(np_dtype).newbyteorder("<")).tobytes()
    return idx, data


def build_example(prefix: str, dtype) -> None:
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    builder.add_item(SEQUENCES[0])
    builder.add_item(np.array(SEQUENCES[1]))
    builder.end_document()
    builder.add_item(SEQUENCES[2])
    builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5), (np.uint8, 1)])
def test_bytes_match_the_spec(tmp_path, dtype, code):
    prefix = str(tmp_path / "ex")
    build_example(prefix, dtype)
    idx, data = expected_bytes(code, np.dtype(dtype).itemsize, dtype)
    assert (tmp_path / "ex.idx").read_bytes() == idx
    assert (tmp_path / "ex.bin").read_bytes() == data

    ds = IndexedDataset(prefix)
    assert len(ds) == 3
    assert ds.dtype == np.dtype(dtype)
    assert ds.sequence_lengths.tolist() == [3, 1, 2]
    assert ds.document_indices.tolist() == [0, 2, 3]
    assert [ds[i].tolist() for i in range(3)] == SEQUENCES
    assert ds[-1].tolist() == [9, 10]
    assert ds.get(0, offset=1).tolist() == [6, 7]
    assert ds.get(0, offset=1, length=1).tolist() == [6]
    assert ds.get(2, length=0).tolist() == []
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    with pytest.raises(IndexError):
        ds[3]


def test_reader_uses_memmap_and_pickles_lightly(tmp_path):
    prefix = write_dataset(tmp_path / "m", [list(range(1000))] * 20)
    ds = IndexedDataset(prefix)
    assert isinstance(ds._bin, np.memmap)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000
    again = pickle.loads(blob)
    assert again[3].tolist() == list(range(1000))


def test_empty_dataset(tmp_path):
    prefix = write_dataset(tmp_path / "empty", [])
    ds = IndexedDataset(prefix)
    assert len(ds) == 0 and ds.document_indices.tolist() == [0]
    ds.check_vocab(1)


def test_merge_two_datasets(tmp_path):
    a = write_dataset(tmp_path / "a", [[1, 2], [3]])
    b = str(tmp_path / "b")
    build_example(b, np.uint16)
    merged = str(tmp_path / "ab")
    builder = IndexedDatasetBuilder(merged + ".bin", np.uint16)
    builder.add_index(a)
    builder.add_index(b)
    builder.finalize(merged + ".idx")

    ds = IndexedDataset(merged)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], *SEQUENCES]
    assert ds.document_indices.tolist() == [0, 1, 2, 4, 5]
    assert ds.sequence_pointers.tolist() == [0, 4, 6, 12, 14]


def test_merge_rejects_other_dtype(tmp_path):
    a = write_dataset(tmp_path / "a", [[1, 2]], dtype=np.int32)
    builder = IndexedDatasetBuilder(str(tmp_path / "c.bin"), np.uint16)
    with pytest.raises(UsageError, match="a.idx"):
        builder.add_index(a)


def test_optimal_dtype():
    assert optimal_dtype(50257) is np.uint16
    assert optimal_dtype(65500) is np.int32


def one_line_error(fn, match: str) -> str:
    with pytest.raises(UsageError, match=match) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture
def example(tmp_path) -> str:
    prefix = str(tmp_path / "ex")
    build_example(prefix, np.uint16)
    return prefix


def test_missing_files(example, tmp_path):
    one_line_error(lambda: IndexedDataset(str(tmp_path / "nope")), r"nope\.idx: no such file")
    (tmp_path / "ex.bin").unlink()
    one_line_error(lambda: IndexedDataset(example), r"ex\.bin: no such file")


def test_bad_magic(example, tmp_path):
    path = tmp_path / "ex.idx"
    path.write_bytes(b"NOTMMIDX\x00" + path.read_bytes()[9:])
    one_line_error(lambda: IndexedDataset(example), r"ex\.idx: .*bad magic")


def test_bad_version(example, tmp_path):
    path = tmp_path / "ex.idx"
    raw = path.read_bytes()
    path.write_bytes(raw[:9] + struct.pack("<Q", 2) + raw[17:])
    one_line_error(lambda: IndexedDataset(example), r"ex\.idx: unsupported index version 2")


@pytest.mark.parametrize("keep", [20, 40, 80])
def test_truncated_index(example, tmp_path, keep):
    path = tmp_path / "ex.idx"
    path.write_bytes(path.read_bytes()[:keep])
    one_line_error(lambda: IndexedDataset(example), r"ex\.idx: truncated index")


def test_short_bin(example, tmp_path):
    path = tmp_path / "ex.bin"
    path.write_bytes(path.read_bytes()[:-2])
    one_line_error(lambda: IndexedDataset(example), r"ex\.bin: data file is 10 bytes but the index needs 12")


# header 34 bytes, then lengths (<i4 x 3) at 34, pointers (<i8 x 3) at 46, the document index (<i8 x 3) at 70
@pytest.mark.parametrize("offset,fmt,value,match", [
    (34 + 4, "<i", -5, r"sequence 1 has length -5"),
    (46, "<q", 2, r"sequence 0 starts at byte 2, not 0"),
    (46 + 16, "<q", 1000, r"sequence 2 starts at byte 1000, not where sequence 1 ends \(8\)"),
    (70 + 8, "<q", 4, r"document 2 starts at sequence 3, before document 1 \(4\)"),
    (70 + 16, "<q", 7, r"the document index runs from 0 to 7, not from 0 to at most the 3 sequences"),
])
def test_a_damaged_index_is_named_when_opened(example, tmp_path, offset, fmt, value, match):
    """Probe, session 12: such indexes passed the header checks and failed mid-training with tracebacks."""
    path = tmp_path / "ex.idx"
    raw = bytearray(path.read_bytes())
    raw[offset:offset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    path.write_bytes(bytes(raw))
    one_line_error(lambda: IndexedDataset(example), rf"ex\.idx: {match}")


def test_check_vocab(example):
    ds = IndexedDataset(example)
    ds.check_vocab(11)
    one_line_error(lambda: ds.check_vocab(10), r"ex\.bin: token id 10 >= vocab size 10")


def test_builder_rejects_ids_outside_dtype(tmp_path):
    builder = IndexedDatasetBuilder(str(tmp_path / "x.bin"), np.uint16)
    with pytest.raises(ValueError):
        builder.add_item([70000])
