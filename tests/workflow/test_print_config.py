"""``colonnade train --print-config`` prints a config that runs with any ``--nproc``: it needs no
``--nproc`` whatever the degrees, leaves the fields derived from the number of ranks unset (it
pinned ``dp = 1``, so the text failed with ``--nproc 4``), and the printed TOML loads, trains
with ``--nproc 1`` and validates with other rank counts."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from colonnade.cli import main
from colonnade.config import load_config, problems, resolve, validate
from tests.reliability.jobs import tiny_args

TP2 = ["--parallel.tp=2", "--model.hidden_size=32", "--model.num_heads=4"]


def test_print_config_needs_no_nproc_and_leaves_derived_fields_unset(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["train", "--print-config", *TP2]) == 0
    text = capsys.readouterr().out
    data = tomllib.loads(text)
    assert data["parallel"]["tp"] == 2
    assert "dp" not in data["parallel"]
    assert "microbatches" not in data["training"]
    assert "global_batch_size" not in data["training"]
    path = tmp_path / "tp2.toml"
    path.write_text(text)
    config = load_config(path)
    assert [validate(resolve(config, world), world).parallel.dp for world in (2, 4, 8)] == [
        1, 2, 4]
    assert problems(resolve(config, 3), 3) == [
        "world size 3 is not a multiple of parallel.tp=2 x pp=1 x cp=1 = 2 (dp = world / 2; "
        "ep does not multiply it); change the degrees or the number of ranks (--nproc)."]


def test_print_config_with_nproc_checks_it_and_shows_the_derived_values_as_a_comment(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--print-config", "--nproc", "4", *TP2]) == 0
    text = capsys.readouterr().out
    assert text.rstrip().splitlines()[-1] == (
        "# derived for 4 rank(s), left unset above so that this config runs with any --nproc: "
        "parallel.dp = 2, training.microbatches = 1, training.global_batch_size = 8")
    assert "dp" not in tomllib.loads(text)["parallel"]
    assert main(["train", "--print-config", "--nproc", "3", *TP2]) == 2
    assert "world size 3 is not a multiple of parallel.tp=2" in capsys.readouterr().err


def test_printed_config_trains_with_nproc_1_and_validates_with_4(
        corpus: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, prepared = corpus
    run = tmp_path / "run"
    assert main(["train", "--print-config",
                 *tiny_args(text, prepared, run, training__steps=2)]) == 0
    path = tmp_path / "tiny.toml"
    path.write_text(capsys.readouterr().out)
    assert main(["train", "--config", str(path), "--nproc", "1"]) == 0
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    capsys.readouterr()
    assert main(["train", "--config", str(path), "--nproc", "4", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "on 4 rank(s)" in out and "batch: global 8 x seq 16" in out, out  # dp 4 x micro 2
