"""Sharding declarations: each parameter says once how it is split across tp.

A :class:`Sharding` is attached to every parameter as ``param.sharding``. Initialisation,
state-dict sharding/gathering, gradient reductions and checkpoint resharding all derive from it:

* ``dim``: the tensor dim split across tp (None: replicated on every tp rank);
* ``full_shape``: the logical (unsharded, unpadded) shape;
* ``padded_rows``: rows of zero padding appended along ``dim`` before splitting (vocab padding);
* ``sp_partial_grad``: a tp-replicated parameter whose gradient is only a partial sum under
  sequence parallelism (norm weights, row-parallel biases): it is all-reduced across tp;
* ``key``: the layout-independent global name; it seeds initialisation.

Initialisation builds only this rank's shard, yet every layout starts from bit-identical
weights: the full tensor is tiled along ``dim`` (dim 0 when replicated) into blocks of
:func:`block_len` indices, a length fixed by the full shape alone; block j holds normal(0, std)
values drawn in float64 from a generator seeded by (seed, key, j), cast to the parameter's
dtype. A rank draws only the blocks overlapping its shard (at most two beyond it) and writes
them straight into the shard on its device; padding rows are zeros. Peak memory is the shard
plus two float64 blocks (:data:`BLOCK_ELEMENTS` each), not the full tensor.
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sharding:
    """How one parameter is laid out across the tp group."""

    key: str
    full_shape: tuple[int, ...]
    dim: int | None = None
    padded_rows: int = 0
    sp_partial_grad: bool = False
    tied_to: str | None = None

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of this rank's shard."""
        if self.dim is None:
            return self.full_shape
        shape = list(self.full_shape)
        total = shape[self.dim] + self.padded_rows
        if total % tp:
            raise ValueError(f"{self.key}: dim {self.dim} of size {total} not divisible by tp={tp}")
        shape[self.dim] = total // tp
        return tuple(shape)

    def shard(self, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
        """Cut this rank's shard out of the full tensor (padding with zeros first)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(f"{self.key}: expected full shape {self.full_shape}, got "
                             f"{tuple(full.shape)}")
        if self.dim is None:
            return full.clone()
        if self.padded_rows:
            pad_shape = list(full.shape)
            pad_shape[self.dim] = self.padded_rows
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=self.dim)
        return full.chunk(tp, dim=self.dim)[tp_rank].clone()

    def unshard(self, shards: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`shard`: concatenate all ranks' shards and drop padding."""
        if self.dim is None:
            return shards[0]
        full = torch.cat(shards, dim=self.dim)
        return full.narrow(self.dim, 0, self.full_shape[self.dim])


def seed_for(seed: int, key: str) -> int:
    """A stable 63-bit seed from the run seed and a parameter's global name."""
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2**63 - 1)


BLOCK_ELEMENTS = 1 << 18
"""Elements (about) of one initialisation block: 2 MiB of float64."""


def block_len(sharding: Sharding) -> int:
    """Indices along the tiling dim (``dim``, or 0 when replicated) per initialisation block;
    depends on the full shape only, so the tiling is the same in every layout."""
    dim = sharding.dim or 0
    inner = math.prod(sharding.full_shape) // max(1, sharding.full_shape[dim])
    return max(1, BLOCK_ELEMENTS // max(1, inner))


def _block(sharding: Sharding, seed: int, std: float, index: int, length: int,
           scratch: torch.Tensor) -> torch.Tensor:
    """Block ``index`` (``length`` indices along the tiling dim) of normal(0, std) values,
    drawn in float64 into the front of ``scratch`` (one buffer per parameter, so the
    allocator is not left with a trail of freed blocks)."""
    dim = sharding.dim or 0
    shape = list(sharding.full_shape)
    shape[dim] = length
    gen = torch.Generator().manual_seed(seed_for(seed, f"{sharding.tied_to or sharding.key}"
                                                       f"#block{index}"))
    return scratch[:math.prod(shape)].view(shape).normal_(0.0, std, generator=gen)


def init_shard(sharding: Sharding, tp_rank: int, tp: int, seed: int, std: float,
               kind: str = "normal", dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
    """This rank's shard of the initial value (normal(0, std), ones or zeros), built directly
    in ``dtype`` on ``device`` from the blocks that overlap it; equal, in every layout, to the
    matching slice of :func:`init_full`."""
    local = sharding.local_shape(tp)
    dim = sharding.dim or 0
    start = tp_rank * local[dim] if sharding.dim is not None else 0
    real = max(0, min(start + local[dim], sharding.full_shape[dim]) - start)  # unpadded part
    if kind == "ones":
        out = torch.ones(local, dtype=dtype, device=device)
    elif kind == "zeros":
        out = torch.zeros(local, dtype=dtype, device=device)
    elif kind == "normal":
        out = torch.empty(local, dtype=dtype, device=device)
        step = block_len(sharding)
        blocks = range(start // step, -(-(start + real) // step))
        inner = math.prod(sharding.full_shape) // max(1, sharding.full_shape[dim])
        scratch = torch.empty(min(step, sharding.full_shape[dim]) * inner if blocks else 0,
                              dtype=torch.float64)
        for index in blocks:
            lo, hi = max(start, index * step), min(start + real, (index + 1) * step)
            length = min(step, sharding.full_shape[dim] - index * step)
            block = _block(sharding, seed, std, index, length, scratch)
            out.narrow(dim, lo - start, hi - lo).copy_(block.narrow(dim, lo - index * step,
                                                                    hi - lo))
    else:
        raise ValueError(f"{sharding.key}: unknown init kind '{kind}' (normal, ones, zeros)")
    if real < local[dim]:
        out.narrow(dim, real, local[dim] - real).zero_()  # vocab padding rows
    return out


def init_full(sharding: Sharding, seed: int, std: float, kind: str = "normal",
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full (unpadded) initial value of a parameter, as every layout's shards make it."""
    return init_shard(dataclasses.replace(sharding, padded_rows=0), 0, 1, seed, std, kind,
                      dtype)


def make_param(sharding: Sharding, tp_rank: int, tp: int, seed: int, std: float,
               kind: str = "normal", dtype: torch.dtype = torch.float32,
               device: torch.device | None = None) -> torch.nn.Parameter:
    """A parameter holding this rank's shard of the seeded initial value, built on its own
    (on the meta device: the shard's shape only, nothing initialised, e.g. for
    ``train --dry-run``)."""
    if device is not None and torch.device(device).type == "meta":
        value = torch.empty(sharding.local_shape(tp), dtype=dtype, device="meta")
    else:
        value = init_shard(sharding, tp_rank, tp, seed, std, kind, dtype, device)
    param = torch.nn.Parameter(value)
    param.sharding = sharding  # type: ignore[attr-defined]
    return param


def output_std(std: float, num_layers: int) -> float:
    """Megatron's scaled init of output projections: std / sqrt(2 * layers)."""
    return std / math.sqrt(2.0 * num_layers)
