"""The mixture-of-experts layer: the MLP of an MoE transformer layer.

On a rank, x [s_l, b, h] (s_l = s / cp, or s / (cp tp) under sp) is flattened to t = s_l b
token rows in [s_l, b] order (s major, b minor) and ::

    routing  = router(x)                          expert ids [t, k], weights w [t, k]
    keep     = capacity(routing)                  [t, k] bool, None when dropless
    y_i      = sum_{j < k, keep_ij} w_ij expert_{e_ij}(x_i)             (routed output)
    y_i     += sigmoid(x_i . g) shared(x_i)        (shared expert; the gate only when asked)

The routed experts of the ep group are reached through a dispatcher (tokens sorted by local
expert, sent to the rank holding their expert, computed there by one grouped GEMM and sent
back; ``parallel.moe_dispatcher``). The shared expert is an ordinary tp-split dense MLP of
width ``moe_shared_expert_ffn_hidden_size``, of the class the subclass names (the moe package
sits below models, so the dense MLP classes are injected: :mod:`colonnade.models.spec` defines
the llama / gpt2 MoE layers over SwiGLUMLP / GeluMLP). With a
:class:`~colonnade.moe.state.MoEState` on the context (``ctx.moe``), the auxiliary losses
ride on the output into backward (:func:`~colonnade.moe.state.attach_aux_loss`) and the
layer's loads and drops are recorded (the trainer clears them at the start of every step, so
an evaluation's forwards never reach a step's log); without one (a bare layer) neither happens.

Activation recomputation re-runs the whole layer (the router has no randomness, so the same
tokens go to the same experts and the dispatch collectives run again in the same order on
every rank); statistics are not recorded twice (MoEState.record skips recomputation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from colonnade.config.sections import ModelConfig
from colonnade.eager import eager
from colonnade.moe.dispatch import capacity_keep, make_dispatcher
from colonnade.moe.experts import GroupedExperts
from colonnade.moe.router import Router, Routing, aux_losses
from colonnade.moe.state import attach_aux_loss
from colonnade.parallel.comm import CommGroup, CommStats
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.sharding import Sharding


class SharedGate(nn.Module):
    """The shared expert's gate ``sigmoid(x w_g^T)``: ``weight`` w_g [1, h], replicated (its
    gradient a partial sum over tp under sp), normal(0, init_std) at init."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str) -> None:
        super().__init__()
        sharding = Sharding(f"{key}.weight", (1, cfg.hidden_size), sp_partial_grad=ctx.sp)
        self.weight = ctx.param(sharding, cfg.init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s(/tp), b, h] -> gate [s(/tp), b, 1] in (0, 1)."""
        return torch.sigmoid(x @ self.weight.T)


class MoELayer(nn.Module):
    """Router, capacity, dispatch, grouped experts, combine, shared expert (module docstring).

    Parameters (key ``layers.{i}.mlp``): ``router.weight`` [E, h] (+ ``router.expert_bias``
    [E] for the sigmoid router), ``experts.*`` (:class:`~colonnade.moe.experts.GroupedExperts`),
    ``shared.*`` (a dense MLP) and ``shared_gate.weight`` [1, h] when configured. This class
    is the gated (SwiGLU) kind without a shared-expert class; :mod:`colonnade.models.spec`
    subclasses it per architecture (``gated``, ``matrices``, ``shared_class``).
    """

    matrices: ClassVar[int] = 3
    """h x f weight matrices of each expert (and of the shared expert): gate, up, down."""
    gated: ClassVar[bool] = True
    """Experts are SwiGLU (True) or GELU (False)."""
    shared_class: ClassVar[Callable[..., nn.Module] | None] = None
    """The dense MLP class of the shared expert, ``(cfg, ctx, key, layer)`` (None: a shared
    expert cannot be built)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str, layer: int) -> None:
        super().__init__()
        if not cfg.moe:
            raise ValueError(f"{key}: an MoE layer needs model.num_experts > 0")
        self.cfg, self.ctx, self.key, self.index = cfg, ctx, key, layer
        self.router = Router(cfg, ctx, f"{key}.router")
        self.experts = self.make_experts(cfg, ctx, f"{key}.experts")
        width = cfg.moe_shared_expert_ffn_hidden_size
        if width > 0 and self.shared_class is None:
            raise ValueError(f"{key}: model.moe_shared_expert_ffn_hidden_size={width} needs an "
                             "MoE layer class with a shared_class (see models.spec)")
        self.shared = (self.shared_class(dataclasses.replace(cfg, ffn_hidden_size=width), ctx,
                                         f"{key}.shared", layer)
                       if width > 0 and self.shared_class is not None else None)
        self.shared_gate = (SharedGate(cfg, ctx, f"{key}.shared_gate")
                            if width > 0 and cfg.moe_shared_expert_gate else None)
        ep = ctx.ep if ctx.ep is not None else CommGroup("ep", [0], None, CommStats(), 0)
        self.dispatcher = make_dispatcher(ctx.moe_dispatcher, ep, cfg.num_experts)

    def make_experts(self, cfg: ModelConfig, ctx: ParallelContext, key: str) -> GroupedExperts:
        """The routed experts (``gated`` from the class); a subclass names other biases or
        another gated activation (gpt-oss)."""
        return GroupedExperts(cfg, ctx, key, gated=self.gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h] (module docstring); batch-first x [b, s, h]
        (``ctx.batch_first``) is routed in the same [s, b] token order (capacity drops and
        the per-sequence balance loss see the tokens as every other layout does) and
        returned as [b, s, h]."""
        if self.ctx.batch_first:  # one [s, b, h] copy, the only one saved for backward
            return self._forward(x.transpose(0, 1).contiguous()).transpose(0, 1)  # [b, s, h]
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s(/tp), b, h] -> [s(/tp), b, h]."""
        s_local, b, h = x.shape
        flat = x.reshape(s_local * b, h)  # [t, h], rows in [s_l, b] order
        routing = self.router(flat)
        routed, dropped = self._routed(flat, routing, s_local, b)  # [t, h]
        out = routed.view(s_local, b, h)
        if self.shared is not None:
            shared = self.shared(x)  # [s(/tp), b, h]
            if self.shared_gate is not None:
                shared = shared * self.shared_gate(x)
            out = out + shared
        if self.ctx.moe is None:
            return out
        return self._aux_and_record(out, routing, dropped, s_local, b)

    @eager
    def _routed(self, flat: torch.Tensor, routing: Routing, s_local: int, b: int
                ) -> tuple[torch.Tensor, int]:
        """Capacity, dispatch, experts and combine: flat [t, h] -> (routed output [t, h],
        token slots dropped by the capacity). Eager under torch.compile: data-dependent token
        counts and ep collectives (through CommGroup) that dynamo cannot trace. The experts
        take the dispatch's host counts (no extra device sync)."""
        keep = capacity_keep(routing, self.cfg, self.ctx, s_local, b)  # [t, k] or None
        tokens, _, handle = self.dispatcher.dispatch(flat, routing, keep)  # [t_e, h]
        y = self.experts(tokens, handle.counts_host)  # [t_e, h]
        return self.dispatcher.combine(y, handle), handle.dropped

    @eager
    def _aux_and_record(self, out: torch.Tensor, routing: Routing, dropped: int,
                        s_local: int, b: int) -> torch.Tensor:
        """``out`` carrying this micro-batch's auxiliary losses into backward (scaled by
        ``ctx.moe.aux_scale``), its statistics recorded. Eager under torch.compile (the aux
        losses' reductions go through CommGroup)."""
        aux = aux_losses(routing, self.cfg, self.ctx, s_local, b)
        if aux:
            out = attach_aux_loss(out, torch.stack(list(aux.values())).sum(), self.ctx.moe)
        self._record(routing.expert, dropped, aux)
        return out

    def _record(self, expert: torch.Tensor, dropped: int,
                aux: dict[str, torch.Tensor]) -> None:
        """Record this micro-batch in ``ctx.moe``: loads (routed slots per expert before the
        capacity, [E], on the device), dropped and routed slot counts, the aux losses."""
        loads = torch.bincount(expert.reshape(-1), minlength=self.cfg.num_experts)  # [E]
        self.ctx.moe.record(self.key, loads, dropped, expert.numel(),
                            {name: value.detach() for name, value in aux.items()})
