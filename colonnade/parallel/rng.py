"""Dropout randomness that does not depend on the parallel layout: a counter-based generator.

Megatron keeps two CUDA RNG streams (one shared across tp, one per tp rank) and forks between
them. Colonnade goes one step further so that dropout runs are *exactly* reproducible across
layouts (the parity tests use that): the keep/drop decision of every element is a pure function
of where that element sits in one logical full mask,

    keep[n] = splitmix64(key + (n + 1) * G) >= p * 2**64      (as unsigned 64-bit integers)
    key     = mix(seed, site, step, microbatch)

where ``n`` is the element's row-major index in the full (one micro-batch) shape, ``site`` the
layout-independent name of the dropout (e.g. ``layers.3.attn.attn_dropout``), ``microbatch``
the *global* micro-batch index of the step (dp rank x microbatches + k) and G the golden-ratio
increment of SplitMix64 (Steele, Lea & Flood 2014): element n of a site is output n of the
SplitMix64 stream seeded with ``key``. It is evaluated with int64 tensor ops (two's-complement
wrap-around, logical shifts by masking) on the device, only on the *global indices of this
rank's slice*: its heads under tp, its sequence rows under sp, its micro-batches under dp. No
rank draws an element it does not keep, and no torch.Generator is made.

Hence the tracker's rule holds by construction: in tp-split regions (attention heads, sequence
shards under sp) ranks hold different slices, so their masks differ; in replicated regions every
tp rank evaluates the same slice, so masks agree. Recomputation sees the same (step, micro-batch)
and reproduces the masks bit for bit; a backward pass may redraw a mask instead of storing it
(:class:`MaskStream` is a plain value).

Statistics: P(keep) = 1 - round(p 2^64) / 2^64, i.e. 1 - p within 2^-64; kept elements are
scaled by 1 / (1 - p), so E[dropout(x)] = x. Memory and time: a draw is evaluated in chunks
of at most :func:`draw_chunk` elements (two int64 temporaries each) into a bool mask; on CPU
the chunks stay in cache (2^16 elements: ~4x faster than 2^22 in benchmarks/dropout_rng.py),
on a GPU they are large enough to keep the ~12 elementwise kernels per chunk busy.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
"""SplitMix64's increment (2^64 / golden ratio, odd)."""
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
"""SplitMix64's finaliser multipliers (Stafford's variant 13)."""
DRAW_CHUNK = {"cpu": 1 << 16, "other": 1 << 22}
"""Most elements evaluated at once, by device type: int64 temporaries 2 x 512 KiB on CPU
(cache-resident), 2 x 32 MiB on accelerators."""


def draw_chunk(device: torch.device) -> int:
    """Elements per evaluation chunk on ``device`` (:data:`DRAW_CHUNK`)."""
    return DRAW_CHUNK["cpu" if device.type == "cpu" else "other"]


def _signed(u: int) -> int:
    """The int64 with the bit pattern of the unsigned 64-bit ``u``."""
    u &= MASK64
    return u - (1 << 64) if u >> 63 else u


def mix64(z: int) -> int:
    """SplitMix64's finaliser on a Python int (the reference the tensor version must match)."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def _shr_(t: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift by ``k`` of int64 bit patterns (a new tensor)."""
    return (t >> k).bitwise_and_((1 << (64 - k)) - 1)


def mix64_(z: torch.Tensor) -> torch.Tensor:
    """:func:`mix64` in place on an int64 tensor of bit patterns (wrapping multiplies)."""
    z.bitwise_xor_(_shr_(z, 30)).mul_(_signed(MIX1))
    z.bitwise_xor_(_shr_(z, 27)).mul_(_signed(MIX2))
    return z.bitwise_xor_(_shr_(z, 31))


@lru_cache(maxsize=4096)
def site_hash(site: str) -> int:
    """A 64-bit hash of a site name (blake2b: independent of Python's hash seed)."""
    return int.from_bytes(hashlib.blake2b(site.encode(), digest_size=8).digest(), "little")


def stream_key(seed: int, site: str, step: int, microbatch: int) -> int:
    """The SplitMix64 seed of one site's mask in one micro-batch of one step."""
    key = mix64(seed + GOLDEN)
    for value in (site_hash(site), step, microbatch):
        key = mix64((key ^ (value & MASK64)) + GOLDEN)
    return key


def _ranges(full_shape: tuple[int, ...], index: tuple[slice, ...]) -> list[range]:
    """The global coordinates ``index`` selects along each dim of ``full_shape``."""
    if len(index) > len(full_shape):
        raise ValueError(f"index {index} has more dims than the full shape {full_shape}")
    padded = (*index, *(slice(None),) * (len(full_shape) - len(index)))
    return [range(*sl.indices(size)) for sl, size in zip(padded, full_shape, strict=True)]


@dataclass(frozen=True)
class MaskStream:
    """The keep/drop decisions of one site in one micro-batch: a value, safe to keep for a
    later (backward) redraw. ``threshold`` = round(p 2^64) - 2^63 (signed compare)."""

    key: int
    p: float

    @property
    def threshold(self) -> int:
        """Signed int64 threshold: keep iff (bits ^ 2^63) >= threshold."""
        return min(round(self.p * 2.0**64), MASK64) - (1 << 63)

    def counters(self, full_shape: tuple[int, ...], ranges: list[range],
                 device: torch.device) -> torch.Tensor:
        """key + (n + 1) G mod 2^64 for every element of the box ``ranges`` (int64, box shape).

        n = sum_i coord_i stride_i, so the term is a broadcast sum of per-dim aranges, each
        multiplied by stride_i G (mod 2^64) first.
        """
        strides = [math.prod(full_shape[i + 1:]) for i in range(len(full_shape))]
        out = torch.full((), _signed(self.key + GOLDEN), dtype=torch.int64, device=device)
        for dim, (rng, stride) in enumerate(zip(ranges, strides, strict=True)):
            coords = torch.arange(rng.start, rng.stop, rng.step, dtype=torch.int64, device=device)
            shape = [1] * len(ranges)
            shape[dim] = len(rng)
            out = out + coords.mul_(_signed(stride * GOLDEN)).view(shape)
        return out

    def keep(self, full_shape: tuple[int, ...], index: tuple[slice, ...],
             device: torch.device) -> torch.Tensor:
        """Bool keep-mask of the slice ``index`` of a ``full_shape`` mask; only that slice's
        elements are evaluated, in boxes of at most :func:`draw_chunk` elements: the outermost
        dim k whose inner dims fit is split in runs, for each coordinate of the dims before k."""
        ranges = _ranges(full_shape, index)
        shape = [len(r) for r in ranges]
        out = torch.empty(shape, dtype=torch.bool, device=device)
        if out.numel() == 0:
            return out
        limit = draw_chunk(device)
        k = next(i for i in range(len(shape)) if math.prod(shape[i + 1:]) <= limit)
        run = max(1, limit // math.prod(shape[k + 1:]))
        for outer in itertools.product(*(range(n) for n in shape[:k])):
            for lo in range(0, shape[k], run):
                box = [ranges[i][c:c + 1] for i, c in enumerate(outer)]
                box += [ranges[k][lo:lo + run], *ranges[k + 1:]]
                z = mix64_(self.counters(full_shape, box, device))
                target = out[(*outer, slice(lo, lo + run))]
                torch.ge(z.bitwise_xor_(_signed(1 << 63)).view(target.shape), self.threshold,
                         out=target)
        return out


@dataclass
class RNGTracker:
    """Source of dropout masks; the training step sets the (step, micro-batch) context."""

    seed: int
    step: int = 0
    microbatch: int = 0

    def set_context(self, step: int, microbatch: int) -> None:
        """Name the micro-batch that the next forward pass computes."""
        self.step, self.microbatch = step, microbatch

    def stream(self, site: str, p: float) -> MaskStream:
        """The mask stream of ``site`` (drop probability ``p``) in the current context."""
        return MaskStream(stream_key(self.seed, site, self.step, self.microbatch), p)

    def keep_mask(self, site: str, full_shape: tuple[int, ...], p: float,
                  index: tuple[slice, ...], device: torch.device) -> torch.Tensor:
        """This rank's slice ``index`` of the full boolean keep-mask of probability 1 - p
        (bool, the slice's shape; only the slice is evaluated)."""
        return self.stream(site, p).keep(full_shape, index, device)

    def dropout(self, x: torch.Tensor, p: float, site: str, full_shape: tuple[int, ...],
                index: tuple[slice, ...]) -> torch.Tensor:
        """Inverted dropout x * keep / (1 - p) of ``x`` (this rank's slice ``index`` of a
        ``full_shape`` tensor); autograd keeps the 1-byte bool mask for backward."""
        if p == 0.0:
            return x
        keep = self.keep_mask(site, full_shape, p, index, x.device)
        return x * keep * (1.0 / (1.0 - p))

    def state_dict(self) -> dict[str, int]:
        """Everything needed to resume (the masks are a pure function of these)."""
        return {"seed": self.seed, "step": self.step, "microbatch": self.microbatch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`."""
        self.seed, self.step, self.microbatch = state["seed"], state["step"], state["microbatch"]
