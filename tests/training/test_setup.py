"""Start-up: data preparation outside the collective timeout, CPU threads on every device.

Preparation: on 2 gloo ranks whose groups have a 0.25 s collective timeout while the data is
built (as ``parallel.timeout_s`` sets it in a run), rank 0's preparation lasts 1 s after rank 1
began to wait for it; rank 1 waits on the store, not in a collective, so the run's data is built
on both ranks (before the fix rank 1 failed in a barrier after the timeout). A failing
preparation on rank 0 (at once, rank 1 already waiting) is re-raised on rank 1 as a
DataError naming it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from colonnade.config.load import load_config
from colonnade.config.validate import resolve, validate
from colonnade.data import DataError
from colonnade.parallel.dims import ParallelDims
from colonnade.parallel.groups import GROUP_NAMES, ProcessGroups
from colonnade.training import setup
from tests.reliability.jobs import tiny_args, write_corpus

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`

TIMEOUT_S = 0.25
SLOW_S = 1.0
BACKSTOP_S = 300.0  # outside the window that is under test


def _set_timeouts(groups: ProcessGroups, seconds: float) -> None:
    """The collective timeout of every process group of ``groups`` (the default one too)."""
    pgs = {id(pg): pg for pg in (getattr(groups, n).pg for n in ("world", *GROUP_NAMES))
           if pg is not None}
    for pg in pgs.values():
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), pg)


def _slow_prepare(args: list[str], fail: bool, key: str) -> dict[str, Any]:
    """Build the run's data on 2 ranks with rank 0's preparation slowed (or failing).

    Ordered by store keys: the groups are made, and later used, under a long timeout; only
    while the data is built is it ``TIMEOUT_S``. Rank 1 sets that, notes its start and says so
    (``key``); rank 0's preparation begins only then and lasts ``SLOW_S`` more, so rank 1's
    wait is >= ``SLOW_S`` > 2 ``TIMEOUT_S`` for every interleaving (a stall only lengthens
    it). A collective in rank 1's wait would have to outlast that timeout: it would fail,
    unless rank 1 itself were stalled for nearly all of ``SLOW_S`` between its note and that
    collective; the correct wait (the store) has no timeout to exceed.
    """
    config = load_config(None, args)
    config = validate(resolve(config, 2), 2)
    groups = ProcessGroups.build(ParallelDims(dp=2), BACKSTOP_S)
    store = dist.distributed_c10d._get_default_store()
    real = setup.prepare_data

    def slow(cfg: Any, log: bool = True, say_reuse: bool = True) -> Path:
        if groups.rank == 0:
            store.wait([key])  # rank 1 is waiting for the preparation
            if fail:
                raise DataError("the corpus is unreadable")
            time.sleep(SLOW_S)  # a duration, not a race: it only has to be long enough
        return real(cfg, log=False)

    setup.prepare_data = slow  # type: ignore[assignment]
    _set_timeouts(groups, TIMEOUT_S)
    start = time.monotonic()
    if groups.rank == 1:
        store.set(key, "waiting")
    try:
        data = setup.build_data(config, groups)
    except DataError as err:
        return {"error": str(err), "waited": time.monotonic() - start}
    finally:
        setup.prepare_data = real  # type: ignore[assignment]
        _set_timeouts(groups, BACKSTOP_S)
    waited = time.monotonic() - start
    t = torch.tensor([1.0])
    groups.world.all_reduce(t)  # the group still works after the wait
    return {"train": len(data.train), "vocab": data.vocab_size, "sum": float(t),
            "waited": waited}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("text"), docs=2, words=300)


def test_slow_preparation_outlives_the_collective_timeout(
        run_ranks: Callable[..., list[Any]], corpus: Path, tmp_path: Path) -> None:
    args = tiny_args(corpus, tmp_path / "prepared", tmp_path / "run", parallel__dp=2)
    r0, r1 = run_ranks(2, _slow_prepare, args, False, f"waiting-{time.monotonic_ns()}")
    assert "error" not in r1, r1
    assert r1["waited"] >= SLOW_S > 2 * TIMEOUT_S  # waited past the timeout, and survived
    assert r0["train"] == r1["train"] > 0 and r0["vocab"] == r1["vocab"] > 0
    assert r0["sum"] == r1["sum"] == 2.0
    assert (tmp_path / "prepared" / "prepare.json").is_file()


def test_failed_preparation_on_rank0_is_named_on_the_others(
        run_ranks: Callable[..., list[Any]], corpus: Path, tmp_path: Path) -> None:
    args = tiny_args(corpus, tmp_path / "prepared", tmp_path / "run", parallel__dp=2)
    r0, r1 = run_ranks(2, _slow_prepare, args, True, f"waiting-{time.monotonic_ns()}")
    assert r0["error"] == "the corpus is unreadable"
    assert r1["error"].startswith("rank 0 failed to prepare data.input"), r1
    assert "DataError: the corpus is unreadable" in r1["error"]
    assert not (tmp_path / "prepared").exists()


def test_cpu_threads_are_limited_on_gpu_runs_too(monkeypatch: pytest.MonkeyPatch,
                                                 corpus: Path, tmp_path: Path) -> None:
    """A (pretend) CUDA rank, one of 4 on a 16-core node, gets 4 threads (it kept all 16)."""
    monkeypatch.setattr(setup, "pick_device", lambda _name, _local: torch.device("cuda", 0))
    monkeypatch.setattr(setup, "_cores", lambda: 16)
    monkeypatch.setattr(setup, "_load", lambda: 0.0)  # an idle node
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(16)
        rt = setup.init_runtime(load_config(None, tiny_args(corpus, tmp_path / "p",
                                                            tmp_path / "run")))
        assert rt.device.type == "cuda"
        assert torch.get_num_threads() == 4
    finally:
        torch.set_num_threads(before)
    assert [setup.cpu_threads(None, None, c, n, 0.0)
            for c, n in ((16, 4), (16, 3), (2, 8), (8, 0))] == [4, 5, 1, 8]
