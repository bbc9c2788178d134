"""Feed-forward (MLP) blocks of the decoder: column-parallel in, row-parallel out.

Every MLP class has the constructor ``(cfg, ctx, key, layer)`` (a :class:`~colonnade.models.
spec.LayerSpec`'s ``mlp``; ``layer`` is the global layer index) and the class attribute
``matrices``, the number of h x f weight matrices it holds, from which parameter and FLOP
counters derive: matrices x h x f weights, (matrices - 1) x f + h biases with ``model.bias``,
and 2 x matrices x h x f forward FLOPs per token.

With tp the first matrices are split by output columns (f/tp each), the last by input rows;
one tp entry (f / all-gather) before, one g (all-reduce / reduce-scatter) after.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from colonnade.config.sections import ModelConfig
from colonnade.gelu import gelu_tanh
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel,
)
from colonnade.tensor_parallel.sharding import output_std


class GatedMLP(nn.Module):
    """down(act(gate x) * up x): the gated family (SwiGLU, GEGLU, ...); a subclass sets
    :meth:`activation`. Parameters ``{key}.up``, ``{key}.gate`` [f, h], ``{key}.down`` [h, f]."""

    matrices: ClassVar[int] = 3
    """h x f weight matrices: up, gate, down."""
    direct_children = ("gate", "up")
    """Children whose weights ``column_parallel`` may read directly (see there)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str, layer: int) -> None:
        super().__init__()
        h, f, std = cfg.hidden_size, cfg.ffn_size, cfg.init_std
        self.up = ColumnParallelLinear(h, f, ctx, f"{key}.up", bias=cfg.bias, std=std)
        self.gate = ColumnParallelLinear(h, f, ctx, f"{key}.gate", bias=cfg.bias, std=std)
        self.down = RowParallelLinear(f, h, ctx, f"{key}.down", bias=cfg.bias,
                                      std=output_std(std, cfg.num_layers))

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        """The gate's non-linearity, elementwise on [s, b, f/tp]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]."""
        gate, up = column_parallel(x, [self.gate, self.up])  # one tp entry for both
        return self.down(self.activation(gate) * up)  # [s, b, f/tp] -> [s(/tp), b, h]


class SwiGLUMLP(GatedMLP):
    """SwiGLU (llama): down(silu(gate x) * up x), silu(z) = z sigmoid(z)."""

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)


class PlainMLP(nn.Module):
    """down(act(up x)): the two-matrix family (GELU, squared ReLU, ...); a subclass sets
    :meth:`activation`. Parameters ``{key}.up`` [f, h], ``{key}.down`` [h, f]."""

    matrices: ClassVar[int] = 2
    """h x f weight matrices: up, down."""
    direct_children = ("up",)
    """Children whose weights ``column_parallel`` may read directly (see there)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str, layer: int) -> None:
        super().__init__()
        h, f, std = cfg.hidden_size, cfg.ffn_size, cfg.init_std
        self.up = ColumnParallelLinear(h, f, ctx, f"{key}.up", bias=cfg.bias, std=std)
        self.down = RowParallelLinear(f, h, ctx, f"{key}.down", bias=cfg.bias,
                                      std=output_std(std, cfg.num_layers))

    def activation(self, up: torch.Tensor) -> torch.Tensor:
        """The non-linearity, elementwise on [s, b, f/tp]."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]."""
        (up,) = column_parallel(x, [self.up])
        return self.down(self.activation(up))  # [s, b, f/tp] -> [s(/tp), b, h]


class GeluMLP(PlainMLP):
    """GPT-2's MLP: down(gelu_tanh(up x)), gelu_tanh(z) = z/2 (1 + tanh(sqrt(2/pi)(z + 0.044715
    z^3)))."""

    def activation(self, up: torch.Tensor) -> torch.Tensor:
        return gelu_tanh(up)
