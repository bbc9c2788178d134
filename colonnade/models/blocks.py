"""Building blocks of the decoder: rotary embeddings, document resets, attention, dropout.

Norms live in :mod:`colonnade.models.norms`, MLPs in :mod:`colonnade.models.mlps`, the layer
that combines them by a spec in :mod:`colonnade.models.layer`.

Activations are [s, b, h] (sequence first), [s/tp, b, h] between tp regions under sp.
Heads are split across tp: a rank holds a/tp query heads and kv/tp key/value heads.

Document boundaries (Megatron's reset_position_ids / reset_attention_mask, :class:`DocReset`):
a packed sample holds several documents, each ending with EOD. With ``positions`` the position
ids restart at 0 after every EOD (RoPE angles and learned positions then see each document from
0); with ``attention`` a token attends only to earlier tokens of its own document (the EOD
belongs to the document it ends). :func:`doc_context` derives both from the tokens [b, s];
every layer of every chunk receives the same :class:`DocContext`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from colonnade.config.sections import ModelConfig
from colonnade.models.checkpointing import checkpoint
from colonnade.models.dropout_attention import DropoutSpec, dropout_attention
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel,
)
from colonnade.tensor_parallel.sharding import output_std


def rope_tables(cfg: ModelConfig, device: torch.device | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_seq_len, d/2] for RoPE with base ``rope_theta``."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), inv)  # [S, d/2]
    return angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) of x [..., d] by position angles cos/sin broadcastable to
    [..., d/2] (attention passes x [s, b, n, d] with cos/sin [s, 1, 1, d/2], or [s, b, 1, d/2]
    per-token positions); the result is contiguous in x's dim order."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


@dataclass(frozen=True)
class DocReset:
    """Reset at document boundaries: the EOD token id and which resets are on."""

    eod_id: int
    positions: bool = True
    """Position ids restart at 0 after each EOD (reset_position_ids)."""
    attention: bool = True
    """Attention does not cross an EOD (reset_attention_mask)."""


@dataclass(frozen=True)
class DocContext:
    """Per micro-batch: position ids [b, s] and the attention mask [b, 1, s, s] (True: may
    attend), each None when that reset is off."""

    positions: torch.Tensor | None
    mask: torch.Tensor | None


def doc_context(tokens: torch.Tensor, reset: DocReset) -> DocContext:
    """Position ids and attention mask of tokens [b, s] under ``reset`` (see the module
    docstring). Document d of a row starts at 0 or just after its d-th EOD."""
    b, s = tokens.shape
    eod = (tokens == reset.eod_id).long()  # [b, s]
    doc = eod.cumsum(dim=1) - eod  # [b, s]: EODs strictly before each position
    positions = mask = None
    if reset.positions:
        idx = torch.arange(s, device=tokens.device).expand(b, s)  # [b, s]
        begins = torch.ones_like(eod, dtype=torch.bool)
        begins[:, 1:] = eod[:, :-1].bool()  # a document begins at 0 and after each EOD
        positions = idx - torch.where(begins, idx, 0).cummax(dim=1).values  # [b, s]
    if reset.attention:
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()  # [s, s]
        mask = ((doc.unsqueeze(2) == doc.unsqueeze(1)) & causal).unsqueeze(1)  # [b, 1, s, s]
    return DocContext(positions, mask)


@dataclass
class KVCache:
    """Keys and values of past positions for generation: [b, kv_local, S_max, d] each."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads, split across tp by heads."""

    direct_children = ("q", "k", "v")
    """Children whose weights ``column_parallel`` may read directly (see there)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str, layer: int) -> None:
        super().__init__()
        self.cfg, self.ctx, self.site = cfg, ctx, key
        self.dropout_site = f"{key}.attn_dropout"
        """The attention dropout's site, formatted once (no per-layer constant in a compiled
        layer's graph)."""
        tp, d, h = ctx.tp, cfg.head_dim, cfg.hidden_size
        self.heads, self.kv_heads = cfg.num_heads // tp, cfg.kv_heads // tp
        std = cfg.init_std
        self.q = ColumnParallelLinear(h, cfg.num_heads * d, ctx, f"{key}.q", bias=cfg.bias, std=std)
        self.k = ColumnParallelLinear(h, cfg.kv_heads * d, ctx, f"{key}.k", bias=cfg.bias, std=std)
        self.v = ColumnParallelLinear(h, cfg.kv_heads * d, ctx, f"{key}.v", bias=cfg.bias, std=std)
        self.o = RowParallelLinear(cfg.num_heads * d, h, ctx, f"{key}.o", bias=cfg.bias,
                                   std=output_std(std, cfg.num_layers))
        self.recompute_core = False

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | None = None, doc: DocContext | None = None) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]; ``doc``: document-boundary resets."""
        d = self.cfg.head_dim
        q, k, v = column_parallel(x, [self.q, self.k, self.v])  # one tp entry for all three
        s, b = q.shape[0], q.shape[1]
        q = q.view(s, b, self.heads, d)  # [s, b, a/tp, d]
        k = k.view(s, b, self.kv_heads, d)  # [s, b, kv/tp, d]
        start = cache.length if cache is not None else 0
        if rope is not None:  # rotated in [s, b, n, d] order: SDPA's output then keeps it
            if doc is not None and doc.positions is not None:
                pos = doc.positions.t()  # [s, b]
                cos, sin = rope[0][pos].unsqueeze(2), rope[1][pos].unsqueeze(2)  # [s, b, 1, d/2]
            else:
                cos = rope[0][start:start + s].unsqueeze(1).unsqueeze(1)  # [s, 1, 1, d/2]
                sin = rope[1][start:start + s].unsqueeze(1).unsqueeze(1)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # [b, n, s, d] views of [s, b, n, d] memory: no copy in, and SDPA's output follows q's
        # layout, so the [s, b, a/tp d] view of core_attention's result is free as well
        q = q.permute(1, 2, 0, 3)  # [b, a/tp, s, d]
        k = k.permute(1, 2, 0, 3)  # [b, kv/tp, s, d]
        v = v.view(s, b, self.kv_heads, d).permute(1, 2, 0, 3)  # [b, kv/tp, s, d]
        if cache is not None:
            cache.k[:, :, start:start + s] = k
            cache.v[:, :, start:start + s] = v
            cache.length = start + s
            k, v = cache.k[:, :, :start + s], cache.v[:, :, :start + s]
        mask = doc.mask if doc is not None else None  # [b, 1, s, s] or None (causal)
        if self.recompute_core and self.training:
            out = checkpoint(self.core_attention, self.ctx.rng, q, k, v, start,
                             mask)  # [s, b, a/tp * d]
        else:
            out = self.core_attention(q, k, v, start, mask)  # [s, b, a/tp * d]
        return self.o(out)

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       start: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal) v: q [b, a/tp, s, d], k/v [b, kv/tp, S, d] with
        S = start + s; ``mask`` [b, 1, s, S] (True: may attend) replaces the causal mask
        (document reset). Returns [s, b, a/tp * d].

        Causal is bottom-right aligned: query i (absolute position start + i) sees keys
        j <= start + i, also for a prefill of s > 1 tokens after a cached prefix (start > 0).
        Which path runs:

        * attention dropout 0 (or eval): fused ``F.scaled_dot_product_attention`` (flash /
          memory-efficient kernels on GPU), with ``is_causal`` when start = 0, an explicit
          [s, S] bottom-right mask when start > 0 and s > 1, no mask for one query token;
          memory O(b a s d) stored, no [s, S] scores.
        * attention dropout > 0 in training: the blockwise eager kernel of
          :mod:`colonnade.models.dropout_attention`: query blocks whose scores hold <= 2^22
          elements, keep-masks drawn only for this rank's heads and redrawn in backward;
          stores q, k, v and lse [b, a/tp, s], temporaries O(block x S).

        The part whose activations grow with s^2 when computed eagerly (selective
        recomputation's target).
        """
        p = self.cfg.attention_dropout if self.training else 0.0
        s, total = q.shape[2], k.shape[2]
        if p > 0.0:
            spec = DropoutSpec(self.ctx.rng, self.dropout_site, p,
                               self.heads * self.ctx.tp, self.ctx.tp_rank * self.heads)
            out = dropout_attention(q, k, v, spec, mask)  # [b, a/tp, s, d]
        else:
            gqa = self.kv_heads != self.heads
            if mask is None and start > 0 and s > 1:  # prefill after a cached prefix
                mask = causal_mask(s, total, q.device)
            if mask is not None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0 and s > 1,
                                                     enable_gqa=gqa)
        b, n, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d)  # [s, b, a/tp * d]


def causal_mask(s: int, total: int, device: torch.device) -> torch.Tensor:
    """Bottom-right causal mask [s, S] (True: may attend): query i sees keys j <= i + S - s."""
    return torch.ones(s, total, dtype=torch.bool, device=device).tril(total - s)


def hidden_dropout(x: torch.Tensor, p: float, ctx: ParallelContext, site: str,
                   training: bool) -> torch.Tensor:
    """Dropout on [s(/tp), b, h] activations: a slice of the full [s, b, h] mask.

    Without sp every tp rank holds the whole tensor (same slice, same mask); under sp rank r
    holds sequence chunk r and evaluates only those rows of the mask (see
    :mod:`colonnade.parallel.rng`); a 1-byte bool mask is kept for backward.
    """
    if not training or p == 0.0:
        return x
    return _draw_dropout(x, p, ctx, site)


@torch.compiler.disable
def _draw_dropout(x: torch.Tensor, p: float, ctx: ParallelContext, site: str) -> torch.Tensor:
    """:func:`hidden_dropout`'s draw, always eager: inside a compiled layer dynamo calls it
    without tracing it, so the tracker's (step, micro-batch) is read at every call, never
    guarded on (see :mod:`colonnade.models.compile`)."""
    s_local = x.shape[0]
    if ctx.sp:
        full = (s_local * ctx.tp, *x.shape[1:])
        index = (slice(ctx.tp_rank * s_local, (ctx.tp_rank + 1) * s_local),)
    else:
        full, index = tuple(x.shape), (slice(None),)
    return ctx.rng.dropout(x, p, site, full, index)
