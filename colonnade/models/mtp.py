"""Multi-token prediction (MTP, DeepSeek-V3): extra modules on the last pipeline stage that
predict tokens further ahead, a training objective only (generation never runs them).

Module k = 0 .. D-1 (``model.mtp_layers`` = D), keys ``mtp.{k}.*`` and the transformer layer
``layers.{L + k}`` (L = model.num_layers), at every position i of a sequence::

    e_i  = Emb_k(t_{i+1+k})                                   [h]  (its own embedding)
    x_i  = W_eh [RMSNorm_e(e_i) ; RMSNorm_h(h_i)]               [h]  (W_eh [h, 2h])
    h'_i = RMSNorm_k(Layer_{L+k}(x)_i)                         [h]
    loss_k = sum_i CE(Head_k(h'_i), t_{i+2+k})                       (its own output head)

with h_i the main model's final-normed hidden state for k = 0 and module k-1's h' after
(DeepSeek-V3's sequential modules; Megatron-Core's MTP feeds the same). Positions whose target
t_{i+2+k} lies past the sequence (or is a masked label) count nothing; the tokens rolled in
there as inputs (0) only reach masked positions, attention being causal. The objective is
main CE sum + mtp_loss_weight / D x sum_k loss_k, both normalised by the main loss's token
count; the value returned (and logged) stays the main CE sum: the MTP term enters through
:class:`AddInBackward`, which adds it in backward only.

Embedding and head: each module holds its own (``mtp.{k}.embed.weight`` [V, h],
``mtp.{k}.head.weight`` [V, h], vocabulary-split over tp like the main ones), which is how
the released checkpoint stores them (``model.layers.{L+k}.embed_tokens`` and
``shared_head.head``) and how inference engines load them. DeepSeek-V3's training shared
them with the main embedding and head; here they are separate parameters (not tied across
pipeline stages): initialised from the checkpoint's copies, they train on their own.

Parallelism: the module runs on the last stage's rows, like the main head: under sp the
embedding reduce-scatters to [s/tp, b, h] and W_eh (replicated) is applied to the rank's rows
(its gradient a partial sum over tp, ``sp_partial_grad``); without sp every tp rank computes
the same rows. Under cp the shifted tokens and labels are cut to the rank's zigzag rows from
the full [b, s] micro-batch the last stage receives, so no rows cross ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from colonnade.config.sections import ModelConfig
from colonnade.context_parallel.layout import take_local
from colonnade.models.blocks import DocContext, hidden_dropout
from colonnade.models.layer import TransformerLayer
from colonnade.models.spec import arch_spec
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.cross_entropy import IGNORE_INDEX, cross_entropy
from colonnade.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    padded_vocab,
)
from colonnade.tensor_parallel.sharding import Sharding


class AddInBackward(torch.autograd.Function):
    """Forward: ``main`` (a copy). Backward: the incoming gradient to ``main`` and, unchanged,
    to ``extra`` (both 0-d): the gradient of main + extra with the value of main."""

    @staticmethod
    def forward(ctx: Any, main: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return main.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad


class EHProjection(nn.Module):
    """W_eh [h, 2h], replicated over tp, applied to the rank's rows (a partial gradient under
    sp): [.., 2h] -> [.., h]."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.weight = ctx.param(Sharding(f"{key}.weight", (h, 2 * h), sp_partial_grad=ctx.sp),
                                cfg.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MTPModule(nn.Module):
    """Module k of the module docstring: ``enorm``, ``hnorm``, ``eh_proj``, the transformer
    layer ``layers.{L + k}`` (the architecture's layer of that global index: an MoE layer for
    DeepSeek-V3), ``norm``, ``embed``, ``head``."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, k: int) -> None:
        super().__init__()
        key, h = f"mtp.{k}", cfg.hidden_size
        self.cfg, self.ctx, self.embed_site = cfg, ctx, f"{key}.embed.dropout"
        spec = arch_spec(cfg)
        norm = spec.final_norm
        self.enorm, self.hnorm = norm(cfg, ctx, f"{key}.enorm"), norm(cfg, ctx, f"{key}.hnorm")
        self.eh_proj = EHProjection(cfg, ctx, f"{key}.eh_proj")
        self.index = cfg.num_layers + k
        self.layers = nn.ModuleDict({str(self.index): TransformerLayer(
            cfg, ctx, self.index, spec.layer(self.index))})
        """The one transformer layer, under its global index (module paths
        ``mtp.{k}.layers.{L + k}``, as the main layers' ``layers.{i}``)."""
        self.norm = norm(cfg, ctx, f"{key}.norm")
        self.embed = VocabParallelEmbedding(cfg.vocab, h, ctx, f"{key}.embed", std=cfg.init_std)
        pad = padded_vocab(cfg.vocab, ctx.tp) - cfg.vocab
        self.head = ColumnParallelLinear(h, cfg.vocab, ctx, f"{key}.head", bias=False,
                                         std=cfg.init_std, padded_rows=pad, fp8=False)

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None,
                doc: DocContext | None) -> torch.Tensor:
        """hidden [s(/tp), b, h] ([b, s, h] batch-first), ids [b, s_l] (this cp rank's rows of
        t_{i+1+k}) -> this module's final-normed output, hidden's shape."""
        first = self.ctx.batch_first
        e = self.embed(ids if first else ids.t())  # [b, s, h] or [s(/tp), b, h]
        e = hidden_dropout(e, self.cfg.hidden_dropout, self.ctx, self.embed_site, self.training)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        return self.norm(self.layers[str(self.index)](x, rope, None, doc))


def shifted(t: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    """[b, s] -> [b, s]: column i holds t[:, i + n], ``fill`` past the end."""
    pad = torch.full((t.shape[0], n), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t[:, n:], pad], dim=1)


def mtp_loss(modules: nn.ModuleList, normed: torch.Tensor, tokens: torch.Tensor,
             labels: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
             doc: DocContext | None, label_smoothing: float) -> torch.Tensor:
    """sum_k loss_k (module docstring): ``normed`` the main model's final-normed hidden states
    (this rank's rows), ``tokens`` / ``labels`` the full micro-batch [b, s]. A 0-d tensor."""
    first = modules[0].ctx.batch_first
    ctx: ParallelContext = modules[0].ctx
    cfg: ModelConfig = modules[0].cfg
    cp, rank = ctx.cp_size, ctx.cp_rank
    total = normed.new_zeros(())
    h = normed
    for k, module in enumerate(modules):
        ids = take_local(shifted(tokens, 1 + k, 0), cp, rank, dim=1)  # [b, s_l]
        target = take_local(shifted(labels, 1 + k, IGNORE_INDEX), cp, rank, dim=1)  # [b, s_l]
        h = module(h, ids, rope, doc)
        logits = module.head(h)  # [s_l, b, V'/tp] or [b, s, V'/tp]
        total = total + cross_entropy(logits, target if first else target.t(), ctx.group,
                                      cfg.vocab, label_smoothing, reduction="sum")
    return total
