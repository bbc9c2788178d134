"""Shared pytest set-up: the session's pools of gloo CPU ranks, and the ``gpu`` marker."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from colonnade.testing import RankPools


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when none is visible")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests on machines without a GPU."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    from colonnade.device import has_gpu

    if not has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA device (marker 'gpu')")
        for item in gpu_items:
            item.add_marker(skip)


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
