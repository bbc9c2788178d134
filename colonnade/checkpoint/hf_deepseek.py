"""Hugging Face form of DeepSeek-V3 (``DeepseekV3ForCausalLM``, Colonnade
``model.arch='deepseek_v3'``): multi-head latent attention, the sigmoid router with group-limited
top-k, shared experts, a dense prefix.

Every tensor is a pure rename (transformers' file layout, what ``save_pretrained`` writes):

* attention ``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj`` without
  ``q_lora_rank``), ``kv_a_proj_with_mqa`` [r + d_r, h], ``kv_a_layernorm``, ``kv_b_proj``
  [a (d_n + d_v), r] (per head: d_n key rows then d_v value rows, so a tp split of the rows is a
  split by heads) and ``o_proj``: ours ``attn.q_a``, ``q_a_norm``, ``q_b`` (``q``), ``kv_a``,
  ``kv_a_norm``, ``kv_b``, ``o``. ``rope_interleave`` is model.mla_rope_interleave (the
  rotation follows it; no weight is permuted);
* dense layers (the first ``first_k_dense_replace``) ``mlp.gate_proj / up_proj / down_proj``;
* MoE layers ``mlp.gate.weight`` [E, h] (the router), ``mlp.gate.e_score_correction_bias`` [E]
  (our selection bias ``router.expert_bias``, moved by the bias update), the routed experts
  ``mlp.experts.{j}.gate_proj / up_proj / down_proj`` (one tensor per expert, as the Hub
  checkpoints and ``save_pretrained`` store them) and ``mlp.shared_experts.*`` (an ungated
  SwiGLU of width n_shared_experts x moe_intermediate_size).

RoPE settings (DeepSeek-V3: yarn, factor 40, mscale = mscale_all_dim = 1, original context
4096) go through :mod:`colonnade.checkpoint.hf_rope`; yarn's mscale_all_dim also scales MLA's
softmax (:func:`colonnade.models.mla.mla_softmax_factor`).

Multi-token prediction (``num_nextn_predict_layers`` = model.mtp_layers): module k is stored
as layer L + k (L = num_hidden_layers): its transformer layer under the usual names, and
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, ``embed_tokens`` and
``shared_head.head`` (ours ``mtp.{k}.*``, :mod:`colonnade.models.mtp`). transformers builds no
MTP module (it ignores layer 61 of DeepSeek-V3 on loading, and warns about the unexpected
keys of a smaller model's) and saves none while writing num_nextn_predict_layers = 1 by
default: :func:`fit` reads such a folder without MTP.

Refused on reading, each by name: attention biases, a scoring function other than sigmoid,
and num_key_value_heads != num_attention_heads (and any rope setting :func:`read_rope`
refuses).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from colonnade.checkpoint.hf_archs import HFFormat, HFRef, refs_to_hf
from colonnade.checkpoint.hf_rope import read_rope, write_rope
from colonnade.config.sections import ModelConfig

_SWIGLU = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
_MTP = (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"),
        ("norm", "shared_head.norm"), ("embed", "embed_tokens"), ("head", "shared_head.head"))
"""A multi-token-prediction module's own tensors: ours (mtp.{k}.*) -> the checkpoint's
(model.layers.{L + k}.*); its transformer layer is layers.{L + k} under the usual names."""

log = logging.getLogger(__name__)


def _refuse(hf: dict[str, Any]) -> None:
    """Raise naming every config.json setting that Colonnade's deepseek_v3 cannot run."""
    problems = []
    if hf.get("attention_bias"):
        problems.append("attention_bias=true (Colonnade's MLA has no biases)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func={hf['scoring_func']!r} (DeepSeek-V3's router is sigmoid)")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r} (SwiGLU needs silu)")
    heads = hf["num_attention_heads"]
    if (hf.get("num_key_value_heads") or heads) != heads:
        problems.append(f"num_key_value_heads={hf['num_key_value_heads']} != "
                        f"num_attention_heads={heads} (MLA expands every head's key)")
    if (hf.get("n_shared_experts") or 0) < 1 and hf["first_k_dense_replace"] < (
            hf["num_hidden_layers"]):
        problems.append("n_shared_experts=0 (DeepSeek-V3's MoE layers have a shared expert)")
    if problems:
        raise ValueError("DeepseekV3ForCausalLM: " + "; ".join(problems))


def read_config(hf: dict[str, Any]) -> ModelConfig:
    """config.json -> ModelConfig (model.arch='deepseek_v3'); refuses what cannot run."""
    _refuse(hf)
    layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace") or 0
    rope = read_rope(hf)  # refuses a rope setting it does not understand
    moe: dict[str, Any] = {}
    if dense < layers:
        f_e = hf["moe_intermediate_size"]
        moe = {"num_experts": hf["n_routed_experts"], "moe_top_k": hf["num_experts_per_tok"],
               "moe_ffn_hidden_size": f_e, "moe_first_dense_layers": dense,
               "moe_router": "sigmoid", "moe_norm_topk_prob": bool(hf.get("norm_topk_prob")),
               "moe_n_group": hf.get("n_group") or 1, "moe_topk_group": hf.get("topk_group") or 1,
               "moe_routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
               "moe_shared_expert_ffn_hidden_size": hf["n_shared_experts"] * f_e}
    return ModelConfig(
        arch="deepseek_v3", num_layers=layers, hidden_size=hf["hidden_size"],
        num_heads=hf["num_attention_heads"], ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], max_seq_len=hf["max_position_embeddings"],
        norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings")),
        init_std=hf.get("initializer_range", 0.02), mla_q_lora_rank=hf.get("q_lora_rank"),
        mla_kv_lora_rank=hf["kv_lora_rank"], mla_qk_nope_head_dim=hf["qk_nope_head_dim"],
        mla_qk_rope_head_dim=hf["qk_rope_head_dim"], mla_v_head_dim=hf["v_head_dim"],
        mla_rope_interleave=bool(hf.get("rope_interleave", True)),
        mtp_layers=int(hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0),
        **rope, **moe)


def fit(cfg: ModelConfig, names: set[str]) -> ModelConfig:
    """``cfg`` with model.mtp_layers = the multi-token-prediction modules the folder holds:
    transformers builds none and saves none, yet writes num_nextn_predict_layers (1 by
    default), so a folder without ``model.layers.{L}.eh_proj.weight`` is read without MTP
    (nothing is dropped: there are no such weights); a folder holding fewer modules than its
    config says is refused."""
    if cfg.mtp_layers == 0:
        return cfg
    held = [f"model.layers.{cfg.num_layers + k}.eh_proj.weight" in names
            for k in range(cfg.mtp_layers)]
    if not any(held):
        log.info("config.json: num_nextn_predict_layers=%d but the folder holds no "
                 "multi-token-prediction weights (transformers saves none): read without MTP",
                 cfg.mtp_layers)
        return dataclasses.replace(cfg, mtp_layers=0)
    if not all(held):
        raise ValueError(f"num_nextn_predict_layers={cfg.mtp_layers} but the folder holds only "
                         f"{sum(held)} multi-token-prediction module(s)")
    return cfg


def write_config(cfg: ModelConfig) -> dict[str, Any]:
    """ModelConfig -> DeepseekV3Config's config.json fields (a dense model writes every layer
    as a dense prefix)."""
    if cfg.bias or cfg.qkv_bias:
        raise ValueError("cannot express as deepseek_v3: model.bias / model.qkv_bias (no biases)")
    if cfg.moe and (cfg.moe_router != "sigmoid" or cfg.moe_layer_freq != 1
                    or cfg.moe_shared_expert_gate or cfg.moe_capacity_factor is not None
                    or cfg.moe_shared_expert_ffn_hidden_size % cfg.expert_ffn_size):
        raise ValueError("cannot express as deepseek_v3: it needs model.moe_router='sigmoid', "
                         "moe_layer_freq=1, an ungated shared expert whose width is a multiple "
                         "of the expert width, and dropless routing")
    f_e = cfg.expert_ffn_size if cfg.moe else cfg.ffn_size
    return {
        "model_type": "deepseek_v3", "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "rope_interleave": cfg.mla_rope_interleave, "q_lora_rank": cfg.mla_q_lora_rank,
        "kv_lora_rank": cfg.mla_kv_lora_rank, "qk_nope_head_dim": cfg.mla_qk_nope_head_dim,
        "qk_rope_head_dim": cfg.mla_qk_rope_head_dim, "v_head_dim": cfg.mla_v_head_dim,
        "first_k_dense_replace": cfg.moe_first_dense_layers if cfg.moe else cfg.num_layers,
        "moe_intermediate_size": f_e, "n_routed_experts": cfg.num_experts or 1,
        "num_experts_per_tok": cfg.moe_top_k if cfg.moe else 1,
        "n_shared_experts": cfg.moe_shared_expert_ffn_hidden_size // f_e if cfg.moe else 1,
        "n_group": cfg.moe_n_group, "topk_group": cfg.moe_topk_group,
        "norm_topk_prob": cfg.moe_norm_topk_prob,
        "routed_scaling_factor": cfg.moe_routed_scaling_factor,
        "num_nextn_predict_layers": cfg.mtp_layers} | write_rope(cfg)


def _names(cfg: ModelConfig) -> dict[str, str]:
    """Colonnade key -> HF name (every tensor but the stacked experts)."""
    out = {"embedding.word.weight": "model.embed_tokens.weight",
           "final_norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        out["head.weight"] = "lm_head.weight"
    attn = {"kv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b": "kv_b_proj",
            "o": "o_proj"}
    attn |= ({"q": "q_proj"} if cfg.mla_q_lora_rank is None else
             {"q_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b": "q_b_proj"})
    for k in range(cfg.mtp_layers):
        ours, theirs = f"mtp.{k}", f"model.layers.{cfg.num_layers + k}"
        for o, t in _MTP:
            out[f"{ours}.{o}.weight"] = f"{theirs}.{t}.weight"
    for i in range(cfg.num_layers + cfg.mtp_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        out[f"{ours}.attn_norm.weight"] = f"{theirs}.input_layernorm.weight"
        out[f"{ours}.mlp_norm.weight"] = f"{theirs}.post_attention_layernorm.weight"
        for o, t in attn.items():
            out[f"{ours}.attn.{o}.weight"] = f"{theirs}.self_attn.{t}.weight"
        if not cfg.is_moe_layer(i):
            for o, t in _SWIGLU:
                out[f"{ours}.mlp.{o}.weight"] = f"{theirs}.mlp.{t}.weight"
            continue
        out[f"{ours}.mlp.router.weight"] = f"{theirs}.mlp.gate.weight"
        out[f"{ours}.mlp.router.expert_bias"] = f"{theirs}.mlp.gate.e_score_correction_bias"
        for o, t in _SWIGLU:
            out[f"{ours}.mlp.shared.{o}.weight"] = f"{theirs}.mlp.shared_experts.{t}.weight"
    return out


def refs(cfg: ModelConfig) -> dict[str, HFRef]:
    """Colonnade key -> where its values are in the HF tensors."""
    out = {ours: HFRef(theirs) for ours, theirs in _names(cfg).items()}
    for i in range(cfg.num_layers + cfg.mtp_layers):
        if cfg.is_moe_layer(i):
            for o, t in _SWIGLU:
                out[f"layers.{i}.mlp.experts.{o}"] = HFRef(
                    f"model.layers.{i}.mlp.experts.{{j}}.{t}.weight", experts=cfg.num_experts)
    return out


DEEPSEEK_V3 = HFFormat("DeepseekV3ForCausalLM", read_config, write_config, refs,
                       lambda cfg, full: refs_to_hf(refs(cfg), full), fit)
"""The DeepSeek-V3 HF form."""
