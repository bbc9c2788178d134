"""Dropout randomness that does not depend on the parallel layout.

Megatron keeps two CUDA RNG streams (one shared across tp, one per tp rank) and forks between
them. Colonnade goes one step further so that dropout runs are *exactly* reproducible across
layouts (the parity tests use that): every dropout mask is a slice of one logical full mask,

    mask = rand(full_shape, generator(seed, site, step, microbatch)) >= p,

where ``site`` is the layout-independent name of the dropout (e.g. ``layers.3.attn``),
``microbatch`` the *global* micro-batch index of the step (dp rank x microbatches + k).
Each rank keeps only its slice of the mask. Hence the tracker's rule holds by construction:
in tp-split regions (attention heads, sequence shards under sp) ranks hold different slices,
so their masks differ; in replicated regions every tp rank takes the same slice, so masks agree.
Recomputation sees the same (step, microbatch) and reproduces the masks bit for bit.

Cost: each rank draws the full mask's random numbers (tp times more than its shard). That is
small next to the matmuls it accompanies; it buys layout-independent, resumable randomness.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch


@dataclass
class RNGTracker:
    """Source of dropout masks; the training step sets the (step, micro-batch) context."""

    seed: int
    step: int = 0
    microbatch: int = 0

    def set_context(self, step: int, microbatch: int) -> None:
        """Name the micro-batch that the next forward pass computes."""
        self.step, self.microbatch = step, microbatch

    def generator(self, site: str, device: torch.device) -> torch.Generator:
        """A generator seeded from (seed, site, step, micro-batch)."""
        key = f"{site}|{self.step}|{self.microbatch}".encode()
        seed = (self.seed * 2_654_435_761 + zlib.crc32(key) * 97 + self.step) % (2**63 - 1)
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen

    def keep_mask(self, site: str, full_shape: tuple[int, ...], p: float,
                  index: tuple[slice, ...], device: torch.device) -> torch.Tensor:
        """This rank's slice ``index`` of the full boolean keep-mask of probability 1 - p."""
        gen = self.generator(site, device)
        full = torch.rand(full_shape, generator=gen, device=device)
        return full[index] >= p

    def dropout(self, x: torch.Tensor, p: float, site: str, full_shape: tuple[int, ...],
                index: tuple[slice, ...]) -> torch.Tensor:
        """Inverted dropout of ``x`` (this rank's slice of a ``full_shape`` tensor)."""
        if p == 0.0:
            return x
        mask = self.keep_mask(site, full_shape, p, index, x.device)
        return x * mask.to(x.dtype) / (1.0 - p)

    def state_dict(self) -> dict[str, int]:
        """Everything needed to resume (the masks are a pure function of these)."""
        return {"seed": self.seed, "step": self.step, "microbatch": self.microbatch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict`."""
        self.seed, self.step, self.microbatch = state["seed"], state["step"], state["microbatch"]
