"""Logical pieces: which part of a full (unsharded, unpadded) tensor a rank holds.

Every saved tensor is addressed in *logical* coordinates, independent of the layout that wrote
it. A :class:`Piece` is a box of the full tensor (``offsets`` + ``shape``; a rank's shard is the
box :meth:`~colonnade.tensor_parallel.sharding.Sharding.box` of its coordinates), optionally
restricted to a flat range ``[start, end)`` of the box's row-major flattening (a ZeRO-1 dp
rank owns such a range of its shard). Vocabulary padding rows never appear:
a padded shard's box is cut at the logical size.

Resharding is then set algebra: a reader asked for a box intersects it with every stored box.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from colonnade.tensor_parallel.sharding import Box, Coords, Sharding

__all__ = ["Box", "Piece", "box_slices", "flat_piece", "intersect", "pad_to_local",
           "valid_part"]


@dataclass(frozen=True)
class Piece:
    """A box of a full tensor, optionally only the flat range ``flat`` of it."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    flat: tuple[int, int] | None = None

    @property
    def numel(self) -> int:
        """Elements stored for this piece."""
        if self.flat is not None:
            return self.flat[1] - self.flat[0]
        return math.prod(self.shape)

    def to_json(self) -> dict[str, object]:
        """Plain dict for the index."""
        return {"offsets": list(self.offsets), "shape": list(self.shape),
                "flat": list(self.flat) if self.flat is not None else None}


def valid_part(local: torch.Tensor, sharding: Sharding, coords: Coords) -> torch.Tensor:
    """The local shard [local_shape] without its padding rows: the values of its box."""
    _, shape = sharding.box(coords)
    for d, n in enumerate(shape):
        if local.shape[d] != n:
            local = local.narrow(d, 0, n)
    return local


def pad_to_local(valid: torch.Tensor, sharding: Sharding, coords: Coords) -> torch.Tensor:
    """Append zero padding rows so ``valid`` (the box's values) takes the local shard's shape."""
    local = sharding.local_shape(coords)
    if tuple(valid.shape) == local:
        return valid
    out = valid.new_zeros(local)
    out[tuple(slice(0, n) for n in valid.shape)] = valid
    return out


def flat_piece(sharding: Sharding, coords: Coords,
               flat: tuple[int, int] | None) -> tuple[Piece, tuple[int, int] | None]:
    """Logical piece of a flat range of the *padded* local shard, and the range kept.

    Padding rows lie at the end of the local shard's dim 0 (vocabulary), so the valid elements
    are a prefix of its flattening: the range is clipped to that prefix. Returns the piece and
    the sub-range [a, b) of ``flat`` (relative to its start) that holds valid elements, or
    ``None`` when nothing valid remains.
    """
    offsets, shape = sharding.box(coords)
    valid_numel = math.prod(shape)
    if flat is None:
        return Piece(offsets, shape), (0, valid_numel) if valid_numel else None
    local = sharding.local_shape(coords)
    if valid_numel and tuple(shape[1:]) != tuple(local[1:]):
        raise NotImplementedError(f"{sharding.key}: flat ranges over padding along a dim "
                                  f"other than 0 are not supported")
    start, end = flat[0], min(flat[1], valid_numel)
    if end <= start:
        return Piece(offsets, shape, (start, start)), None
    if start == 0 and end == valid_numel:
        return Piece(offsets, shape), (0, end - start)
    return Piece(offsets, shape, (start, end)), (0, end - start)


def intersect(a: Box, b: Box) -> Box | None:
    """Intersection of two boxes, or None when empty."""
    offs, shape = [], []
    for ao, asz, bo, bsz in zip(a[0], a[1], b[0], b[1], strict=True):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offs.append(lo)
        shape.append(hi - lo)
    return tuple(offs), tuple(shape)


def box_slices(outer: Box, inner: Box) -> tuple[slice, ...]:
    """Index of ``inner`` inside a tensor holding ``outer``."""
    return tuple(slice(io - oo, io - oo + n)
                 for oo, io, n in zip(outer[0], inner[0], inner[1], strict=True))
