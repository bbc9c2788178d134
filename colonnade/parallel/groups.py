"""ProcessGroups: every process group of a run, created once from :class:`ParallelDims`.

This is the only place that calls ``torch.distributed.new_group``. Groups are values: a layer
receives the :class:`~colonnade.parallel.comm.CommGroup` it needs; nothing is global.

Groups made (each as a CommGroup sharing one :class:`CommStats`):
  tp, pp, dp, cp          one axis each
  dp_cp                   gradient reduction group (dp and cp together)
  model                   tp x pp (everything that holds a different part of one replica)
  embedding               first and last pp stage (tied embedding gradients), same other coords
  world                   all ranks
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.dims import ParallelDims


@dataclass
class ProcessGroups:
    """Every group this rank belongs to, plus where it sits in the layout."""

    dims: ParallelDims
    rank: int
    tp: CommGroup
    pp: CommGroup
    dp: CommGroup
    cp: CommGroup
    dp_cp: CommGroup
    model: CommGroup
    embedding: CommGroup
    world: CommGroup
    stats: CommStats

    @property
    def tp_rank(self) -> int:
        """Index along tp."""
        return self.tp.rank

    @property
    def pp_rank(self) -> int:
        """Index along pp (the pipeline stage)."""
        return self.pp.rank

    @property
    def dp_rank(self) -> int:
        """Index along dp."""
        return self.dp.rank

    @property
    def is_first_stage(self) -> bool:
        """This rank holds the embedding."""
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        """This rank computes the loss."""
        return self.pp.rank == self.pp.size - 1

    def pp_peer(self, stage: int) -> int:
        """Global rank of pipeline stage ``stage`` (mod pp) with this rank's other coordinates."""
        return self.pp.ranks[stage % self.pp.size]

    @classmethod
    def single(cls, dims: ParallelDims | None = None) -> ProcessGroups:
        """Groups of a single process: every group has size 1 and nothing communicates.

        This is how the single-process reference model runs without torch.distributed.
        """
        dims = dims or ParallelDims()
        if dims.world_size != 1:
            raise ValueError("ProcessGroups.single needs a world of size 1")
        stats = CommStats()

        def one(name: str) -> CommGroup:
            return CommGroup(name, [0], None, stats, 0)

        return cls(dims, 0, one("tp"), one("pp"), one("dp"), one("cp"), one("dp_cp"),
                   one("model"), one("embedding"), one("world"), stats)

    @classmethod
    def build(cls, dims: ParallelDims, timeout_s: float = 300.0) -> ProcessGroups:
        """Create every group; must be called by all ranks (same dims) after init_process_group."""
        if not dist.is_initialized():
            if dims.world_size == 1:
                return cls.single(dims)
            raise RuntimeError("torch.distributed is not initialised; launch with torchrun or "
                               "`colonnade train --nproc N`")
        world = dist.get_world_size()
        if world != dims.world_size:
            raise ValueError(f"world size {world} != layout {dims.describe()} "
                             f"({dims.world_size} ranks)")
        rank = dist.get_rank()
        stats = CommStats()
        timeout = timedelta(seconds=timeout_s)
        made: dict[str, CommGroup] = {}
        specs: dict[str, list[list[int]]] = {
            "tp": dims.group_ranks("tp"),
            "pp": dims.group_ranks("pp"),
            "dp": dims.group_ranks("dp"),
            "cp": dims.group_ranks("cp"),
            "dp_cp": dims.group_ranks(("dp", "cp")),
            "model": dims.group_ranks(("tp", "pp")),
            "embedding": _embedding_groups(dims),
        }
        for name, partition in specs.items():
            made[name] = _make(name, partition, rank, stats, timeout)
        world_pg: Any = dist.group.WORLD
        made["world"] = CommGroup("world", list(range(world)), world_pg, stats, rank)
        return cls(dims=dims, rank=rank, stats=stats, **made)


def _embedding_groups(dims: ParallelDims) -> list[list[int]]:
    """First and last stage of each pipeline (one rank when pp == 1); every middle stage
    (pp > 2) holds no embedding and is a group of its own (size 1: nothing to reduce)."""
    out = []
    for pipeline in dims.group_ranks("pp"):
        out.append(sorted({pipeline[0], pipeline[-1]}))
        out.extend([r] for r in pipeline[1:-1])
    return out


def _make(name: str, partition: list[list[int]], rank: int, stats: CommStats,
          timeout: timedelta) -> CommGroup:
    """Create one process group per part (collectively); return the part holding ``rank``."""
    mine: CommGroup | None = None
    for ranks in partition:
        pg = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
        if rank in ranks:
            mine = CommGroup(name, ranks, pg, stats, rank)
    if mine is None:
        raise AssertionError(f"rank {rank} is in no '{name}' group")
    return mine
