"""Contiguous parameter and gradient buffers, in backward order, cut into buckets.

Every parameter of a rank's model chunks becomes a view into one flat parameter buffer
``param_data`` [N] (model dtype) and its gradient a view ``param.main_grad`` into one flat
gradient buffer ``grad_data`` [N] (fp32, or fp64 for fp64 models). Parameters are laid out in
*backward* order (last layer first), so the gradients backward produces first are contiguous at
the start of the buffer.

The buffer is cut into buckets (tensor fusion): parameters are appended to the open bucket
until it holds at least ``bucket_size`` elements; then it is closed. A bucket never spans two
model chunks (virtual pipeline stages finish backward at different times), and a parameter named
in ``isolate`` gets a bucket of its own (tied embedding/head weights with pp > 1, so the first
and last stage lay them out identically and their ZeRO shards coincide).

Sharding (ZeRO-1): with ``shard_count = n`` every bucket is padded with zeros to a multiple of
``n * ALIGN`` elements, so dp rank r owns the equal, aligned range
``[start + r L, start + (r + 1) L)``, ``L = size / n`` of each bucket. The padding is below
``n * ALIGN`` elements per bucket: at most ``buckets * n * ALIGN`` elements in all. Without
sharding (``shard_count = 1``) nothing is padded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

ALIGN = 64
"""Each dp rank's range starts at a multiple of ALIGN elements (256 bytes in fp32)."""


@dataclass
class Bucket:
    """A contiguous range [start, end) of the buffers and the parameters inside it."""

    index: int
    start: int
    end: int
    chunk: int
    params: list[nn.Parameter] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements in the bucket, padding included."""
        return self.end - self.start


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives: [start, end) of the flat buffers, and its bucket."""

    start: int
    end: int
    bucket: int


def grad_dtype_for(param_dtype: torch.dtype) -> torch.dtype:
    """Main-gradient dtype: fp64 for fp64 models, fp32 otherwise."""
    return torch.float64 if param_dtype == torch.float64 else torch.float32


def param_key(param: nn.Parameter) -> str:
    """The layout-independent name of a parameter (its sharding key) or a placeholder."""
    sharding = getattr(param, "sharding", None)
    return sharding.key if sharding is not None else f"<param {tuple(param.shape)}>"


class FlatBuffers:
    """Flat parameter and gradient buffers of a rank's chunks, with buckets and dp ranges.

    ``chunk_params[c]`` lists chunk c's parameters in forward order, each parameter once over
    all chunks. After construction each parameter's ``.data`` is a view of ``param_data`` (its
    values copied) and ``param.main_grad`` a view of ``grad_data``.
    """

    def __init__(self, chunk_params: Sequence[Sequence[nn.Parameter]], bucket_size: int,
                 shard_count: int = 1, isolate: frozenset[str] = frozenset()) -> None:
        if bucket_size < 1:
            raise ValueError(f"parallel.bucket_size={bucket_size} must be >= 1 element")
        if shard_count < 1:
            raise ValueError(f"shard_count={shard_count} must be >= 1")
        params = [p for group in chunk_params for p in group]
        if not params:
            raise ValueError("no parameters to put into data-parallel buffers")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"parameters have several dtypes {sorted(map(str, dtypes))}; "
                             "the buffers hold one model dtype")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("a parameter is listed twice; pass each parameter once")
        self.shard_count, self.bucket_size, self.isolate = shard_count, bucket_size, isolate
        self.param_dtype = params[0].dtype
        self.grad_dtype = grad_dtype_for(self.param_dtype)
        self.params = params
        self.num_params = sum(p.numel() for p in params)
        self.buckets, self.slots = self._layout(chunk_params)
        self.numel = self.buckets[-1].end
        device = params[0].device
        self.param_data = torch.zeros(self.numel, dtype=self.param_dtype, device=device)  # [N]
        self.grad_data = torch.zeros(self.numel, dtype=self.grad_dtype, device=device)  # [N]
        self._attach()

    def _pad(self, size: int) -> int:
        unit = self.shard_count * ALIGN if self.shard_count > 1 else 1
        return -(-size // unit) * unit

    def _layout(self, chunk_params: Sequence[Sequence[nn.Parameter]]
                ) -> tuple[list[Bucket], dict[int, Slot]]:
        """Backward order: chunks last to first, parameters last to first within a chunk."""
        buckets: list[Bucket] = []
        slots: dict[int, Slot] = {}
        offset = 0
        for chunk in reversed(range(len(chunk_params))):
            open_bucket: Bucket | None = None
            for p in reversed(list(chunk_params[chunk])):
                alone = param_key(p) in self.isolate
                if open_bucket is not None and alone:
                    offset = self._close(open_bucket, buckets)
                    open_bucket = None
                if open_bucket is None:
                    open_bucket = Bucket(len(buckets), offset, offset, chunk)
                slots[id(p)] = Slot(offset, offset + p.numel(), open_bucket.index)
                open_bucket.params.append(p)
                offset += p.numel()
                open_bucket.end = offset
                if alone or open_bucket.end - open_bucket.start >= self.bucket_size:
                    offset = self._close(open_bucket, buckets)
                    open_bucket = None
            if open_bucket is not None:
                offset = self._close(open_bucket, buckets)
        return buckets, slots

    def _close(self, bucket: Bucket, buckets: list[Bucket]) -> int:
        bucket.end = bucket.start + self._pad(bucket.end - bucket.start)
        buckets.append(bucket)
        return bucket.end

    @torch.no_grad()
    def _attach(self) -> None:
        for p in self.params:
            slot = self.slots[id(p)]
            view = self.param_data[slot.start:slot.end].view_as(p)
            view.copy_(p.data)
            p.data = view
            p.main_grad = self.grad_data[slot.start:slot.end].view_as(p)  # type: ignore[attr-defined]

    def slot(self, param: nn.Parameter) -> Slot:
        """The slot of ``param`` (KeyError naming it when it is not in the buffers)."""
        try:
            return self.slots[id(param)]
        except KeyError:
            raise KeyError(f"parameter {param_key(param)} is not in the data-parallel "
                           "buffers") from None

    def shard(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """[lo, hi) of ``bucket`` owned by shard ``rank`` (the whole bucket when unsharded)."""
        size = bucket.numel // self.shard_count
        return bucket.start + rank * size, bucket.start + (rank + 1) * size

    def owned_ranges(self, rank: int) -> list[tuple[int, int]]:
        """Ranges of the flat buffers this shard owns, merged where adjacent."""
        out: list[tuple[int, int]] = []
        for bucket in self.buckets:
            lo, hi = self.shard(bucket, rank)
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            elif hi > lo:
                out.append((lo, hi))
        return out

    def segments(self, lo: int, hi: int) -> list[tuple[nn.Parameter, int, int]]:
        """Parameters overlapping [lo, hi), each with the overlap [a, b) in buffer coordinates."""
        out = []
        for p in self.params:
            slot = self.slots[id(p)]
            a, b = max(lo, slot.start), min(hi, slot.end)
            if a < b:
                out.append((p, a, b))
        return sorted(out, key=lambda s: s[1])

    @property
    def padding(self) -> int:
        """Zero elements added so every bucket splits evenly (0 when unsharded)."""
        return self.numel - self.num_params
