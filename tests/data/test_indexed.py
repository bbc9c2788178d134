"""Indexed dataset: writer/reader round trip (uint16 and int32) and every corrupt-file error."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from colonnade.data import IndexedDataset, IndexedDatasetError, IndexedDatasetWriter
from colonnade.data.indexed import HEADER

DOCS = [[5, 1, 7], [], [2, 2, 2, 2, 9], [0]]


def _write(prefix: Path, docs: list[list[int]], vocab_size: int) -> None:
    with IndexedDatasetWriter(prefix, vocab_size) as writer:
        for doc in docs:
            writer.add_document(doc)


@pytest.mark.parametrize(
    ("vocab_size", "dtype", "scale"), [(300, "uint16", 1), (70_000, "int32", 6000)]
)
def test_round_trip(tmp_path: Path, vocab_size: int, dtype: str, scale: int) -> None:
    docs = [[t * scale for t in d] for d in DOCS]  # int32 case holds ids >= 65536
    prefix = tmp_path / "data"
    _write(prefix, docs, vocab_size)
    ds = IndexedDataset(prefix)
    assert ds.dtype == np.dtype(dtype)
    assert (len(ds), ds.num_tokens) == (4, 9)
    assert prefix.with_suffix(".bin").stat().st_size == 9 * np.dtype(dtype).itemsize
    for i, doc in enumerate(docs):
        assert ds.get(i).tolist() == doc
        assert ds[i].tolist() == doc
    assert ds.get(2, offset=1, length=3).tolist() == [2 * scale] * 3
    assert ds.get(2, offset=3).tolist() == [2 * scale, 9 * scale]
    assert ds.tokens.tolist() == [t for d in docs for t in d]
    assert ds.doc_lengths.tolist() == [3, 0, 5, 1]
    assert ds.offsets.tolist() == [0, 3, 3, 8, 9]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)
    with pytest.raises(IndexError):
        ds.get(4)
    assert not list(tmp_path.glob("*.tmp"))


def test_writer_rejects_out_of_vocab_ids_and_aborts_cleanly(tmp_path: Path) -> None:
    with (
        pytest.raises(IndexedDatasetError, match=r"outside \[0, 300\)"),
        IndexedDatasetWriter(tmp_path / "d", 300) as writer,
    ):
        writer.add_document([1, 2])
        writer.add_document([299, 300])
    assert list(tmp_path.iterdir()) == []  # temp files removed, nothing under final names


def test_empty_dataset(tmp_path: Path) -> None:
    _write(tmp_path / "e", [], 300)
    ds = IndexedDataset(tmp_path / "e")
    assert (len(ds), ds.num_tokens, ds.tokens.size) == (0, 0, 0)


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    _write(tmp_path / "data", DOCS, 300)
    return tmp_path / "data"


def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def test_missing_files(prefix: Path) -> None:
    prefix.with_suffix(".bin").unlink()
    with pytest.raises(IndexedDatasetError, match=r"data\.bin: file is missing.*colonnade prepare"):
        IndexedDataset(prefix)
    prefix.with_suffix(".idx").unlink()
    with pytest.raises(IndexedDatasetError, match=r"data\.idx: file is missing"):
        IndexedDataset(prefix)


def test_wrong_magic(prefix: Path) -> None:
    _patch(prefix.with_suffix(".idx"), 0, b"MMIDIDX\x00")
    with pytest.raises(
        IndexedDatasetError, match=r"data\.idx: wrong magic b'MMIDIDX.*not a Colonnade"
    ):
        IndexedDataset(prefix)


def test_wrong_version(prefix: Path) -> None:
    _patch(prefix.with_suffix(".idx"), 8, struct.pack("<I", 7))
    with pytest.raises(IndexedDatasetError, match=r"format version 7 is not supported.*version 1"):
        IndexedDataset(prefix)


def test_unknown_dtype_code(prefix: Path) -> None:
    _patch(prefix.with_suffix(".idx"), 12, struct.pack("<I", 9))
    with pytest.raises(IndexedDatasetError, match="unknown dtype code 9"):
        IndexedDataset(prefix)


def test_truncated_bin(prefix: Path) -> None:
    bin_path = prefix.with_suffix(".bin")
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(IndexedDatasetError) as info:
        IndexedDataset(prefix)
    msg = str(info.value)
    assert "data.bin: size 16 bytes disagrees" in msg and "9 tokens x 2 bytes = 18" in msg
    assert "colonnade prepare" in msg


def test_truncated_idx(prefix: Path) -> None:
    idx_path = prefix.with_suffix(".idx")
    raw = idx_path.read_bytes()
    idx_path.write_bytes(raw[:-8])  # lose the last offset
    with pytest.raises(IndexedDatasetError, match=r"size 64 bytes, expected 72 for 4 documents"):
        IndexedDataset(prefix)
    idx_path.write_bytes(raw[: HEADER.size - 4])  # lose part of the header
    with pytest.raises(IndexedDatasetError, match=r"truncated \.idx \(28 bytes, header needs 32\)"):
        IndexedDataset(prefix)
    idx_path.write_bytes(b"")
    with pytest.raises(IndexedDatasetError, match=r"truncated \.idx \(0 bytes"):
        IndexedDataset(prefix)


def test_inconsistent_offsets(prefix: Path) -> None:
    _patch(prefix.with_suffix(".idx"), HEADER.size + 8, struct.pack("<q", 5))  # o[1] > o[2]
    with pytest.raises(IndexedDatasetError, match="document offsets are inconsistent"):
        IndexedDataset(prefix)
