"""ProcessGroups: every process group of a run, created once from :class:`ParallelDims`.

This is the only place that creates process groups. Groups are values: a layer receives the
:class:`~colonnade.parallel.comm.CommGroup` it needs; nothing is global.

Groups (each a CommGroup sharing one :class:`CommStats`) and who communicates on them:
  tp          tensor-parallel layers, sp, vocab-parallel loss, clipping norms
  pp          pipeline p2p, loss broadcast
  dp_cp       gradient reduction (dp and cp together), ZeRO-1, loss token counts
  dp          rank/size for the data sampler (every cp rank of one dp index reads the same
              samples), dropout's micro-batch index and metadata; no collective runs on it:
              equal to dp_cp while cp = 1, so it shares that pg; at cp > 1 it has none
              (:data:`INDEX_GROUPS`, an :class:`IndexGroup` that refuses collectives)
  cp          context parallelism: ring / all-to-all attention over the sequence's shards
  embedding   first and last pp stage (tied embedding gradients), same other coordinates;
              equal to pp at pp = 2 (shares its pg); a group of one rank without tied embeddings
  world       all ranks (the default group)

Hybrid sharding (made only when ``zero_shard_size`` is given, else None: the shard group is
dp_cp):
  zero_shard      ZeRO shards: groups of zero_shard_size consecutive ranks of each dp_cp group
  zero_replicate  the ranks of one dp_cp group holding the same shard index (gradient shards
                  all-reduced across it)

Hierarchical context parallelism (made only when ``cp_a2a_size`` is given, i.e. with
parallel.cp_attention='hierarchical', else None):
  cp_a2a   the inner all-to-all: groups of cp_a2a_size consecutive ranks of each cp group
  cp_ring  the outer ring: the ranks of one cp group holding the same index in their cp_a2a
           group (the ring runs over them, cp / cp_a2a_size ranks)
At cp_a2a_size = cp the ring groups are single ranks (plain all-to-all), at 1 the a2a groups
(plain ring); the other one then equals the cp partition and shares its process group.

Expert groups (the expert view of :class:`ParallelDims`; made only with ``experts=True``, for a
model with mixture-of-experts layers, else None):
  ep          token all-to-all of the expert layers (experts split across its ranks)
  expert_tp   tensor parallelism inside each expert; equals tp (shares its pg) when etp = tp
  expert_dp   gradient reduction of expert weights (replicated across it); equals dp_cp
              (shares its pg) when ep = 1 and etp = tp

Hybrid sharding of the expert weights (made with both ``experts`` and ``zero_shard_size``):
  expert_zero_shard      groups of min(zero_shard_size, edp) consecutive ranks of each
                         expert_dp group (the expert buckets' ZeRO shards); equals expert_dp
                         when zero_shard_size >= edp
  expert_zero_replicate  the ranks of one expert_dp group holding the same expert shard index

Only groups used for a collective are created, with one call per axis
(:func:`plan_groups` decides, :func:`create_partition` creates), each with the collective
timeout passed at creation. A group whose partition equals another's shares that one's
process group; a group of one rank has none (:class:`CommGroup` does nothing on it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.parallel.dims import ParallelDims

GROUP_NAMES: tuple[str, ...] = ("tp", "pp", "dp_cp", "dp", "cp", "embedding")
"""Groups :meth:`ProcessGroups.build` makes besides world, in creation order (the same on
every rank: group creation is collective)."""
EXPERT_GROUP_NAMES: tuple[str, ...] = ("ep", "expert_tp", "expert_dp")
"""Groups of the expert view, made after :data:`GROUP_NAMES` when ``experts`` is asked for."""
EXPERT_GROUP_AXES: dict[str, str] = {"ep": "ep", "expert_tp": "etp", "expert_dp": "edp"}
"""The :class:`ParallelDims` expert axis each expert group spans."""

INDEX_GROUPS: frozenset[str] = frozenset({"dp"})
"""Groups used only as coordinates (rank, size, ranks), never for a collective: they get a
process group only by sharing an equal partition's (source 'index' otherwise)."""

ZERO_GROUP_NAMES: tuple[str, ...] = ("zero_shard", "zero_replicate")
"""Hybrid-sharding groups, made when ``zero_shard_size`` is given."""
EXPERT_ZERO_GROUP_NAMES: tuple[str, ...] = ("expert_zero_shard", "expert_zero_replicate")
"""Hybrid-sharding groups of the expert weights, made after :data:`ZERO_GROUP_NAMES` when both
``experts`` and ``zero_shard_size`` are given."""
CP_GROUP_NAMES: tuple[str, ...] = ("cp_a2a", "cp_ring")
"""Hierarchical cp's groups, made after the expert groups when ``cp_a2a_size`` is given."""


def split_partition(partition: list[list[int]], size: int, field: str, names: tuple[str, str]
                    ) -> dict[str, list[list[int]]]:
    """Every group ``g`` of ``partition`` (n ranks) split into groups of ``size`` consecutive
    ranks ``g[k size : (k + 1) size]`` (``names[0]``) and the strided groups ``g[j::size]``
    holding one rank of each (``names[1]``); ``field`` names the setting in the error when
    ``size`` does not divide n (the validator says so first, with the fix)."""
    for ranks in partition:
        if len(ranks) % size:
            raise ValueError(f"{field}={size} does not divide a group of {len(ranks)} ranks")
    inner = [ranks[k:k + size] for ranks in partition for k in range(0, len(ranks), size)]
    outer = [ranks[j::size] for ranks in partition for j in range(size)]
    return {names[0]: sorted(inner), names[1]: sorted(outer)}


def cp_partitions(cp: list[list[int]], size: int) -> dict[str, list[list[int]]]:
    """Hierarchical cp over every cp group (in cp-index order): inner all-to-all groups of
    ``size`` consecutive ranks and outer ring groups across them (:func:`split_partition`)."""
    return split_partition(cp, size, "parallel.cp_a2a_size", CP_GROUP_NAMES)


def zero_partitions(dp_cp: list[list[int]], size: int) -> dict[str, list[list[int]]]:
    """Hybrid sharding of every dp x cp group into shard groups of ``size`` consecutive ranks
    and replicate groups across them (:func:`split_partition`)."""
    return split_partition(dp_cp, size, "parallel.zero_shard_size", ZERO_GROUP_NAMES)


def expert_shard_size(zero_shard_size: int, edp: int) -> int:
    """Ranks per expert shard group under hybrid sharding: ``min(zero_shard_size, edp)`` (an
    expert weight is replicated over edp ranks only, so a shard group never spans more)."""
    return min(zero_shard_size, edp)


def expert_zero_partitions(expert_dp: list[list[int]], size: int) -> dict[str, list[list[int]]]:
    """Hybrid sharding of every expert_dp group (edp ranks) into expert shard groups of
    s = :func:`expert_shard_size` consecutive ranks and expert replicate groups across them
    (:func:`split_partition`)."""
    s = expert_shard_size(size, len(expert_dp[0]))
    return split_partition(expert_dp, s, "parallel.zero_shard_size", EXPERT_ZERO_GROUP_NAMES)


@dataclass(frozen=True)
class GroupSpec:
    """How one named group comes to exist on every rank.

    ``partition``: the disjoint rank lists covering the world (one per group of this name);
    ``source``: 'create' (one collective creation call for the whole partition), 'single'
    (every part is one rank: no process group), 'index' (a group of :data:`INDEX_GROUPS`
    with no equal partition to share: coordinates only, no process group), or the name of an
    earlier group with the same partition whose process group it shares.
    """

    partition: list[list[int]]
    source: str

    @property
    def creates(self) -> bool:
        """This group needs a creation call of its own."""
        return self.source == "create"


def plan_groups(dims: ParallelDims, tied_embeddings: bool = True,
                experts: bool = False, zero_shard_size: int | None = None,
                cp_a2a_size: int | None = None) -> dict[str, GroupSpec]:
    """Pure layout maths: the partition of every group and whether it is created, shared or
    trivial. Needs no processes (a 4096-rank layout is planned in a fraction of a second).
    ``experts``: add the expert groups (:data:`EXPERT_GROUP_NAMES`); ``zero_shard_size``: add
    the hybrid-sharding groups (:data:`ZERO_GROUP_NAMES`; with ``experts`` also
    :data:`EXPERT_ZERO_GROUP_NAMES`); ``cp_a2a_size``: hierarchical cp's groups
    (:data:`CP_GROUP_NAMES`)."""
    partitions: dict[str, list[list[int]]] = {
        "tp": dims.group_ranks("tp"),
        "pp": dims.group_ranks("pp"),
        "dp_cp": dims.group_ranks(("dp", "cp")),
        "dp": dims.group_ranks("dp"),
        "cp": dims.group_ranks("cp"),
        "embedding": (_embedding_groups(dims) if tied_embeddings
                      else [[r] for r in range(dims.world_size)]),
    }
    names = GROUP_NAMES
    if experts:
        names = (*GROUP_NAMES, *EXPERT_GROUP_NAMES)
        for name, axis in EXPERT_GROUP_AXES.items():
            partitions[name] = dims.group_ranks(axis)
    if zero_shard_size is not None:
        names = (*names, *ZERO_GROUP_NAMES)
        partitions.update(zero_partitions(partitions["dp_cp"], zero_shard_size))
        if experts:
            names = (*names, *EXPERT_ZERO_GROUP_NAMES)
            partitions.update(expert_zero_partitions(partitions["expert_dp"], zero_shard_size))
    if cp_a2a_size is not None:
        names = (*names, *CP_GROUP_NAMES)
        partitions.update(cp_partitions(partitions["cp"], cp_a2a_size))
    out: dict[str, GroupSpec] = {}
    for name in names:
        part = partitions[name]
        if all(len(ranks) == 1 for ranks in part):
            out[name] = GroupSpec(part, "single")
            continue
        same = next((n for n, s in out.items() if s.source == "create" and s.partition == part),
                    None)
        out[name] = GroupSpec(part, same or ("index" if name in INDEX_GROUPS else "create"))
    return out


def create_partition(name: str, partition: list[list[int]], timeout: timedelta) -> Any:
    """Create the process groups of a whole partition in one call; this rank's pg (None when
    its part is a single rank). Every rank must call it, in the same order.

    With NCCL and a device bound to the default group, ``split_group`` splits the default
    communicator (one ncclCommSplit: each rank makes only its own group). Elsewhere (gloo;
    ``split_group`` needs a splitting backend) ``new_subgroups_by_enumeration`` makes them.
    """
    parts = [ranks for ranks in partition if len(ranks) > 1]
    if _can_split():
        return dist.split_group(split_ranks=parts, timeout=timeout, group_desc=name)
    mine, _ = dist.new_subgroups_by_enumeration(parts, timeout=timeout, group_desc=name)
    return mine


def _can_split() -> bool:
    """The default group can be split (NCCL with a bound device, see ``split_group``)."""
    world: Any = dist.group.WORLD
    return dist.get_backend() == "nccl" and getattr(world, "bound_device_id", None) is not None


class IndexGroup(CommGroup):
    """A group of several ranks without a process group (:data:`INDEX_GROUPS`): its rank,
    size and ranks are coordinates; any collective on it is a bug and raises, naming the group
    to use instead (a pg of None would otherwise mean the default group)."""

    def _refuse(self, op: str) -> RuntimeError:
        return RuntimeError(f"{op} on group '{self.name}' (ranks {self.ranks}): this group has "
                            "no process group (coordinates only); reduce over dp_cp (the "
                            "gradient group) or the group the operation belongs to")

    def _run(self, op: str, name: str, payload: int, wire: float, fn: Any,
             async_op: bool) -> Any:
        raise self._refuse(op)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Refused: see the class."""
        raise self._refuse("all_gather_object")

    def barrier(self) -> None:
        """Refused: see the class."""
        raise self._refuse("barrier")

    def p2p(self, sends: list[tuple[Any, int]], recvs: list[tuple[Any, int]], *,
            name: str = "") -> Any:
        """Refused: see the class."""
        raise self._refuse("p2p")


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
    embedding: CommGroup
    world: CommGroup
    stats: CommStats
    ep: CommGroup | None = None
    """Expert-parallel group (None unless built with ``experts=True``)."""
    expert_tp: CommGroup | None = None
    """Tensor parallelism inside each expert (None unless built with ``experts=True``)."""
    expert_dp: CommGroup | None = None
    """Expert weights' gradient reduction (None unless built with ``experts=True``)."""
    zero_shard: CommGroup | None = None
    """Hybrid sharding's shard group (None unless built with ``zero_shard_size``)."""
    zero_replicate: CommGroup | None = None
    """Hybrid sharding's replicate group (None unless built with ``zero_shard_size``)."""
    cp_a2a: CommGroup | None = None
    """Hierarchical cp's inner all-to-all group (None unless built with ``cp_a2a_size``)."""
    cp_ring: CommGroup | None = None
    """Hierarchical cp's outer ring group (None unless built with ``cp_a2a_size``)."""
    expert_zero_shard: CommGroup | None = None
    """Hybrid sharding's expert shard group (None unless built with ``experts`` and
    ``zero_shard_size``)."""
    expert_zero_replicate: CommGroup | None = None
    """Hybrid sharding's expert replicate group (as ``expert_zero_shard``)."""

    @property
    def shard_group(self) -> CommGroup:
        """The ZeRO shard group: ``zero_shard`` under hybrid sharding, else dp_cp."""
        return self.zero_shard if self.zero_shard is not None else self.dp_cp

    @property
    def expert_shard_group(self) -> CommGroup | None:
        """The expert buckets' ZeRO shard group: ``expert_zero_shard`` under hybrid sharding,
        else expert_dp (None without the expert groups)."""
        return self.expert_zero_shard if self.expert_zero_shard is not None else self.expert_dp

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

    def _comm_groups(self) -> list[CommGroup]:
        return [g for f in dataclasses.fields(self)
                if isinstance(g := getattr(self, f.name), CommGroup)]

    def release(self) -> None:
        """After a peer's death: every group drops its process group and abandons its
        operations in flight (:meth:`CommGroup.release`), until :meth:`adopt`."""
        for group in self._comm_groups():
            group.release()

    def adopt(self, fresh: ProcessGroups) -> None:
        """Rebind every group of this rank, in place, to ``fresh``'s process groups (the same
        layout built again on a new default group, after an in-process restart): each
        :class:`CommGroup` object stays the one the model, buffers and optimizer hold; only
        its process group changes (:meth:`CommGroup.rebind`)."""
        if fresh.dims != self.dims or fresh.rank != self.rank:
            raise ValueError(f"cannot adopt the groups of {fresh.dims.describe()} rank "
                             f"{fresh.rank} into {self.dims.describe()} rank {self.rank}")
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(fresh, f.name)
            if isinstance(mine, CommGroup) and isinstance(theirs, CommGroup):
                if mine.ranks != theirs.ranks:
                    raise ValueError(f"group '{f.name}' has ranks {theirs.ranks}, not "
                                     f"{mine.ranks}")
                mine.rebind(theirs.pg)

    def host_world(self, name: str, timeout_s: float) -> CommGroup:
        """A new group of every rank on the gloo backend, for host-memory tensors moved by a
        background thread (memory snapshots), with its own :class:`CommStats` so the training
        groups' counters and the hang watchdog never see it. Collective: every rank calls it,
        in the same order as every other group creation. One process: a group of one."""
        stats = CommStats()
        if self.world.size == 1:
            return CommGroup(name, [0], None, stats, 0)
        pg = dist.new_group(list(range(self.world.size)), backend="gloo",
                            timeout=timedelta(seconds=timeout_s), group_desc=name)
        return CommGroup(name, list(range(self.world.size)), pg, stats, self.rank)

    @classmethod
    def single(cls, dims: ParallelDims | None = None, cp_split: bool = False) -> ProcessGroups:
        """Groups of a single process: every group has size 1 and nothing communicates.

        This is how the single-process reference model runs without torch.distributed. The
        expert groups are made too (trivial, like every group of one process); ``cp_split``:
        hierarchical cp's two groups as well.
        """
        dims = dims or ParallelDims()
        if dims.world_size != 1:
            raise ValueError("ProcessGroups.single needs a world of size 1")
        stats = CommStats()

        def one(name: str) -> CommGroup:
            return CommGroup(name, [0], None, stats, 0)

        split = {"cp_a2a": one("cp_a2a"), "cp_ring": one("cp_ring")} if cp_split else {}
        return cls(dims, 0, one("tp"), one("pp"), one("dp"), one("cp"), one("dp_cp"),
                   one("embedding"), one("world"), stats, one("ep"), one("expert_tp"),
                   one("expert_dp"), **split)

    @classmethod
    def build(cls, dims: ParallelDims, timeout_s: float = 300.0,
              tied_embeddings: bool = True, experts: bool = False,
              zero_shard_size: int | None = None,
              cp_a2a_size: int | None = None) -> ProcessGroups:
        """Create the groups :func:`plan_groups` asks for; every rank calls it (same dims)
        after init_process_group. ``tied_embeddings`` False: no embedding group is made;
        ``experts`` True: the expert groups (ep, expert_tp, expert_dp) are made too;
        ``zero_shard_size``: the hybrid-sharding groups (zero_shard, zero_replicate);
        ``cp_a2a_size``: hierarchical cp's groups (cp_a2a, cp_ring)."""
        if not dist.is_initialized():
            if dims.world_size == 1:
                return cls.single(dims, cp_a2a_size is not None)
            raise RuntimeError("torch.distributed is not initialised; launch with torchrun or "
                               "`colonnade train --nproc N`")
        world = dist.get_world_size()
        if world != dims.world_size:
            raise ValueError(f"world size {world} != layout {dims.describe()} "
                             f"({dims.world_size} ranks)")
        rank = dist.get_rank()
        stats = CommStats()
        timeout = timedelta(seconds=timeout_s)
        pgs: dict[str, Any] = {}
        made: dict[str, CommGroup] = {}
        for name, spec in plan_groups(dims, tied_embeddings, experts, zero_shard_size,
                                      cp_a2a_size).items():
            if spec.creates:
                pgs[name] = create_partition(name, spec.partition, timeout)
            else:
                pgs[name] = pgs.get(spec.source)  # shared pg, or None for a group of one
            ranks = next(r for r in spec.partition if rank in r)
            kind = IndexGroup if spec.source == "index" else CommGroup
            made[name] = kind(name, ranks, pgs[name] if len(ranks) > 1 else None, stats, rank)
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
    return sorted(out)
