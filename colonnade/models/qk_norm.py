"""Attention with per-head RMSNorm on queries and keys before RoPE (Qwen3, Qwen3-MoE).

For every token and every query head i: q_i <- q_i / sqrt(mean_j(q_ij^2) + eps) * w_q, with
one weight w_q [d] shared by all heads (likewise k with w_k [d] over the key/value heads); the
norm runs after the q/k projections' head split and before RoPE, so the rotated, cached and
cp-exchanged keys are the normalised ones (Hugging Face's ``Qwen3Attention``: ``q_norm`` /
``k_norm`` of width ``head_dim``).

Parallelism:

* tp splits the heads: a rank normalises its a/tp query and kv/tp key heads with the full,
  replicated w [d]. The single-process gradient of w is a sum over all heads, so each rank's
  is a partial sum over its own heads, with or without sp (sp gathers the whole sequence
  before the column-parallel projections, so the heads see every token): the weights are
  declared ``tp_partial_grad`` and summed across tp after backward
  (:func:`colonnade.data_parallel.finalize.reduce_sp_and_tied`, on ZeRO-2/3's owned shard
  pieces too).
* cp and pp need nothing more: the norm is a function of one token's one head (no mixing
  across positions), so a cp rank normalising its own rows computes exactly those rows of the
  single-process result, and its gradient of w is the sum over those rows that the dp x cp
  gradient reduction completes, as for every replicated weight; a pp stage holds whole layers.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from colonnade.config.sections import ModelConfig
from colonnade.models.blocks import Attention
from colonnade.models.norms import RMSNorm
from colonnade.tensor_parallel.context import ParallelContext


class QKNormAttention(Attention):
    """:class:`~colonnade.models.blocks.Attention` with RMSNorms ``q_norm`` and ``k_norm``
    (weights [d], ``model.norm_eps``) on every head of q and k before RoPE."""

    head_norms: ClassVar[int] = 2
    """Per-head norms of width d the layer holds (q and k): 2 d parameters, replicated on
    every tp rank (what the parameter counters read)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str, layer: int) -> None:
        super().__init__(cfg, ctx, key, layer)
        d = cfg.head_size
        self.q_norm = RMSNorm(cfg, ctx, f"{key}.q_norm", width=d, per_head=True)
        self.k_norm = RMSNorm(cfg, ctx, f"{key}.k_norm", width=d, per_head=True)

    def before_rope(self, q: torch.Tensor, k: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [., ., a/tp, d], k [., ., kv/tp, d] -> the same shapes, each head RMS-normalised
        over d and scaled by the [d] weight."""
        return self.q_norm(q), self.k_norm(k)
