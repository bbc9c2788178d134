"""Errors of multi-rank runs are one clean line (issue 14, item 8): bad launch arguments are
named as such, a damaged dataset is caught before launch, and a damaged checkpoint found
inside the ranks is reported once by the launcher, with no torchelastic traceback."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from colonnade.cli import main
from tests.reliability.jobs import tiny_args, write_corpus
from tests.workflow.cli import hashes, run_cli


def test_nproc_0_names_the_launch_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--nproc", "0"]) == 2
    err = capsys.readouterr().err
    assert "--nproc=0 must be >= 1" in err, err
    assert "parallel.dp" not in err, err


def _one_clean_line(out: str, start: str) -> None:
    lines = [line for line in out.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("colonnade: ") and "Error" in line]
    assert len(errors) == 1 and errors[0].startswith(start), out
    assert "Traceback" not in out and "ProcessExitedException" not in out, out
    assert "likely cause" not in out, out


def test_damaged_dataset_fails_before_launch(corpus: tuple[Path, Path], tmp_path: Path) -> None:
    prepared = tmp_path / "prepared"
    shutil.copytree(corpus[1], prepared)
    data = (prepared / "data.bin").read_bytes()
    (prepared / "data.bin").write_bytes(data[:-6])
    before = hashes(prepared)
    args = [a for a in tiny_args(*corpus, tmp_path / "run") if not a.startswith("--data.")]
    status, out = run_cli(["train", "--nproc", "2", *args, f"--data.prepared_dir={prepared}"])
    assert status == 2, out
    _one_clean_line(out, "colonnade: IndexedDatasetError: ")
    assert "data.bin: size" in out and "heartbeat" not in out
    assert hashes(prepared) == before
    assert not (tmp_path / "run").exists()  # no rank started


def test_damaged_checkpoint_in_the_ranks_is_one_line(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    assert main(["train", *tiny_args(*corpus, tmp_path / "run_a", training__steps=2,
                                     checkpoint__save=ckpt)]) == 0
    capsys.readouterr()
    shard = next((ckpt / "step_00000002").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:100])
    status, out = run_cli(["train", "--nproc", "2",
                           *tiny_args(*corpus, tmp_path / "run_b", parallel__tp=2,
                                      training__steps=4, checkpoint__load=ckpt,
                                      checkpoint__lr_schedule="checkpoint")])
    assert status == 2, out
    _one_clean_line(out, "colonnade: CheckpointError: ")
    assert "rank-00000.safetensors" in out and "truncated or corrupted" in out, out


def test_bad_input_of_a_multi_rank_run_is_one_line_before_launch(tmp_path: Path) -> None:
    text = write_corpus(tmp_path / "text", docs=2, words=300)
    (text / "notes.txt").write_bytes("caf\xe9 cr\xe8me\n".encode("latin-1"))
    status, out = run_cli(["train", "--nproc", "2",
                           *tiny_args(text, tmp_path / "prepared", tmp_path / "run")])
    assert status == 2, out
    _one_clean_line(out, "colonnade: ")
    assert str(text / "notes.txt") in out and "UTF-8" in out, out
    assert not (tmp_path / "run").exists()  # no rank started
