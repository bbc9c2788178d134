"""The decoder-only language model, built as pipeline chunks.

A :class:`ModelChunk` holds a contiguous range of layers (one virtual pipeline stage); the first
chunk also holds the embedding, the last the final norm, output head and loss. With pp = vp = 1
one chunk holds everything: that is the single-process reference model, built by the very same
code. Layer modules are keyed by their *global* index, so parameter names
(``layers.5.attn.q.weight``) are identical in every layout.

Shapes: tokens [b, s] -> hidden [s, b, h] ([s/tp, b, h] under sp) -> logits [s, b, V'/tp]
-> per-token loss [s, b] -> summed or mean loss over the valid tokens (scalar; labels equal to
``IGNORE_INDEX`` are masked out). Without sp and cp the residual stream is batch-first instead
(:attr:`~colonnade.tensor_parallel.context.ParallelContext.batch_first`): hidden [b, s, h],
logits [b, s, V'/tp], no transpose anywhere; :meth:`ModelChunk.forward` still returns logits
as an [s, b, V'/tp] view.

Context parallelism (cp > 1): every cp rank receives the FULL micro-batch tokens and labels
[b, s]; the first chunk embeds only its zigzag rows (:func:`colonnade.context_parallel.layout.
take_local`), hidden states are [s/cp(/tp), b, h], and the last chunk's loss covers its rows of
the labels, :func:`local_labels` (the one place that says which labels a rank scores). Summed
over the cp ranks (the gradient reduction runs over dp x cp) that is the full sequence's loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from colonnade.config.sections import ModelConfig
from colonnade.context_parallel.layout import take_local
from colonnade.models.blocks import (
    DocContext,
    DocReset,
    KVCache,
    cp_doc_context,
    doc_context,
    hidden_dropout,
    rope_tables,
)
from colonnade.models.layer import TransformerLayer
from colonnade.models.mtp import AddInBackward, MTPModule, mtp_loss
from colonnade.models.spec import ArchSpec, arch_spec
from colonnade.parallel.groups import ProcessGroups
from colonnade.tensor_parallel import mappings as mp
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.cross_entropy import IGNORE_INDEX, cross_entropy
from colonnade.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    padded_vocab,
    tie_weights,
)
from colonnade.tensor_parallel.sharding import Sharding

# What a recompute plan puts in place of the plain layer loop: (per-layer fns, hidden) -> hidden.
LayerFn = Callable[[torch.Tensor], torch.Tensor]
LayerRunner = Callable[[list[LayerFn], torch.Tensor], torch.Tensor]


def valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of labels that count in the loss (not ``IGNORE_INDEX``), a 0-d int64 tensor."""
    return (labels != IGNORE_INDEX).sum()


def local_labels(labels: torch.Tensor, ctx: ParallelContext | ProcessGroups) -> torch.Tensor:
    """This cp rank's labels: the zigzag rows [b, s/cp] of the full labels [b, s] (``labels``
    itself when cp = 1); ``ctx`` is the model's context or the rank's process groups. Every
    count of valid tokens and every loss mean of a rank uses these."""
    cp = ctx.cp
    if cp is None or cp.size == 1:
        return labels
    return take_local(labels, cp.size, cp.rank, dim=1)


class Embedding(nn.Module):
    """Word embedding (vocab-parallel), plus a learned position table [S, h] when
    ``learned_positions`` (gpt2), then dropout."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, learned_positions: bool) -> None:
        super().__init__()
        self.cfg, self.ctx = cfg, ctx
        self.word = VocabParallelEmbedding(cfg.vocab, cfg.hidden_size, ctx, "embedding.word",
                                           std=cfg.init_std)
        self.position = None
        if learned_positions:
            spec = Sharding("embedding.position.weight", (cfg.max_seq_len, cfg.hidden_size),
                            sp_partial_grad=ctx.sp)
            self.position = ctx.param(spec, cfg.init_std)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None
                ) -> torch.Tensor:
        """tokens [b, s] -> [s, b, h] or [s/tp, b, h] under sp ([b, s, h] when
        ``ctx.batch_first``); ``positions`` [b, s]: position ids (document reset) instead of
        0..s-1."""
        if self.ctx.batch_first:
            x = self.word(tokens)  # [b, s, h]
            if self.position is not None:
                x = x + (self.position[positions] if positions is not None
                         else self.position[:tokens.shape[1]].unsqueeze(0))  # [b, s, h]
        else:
            x = self._seq_first(tokens, positions)  # [s(/tp), b, h]
        return hidden_dropout(x, self.cfg.hidden_dropout, self.ctx, "embedding.dropout",
                              self.training)

    def _seq_first(self, tokens: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """Word (+ learned position) embedding of tokens [b, s] as [s, b, h], or this sp
        rank's rows [s/tp, b, h]."""
        x = self.word(tokens.t())  # [s(/tp), b, h]
        if self.position is not None:
            s_local = x.shape[0]
            start = self.ctx.tp_rank * s_local if self.ctx.sp else 0
            if positions is not None:
                pos = positions.t()[start:start + s_local]  # [s(/tp), b]
                x = x + self.position[pos]  # [s(/tp), b, h]
            else:
                x = x + self.position[start:start + s_local].unsqueeze(1)  # [s(/tp), b, h]
        return x


class ModelChunk(nn.Module):
    """One virtual pipeline stage: optional embedding, layers ``layer_ids``, optional head.

    ``spec`` (default: the registered spec of ``cfg.arch``) chooses the classes: each layer's
    :class:`~colonnade.models.spec.LayerSpec`, the final norm, and the position encoding
    (RoPE tables [S, d/2] held as buffers, or the embedding's learned table).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layer_ids: list[int], *, first: bool,
                 last: bool, label_smoothing: float = 0.0,
                 spec: ArchSpec | None = None) -> None:
        super().__init__()
        spec = spec if spec is not None else arch_spec(cfg)
        self.cfg, self.ctx, self.first, self.last, self.spec = cfg, ctx, first, last, spec
        self.label_smoothing = label_smoothing
        self.embedding = Embedding(cfg, ctx, not spec.rope) if first else None
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg, ctx, i, spec.layer(i))
                                     for i in layer_ids})
        self.layer_runner: LayerRunner | None = None
        self.doc_reset: DocReset | None = None
        """Document-boundary resets (set by the trainer from data.reset_*; None: off)."""
        if spec.rope:
            cos, sin = rope_tables(cfg, ctx.device, ctx.dtype)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        if last:
            self.final_norm = spec.final_norm(cfg, ctx, "final_norm")
            pad = padded_vocab(cfg.vocab, ctx.tp) - cfg.vocab
            self.head = ColumnParallelLinear(
                cfg.hidden_size, cfg.vocab, ctx, "head", bias=False, std=cfg.init_std,
                padded_rows=pad, tied_to="embedding.word.weight" if cfg.tie_embeddings else None,
                fp8=False)
            tie_weights(self)  # the embedding's Parameter here, else a tied copy (pp > 1)
        self.mtp = (nn.ModuleList([MTPModule(cfg, ctx, k) for k in range(cfg.mtp_layers)])
                    if last and cfg.mtp_layers > 0 else None)
        """Multi-token prediction modules (:mod:`colonnade.models.mtp`), last chunk only."""

    @property
    def recomputes_layers(self) -> bool:
        """Whether backward recomputes whole layer blocks (full recompute installed): a split
        backward then takes its weight gradients in one pass, not one per layer boundary."""
        return self.layer_runner is not None

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE tables cos, sin [S, d/2] (``spec.positions == 'rope'``) or None."""
        if not self.spec.rope:
            return None
        return self.rope_cos, self.rope_sin

    def run_layers(self, x: torch.Tensor, caches: list[KVCache] | None = None,
                   doc: DocContext | None = None) -> torch.Tensor:
        """Apply this chunk's layers to x [s(/tp), b, h] (or batch-first [b, s, h]); a
        recompute plan may wrap them."""
        layers = list(self.layers.values())
        if caches is not None:
            for layer, cache in zip(layers, caches, strict=True):
                x = layer(x, self.rope, cache)
            return x
        if self.layer_runner is not None and self.training:
            return self.layer_runner(self._layer_fns(doc), x)
        for layer in layers:
            x = layer(x, self.rope, None, doc)
        return x

    def _layer_fns(self, doc: DocContext | None = None) -> list[LayerFn]:
        rope = self.rope
        return [lambda x, layer=layer: layer(x, rope, None, doc) for layer in self.layers.values()]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and head: x [s(/tp), b, h] -> vocab-split logits [s, b, V'/tp]
        (batch-first: [b, s, h] -> [b, s, V'/tp])."""
        return self.head(self.final_norm(x))

    def head_loss(self, x: torch.Tensor, labels: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last chunk's final norm, head and cross entropy summed over the valid labels:
        (normed [s/cp, b, h] (or [b, s/cp, h]), loss []) for hidden ``x`` of that layout and
        ``labels`` laid out as the logits' leading dims. One function so that
        ``training.compile`` compiles it whole where it holds no collective (tp = 1:
        :func:`colonnade.models.compile.compile_layers`)."""
        normed = self.final_norm(x)
        logits = self.head(normed)  # [s/cp, b, V'/tp] or [b, s/cp, V'/tp]
        return normed, cross_entropy(logits, labels, self.ctx.group, self.cfg.vocab,
                                     self.label_smoothing, reduction="sum")

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor | None = None, *,
                reduction: str = "mean", tokens: torch.Tensor | None = None) -> torch.Tensor:
        """First chunk: tokens [b, s]; others: hidden [s(/tp), b, h] ([b, s, h] when
        ``ctx.batch_first``, as returned) and, with
        ``doc_reset`` on, the micro-batch's ``tokens`` [b, s] (document boundaries).

        Returns hidden [s(/tp), b, h] unless this is the last chunk: then, when ``labels``
        [b, s] are given, the loss over the micro-batch's valid tokens (labels not
        ``IGNORE_INDEX``): their sum (``reduction='sum'``, what the training step uses) or
        their mean ('mean'; 0 when none is valid); else the logits [s, b, V'/tp].
        """
        doc = self._doc(inputs, tokens)
        if self.embedding is not None:
            local = take_local(inputs, self.ctx.cp_size, self.ctx.cp_rank, dim=1)  # [b, s/cp]
            x = self.embedding(local, doc.positions if doc is not None else None)
        else:
            x = inputs
        x = self.run_layers(x, doc=doc)
        if not self.last:
            return x
        first = self.ctx.batch_first
        if labels is None:
            logits = self.logits(x)  # [s/cp, b, V'/tp] or [b, s, V'/tp]
            return logits.transpose(0, 1) if first else logits  # [s/cp, b, V'/tp]
        full_labels, labels = labels, local_labels(labels, self.ctx)  # [b, s], [b, s/cp]
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction={reduction!r} must be 'mean' or 'sum'")
        normed, loss = self.head_loss(x, labels if first else labels.t())
        if self.mtp is not None and self.training:  # the MTP term, in backward only
            full_tokens = inputs if self.first else tokens
            if full_tokens is None:
                raise ValueError("multi-token prediction needs the micro-batch's tokens on the "
                                 "last chunk; pass tokens=")
            extra = mtp_loss(self.mtp, normed, full_tokens, full_labels, self.rope, doc,
                             self.label_smoothing)
            loss = AddInBackward.apply(loss, extra * (self.cfg.mtp_loss_weight
                                                      / self.cfg.mtp_layers))
        if reduction == "sum":
            return loss
        return loss / valid_tokens(labels).clamp(min=1)

    def _doc(self, inputs: torch.Tensor, tokens: torch.Tensor | None) -> DocContext | None:
        """Position ids and attention mask of the micro-batch (None without doc_reset while
        cp = 1); ``inputs`` the chunk's input (tokens [b, s] on the first chunk), ``tokens``
        the micro-batch's tokens [b, s]. Under cp > 1 always a context: its positions are
        the zigzag rows' (see :func:`~colonnade.models.blocks.cp_doc_context`)."""
        full = inputs if self.first else tokens
        if self.doc_reset is not None and full is None:
            raise ValueError("document reset needs the micro-batch's tokens on every chunk; "
                             "pass tokens=")
        if self.ctx.cp_size == 1:
            if self.doc_reset is None:
                return None
            assert full is not None
            return doc_context(full, self.doc_reset)
        if full is not None:
            b, s = full.shape
        else:  # hidden [s/cp(/tp), b, h]
            s = inputs.shape[0] * (self.ctx.tp if self.ctx.sp else 1) * self.ctx.cp_size
            b = inputs.shape[1]
        return cp_doc_context(full, self.doc_reset, self.ctx, b, s, inputs.device)

    @torch.no_grad()
    def full_logits(self, tokens: torch.Tensor, caches: list[KVCache] | None = None
                    ) -> torch.Tensor:
        """Generation path (first and last chunk in one): tokens [b, s] -> logits [b, s, V].
        Runs at cp = 1 only (generation builds its own single-process model)."""
        if self.ctx.cp_size > 1:
            raise ValueError("full_logits (generation, KV caches) runs at parallel.cp=1; "
                             "build the single-process model (models.build.build_reference)")
        x = self.embedding(tokens) if caches is None else self._embed_cached(tokens, caches)
        x = self.run_layers(x, caches)
        logits = mp.gather_last(self.logits(x), self.ctx.group)  # [b, s, V'] or [s, b, V']
        logits = logits[..., : self.cfg.vocab]
        return logits if self.ctx.batch_first else logits.transpose(0, 1)  # [b, s, V]

    def _embed_cached(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        assert self.embedding is not None
        first = self.ctx.batch_first
        x = self.embedding.word(tokens if first else tokens.t())  # [b, s, h] or [s, b, h]
        if self.embedding.position is not None:
            start, s = caches[0].length, tokens.shape[1]
            rows = self.embedding.position[start:start + s]  # [s, h]
            x = x + (rows.unsqueeze(0) if first else rows.unsqueeze(1))
        return x

    def new_caches(self, batch: int, length: int) -> list[KVCache]:
        """Empty KV caches of ``length`` positions for every layer of this chunk (each
        attention class shapes its own, :meth:`Attention.new_cache`)."""
        return [layer.attn.new_cache(batch, length) for layer in self.layers.values()]
