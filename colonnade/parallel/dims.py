"""Parallel degrees and rank <-> coordinate maths, in two views. Pure arithmetic: no
torch.distributed.

Dense view (every non-expert weight: attention, dense MLPs, norms, embeddings). The world is

    world = tp x cp x dp x pp

and a rank order such as ``"tp-cp-dp-pp"`` lists the axes fastest-varying first, so with that
order ::

    rank = tp_i + tp * (cp_i + cp * (dp_i + dp * pp_i))

Consecutive ranks then form a tp group (the bandwidth-hungry axis stays inside a node), and pp
is the slowest axis (it crosses nodes). Any permutation of the four axes is allowed.

Expert view (the weights of mixture-of-experts layers). Expert parallelism does not multiply
the world: ep and the expert tensor-parallel degree etp are folded inside the
``S = tp x cp x dp`` ranks of one pipeline stage, and what is left is expert data parallelism ::

    edp = S / (ep x etp)            (ep x etp must divide S)

A rank's expert coordinates come from its *in-stage index* j, the rank order with pp left out
(with the default order, ``j = tp_i + tp * (cp_i + cp * dp_i)``), split etp fastest, then ep,
then edp ::

    j = etp_i + etp * (ep_i + ep * edp_i)          pp_i: the same as in the dense view

So the two views agree on pp (an expert group never leaves its pipeline stage), and with
etp = tp and tp fastest in the dense order the expert-tp groups are exactly the tp groups
(Megatron-Core's default, expert_tensor_parallel_size = tensor_model_parallel_size); with
etp = 1 each ep group spans consecutive in-stage ranks (torchtitan's ep borrowing from
dp x cp x tp). Expert weights are replicated across an edp group, whose gradients are averaged
there, as dense gradients are over dp x cp.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from colonnade.config.choices import AXES
from colonnade.config.rules_pipeline import stage_layout
from colonnade.config.sections import ParallelConfig

EXPERT_AXES: tuple[str, ...] = ("etp", "ep", "edp")
"""Axes of the expert view inside a pipeline stage, fastest-varying first (plus ``pp``, which
both views share)."""

Coords = dict[str, int]


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Degrees of every axis plus the dense rank order; ``vp`` (chunks per pp rank) is carried.

    ``tp, cp, dp, pp``: the dense axes (their product is the world). ``ep``: expert-parallel
    degree; ``etp``: expert tensor-parallel degree (None: equal to tp, normalised at
    construction). Both live inside the tp x cp x dp ranks of a stage (see the module doc).
    """

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None
    vp: int = 1
    order: tuple[str, ...] = AXES

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        if sorted(self.order) != sorted(AXES):
            raise ValueError(f"rank order {'-'.join(self.order)} must name each of "
                             f"{'-'.join(AXES)} once (the expert view is derived, not ordered)")
        for axis in (*AXES, "ep", "etp", "vp"):
            if int(getattr(self, axis)) < 1:
                raise ValueError(f"parallel.{axis}={getattr(self, axis)} must be >= 1")
        if self.stage_size % (self.ep * self.expert_tp):
            raise ValueError(
                f"ep={self.ep} x etp={self.expert_tp} must divide the tp x cp x dp = "
                f"{self.stage_size} ranks of a pipeline stage (the expert view folds them in)")

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """Build from a resolved ParallelConfig (dp may be None: derived from world_size).

        An order naming 'ep' (the pre-expert-view spelling, e.g. 'tp-cp-ep-dp-pp') loads with
        'ep' dropped; the validator accepts it only with ep = 1, where it meant nothing.
        """
        model_ranks = cfg.tp * cfg.cp * cfg.pp
        dp = cfg.dp if cfg.dp is not None else world_size // model_ranks
        order = tuple(a for a in cfg.order.split("-") if a != "ep")
        dims = cls(tp=cfg.tp, cp=cfg.cp, dp=dp, pp=cfg.pp, ep=cfg.ep, etp=cfg.expert_tp,
                   vp=cfg.vp, order=order)
        if dims.world_size != world_size:
            raise ValueError(
                f"world size {world_size} != tp x cp x dp x pp = {dims.world_size}; "
                "change parallel degrees or the number of ranks (ep does not multiply it)"
            )
        return dims

    # ------------------------------------------------------------------------- degrees

    @property
    def expert_tp(self) -> int:
        """etp as an int (never None after construction)."""
        return int(self.etp if self.etp is not None else self.tp)

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: tp x cp x dp (both views fill exactly these)."""
        return self.tp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: tp x cp x dp / (ep x etp)."""
        return self.stage_size // (self.ep * self.expert_tp)

    def degree(self, axis: str) -> int:
        """Size of one axis of either view ('tp', 'cp', 'dp', 'pp', 'etp', 'ep', 'edp')."""
        if axis == "etp":
            return self.expert_tp
        if axis == "edp":
            return self.edp
        if axis in AXES or axis == "ep":
            return int(getattr(self, axis))
        raise ValueError(f"unknown axis '{axis}'; axes are {AXES} and {EXPERT_AXES}")

    @property
    def world_size(self) -> int:
        """tp x cp x dp x pp (the dense view; ep folds inside it)."""
        return self.stage_size * self.pp

    # ------------------------------------------------------------------------- dense view

    def coords(self, rank: int) -> Coords:
        """Dense coordinates of ``rank`` along every axis of :data:`AXES`."""
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

    # ------------------------------------------------------------------------- expert view

    def in_stage_index(self, rank: int) -> int:
        """j in [0, tp x cp x dp): the dense order's mixed radix with pp left out."""
        return self._in_stage(self.coords(rank))

    def _in_stage(self, c: Coords) -> int:
        j, stride = 0, 1
        for axis in self.order:
            if axis != "pp":
                j += c[axis] * stride
                stride *= self.degree(axis)
        return j

    def expert_coords(self, rank: int) -> Coords:
        """Expert coordinates {'etp', 'ep', 'edp', 'pp'} of ``rank``:
        ``j = etp_i + etp * (ep_i + ep * edp_i)``, pp as in the dense view."""
        c = self.coords(rank)
        j = self._in_stage(c)
        etp_i, rest = j % self.expert_tp, j // self.expert_tp
        return {"etp": etp_i, "ep": rest % self.ep, "edp": rest // self.ep, "pp": c["pp"]}

    def expert_rank(self, **coords: int) -> int:
        """Inverse of :meth:`expert_coords`; axes not named are taken as 0."""
        for axis in (*EXPERT_AXES, "pp"):
            if not 0 <= coords.get(axis, 0) < self.degree(axis):
                raise ValueError(f"{axis} index {coords.get(axis, 0)} outside degree "
                                 f"{self.degree(axis)}")
        j = coords.get("etp", 0) + self.expert_tp * (
            coords.get("ep", 0) + self.ep * coords.get("edp", 0))
        dense: Coords = {"pp": coords.get("pp", 0)}
        for axis in self.order:
            if axis != "pp":
                dense[axis] = j % self.degree(axis)
                j //= self.degree(axis)
        return self.rank(**dense)

    # ------------------------------------------------------------------------- groups

    def _view(self, axes: tuple[str, ...]) -> tuple[tuple[str, ...],
                                                     Callable[[int], Coords],
                                                     Callable[..., int]]:
        """(axes, coords, rank) of the view that ``axes`` belong to."""
        expert = (*EXPERT_AXES, "pp")
        if all(a in AXES for a in axes):
            return AXES, self.coords, self.rank
        if all(a in expert for a in axes):
            return expert, self.expert_coords, self.expert_rank
        raise ValueError(f"axes {axes} mix the dense view {AXES} with the expert view "
                         f"{EXPERT_AXES} (only pp is shared)")

    def group_ranks(self, axes: tuple[str, ...] | str) -> list[list[int]]:
        """Partition of all ranks into groups that vary only along ``axes``.

        Axes of either view (not mixed, except pp): ``group_ranks("tp")`` lists every tp group,
        ``group_ranks(("dp", "cp"))`` the groups spanning dp and cp, ``group_ranks("ep")``
        every expert-parallel group. Ranks inside a group and the groups are sorted ascending.
        """
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        names, coords_of, _ = self._view(axes)
        fixed = [a for a in names if a not in axes]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):  # ascending, so each group comes out sorted
            c = coords_of(rank)
            groups.setdefault(tuple(c[a] for a in fixed), []).append(rank)
        return sorted(groups.values())

    def group_of(self, rank: int, axes: tuple[str, ...] | str) -> list[int]:
        """The group along ``axes`` (either view) that contains ``rank``."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        _, coords_of, rank_of = self._view(axes)
        base = coords_of(rank)
        members = []
        for inner in itertools.product(*(range(self.degree(a)) for a in axes)):
            members.append(rank_of(**{**base, **dict(zip(axes, inner, strict=True))}))
        return sorted(members)

    def describe(self) -> str:
        """Short layout name, e.g. 'tp2-dp2-pp2' or 'tp2-dp4-ep2-etp1' (axes of degree 1
        omitted; etp shown only when it differs from tp)."""
        parts = [f"{a}{self.degree(a)}" for a in AXES if self.degree(a) > 1]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.expert_tp != self.tp:
            parts.append(f"etp{self.expert_tp}")
        if self.vp > 1:
            parts.append(f"vp{self.vp}")
        return "-".join(parts) or "single"


def layout_text(par: ParallelConfig, described: str, num_layers: int | None = None) -> str:
    """The layout as the start-up line and the dry run name it: ``described`` (e.g.
    'pp2-vp2', :meth:`ParallelDims.describe`) and, with pp > 1, the pipeline schedule (and,
    given ``num_layers``, the layers per virtual stage of uneven stages), with
    cp > 1 how attention crosses the cp ranks (``parallel.cp_attention``, ``cp_overlap``)."""
    extra = []
    if par.pp > 1:
        extra.append(f"schedule {par.schedule}")
        uneven = stage_layout(par, num_layers) if num_layers is not None else None
        if uneven is not None:
            extra.append("layers per virtual stage " + ", ".join(map(str, uneven)))
    if par.cp > 1:
        ring = par.cp_attention == "ring" or (par.cp_attention == "hierarchical"
                                              and par.cp == (par.cp_a2a_size or 1))
        overlap = ", overlapped" if par.cp_overlap and ring else ""
        if par.cp_attention == "hierarchical":  # inner a2a x outer ring
            size = par.cp_a2a_size or 1
            overlap = f" (all_to_all {size} x ring {par.cp // size}){overlap}"
        extra.append(f"cp attention: {par.cp_attention}{overlap}")
    return f"{described} ({'; '.join(extra)})" if extra else described
