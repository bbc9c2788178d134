"""Logical pieces: which part of a full (unsharded, unpadded) tensor a rank holds.

Every saved tensor is addressed in *logical* coordinates, independent of the layout that wrote
it. A :class:`Piece` is a box of the full tensor (``offsets`` + ``shape``; a tp shard is a box
along the sharded dim), optionally restricted to a flat range ``[start, end)`` of the box's
row-major flattening (a ZeRO-1 dp rank owns such a range of its tp shard). Vocabulary padding
rows never appear: a padded shard's box is cut at the logical size.

Resharding is then set algebra: a reader asked for a box intersects it with every stored box.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from colonnade.tensor_parallel.sharding import Sharding

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


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


def shard_box(sharding: Sharding, tp_rank: int, tp: int) -> Box:
    """The box of the full tensor held by tp rank ``tp_rank`` (padding rows cut off).

    A shard made only of padding has an empty box (a zero in its shape).
    """
    full = sharding.full_shape
    if sharding.dim is None or tp == 1:
        return (0,) * len(full), full
    d = sharding.dim
    local = sharding.local_shape(tp)[d]
    start = min(tp_rank * local, full[d])
    end = min(start + local, full[d])
    offsets = tuple(start if i == d else 0 for i in range(len(full)))
    shape = tuple(end - start if i == d else n for i, n in enumerate(full))
    return offsets, shape


def valid_part(local: torch.Tensor, sharding: Sharding, tp_rank: int, tp: int) -> torch.Tensor:
    """The local shard [local_shape] without its padding rows: the box's values."""
    _, shape = shard_box(sharding, tp_rank, tp)
    if sharding.dim is None or tuple(local.shape) == shape:
        return local
    return local.narrow(sharding.dim, 0, shape[sharding.dim])


def pad_to_local(valid: torch.Tensor, sharding: Sharding, tp: int) -> torch.Tensor:
    """Append zero padding rows so ``valid`` (the box) takes the local shard's shape."""
    local = sharding.local_shape(tp)
    if tuple(valid.shape) == local:
        return valid
    d = sharding.dim
    assert d is not None
    pad = list(valid.shape)
    pad[d] = local[d] - valid.shape[d]
    return torch.cat([valid, valid.new_zeros(pad)], dim=d)


def flat_piece(sharding: Sharding, tp_rank: int, tp: int,
               flat: tuple[int, int] | None) -> tuple[Piece, tuple[int, int] | None]:
    """Logical piece of a flat range of the *padded* local shard, and the range kept.

    Padding rows lie at the end of dim 0 (vocabulary), so the valid elements are a prefix of
    the local shard's flattening: the range is clipped to that prefix. Returns the piece and
    the sub-range [a, b) of ``flat`` (relative to its start) that holds valid elements, or
    ``None`` when nothing valid remains.
    """
    offsets, shape = shard_box(sharding, tp_rank, tp)
    valid_numel = math.prod(shape)
    if flat is None:
        return Piece(offsets, shape), (0, valid_numel) if valid_numel else None
    if sharding.padded_rows and sharding.dim not in (0, None):
        raise NotImplementedError(f"{sharding.key}: flat ranges over padding along dim "
                                  f"{sharding.dim} are not supported")
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
