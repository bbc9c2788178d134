"""Activation recomputation: trade one extra forward for the memory of stored activations.

Three modes (``training.recompute``), Megatron's:

* ``full``: a checkpointed block keeps only its input [s(/tp), b, h] for backward; its
  activations are recomputed (one more forward of the block) when backward reaches it.
  ``recompute_method='uniform'``: the chunk's layers form consecutive blocks of
  ``recompute_num_layers`` layers (the last one may be shorter), each checkpointed.
  ``recompute_method='block'``: the first ``recompute_num_layers`` layers of every chunk
  (pipeline stage or virtual stage) are checkpointed one by one; the rest store everything.
  Memory per chunk of L layers, micro-batch input I = E s b h (/tp under sp):
  uniform ceil(L/N) I, block min(N, L) I + (L - min(N, L)) x (a full layer).
* ``selective``: only core attention, softmax(q k^T / sqrt(d)) v, the part whose stored
  activations grow with s^2 when it is computed eagerly, is checkpointed; its inputs q, k, v
  are kept (:meth:`colonnade.models.blocks.Attention.core_attention`). Under context
  parallelism the all-to-all attention is checkpointed the same way (its communication
  repeats in backward); ring attention is not: its autograd function already keeps only q, k,
  v, the output and the row log-sum-exp, so recomputing it would only repeat its p2p ring.
* ``none``.

This module is the policy (which blocks, installed on the chunks at build time); the mechanism,
an exact checkpoint of one block that reproduces its dropout masks, is
:func:`colonnade.models.checkpointing.checkpoint` (the exactness argument is there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from colonnade.config.choices import RECOMPUTE_METHODS, RECOMPUTE_MODES
from colonnade.models.checkpointing import checkpoint

if TYPE_CHECKING:
    from colonnade.config.sections import TrainingConfig
    from colonnade.models.gpt import LayerFn, ModelChunk
    from colonnade.tensor_parallel.context import ParallelContext



@dataclass(frozen=True)
class RecomputePlan:
    """What to recompute: ``mode`` in RECOMPUTE_MODES, ``method`` in RECOMPUTE_METHODS,
    ``num_layers`` >= 1."""

    mode: str = "none"
    method: str = "uniform"
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.mode not in RECOMPUTE_MODES:
            raise ValueError(f"training.recompute='{self.mode}' is unknown; use one of "
                             f"{', '.join(RECOMPUTE_MODES)}.")
        if self.method not in RECOMPUTE_METHODS:
            raise ValueError(f"training.recompute_method='{self.method}' is unknown; use one of "
                             f"{', '.join(RECOMPUTE_METHODS)}.")
        if self.num_layers < 1:
            raise ValueError(f"training.recompute_num_layers={self.num_layers} must be >= 1.")

    @classmethod
    def from_config(cls, training: TrainingConfig) -> RecomputePlan:
        """The plan of ``training.recompute`` / ``recompute_method`` / ``recompute_num_layers``."""
        return cls(training.recompute, training.recompute_method, training.recompute_num_layers)

    def blocks(self, num_layers: int) -> list[tuple[int, int, bool]]:
        """Split a chunk's ``num_layers`` layers into (start, stop, checkpointed) runs.

        uniform N: [0, N), [N, 2N), ... all checkpointed; block N: [0, 1), ..., [N-1, N)
        checkpointed, then [N, L) plain.  Not ``full``: one plain run.
        """
        if self.mode != "full" or num_layers == 0:
            return [(0, num_layers, False)] if num_layers else []
        n = self.num_layers
        if self.method == "uniform":
            return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
        k = min(n, num_layers)
        runs = [(i, i + 1, True) for i in range(k)]
        return runs + ([(k, num_layers, False)] if k < num_layers else [])

    def checkpointed_blocks(self, num_layers: int) -> int:
        """Checkpointed blocks in a chunk of ``num_layers`` layers (inputs stored per chunk)."""
        if self.mode != "full":
            return 0
        if self.method == "uniform":
            return math.ceil(num_layers / self.num_layers)
        return min(self.num_layers, num_layers)


class FullRecompute:
    """A ``ModelChunk.layer_runner``: runs the layers in the plan's blocks, checkpointing some.

    The tracker is read from ``ctx`` at every call, so swapping ``ctx.rng`` later is honoured.
    """

    def __init__(self, plan: RecomputePlan, ctx: ParallelContext) -> None:
        self.plan, self.ctx = plan, ctx

    def __call__(self, fns: list[LayerFn], x: torch.Tensor) -> torch.Tensor:
        """x [s(/tp), b, h] through every fn in order -> [s(/tp), b, h]."""
        for start, stop, ckpt in self.plan.blocks(len(fns)):
            run = _sequence(fns[start:stop])
            x = checkpoint(run, self.ctx.rng, x) if ckpt else run(x)
        return x


def _sequence(fns: list[LayerFn]) -> LayerFn:
    """The composition fns[-1] o ... o fns[0]."""

    def run(x: torch.Tensor) -> torch.Tensor:
        for fn in fns:
            x = fn(x)
        return x

    return run


def install(chunks: list[ModelChunk], plan: RecomputePlan) -> None:
    """Put ``plan`` in place on every chunk (idempotent: a new plan replaces the old one)."""
    for chunk in chunks:
        chunk.layer_runner = FullRecompute(plan, chunk.ctx) if plan.mode == "full" else None
        for layer in chunk.layers.values():
            layer.attn.recompute_core = plan.mode == "selective"
