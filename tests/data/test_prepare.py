"""prepare(): corpus -> tokenizer.json + data.bin/.idx, reuse, given tokenizer, stdlib default."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from colonnade.data import CorpusError, DataError, prepare, stdlib_files


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Five small stdlib sources (a few KB) copied into a directory."""
    out = tmp_path_factory.mktemp("corpus")
    small = [p for p in stdlib_files() if 500 < p.stat().st_size < 3_000][:5]
    assert len(small) == 5
    for i, src in enumerate(small):
        shutil.copy(src, out / f"{i:02d}_{src.name}")
    return out


def test_prepare_directory_then_reuse(tmp_path: Path, corpus_dir: Path) -> None:
    out, logs = tmp_path / "out", []
    res = prepare(corpus_dir, out, 300, progress=False, log=logs.append)
    assert not res.reused
    assert {p.name for p in out.iterdir()} == {
        "tokenizer.json",
        "data.bin",
        "data.idx",
        "prepare.json",
    }
    ds, tok = res.dataset(), res.tokenizer()
    files = sorted(corpus_dir.iterdir())
    assert (len(ds), res.num_docs, res.num_tokens) == (5, 5, ds.num_tokens)
    assert res.vocab_size == tok.get_vocab_size() <= 300
    for d, file in enumerate(files):
        doc = ds[d].tolist()
        assert doc[-1] == res.eod_id and res.eod_id not in doc[:-1]
        assert tok.decode(doc[:-1]) == file.read_text()
    again = prepare(corpus_dir, out, 300, progress=False, log=logs.append)
    assert again.reused and again.num_tokens == res.num_tokens
    assert "reusing" in logs[-1]
    data_bin = out / "data.bin"
    data_bin.write_bytes(data_bin.read_bytes()[:-4])  # truncated behind the manifest's back
    repaired = prepare(corpus_dir, out, 300, progress=False, log=logs.append)
    assert not repaired.reused and repaired.num_tokens == res.num_tokens
    said = next(line for line in logs if "tokenizing again" in line)
    assert "was built from these inputs but its files are damaged" in said
    assert "data.bin" in said, said
    changed = files[0].read_text() + "\nx = 1\n"
    files[0].write_text(changed)
    try:
        rebuilt = prepare(corpus_dir, out, 300, progress=False, log=logs.append)
        assert not rebuilt.reused and rebuilt.num_tokens > res.num_tokens
    finally:
        files[0].write_text(changed[: -len("\nx = 1\n")])


def test_prepare_jsonl_with_given_tokenizer(tmp_path: Path, corpus_dir: Path) -> None:
    first = prepare(corpus_dir, tmp_path / "a", 300, progress=False, log=lambda _: None)
    texts = [p.read_text() for p in sorted(corpus_dir.iterdir())]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    second = prepare(
        jsonl, tmp_path / "b", None, first.tokenizer_path, text_key="body", log=lambda _: None
    )
    assert (second.tokenizer_path.read_text()) == first.tokenizer_path.read_text()
    assert second.dataset().tokens.tolist() == first.dataset().tokens.tolist()
    with pytest.raises(DataError, match="vocab_size=123 disagrees with tokenizer"):
        prepare(jsonl, tmp_path / "c", 123, first.tokenizer_path, text_key="body")


def test_prepare_default_stdlib_corpus(tmp_path: Path) -> None:
    res = prepare(None, tmp_path / "std", 300, max_bytes=20_000, progress=False, log=lambda _: None)
    assert res.num_docs == len(stdlib_files(20_000))
    assert 0 < res.num_tokens < 20_000
    assert int((res.dataset().tokens == res.eod_id).sum()) == res.num_docs


def test_prepare_non_utf8_strict_and_skip(tmp_path: Path, corpus_dir: Path) -> None:
    bad_dir = tmp_path / "mixed"
    shutil.copytree(corpus_dir, bad_dir)
    (bad_dir / "zz_bad.txt").write_bytes(b"ok \xff\xfe")
    with pytest.raises(CorpusError, match=r"zz_bad\.txt: not valid UTF-8 at byte offset 3"):
        prepare(bad_dir, tmp_path / "o1", 300, progress=False, log=lambda _: None)
    logs: list[str] = []
    res = prepare(bad_dir, tmp_path / "o2", 300, errors="skip", progress=False, log=logs.append)
    assert res.num_docs == 5
    assert any("left out 1 unreadable documents" in line for line in logs)
    manifest = json.loads((tmp_path / "o2" / "prepare.json").read_text())
    assert len(manifest["result"]["skipped_documents"]) == 1
    assert not os.path.exists(tmp_path / "o1" / "prepare.json")


def _files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


def test_workers_give_identical_output(tmp_path: Path, corpus_dir: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from colonnade.data import encode

    monkeypatch.setattr(encode, "ENCODE_BATCH", 2)  # 5 documents -> 3 batches
    tok = prepare(corpus_dir, tmp_path / "tok", 300, progress=False, log=lambda _: None)
    outs = {}
    for workers in (1, 2):
        logs: list[str] = []
        res = prepare(corpus_dir, tmp_path / f"w{workers}", None, tok.tokenizer_path,
                      num_workers=workers, progress=False, log=logs.append)
        assert res.num_docs == 5 and f"workers={workers}" in logs[0] and "tokens/s" in logs[0]
        outs[workers] = _files(tmp_path / f"w{workers}")
    assert outs[1] == outs[2]
    assert outs[1]["data.bin"] == (tmp_path / "tok" / "data.bin").read_bytes()
    with pytest.raises(DataError, match="num_workers=0 must be >= 1"):
        prepare(corpus_dir, tmp_path / "w0", 300, num_workers=0)


def test_strict_failure_changes_no_file(tmp_path: Path, corpus_dir: Path) -> None:
    out = tmp_path / "out"
    prepare(corpus_dir, out, 300, progress=False, log=lambda _: None)
    before = _files(out)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n{"nope": 1}\n')
    tok = out / "tokenizer.json"
    with pytest.raises(CorpusError, match=r"2 document\(s\) in 1 file\(s\)"):
        prepare(bad, out, None, tok, progress=False, log=lambda _: None)
    with pytest.raises(CorpusError, match=r"bad\.jsonl:2: not valid UTF-8"):
        prepare(bad, out, 300, progress=False, log=lambda _: None)  # fails in the BPE pass
    with pytest.raises(DataError, match=r"--model\.vocab_size=\d+"):
        prepare(bad, out, 123, tok)
    assert _files(out) == before
    with pytest.raises(CorpusError):
        prepare(bad, tmp_path / "new", None, tok, progress=False, log=lambda _: None)
    assert not (tmp_path / "new").exists()


def test_reuse_and_refresh_for_columnar_inputs(tmp_path: Path, corpus_dir: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [p.read_text() for p in sorted(corpus_dir.iterdir())]
    path = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": texts}), path)
    ref = prepare(corpus_dir, tmp_path / "ref", 300, progress=False, log=lambda _: None)
    kw = {"progress": False, "log": lambda _: None, "text_key": "body"}
    first = prepare(path, tmp_path / "o", None, ref.tokenizer_path, **kw)
    assert first.dataset().tokens.tolist() == ref.dataset().tokens.tolist()
    assert prepare(path, tmp_path / "o", None, ref.tokenizer_path, **kw).reused
    pq.write_table(pa.table({"body": texts[:3], "text": ["x", "y", "z"]}), path)
    again = prepare(path, tmp_path / "o", None, ref.tokenizer_path, **kw)
    assert not again.reused and again.num_docs == 3
    kw["text_key"] = "text"
    other_key = prepare(path, tmp_path / "o", None, ref.tokenizer_path, **kw)
    assert not other_key.reused and other_key.num_tokens < again.num_tokens


@pytest.mark.parametrize("fmt", ["jsonl.gz", "csv", "hf_dataset", "glob"])
def test_every_input_type_is_fingerprinted(tmp_path: Path, fmt: str) -> None:
    import csv
    import gzip

    def write(texts: list[str]) -> Path:
        if fmt == "jsonl.gz":
            path = tmp_path / "d.jsonl.gz"
            path.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n"
                                                   for t in texts).encode()))
        elif fmt == "csv":
            path = tmp_path / "d.csv"
            with path.open("w", newline="") as fh:
                csv.writer(fh).writerows([["text"], *[[t] for t in texts]])
        elif fmt == "hf_dataset":
            import datasets

            path = tmp_path / "ds"
            shutil.rmtree(path, ignore_errors=True)
            datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(path))
        else:
            (tmp_path / "g").mkdir(exist_ok=True)
            for i, t in enumerate(texts):
                (tmp_path / "g" / f"{i}.txt").write_text(t)
            return tmp_path / "g" / "*.txt"
        return path

    texts = ["def f(x):\n    return x\n", "class A:\n    pass\n", "import os\n"]
    kw = {"progress": False, "log": lambda _: None}
    path = write(texts)
    first = prepare(path, tmp_path / "o", 300, **kw)
    assert first.num_docs == 3 and not first.reused
    assert prepare(path, tmp_path / "o", 300, **kw).reused
    assert write([*texts, "x = 1\n"]) == path
    changed = prepare(path, tmp_path / "o", 300, **kw)
    assert not changed.reused and changed.num_docs == 4
    assert prepare(path, tmp_path / "o", 300, **kw).reused
