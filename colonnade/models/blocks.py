"""Building blocks of the decoder: rotary embeddings, document resets, attention, dropout.

Norms live in :mod:`colonnade.models.norms`, MLPs in :mod:`colonnade.models.mlps`, the layer
that combines them by a spec in :mod:`colonnade.models.layer`.

Activations are [s, b, h] (sequence first), [s/tp, b, h] between tp regions under sp; without
sp and cp they are batch-first, [b, s, h] (``ParallelContext.batch_first``).
Heads are split across tp: a rank holds a/tp query heads and kv/tp key/value heads.

Document boundaries (Megatron's reset_position_ids / reset_attention_mask, :class:`DocReset`):
a packed sample holds several documents, each ending with EOD. With ``positions`` the position
ids restart at 0 after every EOD (RoPE angles and learned positions then see each document from
0); with ``attention`` a token attends only to earlier tokens of its own document (the EOD
belongs to the document it ends). :func:`doc_context` derives both from the tokens [b, s];
every layer of every chunk receives the same :class:`DocContext`.

Context parallelism (cp > 1, :mod:`colonnade.context_parallel`): a cp rank holds the zigzag
rows of the sequence (:mod:`colonnade.context_parallel.layout`), s/cp of them. Its
:class:`DocContext` always carries the local rows' position ids [b, s/cp] (global positions,
or the document-reset ones computed on the full tokens and then taken locally), and with
``attention`` reset the full-sequence document ids [b, s] (ring and hierarchical attention)
or the full mask [b, 1, s, s] (all-to-all attention, which attends over the whole
natural-order sequence). Core attention then runs
:func:`~colonnade.context_parallel.ring.ring_attention`,
:func:`~colonnade.context_parallel.all_to_all_attention.all_to_all_attention` or
:func:`~colonnade.context_parallel.hierarchical.hierarchical_attention` (attention dropout keyed
by global positions in each), and hidden dropout draws the rows of the full [s, b, h] mask
that the rank holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from colonnade.config.sections import ModelConfig
from colonnade.context_parallel import masks
from colonnade.context_parallel.all_to_all_attention import all_to_all_attention
from colonnade.context_parallel.block_dropout import BlockDropout
from colonnade.context_parallel.hierarchical import hierarchical_attention
from colonnade.context_parallel.layout import local_ranges, take_local, zigzag_index, zigzag_ranges
from colonnade.context_parallel.ring import ring_attention
from colonnade.context_parallel.sinks import attention_with_sinks
from colonnade.eager import eager
from colonnade.models.checkpointing import checkpoint
from colonnade.models.dropout_attention import DropoutSpec, dropout_attention
from colonnade.models.qk_logits import record_logit_max
from colonnade.models.rope import rope_cos_sin
from colonnade.parallel.comm import CommGroup
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel,
)
from colonnade.tensor_parallel.sharding import output_std


def rope_tables(cfg: ModelConfig, device: torch.device | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [max_seq_len, d/2] for RoPE with base ``rope_theta``, scaled by
    model.rope_scaling and multiplied by its attention factor (:mod:`colonnade.models.rope`);
    d is ``cfg.rope_dim`` (the head width, or MLA's rotary part)."""
    return rope_cos_sin(cfg, cfg.rope_dim, device, dtype)


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
    attend), each None when that reset is off.

    Under cp > 1 (:func:`cp_doc_context`): ``positions`` [b, s/cp] of the rank's local rows
    (always set), ``mask`` the full-sequence mask (all-to-all attention only) and ``doc_ids``
    [b, s] the full sequence's document index of each token (ring attention only)."""

    positions: torch.Tensor | None
    mask: torch.Tensor | None
    doc_ids: torch.Tensor | None = None


def doc_context(tokens: torch.Tensor, reset: DocReset, *, ids: bool = False,
                mask: bool = True) -> DocContext:
    """Position ids and attention mask of tokens [b, s] under ``reset`` (see the module
    docstring). Document d of a row starts at 0 or just after its d-th EOD. ``ids``: also
    return the document ids [b, s] (attention reset only); ``mask=False``: no [b, 1, s, s]
    mask."""
    want_mask = mask
    b, s = tokens.shape
    eod = (tokens == reset.eod_id).long()  # [b, s]
    doc = eod.cumsum(dim=1) - eod  # [b, s]: EODs strictly before each position
    positions = mask_t = doc_ids = None
    if reset.positions:
        idx = torch.arange(s, device=tokens.device).expand(b, s)  # [b, s]
        begins = torch.ones_like(eod, dtype=torch.bool)
        begins[:, 1:] = eod[:, :-1].bool()  # a document begins at 0 and after each EOD
        positions = idx - torch.where(begins, idx, 0).cummax(dim=1).values  # [b, s]
    if reset.attention and want_mask:
        causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()  # [s, s]
        mask_t = ((doc.unsqueeze(2) == doc.unsqueeze(1)) & causal).unsqueeze(1)  # [b, 1, s, s]
    if reset.attention and ids:
        doc_ids = doc  # [b, s]
    return DocContext(positions, mask_t, doc_ids)


def cp_doc_context(tokens: torch.Tensor | None, reset: DocReset | None, ctx: ParallelContext,
                   b: int, s: int, device: torch.device) -> DocContext:
    """The :class:`DocContext` of a cp rank (cp > 1) for a micro-batch of full tokens [b, s]
    (``tokens`` may be None without ``reset``): positions [b, s/cp] of its zigzag rows
    (document-reset positions when on, else the global positions), and under attention reset
    the full document ids [b, s] (ring) or the full mask [b, 1, s, s] (all_to_all)."""
    cp, rank = ctx.cp_size, ctx.cp_rank
    full = None
    if reset is not None:
        assert tokens is not None
        ring = ctx.cp_attention != "all_to_all"  # ring and hierarchical: document ids
        full = doc_context(tokens, reset, ids=ring, mask=not ring)
    if full is not None and full.positions is not None:
        positions = take_local(full.positions, cp, rank, dim=1)  # [b, s/cp]
    else:
        positions = zigzag_index(s, cp, rank, device).expand(b, s // cp)  # [b, s/cp]
    if full is None:
        return DocContext(positions, None)
    return DocContext(positions, full.mask, full.doc_ids)


@dataclass
class KVCache:
    """Keys and values of past positions for generation: [b, kv_local, S_max, d] each."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [b, n_kv, s, d] at positions length .. length + s - 1; return the keys
        and values of every position so far, views [b, n_kv, length + s, d]."""
        start, s = self.length, k.shape[2]
        self.k[:, :, start:start + s] = k
        self.v[:, :, start:start + s] = v
        self.length = start + s
        return self.k[:, :, :self.length], self.v[:, :, :self.length]


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads, split across tp by heads."""

    direct_children = ("q", "k", "v")
    """Children whose weights ``column_parallel`` may read directly (see there)."""
    head_norms: ClassVar[int] = 0
    """Norms of width d over each head the layer holds (:meth:`before_rope`; Qwen3's q and k
    norms: 2), what the parameter counters read."""
    has_sinks: ClassVar[bool] = False
    """A learned sink logit per head (:meth:`head_sinks`; gpt-oss's
    :class:`~colonnade.models.gpt_oss.SinkAttention`), what the parameter counters read."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str, layer: int) -> None:
        super().__init__()
        self.cfg, self.ctx, self.site = cfg, ctx, key
        self.dropout_site = f"{key}.attn_dropout"
        """The attention dropout's site, formatted once (no per-layer constant in a compiled
        layer's graph)."""
        tp, d, h = ctx.tp, cfg.head_size, cfg.hidden_size
        self.heads, self.kv_heads = cfg.num_heads // tp, cfg.kv_heads // tp
        std, qkv_bias = cfg.init_std, cfg.bias or cfg.qkv_bias
        self.q = ColumnParallelLinear(h, cfg.num_heads * d, ctx, f"{key}.q", bias=qkv_bias, std=std)
        self.k = ColumnParallelLinear(h, cfg.kv_heads * d, ctx, f"{key}.k", bias=qkv_bias, std=std)
        self.v = ColumnParallelLinear(h, cfg.kv_heads * d, ctx, f"{key}.v", bias=qkv_bias, std=std)
        self.o = RowParallelLinear(cfg.num_heads * d, h, ctx, f"{key}.o", bias=cfg.bias,
                                   std=output_std(std, cfg.num_layers))
        self.recompute_core = False
        self.window = cfg.window(layer)
        """This layer's sliding window W (query i attends keys i - W < j <= i), or None."""
        self.logit_max: torch.Tensor | None = None
        """[a/tp]: the running per-head maximum of this step's pre-softmax logits, updated by
        every training forward (:func:`~colonnade.models.qk_logits.record_logit_max`) once
        q/k clipping installs it (:mod:`colonnade.optim.qk_clip`, which reads and resets it
        after each update); None: nothing is recorded."""

    def new_cache(self, batch: int, length: int) -> KVCache:
        """An empty KV cache of ``length`` positions: k, v [b, kv/tp, S, d]."""
        shape = (batch, self.kv_heads, length, self.cfg.head_size)
        w = self.q.weight
        return KVCache(w.new_zeros(shape), w.new_zeros(shape))

    @property
    def batch_first(self) -> bool:
        """Attention's input and output are [b, s, h] (cp = 1 without sp: the residual stream
        is batch-first, :attr:`ParallelContext.batch_first`), else [s(/tp), b, h]. PyTorch's
        CPU flash kernel runs on [b, s, n, d] memory ~10% faster than on [s, b, n, d] memory
        (whose s stride is b n d), and its backward takes the output gradient and returns
        dq, dk, dv without copies only in that layout (issue 19's profile: ~1.5 ms per
        gpt2-tiny layer, fwd + bwd); sp and cp need the sequence on dim 0, so they keep
        [s, b, n, d]."""
        return self.ctx.batch_first

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | None = None, doc: DocContext | None = None) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h] when :attr:`batch_first`, else [s(/tp), b, h] ->
        [s(/tp), b, h]; ``doc``: document-boundary resets."""
        d = self.cfg.head_size
        q, k, v = column_parallel(x, [self.q, self.k, self.v])  # one tp entry for all three
        lead = q.shape[:2]  # (b, s) or (s, b)
        s = lead[1] if self.batch_first else lead[0]
        q = q.view(*lead, self.heads, d)  # [b, s, a/tp, d] or [s, b, a/tp, d]
        k = k.view(*lead, self.kv_heads, d)  # [b, s, kv/tp, d] or [s, b, kv/tp, d]
        v = v.view(*lead, self.kv_heads, d)
        q, k = self.before_rope(q, k)
        start = cache.length if cache is not None else 0
        if rope is not None:  # rotated in the memory order: SDPA's output then keeps it
            cos, sin = self._rope_angles(rope, start, s, doc)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # [b, n, s, d] views, no copy in; SDPA's output follows q's layout, so the merged
        # [b, s, a/tp d] or [s, b, a/tp d] view of core_attention's result is free as well
        q, k, v = self._heads_first(q), self._heads_first(k), self._heads_first(v)
        if cache is not None:
            k, v = cache.extend(k, v)  # [b, kv/tp, start + s, d]
        mask = doc.mask if doc is not None else None  # [b, 1, s, s] or None (causal)
        if self.ctx.cp_size > 1:
            return self.o(self._cp_core(q, k, v, doc))  # [s, b, h] or [s/tp, b, h]
        if self.logit_max is not None and self.training and cache is None:
            record_logit_max(self.logit_max, q, k, self.window, mask)  # cp = 1 (validator)
        if self.recompute_core and self.training:
            out = checkpoint(self.core_attention, self.ctx.rng, q, k, v, start,
                             mask)  # [b, s, a/tp d] or [s, b, a/tp d]
        else:
            out = self.core_attention(q, k, v, start, mask)
        return self.o(out)

    def before_rope(self, q: torch.Tensor, k: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What happens to q [., ., a/tp, d] and k [., ., kv/tp, d] between the head split
        and RoPE (both before the KV cache and cp's exchange): nothing here; a subclass's
        per-head transform (Qwen3's q/k RMSNorm, :class:`~colonnade.models.qk_norm.
        QKNormAttention`). Shapes are kept."""
        return q, k

    def _rope_angles(self, rope: tuple[torch.Tensor, torch.Tensor], start: int, s: int,
                     doc: DocContext | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin broadcastable to q [b, s, n, d/2] ([s, b, n, d/2] unless batch-first):
        of the document-reset positions [b, s] when ``doc`` has them, else of positions
        start .. start + s - 1."""
        if doc is not None and doc.positions is not None:
            pos = doc.positions if self.batch_first else doc.positions.t()  # [b, s] / [s, b]
            return rope[0][pos].unsqueeze(2), rope[1][pos].unsqueeze(2)  # [., ., 1, d/2]
        cos, sin = rope[0][start:start + s], rope[1][start:start + s]  # [s, d/2]
        if self.batch_first:
            return cos.unsqueeze(1), sin.unsqueeze(1)  # [s, 1, d/2]
        return cos.unsqueeze(1).unsqueeze(1), sin.unsqueeze(1).unsqueeze(1)  # [s, 1, 1, d/2]

    def _heads_first(self, t: torch.Tensor) -> torch.Tensor:
        """[b, s, n, d] (batch-first) or [s, b, n, d] -> a [b, n, s, d] view."""
        return t.transpose(1, 2) if self.batch_first else t.permute(1, 2, 0, 3)

    def _merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """[b, n, s, d] -> [b, s, n d] (batch-first) or [s, b, n d]; a view when ``out``'s
        memory is in that order (SDPA's output follows q's layout)."""
        b, n, s, d = out.shape
        if self.batch_first:
            return out.transpose(1, 2).reshape(b, s, n * d)  # [b, s, a/tp * d]
        return out.permute(2, 0, 1, 3).reshape(s, b, n * d)  # [s(/cp), b, a/tp * d]

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       start: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """softmax(q k^T / sqrt(d) + causal) v: q [b, a/tp, s, d], k/v [b, kv/tp, S, d] with
        S = start + s; ``mask`` [b, 1, s, S] (True: may attend) replaces the causal mask
        (document reset). Returns [b, s, a/tp * d] (batch-first) or [s, b, a/tp * d].

        Causal is bottom-right aligned: query i (absolute position start + i) sees keys
        j <= start + i, also for a prefill of s > 1 tokens after a cached prefix (start > 0);
        a layer with a sliding window W (:attr:`window`) also needs j > start + i - W, an
        explicit [s, S] band (AND-ed with ``mask``) in every path below
        (:func:`colonnade.context_parallel.masks.attention_mask`).
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
        return self._merge_heads(self.attend(q, k, v, start, mask))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
               mask: torch.Tensor | None = None, head_offset: int = 0) -> torch.Tensor:
        """:meth:`core_attention` before the output reshape: q [b, n, s, d], k/v
        [b, n_kv, S, d] -> [b, n, s, d]. ``head_offset``: index of q's first head among this
        tp rank's heads (all-to-all attention hands each cp rank a share of them), which
        places the dropout mask's and the sinks' heads."""
        p = self.cfg.attention_dropout if self.training else 0.0
        s, total = q.shape[2], k.shape[2]
        mask = masks.attention_mask(s, total, self.window, mask, q.device)  # + the window
        sinks = self.head_sinks(head_offset, q.shape[1])  # [n] or None
        if p > 0.0:
            spec = DropoutSpec(self.ctx.rng, self.dropout_site, p, self.heads * self.ctx.tp,
                               self.ctx.tp_rank * self.heads + head_offset)
            out = dropout_attention(q, k, v, spec, mask, sinks=sinks)  # [b, n, s, d]
        else:
            gqa = k.shape[1] != q.shape[1]
            if mask is None and start > 0 and s > 1:  # prefill after a cached prefix
                mask = masks.causal(s, total, q.device)
            if sinks is not None:  # the fused kernel that returns lse, then the sink merge
                out = attention_with_sinks(q, k, v, sinks, causal=mask is None and s > 1,
                                           mask=mask)
            elif mask is not None:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
            else:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=start == 0 and s > 1,
                                                     enable_gqa=gqa)
        return out

    def head_sinks(self, head_offset: int, n: int) -> torch.Tensor | None:
        """Sink logits [n] of this tp rank's heads head_offset .. head_offset + n - 1, which
        join each row's softmax denominator (gpt-oss's :class:`~colonnade.models.gpt_oss.
        SinkAttention`: every path above, ring cp and all-to-all cp apply them); None here:
        plain attention."""
        return None

    def _cp_core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 doc: DocContext | None) -> torch.Tensor:
        """Core attention over the whole sequence for cp > 1: q [b, a/tp, s/cp, d], k/v
        [b, kv/tp, s/cp, d] (zigzag local rows) -> [s/cp, b, a/tp * d]. Selective recompute
        checkpoints the all-to-all path (its attention stores full-sequence activations); the
        ring kernel already keeps only q, k, v, out and lse."""
        if (self.recompute_core and self.training and self.ctx.cp_attention == "all_to_all"):
            out = checkpoint(_cp_attention, self.ctx.rng, self, q, k, v, doc)
        else:
            out = _cp_attention(self, q, k, v, doc)  # [b, a/tp, s/cp, d]
        return self._merge_heads(out)  # [s/cp, b, a/tp * d]


@eager
def _cp_attention(attn: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  doc: DocContext | None) -> torch.Tensor:
    """Ring, hierarchical or all-to-all attention of ``attn``'s heads over the cp group:
    [b, a/tp, s/cp, d] -> [b, a/tp, s/cp, d]. Always eager (a graph break inside a compiled
    layer: its collectives go through CommGroup, which dynamo does not trace)."""
    ctx = attn.ctx
    assert ctx.cp is not None
    if ctx.cp_attention != "all_to_all":
        doc_ids = doc.doc_ids if doc is not None else None  # [b, s] or None
        seq = q.shape[2] * ctx.cp_size

        def ring(qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, head_offset: int,
                 group: CommGroup) -> torch.Tensor:
            return ring_attention(qr, kr, vr, group, causal=True, doc_ids=doc_ids,
                                  overlap=ctx.cp_overlap, window=attn.window,
                                  sinks=attn.head_sinks(head_offset, qr.shape[1]),
                                  dropout=_ring_dropout(attn, seq, head_offset))

        if ctx.cp_attention == "ring":
            return ring(q, k, v, 0, ctx.cp)
        assert ctx.cp_a2a is not None and ctx.cp_ring is not None
        return hierarchical_attention(q, k, v, ctx.cp_a2a, ctx.cp_ring, ring)
    mask = doc.mask if doc is not None else None  # [b, 1, s, s] (natural order) or None

    def attend(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
               head_offset: int) -> torch.Tensor:
        return attn.attend(qh, kh, vh, 0, mask, head_offset)  # [b, a/tp/cp, s, d]

    return all_to_all_attention(q, k, v, ctx.cp, attend)


def _ring_dropout(attn: Attention, seq: int, head_offset: int) -> BlockDropout | None:
    """Ring attention's dropout of ``attn`` in training (None at p = 0 or in eval): the
    site's stream in the tracker's current (step, micro-batch), over the model's query heads,
    this call's first head at tp_rank x a/tp + ``head_offset``, sequence length ``seq``."""
    p = attn.cfg.attention_dropout if attn.training else 0.0
    if p == 0.0:
        return None
    ctx = attn.ctx
    return BlockDropout(ctx.rng.stream(attn.dropout_site, p), attn.heads * ctx.tp,
                        ctx.tp_rank * attn.heads + head_offset, seq)


def hidden_dropout(x: torch.Tensor, p: float, ctx: ParallelContext, site: str,
                   training: bool) -> torch.Tensor:
    """Dropout on [s(/tp), b, h] activations ([b, s, h] when ``ctx.batch_first``): a slice of
    the full [s, b, h] mask (batch-first: its transpose, so every layout draws one mask).

    Without sp every tp rank holds the whole tensor (same slice, same mask); under sp rank r
    holds sequence chunk r and evaluates only those rows of the mask (see
    :mod:`colonnade.parallel.rng`); a 1-byte bool mask is kept for backward.
    """
    if not training or p == 0.0:
        return x
    return _draw_dropout(x, p, ctx, site)


@eager
def _draw_dropout(x: torch.Tensor, p: float, ctx: ParallelContext, site: str) -> torch.Tensor:
    """:func:`hidden_dropout`'s draw, always eager: inside a compiled layer dynamo calls it
    without tracing it, so the tracker's (step, micro-batch) is read at every call, never
    guarded on (see :mod:`colonnade.models.compile`)."""
    if ctx.batch_first:
        b, s, h = x.shape
        keep = ctx.rng.keep_mask(site, (s, b, h), p, (slice(None),), x.device)  # [s, b, h]
        return x * keep.transpose(0, 1) * (1.0 / (1.0 - p))  # [b, s, h]
    s_local = x.shape[0]
    if ctx.cp_size > 1:
        return _cp_dropout(x, p, ctx, site)
    if ctx.sp:
        full = (s_local * ctx.tp, *x.shape[1:])
        index = (slice(ctx.tp_rank * s_local, (ctx.tp_rank + 1) * s_local),)
    else:
        full, index = tuple(x.shape), (slice(None),)
    return ctx.rng.dropout(x, p, site, full, index)


def _cp_dropout(x: torch.Tensor, p: float, ctx: ParallelContext, site: str) -> torch.Tensor:
    """Hidden dropout of a cp rank's rows x [s_l, b, h] (s_l = s/cp, or s/(cp tp) under sp):
    its rows of the full [s, b, h] mask, the global row ranges of the zigzag split (of this
    sp shard), one box each, concatenated: the single-process model's mask rows."""
    s_local = x.shape[0]
    s_cp = s_local * ctx.tp if ctx.sp else s_local  # this cp rank's rows
    start = ctx.tp_rank * s_local if ctx.sp else 0
    full = (s_cp * ctx.cp_size, *x.shape[1:])
    boxes = local_ranges(zigzag_ranges(full[0], ctx.cp_size, ctx.cp_rank), start, s_local)
    keep = torch.cat([ctx.rng.keep_mask(site, full, p, (slice(lo, hi),), x.device)
                      for lo, hi in boxes])  # [s_l, b, h]
    return x * keep * (1.0 / (1.0 - p))
