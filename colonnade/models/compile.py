"""``training.compile``: ``torch.compile`` applied to each transformer layer (torchtitan's recipe).

What is compiled: every :class:`~colonnade.models.layer.TransformerLayer` of every chunk, in
place (``nn.Module.compile``: the module keeps its identity, its parameter names and its
hooks), with TorchInductor, ``dynamic=False`` and ``fullgraph=False``. Not compiled: the
embedding, the final norm, the head and the loss (once per micro-batch, and the loss holds the
vocab-parallel collectives), the pipeline executor, the optimizer. Every layer of a model runs
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
* ZeRO-1 with overlapped parameter gathers: the pre-forward hook of each module that waits for
  its parameter bucket (:mod:`colonnade.data_parallel.ddp`) runs eagerly.

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

from colonnade.models.gpt import ModelChunk
from colonnade.models.layer import TransformerLayer

BACKEND = "inductor"
"""The torch.compile backend (TorchInductor: C++/OpenMP kernels on CPU, Triton on GPUs)."""


def compile_layers(chunks: Sequence[ModelChunk], backend: str = BACKEND) -> int:
    """Compile every transformer layer of ``chunks`` in place; returns how many.

    Idempotent: a layer already compiled is left as it is. Compilation itself happens at each
    layer's first call (dynamo traces lazily), so hooks registered after this (ZeRO-1's
    pre-forward waits) are seen by it.
    """
    count = 0
    for chunk in chunks:
        for layer in chunk.layers.values():
            if not is_compiled(layer):
                layer.compile(backend=backend, dynamic=False, fullgraph=False)
            count += 1
    return count


def is_compiled(layer: TransformerLayer) -> bool:
    """Whether ``layer`` runs through ``torch.compile`` (``nn.Module.compile`` was applied)."""
    return getattr(layer, "_compiled_call_impl", None) is not None


def compiled_layers(chunks: Sequence[ModelChunk]) -> int:
    """Number of compiled transformer layers in ``chunks``."""
    return sum(is_compiled(layer) for chunk in chunks for layer in chunk.layers.values())
