"""Read planning: which bytes of which stored pieces a request needs, and nothing more.

A request is a box ``R`` of a logical tensor (:data:`~colonnade.checkpoint.pieces.Box`),
optionally only the flat range ``[a, b)`` of ``R``'s row-major flattening (a ZeRO-1 rank's part
of its tp shard). The checkpoint stores pieces: boxes ``S`` of the full tensor, each either
whole (stored with shape ``S``) or a flat range ``[c, d)`` of ``S``'s flattening (stored 1-D).

:func:`plan_reads` turns a request into :class:`PieceRead` s, each one rectangular slice of one
stored tensor (what ``safe_open(...).get_slice(name)[src]`` reads), and where it lands in the
output: a box of the ``R``-shaped output (``flat_dst=False``) or a slice of the flat output.
The planned element count is exactly the request's element count: a tp shard's resume reads
its box, a ZeRO-1 rank its range, whatever layout wrote the checkpoint. The reader
(:class:`~colonnade.checkpoint.format.CheckpointReader`) only executes plans, so what the
4096-rank counting test sums is what a rank reads.

Method: for every stored box ``S`` meeting ``R`` in ``C = S ∩ R``, ``C`` is cut into *runs*
contiguous in the flattening of ``S``, of ``R`` and of ``C`` alike (all dims after the last dim
where ``C`` is narrower than ``S`` or ``R`` are whole, so a run is ``prod(C.shape[j:])``
elements). A run is clipped to ``[a, b)`` and to each stored piece's ``[c, d)``; on a whole
(box-shaped) stored piece a flat range becomes at most ``2 ndim - 1`` rectangular blocks
(:func:`flat_blocks`). A whole-box request of a whole stored piece is one box slice.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from colonnade.checkpoint.pieces import Box, box_slices, intersect

Index = tuple[slice, ...]


@dataclass(frozen=True)
class PieceRead:
    """One rectangular read of one stored tensor and where its values go."""

    piece: dict[str, Any]
    """The stored piece's index entry (file, tensor, offsets, shape, flat, crc32)."""
    src: Index
    """Index into the stored tensor (1-D for a flat piece)."""
    dst: Index
    """Box of the R-shaped output, or (``flat_dst``) one slice of the flat output."""
    flat_dst: bool
    numel: int
    whole: bool
    """The read covers the whole stored tensor (its crc32 can be checked)."""


def stored_numel(piece: dict[str, Any]) -> int:
    """Elements stored for a piece."""
    if piece["flat"] is not None:
        return piece["flat"][1] - piece["flat"][0]
    return math.prod(piece["shape"])


def flat_blocks(shape: tuple[int, ...], lo: int, hi: int) -> Iterator[Index]:
    """Rectangular blocks covering elements [lo, hi) of a row-major tensor of ``shape``, in
    order (each block's elements are contiguous in the flattening); at most 2 ndim - 1."""
    if lo >= hi:
        return
    if len(shape) <= 1:
        yield (slice(lo, hi),) if shape else ()
        return
    inner = math.prod(shape[1:])
    r0, o0 = divmod(lo, inner)
    r1, o1 = divmod(hi, inner)
    if r0 == r1:
        for sub in flat_blocks(shape[1:], o0, o1):
            yield (slice(r0, r0 + 1), *sub)
        return
    if o0:
        for sub in flat_blocks(shape[1:], o0, inner):
            yield (slice(r0, r0 + 1), *sub)
        r0 += 1
    if r1 > r0:
        yield (slice(r0, r1), *(slice(0, n) for n in shape[1:]))
    if o1:
        for sub in flat_blocks(shape[1:], 0, o1):
            yield (slice(r1, r1 + 1), *sub)


def _runs(stored: Box, want: Box, common: Box) -> Iterator[tuple[int, int, int]]:
    """(start in S-flat, start in R-flat, length) of the runs of ``common`` (see module doc)."""
    (s_off, s_shape), (r_off, r_shape), (c_off, c_shape) = stored, want, common
    ndim = len(c_shape)
    j = 0
    for d in range(ndim):
        if c_shape[d] != s_shape[d] or c_shape[d] != r_shape[d]:
            j = d
    length = math.prod(c_shape[j:])
    outer = c_shape[:j]
    s_strides = [math.prod(s_shape[d + 1:]) for d in range(ndim)]
    r_strides = [math.prod(r_shape[d + 1:]) for d in range(ndim)]
    for k in range(math.prod(outer)):
        idx, rest = [], k
        for n in reversed(outer):
            rest, i = divmod(rest, n)
            idx.append(i)
        idx.reverse()
        pos = idx + [0] * (ndim - j)
        s = sum((c_off[d] - s_off[d] + pos[d]) * s_strides[d] for d in range(ndim))
        r = sum((c_off[d] - r_off[d] + pos[d]) * r_strides[d] for d in range(ndim))
        yield s, r, length


def _piece_reads(piece: dict[str, Any], stored: Box, s_lo: int, s_hi: int,
                 dst_lo: int) -> Iterator[PieceRead]:
    """Reads of elements [s_lo, s_hi) of S-flat from one piece, landing at flat ``dst_lo``."""
    numel_s = math.prod(stored[1])
    c, d = piece["flat"] if piece["flat"] is not None else (0, numel_s)
    lo, hi = max(s_lo, c), min(s_hi, d)
    if lo >= hi:
        return
    at = dst_lo + lo - s_lo
    whole_piece = lo == c and hi == d
    if piece["flat"] is not None:
        yield PieceRead(piece, (slice(lo - c, hi - c),), (slice(at, at + hi - lo),), True,
                        hi - lo, whole_piece)
        return
    for block in flat_blocks(stored[1], lo, hi):
        n = math.prod(s.stop - s.start for s in block)
        yield PieceRead(piece, block, (slice(at, at + n),), True, n, whole_piece)
        at += n


def plan_reads(pieces: list[dict[str, Any]], want: Box,
               flat: tuple[int, int] | None = None) -> tuple[list[PieceRead], int]:
    """The reads of box ``want`` (only its flat range ``flat`` when given) from ``pieces`` (a
    tensor's index entries); returns them and the number of requested elements they cover."""
    numel_r = math.prod(want[1])
    a, b = flat if flat is not None else (0, numel_r)
    reads: list[PieceRead] = []
    covered = 0
    by_box: dict[Box, list[dict[str, Any]]] = {}
    for p in pieces:
        by_box.setdefault((tuple(p["offsets"]), tuple(p["shape"])), []).append(p)
    for stored, parts in by_box.items():
        common = intersect(stored, want)
        if common is None:
            continue
        if flat is None and len(parts) == 1 and parts[0]["flat"] is None:
            p = parts[0]
            n = math.prod(common[1])
            reads.append(PieceRead(p, box_slices(stored, common), box_slices(want, common),
                                   False, n, common == stored))
            covered += n
            continue
        for s_start, r_start, length in _runs(stored, want, common):
            lo, hi = max(r_start, a), min(r_start + length, b)
            if lo >= hi:
                continue
            s_lo = s_start + lo - r_start
            for p in parts:
                for r in _piece_reads(p, stored, s_lo, s_lo + hi - lo, lo - a):
                    reads.append(r)
                    covered += r.numel
    return reads, covered
