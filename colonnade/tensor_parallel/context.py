"""The parallel context shared by every layer of a rank's model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from colonnade.parallel.comm import CommGroup
from colonnade.parallel.rng import RNGTracker
from colonnade.tensor_parallel.float8 import Float8GEMM
from colonnade.tensor_parallel.sharding import Sharding, make_param, tp_coords


def is_batch_first(sp: bool, cp: int) -> bool:
    """The one rule for the residual stream's layout: [b, s, h] when neither sp nor cp splits
    the sequence (they need it on dim 0: [s(/cp)(/tp), b, h]); see
    :attr:`ParallelContext.batch_first`."""
    return cp == 1 and not sp


@dataclass
class ParallelContext:
    """What every model layer needs to know about its surroundings: the groups of the axes it
    spans, sequence parallelism, the seed and dropout RNG, parameter dtype and device.

    One value is built per rank (``models.build.parallel_context``) and shared by all layers;
    with every degree 1 the layers are ordinary layers.
    """

    group: CommGroup
    """The tp group."""
    sp: bool
    """Sequence parallelism on: activations between tp regions are [s/tp, b, h]."""
    seed: int
    """Run seed (initialisation and dropout)."""
    rng: RNGTracker
    """Dropout mask source."""
    dtype: torch.dtype = torch.float32
    """Parameter dtype."""
    device: torch.device | None = None
    """Parameter device."""
    param_device: torch.device | None = None
    """Where parameters are built when not ``device``: 'meta' for ZeRO-3's deferred init
    (each is materialised on ``device`` later from its ``init_recipe``)."""
    comm_chunks: int = 1
    """Chunks for overlapping sp collectives with matmuls (1: off)."""
    cp: CommGroup | None = None
    """The cp group (context parallelism: the sequence split across its ranks; one rank while
    cp = 1); None in a context made without process groups."""
    cp_attention: str = "ring"
    """How attention spans the cp ranks when cp > 1: 'ring', 'all_to_all' or 'hierarchical'
    (``parallel.cp_attention``)."""
    cp_a2a: CommGroup | None = None
    """Hierarchical cp's inner all-to-all group (None unless cp_attention='hierarchical')."""
    cp_ring: CommGroup | None = None
    """Hierarchical cp's outer ring group (None unless cp_attention='hierarchical')."""
    cp_overlap: bool = True
    """Ring attention overlaps each key/value transfer with the current block's compute
    (``parallel.cp_overlap``)."""
    ep: CommGroup | None = None
    """The expert-parallel group (token all-to-all of mixture-of-experts layers, see
    :class:`~colonnade.parallel.dims.ParallelDims`' expert view); None without expert groups."""
    expert_tp: CommGroup | None = None
    """The expert tensor-parallel group: the ranks holding slices (column-parallel gate/up,
    row-parallel down) of the same experts, folded with ep inside the stage (Megatron's MoE
    parallel folding); None or one rank: whole experts."""
    moe_dispatcher: str = "all_to_all"
    """How mixture-of-experts layers move tokens to their experts' ep ranks: 'all_to_all' or
    'all_gather' (``parallel.moe_dispatcher``)."""
    fp8: str = "off"
    """Float8 GEMMs in the linear layers: 'off', 'tensorwise' or 'rowwise'
    (``training.fp8``, :mod:`colonnade.tensor_parallel.float8`)."""
    moe: Any = None
    """The mutable mixture-of-experts state of this rank (a
    :class:`colonnade.moe.state.MoEState`: the aux-loss gradient scale the training step sets,
    the per-layer statistics sink), or None: MoE layers then attach no auxiliary loss and record
    nothing (evaluation, generation, tests of a bare layer). Typed ``Any`` because the moe
    package sits above this one (tests/test_layering.py)."""

    @property
    def tp(self) -> int:
        """tp degree."""
        return self.group.size

    @property
    def tp_rank(self) -> int:
        """This rank's index in tp."""
        return self.group.rank

    @property
    def ep_size(self) -> int:
        """ep degree (1 without an ep group)."""
        return self.ep.size if self.ep is not None else 1

    @property
    def ep_rank(self) -> int:
        """This rank's index in ep (0 without an ep group)."""
        return self.ep.rank if self.ep is not None else 0

    @property
    def etp_size(self) -> int:
        """Expert tp degree (1 without an expert_tp group)."""
        return self.expert_tp.size if self.expert_tp is not None else 1

    @property
    def etp_rank(self) -> int:
        """This rank's index in expert tp (0 without an expert_tp group)."""
        return self.expert_tp.rank if self.expert_tp is not None else 0

    @property
    def cp_size(self) -> int:
        """cp degree (1 without a cp group)."""
        return self.cp.size if self.cp is not None else 1

    @property
    def cp_rank(self) -> int:
        """This rank's index in cp (0 without a cp group)."""
        return self.cp.rank if self.cp is not None else 0

    @property
    def batch_first(self) -> bool:
        """The residual stream's layout: [b, s, h] when True (cp = 1 without sp), else
        [s(/cp)(/tp), b, h]. sp and cp split the sequence, so they need it on dim 0; without
        them the model runs batch-first throughout, as PyTorch's attention kernels want (see
        :class:`~colonnade.models.blocks.Attention`), with no transpose anywhere. Pipeline
        messages, dropout masks (drawn in the [s, b, h] order, so every layout draws the
        same mask) and mixture-of-experts token order (kept in [s, b] order) follow it."""
        return is_batch_first(self.sp, self.cp_size)

    def float8(self, group: CommGroup | None, split: str) -> Float8GEMM | None:
        """How a linear whose ``split`` dim ('n' output, 'k' input, 'none') is split over
        ``group`` runs its GEMMs in float8; None while ``fp8`` is 'off'."""
        if self.fp8 == "off":
            return None
        return Float8GEMM(self.fp8, group, split)

    def param(self, sharding: Sharding, std: float, kind: str = "normal") -> nn.Parameter:
        """A parameter holding this rank's shard (its coordinates on the axes that split
        parameters: tp today) of its seeded full initial value."""
        return make_param(sharding, tp_coords(self.tp_rank, self.tp), self.seed, std, kind,
                          self.dtype, self.param_device or self.device, self.device)

    def expert_param(self, sharding: Sharding, std: float, kind: str = "normal"
                     ) -> nn.Parameter:
        """A routed-expert parameter: this rank's shard on the expert view's axes (coordinates
        ``{"ep": (ep_rank, ep), "tp": (etp_rank, etp)}``: a "tp" split of an expert weight is
        a split over the expert tp group) of its seeded full initial value, identical in
        every layout."""
        coords = {"ep": (self.ep_rank, self.ep_size), "tp": (self.etp_rank, self.etp_size)}
        return make_param(sharding, coords, self.seed, std, kind, self.dtype,
                          self.param_device or self.device, self.device)
