"""Reading raw text corpora as a deterministic stream of documents.

Two sources are supported:

* the built-in default corpus: the running Python's standard-library source (`*.py` files under
  `sysconfig.get_paths()["stdlib"]`, test directories and site-packages excluded), sorted by
  relative path and capped at `max_bytes`, so every machine with the same Python gets the same data;
* a user path: a directory of text files (one document per file, sorted by relative path), a single
  text file (one document), or a `.jsonl` file (one document per line, under a configurable key).

Text must be UTF-8. A file that is not is an error naming the file and the byte offset of the first
bad byte, unless the caller passes `errors="skip"`, in which case the document is skipped, logged
and counted in a `DocumentStats`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from colonnade.data.errors import CorpusError

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 8_000_000
"""Default cap on the built-in stdlib corpus, in bytes of source text (about 2M BPE tokens)."""

TEXT_SUFFIXES: tuple[str, ...] = (".txt", ".py", ".md", ".rst", ".text", ".c", ".h", ".json")
"""File suffixes read as documents when the input is a directory."""

SKIPPED_DIRS: frozenset[str] = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings",
     "pydoc_data"}
)
"""Directory names never entered when collecting the stdlib corpus (encodings and pydoc_data
hold generated tables and text, not Python people write)."""

MAX_FILE_BYTES = 300_000
"""Larger stdlib files (generated tables) are left out of the built-in corpus."""

ErrorPolicy = Literal["strict", "skip"]


@dataclass
class DocumentStats:
    """Counters filled while documents are read (pass one to `iter_documents` to observe them).

    `skipped` lists `"<file>: <reason>"` for every document dropped under `errors="skip"`;
    `empty` counts documents with no text, which are never yielded.
    """

    documents: int = 0
    bytes: int = 0
    empty: int = 0
    skipped: list[str] = field(default_factory=list)


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(max_bytes: int = DEFAULT_MAX_BYTES) -> list[Path]:
    """Files of the built-in corpus: stdlib `*.py`, total size <= max_bytes, sorted by path.

    Candidates are visited in the order of a stable hash (crc32) of their relative path, so a cap
    samples the whole library rather than its alphabetical beginning; files are taken until the
    next one would exceed the cap, and the choice is returned sorted by relative path (so a
    larger cap gives a superset, and the list is deterministic for a given installation).
    """
    if max_bytes <= 0:
        raise CorpusError(f"max_bytes={max_bytes} must be positive; pass e.g. {DEFAULT_MAX_BYTES}")
    root = stdlib_root()
    candidates: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIRS]  # prune, never descend
        base = Path(dirpath)
        rel_dir = base.relative_to(root).as_posix()
        for name in filenames:
            if name.endswith(".py") and (base / name).stat().st_size <= MAX_FILE_BYTES:
                rel = name if rel_dir == "." else f"{rel_dir}/{name}"
                candidates.append((rel, base / name))
    candidates.sort(key=lambda item: (zlib.crc32(item[0].encode()), item[0]))
    chosen: list[tuple[str, Path]] = []
    total = 0
    for rel, path in candidates:
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append((rel, path))
        total += size
    if not chosen:
        raise CorpusError(
            f"no stdlib source fits in max_bytes={max_bytes} (root {root}); raise max_bytes"
        )
    return [path for _, path in sorted(chosen)]


def iter_stdlib_documents(
    max_bytes: int = DEFAULT_MAX_BYTES, *, stats: DocumentStats | None = None
) -> Iterator[str]:
    """Documents of the built-in corpus, one per stdlib source file (see `stdlib_files`)."""
    yield from iter_file_documents(stdlib_files(max_bytes), stats=stats)


def iter_file_documents(
    files: Sequence[Path], *, errors: ErrorPolicy = "strict", stats: DocumentStats | None = None
) -> Iterator[str]:
    """One document per file of `files`, in the given order (strict UTF-8 unless errors='skip')."""
    for path in files:
        yield from _file_document(Path(path), errors, stats)


def list_text_files(directory: Path, suffixes: Sequence[str] = TEXT_SUFFIXES) -> list[Path]:
    """Files below `directory` whose suffix is in `suffixes`, sorted by relative path."""
    files = [p for p in directory.rglob("*") if p.is_file() and p.suffix.lower() in suffixes]
    files.sort(key=lambda p: p.relative_to(directory).as_posix())
    if not files:
        raise CorpusError(
            f"{directory}: no files with suffixes {', '.join(suffixes)}; "
            "point the input at a directory of text files or a .jsonl file"
        )
    return files


def iter_documents(
    path: Path,
    *,
    text_key: str = "text",
    errors: ErrorPolicy = "strict",
    stats: DocumentStats | None = None,
) -> Iterator[str]:
    """Yield the documents of `path` in a deterministic order.

    `path` may be a directory (every text file below it is one document), a `.jsonl` file (the
    string under `text_key` on each non-blank line is one document) or any other file (one
    document). Empty documents are counted in `stats.empty` and not yielded.
    """
    path = Path(path)
    if errors not in ("strict", "skip"):
        raise CorpusError(f"errors={errors!r} must be 'strict' or 'skip'")
    if not path.exists():
        raise CorpusError(f"{path}: no such file or directory; check the input path")
    if path.is_dir():
        yield from iter_file_documents(list_text_files(path), errors=errors, stats=stats)
    elif path.suffix.lower() == ".jsonl":
        yield from _jsonl_documents(path, text_key, errors, stats)
    else:
        yield from _file_document(path, errors, stats)


def _count(stats: DocumentStats | None, text: str, nbytes: int) -> bool:
    """Record one document; return False (and count it) when it is empty."""
    if stats is None:
        return bool(text)
    if not text:
        stats.empty += 1
        return False
    stats.documents += 1
    stats.bytes += nbytes
    return True


def _skip_or_raise(
    errors: ErrorPolicy, stats: DocumentStats | None, where: str, reason: str, fix: str
) -> None:
    """Raise a `CorpusError` under errors='strict'; otherwise log and count the skipped document."""
    if errors == "strict":
        raise CorpusError(f"{where}: {reason}; {fix}")
    log.warning("skipping document %s: %s", where, reason)
    if stats is not None:
        stats.skipped.append(f"{where}: {reason}")


_UTF8_FIX = "convert the file to UTF-8 or pass errors='skip' to skip such documents"


def _file_document(path: Path, errors: ErrorPolicy, stats: DocumentStats | None) -> Iterator[str]:
    """The whole file as one document (strict UTF-8)."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        _skip_or_raise(
            errors, stats, str(path), f"not valid UTF-8 at byte offset {exc.start}", _UTF8_FIX
        )
        return
    if _count(stats, text, len(raw)):
        yield text


def _jsonl_documents(
    path: Path, text_key: str, errors: ErrorPolicy, stats: DocumentStats | None
) -> Iterator[str]:
    """One document per JSON line; byte offsets in errors count from the start of the file."""
    offset = 0
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                reason = f"not valid UTF-8 at byte offset {start + exc.start}"
                _skip_or_raise(errors, stats, where, reason, _UTF8_FIX)
                continue
            text = _jsonl_text(line, text_key, where, errors, stats)
            if text is not None and _count(stats, text, len(raw)):
                yield text


def _jsonl_text(
    line: str, text_key: str, where: str, errors: ErrorPolicy, stats: DocumentStats | None
) -> str | None:
    """The `text_key` string of one JSON line, or None when skipped."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        _skip_or_raise(errors, stats, where, f"invalid JSON ({exc.msg})", "fix the line")
        return None
    value = record.get(text_key) if isinstance(record, dict) else None
    if not isinstance(value, str):
        reason = f"no string under key {text_key!r}"
        _skip_or_raise(errors, stats, where, reason, "pass the right text_key or fix the line")
        return None
    return value


def corpus_fingerprint(path: Path | None, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """A cheap identity of the input (relative paths, sizes, mtimes), used to reuse prepared data.

    `None` fingerprints the built-in stdlib corpus at `max_bytes`.
    """
    if path is None:
        return fingerprint_files(stdlib_root(), stdlib_files(max_bytes))
    path = Path(path)
    if not path.exists():
        raise CorpusError(f"{path}: no such file or directory; check the input path")
    if path.is_dir():
        return fingerprint_files(path, list_text_files(path))
    return fingerprint_files(path.parent, [path])


def fingerprint_files(root: Path, files: Sequence[Path]) -> str:
    """sha256 over `root` and each file's relative path, size and mtime (no content is read)."""
    digest = hashlib.sha256(str(root.resolve()).encode())
    for file in files:
        st = file.stat()
        rel = file.relative_to(root).as_posix()
        digest.update(f"{rel}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()
