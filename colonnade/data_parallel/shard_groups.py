"""Which group reduces, shards and gathers each bucket: dense buckets over dp x cp (or hybrid
sharding's shard group, replicated over its replicate group), expert buckets over expert-dp
(or its hybrid shard group, replicated over the expert replicate group).

One value used by every ZeRO stage (:class:`~colonnade.data_parallel.ddp.DataParallel` at
stages 0/1, :class:`~colonnade.data_parallel.grad_shards.GradShards` at 2/3,
:class:`~colonnade.data_parallel.param_shards.ParamShards` at 3), so a bucket's collectives
always run on the same group whatever the stage.

Scaling (see :mod:`colonnade.data_parallel.ddp` for why): the step's gradient is
(1 / D) x the sum over the D = dp x cp dense replicas, for dense and expert weights alike. A
bucket reduced by a shard group of n ranks and then a replicate group of R ranks is pre-scaled
by ``1 / D`` before SUMs; with ``average_in_collective`` both collectives average (a factor
1 / (n R)), so the pre-scale is ``n R / D``: 1 for a dense bucket (n R = D), edp / D for an
expert bucket (n R = edp, which differs from D when ep != tp).
"""

from __future__ import annotations

from dataclasses import dataclass

from colonnade.data_parallel.buffer import Bucket
from colonnade.parallel.comm import CommGroup


@dataclass(frozen=True)
class ShardGroups:
    """The groups of dense and expert buckets (see the module docstring). ``dense``: the dense
    reduction / shard group; ``expert``: the expert one (None for a dense model); the
    ``*_replicate`` groups: hybrid sharding's replicas (None: not hybrid)."""

    dense: CommGroup
    dense_replicate: CommGroup | None = None
    expert: CommGroup | None = None
    expert_replicate: CommGroup | None = None

    def shard(self, bucket: Bucket) -> CommGroup:
        """The group reducing (and with ZeRO sharding) ``bucket``."""
        if bucket.expert:
            if self.expert is None:
                raise ValueError("an expert bucket needs the expert-dp group; build the groups "
                                 "with experts=True")
            return self.expert
        return self.dense

    def rank(self, bucket: Bucket) -> int:
        """This rank's index in ``bucket``'s shard group (its ZeRO shard of the bucket)."""
        return max(self.shard(bucket).rank, 0)

    def replicate(self, bucket: Bucket) -> CommGroup | None:
        """Hybrid sharding's replicate group of ``bucket`` (None: no replicas)."""
        group = self.expert_replicate if bucket.expert else self.dense_replicate
        return group if group is not None and group.size > 1 else None

    def replicas(self, bucket: Bucket) -> int:
        """Ranks holding the same shard of ``bucket`` (1 without hybrid sharding)."""
        group = self.replicate(bucket)
        return group.size if group is not None else 1

    @property
    def expert_rank(self) -> int:
        """This rank's index in the expert shard group (0 for a dense model)."""
        return max(self.expert.rank, 0) if self.expert is not None else 0

    def prescale(self, bucket: Bucket, divisor: int, average: bool) -> float:
        """The factor ``bucket`` is multiplied by before its collectives: ``1 / D`` before
        SUMs, ``n R / D`` before averaging ones (``average``); ``divisor`` is D = dp x cp."""
        ranks = self.shard(bucket).size * self.replicas(bucket) if average else 1
        return ranks / divisor


def bucket_name(bucket: Bucket, name: str) -> str:
    """The comm-stats name of a bucket collective (expert buckets: ``expert_`` prefix)."""
    return f"expert_{name}" if bucket.expert else name
