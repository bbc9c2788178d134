"""The validator's mixture-of-experts rules (one of :data:`colonnade.config.validate.RULES`):
the model.moe_* fields' ranges and choices, and what the parallel layout supports with experts.
"""

from __future__ import annotations

from colonnade.config.choices import MOE_AUX_LOSS_TYPES, MOE_DISPATCHERS, MOE_ROUTERS
from colonnade.config.sections import Config, ModelConfig, ParallelConfig


def _moe_fields(m: ModelConfig) -> list[str]:
    """Ranges and choices of the model.moe_* fields (checked only when num_experts > 0)."""
    out = []
    if not 1 <= m.moe_top_k <= m.num_experts:
        out.append(f"model.moe_top_k={m.moe_top_k} must be in [1, model.num_experts="
                   f"{m.num_experts}] (experts each token is sent to).")
    for name, low, value in (("moe_layer_freq", 1, m.moe_layer_freq),
                             ("moe_first_dense_layers", 0, m.moe_first_dense_layers),
                             ("moe_shared_expert_ffn_hidden_size", 0,
                              m.moe_shared_expert_ffn_hidden_size),
                             ("moe_ffn_hidden_size", 1, m.expert_ffn_size)):
        if value < low:
            out.append(f"model.{name}={value} must be >= {low}.")
    if m.moe_layer_freq >= 1 and m.num_layers >= 1 and not any(
            map(m.is_moe_layer, range(m.num_layers))):
        out.append(f"model.moe_first_dense_layers={m.moe_first_dense_layers} leaves no MoE "
                   f"layer among model.num_layers={m.num_layers}; lower it or set "
                   "model.num_experts=0.")
    for name, value in (("moe_aux_loss_coeff", m.moe_aux_loss_coeff),
                        ("moe_z_loss_coeff", m.moe_z_loss_coeff),
                        ("moe_router_bias_update_rate", m.moe_router_bias_update_rate)):
        if value < 0:
            out.append(f"model.{name}={value} must be >= 0 (0 turns it off).")
    if m.moe_capacity_factor is not None and not m.moe_capacity_factor > 0:
        out.append(f"model.moe_capacity_factor={m.moe_capacity_factor} must be > 0 (slots per "
                   "expert relative to an even split); unset it for dropless routing.")
    if m.moe_shared_expert_gate and m.moe_shared_expert_ffn_hidden_size <= 0:
        out.append("model.moe_shared_expert_gate=true needs a shared expert: set "
                   "model.moe_shared_expert_ffn_hidden_size > 0 or the gate to false.")
    for name, value, allowed in (("model.moe_router", m.moe_router, MOE_ROUTERS),
                                 ("model.moe_aux_loss_type", m.moe_aux_loss_type,
                                  MOE_AUX_LOSS_TYPES)):
        if value not in allowed:
            out.append(f"{name}='{value}' is unknown; use one of {', '.join(allowed)}.")
    return out


def _swiglu_clamp(m: ModelConfig) -> list[str]:
    """model.moe_swiglu_alpha / limit: gpt-oss's experts only, a positive limit."""
    defaults = ModelConfig()
    changed = [f"model.{name}={getattr(m, name)}" for name in ("moe_swiglu_alpha",
                                                                "moe_swiglu_limit")
               if getattr(m, name) != getattr(defaults, name)]
    traits = m.traits
    if changed and traits is not None and not traits.clamped_swiglu:
        return [f"{', '.join(changed)}: model.arch='{m.arch}' has no clamped SwiGLU experts "
                "(gpt_oss has); leave them at their defaults."]
    if not m.moe_swiglu_limit > 0:
        return [f"model.moe_swiglu_limit={m.moe_swiglu_limit} must be > 0 (the clamp of "
                "gpt-oss's expert activations)."]
    return []


def moe_rules(c: Config, _: int | None) -> list[str]:
    """Mixture of experts: the model.moe_* fields, and what the parallel layout supports with
    experts (ep dividing the experts, expert_tp dividing the expert width, sp under tp > 1,
    hybrid sharding's size dividing expert dp)."""
    m, p, out = c.model, c.parallel, []
    if p.moe_dispatcher not in MOE_DISPATCHERS:
        out.append(f"parallel.moe_dispatcher='{p.moe_dispatcher}' is unknown; use one of "
                   f"{', '.join(MOE_DISPATCHERS)}.")
    if m.num_experts < 0:
        out.append(f"model.num_experts={m.num_experts} must be >= 0 (0: a dense model).")
    out.extend(_swiglu_clamp(m))
    if not m.moe:
        if p.expert_tp is not None and p.expert_tp > 1:
            out.append(f"parallel.expert_tp={p.expert_tp} needs a mixture-of-experts model "
                       "(model.num_experts > 0): no layer has experts to split; unset it or "
                       "set expert_tp=1.")
        return out
    out.extend(_moe_fields(m))
    if p.ep >= 1 and m.num_experts % p.ep:
        out.append(f"model.num_experts={m.num_experts} is not divisible by parallel.ep={p.ep}; "
                   "each ep rank holds num_experts / ep experts: pick ep dividing num_experts.")
    etp = p.expert_tp if p.expert_tp is not None else 1
    if etp >= 1 and m.expert_ffn_size >= 1 and m.expert_ffn_size % etp:
        out.append(f"model.moe_ffn_hidden_size={m.expert_ffn_size} is not divisible by "
                   f"parallel.expert_tp={etp} (each expert's gate/up rows and down columns are "
                   "split over expert tp); pick expert_tp dividing it, or expert_tp=1.")
    if p.tp > 1 and not p.sp:
        out.append(f"parallel.tp={p.tp} with a mixture-of-experts model needs parallel.sp=true "
                   "(the tp ranks must route different tokens); set sp=true or tp=1.")
    if m.moe_shared_expert_ffn_hidden_size > 0 and p.tp >= 1 and (
            m.moe_shared_expert_ffn_hidden_size % p.tp):
        out.append(f"model.moe_shared_expert_ffn_hidden_size="
                   f"{m.moe_shared_expert_ffn_hidden_size} is not divisible by parallel.tp="
                   f"{p.tp} (the shared expert is tp-split); make it a multiple of tp.")
    out.extend(_expert_hybrid(p))
    return out


def _expert_hybrid(p: ParallelConfig) -> list[str]:
    """Hybrid sharding of the expert buckets: groups of min(zero_shard_size, edp) consecutive
    expert-dp ranks (:func:`colonnade.parallel.groups.expert_shard_size`), which must divide
    edp = tp x cp x dp / (ep x expert_tp)."""
    size, etp = p.zero_shard_size, p.expert_tp or 1
    if size is None or size < 1 or p.zero < 1 or p.dp is None or p.ep < 1:
        return []
    stage = p.tp * p.cp * p.dp
    if stage % (p.ep * etp):
        return []  # the layout rule names this
    edp = stage // (p.ep * etp)
    if edp % min(size, edp):
        return [f"parallel.zero_shard_size={size} does not divide the expert data-parallel "
                f"degree tp x cp x dp / (ep x expert_tp) = {edp} (expert weights shard over "
                f"groups of min(zero_shard_size, {edp}) expert-dp ranks); pick a divisor or a "
                f"multiple of {edp}, or change parallel.ep."]
    return []
