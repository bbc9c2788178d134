"""gpt-oss's layer classes: attention with sinks, and its mixture-of-experts MLP.

* :class:`SinkAttention`: :class:`~colonnade.models.blocks.Attention` (its forward, rope,
  KV cache, tp / sp / cp paths unchanged) plus one learned logit per head, ``sinks`` [a]
  (split over tp by heads like q), that joins every query's softmax denominator::

      p_ij = exp(l_ij) / (sum_j exp(l_ij) + exp(s_h)),   out = attention(q, k, v) sigmoid(lse - s_h)

  (derivation and gradient: :mod:`colonnade.context_parallel.sinks`). Every path applies it
  through :meth:`~colonnade.models.blocks.Attention.head_sinks`: the fused kernel that returns
  lse, the eager dropout kernel, all-to-all cp (each cp rank's share of the heads), ring cp
  (after the ring's merge, with the final lse) and KV-cache generation.
* :class:`GptOssMoELayer`: the router a linear layer with a bias [E] (``model.moe_router_bias``),
  top-k of the logits then a softmax over the k kept, which is the softmax router with the
  top k renormalised (``model.moe_norm_topk_prob``): exp(z_i) / sum_{j in top k} exp(z_j)
  either way; experts with biases on gate, up and down and gpt-oss's clamped SwiGLU
  (:func:`~colonnade.moe.experts.clamped_swiglu`, ``model.moe_swiglu_alpha`` / ``limit``).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from colonnade.config.sections import ModelConfig
from colonnade.models.blocks import Attention
from colonnade.models.mlps import SwiGLUMLP
from colonnade.moe.experts import GroupedExperts, clamped_swiglu
from colonnade.moe.layer import MoELayer
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.sharding import Sharding


class SinkAttention(Attention):
    """Attention with a learned sink logit per head (module docstring). Parameters: those of
    :class:`~colonnade.models.blocks.Attention` plus ``{key}.sinks`` [a], tp-split by heads
    (this rank's a/tp), normal(0, init_std) at init."""

    has_sinks: ClassVar[bool] = True
    """One extra parameter per query head (the parameter counter reads it)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str, layer: int) -> None:
        super().__init__(cfg, ctx, key, layer)
        self.sinks = ctx.param(Sharding(f"{key}.sinks", (cfg.num_heads,), dim=0), cfg.init_std)

    def head_sinks(self, head_offset: int, n: int) -> torch.Tensor | None:
        """The sink logits [n] of this rank's heads head_offset .. head_offset + n - 1."""
        return self.sinks[head_offset:head_offset + n]


class GptOssMoELayer(MoELayer):
    """gpt-oss's MoE MLP (module docstring): biased router and experts, clamped SwiGLU."""

    matrices: ClassVar[int] = 3
    """h x f weight matrices per expert: gate, up, down."""
    gated: ClassVar[bool] = True
    """Gated (clamped SwiGLU) experts."""
    clamped_swiglu: ClassVar[bool] = True
    """The clamped SwiGLU of model.moe_swiglu_alpha / limit (config's ArchTraits say so too,
    checked by :func:`colonnade.models.spec._check_registry`)."""
    shared_class = SwiGLUMLP
    """The shared expert's dense MLP class (gpt-oss has none; the validator refuses one)."""

    def make_experts(self, cfg: ModelConfig, ctx: ParallelContext, key: str) -> GroupedExperts:
        """Experts with biases on every matrix (with ``model.bias``) and the clamped SwiGLU."""
        return GroupedExperts(cfg, ctx, key, gated=True, biases=cfg.bias,
                              activation=clamped_swiglu(cfg.moe_swiglu_alpha,
                                                        cfg.moe_swiglu_limit))
