"""Which sequence rows a cp rank holds: the causal load-balanced ("zigzag") split.

A sequence of s tokens is cut into 2 cp equal chunks of n = s / (2 cp) rows; cp rank r holds
chunks r and 2cp - 1 - r, in that order, so its s / cp local rows are the global rows ::

    [r n, (r + 1) n)  followed by  [(2cp - 1 - r) n, (2cp - r) n)

Under a causal mask row i attends to i + 1 keys, so chunk c costs ~ (c + 1/2) n^2: pairing an
early chunk with its mirror gives every rank the same work, (2cp - 1 + 1) n^2 / 2 = cp n^2,
where a contiguous split would leave the last rank with ~ 2 cp - 1 times the first one's.
With cp = 1 rank 0 holds chunks 0 and 1, i.e. the whole sequence in natural order.

Every function here is pure index arithmetic; no communication.
"""

from __future__ import annotations

import torch


def check_divisible(s: int, cp: int) -> None:
    """Raise unless a sequence of ``s`` rows splits into 2 cp equal chunks."""
    if s % (2 * cp):
        raise ValueError(f"sequence length {s} must be divisible by 2 x cp = {2 * cp} "
                         "(the zigzag split's chunks); change training.seq_len or parallel.cp")


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two chunk ids (of 2 cp) that cp rank ``rank`` holds, in local order."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} out of range for cp = {cp}")
    return rank, 2 * cp - 1 - rank


def zigzag_ranges(s: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """Global [start, stop) row ranges of the rank's local rows, in local order (one range
    when the two chunks are adjacent, i.e. cp = 1)."""
    check_divisible(s, cp)
    n = s // (2 * cp)
    a, b = zigzag_chunks(cp, rank)
    if b == a + 1:
        return [(a * n, (b + 1) * n)]
    return [(a * n, (a + 1) * n), (b * n, (b + 1) * n)]


def local_ranges(ranges: list[tuple[int, int]], start: int, length: int
                 ) -> list[tuple[int, int]]:
    """Global row ranges of local rows [start, start + length) of a rank whose local rows are
    the concatenation of ``ranges`` (e.g. the sp shard of a cp rank's rows)."""
    out: list[tuple[int, int]] = []
    offset = 0
    for lo, hi in ranges:
        a, b = max(start, offset), min(start + length, offset + hi - lo)
        if a < b:
            out.append((lo + a - offset, lo + b - offset))
        offset += hi - lo
    if sum(b - a for a, b in out) != length:
        raise ValueError(f"local rows [{start}, {start + length}) exceed the rank's "
                         f"{offset} rows")
    return out


def zigzag_index(s: int, cp: int, rank: int, device: torch.device | None = None
                 ) -> torch.Tensor:
    """Global positions of the rank's local rows: int64 [s / cp]."""
    parts = [torch.arange(lo, hi, device=device) for lo, hi in zigzag_ranges(s, cp, rank)]
    return torch.cat(parts)  # [s/cp]


def take_local(x: torch.Tensor, cp: int, rank: int, dim: int) -> torch.Tensor:
    """The rank's local rows of the full-sequence tensor ``x`` along ``dim`` (x itself when
    cp = 1)."""
    if cp == 1:
        return x
    s = x.shape[dim]
    return torch.cat([x.narrow(dim, lo, hi - lo) for lo, hi in zigzag_ranges(s, cp, rank)],
                     dim=dim)


def zigzag_order(s: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """Global position of each row of the concatenation of all ranks' local rows in rank
    order (what an all-gather of the local rows over cp holds): int64 [s]. ``x[inv]`` with
    ``inv = zigzag_order(...).argsort()`` puts such a gathered tensor in natural order."""
    return torch.cat([zigzag_index(s, cp, r, device) for r in range(cp)])  # [s]
