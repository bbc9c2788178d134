"""The checkpointing mechanism: run a block now, recompute its activations in backward, exactly.

Recomputation repeats the very same operations on the very same inputs, so the
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

The policy (which blocks of a chunk are checkpointed) is :mod:`colonnade.models.recompute`; this
module imports nothing from the model, so the layers (:mod:`colonnade.models.blocks`) can use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as tc

from colonnade.eager import eager
from colonnade.parallel.rng import RNGTracker


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


@eager
def checkpoint(fn: Callable[..., torch.Tensor], rng: RNGTracker, *args: Any) -> torch.Tensor:
    """``fn(*args)`` with its activations recomputed in backward instead of stored.

    Non-reentrant ``torch.utils.checkpoint``: only the tensor inputs in ``args`` are saved.
    The dropout context (``rng.step``, ``rng.microbatch``) current now is reinstated while
    ``fn`` is recomputed, so every mask is reproduced even if the context has moved on to
    another micro-batch by the time backward runs.  Without autograd (eval, ``no_grad``) this
    is a plain call. Never traced by torch.compile (dynamo cannot trace a custom
    ``context_fn``): inside a compiled layer it is an eager island, and compiled layers called
    by ``fn`` still run compiled (see :mod:`colonnade.models.compile`).
    """
    if not torch.is_grad_enabled():
        return fn(*args)
    step, microbatch = rng.step, rng.microbatch

    def contexts() -> tuple[contextlib.AbstractContextManager[None], _RestoreContext]:
        return contextlib.nullcontext(), _RestoreContext(rng, step, microbatch)

    return tc.checkpoint(fn, *args, use_reentrant=False, context_fn=contexts)
