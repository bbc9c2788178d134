"""Input formats: json arrays, csv/tsv, parquet, jsonl.gz/.zst, arrow, HF save_to_disk dirs,
folders of shards, globs, comma lists; unsupported formats; every problem in one error."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from colonnade.data import CorpusError, DocumentStats, iter_documents
from colonnade.data.corpus import corpus_fingerprint
from colonnade.data.readers import resolve_input

DOCS = ["first doc", "sécond, with \"quotes\"\nand a newline", "third 🐍"]


def _jsonl(docs: list[str], key: str = "text") -> bytes:
    return "".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)).encode()


def test_json_array_of_records_is_one_document_per_record(tmp_path: Path) -> None:
    path = tmp_path / "docs.json"
    path.write_text(json.dumps([{"body": d, "n": 1} for d in DOCS]))
    assert list(iter_documents(path, text_key="body")) == DOCS
    strings = tmp_path / "strings.json"
    strings.write_text(json.dumps(DOCS[:2]))
    assert list(iter_documents(strings)) == DOCS[:2]
    lines = tmp_path / "lines.json"  # JSON lines under a .json name
    lines.write_bytes(_jsonl(DOCS))
    assert list(iter_documents(lines)) == DOCS
    (tmp_path / "broken.json").write_text('[{"text": "a"},')
    with pytest.raises(CorpusError, match=r"broken\.json: invalid JSON: Expecting value at "
                       r"line 1 column 16\n"):
        list(iter_documents(tmp_path / "broken.json"))


def test_csv_and_tsv_text_column(tmp_path: Path) -> None:
    import csv

    for name, delim in (("docs.csv", ","), ("docs.tsv", "\t")):
        with (tmp_path / name).open("w", newline="") as fh:
            writer = csv.writer(fh, delimiter=delim)
            writer.writerow(["id", "content"])
            writer.writerows([[i, d] for i, d in enumerate(DOCS)])
        assert list(iter_documents(tmp_path / name, text_key="content")) == DOCS
    stats = DocumentStats()
    with pytest.raises(CorpusError, match=r"the first record of 1 file\(s\) cannot be read "
                       r"\(checked before reading the corpus\):\n  - \S+docs\.csv: no column "
                       r"'text' in the header \(id, "):
        iter_documents(tmp_path / "docs.csv", stats=stats)
    assert stats.problems == 0  # raised by the check before the corpus is read
    assert list(iter_documents(tmp_path / "docs.csv", errors="skip", stats=stats)) == []
    assert stats.problems == 1  # under 'skip': read, left out and counted


def test_parquet_column_with_null_rows(tmp_path: Path) -> None:
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": [*DOCS, None], "n": [1, 2, 3, 4]}), path, row_group_size=2)
    stats = DocumentStats()
    assert list(iter_documents(path, errors="skip", stats=stats)) == DOCS
    assert stats.skipped == [f"{path}[row 3]: null under 'text'"]
    with pytest.raises(CorpusError, match=r"column 'n' has type int64, not string"):
        list(iter_documents(path, text_key="n"))
    # a missing column: the one string column is named as the key to set
    with pytest.raises(CorpusError, match=r"no column 'body' \(columns: text, n\); "
                       r"set --data.text_key=text\n"):
        iter_documents(path, text_key="body")


def test_jsonl_gz_and_zst(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS)))
    # two zstd frames back to back, as `cat a.zst b.zst` makes
    zst = zstandard.ZstdCompressor()
    frames = zst.compress(_jsonl(DOCS[:1])) + zst.compress(_jsonl(DOCS[1:]))
    (tmp_path / "b.jsonl.zst").write_bytes(frames)
    assert list(iter_documents(tmp_path / "a.jsonl.gz")) == DOCS
    assert list(iter_documents(tmp_path / "b.jsonl.zst")) == DOCS
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(DOCS[1].encode()))
    assert list(iter_documents(tmp_path / "c.txt.gz")) == [DOCS[1]]
    for name in ("broken.jsonl.gz", "broken.jsonl.zst", "broken.parquet"):
        (tmp_path / name).write_bytes(b"not compressed at all")
        stats = DocumentStats()
        assert list(iter_documents(tmp_path / name, errors="skip", stats=stats)) == []
        assert stats.skipped[0].startswith(f"{tmp_path / name}: cannot be read ("), stats.skipped


def test_hf_datasets_save_to_disk_directory(tmp_path: Path) -> None:
    import datasets

    rows = [f"row {i}: " + DOCS[i % 3] for i in range(10)]
    ds = datasets.Dataset.from_dict({"id": list(range(10)), "content": rows})
    ds.save_to_disk(str(tmp_path / "ds"), num_shards=3)
    sources = resolve_input(tmp_path / "ds")
    assert [s.fmt for s in sources] == ["arrow"] * 3
    assert list(iter_documents(tmp_path / "ds", text_key="content")) == rows
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(
        str(tmp_path / "dd"))
    with pytest.raises(CorpusError, match=r"DatasetDict with splits .*point data\.input at one"):
        list(iter_documents(tmp_path / "dd"))
    assert list(iter_documents(tmp_path / "dd" / "test", text_key="content")) == rows[:2]


def test_folder_of_shards_glob_and_comma_list(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    (shards / "sub").mkdir(parents=True)
    (shards / "b.jsonl").write_bytes(_jsonl(["b0", "b1"]))
    (shards / "a.jsonl").write_bytes(_jsonl(["a0"]))
    (shards / "sub" / "c.jsonl").write_bytes(_jsonl(["c0"]))
    (shards / ".hidden.jsonl").write_bytes(_jsonl(["never"]))
    (shards / "notes.pdf").write_bytes(b"%PDF")
    stats = DocumentStats()
    assert list(iter_documents(shards, stats=stats)) == ["a0", "b0", "b1", "c0"]
    assert stats.ignored == [str(shards / "notes.pdf")]
    assert list(iter_documents(f"{shards}/**/*.jsonl")) == ["a0", "b0", "b1", "c0"]
    spec = f"{shards / 'sub' / 'c.jsonl'},{shards / 'a.jsonl'}"
    assert list(iter_documents(spec)) == ["c0", "a0"]
    first = corpus_fingerprint(shards)
    (shards / "a.jsonl").write_bytes(_jsonl(["a0", "new"]))
    assert corpus_fingerprint(shards) != first
    with pytest.raises(CorpusError, match=r"glob '.*\*\.parquet' matches no file"):
        list(iter_documents(f"{shards}/*.parquet"))


def test_unsupported_format_names_suffix_and_formats(tmp_path: Path) -> None:
    path = tmp_path / "book.pdf"
    path.write_bytes(b"%PDF-1.4")
    with pytest.raises(CorpusError) as info:
        list(iter_documents(path))
    msg = str(info.value)
    assert "unsupported input format '.pdf'" in msg
    assert all(fmt in msg for fmt in (".jsonl", ".parquet", ".csv", "save_to_disk", ".zst"))


def test_every_problem_reported_together_or_skipped(tmp_path: Path) -> None:
    (tmp_path / "a_ok.txt").write_text("fine")
    (tmp_path / "b_latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp_path / "c.jsonl").write_bytes(
        b'{"text": "ok"}\nnot json\n{"body": "x"}\n{"text": "b\xffd"}\n{"text": "end"}\n')
    (tmp_path / "d.json").write_text("[{\"text\": 1}, {\"text\": \"json ok\"}]")
    with pytest.raises(CorpusError) as info:
        list(iter_documents(tmp_path))
    msg = str(info.value)
    assert msg.startswith("5 document(s) in 3 file(s) cannot be read:")
    for part in ("b_latin1.txt: not valid UTF-8 at byte offset 3", "c.jsonl:2: invalid JSON",
                 "c.jsonl:3: no string under key 'text' (keys: body)",
                 "c.jsonl:4: not valid UTF-8 at byte offset 49", "d.json[0]: no string under",
                 "--data.errors=skip"):
        assert part in msg, (part, msg)
    stats = DocumentStats()
    docs = list(iter_documents(tmp_path, errors="skip", stats=stats))
    assert docs == ["fine", "ok", "end", "json ok"]
    assert (stats.documents, stats.problems, len(stats.skipped)) == (4, 5, 5)
    assert stats.bad_files == {str(tmp_path / "b_latin1.txt"): 1, str(tmp_path / "c.jsonl"): 3,
                               str(tmp_path / "d.json"): 1}


def test_one_line_per_file_and_reason_with_the_key_to_set(tmp_path: Path) -> None:
    """Records that name the text otherwise: at once, from the first record, naming the fix;
    past a good first record, one line for all of them."""
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(f'{{"content": "doc {i}", "id": {i}}}\n' for i in range(50)))
    with pytest.raises(CorpusError) as info:
        iter_documents(path)  # the call checks, before any document is read
    assert str(info.value) == (
        "the first record of 1 file(s) cannot be read (checked before reading the corpus):\n"
        f"  - {path}:1: no string under key 'text' (keys: content, id); set "
        "--data.text_key=content or fix the record\nfix each as its line says (rename the file, "
        "set data.text_key or a ':KEY' suffix), or leave unreadable records out with "
        "data.errors='skip' (--data.errors=skip)")
    assert list(iter_documents(path, text_key="content"))[:2] == ["doc 0", "doc 1"]
    path.write_text('{"text": "first"}\n' + path.read_text())
    with pytest.raises(CorpusError) as info:
        list(iter_documents(path))
    msg = str(info.value)
    assert msg.startswith("50 document(s) in 1 file(s) cannot be read:\n")
    assert (f"  - {path}:2 and 49 more records: no string under key 'text' (keys: content, id); "
            "set --data.text_key=content or fix the record\n") in msg
    assert "... and" not in msg  # every problem is in the one line
