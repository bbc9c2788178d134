"""Intra-op CPU threads of a rank (training/setup.py): training.cpu_threads, then
OMP_NUM_THREADS, then the share of the cores the machine's load leaves free; a warning when a
node's ranks x threads exceed its cores. ``cores // local_ranks`` ignored OMP_NUM_THREADS and
the load: one process on a loaded 2-core machine ran 2 threads and crawled."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from colonnade.config import load_config, problems
from colonnade.training import setup
from tests.reliability.jobs import tiny_args


@pytest.mark.parametrize(("configured", "omp", "cores", "ranks", "load", "threads"), [
    (None, None, 2, 1, 0.1, 2),    # an idle 2-core machine: both cores
    (None, None, 2, 1, 1.0, 1),    # one busy process beside it: one thread
    (None, None, 2, 1, 15.0, 1),   # very busy: still one
    (None, None, 16, 4, 0.0, 4),   # a node's cores shared by its ranks
    (None, None, 16, 4, 8.0, 2),   # ... and by the load
    (None, None, 16, 3, 0.0, 5),
    (None, None, 2, 8, 0.0, 1),    # more ranks than cores: one each
    (None, "1", 16, 1, 0.0, 1),    # OMP_NUM_THREADS (torchrun sets 1)
    (None, "6,2", 16, 1, 0.0, 6),  # nested OpenMP: the outer count
    (None, "x", 2, 1, 0.0, 2),     # not a count: ignored
    (3, "1", 2, 1, 15.0, 3),       # training.cpu_threads wins
])
def test_thread_count_rules(configured: int | None, omp: str | None, cores: int, ranks: int,
                            load: float, threads: int) -> None:
    assert setup.cpu_threads(configured, omp, cores, ranks, load) == threads


def _runtime_threads(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cores: int,
                     local_ranks: int, *extra: str) -> int:
    monkeypatch.setattr(setup, "_cores", lambda: cores)
    monkeypatch.setattr(setup, "_load", lambda: 0.0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    before = torch.get_num_threads()
    try:
        args = [*tiny_args(tmp_path / "text", tmp_path / "p", tmp_path / "run"), *extra]
        setup.init_runtime(load_config(None, [a for a in args if "data.input" not in a]))
        return torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_omp_num_threads_and_the_config_field_are_respected(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _runtime_threads(monkeypatch, tmp_path, 16, 1) == 1
    assert _runtime_threads(monkeypatch, tmp_path, 16, 1, "--training.cpu_threads=3") == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert _runtime_threads(monkeypatch, tmp_path, 16, 4) == 4
    config = load_config(None, ["--training.cpu_threads=0"])
    assert problems(config) == ["training.cpu_threads=0 must be >= 1."]


def test_more_ranks_than_cores_is_warned_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _runtime_threads(monkeypatch, tmp_path, 2, 8) == 1
    assert capsys.readouterr().err.splitlines() == [
        "colonnade: warning: 8 rank(s) x 1 CPU thread(s) = 8 threads on 2 cores: they take "
        "turns on the cores, so every step is slower than it would be with fewer; use "
        "--nproc <= 2 unless the layout itself is what you are testing."]
    monkeypatch.setenv("LOCAL_RANK", "1")  # the node's other ranks say nothing
    assert _runtime_threads(monkeypatch, tmp_path, 2, 8) == 1
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert _runtime_threads(monkeypatch, tmp_path, 2, 2) == 1
    assert capsys.readouterr().err == ""
