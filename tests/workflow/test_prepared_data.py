"""`train` prepares only what it is told to, and a rejected run changes no file (issue 14,
items 1 and 4): a prepared dir is used as it is without data.input, a missing one is an error
naming the fix, one built from other inputs is never overwritten unless data.overwrite, and a
tokenizer that does not fit model.vocab_size (or tp > vocab) is refused before any file is
touched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from colonnade.cli import main
from colonnade.config.load import load_config
from colonnade.config.validate import problems, resolve
from tests.reliability.jobs import tiny_args, write_corpus
from tests.workflow.cli import hashes


def _without_input(args: list[str]) -> list[str]:
    # a small built-in corpus cap so the old behaviour (re-prepare from stdlib) fails fast
    return [a for a in args if not a.startswith("--data.input=")] + [
        "--data.max_corpus_bytes=100000"]


def _recorded_input(prepared: Path) -> str | None:
    return json.loads((prepared / "prepare.json").read_text())["key"]["input"]


def test_train_without_input_uses_the_prepared_dir_as_is(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, source = corpus
    prepared = tmp_path / "mine"
    shutil.copytree(source, prepared)
    before = hashes(prepared)
    status = main(["train", *_without_input(tiny_args(text, prepared, tmp_path / "run",
                                                      training__steps=2))])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert hashes(prepared) == before  # not re-prepared from the built-in corpus
    assert _recorded_input(prepared) == str(text.resolve())
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count('"step"') == 2


def test_missing_prepared_dir_is_an_error_naming_the_fix(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    typo = tmp_path / "data" / "mnie"
    status = main(["train", *_without_input(tiny_args(corpus[0], typo, tmp_path / "run"))])
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"data.prepared_dir='{typo}' holds no prepared dataset" in err, err
    assert "colonnade prepare --data.input=" in err and "--data.input=" in err, err
    assert not typo.exists() and not (tmp_path / "run").exists()  # nothing created


def test_other_inputs_are_refused_unless_overwrite(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, source = corpus
    prepared = tmp_path / "mine"
    shutil.copytree(source, prepared)
    before = hashes(prepared)
    other = write_corpus(tmp_path / "other", docs=2, words=400, seed=7)
    for command in ("prepare", "train"):
        status = main([command, *tiny_args(other, prepared, tmp_path / "run")])
        err = capsys.readouterr().err
        assert status == 2, (command, err)
        assert f"prepared from '{text.resolve()}'" in err and "--data.overwrite=true" in err, err
        assert hashes(prepared) == before, command
    status = main(["prepare", *tiny_args(other, prepared, tmp_path / "run"),
                   "--data.overwrite=true"])
    assert status == 0, capsys.readouterr().err
    assert _recorded_input(prepared) == str(other.resolve())
    assert hashes(prepared)["data.bin"] != before["data.bin"]


def test_rejected_vocab_changes_no_file(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tokenizer of 300 tokens with model.vocab_size=200: refused before prepare runs (it used
    to delete prepare.json first, forcing a re-tokenize)."""
    text, source = corpus
    prepared = tmp_path / "mine"
    shutil.copytree(source, prepared)
    tok = shutil.copy(prepared / "tokenizer.json", tmp_path / "tok.json")
    before = hashes(prepared)
    for args in (tiny_args(text, prepared, tmp_path / "run", data__tokenizer=tok),
                 _without_input(tiny_args(text, prepared, tmp_path / "run"))):
        status = main(["train", *args, "--model.vocab_size=200"])
        err = capsys.readouterr().err
        assert status == 2, err
        assert "300 tokens but model.vocab_size=200" in err, err
        assert "--model.vocab_size=300" in err, err
        assert hashes(prepared) == before
    assert not (tmp_path / "run").exists()


def test_tp_larger_than_vocab_is_rejected_before_launch() -> None:
    config = load_config(None, ["--parallel.tp=4", "--model.vocab_size=3",
                                "--model.num_heads=4", "--model.hidden_size=32"])
    found = problems(resolve(config, 4), 4)
    assert any("parallel.tp=4 exceeds model.vocab_size=3" in p for p in found), found
