"""`colonnade prepare`: corpus -> tokenizer.json + data.bin + data.idx in one output directory.

Steps: (1) take the given tokenizer, or train a byte-level BPE one on the same input; (2) encode
every document, append the EOD token, and stream the ids into an indexed dataset; (3) write
`prepare.json`, a manifest of what was built from what. A second call with the same inputs finds a
matching manifest and intact files and reuses them instead of tokenizing again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tqdm import tqdm

from colonnade.data.corpus import (
    DEFAULT_MAX_BYTES,
    DocumentStats,
    ErrorPolicy,
    corpus_fingerprint,
    iter_documents,
    iter_stdlib_documents,
    list_text_files,
    stdlib_files,
)
from colonnade.data.errors import DataError
from colonnade.data.indexed import IndexedDataset, IndexedDatasetWriter
from colonnade.data.tokenizer import eod_id, load_tokenizer, save_tokenizer, train_bpe_from_texts

MANIFEST_VERSION = 1
ENCODE_BATCH = 256  # documents per `encode_batch` call


@dataclass(frozen=True)
class PreparedData:
    """What `prepare` produced (paths and sizes); `reused` tells whether it was built this call."""

    out_dir: Path
    tokenizer_path: Path
    prefix: Path
    vocab_size: int
    eod_id: int
    num_docs: int
    num_tokens: int
    reused: bool

    def dataset(self) -> IndexedDataset:
        """Open the prepared indexed dataset."""
        return IndexedDataset(self.prefix)

    def tokenizer(self) -> Tokenizer:
        """Load the prepared tokenizer."""
        return load_tokenizer(self.tokenizer_path)


def prepare(
    input: Path | None,
    out_dir: Path,
    vocab_size: int | None,
    tokenizer_path: Path | None = None,
    *,
    text_key: str = "text",
    errors: ErrorPolicy = "strict",
    max_bytes: int = DEFAULT_MAX_BYTES,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> PreparedData:
    """Tokenize `input` (None = the built-in stdlib corpus capped at `max_bytes`) into `out_dir`.

    Without `tokenizer_path`, a byte-level BPE tokenizer of `vocab_size` is trained on the same
    input. With one, `vocab_size` may be None, or must equal the tokenizer's size.
    """
    out_dir = Path(out_dir)
    key = _manifest_key(input, vocab_size, tokenizer_path, text_key, errors, max_bytes)
    reused, damage = _try_reuse(out_dir, key)
    if reused is not None:
        log(
            f"prepare: reusing {out_dir} ({reused.num_docs} documents, {reused.num_tokens} tokens; "
            "inputs unchanged)"
        )
        return reused
    if damage:
        log(f"prepare: {out_dir} was built from these inputs but {damage}; tokenizing again")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "prepare.json").unlink(missing_ok=True)
    tok_out = out_dir / "tokenizer.json"

    def documents(stats: DocumentStats | None = None) -> Iterator[str]:
        if input is None:
            return iter_stdlib_documents(max_bytes, stats=stats)
        return iter_documents(Path(input), text_key=text_key, errors=errors, stats=stats)

    tok = _obtain_tokenizer(tokenizer_path, vocab_size, tok_out, documents, log)
    stats = DocumentStats()
    total_docs = _count_files(input, max_bytes)
    writer = IndexedDatasetWriter(out_dir / "data", tok.get_vocab_size())
    with writer:
        _encode_into(tok, documents(stats), writer, stats, total_docs, progress)
    result = PreparedData(
        out_dir=out_dir,
        tokenizer_path=tok_out,
        prefix=out_dir / "data",
        vocab_size=tok.get_vocab_size(),
        eod_id=eod_id(tok),
        num_docs=writer.num_docs,
        num_tokens=writer.num_tokens,
        reused=False,
    )
    _write_manifest(out_dir, key, result, stats)
    log(
        f"prepare: wrote {out_dir}: {result.num_docs} documents, {result.num_tokens} tokens, "
        f"vocab {result.vocab_size} ({stats.bytes / max(result.num_tokens, 1):.2f} bytes/token)"
    )
    if stats.skipped or stats.empty:
        log(f"prepare: skipped {len(stats.skipped)} undecodable and {stats.empty} empty documents")
    return result


def _obtain_tokenizer(
    tokenizer_path: Path | None,
    vocab_size: int | None,
    tok_out: Path,
    documents: Callable[[], Iterator[str]],
    log: Callable[[str], None],
) -> Tokenizer:
    """Copy the given tokenizer to `tok_out`, or train one of `vocab_size` on the documents."""
    if tokenizer_path is None:
        if vocab_size is None:
            raise DataError(
                "vocab_size is required to train a tokenizer; pass e.g. vocab_size=8192"
            )
        log(f"prepare: training a byte-level BPE tokenizer (vocab_size={vocab_size})")
        return train_bpe_from_texts(documents(), vocab_size, tok_out)
    tok = load_tokenizer(tokenizer_path)
    eod_id(tok)  # fail now, before tokenizing, when the tokenizer has no EOD token
    if vocab_size is not None and vocab_size != tok.get_vocab_size():
        raise DataError(
            f"vocab_size={vocab_size} disagrees with tokenizer {tokenizer_path} "
            f"({tok.get_vocab_size()} tokens); pass vocab_size=None or {tok.get_vocab_size()}"
        )
    save_tokenizer(tok, tok_out)
    return tok


def _encode_into(
    tok: Tokenizer,
    docs: Iterator[str],
    writer: IndexedDatasetWriter,
    stats: DocumentStats,
    total: int | None,
    progress: bool,
) -> None:
    """Encode documents in batches and append each (ids + [EOD]) to `writer`.

    The progress bar counts documents read, including empty and skipped ones (read from `stats`),
    so it reaches `total` (the number of input files) at the end.
    """
    eod = eod_id(tok)
    bar = tqdm(total=total, desc="tokenize", unit="doc", disable=not progress)
    batch: list[str] = []

    def flush() -> None:
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            writer.add_document([*enc.ids, eod])
        batch.clear()
        bar.update(stats.documents + stats.empty + len(stats.skipped) - bar.n)

    with bar:
        for text in docs:
            batch.append(text)
            if len(batch) == ENCODE_BATCH:
                flush()
        flush()


def _count_files(input: Path | None, max_bytes: int) -> int | None:
    """Number of documents when known up front (one per file), else None (jsonl)."""
    if input is None:
        return len(stdlib_files(max_bytes))
    input = Path(input)
    if input.is_dir():
        return len(list_text_files(input))
    return None if input.suffix.lower() == ".jsonl" else 1


def _manifest_key(
    input: Path | None,
    vocab_size: int | None,
    tokenizer_path: Path | None,
    text_key: str,
    errors: str,
    max_bytes: int,
) -> dict[str, Any]:
    """Everything the outputs depend on; equal keys mean the outputs can be reused."""
    tok_sha = None
    if tokenizer_path is not None:
        path = Path(tokenizer_path)
        path = path / "tokenizer.json" if path.is_dir() else path
        tok_sha = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
    return {
        "manifest_version": MANIFEST_VERSION,
        "input": None if input is None else str(Path(input).resolve()),
        "fingerprint": corpus_fingerprint(input, max_bytes),
        "max_bytes": max_bytes if input is None else None,
        "vocab_size": vocab_size,
        "tokenizer_sha256": tok_sha,
        "text_key": text_key,
        "errors": errors,
    }


def _try_reuse(out_dir: Path, key: dict[str, Any]) -> tuple[PreparedData | None, str]:
    """(the recorded result, "") when the manifest matches `key` and the files are intact;
    (None, "") when there is no manifest or it records other inputs; (None, what is damaged)
    when it matches but a file is missing, corrupt or disagrees with it."""
    manifest = out_dir / "prepare.json"
    if not manifest.is_file():
        return None, ""
    try:
        recorded = json.loads(manifest.read_text())
    except (ValueError, OSError) as err:
        return None, f"its manifest {manifest} cannot be read ({err})"
    if recorded.get("key") != key:
        return None, ""
    try:
        res = recorded["result"]
        ds = IndexedDataset(out_dir / "data")
        tok = load_tokenizer(out_dir / "tokenizer.json")
        eod = eod_id(tok)
    except (DataError, ValueError, KeyError, OSError) as err:
        return None, f"its files are damaged ({' '.join(str(err).split())})"
    if (len(ds), ds.num_tokens, tok.get_vocab_size()) != (
        res["num_docs"],
        res["num_tokens"],
        res["vocab_size"],
    ):
        return None, (
            f"its files hold {len(ds)} documents, {ds.num_tokens} tokens, vocab "
            f"{tok.get_vocab_size()} where the manifest records {res['num_docs']}, "
            f"{res['num_tokens']}, {res['vocab_size']}"
        )
    data = PreparedData(
        out_dir=out_dir,
        tokenizer_path=out_dir / "tokenizer.json",
        prefix=out_dir / "data",
        vocab_size=res["vocab_size"],
        eod_id=eod,
        num_docs=len(ds),
        num_tokens=ds.num_tokens,
        reused=True,
    )
    return data, ""


def _write_manifest(
    out_dir: Path, key: dict[str, Any], result: PreparedData, stats: DocumentStats
) -> None:
    """Write prepare.json atomically; its presence marks a complete, reusable output."""
    body = {
        "key": key,
        "result": {
            "num_docs": result.num_docs,
            "num_tokens": result.num_tokens,
            "vocab_size": result.vocab_size,
            "eod_id": result.eod_id,
            "input_bytes": stats.bytes,
            "empty_documents": stats.empty,
            "skipped_documents": stats.skipped,
        },
    }
    tmp = out_dir / "prepare.json.tmp"
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    os.replace(tmp, out_dir / "prepare.json")
