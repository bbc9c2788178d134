"""Indexed token dataset on disk: `<prefix>.bin` (token ids) + `<prefix>.idx` (document index).

`.bin` is the concatenation of every document's token ids, little-endian `uint16` when the
vocabulary has fewer than 65536 entries, else `int32`. `.idx` is (all little-endian):

    offset  size            field
    0       8               magic b"COLIDX\\x00\\x00"
    8       4   uint32      format version (FORMAT_VERSION)
    12      4   uint32      dtype code (1 = uint16, 2 = int32)
    16      8   uint64      number of documents n
    24      8   uint64      number of tokens N
    32      8*(n+1) int64   document offsets o, o[0] = 0, o[n] = N; doc d is tokens[o[d]:o[d+1]]

Both files are read through `numpy.memmap`, so opening a dataset costs O(1) memory whatever its
size. Files are written to temporary names and renamed on `finalize`, so a crash never leaves a
half-written dataset under the final names.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from colonnade.data.errors import IndexedDatasetError

MAGIC = b"COLIDX\x00\x00"
FORMAT_VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, dtype code, num docs, num tokens
DTYPES: dict[int, np.dtype] = {1: np.dtype("<u2"), 2: np.dtype("<i4")}
_FIX = "re-run `colonnade prepare` to rebuild it"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest supported token dtype for `vocab_size`: uint16 below 65536, else int32."""
    if vocab_size <= 0:
        raise IndexedDatasetError(f"vocab_size={vocab_size} must be positive")
    if vocab_size > np.iinfo(np.int32).max:
        raise IndexedDatasetError(f"vocab_size={vocab_size} does not fit int32 token ids")
    return DTYPES[1] if vocab_size < 65536 else DTYPES[2]


def _dtype_code(dtype: np.dtype) -> int:
    return next(code for code, dt in DTYPES.items() if dt == dtype)


class IndexedDatasetWriter:
    """Streams documents into `<prefix>.bin` and writes `<prefix>.idx` on `finalize()`.

    Usable as a context manager: leaving the block normally finalizes, leaving it by an
    exception removes the temporary files.
    """

    def __init__(self, prefix: Path | str, vocab_size: int) -> None:
        self.prefix = Path(prefix)
        self.vocab_size = vocab_size
        self.dtype = dtype_for_vocab(vocab_size)
        self.bin_path, self.idx_path = (
            self.prefix.with_suffix(".bin"),
            self.prefix.with_suffix(".idx"),
        )
        self._tmp_bin = self.bin_path.with_name(self.bin_path.name + ".tmp")
        self._tmp_idx = self.idx_path.with_name(self.idx_path.name + ".tmp")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin: BinaryIO | None = self._tmp_bin.open("wb")
        self._offsets: list[int] = [0]

    @property
    def num_docs(self) -> int:
        return len(self._offsets) - 1

    @property
    def num_tokens(self) -> int:
        return self._offsets[-1]

    def add_document(self, ids: Sequence[int] | np.ndarray) -> None:
        """Append one document's token ids (each in [0, vocab_size))."""
        if self._bin is None:
            raise IndexedDatasetError(f"{self.prefix}: writer already finalized; make a new one")
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise IndexedDatasetError(f"document must be a 1-D id sequence, got shape {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise IndexedDatasetError(
                f"document {self.num_docs} has token ids in [{arr.min()}, {arr.max()}] outside "
                f"[0, {self.vocab_size}); pass the tokenizer's vocab_size to the writer"
            )
        self._bin.write(arr.astype(self.dtype, copy=False).tobytes())
        self._offsets.append(self._offsets[-1] + int(arr.size))

    def add_documents(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append several documents at once: `ids` concatenated, `lengths` tokens per document."""
        if self._bin is None:
            raise IndexedDatasetError(f"{self.prefix}: writer already finalized; make a new one")
        ids, lengths = np.asarray(ids), np.asarray(lengths, dtype=np.int64)
        if ids.ndim != 1 or lengths.ndim != 1 or int(lengths.sum()) != ids.size:
            raise IndexedDatasetError(f"add_documents got {ids.size} ids but lengths summing "
                                      f"to {int(lengths.sum())}; pass 1-D arrays that agree")
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise IndexedDatasetError(
                f"documents {self.num_docs}.. have token ids in [{ids.min()}, {ids.max()}] "
                f"outside [0, {self.vocab_size}); pass the tokenizer's vocab_size to the writer"
            )
        self._bin.write(ids.astype(self.dtype, copy=False).tobytes())
        ends = self._offsets[-1] + np.cumsum(lengths)
        self._offsets.extend(ends.tolist())

    def finalize(self) -> None:
        """Flush `.bin`, write `.idx`, then rename both temp files to their final names."""
        if self._bin is None:
            raise IndexedDatasetError(f"{self.prefix}: writer already finalized")
        self._bin.close()
        self._bin = None
        header = HEADER.pack(
            MAGIC, FORMAT_VERSION, _dtype_code(self.dtype), self.num_docs, self.num_tokens
        )
        with self._tmp_idx.open("wb") as fh:
            fh.write(header)
            fh.write(np.asarray(self._offsets, dtype="<i8").tobytes())
        os.replace(self._tmp_bin, self.bin_path)
        os.replace(self._tmp_idx, self.idx_path)

    def abort(self) -> None:
        """Close and delete the temporary files (the final names are left untouched)."""
        if self._bin is not None:
            self._bin.close()
            self._bin = None
        for tmp in (self._tmp_bin, self._tmp_idx):
            tmp.unlink(missing_ok=True)

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.abort()


class IndexedDataset:
    """Read-only, memory-mapped view of `<prefix>.bin` / `<prefix>.idx`, validated on open."""

    def __init__(self, prefix: Path | str) -> None:
        self.prefix = Path(prefix)
        self.bin_path, self.idx_path = (
            self.prefix.with_suffix(".bin"),
            self.prefix.with_suffix(".idx"),
        )
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise IndexedDatasetError(f"{path}: file is missing; {_FIX}")
        self.dtype, num_docs, self._num_tokens = _read_header(self.idx_path)
        self.offsets = _read_offsets(self.idx_path, num_docs, self._num_tokens)  # [n + 1] int64
        expected = self._num_tokens * self.dtype.itemsize
        actual = self.bin_path.stat().st_size
        if actual != expected:
            raise IndexedDatasetError(
                f"{self.bin_path}: size {actual} bytes disagrees with {self.idx_path.name} "
                f"({self._num_tokens} tokens x {self.dtype.itemsize} bytes = {expected}); "
                f"the .bin is truncated or from another run; {_FIX}"
            )
        if self._num_tokens == 0:
            self.tokens: np.ndarray = np.empty(0, dtype=self.dtype)
        else:
            self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r")  # [N] flat view

    def __len__(self) -> int:
        """Number of documents."""
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        """Total number of tokens over all documents."""
        return self._num_tokens

    @property
    def doc_lengths(self) -> np.ndarray:
        """Tokens per document, int64 [num_docs]."""
        return np.diff(self.offsets)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `[offset, offset + length)` of document `doc` (to its end if `length` is None).

        Returns a read-only view in the on-disk dtype; copy or cast it before modifying.
        """
        n = len(self)
        if not -n <= doc < n:
            raise IndexError(f"document {doc} out of range for {n} documents in {self.prefix}")
        doc %= n
        start, end = int(self.offsets[doc]), int(self.offsets[doc + 1])
        doc_len = end - start
        if length is None:
            length = doc_len - offset
        if offset < 0 or length < 0 or offset + length > doc_len:
            raise IndexError(
                f"slice offset={offset} length={length} outside document {doc} of length {doc_len}"
            )
        return self.tokens[start + offset : start + offset + length]

    def __getitem__(self, doc: int) -> np.ndarray:
        """All tokens of document `doc`."""
        return self.get(doc)


def _read_header(idx_path: Path) -> tuple[np.dtype, int, int]:
    """Validate the fixed header of `.idx`; return (dtype, num_docs, num_tokens)."""
    with idx_path.open("rb") as fh:
        raw = fh.read(HEADER.size)
    if not MAGIC.startswith(raw[: len(MAGIC)]):  # a short prefix of MAGIC is "truncated"
        raise IndexedDatasetError(
            f"{idx_path}: wrong magic {raw[: len(MAGIC)]!r} (expected {MAGIC!r}); "
            f"this is not a Colonnade index file; {_FIX}"
        )
    if len(raw) < HEADER.size:
        raise IndexedDatasetError(
            f"{idx_path}: truncated .idx ({len(raw)} bytes, header needs {HEADER.size}); {_FIX}"
        )
    _, version, code, num_docs, num_tokens = HEADER.unpack(raw)
    if version != FORMAT_VERSION:
        raise IndexedDatasetError(
            f"{idx_path}: format version {version} is not supported by this reader "
            f"(version {FORMAT_VERSION}); {_FIX} with this Colonnade"
        )
    if code not in DTYPES:
        raise IndexedDatasetError(f"{idx_path}: unknown dtype code {code}; {_FIX}")
    return DTYPES[code], num_docs, num_tokens


def _read_offsets(idx_path: Path, num_docs: int, num_tokens: int) -> np.ndarray:
    """Memory-map and validate the document offsets of `.idx`, int64 [num_docs + 1]."""
    expected = HEADER.size + 8 * (num_docs + 1)
    actual = idx_path.stat().st_size
    if actual != expected:
        raise IndexedDatasetError(
            f"{idx_path}: size {actual} bytes, expected {expected} for {num_docs} documents; "
            f"the .idx is truncated or corrupt; {_FIX}"
        )
    offsets = np.memmap(idx_path, dtype="<i8", mode="r", offset=HEADER.size, shape=(num_docs + 1,))
    if offsets[0] != 0 or offsets[-1] != num_tokens or (num_docs and np.any(np.diff(offsets) < 0)):
        raise IndexedDatasetError(
            f"{idx_path}: document offsets are inconsistent (first {offsets[0]}, last "
            f"{offsets[-1]}, tokens {num_tokens}); the .idx is corrupt; {_FIX}"
        )
    return offsets
