"""Sharding declarations: each parameter says once, per axis, how it is split.

A :class:`Sharding` is attached to every parameter as ``param.sharding``. Initialisation,
checkpoint pieces and resharding, HF loading, full-tensor export, gradient reductions and the
gradient-norm ownership all derive from it:

* ``key``: the layout-independent global name; it seeds initialisation and names the
  checkpoint tensor;
* ``full_shape``: the logical (unsharded, unpadded) shape;
* ``splits``: ``((axis, dim), ...)``, which tensor dim each parallel axis splits ("tp" today;
  "ep", "dp_shard", "cp" tomorrow), outermost first. An expert weight [E, f, h] would say
  ``(("ep", 0), ("tp", 1))``. ``dim=d`` is the shorthand for a tp split of dim d (appended
  last, i.e. innermost); every axis not named replicates the parameter;
* ``padded_rows``: zero rows appended along the tp dim before splitting (vocabulary padding
  to a multiple of tp);
* ``sp_partial_grad``: a tp-replicated parameter whose gradient is only a partial sum under
  sequence parallelism (norm weights, row-parallel biases): it is all-reduced across tp;
* ``tp_partial_grad``: a tp-replicated parameter applied to each of the rank's tp-split heads
  (Qwen3's q/k norm weights [d]), so its gradient is a partial sum over the heads of every tp
  rank with or without sp: it is always all-reduced across tp;
* ``tied_copy``: the last pipeline stage's copy of a tied parameter (the output head tied to
  the word embedding): same key (so same initial value and checkpoint name), gradient summed
  with the first stage's over the embedding group, never saved nor counted in the norm.

Rank coordinates are ``{axis: (index, degree)}`` (:data:`Coords`); an axis left out has degree
1. Along a dim of padded size P split by axes a_1..a_k (declared order, outermost first) of
degrees n_1..n_k, the rank with indices i_1..i_k holds the block number
``b = (..(i_1 n_2 + i_2) n_3 + ..) n_k + i_k`` of ``n = n_1 .. n_k`` equal blocks: rows
``[b P/n, (b+1) P/n)``. :meth:`Sharding.slice` gives that box (padded coordinates),
:meth:`Sharding.box` the same box cut at the logical size (what a checkpoint stores).

Initialisation builds only this rank's shard, yet every layout starts from bit-identical
weights: the full tensor is tiled along the *tiling dim* (the first split's dim, 0 when
replicated) into blocks of :func:`block_len` indices, a length fixed by the full shape alone;
block j holds normal(0, std) values drawn in float64 from a generator seeded by (seed, key, j),
cast to the parameter's dtype. A rank draws only the blocks overlapping its slice along the
tiling dim, narrows them to its box in every dim, and writes them into the shard on its
device; padding rows are zeros. Peak memory is the shard plus one float64 block
(:data:`BLOCK_ELEMENTS`), not the full tensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

Coords = Mapping[str, tuple[int, int]]
"""A rank's place on the parallel axes: axis name -> (index, degree)."""

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""(offsets, lengths) of a block of a tensor."""


def tp_coords(tp_rank: int, tp: int) -> dict[str, tuple[int, int]]:
    """The coordinates of a rank that only has a tp place: ``{"tp": (tp_rank, tp)}``."""
    return {"tp": (tp_rank, tp)}


@dataclass(frozen=True)
class Sharding:
    """How one parameter is laid out across the parallel axes (see the module docstring)."""

    key: str
    """Layout-independent global name (initialisation seed, checkpoint name)."""
    full_shape: tuple[int, ...]
    """Logical, unsharded and unpadded shape."""
    dim: int | None = None
    """The dim split over tp (shorthand for a ("tp", dim) split; None: not split over tp)."""
    padded_rows: int = 0
    """Zero rows appended along the tp dim before splitting (vocabulary padding)."""
    sp_partial_grad: bool = False
    """tp-replicated, but the gradient is a partial sum under sp: all-reduced across tp."""
    tp_partial_grad: bool = False
    """tp-replicated, applied to tp-split heads: the gradient is a partial sum over each rank's
    heads whatever sp, all-reduced across tp (:attr:`partial_over_tp`)."""
    tied_copy: bool = False
    """A later pipeline stage's copy of the first stage's parameter of the same key."""
    splits: tuple[tuple[str, int], ...] = ()
    """(axis, dim) per splitting axis, outermost first; ``dim`` adds ("tp", dim) last."""

    def __post_init__(self) -> None:
        splits = tuple(self.splits)
        if self.dim is not None and ("tp", self.dim) not in splits:
            if any(axis == "tp" for axis, _ in splits):
                raise ValueError(f"{self.key}: dim={self.dim} and a tp split in {splits}")
            splits += (("tp", self.dim),)
        axes = [axis for axis, _ in splits]
        if len(set(axes)) != len(axes):
            raise ValueError(f"{self.key}: an axis splits twice in {splits}")
        for axis, d in splits:
            if not 0 <= d < len(self.full_shape):
                raise ValueError(f"{self.key}: {axis} splits dim {d} of shape {self.full_shape}")
        if self.padded_rows and "tp" not in axes:
            raise ValueError(f"{self.key}: padded_rows needs a tp split")
        object.__setattr__(self, "splits", splits)
        object.__setattr__(self, "dim", dict(splits).get("tp"))

    @property
    def partial_over_tp(self) -> bool:
        """This rank's gradient is a partial sum to be all-reduced across tp after backward
        (``sp_partial_grad`` or ``tp_partial_grad``)."""
        return self.sp_partial_grad or self.tp_partial_grad

    @property
    def split_axes(self) -> tuple[str, ...]:
        """The axes splitting this parameter, outermost first."""
        return tuple(axis for axis, _ in self.splits)

    @property
    def padded_shape(self) -> tuple[int, ...]:
        """``full_shape`` with the padding rows along the tp dim."""
        shape = list(self.full_shape)
        if self.dim is not None:
            shape[self.dim] += self.padded_rows
        return tuple(shape)

    @property
    def tiling_dim(self) -> int:
        """The dim initialisation blocks tile: the first split's dim (0 when replicated)."""
        return self.splits[0][1] if self.splits else 0

    def replicated_axes(self, coords: Coords) -> tuple[str, ...]:
        """The axes of ``coords`` whose ranks hold identical copies (those not splitting it)."""
        return tuple(axis for axis in coords if axis not in self.split_axes)

    def owns(self, coords: Coords) -> bool:
        """Whether this rank is the one that saves (and counts in the norm) its piece: index 0
        on every replicated axis, and not a tied copy."""
        return not self.tied_copy and all(coords[a][0] == 0 for a in self.replicated_axes(coords))

    def slice(self, coords: Coords) -> Box:
        """(offsets, lengths) of this rank's shard in the *padded* full tensor."""
        offsets, lengths = [0] * len(self.full_shape), list(self.padded_shape)
        for d in range(len(lengths)):
            block, count = 0, 1
            for axis, sd in self.splits:
                if sd == d:
                    index, degree = coords.get(axis, (0, 1))
                    block, count = block * degree + index, count * degree
            if lengths[d] % count:
                raise ValueError(f"{self.key}: dim {d} of size {lengths[d]} not divisible by "
                                 f"the {count} ranks splitting it ({dict(coords)})")
            lengths[d] //= count
            offsets[d] = block * lengths[d]
        return tuple(offsets), tuple(lengths)

    def local_shape(self, coords: Coords) -> tuple[int, ...]:
        """Shape of this rank's shard (padding included)."""
        return self.slice(coords)[1]

    def box(self, coords: Coords) -> Box:
        """This rank's slice cut at the logical shape: the part of the full tensor it holds
        (a shard made only of padding has a zero length)."""
        offsets, lengths = self.slice(coords)
        cut = tuple(max(0, min(o + n, f) - o) for o, n, f in
                    zip(offsets, lengths, self.full_shape, strict=True))
        return tuple(min(o, f) for o, f in zip(offsets, self.full_shape, strict=True)), cut

    def shard(self, full: torch.Tensor, coords: Coords) -> torch.Tensor:
        """Cut this rank's shard out of the full tensor (padding with zeros first)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"{self.key}: expected full shape {self.full_shape}, got "
                             f"{tuple(full.shape)}")
        if self.padded_rows:
            assert self.dim is not None
            pad_shape = list(full.shape)
            pad_shape[self.dim] = self.padded_rows
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=self.dim)
        out = full
        for d, (o, n) in enumerate(zip(*self.slice(coords), strict=True)):
            out = out.narrow(d, o, n)
        return out.clone()

    def layout(self, degrees: Mapping[str, int]) -> list[dict[str, tuple[int, int]]]:
        """Every shard's coordinates over the splitting axes, row-major in declared order
        (the last axis fastest): the order :meth:`unshard` takes shards in."""
        axes = self.split_axes
        sizes = [degrees.get(a, 1) for a in axes]
        return [{a: (i, n) for a, i, n in zip(axes, index, sizes, strict=True)}
                for index in itertools.product(*(range(n) for n in sizes))]

    def unshard(self, shards: Sequence[torch.Tensor],
                degrees: Mapping[str, int] | None = None) -> torch.Tensor:
        """Inverse of :meth:`shard`: the logical full tensor from every shard, in
        :meth:`layout` order (``degrees`` default: ``{"tp": len(shards)}``); a parameter that
        no axis of ``degrees`` splits is (a copy of) ``shards[0]`` (the others are its copies).
        The result never aliases a shard."""
        places = self.layout({"tp": len(shards)} if degrees is None else degrees)
        if len(places) == 1:  # not split: every shard is the whole (padded) tensor
            full = shards[0]
        elif len(places) != len(shards):
            raise ValueError(f"{self.key}: {len(shards)} shards for {len(places)} places")
        else:
            full = shards[0].new_empty(self.padded_shape)
            for coords, shard in zip(places, shards, strict=True):
                offsets, lengths = self.slice(coords)
                full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))] = shard
        for d, n in enumerate(self.full_shape):
            full = full.narrow(d, 0, n)
        return full.clone() if len(places) == 1 else full


def seed_for(seed: int, key: str) -> int:
    """A stable 63-bit seed from the run seed and a parameter's global name."""
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)


BLOCK_ELEMENTS = 1 << 18
"""Elements (about) of one initialisation block: 2 MiB of float64."""


def block_len(sharding: Sharding) -> int:
    """Indices along the tiling dim per initialisation block; depends on the full shape (and
    the declared tiling dim) only, so the tiling is the same in every layout."""
    dim = sharding.tiling_dim
    inner = math.prod(sharding.full_shape) // max(1, sharding.full_shape[dim])
    return max(1, BLOCK_ELEMENTS // max(1, inner))


def _block(sharding: Sharding, seed: int, std: float, index: int, length: int,
           scratch: torch.Tensor) -> torch.Tensor:
    """Block ``index`` (``length`` indices along the tiling dim, every other dim whole) of
    normal(0, std) values, drawn in float64 into the front of ``scratch`` (one buffer per
    parameter, so the allocator is not left with a trail of freed blocks)."""
    shape = list(sharding.full_shape)
    shape[sharding.tiling_dim] = length
    gen = torch.Generator().manual_seed(seed_for(seed, f"{sharding.key}#block{index}"))
    return scratch[:math.prod(shape)].view(shape).normal_(0.0, std, generator=gen)


def _fill_normal(out: torch.Tensor, sharding: Sharding, box: Box, seed: int,
                 std: float) -> None:
    """Write the values of ``box`` (logical coordinates; ``out`` starts at its offsets) from
    the seeded blocks overlapping it along the tiling dim."""
    t, (offsets, lengths) = sharding.tiling_dim, box
    full = sharding.full_shape
    start, real = offsets[t], lengths[t]
    step = block_len(sharding)
    blocks = range(start // step, -(-(start + real) // step)) if real else range(0)
    inner = math.prod(full) // max(1, full[t])
    scratch = torch.empty(min(step, full[t]) * inner if blocks else 0, dtype=torch.float64)
    for index in blocks:
        lo, hi = max(start, index * step), min(start + real, (index + 1) * step)
        block = _block(sharding, seed, std, index, min(step, full[t] - index * step), scratch)
        block = block.narrow(t, lo - index * step, hi - lo)
        dst = out.narrow(t, lo - start, hi - lo)
        for d in range(len(full)):
            if d != t:
                block = block.narrow(d, offsets[d], lengths[d])
                dst = dst.narrow(d, 0, lengths[d])
        dst.copy_(block)


def init_shard(sharding: Sharding, coords: Coords, seed: int, std: float,
               kind: str = "normal", dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
    """This rank's shard of the initial value (normal(0, std), ones or zeros), built directly
    in ``dtype`` on ``device`` from the blocks that overlap it; equal, in every layout, to the
    matching slice of :func:`init_full`. Padding rows are zeros."""
    local = sharding.local_shape(coords)
    box = sharding.box(coords)
    if kind == "ones":
        out = torch.ones(local, dtype=dtype, device=device)
    elif kind == "zeros":
        out = torch.zeros(local, dtype=dtype, device=device)
    elif kind == "normal":
        out = torch.empty(local, dtype=dtype, device=device)
        _fill_normal(out, sharding, box, seed, std)
    else:
        raise ValueError(f"{sharding.key}: unknown init kind '{kind}' (normal, ones, zeros)")
    for d, (n, real) in enumerate(zip(local, box[1], strict=True)):
        if real < n:
            out.narrow(d, real, n - real).zero_()  # vocab padding rows
    return out


def init_full(sharding: Sharding, seed: int, std: float, kind: str = "normal",
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full (unpadded) initial value of a parameter, as every layout's shards make it."""
    return init_shard(dataclasses.replace(sharding, padded_rows=0), {}, seed, std, kind, dtype)


@dataclass(frozen=True)
class InitRecipe:
    """How a parameter's initial shard is made: the arguments of :func:`init_shard` (attached
    to every parameter as ``param.init_recipe`` by :func:`make_param`), so a parameter built
    on the meta device is materialised later, one at a time (:func:`initial_value`)."""

    coords: tuple[tuple[str, tuple[int, int]], ...]
    """The rank's coordinates (``dict(coords)`` gives :data:`Coords`)."""
    seed: int
    """Run seed."""
    std: float
    """Standard deviation of a normal init."""
    kind: str
    """'normal', 'ones' or 'zeros'."""
    dtype: torch.dtype
    """Parameter dtype."""
    device: torch.device | None
    """Where the value is materialised (None: the default device)."""


def make_param(sharding: Sharding, coords: Coords, seed: int, std: float,
               kind: str = "normal", dtype: torch.dtype = torch.float32,
               device: torch.device | None = None,
               materialise_on: torch.device | None = None) -> torch.nn.Parameter:
    """A parameter holding this rank's shard of the seeded initial value, built on its own
    (on the meta device: the shard's shape only, nothing initialised, e.g. for
    ``train --dry-run`` or ZeRO-3's deferred init). Its recipe is attached as
    ``param.init_recipe`` (materialised on ``materialise_on``, default ``device``)."""
    meta = device is not None and torch.device(device).type == "meta"
    if meta:
        value = torch.empty(sharding.local_shape(coords), dtype=dtype, device="meta")
    else:
        value = init_shard(sharding, coords, seed, std, kind, dtype, device)
    param = torch.nn.Parameter(value)
    param.sharding = sharding  # type: ignore[attr-defined]
    target = materialise_on if materialise_on is not None else (None if meta else device)
    param.init_recipe = InitRecipe(  # type: ignore[attr-defined]
        tuple(sorted(coords.items())), seed, std, kind, dtype,
        torch.device(target) if target is not None else None)
    return param


def initial_value(param: torch.nn.Parameter) -> torch.Tensor:
    """The initial shard [local_shape] of a parameter made by :func:`make_param` (a meta one
    included), built from its recipe on the recipe's device: bit-identical to what
    :func:`make_param` builds directly, in every layout."""
    recipe: InitRecipe | None = getattr(param, "init_recipe", None)
    if recipe is None:
        raise ValueError(f"{getattr(param, 'sharding', None)}: a parameter without an init "
                         "recipe (not made by make_param) cannot be materialised")
    return init_shard(param.sharding, dict(recipe.coords), recipe.seed,  # type: ignore[attr-defined]
                      recipe.std, recipe.kind, recipe.dtype, recipe.device)


def output_std(std: float, num_layers: int) -> float:
    """Megatron's scaled init of output projections: std / sqrt(2 * layers)."""
    return std / math.sqrt(2.0 * num_layers)
