"""Test harness: pools of gloo CPU ranks that run test functions (see ``pool.py``)."""

from colonnade.testing.pool import (
    RankError,
    RankPool,
    RankPools,
    RankTimeout,
    spawn_ranks,
)

__all__ = ["RankError", "RankPool", "RankPools", "RankTimeout", "spawn_ranks"]
