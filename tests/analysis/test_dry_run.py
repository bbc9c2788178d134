"""`colonnade train --dry-run` (issue 14, item 13): validate, build on the meta device, report
parameters, layout, tokens per step, the planner's per-rank memory and the data; start, write
and prepare nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from colonnade.analysis.dry_run import meta_param_count
from colonnade.analysis.layout import Layout, Workload
from colonnade.analysis.memory import memory_per_device
from colonnade.cli import main
from colonnade.config import load_config, resolve
from colonnade.data.dataset import WindowDataset
from colonnade.data.indexed import IndexedDataset
from colonnade.models.counts import LayerShape, total_params
from colonnade.training.setup import prepare_data
from tests.reliability.jobs import REPO, tiny_args, write_corpus
from tests.workflow.cli import hashes

BIG = ["--config", str(REPO / "configs" / "llama2-70b.toml"), "--nproc", "8",
       "--parallel.tp=8"]


def test_dry_run_of_a_70b_preset_is_instant_and_writes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)  # runs/, checkpoints/, data/stdlib (built-in corpus) go here
    start = time.perf_counter()
    assert main(["train", *BIG, "--checkpoint.save=ck", "--dry-run"]) == 0
    assert time.perf_counter() - start < 20
    out = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []  # nothing written, nothing prepared
    cfg = resolve(load_config(REPO / "configs" / "llama2-70b.toml", ["--parallel.tp=8"]), 8)
    assert total_params(LayerShape.of(cfg.model)) == 68_976_648_192
    assert "68,976,648,192 parameters" in out
    assert "layout: tp8" in out and "on 8 rank(s)" in out
    tokens = int(cfg.training.global_batch_size or 0) * cfg.training.seq_len
    assert f"= {tokens:,} tokens per step" in out
    mem = memory_per_device(Workload.from_config(cfg), Layout.from_config(cfg, 8)).gib()
    for kind in ("params", "grads", "optimizer", "activations", "total"):
        assert f"{kind:<12} {mem[kind]:10.3f} GiB" in out
    assert mem["params"] == pytest.approx(68_976_648_192 / 8 * 2 / 2**30, rel=1e-3)  # bf16 / tp
    assert "train would prepare the built-in corpus" in out


def test_meta_build_counts_what_the_planner_counts() -> None:
    for preset in ("gpt2-124m", "llama3-8b"):
        cfg = load_config(REPO / "configs" / f"{preset}.toml", [])
        assert meta_param_count(cfg) == total_params(LayerShape.of(cfg.model))


def test_dry_run_reports_a_prepared_dataset(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    text = write_corpus(tmp_path / "text", docs=3, words=1200)
    prepared = tmp_path / "prep"
    args = tiny_args(text, prepared, tmp_path / "run", training__steps=50)
    prepare_data(load_config(None, args), log=False)
    before = hashes(tmp_path)
    no_input = [a for a in args if not a.startswith("--data.input")]
    assert main(["train", *no_input, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert hashes(tmp_path) == before and not (tmp_path / "run").exists()
    indexed = IndexedDataset(prepared / "data")
    train = WindowDataset(indexed, 16, "train", 0.02)
    assert len(indexed) == 3
    assert (f"{prepared}: 3 documents, {indexed.num_tokens:,} tokens; {len(train):,} training "
            "samples of 16 tokens per epoch") in out
    assert f"50 steps use 100 samples = {100 / len(train):.3g} epochs" in out
    assert main(["train", *args, "--dry-run"]) == 0  # with data.input: said, not done
    assert f"train would prepare {text} into {prepared} first" in capsys.readouterr().out
    assert hashes(tmp_path) == before


def test_dry_run_rejects_an_invalid_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", *BIG[:4], "--parallel.tp=3", "--dry-run"]) == 2
    assert "not divisible by parallel.tp=3" in capsys.readouterr().err
