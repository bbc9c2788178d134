"""The validator's DeepSeek-V3 rules (one of :data:`colonnade.config.validate.RULES`):
multi-head latent attention's fields (model.mla_*), and the router's group limit and routed
scaling (model.moe_n_group, moe_topk_group, moe_routed_scaling_factor).
"""

from __future__ import annotations

from colonnade.config.sections import Config, ModelConfig


def _mla_fields(m: ModelConfig) -> list[str]:
    """Ranges of the model.mla_* fields of an MLA architecture, and the fields MLA ignores."""
    out = []
    for name, low, value in (("mla_kv_lora_rank", 1, m.mla_kv_lora_rank),
                             ("mla_qk_nope_head_dim", 0, m.mla_qk_nope_head_dim),
                             ("mla_qk_rope_head_dim", 2, m.mla_qk_rope_head_dim),
                             ("mla_v_head_dim", 1, m.mla_v_head_dim)):
        if value < low:
            out.append(f"model.{name}={value} must be >= {low} with model.arch='{m.arch}' "
                       "(multi-head latent attention; DeepSeek-V3: kv_lora_rank 512, "
                       "qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128).")
    if m.mla_qk_rope_head_dim % 2:
        out.append(f"model.mla_qk_rope_head_dim={m.mla_qk_rope_head_dim} must be even (RoPE "
                   "rotates pairs).")
    if m.mla_q_lora_rank is not None and m.mla_q_lora_rank < 1:
        out.append(f"model.mla_q_lora_rank={m.mla_q_lora_rank} must be >= 1, or unset for one "
                   "query projection.")
    if m.num_kv_heads not in (None, m.num_heads):
        out.append(f"model.num_kv_heads={m.num_kv_heads}: multi-head latent attention expands "
                   "a key and a value for every head; unset it.")
    if m.head_dim is not None:
        out.append(f"model.head_dim={m.head_dim} is not used by multi-head latent attention "
                   "(its widths are model.mla_qk_nope_head_dim + mla_qk_rope_head_dim and "
                   "mla_v_head_dim); unset it.")
    if m.bias or m.qkv_bias:
        out.append("model.bias / model.qkv_bias: multi-head latent attention has no biases; "
                   "set both to false.")
    return out


def _router_fields(m: ModelConfig) -> list[str]:
    """The group-limited router's fields (sigmoid router only)."""
    out = []
    sigmoid = m.moe_router == "sigmoid"
    if m.moe_n_group < 1 or m.moe_topk_group < 1:
        out.append(f"model.moe_n_group={m.moe_n_group} and model.moe_topk_group="
                   f"{m.moe_topk_group} must be >= 1 (1: no group limit).")
        return out
    if m.moe_n_group > 1 and not sigmoid:
        out.append(f"model.moe_n_group={m.moe_n_group}: group-limited routing is built for "
                   "model.moe_router='sigmoid' only; set moe_n_group=1 or the sigmoid router.")
    if m.moe_routed_scaling_factor != 1.0 and not sigmoid:
        out.append(f"model.moe_routed_scaling_factor={m.moe_routed_scaling_factor} is built "
                   "for model.moe_router='sigmoid' only; set it to 1.")
    if not m.moe_routed_scaling_factor > 0:
        out.append(f"model.moe_routed_scaling_factor={m.moe_routed_scaling_factor} must be > 0.")
    if m.moe_topk_group > m.moe_n_group:
        out.append(f"model.moe_topk_group={m.moe_topk_group} exceeds model.moe_n_group="
                   f"{m.moe_n_group}; a token cannot use more groups than there are.")
    if m.num_experts % m.moe_n_group:
        out.append(f"model.num_experts={m.num_experts} is not divisible by model.moe_n_group="
                   f"{m.moe_n_group} (equal expert groups); pick a divisor.")
    elif m.moe_top_k > m.moe_topk_group * (m.num_experts // m.moe_n_group):
        out.append(f"model.moe_top_k={m.moe_top_k} exceeds the experts of model.moe_topk_group="
                   f"{m.moe_topk_group} groups ({m.num_experts // m.moe_n_group} each); raise "
                   "moe_topk_group or lower moe_top_k.")
    return out


def deepseek_rules(c: Config, _: int | None) -> list[str]:
    """Multi-head latent attention (an arch whose traits say ``mla`` needs the model.mla_*
    widths, every other arch leaves them unset) and the group-limited router."""
    m, out = c.model, []
    if m.traits is not None and m.traits.mla:
        out.extend(_mla_fields(m))
    elif m.mla or m.mla_q_lora_rank is not None or m.mla_qk_nope_head_dim or (
            m.mla_qk_rope_head_dim or m.mla_v_head_dim):
        out.append(f"model.mla_* fields are set but model.arch='{m.arch}' has no multi-head "
                   "latent attention (deepseek_v3 has); unset them.")
    if m.mtp_layers < 0 or m.mtp_loss_weight < 0:
        out.append(f"model.mtp_layers={m.mtp_layers} and model.mtp_loss_weight="
                   f"{m.mtp_loss_weight} must be >= 0 (0 layers: no multi-token prediction).")
    if m.moe:
        out.extend(_router_fields(m))
    elif (m.moe_n_group, m.moe_topk_group, m.moe_routed_scaling_factor) != (1, 1, 1.0):
        out.append("model.moe_n_group / moe_topk_group / moe_routed_scaling_factor need a "
                   "mixture-of-experts model (model.num_experts > 0); leave them at 1.")
    return out
