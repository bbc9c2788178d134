"""Corpus reading: deterministic order, jsonl keys, UTF-8 errors with file and byte offset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colonnade.data import CorpusError, DocumentStats, iter_documents, stdlib_files
from colonnade.data.corpus import corpus_fingerprint, stdlib_root


def test_directory_documents_sorted_by_relative_path(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("bee")
    (tmp_path / "a.md").write_text("ay")
    (tmp_path / "sub" / "c.py").write_text("x = 1\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\xff")  # not a text suffix: ignored
    stats = DocumentStats()
    assert list(iter_documents(tmp_path, stats=stats)) == ["ay", "bee", "x = 1\n"]
    assert (stats.documents, stats.bytes, stats.empty) == (3, 11, 1)


def test_jsonl_with_configurable_key(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    rows = [{"content": "first"}, {"content": "sécond"}, {"content": "third\nline"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(iter_documents(path, text_key="content")) == ["first", "sécond", "third\nline"]
    with pytest.raises(CorpusError, match=r"docs\.jsonl:1: no string under key 'text'"):
        list(iter_documents(path))


def test_non_utf8_file_names_file_and_offset(tmp_path: Path) -> None:
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "latin1.txt").write_bytes(b"abc caf" + "é".encode("latin-1") + b"!")
    with pytest.raises(CorpusError) as info:
        list(iter_documents(tmp_path))
    msg = str(info.value)
    assert "latin1.txt" in msg and "byte offset 7" in msg and "errors='skip'" in msg
    stats = DocumentStats()
    assert list(iter_documents(tmp_path, errors="skip", stats=stats)) == ["fine"]
    assert len(stats.skipped) == 1 and "latin1.txt" in stats.skipped[0]


def test_non_utf8_jsonl_offset_counts_from_file_start(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    line1 = b'{"text": "ok"}\n'  # 15 bytes
    path.write_bytes(line1 + b'{"text": "b\xffd"}\n' + b'{"text": "end"}\n')
    with pytest.raises(CorpusError, match=r"d\.jsonl:2: not valid UTF-8 at byte offset 26"):
        list(iter_documents(path))
    stats = DocumentStats()
    assert list(iter_documents(path, errors="skip", stats=stats)) == ["ok", "end"]
    assert len(stats.skipped) == 1


def test_missing_input_and_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="no such file or directory"):
        list(iter_documents(tmp_path / "absent"))
    with pytest.raises(CorpusError, match="no files of a supported format"):
        list(iter_documents(tmp_path))


def test_stdlib_corpus_is_capped_sorted_and_without_tests() -> None:
    files = stdlib_files(max_bytes=200_000)
    root = stdlib_root()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and all(r.endswith(".py") for r in rel)
    assert sum(f.stat().st_size for f in files) <= 200_000
    assert not any({"test", "tests", "site-packages"} & set(r.split("/")[:-1]) for r in rel)
    assert stdlib_files(max_bytes=200_000) == files
    assert len(stdlib_files(max_bytes=400_000)) > len(files)  # a superset of the same list
    assert set(files) <= set(stdlib_files(max_bytes=400_000))
    assert len({r.split("/")[0] for r in rel}) > 5  # sampled across the library
    assert corpus_fingerprint(None, 200_000) == corpus_fingerprint(None, 200_000)
    assert corpus_fingerprint(None, 200_000) != corpus_fingerprint(None, 400_000)
