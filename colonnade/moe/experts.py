"""The routed experts of one mixture-of-experts layer, stacked, this rank's E_local of them.

With E experts split over ep ranks, ep rank r holds experts ``[r E_local, (r+1) E_local)``,
``E_local = E / ep``, as slices of stacked weights whose full shapes are those of the
single-process model, so every layout starts from the same bits: the seeded initialisation
blocks tile the expert dim. With expert tp (``parallel.expert_tp`` = n > 1) each expert's
f dim is split too, gate / up column-parallel and down row-parallel (:func:`expert_splits`:
``(("ep", 0), ("tp", d))``, "tp" meaning the expert tp group), and the rows of the group's
ranks are exchanged around the GEMMs (:mod:`colonnade.moe.expert_tp`).

Per expert e (f = ``model.expert_ffn_size``, h the hidden size), on its rows x_e [n_e, h]:

* gated (llama, SwiGLU): ``y_e = (silu(x_e G_e^T) * (x_e U_e^T)) D_e^T``, with
  ``gate`` G [E, f, h], ``up`` U [E, f, h], ``down`` D [E, h, f]; with ``biases`` (gpt-oss)
  ``gate_bias`` [E, f], ``up_bias`` [E, f] and ``down_bias`` [E, h] added after each product,
  and the activation the layer names (gpt-oss: :func:`clamped_swiglu`);
* plain (gpt2, GELU): ``y_e = gelu_tanh(x_e U_e^T + u_e) D_e^T + d_e``, with ``up`` U
  [E, f, h], ``down`` D [E, h, f] and, with ``model.bias``, ``up_bias`` u [E, f] and
  ``down_bias`` d [E, h] (zeros at init).

Initialisation: normal(0, init_std) for gate and up, the scaled output std
(:func:`~colonnade.tensor_parallel.sharding.output_std`) for down, as the dense MLP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from colonnade.config.sections import ModelConfig
from colonnade.gelu import gelu_tanh
from colonnade.moe.expert_tp import gather_rows, scatter_partial_rows
from colonnade.moe.grouped_gemm import grouped_mm, host_counts
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.sharding import Sharding, output_std

EP_SPLIT: tuple[tuple[str, int], ...] = (("ep", 0),)
"""Every routed-expert tensor is split over ep along its expert dim (dim 0)."""


def expert_splits(name: str) -> tuple[tuple[str, int], ...]:
    """The splits of routed-expert tensor ``name``: over ep along the expert dim (0), then
    over expert tp ("tp" of the expert view) along f: dim 1 of gate / up [E, f, h] and of
    gate_bias / up_bias [E, f] (column-parallel), dim 2 of down [E, h, f] (row-parallel);
    down_bias [E, h] is replicated over expert tp."""
    f_dim = {"gate": 1, "up": 1, "gate_bias": 1, "up_bias": 1, "down": 2}.get(name)
    return EP_SPLIT if f_dim is None else (*EP_SPLIT, ("tp", f_dim))


def is_gated(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s experts are gated (SwiGLU) rather than plain (GELU): the
    architecture's ``gated_mlp`` trait."""
    traits = cfg.traits
    if traits is None:
        raise ValueError(f"model.arch={cfg.arch!r} has no traits; cannot build its experts")
    return traits.gated_mlp


GatedActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``act(gate [t_e, f], up [t_e, f]) -> [t_e, f]``: a gated expert's hidden activation."""


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The gated experts' default activation: silu(gate) * up, [t_e, f] each."""
    return F.silu(gate) * up


class ClampedSwiGLU(torch.autograd.Function):
    """gpt-oss's expert activation, saving only its two inputs [t_e, f] (autograd through
    the separate ops would keep seven such tensors). With g = min(gate, L), u = clamp(up, -L,
    L), sigma = sigmoid(alpha g)::

        out     = (u + 1) g sigma
        d up    = dout g sigma                                  where -L <= up <= L, else 0
        d gate  = dout (u + 1) sigma (1 + alpha g (1 - sigma))  where gate <= L, else 0

    (the clamps pass the gradient inside their range, bounds included, as torch.clamp does).
    """

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, alpha: float,
                limit: float) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.alpha, ctx.limit = alpha, limit
        g = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (g * torch.sigmoid(alpha * g))

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        alpha, limit = ctx.alpha, ctx.limit
        g = gate.clamp(max=limit)
        sig = torch.sigmoid(alpha * g)
        d_up = (dout * g * sig).masked_fill_((up < -limit) | (up > limit), 0.0)
        u1 = up.clamp(-limit, limit) + 1
        d_gate = dout * u1 * sig * (1 + alpha * g * (1 - sig))
        return d_gate.masked_fill_(gate > limit, 0.0), d_up, None, None


def clamped_swiglu(alpha: float, limit: float) -> GatedActivation:
    """gpt-oss's expert activation (transformers' GptOssExperts): with g = min(gate, limit)
    and u = clamp(up, -limit, limit), ``(u + 1) * g * sigmoid(alpha g)``, [t_e, f] each
    (:class:`ClampedSwiGLU`: only gate and up are kept for backward)."""
    def act(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = ClampedSwiGLU.apply(gate, up, alpha, limit)
        return out
    return act


class GroupedExperts(nn.Module):
    """E_local experts' stacked weights (see the module docstring for names and maths).

    ``gated`` None: from the architecture (:func:`is_gated`). ``biases`` None: with
    ``model.bias`` on plain experts only; True: on every expert matrix (gated too).
    ``activation``: a gated expert's act(gate, up) (default :func:`swiglu`).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str,
                 gated: bool | None = None, biases: bool | None = None,
                 activation: GatedActivation = swiglu) -> None:
        super().__init__()
        e, h, f = cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size
        if e % ctx.ep_size or f % ctx.etp_size:
            raise ValueError(f"model.num_experts={e} must be divisible by parallel.ep="
                             f"{ctx.ep_size} and model.moe_ffn_hidden_size={f} by "
                             f"parallel.expert_tp={ctx.etp_size}")
        self.etp = ctx.expert_tp
        """The expert tp group (None or one rank: whole experts)."""
        self.fp8_in = ctx.float8(self.etp, "n")
        """Float8 GEMMs of gate / up (f split over expert tp), or None."""
        self.fp8_out = ctx.float8(self.etp, "k")
        """Float8 GEMMs of down (f split over expert tp), or None."""
        self.gated = is_gated(cfg) if gated is None else gated
        self.num_local = e // ctx.ep_size
        self.first = ctx.ep_rank * self.num_local
        """Global id of this rank's first expert."""
        std, out_std = cfg.init_std, output_std(cfg.init_std, cfg.num_layers)

        def param(name: str, shape: tuple[int, ...], sd: float, kind: str = "normal"
                  ) -> nn.Parameter:
            sharding = Sharding(f"{key}.{name}", shape, splits=expert_splits(name),
                                tp_partial_grad=name == "down_bias" and ctx.etp_size > 1)
            return ctx.expert_param(sharding, sd, kind)

        self.gate = param("gate", (e, f, h), std) if self.gated else None
        self.up = param("up", (e, f, h), std)
        self.down = param("down", (e, h, f), out_std)
        self.activation = activation
        bias = cfg.bias and not self.gated if biases is None else biases
        self.gate_bias = (param("gate_bias", (e, f), 0.0, "zeros")
                          if bias and self.gated else None)
        self.up_bias = param("up_bias", (e, f), 0.0, "zeros") if bias else None
        self.down_bias = param("down_bias", (e, h), 0.0, "zeros") if bias else None

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor | Sequence[int]
                ) -> torch.Tensor:
        """tokens [t_e, h] sorted by local expert, counts [E_local] (rows per local expert,
        a tensor or host ints) -> [t_e, h], each row through its expert (under expert tp:
        the group's rows gathered, this rank's slices applied, the partial sums
        reduce-scattered back; :mod:`colonnade.moe.expert_tp`)."""
        sizes = host_counts(counts)
        x, group_sizes, exchange = gather_rows(tokens, sizes, self.etp)  # [t_g, h]
        up = grouped_mm(x, self.up, group_sizes, self.fp8_in)  # [t_g, f/etp]
        if self.up_bias is not None:
            up = up + _rows(self.up_bias, group_sizes, x.shape[0])
        if self.gate is not None:
            gate = grouped_mm(x, self.gate, group_sizes, self.fp8_in)  # [t_g, f/etp]
            if self.gate_bias is not None:
                gate = gate + _rows(self.gate_bias, group_sizes, x.shape[0])
            hidden = self.activation(gate, up)  # [t_g, f/etp]
        else:
            hidden = gelu_tanh(up)  # [t_g, f/etp]
        out = scatter_partial_rows(grouped_mm(hidden, self.down, group_sizes, self.fp8_out),
                                   exchange)  # [t_e, h]
        if self.down_bias is not None:
            out = out + _rows(self.down_bias, sizes, tokens.shape[0])
        return out


def _rows(bias: torch.Tensor, sizes: list[int], total: int) -> torch.Tensor:
    """Per-expert bias [E_local, n] repeated over each expert's rows -> [t_e, n]."""
    counts = torch.tensor(sizes, device=bias.device)
    return bias.repeat_interleave(counts, dim=0, output_size=total)
