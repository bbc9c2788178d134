"""A prepared dir is never rebuilt into another dataset unless data.overwrite (issue 35, items 1
and 9): another tokenizer (either way), BPE vocab size, text key or format is refused as another
input is, naming the difference; per-source text keys ('a.jsonl,b.parquet:body')."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from colonnade.cli import main
from colonnade.config.load import load_config
from colonnade.config.validate import problems
from colonnade.data import IndexedDataset
from tests.data.test_prepare_cli import _model_dir
from tests.workflow.cli import hashes


def _records(path: Path, key: str = "text") -> Path:
    rows = [{key: f"hello w{i} w{i + 1}", "prompt": "q", "response": "a"} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prepare(data: Path, out: Path, *extra: str) -> list[str]:
    return ["prepare", f"--data.input={data}", f"--data.prepared_dir={out}", *extra]


def test_other_tokenizer_vocab_key_or_format_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model_dir(tmp_path)
    data = _records(tmp_path / "stories.jsonl")
    hf, bpe = tmp_path / "hf", tmp_path / "bpe"
    assert main(_prepare(data, hf, f"--data.tokenizer={model}")) == 0
    assert main(_prepare(data, bpe, "--model.vocab_size=300")) == 0
    capsys.readouterr()
    refused = [
        (_prepare(data, hf, "--model.vocab_size=300"),  # the issue: HF -> BPE rewrote it
         f"holds a dataset prepared with the tokenizer {model.resolve()} (given with "
         "data.tokenizer, 3000 tokens), where this run would train a byte-level BPE "
         "(vocab_size=300, model.vocab_size) as data.tokenizer is unset (to reuse it, pass "
         f"--data.tokenizer={model.resolve()})"),
        (_prepare(data, bpe, f"--data.tokenizer={model}"),  # the reverse
         "holds a dataset prepared with a byte-level BPE it trained (vocab_size=300, "),
        (_prepare(data, bpe, "--model.vocab_size=280"),
         ", where this run would train a byte-level BPE (vocab_size=280, model.vocab_size)"),
        (_prepare(data, bpe, "--model.vocab_size=300", "--data.text_key=prompt"),
         f"holds a dataset prepared reading the text of {data.resolve()} under key 'text', "
         "where this run reads 'prompt'"),
        (_prepare(data, bpe, "--model.vocab_size=300", "--data.format=sft"),
         "holds a dataset prepared as data.format='text', where this run asks "
         "data.format='sft'"),
    ]
    before = {d: hashes(d) for d in (hf, bpe)}
    for argv, expected in refused:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert expected in err, (argv, err)
        assert err.rstrip().endswith("or set --data.overwrite=true to rebuild it (replacing "
                                     "that dataset)."), err
        assert {d: hashes(d) for d in (hf, bpe)} == before, argv
    assert main(_prepare(data, hf, "--model.vocab_size=300", "--data.overwrite=true")) == 0
    out = capsys.readouterr().out
    assert f"prepare: data.overwrite=true: rebuilding {hf}, which holds a dataset prepared " \
           f"with the tokenizer {model.resolve()}" in out, out
    assert json.loads((hf / "prepare.json").read_text())["tokenizer"] is None


def test_changed_input_files_rebuild_and_say_why(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _records(tmp_path / "stories.jsonl")
    out = tmp_path / "p"
    assert main(_prepare(data, out, "--model.vocab_size=300")) == 0
    with data.open("a") as fh:
        fh.write(json.dumps({"text": "one more"}) + "\n")
    capsys.readouterr()
    assert main(_prepare(data, out, "--model.vocab_size=300")) == 0
    said = capsys.readouterr().out
    assert f"prepare: {out} was built before the input files changed (sizes or modification " \
           "times); tokenizing again" in said, said
    assert len(IndexedDataset(out / "data")) == 5


def test_per_source_text_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model_dir(tmp_path)
    a = tmp_path / "a.jsonl"
    a.write_text(json.dumps({"text": "hello w1"}) + "\n")
    pq.write_table(pa.table({"body": ["w2 w3", "w4"], "id": [1, 2]}), tmp_path / "b.parquet")
    out = tmp_path / "p"
    spec = f"{a},{tmp_path / 'b.parquet'}:body"
    assert main(_prepare(Path(spec), out, f"--data.tokenizer={model}")) == 0
    eod, hello, w = 2, 3, 4
    assert np.asarray(IndexedDataset(out / "data").tokens).tolist() == [
        hello, w + 1, eod, w + 2, w + 3, eod, w + 4, eod]
    manifest = json.loads((out / "prepare.json").read_text())
    root = tmp_path.resolve()
    assert manifest["key"]["input"] == f"{root / 'a.jsonl'},{root / 'b.parquet'}:body"
    assert manifest["text_keys"] == {str(root / "a.jsonl"): "text",
                                     str(root / "b.parquet"): "body"}
    capsys.readouterr()
    assert main(_prepare(Path(spec), out, f"--data.tokenizer={model}")) == 0
    assert f"prepare: reusing {out} (3 documents" in capsys.readouterr().out
    other = f"{a},{tmp_path / 'b.parquet'}:id"
    assert main(_prepare(Path(other), out, f"--data.tokenizer={model}")) == 2
    assert (f"reading the text of {root / 'b.parquet'} under key 'body', where this run reads "
            "'id'") in capsys.readouterr().err


def test_per_source_keys_are_checked_up_front(tmp_path: Path) -> None:
    from colonnade.config.data_paths import input_sources

    colon = tmp_path / "odd:name.jsonl"  # an existing path holding ':' is taken whole
    colon.write_text("{}\n")
    assert input_sources(str(colon)) == [(str(colon), None)]
    assert input_sources(f"{colon}:body") == [(str(colon), "body")]
    assert input_sources("C:/x.jsonl,y.csv:col") == [("C:/x.jsonl", None), ("y.csv", "col")]

    def found(*args: str) -> list[str]:
        return [p for p in problems(load_config(None, list(args))) if "data." in p]

    assert found(f"--data.input={colon}:body") == []
    assert found(f"--data.input={colon}:") == [
        f"data.input part '{colon}:' has an empty text key after ':'; write '{colon}:KEY' "
        "(KEY: the field or column holding its text) or drop the ':'."]
    assert found(f"--data.input={colon}:body", "--data.format=sft") == [
        f"data.input parts {colon}:body name a text key, which only data.format='text' reads; "
        "data.format='sft' reads data.prompt_key / data.response_key: drop the ':KEY' "
        "suffixes."]
    missing = found(f"--data.input={tmp_path / 'nope.jsonl'}:body")
    assert f"(read as '{tmp_path / 'nope.jsonl'}:body': path, then the ':key' suffix" \
        in missing[0]
    (tmp_path / "notes.txt").write_text("a note")
    assert main(_prepare(Path(f"{tmp_path / 'notes.txt'}:body"), tmp_path / "p",
                         "--model.vocab_size=300")) == 2
    assert not (tmp_path / "p").exists()


def test_a_wrong_key_suffix_is_named_as_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A ':KEY' suffix that names no field gets the suffix as its fix, not data.text_key."""
    a = _records(tmp_path / "a.jsonl", key="body")
    pq.write_table(pa.table({"body": ["w2 w3"], "id": [1]}), tmp_path / "b.parquet")
    spec = f"{a}:nope,{tmp_path / 'b.parquet'}:nope,{a}"
    assert main(_prepare(Path(spec), tmp_path / "p", "--model.vocab_size=300")) == 2
    err = capsys.readouterr().err
    assert (f"  - {a}:1: no string under key 'nope' (keys: body, prompt, response); fix the "
            "':KEY' suffix of its data.input part or fix the record\n"
            f"  - {tmp_path / 'b.parquet'}: no column 'nope' (columns: body, id); write "
            "':body', not ':nope', after its data.input part\n"
            f"  - {a}:1: no string under key 'text' (keys: body, prompt, response); set "
            "data.text_key or fix the record\n") in err, err


def test_unset_vocab_reuses_the_bpe_of_the_same_input(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """model.vocab_size unset asks for no size: a re-run reuses the BPE already built from
    this input (it was refused as 'vocab_size=2048, where the dir holds 300')."""
    data = _records(tmp_path / "stories.jsonl")
    out = tmp_path / "p"
    assert main(_prepare(data, out, "--model.vocab_size=300")) == 0
    capsys.readouterr()
    assert main(_prepare(data, out)) == 0
    assert f"prepare: reusing {out} (4 documents" in capsys.readouterr().out
    other = _records(tmp_path / "other.jsonl", key="body")
    assert main(_prepare(other, out, "--data.text_key=body", "--data.overwrite=true")) == 0
    assert json.loads((out / "prepare.json").read_text())["key"]["vocab_size"] == 2048


def test_other_sft_keys_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _records(tmp_path / "chat.jsonl")
    out = tmp_path / "p"
    assert main(_prepare(data, out, "--model.vocab_size=300", "--data.format=sft")) == 0
    capsys.readouterr()
    before = hashes(out)
    assert main(_prepare(data, out, "--model.vocab_size=300", "--data.format=sft",
                         "--data.prompt_key=text")) == 2
    assert ("holds a dataset prepared with data.prompt_key='prompt', data.response_key="
            "'response', where this run reads 'text', 'response'; refusing to overwrite it."
            ) in capsys.readouterr().err
    assert hashes(out) == before


def test_a_changed_chat_template_rebuilds_and_says_why(tmp_path: Path) -> None:
    """SFT chat records rendered with the tokenizer's template are tokenized again when the
    template changed - and the log says so (it rebuilt silently)."""
    from colonnade.data.sft import prepare_sft
    from tests.data.test_sft_chat import BUILTIN_CHAT_TEMPLATE, CONVERSATIONS, chat_tokenizer

    chat_tokenizer(tmp_path / "tok")
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    out, logged = tmp_path / "p", []
    prepare_sft(src, out, None, tmp_path / "tok", progress=False, log=logged.append)
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": BUILTIN_CHAT_TEMPLATE, "eos_token": "<|im_end|>"}))
    logged.clear()
    assert not prepare_sft(src, out, None, tmp_path / "tok", progress=False,
                           log=logged.append).reused
    assert logged[0] == (f"prepare: {out} was built before the tokenizer's "
                         "tokenizer_config.json (special tokens, chat template) changed; "
                         "tokenizing again")
