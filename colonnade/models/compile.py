"""``training.compile``: ``torch.compile`` applied to each transformer layer (torchtitan's recipe).

What is compiled: the forward of every :class:`~colonnade.models.layer.TransformerLayer` of
every chunk, in place (the module keeps its identity and parameter names; its own hooks stay
eager, its descendants' are traced), with TorchInductor, ``dynamic=False`` and
``fullgraph=False``. Not compiled: the embedding, the final norm, the head and the loss (once
per micro-batch, and the loss holds the vocab-parallel collectives), the pipeline executor, the
optimizer. Every layer of a model runs
the same code on parameters of the same shapes, and no per-layer constant reaches the traced
code (the layers' dropout site names are passed through untouched to eager code), so all layers
share one compiled graph: one compilation per distinct (training mode, grad mode, shape), not
one per layer, and a deep model stays far below dynamo's recompile limit.

Where dynamo breaks the graph (``TORCH_LOGS=graph_breaks``; counted by the tests), all by
design, results unchanged:

* tp > 1: at every tensor-parallel entry and exit (f / g, the sp all-gather and reduce-scatter,
  :mod:`colonnade.tensor_parallel.mappings`): each collective goes through
  :class:`~colonnade.parallel.comm.CommGroup`, whose Python bookkeeping (byte counts, timing,
  timeouts) must run at every call, so the autograd function runs eagerly between compiled
  pieces: a layer is 2-3 graphs per tp region instead of one.
* dropout > 0 in training: at each hidden-dropout draw and around the blockwise dropout
  attention, which are ``torch.compiler.disable``-d. The masks are computed by the eager
  counter-based generator from the tracker's (seed, site, step, micro-batch) read at call time
  (:mod:`colonnade.parallel.rng`), so they are the masks of the eager model bit for bit, and
  no guard on the step or micro-batch number forces a recompilation per micro-batch.
* none for ZeRO-1's overlapped parameter gathers: a compiled layer gets one eager
  pre-forward hook waiting for all its parameters' buckets, and its descendants none
  (:mod:`colonnade.data_parallel.ddp`).

Order with activation recomputation:

* full: checkpointing wraps compiled layers (checkpoint outside, compile inside). The chunk's
  layer runner (:class:`~colonnade.models.recompute.FullRecompute`) stays eager; its
  ``torch.utils.checkpoint`` keeps a block's input and, in backward, runs the block's
  compiled forward again under the restored dropout context, then its compiled backward.
  Compiling the checkpoint instead (torchtitan's order, recompute decided by the partitioner)
  would need dynamo to trace our ``context_fn`` (the dropout-context restoration), which it
  does not support; recomputing a compiled layer is also cheaper than recomputing an eager one.
* selective: the core-attention checkpoint sits inside the compiled layer; dynamo does not
  trace a checkpoint with a custom ``context_fn``, so core attention runs eagerly under the
  eager checkpoint between two compiled pieces of the layer (norm + q/k/v projections before
  it, output projection + MLP after it).

Generation (KV caches) and the analysis / export models built by
:func:`~colonnade.models.build.build_reference` are never compiled.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from colonnade.models.gpt import ModelChunk

MARK = "compiled_forward"
"""Attribute set to True on a module whose forward :func:`compile_layers` compiled."""
BACKEND = "inductor"
"""The torch.compile backend (TorchInductor: C++/OpenMP kernels on CPU, Triton on GPUs)."""


def compile_layers(chunks: Sequence[ModelChunk], backend: str = BACKEND) -> int:
    """Compile the forward of every transformer layer of ``chunks`` in place; returns how many.

    The layer's ``forward`` (not its ``__call__``) is replaced by its compiled version, so the
    layer's own forward hooks stay eager: ZeRO-1 puts its parameter wait there, one hook per
    compiled layer (:mod:`colonnade.data_parallel.ddp`), where a hook traced inside the graph
    would bake its bucket numbers in as constants and recompile the graph for every layer.
    Idempotent. Dynamo traces at each layer's first call.
    """
    count = 0
    for chunk in chunks:
        for layer in chunk.layers.values():
            if not is_compiled(layer):
                layer.forward = torch.compile(  # type: ignore[method-assign]
                    layer.forward, backend=backend, dynamic=False, fullgraph=False)
                setattr(layer, MARK, True)
            count += 1
    return count


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module``'s forward is compiled (:func:`compile_layers`): its descendants'
    forward hooks would run inside the compiled graph."""
    return bool(getattr(module, MARK, False))


def compiled_layers(chunks: Sequence[ModelChunk]) -> int:
    """Number of compiled transformer layers in ``chunks``."""
    return sum(is_compiled(layer) for chunk in chunks for layer in chunk.layers.values())
