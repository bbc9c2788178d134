"""The rank pool: results in rank order, remote errors named, hangs killed, pools reused.

Functions sent to ranks live at module level so the ranks import them by name
(``tests.parallel.test_pool._all_reduce_ranks``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from colonnade.parallel.pool import (
    LeakedGroupWarning,
    RankError,
    RankPool,
    RankPools,
    RankTimeout,
    spawn_ranks,
)
from colonnade.parallel.pool_rank import thread_names

pytestmark = pytest.mark.timing  # races the OS (see conftest); `make flake-hunt`

# ----------------------------------------------------------------------------- rank functions


def _all_reduce_ranks(scale: float, *, offset: float = 0.0) -> dict[str, Any]:
    """Rank r contributes [r + 1, 10 (r + 1)] * scale + offset; returns the all-reduced sum."""
    rank = dist.get_rank()
    value = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], dtype=torch.float64)  # [2]
    value = value * scale + offset
    dist.all_reduce(value)
    return {"rank": rank, "world": dist.get_world_size(), "sum": value}


def _raise_on_rank(bad_rank: int, others_wait: bool) -> int:
    """``bad_rank`` raises; the others return at once or block in an all-reduce with it."""
    rank = dist.get_rank()
    if rank == bad_rank:
        raise ValueError("boom")
    if others_wait:
        dist.all_reduce(torch.ones(1))
    return rank


def _sleep_on_rank(sleepy_rank: int, seconds: float, others_wait: bool) -> int:
    """``sleepy_rank`` sleeps; the others return at once or wait for it in an all-reduce."""
    rank = dist.get_rank()
    if rank == sleepy_rank:
        time.sleep(seconds)
    if others_wait:
        dist.all_reduce(torch.ones(1))
    return rank


def _exit_on_rank(dead_rank: int) -> int:
    """``dead_rank`` dies without a word (as a segfault would)."""
    if dist.get_rank() == dead_rank:
        os._exit(7)
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def _rank() -> int:
    return dist.get_rank()


def _pid() -> int:
    return os.getpid()


def _dirty_state() -> int:
    """Leave process-wide state behind: float64 default, a subgroup, no grad, a used RNG."""
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.rand(5)
    group = dist.new_group(list(range(dist.get_world_size())))
    value = torch.ones(1)
    dist.all_reduce(value, group=group)
    return int(value.item())


def _read_state() -> tuple[str, bool, float, int]:
    """What a fresh rank sees: default dtype, grad mode, first random number, world size."""
    return (
        str(torch.get_default_dtype()),
        torch.is_grad_enabled(),
        float(torch.rand(1).item()),
        dist.get_world_size(),
    )


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def small_pool() -> Iterator[RankPool]:
    """A private 2-rank pool with a short grace, for tests that kill their pool on purpose."""
    pool = RankPool(2, timeout_s=60.0, grace_s=1.0)
    try:
        yield pool
    finally:
        pool.close()


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce_results_come_back_in_rank_order(
    run_ranks: Callable[..., list[Any]], world_size: int
) -> None:
    results = run_ranks(world_size, _all_reduce_ranks, 3.0, offset=0.5)
    n = world_size
    expected = torch.tensor(
        [3.0 * n * (n + 1) / 2 + 0.5 * n, 30.0 * n * (n + 1) / 2 + 0.5 * n], dtype=torch.float64
    )
    assert [r["rank"] for r in results] == list(range(n))
    assert all(r["world"] == n for r in results)
    for r in results:
        torch.testing.assert_close(r["sum"], expected, rtol=0, atol=0)
    if n == 4:  # 1+2+3+4 = 10: [3*10 + 2, 30*10 + 2]
        torch.testing.assert_close(results[0]["sum"], torch.tensor([32.0, 302.0]).double())


def test_rank_error_names_the_rank_and_keeps_the_pool(rank_pools: RankPools) -> None:
    pool = rank_pools.get(2)
    pool.start()
    starts = pool.starts
    with pytest.raises(RankError) as info:
        pool.run(_raise_on_rank, 1, others_wait=False)
    message = str(info.value)
    assert "rank 1" in message and "ValueError: boom" in message
    assert "rank 0" not in message  # rank 0 returned normally
    assert list(info.value.failures) == [1] and info.value.stuck == []
    assert "_raise_on_rank" in info.value.failures[1]  # the remote traceback
    # Every rank answered, so the same processes serve the next call.
    assert [r["sum"][0].item() for r in pool.run(_all_reduce_ranks, 1.0)] == [3.0, 3.0]
    assert pool.starts == starts


def test_rank_error_with_ranks_stuck_in_a_collective_restarts_the_pool(
    small_pool: RankPool,
) -> None:
    small_pool.start()
    starts = small_pool.starts
    began = time.monotonic()
    with pytest.raises(RankError) as info:
        small_pool.run(_raise_on_rank, 1, others_wait=True)
    elapsed = time.monotonic() - began
    message = str(info.value)
    assert "rank 1" in message and "boom" in message and "did not answer" in message
    assert info.value.stuck == [0]
    # Without the grace the parent would wait for the pool's 60 s timeout; the margin (the
    # grace plus 20 s) absorbs a loaded 2-core machine and stays far below that timeout.
    assert elapsed < small_pool.grace_s + 20.0 < small_pool.timeout_s / 2
    assert not small_pool.alive  # killed; the next call restarts it transparently
    assert [r["sum"][1].item() for r in small_pool.run(_all_reduce_ranks, 1.0)] == [30.0, 30.0]
    assert small_pool.starts == starts + 1


@pytest.mark.parametrize(("others_wait", "missing"), [(True, [0, 1]), (False, [0])])
def test_hang_raises_rank_timeout_then_the_pool_recovers(
    small_pool: RankPool, others_wait: bool, missing: list[int]
) -> None:
    small_pool.start()
    timeout_s = 2.0
    began = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        small_pool.call(_sleep_on_rank, (0, 60.0, others_wait), timeout_s=timeout_s)
    elapsed = time.monotonic() - began
    # Never before the timeout; after it, killing and reaping ranks on a loaded machine may
    # take a while, but far less than the 60 s sleep that would end the call without one.
    assert timeout_s <= elapsed < timeout_s + 30.0 < 60.0
    assert info.value.missing == missing
    assert f"rank(s) {', '.join(map(str, missing))} had not answered" in str(info.value)
    assert small_pool.run(_rank) == [0, 1]


def test_dead_rank_is_reported_with_its_exit_code(small_pool: RankPool) -> None:
    with pytest.raises(RankError) as info:
        small_pool.run(_exit_on_rank, 1)
    assert "rank 1" in str(info.value) and "exit code 7" in str(info.value)
    assert small_pool.run(_rank) == [0, 1]


def test_each_run_starts_from_fresh_state(run_ranks: Callable[..., list[Any]]) -> None:
    assert run_ranks(2, _dirty_state) == [2, 2]
    torch.manual_seed(0)
    first_random = float(torch.rand(1).item())  # the pool seeds every run with 0
    assert run_ranks(2, _read_state) == [("torch.float32", True, first_random, 2)] * 2


def test_idle_ranks_hold_no_group_and_no_polling_thread(rank_pools: RankPools) -> None:
    """Between runs a rank holds no process group, so gloo's transport thread (an epoll loop
    that wakes every 10 ms while a group lives) is gone and the rank blocks in its pipe read.
    The parent reads the threads after the run's "end" reply, which a rank sends only after
    destroying its groups: no window to race."""
    pool = rank_pools.get(2)
    pids = pool.run(_pid)
    during = pool.run(_thread_names_here)
    assert all("gloo_tcp_loop" in names for names in during), during
    for pid in pids:
        names = thread_names(pid)
        assert "gloo_tcp_loop" not in names and "pt_gloo_runloop" not in names, names


def _thread_names_here() -> list[str]:
    return thread_names()


_KEPT: list[Any] = []


def _keep_a_group() -> int:
    """Leave a process group alive past the run, as a global cache would."""
    _KEPT.append(dist.new_group(list(range(dist.get_world_size()))))
    return len(_KEPT)


def test_a_run_that_leaves_a_group_alive_is_named_and_the_pool_restarts(
        small_pool: RankPool) -> None:
    """A group some object keeps past ``destroy_process_group`` keeps its gloo transport thread
    polling for the pool's life; the pool names the run in a warning and starts afresh."""
    small_pool.start()
    starts = small_pool.starts
    leak = r"_keep_a_group on 2 ranks left gloo process groups alive after the run \(rank 0: 1, "
    with pytest.warns(LeakedGroupWarning, match=leak + r"rank 1: 1\)"):
        assert small_pool.run(_keep_a_group) == [1, 1]
    assert not small_pool.alive
    assert small_pool.run(_keep_a_group) == [1, 1]  # fresh processes: an empty cache
    assert small_pool.starts == starts + 1


def test_reusing_a_pool_is_fast(rank_pools: RankPools) -> None:
    """20 runs reuse the same 4 processes (no start, same pids: nothing imports torch again),
    and take far less than restarting would (4 ranks importing torch on 2 cores take ~10 s a
    start, so 20 restarts take minutes; the bound is a generous 60 s for 20 trivial runs)."""
    pool = rank_pools.get(4)
    pool.start()
    starts, pids = pool.starts, pool.run(_pid)
    began = time.monotonic()
    results = [pool.run(_rank) for _ in range(20)]
    elapsed = time.monotonic() - began
    assert results == [[0, 1, 2, 3]] * 20
    assert pool.starts == starts and pool.run(_pid) == pids  # the same processes served all
    assert len(set(pids)) == 4 and os.getpid() not in pids
    assert elapsed < 60.0, f"20 trivial runs on 4 ranks took {elapsed:.1f} s"


def test_functions_ranks_cannot_import_are_rejected_before_starting() -> None:
    pool = RankPool(2)
    with pytest.raises(TypeError, match="module level"):
        pool.run(lambda: 0)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pool.run(_rank, lambda: 0)
    assert not pool.alive and pool.starts == 0


def test_invalid_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="world_size"):
        RankPool(0)
    with pytest.raises(ValueError, match="timeout_s"):
        RankPool(2, timeout_s=0)
    with pytest.raises(ValueError, match=r"1\.\.8"):
        RankPools().get(9)


def test_pools_beyond_the_rank_budget_close_the_least_recently_used() -> None:
    pools = RankPools(max_world_size=2, max_live_ranks=2)
    try:
        one = pools.get(1)
        assert one.run(_rank) == [0]
        two = pools.get(2)  # 1 + 2 live ranks > 2: the 1-rank pool is closed
        assert not one.alive
        assert two.run(_rank) == [0, 1]
    finally:
        pools.close()


def test_spawn_ranks_runs_once_outside_pytest_pools() -> None:
    results = spawn_ranks(2, _all_reduce_ranks, 2.0, timeout_s=120.0)
    assert [r["sum"].tolist() for r in results] == [[6.0, 60.0], [6.0, 60.0]]
