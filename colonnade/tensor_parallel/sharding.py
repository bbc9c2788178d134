"""Sharding declarations: each parameter says once how it is split across tp.

A :class:`Sharding` is attached to every parameter as ``param.sharding``. Initialisation,
state-dict sharding/gathering, gradient reductions and checkpoint resharding all derive from it:

* ``dim``: the tensor dim split across tp (None: replicated on every tp rank);
* ``full_shape``: the logical (unsharded, unpadded) shape;
* ``padded_rows``: rows of zero padding appended along ``dim`` before splitting (vocab padding);
* ``sp_partial_grad``: a tp-replicated parameter whose gradient is only a partial sum under
  sequence parallelism (norm weights, row-parallel biases): it is all-reduced across tp;
* ``key``: the layout-independent global name; it seeds initialisation.

Initialisation draws the *full* tensor from a generator seeded by (seed, key) and keeps this
rank's shard, so every layout starts from bit-identical weights.
"""

from __future__ import annotations

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


def init_full(sharding: Sharding, seed: int, std: float, kind: str = "normal",
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full initial value of a parameter: normal(0, std), ones or zeros."""
    if kind == "ones":
        return torch.ones(sharding.full_shape, dtype=dtype)
    if kind == "zeros":
        return torch.zeros(sharding.full_shape, dtype=dtype)
    gen = torch.Generator().manual_seed(seed_for(seed, sharding.tied_to or sharding.key))
    out = torch.empty(sharding.full_shape, dtype=torch.float64)
    out.normal_(0.0, std, generator=gen)
    return out.to(dtype)


def make_param(sharding: Sharding, tp_rank: int, tp: int, seed: int, std: float,
               kind: str = "normal", dtype: torch.dtype = torch.float32,
               device: torch.device | None = None) -> torch.nn.Parameter:
    """A parameter holding this rank's shard of the seeded full initial value (on the meta
    device: the shard's shape only, nothing initialised, e.g. for ``train --dry-run``)."""
    if device is not None and torch.device(device).type == "meta":
        full = torch.empty(sharding.full_shape, dtype=dtype, device="meta")
    else:
        full = init_full(sharding, seed, std, kind, dtype)
    param = torch.nn.Parameter(sharding.shard(full, tp_rank, tp).to(device=device))
    param.sharding = sharding  # type: ignore[attr-defined]
    return param


def output_std(std: float, num_layers: int) -> float:
    """Megatron's scaled init of output projections: std / sqrt(2 * layers)."""
    return std / math.sqrt(2.0 * num_layers)
