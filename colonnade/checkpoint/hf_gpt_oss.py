"""Hugging Face form of gpt-oss: ``GptOssForCausalLM`` (Colonnade ``arch="gpt_oss"``).

What transformers' ``save_pretrained`` writes (not the Hub's MXFP4-quantised files, whose
experts are packed blocks and scales: a config.json with ``quantization_config`` is refused):

* attention: Llama's names with biases on q, k, v and o (``attention_bias``: model.bias) and
  ``self_attn.sinks`` [a], our ``attn.sinks``;
* the router ``mlp.router.weight`` [E, h] and ``mlp.router.bias`` [E] (model.moe_router_bias);
* the experts, stacked in one tensor each, stored [in, out] per expert (the transpose of our
  [out, in]): ``mlp.experts.gate_up_proj`` [E, h, 2f] with gate and up INTERLEAVED along its
  last dim (gate = [..., 0::2], up = [..., 1::2]; :attr:`HFRef.interleave`) and
  ``gate_up_proj_bias`` [E, 2f] likewise; ``down_proj`` [E, f, h], ``down_proj_bias`` [E, h];
* config: ``num_local_experts``, ``num_experts_per_tok``, ``intermediate_size`` (the experts'
  width f), ``head_dim``, ``swiglu_alpha`` / ``swiglu_limit``, ``router_aux_loss_coef`` (only
  with ``output_router_logits``, as the other MoE classes); ``sliding_window`` and
  ``layer_types`` through :mod:`colonnade.checkpoint.hf_window`'s ALTERNATE rule.

Every layer is MoE; the router is the softmax router with the top k renormalised (top-k of
the logits, then a softmax over them: the same weights), no shared expert, no capacity.
"""

from __future__ import annotations

from typing import Any

import torch

from colonnade.checkpoint.hf_archs import HFFormat, HFRef, _llama_names
from colonnade.checkpoint.hf_rope import read_rope, write_rope
from colonnade.checkpoint.hf_window import ALTERNATE
from colonnade.config.sections import ModelConfig

HF_CLASS = "GptOssForCausalLM"
"""``architectures[0]`` of a gpt-oss config.json."""

_EXPERTS = "mlp.experts"


def read_config(hf: dict[str, Any]) -> ModelConfig:
    """A ``GptOssForCausalLM`` config.json -> ModelConfig; refuses what Colonnade cannot run
    (quantised experts, attention without biases, a rope setting :func:`read_rope`
    refuses)."""
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise ValueError(f"config.json: quantization_config (quant_method={method!r}): the "
                         "experts are stored quantised; Colonnade reads unquantised weights. "
                         "Load the model in transformers with dequantize=True (Mxfp4Config) "
                         "and save_pretrained it, then import that folder")
    if not hf.get("attention_bias", True):
        raise ValueError("config.json: attention_bias=false; Colonnade's gpt_oss has biases "
                         "on q, k, v and o (model.bias) like the experts")
    h, a = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim == h // a and h % a == 0:
        head_dim = None
    coeff = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
    f = hf["intermediate_size"]
    return ModelConfig(
        arch="gpt_oss", num_layers=hf["num_hidden_layers"], hidden_size=h, num_heads=a,
        num_kv_heads=hf.get("num_key_value_heads") or a, head_dim=head_dim,
        ffn_hidden_size=f, vocab_size=hf["vocab_size"],
        max_seq_len=hf["max_position_embeddings"], **read_rope(hf),
        norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings")),
        bias=True, init_std=hf.get("initializer_range", 0.02),
        num_experts=hf["num_local_experts"], moe_top_k=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=f, moe_router="softmax", moe_norm_topk_prob=True,
        moe_router_bias=True, moe_swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        moe_swiglu_limit=float(hf.get("swiglu_limit", 7.0)), moe_aux_loss_coeff=coeff,
        moe_aux_loss_type="global")


def write_config(cfg: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> the class-specific config.json fields (refuses what the class cannot
    express)."""
    problems = [] if cfg.moe else ["model.num_experts > 0 (every layer is MoE)"]
    if not (cfg.bias and cfg.moe_router_bias):
        problems.append("model.bias and model.moe_router_bias must be true (biases on "
                        "attention, router and experts)")
    if cfg.moe_router != "softmax" or not cfg.moe_norm_topk_prob:
        problems.append("the router must be moe_router='softmax' with moe_norm_topk_prob=true")
    if (cfg.moe_first_dense_layers or cfg.moe_layer_freq != 1
            or cfg.moe_shared_expert_ffn_hidden_size or cfg.moe_capacity_factor is not None):
        problems.append("every layer MoE, no shared expert, dropless (moe_first_dense_layers=0,"
                        " moe_layer_freq=1, moe_shared_expert_ffn_hidden_size=0, "
                        "moe_capacity_factor unset)")
    if problems:
        raise ValueError(f"cannot express as {HF_CLASS}: " + "; ".join(problems))
    return {"model_type": "gpt_oss", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.expert_ffn_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_size, "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "attention_bias": True,
            "attention_dropout": 0.0, "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.moe_top_k, "swiglu_alpha": cfg.moe_swiglu_alpha,
            "swiglu_limit": cfg.moe_swiglu_limit,
            "output_router_logits": cfg.moe_aux_loss_coeff > 0,
            "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
            **write_rope(cfg)}


def refs(cfg: ModelConfig) -> dict[str, HFRef]:
    """Colonnade key -> where its values lie in the HF tensors (module docstring)."""
    out = {ours: HFRef(theirs) for ours, theirs in _llama_names(cfg).items()
           if ".mlp." not in ours}
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        out[f"{ours}.attn.sinks"] = HFRef(f"{theirs}.self_attn.sinks")
        out[f"{ours}.mlp.router.weight"] = HFRef(f"{theirs}.mlp.router.weight")
        out[f"{ours}.mlp.router.bias"] = HFRef(f"{theirs}.mlp.router.bias")
        ex, hx = f"{ours}.mlp.experts", f"{theirs}.{_EXPERTS}"
        for j, name in enumerate(("gate", "up")):
            out[f"{ex}.{name}"] = HFRef(f"{hx}.gate_up_proj", True, j, 2, interleave=True)
            out[f"{ex}.{name}_bias"] = HFRef(f"{hx}.gate_up_proj_bias", False, j, 2,
                                             interleave=True)
        out[f"{ex}.down"] = HFRef(f"{hx}.down_proj", True)
        out[f"{ex}.down_bias"] = HFRef(f"{hx}.down_proj_bias")
    return out


def to_hf(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full Colonnade tensors -> the HF state dict (the inverse of reading through
    :func:`refs`): renames, experts transposed per expert, gate and up interleaved."""
    out: dict[str, torch.Tensor] = {}
    for ours, ref in refs(cfg).items():
        value = full[ours].transpose(-1, -2) if ref.transpose else full[ours]
        if not ref.interleave:
            out[ref.name] = value.contiguous()
            continue
        if ref.name not in out:
            shape = (*value.shape[:-1], value.shape[-1] * ref.blocks)
            out[ref.name] = torch.empty(shape, dtype=value.dtype, device=value.device)
        out[ref.name][..., ref.block::ref.blocks] = value
    return out


FORMAT = HFFormat(HF_CLASS, read_config, write_config, refs, to_hf, window=ALTERNATE)
"""gpt-oss's HF form (registered in :data:`colonnade.checkpoint.hf_moe.MOE_FORMATS`)."""
