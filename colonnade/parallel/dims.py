"""Parallel degrees and rank <-> coordinate maths. Pure arithmetic: no torch.distributed.

A rank order such as ``"tp-cp-ep-dp-pp"`` lists the axes fastest-varying first, so with that
order ::

    rank = tp_i + tp * (cp_i + cp * (ep_i + ep * (dp_i + dp * pp_i)))

Consecutive ranks then form a tp group (the bandwidth-hungry axis stays inside a node), and pp
is the slowest axis (it crosses nodes). Any permutation of the five axes is allowed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from colonnade.config.choices import AXES
from colonnade.config.sections import ParallelConfig


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of every axis plus the rank order; ``vp`` (chunks per pp rank) is carried along."""

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    vp: int = 1
    order: tuple[str, ...] = AXES

    def __post_init__(self) -> None:
        if sorted(self.order) != sorted(AXES):
            raise ValueError(f"rank order {'-'.join(self.order)} must name each of {AXES} once")
        for axis in AXES:
            if self.degree(axis) < 1:
                raise ValueError(f"parallel.{axis}={self.degree(axis)} must be >= 1")

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Build from a resolved ParallelConfig (dp may be None: derived from world_size)."""
        model_ranks = cfg.tp * cfg.cp * cfg.ep * cfg.pp
        dp = cfg.dp if cfg.dp is not None else world_size // model_ranks
        dims = cls(tp=cfg.tp, cp=cfg.cp, ep=cfg.ep, dp=dp, pp=cfg.pp, vp=cfg.vp,
                   order=tuple(cfg.order.split("-")))
        if dims.world_size != world_size:
            raise ValueError(
                f"world size {world_size} != tp x cp x ep x dp x pp = {dims.world_size}; "
                "change parallel degrees or the number of ranks"
            )
        return dims

    def degree(self, axis: str) -> int:
        """Size of one axis."""
        return int(getattr(self, axis))

    @property
    def world_size(self) -> int:
        """Product of all degrees."""
        out = 1
        for axis in AXES:
            out *= self.degree(axis)
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """Coordinates of ``rank`` along every axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        out = {}
        for axis in self.order:
            out[axis] = rank % self.degree(axis)
            rank //= self.degree(axis)
        return out

    def rank(self, **coords: int) -> int:
        """Inverse of :meth:`coords`; axes not named are taken as 0."""
        rank, stride = 0, 1
        for axis in self.order:
            index = coords.get(axis, 0)
            if not 0 <= index < self.degree(axis):
                raise ValueError(f"{axis} index {index} outside degree {self.degree(axis)}")
            rank += index * stride
            stride *= self.degree(axis)
        return rank

    def group_ranks(self, axes: tuple[str, ...] | str) -> list[list[int]]:
        """Partition of all ranks into groups that vary only along ``axes``.

        ``group_ranks("tp")`` lists every tp group; ``group_ranks(("tp", "dp"))`` the groups
        spanning tp and dp together. Ranks inside a group are sorted ascending.
        """
        if isinstance(axes, str):
            axes = (axes,)
        fixed = [a for a in AXES if a not in axes]
        groups = []
        for values in itertools.product(*(range(self.degree(a)) for a in fixed)):
            base = dict(zip(fixed, values, strict=True))
            members = []
            for inner in itertools.product(*(range(self.degree(a)) for a in axes)):
                members.append(self.rank(**base, **dict(zip(axes, inner, strict=True))))
            groups.append(sorted(members))
        return sorted(groups)

    def group_of(self, rank: int, axes: tuple[str, ...] | str) -> list[int]:
        """The group along ``axes`` that contains ``rank``."""
        for group in self.group_ranks(axes):
            if rank in group:
                return group
        raise AssertionError("unreachable: every rank is in exactly one group")

    def describe(self) -> str:
        """Short layout name, e.g. 'tp2-pp2-dp2' (axes of degree 1 omitted)."""
        parts = [f"{a}{self.degree(a)}" for a in AXES if self.degree(a) > 1]
        if self.vp > 1:
            parts.append(f"vp{self.vp}")
        return "-".join(parts) or "single"
