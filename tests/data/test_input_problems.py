"""Inputs that cannot give a dataset are refused by `prepare`, naming the file and the fix
(issue 35, item 8): an empty .jsonl, a parquet file named .jsonl, a JSON error in full."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from colonnade.cli import main
from colonnade.data import CorpusError, DocumentStats, iter_documents
from tests.data.test_prepare_cli import _model_dir


def _prepare(tmp_path: Path, spec: Path, *extra: str) -> list[str]:
    vocab = [] if any(e.startswith("--data.tokenizer") for e in extra) else [
        "--model.vocab_size=300"]
    return ["prepare", f"--data.input={spec}", f"--data.prepared_dir={tmp_path / 'out'}",
            *vocab, *extra]


def test_empty_input_is_refused_at_prepare_time(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "stories.jsonl"
    empty.write_text("")
    assert main(_prepare(tmp_path, empty)) == 2
    assert capsys.readouterr().err == (
        f"colonnade: CorpusError: no documents in {empty}: the file is empty. Nothing was "
        "prepared; point data.input at files that hold text\n")
    assert not (tmp_path / "out").exists()
    blank = tmp_path / "blank.jsonl"
    blank.write_text('\n{"text": ""}\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    model = _model_dir(tmp_path)  # a given tokenizer: the check comes after the tokenizing pass
    for spec, extra, why in (
            (blank, [], "it holds only blank lines or empty texts (1 empty document(s) left "
             "out)"),
            (bad, ["--data.errors=skip", f"--data.tokenizer={model}"],
             "all 1 of its documents were unreadable and left out (data.errors='skip'); "
             f"first: {bad}:1: no string under key 'text'")):
        assert main(_prepare(tmp_path, spec, *extra)) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"colonnade: CorpusError: no documents in {spec}: {why}"), err
        assert not (tmp_path / "out").exists()


def test_parquet_named_jsonl_is_named_as_parquet(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    disguised = tmp_path / "shard.jsonl"
    pq.write_table(pa.table({"text": ["a", "b"]}), disguised)
    assert main(_prepare(tmp_path, disguised)) == 2
    err = capsys.readouterr().err
    assert (f"  - {disguised}: looks like a parquet file (it starts with the magic bytes "
            "'PAR1'), not jsonl; rename it to shard.parquet\n") in err, err
    assert "UTF-8" not in err and not (tmp_path / "out").exists()


def test_json_errors_are_whole_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n" + '{"text": "tab\there"}\n')
    stats = DocumentStats()
    assert list(iter_documents(path, errors="skip", stats=stats)) == ["ok"]
    assert stats.skipped == [
        f"{path}:2: invalid JSON: Invalid control character at line 2 column 14 (a raw tab, "
        "newline or other control character inside a string: escape it as \\t, \\n or "
        "\\uXXXX)"]
    array = tmp_path / "docs.json"
    array.write_text('[{"text": "a"},\n {"text": "b"\n')
    stats = DocumentStats()
    with pytest.raises(CorpusError):
        list(iter_documents(array, stats=stats))
    assert stats.skipped == [f"{array}: invalid JSON: Expecting ',' delimiter at line 3 "
                             "column 1"]


def test_sft_inputs_get_the_same_refusals(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """data.format='sft' reads its own records: an empty file, a parquet file named .jsonl and
    a JSON error are refused as in pretraining, each file named once."""
    empty = tmp_path / "chats.jsonl"
    empty.write_text("\n")
    assert main(_prepare(tmp_path, empty, "--data.format=sft")) == 2
    assert capsys.readouterr().err == (
        f"colonnade: CorpusError: no documents in {empty}: it holds only blank lines. Nothing "
        "was prepared; point data.input at files that hold text\n")
    assert not (tmp_path / "out").exists()
    disguised = tmp_path / "shard.jsonl"
    pq.write_table(pa.table({"prompt": ["a"] * 50, "response": ["b"] * 50}), disguised)
    tab = tmp_path / "tab.jsonl"
    tab.write_text('{"prompt": "a\tb", "response": "c"}\n')
    assert main(_prepare(tmp_path, Path(f"{disguised},{tab}"), "--data.format=sft")) == 2
    assert capsys.readouterr().err == (
        "colonnade: CorpusError: the first record of 2 file(s) is not an SFT example (checked "
        "before reading the input):\n"
        f"  - {disguised}: looks like a parquet file (it starts with the magic bytes 'PAR1'), "
        "not jsonl; rename it to shard.parquet\n"
        f"  - {tab}:1: invalid JSON: Invalid control character at line 1 column 14 (a raw "
        "tab, newline or other control character inside a string: escape it as \\t, \\n or "
        "\\uXXXX)\n"
        "fix them, or leave unusable records out with data.errors='skip' (--data.errors=skip)\n")
    assert not (tmp_path / "out").exists()
