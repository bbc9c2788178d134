"""Global gradient-norm: ||g|| over every parameter of the model, counted exactly once.

Each rank sums the squares of the gradient entries it *owns*: tp-sharded parameters on every
tp rank (disjoint shards), tp-replicated ones on tp rank 0 only, the duplicate tied head on the
last stage not at all (its gradient equals the embedding's after the tied reduction). The
partial sums are then all-reduced over the model group (tp x pp). With ZeRO (any stage >= 1),
each rank of the shard group owns a disjoint range of the flat gradient (stage 2/3: its shard
is the only gradient it has) and the sum runs over the shard group as well; under hybrid
sharding the replicate group holds copies of the same shards and is not summed over.
Expert parameters (an "ep" split) are counted on their own coordinates and summed over ep
(see :mod:`colonnade.optim.distributed`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from colonnade.parallel.comm import CommGroup
from colonnade.tensor_parallel.sharding import Coords


def owns_grad(param: torch.nn.Parameter, coords: Coords) -> bool:
    """Whether this rank (``coords``, e.g. ``{"tp": (rank, tp)}``) counts ``param`` in the
    global norm: ``Sharding.owns`` (index 0 of every axis replicating it, never a tied copy)."""
    sharding = getattr(param, "sharding", None)
    return sharding is None or sharding.owns(coords)


def global_sq(local_sq: torch.Tensor, groups: Iterable[CommGroup]) -> torch.Tensor:
    """The sum over ``groups`` of per-rank sums of squares (float64 scalar)."""
    live = [g for g in groups if g.size > 1]
    if not live:  # one rank in every group: nothing to sum, no collective entered
        return local_sq.detach().to(torch.float64)
    total = local_sq.detach().to(torch.float64).reshape(1).clone()
    for group in live:
        group.all_reduce(total, name="grad_norm")
    return total[0]


def global_norm(local_sq: torch.Tensor, groups: Iterable[CommGroup]) -> torch.Tensor:
    """sqrt of the sum over ``groups`` of per-rank sums of squares (float64 scalar)."""
    return global_sq(local_sq, groups).sqrt()


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> float:
    """min(1, max_norm / (norm + 1e-6)); 1 when clipping is off."""
    if max_norm <= 0:
        return 1.0
    return float(min(1.0, max_norm / (float(norm) + 1e-6)))
