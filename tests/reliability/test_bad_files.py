"""Bad files through `colonnade prepare` / `colonnade train`: one clear error line, exit 2, and
every file involved left byte-for-byte as it was.

Cases: a truncated .bin, an .idx with a wrong magic and one with a wrong format version (both
as a data.blend dataset), a non-UTF-8 input file (prepare, and train which prepares), and a
checkpoint written by another model (train --checkpoint.load, with checkpoint.save pointing at
the same directory).
"""

from __future__ import annotations

import hashlib
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from colonnade.cli import main
from colonnade.config.load import load_config
from colonnade.training.loop import train
from tests.reliability.jobs import tiny_args, write_corpus


def _hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _copy_dataset(prepared: Path, where: Path) -> Path:
    where.mkdir(parents=True)
    for suffix in (".bin", ".idx"):
        shutil.copy(prepared / f"data{suffix}", where / f"data{suffix}")
    return where / "data"


def _truncate_bin(prefix: Path) -> None:
    data = prefix.with_suffix(".bin").read_bytes()
    prefix.with_suffix(".bin").write_bytes(data[:-6])


def _wrong_magic(prefix: Path) -> None:
    idx = bytearray(prefix.with_suffix(".idx").read_bytes())
    idx[:8] = b"NOTANIDX"
    prefix.with_suffix(".idx").write_bytes(bytes(idx))


def _wrong_version(prefix: Path) -> None:
    idx = bytearray(prefix.with_suffix(".idx").read_bytes())
    idx[8:12] = struct.pack("<I", 99)
    prefix.with_suffix(".idx").write_bytes(bytes(idx))


@pytest.mark.parametrize(("damage", "expected"), [
    (_truncate_bin, ["IndexedDatasetError", "data.bin: size", "truncated"]),
    (_wrong_magic, ["IndexedDatasetError", "data.idx: wrong magic", "not a Colonnade index"]),
    (_wrong_version, ["IndexedDatasetError", "data.idx: format version 99 is not supported"]),
], ids=["truncated_bin", "idx_wrong_magic", "idx_wrong_version"])
def test_damaged_dataset_is_a_clear_error(corpus: tuple[Path, Path], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str],
                                          damage: Callable[[Path], None],
                                          expected: list[str]) -> None:
    prefix = _copy_dataset(corpus[1], tmp_path / "bad")
    damage(prefix)
    before = _hashes(tmp_path / "bad")
    prepared_before = _hashes(corpus[1])
    status = main(["train", *tiny_args(*corpus, tmp_path / "run", training__steps=2,
                                       data__blend=f"1.0:{prefix}")])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("colonnade: IndexedDatasetError: ") and str(prefix.parent) in err, err
    for part in expected:
        assert part in err, (part, err)
    assert _hashes(tmp_path / "bad") == before
    assert _hashes(corpus[1]) == prepared_before


def _latin1_corpus(where: Path) -> Path:
    write_corpus(where, docs=2, words=300)
    (where / "notes.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e\n".encode("latin-1"))
    return where


def test_non_utf8_input_fails_prepare_and_train_without_touching_data(
        corpus: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    text = _latin1_corpus(tmp_path / "text")
    prepared = tmp_path / "prepared"
    shutil.copytree(corpus[1], prepared)  # an existing prepared dataset in the output directory
    keep = {k: v for k, v in _hashes(prepared).items() if k != "prepare.json"}
    for command in ("prepare", "train"):
        status = main([command, *tiny_args(text, prepared, tmp_path / "run",
                                           training__steps=2, data__overwrite="true")])
        err = capsys.readouterr().err
        assert status == 2, (command, err)
        assert err.startswith("colonnade: CorpusError: "), err
        assert str(text / "notes.txt") in err and "UTF-8" in err, err
        now = _hashes(prepared)
        assert {k: now.get(k) for k in keep} == keep, command  # data and tokenizer untouched


def test_checkpoint_of_another_model_is_refused_and_kept(
        corpus: tuple[Path, Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    train(load_config(None, tiny_args(*corpus, tmp_path / "run_a", training__steps=2,
                                      checkpoint__save=ckpt)))
    capsys.readouterr()
    before = _hashes(ckpt)
    status = main(["train", *tiny_args(*corpus, tmp_path / "run_b", training__steps=2,
                                       model__hidden_size=48, checkpoint__load=ckpt,
                                       checkpoint__save=ckpt)])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith("colonnade: CheckpointError: "), err
    assert "48" in err and "32" in err, err  # the two shapes are named
    assert _hashes(ckpt) == before
