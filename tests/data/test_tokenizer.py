"""Byte-level BPE tokenizer: training, exact round trip, EOD token, clear load errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from colonnade.data import (
    EOD_TOKEN,
    TokenizerError,
    eod_id,
    load_tokenizer,
    stdlib_files,
    train_bpe_tokenizer,
)

SOURCE = '''def greet(name: str) -> str:
    """Say hello — in ünïcödé, with emoji 🐍 and tabs\tinside."""
    return f"hello, {name}!"\r\n
class Box:
    value = [1, 2.5, 0x1F, None]  # comment
'''


@pytest.fixture(scope="module")
def corpus_files() -> list[Path]:
    """A few KB of Python source: the first small stdlib files."""
    return [p for p in stdlib_files(max_bytes=40_000) if p.stat().st_size < 8_000][:6]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory: pytest.TempPathFactory, corpus_files: list[Path]) -> Path:
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe_tokenizer(corpus_files, 300, out)
    return out


def test_train_saves_loadable_tokenizer(tok_path: Path) -> None:
    tok = load_tokenizer(tok_path)
    assert tok_path.is_file()
    assert 257 < tok.get_vocab_size() <= 300
    assert load_tokenizer(tok_path.parent).get_vocab_size() == tok.get_vocab_size()


def test_round_trip_python_source(tok_path: Path, corpus_files: list[Path]) -> None:
    tok = load_tokenizer(tok_path)
    for text in (SOURCE, corpus_files[0].read_text()):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    # merges compress source: fewer tokens than bytes
    src = corpus_files[0].read_text()
    assert len(tok.encode(src).ids) < 0.8 * len(src.encode())


def test_eod_is_single_special_token(tok_path: Path) -> None:
    tok = load_tokenizer(tok_path)
    eod = eod_id(tok)
    assert tok.id_to_token(eod) == EOD_TOKEN
    assert tok.encode(f"a{EOD_TOKEN}b").ids.count(eod) == 1


def test_training_is_deterministic(
    tmp_path: Path, corpus_files: list[Path], tok_path: Path
) -> None:
    again = tmp_path / "again.json"
    train_bpe_tokenizer(corpus_files, 300, again)
    assert again.read_text() == tok_path.read_text()


def test_load_missing_and_corrupt(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"nope\.json: tokenizer file not found"):
        load_tokenizer(tmp_path / "nope.json")
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match=r"not a valid tokenizer\.json"):
        load_tokenizer(bad)


def test_eod_missing_and_vocab_too_small(tmp_path: Path, corpus_files: list[Path]) -> None:
    from tokenizers import Tokenizer, models

    with pytest.raises(TokenizerError, match="end-of-document"):
        eod_id(Tokenizer(models.BPE()))
    with pytest.raises(TokenizerError, match=r"vocab_size=100 is too small.*at least 257"):
        train_bpe_tokenizer(corpus_files, 100, tmp_path / "t.json")


def test_model_dir_without_tokenizer_json_names_the_conversion(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").write_bytes(b"sp")
    with pytest.raises(TokenizerError, match=r"holds tokenizer\.model but no tokenizer\.json.*"
                       r"save_pretrained"):
        load_tokenizer(tmp_path)
