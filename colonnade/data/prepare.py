"""`colonnade prepare`: corpus -> tokenizer.json + data.bin + data.idx in one output directory.

Steps: (1) take the given tokenizer, or train a byte-level BPE one on the same input; (2) encode
every document, append the EOD token, and stream the ids into an indexed dataset; (3) write
`prepare.json`, a manifest of what was built from what. A second call with the same inputs finds a
matching manifest and intact files and reuses them instead of tokenizing again; one whose input
files changed (or data.errors, or the built-in corpus cap) tokenizes again and says why. This
function rebuilds whatever `out_dir` held: the refusal to replace a dataset whose tokens would
mean something else (other inputs, keys, tokenizer, format) comes before it, in
:func:`colonnade.training.preflight.check_prepare_target` (see :mod:`colonnade.data.manifest`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tqdm import tqdm

from colonnade.checkpoint.format import removed_on_failure
from colonnade.config.data_paths import input_sources, normalize_input
from colonnade.data.chat import config_damage, tokenizer_config, write_tokenizer_config
from colonnade.data.corpus import (
    DEFAULT_MAX_BYTES,
    ERROR_POLICIES,
    DocumentStats,
    ErrorPolicy,
    corpus_fingerprint,
    iter_documents,
    iter_stdlib_documents,
    no_documents_message,
    stdlib_files,
)
from colonnade.data.encode import encode_stream
from colonnade.data.errors import CorpusError, DataError
from colonnade.data.indexed import IndexedDataset, IndexedDatasetWriter
from colonnade.data.manifest import file_sha256
from colonnade.data.readers import resolve_input
from colonnade.data.tokenizer import eod_id, load_tokenizer, save_tokenizer, train_bpe_from_texts

MANIFEST_VERSION = 2  # 2: .json read as records, inputs may be globs, comma lists, ':key's
REUSE_LINE = "prepare: reusing "
"""How the line logged for a reused build starts (`prepare`, `sft.prepare_sft`)."""
MAX_MANIFEST_SKIPPED = 1000
"""Unreadable documents listed by name in prepare.json (all are counted)."""


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
    input: str | Path | None,
    out_dir: Path,
    vocab_size: int | None,
    tokenizer_path: Path | None = None,
    *,
    text_key: str = "text",
    errors: ErrorPolicy = "strict",
    max_bytes: int = DEFAULT_MAX_BYTES,
    num_workers: int = 1,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> PreparedData:
    """Tokenize `input` (None = the built-in stdlib corpus capped at `max_bytes`) into `out_dir`.

    `input` is anything `readers.resolve_input` accepts (files, directories, globs, comma lists
    of text, jsonl(.gz/.zst), json, csv, parquet, arrow, Hugging Face datasets directories; a
    part's ':KEY' suffix reads its records under KEY instead of `text_key`).
    Without `tokenizer_path`, a byte-level BPE tokenizer of `vocab_size` is trained on the same
    input. With one (a tokenizer.json or a directory holding one), `vocab_size` may be None, or
    must equal the tokenizer's size. `num_workers` > 1 encodes in that many processes (the
    output is identical, so it is not part of the manifest). Every check on the arguments runs
    before any file is touched, and a failure (including unreadable documents under
    errors='strict', all listed in one error) leaves `out_dir` as it was.
    """
    out_dir = Path(out_dir)
    if num_workers < 1:
        raise DataError(f"data.num_workers={num_workers} must be >= 1 (1 encodes in this "
                        "process; more uses that many worker processes)")
    if errors not in ERROR_POLICIES:
        raise DataError(f"data.errors={errors!r} must be one of {', '.join(ERROR_POLICIES)}")
    given = _given_tokenizer(tokenizer_path, vocab_size)
    tok_config = tokenizer_config(tokenizer_path)  # kept beside tokenizer.json (data/chat.py)
    key = _manifest_key(input, vocab_size, tokenizer_path, text_key, errors, max_bytes)
    reused, damage = _try_reuse(out_dir, key)
    if reused is not None:
        log(f"{REUSE_LINE}{out_dir} ({reused.num_docs} documents, {reused.num_tokens} tokens; "
            "inputs unchanged)")
        if tokenizer_path is not None and config_damage(out_dir, tok_config):
            write_tokenizer_config(out_dir, tok_config)  # the tokens do not depend on it
            log(f"prepare: {out_dir}: tokenizer_config.json (special tokens, chat template) "
                f"updated to the one of {tokenizer_path}")
        return reused
    if damage:
        log(f"prepare: {out_dir} was built from these inputs but {damage}; tokenizing again")
    elif changed := _changed_since(out_dir, key):
        log(f"prepare: {out_dir} was built before {changed}; tokenizing again")

    def documents(stats: DocumentStats) -> Iterator[str]:
        if input is None:
            return iter_stdlib_documents(max_bytes, stats=stats)
        return iter_documents(input, text_key=text_key, errors=errors, stats=stats)

    total = _total_docs(input, max_bytes)
    if given is None:
        first = DocumentStats()
        texts = documents(first)  # the input's checks raise here, before the log
        log(f"prepare: training a byte-level BPE tokenizer (vocab_size={vocab_size})")
        with tqdm(texts, total=total, desc="train tokenizer", unit="doc",  # reads the corpus
                  disable=None if progress else True) as read:  # None: off when not a terminal
            given = train_bpe_from_texts(read, int(vocab_size or 0), None)
        _require_documents(input, first)
    with removed_on_failure(out_dir):
        result, stats = _tokenize(given, documents, out_dir, num_workers, progress, total,
                                  log, input)
        write_tokenizer_config(out_dir, tok_config)
    _write_manifest(out_dir, key, result, stats, tokenizer_path)
    _log_summary(result, stats, log)
    return result


def _changed_since(out_dir: Path, key: dict[str, Any]) -> str:
    """What changed since `out_dir`'s manifest was written, among what is tokenized again
    rather than refused: the input files, data.errors, the built-in corpus cap, and (SFT) the
    given tokenizer's tokenizer_config.json, whose chat template renders the records ('' when
    it has no manifest or nothing of that changed)."""
    try:
        recorded = _reasons_view(json.loads((out_dir / "prepare.json").read_text())["key"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ""
    key = _reasons_view(key)
    names = {"fingerprint": "the input files changed (sizes or modification times)",
             "errors": f"data.errors changed ('{recorded.get('errors')}' -> '{key['errors']}')",
             "max_bytes": "data.max_corpus_bytes changed",
             "tokenizer_config": "the tokenizer's tokenizer_config.json (special tokens, chat "
                                 "template) changed"}
    if any(recorded.get(k) != key.get(k) for k in {*recorded, *key} - set(names)):
        return ""  # another dataset: check_prepare_target refused it or data.overwrite said so
    return "; ".join(why for name, why in names.items() if recorded.get(name) != key.get(name))


def _reasons_view(key: dict[str, Any]) -> dict[str, Any]:
    """A manifest key with the SFT tokenizer_config_sha256 lifted out of key['sft'] as
    'tokenizer_config' (:func:`_changed_since` names it as a reason)."""
    sft = key.get("sft")
    if not isinstance(sft, dict):
        return key
    rest = {name: value for name, value in sft.items() if name != "tokenizer_config_sha256"}
    return {**key, "sft": rest, "tokenizer_config": sft.get("tokenizer_config_sha256")}


def _require_documents(input: str | Path | None, stats: DocumentStats) -> None:
    """Refuse an input that gave no document (empty files, blank lines, every record
    unreadable under data.errors='skip'), naming its files."""
    if input is not None and not stats.documents:
        raise CorpusError(no_documents_message(resolve_input(input), stats))


def _given_tokenizer(tokenizer_path: Path | None, vocab_size: int | None) -> Tokenizer | None:
    """The tokenizer to use, loaded and checked (EOD token, vocab size); None means train one."""
    if tokenizer_path is None:
        if vocab_size is None:
            raise DataError(
                "a vocab size is needed to train a tokenizer; set model.vocab_size "
                "(--model.vocab_size=8192) or give one with data.tokenizer"
            )
        return None
    tok = load_tokenizer(tokenizer_path)
    eod_id(tok)  # fail now, before tokenizing, when the tokenizer has no EOD token
    if vocab_size is not None and vocab_size != tok.get_vocab_size():
        n = tok.get_vocab_size()
        raise DataError(
            f"vocab_size={vocab_size} disagrees with tokenizer {tokenizer_path} ({n} tokens); "
            f"set model.vocab_size to {n} (--model.vocab_size={n}) or leave data.tokenizer unset "
            "to train one"
        )
    return tok


def _tokenize(
    tok: Tokenizer,
    documents: Callable[[DocumentStats], Iterator[str]],
    out_dir: Path,
    num_workers: int,
    progress: bool,
    total: int | None,
    log: Callable[[str], None],
    input: str | Path | None = None,
) -> tuple[PreparedData, DocumentStats]:
    """Encode every document into `out_dir`/data.{bin,idx} and save the tokenizer there.

    The dataset is written under temporary names; only when the whole input was read without
    error, and gave a document (`_require_documents`), are the manifest removed, the
    tokenizer saved and the files renamed into place.
    """
    stats = DocumentStats()
    eod = eod_id(tok)
    start = time.perf_counter()
    with (IndexedDatasetWriter(out_dir / "data", tok.get_vocab_size()) as writer,
          tqdm(total=total, desc="tokenize", unit="doc",
               disable=None if progress else True) as bar):  # None: off when not a terminal
        for ids, lengths in encode_stream(tok, eod, documents(stats), num_workers):
            writer.add_documents(ids, lengths)
            bar.update(stats.documents + stats.empty + stats.problems - bar.n)
            bar.set_postfix(tokens=writer.num_tokens, refresh=False)
        _require_documents(input, stats)  # raised here, the writer drops its temporary files
        (out_dir / "prepare.json").unlink(missing_ok=True)  # files change from here on
        for stale in ("mask.bin", "mask.idx"):  # an SFT loss mask (data/sft.py) of old data
            (out_dir / stale).unlink(missing_ok=True)
        save_tokenizer(tok, out_dir / "tokenizer.json")
    seconds = time.perf_counter() - start
    log(f"prepare: tokenized {writer.num_docs} documents in {seconds:.1f}s "
        f"({writer.num_docs / max(seconds, 1e-9):,.0f} docs/s, "
        f"{writer.num_tokens / max(seconds, 1e-9):,.0f} tokens/s, workers={num_workers})")
    result = PreparedData(
        out_dir=out_dir,
        tokenizer_path=out_dir / "tokenizer.json",
        prefix=out_dir / "data",
        vocab_size=tok.get_vocab_size(),
        eod_id=eod,
        num_docs=writer.num_docs,
        num_tokens=writer.num_tokens,
        reused=False,
    )
    return result, stats


def _log_summary(result: PreparedData, stats: DocumentStats, log: Callable[[str], None]) -> None:
    log(
        f"prepare: wrote {result.out_dir}: {result.num_docs} documents, {result.num_tokens} "
        f"tokens, vocab {result.vocab_size} "
        f"({stats.bytes / max(result.num_tokens, 1):.2f} bytes/token)"
    )
    if stats.problems or stats.empty:
        first = "; ".join(stats.skipped[:3])
        log(f"prepare: left out {stats.problems} unreadable documents (data.errors='skip') and "
            f"{stats.empty} empty ones" + (f"; first: {first}" if first else ""))
    if stats.ignored:
        log(f"prepare: ignored {len(stats.ignored)} files in unsupported formats: "
            f"{', '.join(stats.ignored[:5])}{' ...' if len(stats.ignored) > 5 else ''}")


def _total_docs(input: str | Path | None, max_bytes: int) -> int | None:
    """Number of documents when known up front (text files only: one per file), else None."""
    if input is None:
        return len(stdlib_files(max_bytes))
    sources = resolve_input(input)
    return len(sources) if all(s.fmt == "text" for s in sources) else None


def _manifest_key(
    input: str | Path | None,
    vocab_size: int | None,
    tokenizer_path: Path | None,
    text_key: str,
    errors: str,
    max_bytes: int,
) -> dict[str, Any]:
    """Everything the outputs depend on; equal keys mean the outputs can be reused."""
    tok_sha = None if tokenizer_path is None else file_sha256(Path(tokenizer_path))
    return {
        "manifest_version": MANIFEST_VERSION,
        "input": None if input is None else normalize_input(str(input)),
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
    out_dir: Path, key: dict[str, Any], result: PreparedData, stats: DocumentStats,
    tokenizer_path: Path | None = None,
) -> None:
    """Write prepare.json atomically; its presence marks a complete, reusable output. Beside
    the key and the result it records, for people and error messages, the given tokenizer's
    path and the text key each input part was read under."""
    spec = key.get("input")
    body: dict[str, Any] = {
        "key": key,
        "tokenizer": None if tokenizer_path is None else str(Path(tokenizer_path).resolve()),
        "text_keys": None if not spec or not key.get("text_key") else {
            part: part_key or key["text_key"] for part, part_key in input_sources(spec)},
        "result": {
            "num_docs": result.num_docs,
            "num_tokens": result.num_tokens,
            "vocab_size": result.vocab_size,
            "eod_id": result.eod_id,
            "input_bytes": stats.bytes,
            "empty_documents": stats.empty,
            "skipped_documents": stats.skipped[:MAX_MANIFEST_SKIPPED],
            "skipped_total": stats.problems,
            "ignored_files": stats.ignored[:MAX_MANIFEST_SKIPPED],
        },
    }
    tmp = out_dir / "prepare.json.tmp"
    tmp.write_text(json.dumps(body, indent=2) + "\n")
    os.replace(tmp, out_dir / "prepare.json")
