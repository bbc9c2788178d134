"""training.memory_limit_gb (issue 16): a run whose memory-model estimate exceeds the per-rank
limit is refused before anything is written or started, with the estimate, the limit and what
would fit (the smallest cp first), each computed by the same model."""

from __future__ import annotations

from pathlib import Path

import pytest

from colonnade.analysis.hardware import GIB
from colonnade.analysis.layout import Layout
from colonnade.analysis.memory_limit import check_memory_limit, estimate, fits, limit_problem
from colonnade.cli import main
from colonnade.config import load_config, resolve
from colonnade.config.load import ConfigError
from tests.reliability.jobs import tiny_args, write_corpus
from tests.workflow.cli import hashes


def _args(tmp_path: Path) -> list[str]:
    text = write_corpus(tmp_path / "text", docs=2, words=200)
    return tiny_args(text, tmp_path / "prep", tmp_path / "run", model__max_seq_len=1024,
                     training__seq_len=1024, training__micro_batch_size=2)


def _gib(args: list[str], world: int, *extra: str) -> float:
    cfg = resolve(load_config(None, [*args, *extra]), world)
    return estimate(cfg, world)[2].total / GIB


def test_a_run_over_the_limit_is_refused_before_anything_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    args = _args(tmp_path)
    one, two = _gib(args, 1), _gib(args, 2, "--parallel.cp=2")
    assert two < 0.65 * one  # activations dominate this tiny model at s = 1024: ~1/2
    limit = round((one + two) / 2, 6)
    before = hashes(tmp_path)
    assert main(["train", *args, f"--training.memory_limit_gb={limit}"]) == 2
    err = capsys.readouterr().err
    assert hashes(tmp_path) == before and not (tmp_path / "run").exists()
    assert not (tmp_path / "prep").exists()  # nothing prepared either
    assert f"training.memory_limit_gb={limit:g}: this run needs an estimated {one:.3g} GiB" in err
    assert f"--parallel.cp=2 ({two:.3g} GiB per rank, on 2 ranks)" in err
    assert "--training.micro_batch_size=1 --training.microbatches=2" in err
    assert "raise training.memory_limit_gb" in err
    # the dry run says the same without refusing
    assert main(["train", *args, f"--training.memory_limit_gb={limit}", "--dry-run"]) == 0
    assert "memory limit: train would refuse this run" in capsys.readouterr().out
    assert main(["train", *args, "--nproc", "2", "--parallel.cp=2",
                 f"--training.memory_limit_gb={limit}", "--dry-run"]) == 0
    assert f"the estimate {two:.3g} GiB fits" in capsys.readouterr().out


def test_the_fits_are_computed_by_the_same_model(tmp_path: Path) -> None:
    args = _args(tmp_path)
    cfg = resolve(load_config(None, args), 1)
    w, lay, mem = estimate(cfg, 1)
    # a limit only cp 4 (or recompute + micro-batch together) meets: cp listed first, smallest
    four = _gib(args, 4, "--parallel.cp=4")
    options = fits(w, lay, four * GIB * 1.0001)
    assert options[0].flags == "--parallel.cp=4" and options[0].total_gib == pytest.approx(four)
    assert all(o.total_gib <= four * 1.0001 for o in options)
    # within the limit: no problem; unset: no check at all
    ok = resolve(load_config(None, [*args, f"--training.memory_limit_gb={mem.total / GIB * 2}"]),
                 1)
    assert limit_problem(ok, 1) is None and limit_problem(cfg, 1) is None
    check_memory_limit(ok, 1)
    tight = resolve(load_config(None, [*args, "--training.memory_limit_gb=1e-6"]), 1)
    with pytest.raises(ConfigError, match=r"Nothing tried fits \(parallel\.cp up to seq_len/2"):
        check_memory_limit(tight, 1)
    assert Layout.from_config(cfg, 1).cp == 1
