"""Mutable per-run state of the mixture-of-experts layers, and the auxiliary-loss scaler.

One :class:`MoEState` hangs off the :class:`~colonnade.tensor_parallel.context.
ParallelContext` (``ctx.moe``) and is shared by every MoE layer of a rank's model. It holds

* ``aux_scale``: the factor the auxiliary losses' gradients are multiplied by in backward. The
  training step sets it before the step's forwards (see :func:`attach_aux_loss`);
* ``dp_cp``: the data x context-parallel group, over which the 'global' balancing loss counts
  the micro-batch's tokens (None: no data-parallel peers, the cp group stands for it);
* the step's statistics per MoE layer (:class:`LayerStats`), which the trainer reads, reduces
  over its ranks, logs and resets once per step.

Auxiliary losses reach the gradients without the pipeline executor: an MoE layer returns its
output through :func:`attach_aux_loss`, identity forward, whose backward also back-propagates
``aux_scale x aux`` from the loss's own graph (the router's logits), as Megatron-Core's
MoEAuxLossAutoScaler does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from colonnade.parallel.comm import CommGroup


@dataclass
class LayerStats:
    """One MoE layer's statistics, accumulated over the micro-batches of a step on this rank."""

    loads: torch.Tensor | None = None
    """[E] int64: token slots this rank's tokens routed to each expert (before capacity)."""
    dropped: int = 0
    """Token slots dropped by the capacity limit."""
    routed: int = 0
    """Token slots routed (tokens x k)."""
    aux_sums: dict[str, torch.Tensor | float] = field(default_factory=dict)
    """Sum over the micro-batches of each auxiliary loss's value (already x its coefficient;
    0-d tensors while recording, host floats once :meth:`MoEState.read`)."""
    microbatches: int = 0
    """Micro-batches recorded."""

    def aux_means(self) -> dict[str, float]:
        """Each auxiliary loss's mean over the recorded micro-batches."""
        n = max(self.microbatches, 1)
        return {name: float(value) / n for name, value in self.aux_sums.items()}

    @property
    def dropped_fraction(self) -> float:
        """dropped / routed (0 when nothing was routed)."""
        return self.dropped / self.routed if self.routed else 0.0


def in_recomputation() -> bool:
    """Whether the caller runs inside a backward pass: activation recomputation re-runs a
    layer's forward there, and its statistics must not be counted twice."""
    return bool(torch._C._current_graph_task_id() != -1)


@dataclass
class MoEState:
    """What the MoE layers of one rank share with the training step (module docstring)."""

    aux_scale: float = 1.0
    """Gradient factor of the auxiliary losses, read when a layer's forward runs. 1.0 makes
    the backward that of ``main + aux`` (one process, no trainer)."""
    dp_cp: CommGroup | None = None
    """The dp x cp group of this rank ('global' balancing loss); None: the cp group only."""
    layers: dict[str, LayerStats] = field(default_factory=dict)
    """Statistics of the current step per layer key (``layers.{i}.mlp``)."""
    steps: int = 0
    """Steps completed (:meth:`reset` calls)."""

    def record(self, layer_key: str, loads: torch.Tensor, dropped: int, routed: int,
               aux: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch of layer ``layer_key``: ``loads`` [E] routed slots per expert
        (int, stays on its device: no host sync), ``dropped`` / ``routed`` slot counts, ``aux``
        the layer's auxiliary losses (detached; read on the host in :meth:`read`). Ignored
        while recomputing activations in backward (the forward already counted)."""
        if in_recomputation():
            return
        stats = self.layers.setdefault(layer_key, LayerStats())
        loads = loads.detach().to(torch.int64)
        stats.loads = loads.clone() if stats.loads is None else stats.loads + loads
        stats.dropped += int(dropped)
        stats.routed += int(routed)
        for name, value in aux.items():
            stats.aux_sums[name] = stats.aux_sums.get(name, 0.0) + value.detach()
        stats.microbatches += 1

    def read(self) -> dict[str, LayerStats]:
        """The step's statistics per layer key, aux sums as host floats (one sync here)."""
        out: dict[str, LayerStats] = {}
        for key, stats in self.layers.items():
            sums: dict[str, torch.Tensor | float] = {
                name: float(value) for name, value in stats.aux_sums.items()}
            out[key] = LayerStats(stats.loads, stats.dropped, stats.routed, sums,
                                  stats.microbatches)
        return out

    def reset(self) -> None:
        """Forget the step's statistics (after the trainer has read them)."""
        self.layers.clear()
        self.steps += 1


class AuxLossScaler(torch.autograd.Function):
    """Forward: ``x`` unchanged. Backward: ``x``'s gradient unchanged, and ``scale`` as the
    gradient of the 0-d ``loss``, so autograd also back-propagates ``scale x loss``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_meta = (loss.dtype, loss.device, loss.shape)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        dtype, device, shape = ctx.loss_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def attach_aux_loss(x: torch.Tensor, loss: torch.Tensor | None,
                    state: MoEState | None) -> torch.Tensor:
    """``x`` (any shape, e.g. the MoE output [s(/tp), b, h]) returned unchanged, carrying the
    0-d auxiliary ``loss`` into backward: the gradients become those of
    ``main + aux_scale x loss`` (``aux_scale`` of ``state`` read now; 1.0 without a state).

    The training step sets ``aux_scale = loss_scale x dp_cp / (microbatches x dp)``: each
    rank's gradient is averaged over dp x cp (hence x dp_cp), and the objective counts the
    mean over the global batch's microbatches x dp micro-batches of each one's aux loss.
    Nothing is attached when ``loss`` is None or does not require a gradient (eval)."""
    if loss is None or not loss.requires_grad:
        return x
    scale = state.aux_scale if state is not None else 1.0
    out: torch.Tensor = AuxLossScaler.apply(x, loss, scale)
    return out
