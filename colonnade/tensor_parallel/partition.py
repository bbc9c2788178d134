"""Tensor partitioning: the sequence-parallel collectives cut into chunks and pipelined with the
matmuls that produce or consume them, so communication runs while the device computes.

Notation: tp ranks, n chunks, local sequence s/tp = n L. Rank r holds the contiguous sequence
block r, so the row index of the full sequence is ``r (s/tp) + c L + j`` (rank r, chunk c, row
j < L): the natural [s, ...] tensor is the view [tp, n, L, ...]. Chunk c of the collectives is
the slab [:, c] of that view: all-gathering the local pieces ``x_r[c]`` ([L, b, h]) gives the
rows (r, c, j) for every r in rank order ([tp L, b, h]), and reduce-scattering a [tp L, b, .]
slab gives rank r exactly its rows (r, c, :). Writing each chunk back to the slab [:, c] keeps
the layout and the numbers identical to the unchunked operators (only the summation order of
the weight gradient differs, by rounding).

Column-parallel under sp, Y_k = AllGather_s(X) A_k^T + b_k (:func:`gathered_linears`, for k
sibling weights reading the same X, e.g. q, k, v; :func:`gathered_linear` for one):
  forward   post every chunk's all-gather; wait chunk c, multiply it by every A_k while
            chunks c+1.. are in flight. The gathered X is saved for the weight gradients.
  backward  dX_c = sum_k dY_k[:, c] A_k for each chunk, its reduce-scatter posted at once; the
            weight gradients dA_k = dY_k^T X_gathered run while the reduce-scatters fly.
Row-parallel under sp, Y = ReduceScatter_s(X A^T) (:func:`linear_reduce_scatter`):
  forward   partial P_c = X[:, c] A^T, its reduce-scatter posted; P_{c+1} computed meanwhile.
  backward  post every chunk's all-gather of dY; wait chunk c, compute dX[:, c] = dY_c A and
            accumulate dA += dY_c^T X[:, c] while c+1.. are in flight.

The first all-gather of a forward / the last reduce-scatter of a row forward have no compute
to hide behind, so at best (n-1)/n of their time is hidden; the column backward's
reduce-scatters all hide behind the weight-gradient matmul. Every collective goes through
:class:`~colonnade.parallel.comm.CommGroup` (async handles record in-flight and waited time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from colonnade.parallel.comm import CommGroup, Handle


def chunk_rows(s_local: int, chunks: int, where: str) -> int:
    """Rows L of one chunk of a local sequence of ``s_local`` rows (``s_local = chunks L``)."""
    if chunks < 1:
        raise ValueError(f"{where}: parallel.tp_comm_chunks must be >= 1, got {chunks}")
    if s_local % chunks:
        raise ValueError(f"{where}: the local sequence of {s_local} rows (training.seq_len / tp) "
                         f"is not divisible by parallel.tp_comm_chunks={chunks}; choose "
                         f"tp_comm_chunks dividing seq_len / tp (or 1 to switch chunking off).")
    return s_local // chunks


def _wait_all(handles: list[Handle]) -> None:
    for handle in handles:
        handle.wait()


class GatheredLinears(torch.autograd.Function):
    """Chunked ``F.linear(all_gather_seq(x), w_k, b_k)`` for k sibling weights reading one x.

    x [s/tp, b, h] -> one [s, b, o_k/tp] per weight; each chunk is gathered once and serves
    every weight (attention's q, k, v; SwiGLU's gate, up), as the unchunked path gathers once.
    Arguments after ``count``: the ``count`` weights [o_k/tp, h], then ``count`` biases or None.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: CommGroup, chunks: int, count: int,
                *params: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        weights, biases = params[:count], params[count:]
        tp, (s_local, b, h) = group.size, x.shape
        rows = chunk_rows(s_local, chunks, "ColumnParallelLinear")
        pieces = x.contiguous().view(chunks, rows, b, h)  # [n, L, b, h]
        gathered = x.new_empty((chunks, tp * rows, b, h))  # [n, tp L, b, h]; rows (r, j) of c
        handles = [group.all_gather_into(gathered[c], pieces[c], name="sp_gather_chunk",
                                         async_op=True) for c in range(chunks)]
        # [tp, n, L, b, o_k/tp] = natural [s, b, o_k/tp]
        outs = [x.new_empty((tp, chunks, rows, b, w.shape[0])) for w in weights]
        for c in range(chunks):
            handles[c].wait()
            for out, w, bias in zip(outs, weights, biases, strict=True):
                out[:, c] = F.linear(gathered[c], w, bias).view(tp, rows, b, w.shape[0])
        ctx.save_for_backward(gathered, *weights)
        ctx.group, ctx.chunks, ctx.count = group, chunks, count
        ctx.has_bias = [bias is not None for bias in biases]
        return tuple(out.view(tp * chunks * rows, b, out.shape[-1]) for out in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gathered, *weights = ctx.saved_tensors
        group, n, k = ctx.group, ctx.chunks, ctx.count
        tp, (_, tp_rows, b, h) = group.size, gathered.shape
        rows = tp_rows // tp
        # dY_k as [tp, n, L, b, o_k/tp]
        gs = [g.contiguous().view(tp, n, rows, b, w.shape[0]) for g, w in zip(grads, weights,
                                                                                strict=True)]
        grad_x = None
        handles: list[Handle] = []
        partials: list[torch.Tensor] = []  # kept alive until their reduce-scatter completes
        if ctx.needs_input_grad[0]:
            grad_x = gathered.new_empty((n, rows, b, h))  # [n, L, b, h] = this rank's [s/tp, b, h]
            for c in range(n):
                part = gs[0][:, c].matmul(weights[0])  # [tp, L, b, h] partial sums
                for g, w in zip(gs[1:], weights[1:], strict=True):
                    part.add_(g[:, c].matmul(w))
                partials.append(part)
                handles.append(group.reduce_scatter_into(
                    grad_x[c], part.view(tp * rows, b, h), name="sp_gather_chunk_bwd",
                    async_op=True))
        grad_ws: list[torch.Tensor | None] = [None] * k
        grad_bs: list[torch.Tensor | None] = [None] * k
        flat_x = gathered.view(-1, h)  # [n tp L b, h]
        for i, (g, w) in enumerate(zip(gs, weights, strict=True)):
            if ctx.needs_input_grad[4 + i]:
                o = w.shape[0]
                grad_ws[i] = g.transpose(0, 1).reshape(-1, o).t().mm(flat_x)  # [o_k/tp, h]
            if ctx.has_bias[i] and ctx.needs_input_grad[4 + k + i]:
                grad_bs[i] = grads[i].sum(dim=(0, 1))  # [o_k/tp]
        _wait_all(handles)
        if grad_x is not None:
            grad_x = grad_x.view(n * rows, b, h)  # [s/tp, b, h]
        return (grad_x, None, None, None, *grad_ws, *grad_bs)


class LinearReduceScatter(torch.autograd.Function):
    """Chunked ``reduce_scatter_seq(F.linear(x, weight))``: x [s, b, i/tp] -> [s/tp, b, o]."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, group: CommGroup,
                chunks: int) -> torch.Tensor:
        tp, (s, b, i) = group.size, x.shape
        if s % tp:
            raise ValueError(f"RowParallelLinear: sequence length {s} not divisible by tp={tp}")
        rows = chunk_rows(s // tp, chunks, "RowParallelLinear")
        o = weight.shape[0]
        x = x.contiguous()
        xv = x.view(tp, chunks, rows, b, i)  # [tp, n, L, b, i/tp]
        out = x.new_empty((chunks, rows, b, o))  # [n, L, b, o] = this rank's [s/tp, b, o]
        handles: list[Handle] = []
        partials: list[torch.Tensor] = []
        for c in range(chunks):
            part = F.linear(xv[:, c], weight).reshape(tp * rows, b, o)  # [tp L, b, o] partial
            partials.append(part)
            handles.append(group.reduce_scatter_into(out[c], part, name="sp_reduce_scatter_chunk",
                                                     async_op=True))
        _wait_all(handles)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.chunks = group, chunks
        return out.view(chunks * rows, b, o)  # [s/tp, b, o]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        group, n = ctx.group, ctx.chunks
        tp, (s, b, i), o = group.size, x.shape, weight.shape[0]
        rows = s // (tp * n)
        pieces = grad.contiguous().view(n, rows, b, o)  # [n, L, b, o]
        gathered = grad.new_empty((n, tp * rows, b, o))  # [n, tp L, b, o]; rows (r, j) of c
        handles = [group.all_gather_into(gathered[c], pieces[c],
                                         name="sp_reduce_scatter_chunk_bwd", async_op=True)
                   for c in range(n)]
        xv = x.view(tp, n, rows, b, i)  # [tp, n, L, b, i/tp]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = x.new_empty((tp, n, rows, b, i)) if need_x else None  # natural [s, b, i/tp]
        grad_w = weight.new_zeros((o, i)) if need_w else None  # [o, i/tp]
        for c in range(n):
            handles[c].wait()
            g_c = gathered[c].view(tp, rows, b, o)  # [tp, L, b, o]
            if grad_x is not None:
                grad_x[:, c] = g_c.matmul(weight)  # [tp, L, b, i/tp]
            if grad_w is not None:
                grad_w.addmm_(g_c.reshape(-1, o).t(), xv[:, c].reshape(-1, i))  # [o, i/tp]
        if grad_x is not None:
            grad_x = grad_x.view(s, b, i)  # [s, b, i/tp]
        return grad_x, grad_w, None, None


def gathered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    group: CommGroup, chunks: int) -> torch.Tensor:
    """Column-parallel linear under sp with the all-gather cut into ``chunks`` pieces.

    x [s/tp, b, h] (this rank's sequence block), weight [o/tp, h], bias [o/tp] or None ->
    [s, b, o/tp], equal to ``F.linear(gather_seq(x), weight, bias)``.
    """
    (y,) = GatheredLinears.apply(x, group, chunks, 1, weight, bias)
    return y


def gathered_linears(x: torch.Tensor, weights: Sequence[torch.Tensor],
                     biases: Sequence[torch.Tensor | None], group: CommGroup,
                     chunks: int) -> tuple[torch.Tensor, ...]:
    """Several column-parallel linears reading the same sp input, sharing one chunked gather.

    x [s/tp, b, h], weights [o_k/tp, h], biases [o_k/tp] or None -> one [s, b, o_k/tp] per
    weight, equal to ``F.linear(gather_seq(x), w_k, b_k)`` (the gather and, backward, the
    reduce-scatter of the summed input gradient happen once, as in the unchunked path).
    """
    if not weights or len(weights) != len(biases):
        raise ValueError(f"gathered_linears: need one bias (or None) per weight, got "
                         f"{len(weights)} weights and {len(biases)} biases")
    return GatheredLinears.apply(x, group, chunks, len(weights), *weights, *biases)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: CommGroup,
                          chunks: int) -> torch.Tensor:
    """Row-parallel linear under sp with the reduce-scatter cut into ``chunks`` pieces.

    x [s, b, i/tp], weight [o, i/tp] -> this rank's [s/tp, b, o] block of the summed output,
    equal to ``reduce_scatter_seq(F.linear(x, weight))``.
    """
    return LinearReduceScatter.apply(x, weight, group, chunks)
