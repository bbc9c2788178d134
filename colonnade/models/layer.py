"""The transformer layer, built from a :class:`~colonnade.models.spec.LayerSpec`."""

from __future__ import annotations

import torch
from torch import nn

from colonnade.config.sections import ModelConfig
from colonnade.models.blocks import DocContext, KVCache, hidden_dropout
from colonnade.models.spec import LayerSpec, arch_spec
from colonnade.tensor_parallel.context import ParallelContext


class TransformerLayer(nn.Module):
    """Pre-norm block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x))).

    Parameters ``layers.{index}.attn_norm``, ``.attn``, ``.mlp_norm``, ``.mlp`` (global
    index), made by ``spec``'s classes; without ``spec``, the registered spec of
    ``cfg.arch`` for this layer.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, index: int,
                 spec: LayerSpec | None = None) -> None:
        super().__init__()
        spec = spec if spec is not None else arch_spec(cfg).layer(index)
        key = f"layers.{index}"
        self.cfg, self.ctx, self.key = cfg, ctx, key
        self.attn_norm = spec.norm(cfg, ctx, f"{key}.attn_norm")
        self.attn = spec.attention(cfg, ctx, f"{key}.attn", index)
        self.mlp_norm = spec.norm(cfg, ctx, f"{key}.mlp_norm")
        self.mlp = spec.mlp(cfg, ctx, f"{key}.mlp", index)
        self.attn_out_site, self.mlp_out_site = f"{key}.attn_out", f"{key}.mlp_out"
        """Dropout site names, formatted once: forward passes them untouched, so a compiled
        layer's graph holds no per-layer constant and every layer shares it."""

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | None = None, doc: DocContext | None = None) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h] ([b, s, h] when ``ctx.batch_first``);
        ``rope``: cos, sin [S, d/2] or None."""
        p = self.cfg.hidden_dropout
        a = self.attn(self.attn_norm(x), rope, cache, doc)  # [s(/tp), b, h] or [b, s, h]
        x = x + hidden_dropout(a, p, self.ctx, self.attn_out_site, self.training)
        m = self.mlp(self.mlp_norm(x))
        return x + hidden_dropout(m, p, self.ctx, self.mlp_out_site, self.training)
