"""Reading raw text corpora as a deterministic stream of documents.

Two sources are supported:

* the built-in default corpus: the running Python's standard-library source (`*.py` files under
  `sysconfig.get_paths()["stdlib"]`, test directories and site-packages excluded), sorted by
  relative path and capped at `max_bytes`, so every machine with the same Python gets the same data;
* a user input: files, directories, globs or comma lists of text, jsonl, json, csv, parquet, arrow
  and Hugging Face datasets directories (see `readers` for the formats).

Text must be UTF-8. Unreadable documents (bad bytes, invalid JSON, a missing key or column) are
collected in a `DocumentStats`: under errors="strict" one error lists them all at the end of the
stream, under errors="skip" they are left out and counted.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from colonnade.config.choices import ERROR_POLICIES
from colonnade.data.errors import CorpusError
from colonnade.data.readers import Source, first_record_problems, read_source, resolve_input

DEFAULT_MAX_BYTES = 8_000_000
"""Default cap on the built-in stdlib corpus, in bytes of source text (about 2M BPE tokens)."""

SKIPPED_DIRS: frozenset[str] = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "encodings",
     "pydoc_data"}
)
"""Directory names never entered when collecting the stdlib corpus (encodings and pydoc_data
hold generated tables and text, not Python people write)."""

MAX_FILE_BYTES = 300_000
"""Larger stdlib files (generated tables) are left out of the built-in corpus."""

ErrorPolicy = str
"""One of config.choices.ERROR_POLICIES."""

MAX_RECORDED = 10_000
"""Unreadable documents recorded by name in `DocumentStats.skipped` (all are counted)."""


@dataclass
class DocumentStats:
    """Counters filled while documents are read (pass one to `iter_documents` to observe them).

    `skipped` lists `"<where>: <reason>"` for each unreadable document or file (the first
    `MAX_RECORDED`; `problems` counts them all, `bad_files` per file); `groups` counts them by
    (file, reason) with the first record's location (the first `MAX_RECORDED` pairs), so 10^6
    records missing one key read as one line; `empty` counts documents with no text, which
    are never yielded; `ignored` lists files a directory input holds in an unsupported format.
    """

    documents: int = 0
    bytes: int = 0
    empty: int = 0
    problems: int = 0
    skipped: list[str] = field(default_factory=list)
    bad_files: dict[str, int] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)
    groups: dict[tuple[str, str], tuple[str, int]] = field(default_factory=dict)

    def report(self, path: Path, at: str, reason: str) -> None:
        """Record one unreadable document or file (`at` locates the record, see readers)."""
        self.problems += 1
        if len(self.skipped) < MAX_RECORDED:
            self.skipped.append(f"{path}{at}: {reason}")
        self.bad_files[str(path)] = self.bad_files.get(str(path), 0) + 1
        key = (str(path), reason)
        first, count = self.groups.get(key, (at, 0))
        if count or len(self.groups) < MAX_RECORDED:
            self.groups[key] = (first, count + 1)


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
    """One document per text file of `files`, in the given order (UTF-8; see `iter_documents`
    for `errors`)."""
    sources = [Source(Path(f), "text") for f in files]
    yield from _read_all(sources, "text", errors, stats)


def iter_documents(
    input: str | Path,
    *,
    text_key: str = "text",
    errors: ErrorPolicy = "strict",
    stats: DocumentStats | None = None,
) -> Iterator[str]:
    """The documents of `input` (any spec `readers.resolve_input` accepts), in order: an
    iterator that reads as it is consumed, returned once the input's checks below passed.

    Empty documents are counted in `stats.empty` and not yielded. A bad file or record never
    stops the reading: under errors='skip' it is left out and recorded in `stats.skipped`; under
    'strict' every problem is collected and one `CorpusError` listing them all is raised once
    the input is exhausted. The input is resolved by this call, so a missing path or an
    unsupported format fails here, before any reading; under 'strict' the first record of each
    file is read here too (`readers.first_record_problems`), so a wrong `text_key` fails at once.
    """
    if errors not in ERROR_POLICIES:
        raise CorpusError(f"data.errors={errors!r} must be one of {', '.join(ERROR_POLICIES)}")
    stats = DocumentStats() if stats is None else stats
    sources = resolve_input(input, stats.ignored)
    if errors == "strict" and (first := first_record_problems(sources, text_key)):
        raise CorpusError(
            f"the first record of {len(first)} file(s) cannot be read (checked before reading "
            "the corpus):\n" + "\n".join(f"  - {line}" for line in first)
            + "\nfix each as its line says (rename the file, set data.text_key or a ':KEY' "
            "suffix), or leave unreadable records out with data.errors='skip' "
            "(--data.errors=skip)")
    return _read_all(sources, text_key, errors, stats)


def _read_all(
    sources: Sequence[Source], text_key: str, errors: ErrorPolicy, stats: DocumentStats | None
) -> Iterator[str]:
    stats = DocumentStats() if stats is None else stats
    for source in sources:
        for text in read_source(source, text_key, stats.report):
            if not text:
                stats.empty += 1
                continue
            stats.documents += 1
            stats.bytes += len(text.encode("utf-8"))
            yield text
    if errors == "strict" and stats.problems:
        raise CorpusError(problems_message(stats))


def no_documents_message(sources: Sequence[Source], stats: DocumentStats, shown: int = 5) -> str:
    """Why an input gave no document to train on, naming its files (the first `shown`);
    `prepare` refuses such an input with it, before writing anything."""
    names = ", ".join(str(s.path) for s in sources[:shown]) + (
        f" and {len(sources) - shown} more" if len(sources) > shown else "")
    if stats.problems:
        why = (f"all {stats.problems} of its documents were unreadable and left out "
               f"(data.errors='skip'); first: {stats.skipped[0]}")
    elif all(s.path.stat().st_size == 0 for s in sources):
        why = "the file is empty" if len(sources) == 1 else "the files are empty"
    elif stats.empty:
        why = (f"it holds only blank lines or empty texts ({stats.empty} empty document(s) "
               "left out)")
    else:
        why = "it holds only blank lines"
    return (f"no documents in {names}: {why}. Nothing was prepared; point data.input at "
            "files that hold text")


def problems_message(stats: DocumentStats, shown: int = 20, what: str = "document(s)",
                     fix: str = "convert to UTF-8, set data.text_key") -> str:
    """One message listing the unreadable `what` (documents; SFT: examples): one line per
    (file, reason), the first `shown` of them (``c.jsonl:1 and 2999 more records: <reason>``),
    then counts per file, then the usual fixes `fix`."""
    lines = [f"  - {path}{at}{f' and {n - 1} more records' if n > 1 else ''}: {reason}"
             for (path, reason), (at, n) in list(stats.groups.items())[:shown]]
    listed_count = sum(n for _, n in list(stats.groups.values())[:shown])
    listed, more = "\n".join(lines), ""
    if stats.problems > listed_count:
        per_file = ", ".join(f"{name} ({n})" for name, n in stats.bad_files.items())
        more = f"\n  ... and {stats.problems - listed_count} more; per file: {per_file}"
    return (f"{stats.problems} {what} in {len(stats.bad_files)} file(s) cannot be read:\n"
            f"{listed}{more}\nfix them (e.g. {fix}), or leave them out with "
            "data.errors='skip' (--data.errors=skip)")


def corpus_fingerprint(input: str | Path | None, max_bytes: int = DEFAULT_MAX_BYTES) -> str:
    """A cheap identity of the input (paths, sizes, mtimes of every file read), used to reuse
    prepared data. `None` fingerprints the built-in stdlib corpus at `max_bytes`."""
    if input is None:
        return fingerprint_files(stdlib_root(), stdlib_files(max_bytes))
    return fingerprint_files(None, [s.path for s in resolve_input(input)])


def fingerprint_files(root: Path | None, files: Sequence[Path]) -> str:
    """sha256 over `root` and each file's path (relative to `root`, else absolute), size and
    mtime (no content is read)."""
    digest = hashlib.sha256(str(root.resolve() if root else "").encode())
    for file in files:
        st = file.stat()
        rel = file.relative_to(root).as_posix() if root else str(file.resolve())
        digest.update(f"{rel}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()
