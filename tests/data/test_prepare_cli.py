"""`colonnade prepare` from the command line: the data.* fields of every input format, a reused
Hugging Face tokenizer whose vocab is not restated, every bad document in one error."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from colonnade.cli import main
from colonnade.data import IndexedDataset

WORDS = [f"w{i}" for i in range(2996)]


def _model_dir(tmp_path: Path, eod: str = "<|endoftext|>") -> Path:
    """A 'model directory' holding a word-level tokenizer.json of 3000 tokens (more than the
    default model.vocab_size of 2048) with `eod` as its special end-of-document token."""
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", eod, "hello", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([eod, "<s>"])
    out = tmp_path / "hf_model"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "config.json").write_text('{"model_type": "llama"}')
    return out


def test_prepare_cli_parquet_and_shards_with_hf_tokenizer(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    pq.write_table(pa.table({"body": ["hello w5 w7", "w2999"]}), tmp_path / "a.parquet")
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "01.jsonl").write_text(json.dumps({"body": "w1 w2"}) + "\n")
    (shards / "00.jsonl").write_text(json.dumps({"body": "w0"}) + "\nnot json\n")
    out = tmp_path / "prepared"
    argv = ["prepare", f"--data.input={tmp_path / 'a.parquet'},{shards}",
            f"--data.prepared_dir={out}", f"--data.tokenizer={model}", "--data.text_key=body",
            "--data.errors=skip", "--data.num_workers=2"]
    assert main(argv) == 0
    ds = IndexedDataset(out / "data")
    eod, hello = 2, 3
    w = {f"w{i}": 4 + i for i in range(2996)}
    expected = [hello, w["w5"], w["w7"], eod, 0, eod, w["w0"], eod, w["w1"], w["w2"], eod]
    assert np.asarray(ds.tokens).tolist() == expected  # w2999 is not in the vocab: <unk> = 0
    manifest = json.loads((out / "prepare.json").read_text())
    assert manifest["result"]["vocab_size"] == 3000
    assert manifest["result"]["skipped_total"] == 1
    assert manifest["key"]["text_key"] == "body" and manifest["key"]["errors"] == "skip"


def test_prepare_cli_reports_every_bad_document(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(b'{"text": "ok"}\n{"text": 3}\n')
    (tmp_path / "in" / "b.txt").write_bytes(b"caf\xe9")
    out = tmp_path / "out"
    assert main(["prepare", f"--data.input={tmp_path / 'in'}", f"--data.prepared_dir={out}",
                 "--model.vocab_size=300"]) == 2
    err = capsys.readouterr().err
    assert "2 document(s) in 2 file(s) cannot be read" in err
    assert "a.jsonl:2: no string under key 'text'" in err and "b.txt: not valid UTF-8" in err
    assert "--data.errors=skip" in err and not out.exists()
    assert main(["prepare", f"--data.input={tmp_path / 'in' / 'x.xlsx'}",
                 f"--data.prepared_dir={out}"]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "in" / "x.xlsx").write_bytes(b"PK")
    assert main(["prepare", f"--data.input={tmp_path / 'in' / 'x.xlsx'}",
                 f"--data.prepared_dir={out}"]) == 2
    assert "unsupported input format '.xlsx'" in capsys.readouterr().err


@pytest.mark.parametrize("eod", ["</s>", "<|end_of_text|>"])
def test_llama_eod_tokens_are_recognised(tmp_path: Path, eod: str) -> None:
    model = _model_dir(tmp_path, eod)
    (tmp_path / "d.txt").write_text("hello w1")
    out = tmp_path / "p"
    assert main(["prepare", f"--data.input={tmp_path / 'd.txt'}", f"--data.prepared_dir={out}",
                 f"--data.tokenizer={model / 'tokenizer.json'}"]) == 0
    assert np.asarray(IndexedDataset(out / "data").tokens).tolist() == [3, 5, 2]


def test_validator_accepts_globs_and_comma_lists(tmp_path: Path) -> None:
    from colonnade.config.load import load_config
    from colonnade.config.validate import problems

    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "b.parquet").write_bytes(b"")

    def found(spec: str) -> list[str]:
        return [p for p in problems(load_config(None, [f"--data.input={spec}"]))
                if "data." in p]

    assert found(f"{tmp_path}/*.jsonl") == []
    assert found(f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.parquet'}") == []
    missing = found(f"{tmp_path / 'a.jsonl'},{tmp_path / 'nope.csv'}")
    assert len(missing) == 1 and f"({tmp_path / 'nope.csv'} not found)" in missing[0]
    assert "glob or comma-separated list" in found(f"{tmp_path}/*.csv")[0]
    bad = problems(load_config(None, ["--data.errors=maybe", "--data.num_workers=0",
                                      "--data.text_key="]))
    assert "data.errors='maybe' is unknown; use one of strict, skip." in bad
    assert "data.num_workers=0 must be >= 1." in bad
    assert any(p.startswith("data.text_key is empty") for p in bad)


def test_relative_comma_list_is_reused_on_rerun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    pq.write_table(pa.table({"text": ["one doc", "two doc"]}), tmp_path / "a.parquet")
    (tmp_path / "sh").mkdir()
    (tmp_path / "sh" / "0.jsonl").write_text('{"text": "three"}\n')
    argv = ["prepare", "--data.input=a.parquet,sh", "--data.prepared_dir=p",
            "--model.vocab_size=300"]
    assert main(argv) == 0
    assert main(argv) == 0, capsys.readouterr().err
    assert "prepare: reusing p (3 documents" in capsys.readouterr().out
    manifest = json.loads((tmp_path / "p" / "prepare.json").read_text())
    root = tmp_path.resolve()
    assert manifest["key"]["input"] == f"{root / 'a.parquet'},{root / 'sh'}"
