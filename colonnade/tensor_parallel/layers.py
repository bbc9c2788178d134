"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Column-parallel Y = X A with A = [A_1 ... A_t] split along its output dim: rank i holds A_i
(torch weight [out/tp, in]) and computes Y_i = X A_i. Entering it, X is copied (f) or, under
sequence parallelism, all-gathered along the sequence (g_sp).

Row-parallel Y = X A with A split along its input dim: rank i holds A_i (weight [out, in/tp]),
takes the matching slice X_i (the column layer's output) and computes the partial X_i A_i;
leaving it, partials are summed (g) or, under sp, reduce-scattered along the sequence (g-bar).

With tp = 1 every operator is the identity, so the same classes form the reference model.

Every parameter is made from its :class:`~colonnade.tensor_parallel.sharding.Sharding`
declaration. Tying has one mechanism: a layer declares ``tied_to=<key>`` and
:func:`tie_weights` resolves it over a rank's chunk (share that Parameter, or make a copy under
the same key on a later pipeline stage).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn

from colonnade.tensor_parallel import mappings as mp
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.float8 import linear
from colonnade.tensor_parallel.sharding import Sharding, tp_coords

log = logging.getLogger(__name__)


def column_parallel(x: torch.Tensor, layers: list[ColumnParallelLinear]) -> list[torch.Tensor]:
    """Apply column-parallel layers that read the same input ``x``, entering tp only once.

    Attention's q, k, v (and SwiGLU's gate, up) share one f (tp) or one sequence all-gather
    (sp), so a transformer layer costs 2 entries, not 5; with ``comm_chunks > 1`` under sp they
    share one chunked all-gather pipelined with all their matmuls (and one reduce-scatter of
    the summed input gradient backward).  The layers' weights are read directly, not through
    their forward: a module calling this for its children lists them in ``direct_children``
    (ZeRO-1 then waits for their parameter all-gather before that module's forward).
    x [s, b, h] (or [s/tp, b, h] under sp) -> one [s, b, o_k/tp] per layer.
    Under ``training.fp8`` each GEMM runs in float8 (the validator refuses fp8 with
    ``tp_comm_chunks > 1``, whose chunked path is not float8).
    """
    ctx = layers[0].ctx
    weights = [layer.weight for layer in layers]
    biases = [layer.bias for layer in layers]
    if ctx.tp > 1 and ctx.sp and ctx.comm_chunks > 1 and layers[0].fp8 is None:
        from colonnade.tensor_parallel.partition import gathered_linears

        return list(gathered_linears(x, weights, biases, ctx.group, ctx.comm_chunks))
    if ctx.tp > 1:
        x = mp.gather_seq(x, ctx.group) if ctx.sp else mp.copy_to_tp(x, ctx.group)  # [s, b, h]
    return [linear(x, layer.weight, layer.bias, layer.fp8)
            for layer in layers]  # [s, b, o_k/tp]


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with the output features split across tp.

    Input [s, b, in] (or [s/tp, b, in] under sp); output [s, b, out/tp], or [s, b, out] with
    ``gather_output``.

    ``fp8``: the GEMMs follow ``training.fp8`` (False: always in the model's dtype, as the
    output heads are, torchtitan's default).

    ``tied_to`` names another parameter (the word embedding, for a tied output head) whose
    values this weight shares: the layer makes no weight of its own until
    :func:`tie_weights` resolves the tie over the modules of a rank.
    """

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, key: str, *,
                 bias: bool, std: float, gather_output: bool = False, padded_rows: int = 0,
                 tied_to: str | None = None, fp8: bool = True) -> None:
        super().__init__()
        self.ctx, self.gather_output, self.tied_to = ctx, gather_output, tied_to
        self.fp8 = ctx.float8(ctx.group, "n") if fp8 else None
        """Float8 GEMMs (output features split over tp), or None."""
        spec = Sharding(tied_to or f"{key}.weight", (out_features, in_features), dim=0,
                        padded_rows=padded_rows)
        self.pending_tie: tuple[Sharding, float] | None = None
        """(declaration, std) of a tied weight not resolved yet (:func:`tie_weights`)."""
        if tied_to is None:
            self.weight = ctx.param(spec, std)
        else:
            self.register_parameter("weight", None)
            self.pending_tie = (spec, std)
        self.bias = (ctx.param(Sharding(f"{key}.bias", (out_features,), dim=0), 0.0, "zeros")
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, b, in] (or [s/tp, b, in] under sp) -> [s, b, out/tp] (or gathered)."""
        if self.pending_tie is not None:
            raise RuntimeError(f"weight tied to '{self.tied_to}' not resolved: call "
                               "tensor_parallel.layers.tie_weights on the model chunk")
        (y,) = column_parallel(x, [self])  # [s, b, o/tp]
        if self.gather_output:
            y = mp.gather_last(y, self.ctx.group)  # [s, b, o]
        return y


def tie_weights(root: nn.Module) -> None:
    """Resolve every ``tied_to`` declaration under ``root`` (one rank's model chunk).

    When ``root`` holds the parameter of that key (the embedding is on this pipeline stage)
    the layer shares that very Parameter: one tensor, one gradient. Otherwise the layer gets
    its own copy: a parameter with the *same* key (hence the same seeded initial value and
    checkpoint name) marked ``tied_copy``; the embedding-group all-reduce of
    :mod:`colonnade.data_parallel.finalize` keeps it equal to the first stage's, and only the
    original is saved and counted in the gradient norm. Declarations must match exactly.
    """
    owners = {p.sharding.key: p for p in root.parameters()  # type: ignore[attr-defined]
              if hasattr(p, "sharding")}
    for module in root.modules():
        if not isinstance(module, ColumnParallelLinear) or module.pending_tie is None:
            continue
        spec, std = module.pending_tie
        target = owners.get(spec.key)
        if target is None:
            module.weight = module.ctx.param(dataclasses.replace(spec, tied_copy=True), std)
        elif target.sharding != spec:  # type: ignore[attr-defined]
            raise ValueError(f"tied weight '{spec.key}': declared as {spec}, but the parameter "
                             f"is {target.sharding}")  # type: ignore[attr-defined]
        else:
            module.weight = target
        module.pending_tie = None


def share_tied_across(roots: list[nn.Module]) -> None:
    """Tie across one rank's chunks: a tied copy (made by :func:`tie_weights` in a chunk that
    does not hold the original) becomes the original Parameter when another chunk of the same
    rank holds it (the "v" pipeline placement puts the embedding and the head on stage 0), so
    the rank has one tensor and one gradient and no embedding-group all-reduce is needed."""
    owners = {p.sharding.key: p for root in roots for p in root.parameters()
              if not getattr(getattr(p, "sharding", None), "tied_copy", True)}
    for root in roots:
        for module in root.modules():
            weight = getattr(module, "weight", None)
            spec = getattr(weight, "sharding", None)
            if (isinstance(module, ColumnParallelLinear) and spec is not None
                    and spec.tied_copy and spec.key in owners):
                module.weight = owners[spec.key]


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with the input features split across tp.

    Input [s, b, in/tp] (the column layer's output), or the full [s, b, in] when
    ``input_is_parallel`` is False (each rank then keeps its slice, the gradient is
    all-gathered); output [s, b, out], or [s/tp, b, out] under sp. The bias is replicated and
    added once, after the reduction (fused into the matmul at tp = 1); under sp its gradient is
    a partial sum over this rank's sequence chunk (``sp_partial_grad``).
    """

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, key: str, *,
                 bias: bool, std: float, input_is_parallel: bool = True) -> None:
        super().__init__()
        self.ctx, self.input_is_parallel = ctx, input_is_parallel
        self.fp8 = ctx.float8(ctx.group, "k")
        """Float8 GEMMs (input features split over tp), or None."""
        self.weight = ctx.param(Sharding(f"{key}.weight", (out_features, in_features), dim=1), std)
        self.bias = (ctx.param(Sharding(f"{key}.bias", (out_features,), sp_partial_grad=ctx.sp),
                               0.0, "zeros") if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, b, in/tp] (or [s, b, in], ``input_is_parallel=False``) -> [s, b, out]
        ([s/tp, b, out] under sp).

        With tp = 1 this is ``F.linear(x, w, b)``: the bias fused into the matmul (addmm), no
        mapping entered. With tp > 1 the bias is added once, after the partials are summed.
        """
        ctx = self.ctx
        if ctx.tp == 1:
            return linear(x, self.weight, self.bias, self.fp8)  # [s, b, o]
        if not self.input_is_parallel:
            x = mp.split_last(x, ctx.group)  # [s, b, in/tp]
        if ctx.sp:
            if ctx.comm_chunks > 1 and self.fp8 is None:
                from colonnade.tensor_parallel.partition import linear_reduce_scatter

                y = linear_reduce_scatter(x, self.weight, ctx.group, ctx.comm_chunks)
            else:
                y = mp.reduce_scatter_seq(linear(x, self.weight, None, self.fp8),
                                          ctx.group)  # [s/tp, b, o]
        else:
            y = mp.reduce_from_tp(linear(x, self.weight, None, self.fp8), ctx.group)  # [s, b, o]
        if self.bias is not None:
            y = y + self.bias
        return y


def padded_vocab(vocab: int, tp: int) -> int:
    """Vocabulary rounded up to a multiple of tp."""
    return -(-vocab // tp) * tp


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the (padded) vocabulary split across tp.

    Rank i holds rows [i V'/tp, (i+1) V'/tp) of the [V', h] table, V' = V padded to a multiple
    of tp with zero rows. Tokens [s, b] -> [s, b, h] (all-reduced) or [s/tp, b, h]
    (reduce-scattered) under sp.
    """

    def __init__(self, vocab: int, hidden: int, ctx: ParallelContext, key: str, *,
                 std: float) -> None:
        super().__init__()
        self.ctx, self.vocab = ctx, vocab
        pad = padded_vocab(vocab, ctx.tp) - vocab
        if pad and ctx.tp_rank == 0:
            log.info("%s: vocab %d padded to %d (+%d zero rows) for tp=%d; the padded logits are "
                     "masked out of the loss and the output", key, vocab, vocab + pad, pad, ctx.tp)
        spec = Sharding(f"{key}.weight", (vocab, hidden), dim=0, padded_rows=pad)
        self.weight = ctx.param(spec, std)
        (self.start, _), (self.rows, _) = spec.slice(tp_coords(ctx.tp_rank, ctx.tp))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        if ctx.tp == 1:
            out = F.embedding(tokens, self.weight)  # [s, b, h]
            return mp.split_seq(out, ctx.group) if ctx.sp else out
        local = tokens - self.start  # [s, b]
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [s, b, h]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if ctx.sp:
            return mp.reduce_scatter_seq(out, ctx.group)  # [s/tp, b, h]
        return mp.reduce_from_tp(out, ctx.group)  # [s, b, h]
