"""Shared pytest set-up: the session's pools of gloo CPU ranks, and the ``gpu`` marker."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from colonnade.parallel.pool import RankPools

pytest_plugins = ["tests.time_budget"]

# The pool's ranks import test functions by name (``tests.<dir>.<module>``) with the parent's
# sys.path (spawn copies it): the repo root first, the tests directory last for its helpers.
# The paths are set here, by the tests, never by the library.
_REPO_ROOT = Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))
if str(_REPO_ROOT / "tests") not in sys.path:
    sys.path.append(str(_REPO_ROOT / "tests"))


def pytest_configure(config: pytest.Config) -> None:
    _sigint_raises()
    config.addinivalue_line(
        "markers", "timing: races the OS (signals, kills, hangs, subprocesses, threads, "
        "timeouts, wall clocks); ordered by events so it holds for every interleaving, and "
        "run 20 times under load by `make flake-hunt` (tests/flake_hunt.py)")
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA device; deselected by default (pyproject addopts "
        "-m 'not gpu'), selected with `pytest -m gpu tests/gpu` on a GPU machine")


def _sigint_raises() -> None:
    """SIGINT raises KeyboardInterrupt in the test process, and its children start with SIGINT's
    default action, however the suite was started. A job that a non-interactive shell starts
    with ``&`` (``make test &``, two copies of the suite at once, a CI wrapper) begins with
    SIGINT ignored; Python keeps an inherited SIG_IGN, and every process a test starts inherits
    it in turn, so the tests that stop a run with Ctrl-C failed there and passed in a terminal
    (``test_signal_while_the_pool_forks_is_raised_after_it[2]`` at f910c72: ``bash -c 'pytest
    ... & wait'`` failed it every time). A Python-level handler is reset to SIG_DFL by exec."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A selected ``@pytest.mark.gpu`` test on a machine without a GPU fails, never skips.

    CI deselects them (pyproject's ``-m 'not gpu'``: no skips, no failures); a GPU run selects
    them with ``-m gpu``. Asking for them where no CUDA device is visible is a mistake, reported
    as an error at set-up (``--collect-only`` still lists them everywhere).
    """
    if item.get_closest_marker("gpu") is None:
        return
    from colonnade.device import has_gpu

    if not has_gpu():
        pytest.fail("this test is marked gpu and needs a CUDA device; none is visible here. "
                    "Deselect it with -m 'not gpu' (the default) or run it on a GPU machine.",
                    pytrace=False)


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[RankPools]:
    """One lazily started RankPool per world size (1..8), alive for the whole session."""
    pools = RankPools()
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture(scope="session")
def run_ranks(rank_pools: RankPools) -> Callable[..., list[Any]]:
    """``run_ranks(world_size, fn, *args, **kwargs)`` -> results of ``fn`` in rank order.

    ``fn`` must be a module-level function; each rank learns its rank from
    ``torch.distributed.get_rank()``. A rank exception raises ``RankError``.
    """
    return rank_pools.run


@pytest.fixture()
def cli(run_ranks: Callable[..., list[Any]], capsys: pytest.CaptureFixture[str]
        ) -> Iterator[Callable[[list[str]], tuple[int, str]]]:
    """``cli(argv)`` -> (exit status, stdout + stderr) of ``colonnade argv`` run in the test's
    process, ``train --nproc N``'s ranks on the session's rank pool
    (:func:`tests.workflow.cli.ranks_in_pool`): no interpreter, torch or launcher started per
    command. For tests of what a command computes; the real processes and launcher keep
    their own tests (tests/workflow/test_end_to_end.py, tests/reliability/test_launch.py)."""
    from tests.workflow.cli import ranks_in_pool, run_in_process

    with ranks_in_pool(run_ranks):
        yield lambda argv: run_in_process(argv, capsys)
