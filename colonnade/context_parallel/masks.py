"""Which keys a query may attend: the one place the attention-mask maths lives.

For a query at absolute sequence position i and a key at position j (positions of the whole
sequence, natural order; with a KV cache the cached prefix counts)::

    causal          j <= i
    sliding window  i - j < W        (model.sliding_window = W: W keys, the query's own included;
                                      transformers' sliding_window_overlay, kv_idx > q_idx - W)
    document reset  doc[i] == doc[j] (colonnade.models.blocks.DocReset; applied by the callers
                                      as a separate boolean mask and AND-ed with these)

so a windowed causal query sees the keys max(0, i - W + 1) .. i. The window counts absolute
positions: a document reset shortens what a query sees further, never lengthens it.

Users: the fused SDPA path and the eager dropout kernel
(:meth:`colonnade.models.blocks.Attention.attend`, bottom-right aligned masks for a prefill
after a cached prefix and for one-token decoding), all-to-all attention (the same path on the
whole sequence), and ring attention (:mod:`colonnade.context_parallel.ring`: which (query
chunk, key chunk) blocks are computed, and the band inside a block, :func:`block_kind`).
"""

from __future__ import annotations

import torch

SKIP, FULL, DIAG, BAND = "skip", "full", "diag", "band"
"""Kinds of a (query block, key block) pair (:func:`block_kind`)."""


def band(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and windowed) visibility of query positions q_pos [n] over key positions
    k_pos [m]: bool [n, m], True where 0 <= i - j (< W with a window)."""
    diff = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)  # [n, m]: i - j
    ok = diff >= 0
    return ok & (diff < window) if window is not None else ok


def causal(s: int, total: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """Bottom-right causal mask [s, S] (S = ``total``, True: may attend): the s queries are
    the last s positions S - s .. S - 1 (a prefill after a cached prefix of S - s tokens, or
    one decoded token), the keys positions 0 .. S - 1; windowed by ``window``."""
    q_pos = torch.arange(total - s, total, device=device)  # [s]
    return band(q_pos, torch.arange(total, device=device), window)  # [s, S]


def attention_mask(s: int, total: int, window: int | None, mask: torch.Tensor | None,
                   device: torch.device) -> torch.Tensor | None:
    """The boolean mask core attention applies to s queries over S = ``total`` keys: ``mask``
    ([b, 1, s, S], the document reset's, already causal) AND-ed with the window's band, or the
    windowed causal mask [1, 1, s, S] alone; without a window, or one that cuts nothing
    (S <= W: no query is W positions past any key), ``mask`` unchanged (None: plain causal,
    which the kernels apply natively: the flash kernels stay usable)."""
    if window is None or total <= window:
        return mask
    windowed = causal(s, total, device, window)[None, None]  # [1, 1, s, S]
    return windowed if mask is None else mask & windowed


def block_kind(q0: int, n_q: int, k0: int, n_k: int, causal: bool,
               window: int | None) -> str:
    """How a block of queries at positions q0 .. q0 + n_q - 1 attends keys at k0 .. k0 + n_k - 1:

    * :data:`SKIP`: no query sees any key (every key in the future, or every key at least W
      behind every query): never computed;
    * :data:`FULL`: every query sees every key (no mask);
    * :data:`DIAG`: a square block on the diagonal (q0 = k0) that the window does not cut: the
      kernels' own top-left causal mask;
    * :data:`BAND`: anything else: the mask :func:`band` of the two position ranges.
    """
    if not causal:
        return FULL
    nearest, farthest = q0 - (k0 + n_k - 1), q0 + n_q - 1 - k0  # min and max of i - j
    if farthest < 0 or (window is not None and nearest >= window):
        return SKIP
    fits = window is None or farthest < window
    if nearest >= 0 and fits:
        return FULL
    if q0 == k0 and n_q == n_k and fits:
        return DIAG
    return BAND


def block_band(q0: int, n_q: int, k0: int, n_k: int, window: int | None,
               device: torch.device) -> torch.Tensor:
    """:func:`band` of the position ranges of a :data:`BAND` block: bool [n_q, n_k]."""
    return band(torch.arange(q0, q0 + n_q, device=device),
                torch.arange(k0, k0 + n_k, device=device), window)
