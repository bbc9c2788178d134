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
  are kept (:meth:`colonnade.models.blocks.Attention.core_attention`).
* ``none``.

Exactness.  Recomputation repeats the very same operations on the very same inputs, so the
gradients are bit-identical to those without recomputation, dropout included: the
:class:`~colonnade.parallel.rng.RNGTracker` derives every mask from (seed, site, step,
micro-batch).  The one thing that can differ at recompute time is the tracker's context: a
pipeline schedule runs other micro-batches' forwards between a micro-batch's forward and its
backward, each one re-pointing the tracker.  :func:`checkpoint` therefore captures
(step, micro-batch) when the block runs forward and reinstates it around the recomputation
(restoring whatever was current afterwards), through ``torch.utils.checkpoint``'s
``context_fn``.  The tp-split dropout regions (attention heads, sequence shards) take their
slices of the same full masks, so they reproduce too.

Recomputation runs the block's forward collectives again (tp all-reduce / sp all-gather) inside
backward, identically on every tp rank, so the ranks stay in step.  PyTorch recomputes per
backward pass: the zero-bubble schedule's separate weight-gradient pass (W, a second engine
run over the same graph) recomputes a checkpointed block once more - same numbers, one more
forward of it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.checkpoint as tc

from colonnade.parallel.rng import RNGTracker

if TYPE_CHECKING:
    from colonnade.config.sections import TrainingConfig
    from colonnade.models.gpt import LayerFn, ModelChunk
    from colonnade.tensor_parallel.layers import TPContext

MODES = ("none", "full", "selective")
METHODS = ("uniform", "block")


class _RestoreContext:
    """Points ``rng`` at (step, microbatch) while entered and restores the previous context.

    Reusable (and re-entrant): one backward graph can be recomputed more than once, e.g. by a
    zero-bubble schedule's separate weight-gradient pass.
    """

    def __init__(self, rng: RNGTracker, step: int, microbatch: int) -> None:
        self.rng, self.context = rng, (step, microbatch)
        self._before: list[tuple[int, int]] = []

    def __enter__(self) -> None:
        self._before.append((self.rng.step, self.rng.microbatch))
        self.rng.set_context(*self.context)

    def __exit__(self, *exc: object) -> None:
        self.rng.set_context(*self._before.pop())


def checkpoint(fn: Callable[..., torch.Tensor], rng: RNGTracker, *args: Any) -> torch.Tensor:
    """``fn(*args)`` with its activations recomputed in backward instead of stored.

    Non-reentrant ``torch.utils.checkpoint``: only the tensor inputs in ``args`` are saved.
    The dropout context (``rng.step``, ``rng.microbatch``) current now is reinstated while
    ``fn`` is recomputed, so every mask is reproduced even if the context has moved on to
    another micro-batch by the time backward runs.  Without autograd (eval, ``no_grad``) this
    is a plain call.
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    step, microbatch = rng.step, rng.microbatch

    def contexts() -> tuple[contextlib.AbstractContextManager[None], _RestoreContext]:
        return contextlib.nullcontext(), _RestoreContext(rng, step, microbatch)

    return tc.checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)


@dataclass(frozen=True)
class RecomputePlan:
    """What to recompute: ``mode`` in MODES, ``method`` in METHODS, ``num_layers`` >= 1."""

    mode: str = "none"
    method: str = "uniform"
    num_layers: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"training.recompute='{self.mode}' is unknown; use one of "
                             f"{', '.join(MODES)}.")
        if self.method not in METHODS:
            raise ValueError(f"training.recompute_method='{self.method}' is unknown; use one of "
                             f"{', '.join(METHODS)}.")
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

    def __init__(self, plan: RecomputePlan, ctx: TPContext) -> None:
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
