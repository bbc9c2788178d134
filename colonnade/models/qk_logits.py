"""The per-head maximum of the pre-softmax attention logits (MuonClip's S_h, Kimi K2).

For query head h of a layer, over the batch, every query i and every key j the query may attend
(causal j <= i, the sliding window, document resets: :func:`colonnade.context_parallel.masks.
attention_mask`)::

    S_h = max_{b, i, j allowed} (q_{b,h,i} . k_{b,g(h),j}) * scale,    scale = 1 / sqrt(d)

with g(h) = h // (n / n_kv) the key head of query head h (grouped-query attention, as SDPA's
``enable_gqa``) and scale SDPA's default, the one every :class:`~colonnade.models.blocks.
Attention` path uses. q and k are the rotated heads core attention receives. Computed under
no_grad in query blocks whose [b, n, rows, S] scores hold at most :data:`BLOCK_ELEMENTS`
elements (the full [s, S] square is never stored). The products are taken in q's dtype,
as core attention multiplies them (bf16 on a GPU: tensor cores, float32 accumulation, each
logit rounded once to bf16, relative error <= 2^-9 on S; exact in float32 / float64), the
maximum is kept in ``logit_max``'s dtype (at least float32).
:class:`~colonnade.models.blocks.Attention` keeps the running maximum over a step's
micro-batches in ``logit_max`` [n] while :mod:`colonnade.optim.qk_clip` has installed it.
"""

from __future__ import annotations

import math

import torch

from colonnade.context_parallel import masks
from colonnade.eager import eager

BLOCK_ELEMENTS = 1 << 22
"""Most score elements one query block computes at once (32 MiB in float64)."""


@eager
@torch.no_grad()
def record_logit_max(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     window: int | None, mask: torch.Tensor | None) -> None:
    """``out`` [n] <- max(out, S) with S [n] the per-head logit maximum (module docstring) of
    q [b, n, s, d] over k [b, n_kv, s, d] (training: no cache, queries and keys at the same
    positions 0 .. s - 1); ``mask`` [b, 1, s, s] (True: may attend, already causal) or None
    (causal), the window AND-ed in. Always eager (an in-place side result of a compiled
    layer)."""
    b, n, s, d = q.shape
    allowed = masks.attention_mask(s, s, window, mask, q.device)  # [b or 1, 1, s, s] or None
    if allowed is None:
        allowed = masks.causal(s, s, q.device)[None, None]  # [1, 1, s, s]
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(
        allowed.logical_not(), -math.inf)  # [b or 1, 1, s, s]: 0 or -inf (not attended)
    keys = k.repeat_interleave(n // k.shape[1], dim=1)  # [b, n, s, d]
    rows = max(1, BLOCK_ELEMENTS // max(1, b * n * s))
    top = torch.full_like(out, -math.inf)  # [n]: max of q . k (unscaled)
    for r0 in range(0, s, rows):
        r1 = min(s, r0 + rows)
        scores = q[:, :, r0:r1] @ keys.transpose(2, 3)  # [b, n, rows, s] in q's dtype
        if bias.shape[0] == 1:  # one mask for the batch: reduce over b before masking
            scores = scores.amax(dim=0, keepdim=True)  # [1, n, rows, s]
        scores += bias[:, :, r0:r1]
        torch.maximum(top, scores.amax(dim=(0, 2, 3)).to(top.dtype), out=top)
    torch.maximum(out, top * (1.0 / math.sqrt(d)), out=out)  # scale > 0: max commutes
