"""Attention sinks (gpt-oss): a learned logit per head that joins every query's softmax.

Head h has a sink logit s_h. For query row i with scores l_ij = c q_i k_j (masked keys
-inf), the sink adds exp(s_h) to the softmax denominator and nothing to the output::

    p_ij = exp(l_ij) / (sum_j exp(l_ij) + exp(s_h))

Derivation of the form computed here: with lse_i = log sum_j exp(l_ij) (the plain
attention's log-sum-exp) and P_ij = exp(l_ij - lse_i) (its softmax),
p_ij = P_ij e^lse / (e^lse + e^s) = P_ij / (1 + exp(s_h - lse_i)) = P_ij sigmoid(lse_i - s_h),
so the output of plain attention is only rescaled per row::

    out'_i = out_i sigmoid(lse_i - s_h)          lse'_i = logaddexp(lse_i, s_h)

This is exactly the online-softmax merge (:func:`colonnade.context_parallel.kernels.merge`)
of the attention's partial with one virtual key of logit s_h and value 0: the factor is
exp(lse_i - lse'_i). So it is applied ONCE, after every key block was merged (ring attention:
after the ring, with the final lse), and the backward is the ordinary attention backward
with the final out' and lse' (:func:`~colonnade.context_parallel.kernels.block_backward`:
P' = exp(S - lse'), D_i = sum_d dout_id out'_id), plus the sink's own gradient: its column
has dP = dout . 0 = 0, so dS_sink,i = P'_sink,i (0 - D_i) with P'_sink,i = exp(s_h - lse'_i)
= sigmoid(s_h - lse_i)::

    d s_h = - sum_{b, i} sigmoid(s_h - lse_i) D_i

A row with no visible key (lse -inf) gets out' 0, lse' = s_h and D = 0: no gradient.
Shapes: out [b, a, n, d], lse [b, a, n] (fp32, fp64 for fp64 inputs), sinks [a] (this rank's
heads).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from colonnade.context_parallel import kernels


def _per_row(sinks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sinks [a] -> [1, a, 1] in ``dtype``, broadcastable to lse [b, a, n]."""
    return sinks.to(dtype).view(1, -1, 1)


def merge_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sink merged into a final partial: out [b, a, n, d] (any dtype), lse [b, a, n]
    -> (out' = out sigmoid(lse - s) in out's dtype, lse' = logaddexp(lse, s))."""
    s = _per_row(sinks.detach(), lse.dtype)  # [1, a, 1]
    factor = torch.sigmoid(lse - s)  # [b, a, n]; 0 for a row with lse -inf
    merged = (out.to(lse.dtype) * factor.unsqueeze(-1)).to(out.dtype)  # [b, a, n, d]
    return merged, torch.logaddexp(lse, s.expand_as(lse))


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               sinks: torch.Tensor) -> torch.Tensor:
    """d s [a] (in sinks' dtype) from the output gradient dout [b, a, n, d] and the FINAL
    out' [b, a, n, d], lse' [b, a, n] (after :func:`merge_sinks`): -sum_{b, i}
    exp(s - lse'_i) D_i, D_i = sum_d dout_id out'_id (module doc)."""
    acc = lse.dtype
    big_d = (dout.to(acc) * out.to(acc)).sum(dim=-1)  # [b, a, n]
    weight = torch.exp(_per_row(sinks.detach(), acc) - lse)  # [b, a, n], P'_sink
    return (-(weight * big_d).sum(dim=(0, 2))).to(sinks.dtype)  # [a]


class SinkAttention(torch.autograd.Function):
    """Autograd of :func:`attention_with_sinks`: saves q, k, v, out' and lse' (no scores)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor, causal: bool, mask: torch.Tensor | None,
                scale: float) -> torch.Tensor:
        """One fused block (:func:`kernels.block_forward`), then the sink merged."""
        out, lse = kernels.block_forward(q, k, v, causal=causal, mask=mask, scale=scale)
        out, lse = merge_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.causal, ctx.mask, ctx.scale = causal, mask, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:
        """The block backward with the final out' / lse', and d sinks (module doc)."""
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = dout.contiguous()
        dq, dk, dv = kernels.block_backward(dout, q, k, v, out, lse, causal=ctx.causal,
                                            mask=ctx.mask, scale=ctx.scale)
        return dq, dk, dv, sinks_grad(dout, out, lse, sinks), None, None, None


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         sinks: torch.Tensor, *, causal: bool,
                         mask: torch.Tensor | None = None,
                         scale: float | None = None) -> torch.Tensor:
    """softmax attention whose every row's denominator also holds exp(sinks[h]) (module
    doc): q [b, a, n, d], k / v [b, kv, m, d] (GQA, not expanded), sinks [a], ``causal``
    top-left (query i sees keys j <= i), ``mask`` bool broadcastable to [b, 1, n, m] (True:
    may attend); ``scale`` defaults to 1 / sqrt(d). Returns [b, a, n, d]. Differentiable in
    q, k, v and sinks; the kernel is :func:`kernels.block_forward`'s (fused where it can)."""
    if sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks {tuple(sinks.shape)} must hold one logit per query head "
                         f"({q.shape[1]})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    out: torch.Tensor = SinkAttention.apply(q, k, v, sinks, causal, mask, scale)
    return out
