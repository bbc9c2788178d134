"""Normalisation layers of the decoder: RMSNorm and LayerNorm over the last dim h.

Every norm class has the constructor ``(cfg, ctx, key)`` (a :class:`~colonnade.models.spec.
LayerSpec`'s ``norm`` and an ``ArchSpec``'s ``final_norm``) and the class attribute
``has_bias`` that parameter counters read: a norm holds h weights, plus h biases if it has one.

Parameters are replicated across tp; under sp each rank normalises only its sequence chunk,
so their gradients are partial sums (``sp_partial_grad``) all-reduced across tp later. A norm
built with ``per_head`` (Qwen3's q/k norm, :mod:`colonnade.models.qk_norm`) normalises each of
the rank's tp-split heads over their width d: its gradient is a partial sum over the heads,
with or without sp (``tp_partial_grad``), all-reduced across tp the same way.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from colonnade.config.sections import ModelConfig
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.sharding import Sharding


class Norm(nn.Module):
    """What every norm class shares: the constructor and a weight w [h] initialised to ones."""

    has_bias: ClassVar[bool] = False
    """Whether the norm holds a bias b [h] (initialised to zeros) next to its weight."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str, *,
                 width: int | None = None, per_head: bool = False) -> None:
        """``width``: the normalised dim (default h). ``per_head``: the norm runs on each of
        this rank's tp-split heads (q/k norm, width d), so its gradient is a partial sum over
        tp with or without sp (``tp_partial_grad``) instead of one under sp only."""
        super().__init__()
        self.eps, h = cfg.norm_eps, cfg.hidden_size if width is None else width
        sp_partial = ctx.sp and not per_head
        self.weight = ctx.param(Sharding(f"{key}.weight", (h,), sp_partial_grad=sp_partial,
                                         tp_partial_grad=per_head), 0.0, "ones")
        self.bias = (ctx.param(Sharding(f"{key}.bias", (h,), sp_partial_grad=sp_partial,
                                        tp_partial_grad=per_head), 0.0, "zeros")
                     if self.has_bias else None)


class RMSNorm(Norm):
    """y = x / sqrt(mean(x^2) + eps) * w over the last dim (llama); statistics in fp32 for
    half-precision inputs. x [..., h] -> [..., h]."""

    has_bias = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in (torch.float16, torch.bfloat16):  # the same ops on CPU, fused on GPU
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x32 = x.float()  # half: normalise in fp32, round, then scale (Hugging Face's order)
        out = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., h]
        return out.to(x.dtype) * self.weight


class LayerNorm(Norm):
    """y = (x - mean(x)) / sqrt(var(x) + eps) * w + b over the last dim (gpt2).
    x [..., h] -> [..., h]."""

    has_bias = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
