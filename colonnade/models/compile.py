"""``training.compile``: ``torch.compile`` applied to each transformer layer (torchtitan's recipe).

What is compiled: the ``forward`` of every :class:`~colonnade.models.layer.TransformerLayer`
of every chunk, in place, by TorchInductor (C++/OpenMP kernels on CPU, Triton on GPUs), with
``dynamic=False`` and ``fullgraph=False``. The module keeps its identity and parameter names
(checkpoints, sharding declarations and tied weights are untouched); its own forward hooks run
eagerly, those of the modules inside it are traced. At tp = 1 the last chunk's final norm,
head and cross entropy (:meth:`~colonnade.models.gpt.ModelChunk.head_loss`) are compiled too,
as one more graph (torchtitan compiles the loss as well): the [s, b, V] logits and the
softmax's temporaries are then fused instead of written and read by separate kernels. Not
compiled: the embedding, the head and loss at tp > 1 (the vocab-parallel cross entropy's
collectives), the pipeline executor and the optimizer.

One graph for all layers: every layer runs the same code on parameters of the same shapes, and
no per-layer constant reaches the traced code (dropout site names are formatted once and passed
through to eager code untouched), so dynamo compiles one graph (per training/eval mode and grad
mode) that every layer reuses: compilation costs one layer, not L, and a deep model stays far
below dynamo's recompile limit (8 versions of a function, after which it would silently run
eagerly). The tests assert one compiled version for all layers over several steps.

Graph breaks (``TORCH_LOGS=graph_breaks``), by design; results are unchanged by each:

* tp > 1: at every tensor-parallel entry and exit (f / g, the sp all-gather and
  reduce-scatter of :mod:`colonnade.tensor_parallel.mappings`). Each collective goes through
  :class:`~colonnade.parallel.comm.CommGroup`, whose bookkeeping (byte counters under a lock,
  timing, timeouts) dynamo cannot trace, so the autograd function runs eagerly between
  compiled pieces and the comm counters count every call as in eager mode.
* dropout > 0 in training: at each hidden-dropout draw and around the blockwise dropout
  attention, both ``eager`` (:mod:`colonnade.eager`). The masks come from the eager counter-based
  generator, which reads the tracker's (seed, site, step, micro-batch) at every call
  (:mod:`colonnade.parallel.rng`): the masks of the eager model bit for bit, and no guard on
  the step or micro-batch that would recompile the graph at every micro-batch.
* cp > 1: around the context-parallel attention call (ring or all-to-all,
  ``eager`` (:mod:`colonnade.eager`) in :mod:`colonnade.models.blocks`): its p2p / all-to-all go
  through CommGroup, and the ring's autograd function runs eagerly between the compiled
  projections before it and the output projection + MLP after it.
* selective recompute: around core attention, which runs eagerly inside the eager checkpoint
  (:func:`colonnade.models.checkpointing.checkpoint` is ``eager`` (:mod:`colonnade.eager`): dynamo
  cannot trace its ``context_fn``, the dropout-context restoration); the layer is two compiled
  pieces, norm + q/k/v projections before it and output projection + MLP after it.

Order with activation recomputation: checkpointing outside, compilation inside. Full
recompute's layer runner (:class:`~colonnade.models.recompute.FullRecompute`) stays eager and
checkpoints compiled layers: ``torch.utils.checkpoint`` keeps a block's input and, in backward,
runs the block's compiled forward again under the restored dropout context, then its compiled
backward (compiled code called from a ``eager`` (:mod:`colonnade.eager`) function still runs
compiled). Compiling the checkpoint instead (torchtitan's order, the partitioner choosing what
to recompute) would need dynamo to trace our ``context_fn``. Selective recompute: see above.

ZeRO-1 with overlapped parameter gathers: a compiled layer gets one eager pre-forward hook that
waits for all its parameters' buckets, and the modules inside it none
(:mod:`colonnade.data_parallel.ddp`): a hook traced inside the graph would turn its bucket
numbers into per-layer constants. The zero-bubble schedule (zb_h1) is rejected by validation:
its split backward walks a layer's backward twice, and a compiled backward is one node that
computes every gradient of the layer at once and frees its saved buffers.

Generation (KV caches) and the models of export and analysis, made by
:func:`~colonnade.models.build.build_reference`, are never compiled.

CUDA graphs (``training.cuda_graphs``): the same per-layer compilation in torch.compile's
``mode="reduce-overhead"`` (:func:`compile_mode`), whose CUDA graph trees record each
layer's compiled forward and backward once and replay them; the trainer marks every step's
start (:func:`colonnade.device.begin_graph_step`) so the graphs' static outputs of the last
step may be overwritten. Where it cannot work (a host read or a token-dependent shape inside
a layer, collectives between captured layers, dropout's eager generator, recompute, ZeRO-3's
moving parameters) the validator refuses it (:mod:`colonnade.config.rules_graphs`); on the
dense path the layer has no graph break (tests/models/test_compile.py), hence no host read.
The compiler is passed in (:class:`LayerCompiler`), so a test checks on a CPU what each
layer is compiled with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from colonnade.config.sections import TrainingConfig
from colonnade.models.gpt import ModelChunk

MARK = "compiled_forward"
"""Attribute set to True on a module whose forward :func:`compile_layers` compiled."""
HEAD_MARK = "compiled_head_loss"
"""Attribute set to True on a last chunk whose :meth:`~colonnade.models.gpt.ModelChunk.
head_loss` (final norm + head + cross entropy) :func:`compile_layers` compiled (tp = 1)."""
BACKEND = "inductor"
"""The torch.compile backend (TorchInductor: C++/OpenMP kernels on CPU, Triton on GPUs)."""


GRAPH_MODE = "reduce-overhead"
"""torch.compile's mode that records and replays CUDA graphs (``training.cuda_graphs``)."""


class LayerCompiler(Protocol):
    """What compiles a layer's forward: ``torch.compile``'s signature (a test passes a fake)."""

    def __call__(self, fn: Callable[..., Any], *, backend: str, mode: str | None,
                 dynamic: bool, fullgraph: bool) -> Callable[..., Any]: ...


def compile_mode(training: TrainingConfig) -> str | None:
    """The torch.compile mode of the layers: :data:`GRAPH_MODE` with ``training.cuda_graphs``,
    None (inductor's default, no CUDA graphs) with ``training.compile`` alone."""
    return GRAPH_MODE if training.cuda_graphs else None


def wants_compile(training: TrainingConfig) -> bool:
    """Whether the layers are compiled: ``training.compile`` or ``training.cuda_graphs``."""
    return training.compile or training.cuda_graphs


def compile_layers(chunks: Sequence[ModelChunk], backend: str = BACKEND,
                   mode: str | None = None,
                   compiler: LayerCompiler = torch.compile) -> int:  # type: ignore[assignment]
    """Compile the forward of every transformer layer of ``chunks`` in place; returns how many.
    ``mode``: torch.compile's (None: default; :data:`GRAPH_MODE`: CUDA graphs).

    The layer's ``forward`` (not its ``__call__``) is replaced by its compiled version, so the
    layer's own forward hooks stay eager: ZeRO-1 puts its parameter wait there, one hook per
    compiled layer (:mod:`colonnade.data_parallel.ddp`), where a hook traced inside the graph
    would bake its bucket numbers in as constants and recompile the graph for every layer.
    Idempotent. Dynamo traces at each layer's first call.
    """
    count = 0
    for chunk in chunks:
        if chunk.last and chunk.ctx.group.size == 1 and not getattr(chunk, HEAD_MARK, False):
            chunk.head_loss = compiler(  # type: ignore[method-assign]
                chunk.head_loss, backend=backend, mode=mode, dynamic=False, fullgraph=False)
            setattr(chunk, HEAD_MARK, True)  # not MARK: the chunk's forward stays eager
        for layer in chunk.layers.values():
            if not is_compiled(layer):
                layer.forward = compiler(  # type: ignore[method-assign]
                    layer.forward, backend=backend, mode=mode, dynamic=False, fullgraph=False)
                setattr(layer, MARK, True)
            count += 1
    return count


COMPILE_TIMERS = ("_compile.compile_inner", "backward._backward_impl")
"""torch._dynamo's timers of a frame's compilation (trace + AOT + inductor of the forward and
the joint graph) and of the lazy compilation of a compiled backward at its first call."""


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (forward frames and their backwards;
    dynamo's own cumulative timers, so a recompilation adds to it)."""
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(sum(compilation_time_metrics.get(key, ())) for key in COMPILE_TIMERS))


def is_compiled(module: nn.Module) -> bool:
    """Whether ``module``'s forward is compiled (:func:`compile_layers`): its descendants'
    forward hooks would run inside the compiled graph."""
    return bool(getattr(module, MARK, False))


def compiled_layers(chunks: Sequence[ModelChunk]) -> int:
    """Number of compiled transformer layers in ``chunks``."""
    return sum(is_compiled(layer) for chunk in chunks for layer in chunk.layers.values())
