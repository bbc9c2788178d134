"""Blockwise eager attention with dropout on the probabilities, memory O(block x S).

    out = dropout(softmax(q k^T / sqrt(d) + bias)) v,    bias = 0 where allowed, -inf elsewhere

q [b, a, s, d] (this rank's a heads), k/v [b, kv, S, d] (grouped-query: query head
g * rep + r reads kv head g, rep = a / kv). Query rows are processed in blocks of n rows, so
scores, probabilities and the keep-mask exist only for one block at a time: [b, a, n, S].
Autograd keeps q, k, v and the row log-sum-exp lse [b, a, s] (fp32 for 16-bit inputs), not the
[b, a, s, S] probabilities nor the mask: backward recomputes each block's probabilities from
lse and redraws its keep-mask from the same :class:`~colonnade.parallel.rng.MaskStream`
(FlashAttention's recipe; the counter-based RNG makes the redraw exact).

The keep-mask of block rows [i0, i1) is the slice
[:, head_offset : head_offset + a, i0 : i1, :] of the layout-independent full mask
[b, a_total, s, S] of the site, so every tp rank draws only its heads and the masks are those
of the single-process model.

Backward of one block (P probabilities, K keep / (1 - p), dO the output gradient):
    dV += (P K)^T dO,  dPK = dO V^T,  dP = dPK K,  dS = P (dP - rowsum(dP P)),
    dQ = dS K_ / sqrt(d),  dK += dS^T Q / sqrt(d).

Attention sinks (``sinks`` [a], :mod:`colonnade.context_parallel.sinks`): each row's
denominator also holds exp(s_h), so the probabilities are P' = exp(S - lse') with
lse' = logaddexp(lse, s_h), and dropout acts on P' (transformers' gpt-oss drops the
sink-normalised probabilities). The sink is a key of value 0, so the backward above holds with
P' unchanged, plus d s_h = -sum_{b, i} exp(s_h - lse'_i) rowsum(dP P')_i.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from colonnade.context_parallel import masks
from colonnade.eager import eager
from colonnade.parallel.rng import MaskStream, RNGTracker

BLOCK_ELEMENTS = 1 << 22
"""Score elements per query block (b x a x n x S) before a block is split further."""


@dataclass(frozen=True)
class DropoutSpec:
    """Which dropout the attention applies: ``rng``/``site`` draw the forward masks (the
    tracker's current context), ``heads_total`` and ``head_offset`` place this rank's heads
    in the full mask, ``p`` the drop probability."""

    rng: RNGTracker
    site: str
    p: float
    heads_total: int
    head_offset: int


def block_rows(b: int, a: int, s: int, total: int, budget: int = BLOCK_ELEMENTS) -> int:
    """Query rows per block so that a block's scores [b, a, n, S] hold <= budget elements."""
    return max(1, min(s, budget // max(1, b * a * total)))


def _allowed(mask: torch.Tensor | None, i0: int, i1: int, total: int, offset: int,
             device: torch.device) -> torch.Tensor:
    """Bool [b|1, 1, 1, n, S] broadcastable to grouped scores [b, kv, rep, n, S]: the doc mask's
    rows (a sliding window's band already in it), or bottom-right causal (query i sees keys
    j <= i + offset)."""
    if mask is not None:  # [b, 1, s, S]
        return mask[:, :, i0:i1].unsqueeze(1)
    rows = torch.arange(i0 + offset, i1 + offset, device=device)  # [n] query positions
    return masks.band(rows, torch.arange(total, device=device), None).view(
        1, 1, 1, i1 - i0, total)


class _Saved:
    """What the forward passes to backward besides tensors."""

    def __init__(self, stream: MaskStream, spec: DropoutSpec, mask: torch.Tensor | None,
                 rows: int, full: tuple[int, ...]) -> None:
        self.stream, self.spec, self.mask, self.rows, self.full = stream, spec, mask, rows, full


def _grouped(t: torch.Tensor, kv: int, i0: int, i1: int) -> torch.Tensor:
    """Rows [i0, i1) of a [b, a, s, d] tensor as [b, kv, rep * n, d] (a copy)."""
    b, a, _, d = t.shape
    return t[:, :, i0:i1].reshape(b, kv, a // kv * (i1 - i0), d)


class BlockwiseDropoutAttention(torch.autograd.Function):
    """Autograd function of the module docstring; see :func:`dropout_attention`."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                spec: DropoutSpec, mask: torch.Tensor | None, rows: int,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        b, a, s, d = q.shape
        kv, total = k.shape[1], k.shape[2]
        acc = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
        scale, keep_scale = 1.0 / math.sqrt(d), 1.0 / (1.0 - spec.p)
        full = (b, spec.heads_total, s, total)
        out = torch.empty_like(q)  # [b, a, s, d] in q's memory order (merged heads: a view)
        lse = torch.empty(b, a, s, dtype=acc, device=q.device)
        for i0 in range(0, s, rows):
            i1, n = min(i0 + rows, s), min(rows, s - i0)
            scores = (_grouped(q, kv, i0, i1) @ k.transpose(-1, -2)).to(acc) * scale
            scores = scores.view(b, kv, a // kv, n, total).masked_fill_(
                ~_allowed(mask, i0, i1, total, total - s, q.device), float("-inf"))
            row_lse = scores.logsumexp(dim=-1, keepdim=True)  # [b, kv, rep, n, 1]
            if sinks is not None:  # lse' = logaddexp(lse, s_h)
                row_lse = torch.logaddexp(row_lse, _sink_rows(sinks, kv, acc).expand_as(row_lse))
            probs = scores.sub_(row_lse).exp_().view(b, a, n, total)
            index = (slice(None), slice(spec.head_offset, spec.head_offset + a), slice(i0, i1))
            keep = spec.rng.keep_mask(spec.site, full, spec.p, index, q.device)
            probs.mul_(keep).mul_(keep_scale)
            block = probs.to(q.dtype).view(b, kv, -1, total) @ v  # [b, kv, rep * n, d]
            out[:, :, i0:i1] = block.view(b, a, n, d)
            lse[:, :, i0:i1] = row_lse.view(b, a, n)
        ctx.save_for_backward(q, k, v, lse, sinks)
        ctx.saved = _Saved(spec.rng.stream(spec.site, spec.p), spec, mask, rows, full)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, lse, sinks = ctx.saved_tensors
        saved: _Saved = ctx.saved
        spec = saved.spec
        b, a, s, d = q.shape
        kv, total, rep = k.shape[1], k.shape[2], a // k.shape[1]
        acc = lse.dtype
        scale, keep_scale = 1.0 / math.sqrt(d), 1.0 / (1.0 - spec.p)
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        dsinks = None if sinks is None else torch.zeros(b, kv, rep, 1, 1, dtype=acc,
                                                        device=q.device)
        for i0 in range(0, s, saved.rows):
            i1 = min(i0 + saved.rows, s)
            n = i1 - i0
            qb, gb = _grouped(q, kv, i0, i1), _grouped(grad.to(q.dtype), kv, i0, i1)
            scores = (qb @ k.transpose(-1, -2)).to(acc).mul_(scale).view(b, kv, rep, n, total)
            scores.masked_fill_(~_allowed(saved.mask, i0, i1, total, total - s, q.device),
                                float("-inf"))
            probs = scores.sub_(lse[:, :, i0:i1].reshape(b, kv, rep, n, 1)).exp_()
            index = (slice(None), slice(spec.head_offset, spec.head_offset + a), slice(i0, i1))
            keep = saved.stream.keep(saved.full, index, q.device).view(b, kv, rep, n, total)
            kept = probs * keep * keep_scale  # P K, [b, kv, rep, n, S]
            dv += kept.view(b, kv, rep * n, total).transpose(-1, -2).to(q.dtype).matmul(gb)
            dprobs = (gb @ v.transpose(-1, -2)).to(acc).view(b, kv, rep, n, total)
            dprobs.mul_(keep).mul_(keep_scale)
            row = (dprobs * probs).sum(-1, keepdim=True)  # [b, kv, rep, n, 1]
            if dsinks is not None:  # the sink's column: P'_sink (0 - row)
                sink_p = (_sink_rows(sinks, kv, acc)
                          - lse[:, :, i0:i1].reshape(b, kv, rep, n, 1)).exp()
                dsinks -= (sink_p * row).sum(dim=3, keepdim=True)
            ds = probs.mul_(dprobs - row).mul_(scale)
            ds = ds.view(b, kv, rep * n, total).to(q.dtype)
            dq[:, :, i0:i1] = (ds @ k).view(b, a, n, d)
            dk += ds.transpose(-1, -2).matmul(qb)
        grad_sinks = None if dsinks is None else dsinks.sum(dim=0).reshape(a).to(sinks.dtype)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, grad_sinks


def _sink_rows(sinks: torch.Tensor, kv: int, dtype: torch.dtype) -> torch.Tensor:
    """sinks [a] -> [1, kv, rep, 1, 1] in ``dtype`` (query head g rep + r is [., g, r])."""
    return sinks.detach().to(dtype).view(1, kv, -1, 1, 1)


@eager
def dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: DropoutSpec,
                      mask: torch.Tensor | None = None,
                      budget: int = BLOCK_ELEMENTS,
                      sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with dropout ``spec`` on the probabilities; q [b, a, s, d], k/v [b, kv, S, d],
    ``mask`` [b, 1, s, S] (True: may attend) or None for bottom-right causal. Returns
    [b, a, s, d] whose memory is [s, b, a, d] (so the [s, b, a d] view is free). Query blocks
    hold <= ``budget`` score elements (:func:`block_rows`); ``sinks`` [a]: per-head sink
    logits in every row's denominator (module doc), differentiable. Always eager (a compiled layer
    calls it without tracing it: its masks come from the tracker's context at call time)."""
    rows = block_rows(q.shape[0], q.shape[1], q.shape[2], k.shape[2], budget)
    out: torch.Tensor = BlockwiseDropoutAttention.apply(q, k, v, spec, mask, rows, sinks)
    return out
