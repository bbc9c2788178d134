"""The mixture-of-experts side of a training step: the aux-loss scale, the step's global expert
loads, the sigmoid router's bias update and the MoE fields of the log.

Aux-loss scale (set before the step's forward passes; the MoE layers' autograd scaler
back-propagates ``aux_scale x aux`` from every micro-batch's aux losses). Let a rank run m
micro-batches of a global batch of m x dp micro-batches. The main loss reaches each rank's
backward as ``loss_scale x dp_cp / N x sum CE`` and the gradient reduction averages over dp x cp
(the dense weights, among them the router's), so the reduced gradient is that of
``loss_scale x CE_mean``. The trained objective is ::

    L = CE_mean + (1 / (m dp)) sum over the global batch's micro-batches k of aux_k

(aux_k already carries its coefficient; it is the micro-batch's loss over its own sequences
for 'seq' and, for 'global', its micro-step's loss over all dp x cp x tp(sp) ranks' tokens, of
which each rank differentiates its own tokens' share). A rank that back-propagates
``scale x aux_k`` of each of its micro-batches contributes, after the dp x cp averaging,
``scale / dp_cp`` times its gradients; asking for ``loss_scale / (m dp)`` per micro-batch gives ::

    aux_scale = loss_scale x dp_cp / (m x dp)

(cp and tp-under-sp ranks of one sequence each differentiate their own rows of the same
aux, so their partial gradients add up to it: the dp_cp factor undoes the cp averaging; the
tp partial sums are added by the sp reduction of replicated weights).

Loads: every MoE layer records, per micro-batch, the expert counts of this rank's token
slots. Tokens of different dp, cp and tp (sequence parallel is required with tp) ranks differ
and a layer lives on one pipeline stage, so one world all-reduce of the per-layer rows
([layers, E] counts and the drop / aux columns, zero rows for other stages' layers) counts
every routed token exactly once and makes the step's global loads known on every rank (the
logger is rank 0, on the first stage).
"""

from __future__ import annotations

from typing import Any

import torch

from colonnade.config.sections import Config
from colonnade.models.gpt import ModelChunk
from colonnade.moe.router import Router, update_expert_bias
from colonnade.moe.state import MoEState
from colonnade.parallel.groups import ProcessGroups

AUX_NAMES: tuple[str, ...] = ("load_balance", "z_loss")
"""Aux losses reported per layer (absent ones count as 0)."""


def moe_state(chunks: list[ModelChunk]) -> MoEState | None:
    """The rank's MoE state (shared by all its chunks' layers); None for a dense model."""
    return getattr(chunks[0].ctx, "moe", None) if chunks else None


def aux_scale(loss_scale: float, groups: ProcessGroups, microbatches: int) -> float:
    """``loss_scale x dp_cp / (microbatches x dp)`` (derived in the module docstring)."""
    return loss_scale * groups.dp_cp.size / (microbatches * groups.dp.size)


def install_moe_state(chunks: list[ModelChunk], groups: ProcessGroups) -> MoEState | None:
    """Give a rank's chunks (one shared context) a fresh :class:`MoEState` over its dp x cp
    group when the model has MoE layers; returns it (None for a dense model). Without it the
    MoE layers attach no aux loss and record nothing (evaluation-only models, generation)."""
    if not chunks or not chunks[0].cfg.moe:
        return None
    state = MoEState(dp_cp=groups.dp_cp)
    for chunk in chunks:
        chunk.ctx.moe = state
    return state


def begin_moe_step(chunks: list[ModelChunk], groups: ProcessGroups, loss_scale: float,
                   microbatches: int) -> None:
    """Before a training step: forget recorded statistics, set the aux-loss scale."""
    state = moe_state(chunks)
    if state is None:
        return
    state.reset()
    state.aux_scale = aux_scale(loss_scale, groups, microbatches)


def moe_layer_ids(config: Config) -> list[int]:
    """Global indices of the MoE layers, in order (the rows of :func:`step_rows`), the
    multi-token-prediction modules' layers (num_layers ..) included."""
    model = config.model
    return [i for i in range(model.num_layers + model.mtp_layers) if model.is_moe_layer(i)]


def _layer_index(key: Any) -> int:
    """Global layer index of a record key ('layers.3.mlp', 'layers.3' or 3)."""
    if isinstance(key, int):
        return key
    parts = str(key).split(".")
    return int(parts[parts.index("layers") + 1] if "layers" in parts else parts[0])


def step_rows(state: MoEState, config: Config, groups: ProcessGroups,
              device: torch.device) -> torch.Tensor:
    """[L, E + 3 + len(AUX_NAMES)] float64 over the world: per MoE layer, the step's global
    token-slot counts per expert [E], dropped and routed slots, micro-batches recorded (on one
    rank of the layer's stage; the stage's ranks agree) and the aux losses summed over the
    step's micro-batches, averaged over the stage's ranks."""
    ids = moe_layer_ids(config)
    row_of = {layer: r for r, layer in enumerate(ids)}
    e = config.model.num_experts
    rows = torch.zeros(len(ids), e + 3 + len(AUX_NAMES), dtype=torch.float64, device=device)
    stage = groups.world.size // groups.pp.size  # ranks of one pipeline stage: tp x cp x dp
    for key, rec in state.read().items():
        if rec.loads is None:
            continue
        r = row_of[_layer_index(key)]
        rows[r, :e] = rec.loads.to(device=device, dtype=torch.float64)
        rows[r, e] = float(rec.dropped)
        rows[r, e + 1] = float(rec.routed)
        rows[r, e + 2] = float(rec.microbatches) / stage
        for j, name in enumerate(AUX_NAMES):
            rows[r, e + 3 + j] = float(rec.aux_sums.get(name, 0.0)) / stage
    if groups.world.size > 1:
        groups.world.all_reduce(rows, name="moe_stats")
    return rows


def end_moe_step(chunks: list[ModelChunk], config: Config,
                 groups: ProcessGroups, device: torch.device) -> dict[str, Any]:
    """After the optimizer step: global loads, the sigmoid routers' bias update, log fields.

    Returns {} for a dense model, else :func:`moe_metrics` of the step. Every rank calls it
    (one world all-reduce)."""
    state = moe_state(chunks)
    if state is None:
        return {}
    rows = step_rows(state, config, groups, device)
    e = config.model.num_experts
    row_of = {layer: r for r, layer in enumerate(moe_layer_ids(config))}
    rate = config.model.moe_router_bias_update_rate
    for chunk in chunks:
        for name, module in chunk.named_modules():  # 'layers.<global index>.mlp.router'
            if isinstance(module, Router) and getattr(module, "expert_bias", None) is not None:
                loads = rows[row_of[_layer_index(name)], :e]
                update_expert_bias(module, loads.to(module.expert_bias.dtype), rate)
    state.reset()
    return moe_metrics(rows.cpu(), moe_layer_ids(config), e)


def moe_metrics(rows: torch.Tensor, layer_ids: list[int], e: int) -> dict[str, Any]:
    """Log fields from :func:`step_rows`: per layer i ``moe/{i}/load_max_mean`` (largest
    expert load over the mean load), ``moe/{i}/dropped_frac`` (dropped / routed slots),
    ``moe/{i}/<aux>`` (mean over the step's micro-batches); ``moe_load`` {layer: [E] slot
    counts}; and the summary ``moe_load_max_mean`` (worst layer), ``moe_dropped_frac`` (all
    layers), ``moe_aux_loss`` / ``moe_z_loss`` (summed over layers)."""
    out: dict[str, Any] = {}
    loads: dict[str, list[int]] = {}
    worst, dropped, routed = 0.0, 0.0, 0.0
    aux_total = [0.0] * len(AUX_NAMES)
    for r, layer in enumerate(layer_ids):
        load = rows[r, :e]
        mean = float(load.mean())
        ratio = float(load.max()) / mean if mean > 0 else 0.0
        count = max(float(rows[r, e + 2]), 1e-30)
        out[f"moe/{layer}/load_max_mean"] = ratio
        out[f"moe/{layer}/dropped_frac"] = float(rows[r, e]) / max(float(rows[r, e + 1]), 1.0)
        for j, name in enumerate(AUX_NAMES):
            value = float(rows[r, e + 3 + j]) / count
            out[f"moe/{layer}/{name}"] = value
            aux_total[j] += value
        loads[str(layer)] = [round(float(v)) for v in load]
        worst = max(worst, ratio)
        dropped += float(rows[r, e])
        routed += float(rows[r, e + 1])
    out["moe_load_max_mean"] = worst
    out["moe_dropped_frac"] = dropped / max(routed, 1.0)
    out["moe_aux_loss"], out["moe_z_loss"] = aux_total
    out["moe_load"] = loads
    return out
