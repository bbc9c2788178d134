"""Hugging Face forms of mixture-of-experts models: ``MixtralForCausalLM`` (Colonnade
``arch="mistral"`` with ``model.num_experts > 0``, its ``sliding_window`` on every layer) and
``Qwen2MoeForCausalLM`` (``arch="qwen2"`` with experts; ``use_sliding_window`` with
``layer_types``); both read through :data:`MOE_BY_ARCH`. A model.arch='llama' MoE model
(checkpoints from before those archs) still exports as either, :func:`moe_format_key`
choosing.

Files are written in the per-expert layout of the Hub checkpoints (what ``save_pretrained``
writes: transformers >= 5 fuses experts in memory, ``gate_up_proj`` [E, 2f, h], and converts
back on save): expert j's SwiGLU weights are separate tensors, which our stacked tensors
[E, f, h] / [E, h, f] read and write one expert at a time (:attr:`HFRef.experts`).

* Mixtral: ``block_sparse_moe.gate`` [E, h] is our router; ``experts.{j}.w1 / w3 / w2`` are
  gate / up / down. Softmax router over all experts, top k, renormalised (norm_topk_prob);
  every layer is MoE; no shared expert, no biases.
* Qwen2-MoE: ``mlp.gate`` [E, h] is the router; ``mlp.experts.{j}.gate_proj / up_proj /
  down_proj``; a shared expert ``mlp.shared_expert.*`` (width
  shared_expert_intermediate_size) scaled by sigmoid(``mlp.shared_expert_gate`` [1, h] x);
  ``norm_topk_prob`` as configured (False in the released models); biases on q, k, v only
  (``qkv_bias``: model.qkv_bias). Layer i is MoE iff i is not in ``mlp_only_layers`` and
  (i + 1) % decoder_sparse_step == 0, which is model.moe_first_dense_layers = step - 1 and
  model.moe_layer_freq = step (a prefix of mlp_only_layers adds to the dense prefix);
  other layers are dense SwiGLU MLPs of width intermediate_size.
* Qwen3-MoE (``arch="qwen3"`` with experts, :data:`MOE_BY_ARCH`): Qwen2-MoE's router, experts
  and sparse-layer rule (``decoder_sparse_step``, ``mlp_only_layers``, ``moe_intermediate_size``,
  ``norm_topk_prob``: True in the released models), no shared expert, no biases; attention is
  Qwen3's (per-head ``q_norm`` / ``k_norm``, ``head_dim``); ``use_sliding_window`` windows
  every layer (:data:`~colonnade.checkpoint.hf_window.EVERY_LAYER_IF_USED`).

The aux loss coefficient maps to router_aux_loss_coef (HF adds it only with
output_router_logits, so a coefficient of 0 writes output_router_logits=false).
"""

from __future__ import annotations

from typing import Any

from colonnade.checkpoint.hf_archs import (
    HF_FORMATS,
    HFFormat,
    HFRef,
    _llama_names,
    _llama_read,
    _llama_write,
    qwen3_norm_names,
    qwen3_refuse,
    qwen3_write_check,
    refs_to_hf,
)
from colonnade.checkpoint.hf_deepseek import DEEPSEEK_V3
from colonnade.checkpoint.hf_gpt_oss import FORMAT as GPT_OSS
from colonnade.checkpoint.hf_rope import ROPE_FIELDS
from colonnade.checkpoint.hf_window import EVEN_BELOW_K, EVERY_LAYER, EVERY_LAYER_IF_USED
from colonnade.config.sections import ModelConfig

MIXTRAL, QWEN2_MOE, QWEN3_MOE = "mixtral", "qwen2_moe", "qwen3_moe"
"""Keys of :data:`MOE_FORMATS`."""

_SWIGLU = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))
_MIXTRAL_EXPERT = (("gate", "w1"), ("up", "w3"), ("down", "w2"))


def _common_read(hf: dict[str, Any], key: str) -> dict[str, Any]:
    """Llama-like fields of an MoE config.json as ModelConfig keyword arguments."""
    if hf.get("router_jitter_noise"):
        raise ValueError("config.json: router_jitter_noise != 0 is not supported")
    dense = _llama_read(dict(hf, attention_bias=False, mlp_bias=False))
    coeff = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
    return {f: getattr(dense, f) for f in (
        "arch", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
        "vocab_size", "max_seq_len", *ROPE_FIELDS, "norm_eps", "tie_embeddings", "init_std")} | {
        "moe_top_k": hf["num_experts_per_tok"], "moe_router": "softmax",
        "moe_aux_loss_coeff": coeff, "moe_aux_loss_type": "global"}


def _mixtral_read(hf: dict[str, Any]) -> ModelConfig:
    f = hf["intermediate_size"]
    return ModelConfig(**(_common_read(hf, MIXTRAL) | {"arch": "mistral"}), ffn_hidden_size=f,
                       num_experts=hf["num_local_experts"], moe_ffn_hidden_size=f,
                       moe_norm_topk_prob=True)


def _qwen_layers(hf: dict[str, Any]) -> tuple[int, int]:
    """(moe_first_dense_layers, moe_layer_freq) giving Qwen2-MoE's sparse layers, or raise."""
    n, step = hf["num_hidden_layers"], int(hf.get("decoder_sparse_step", 1))
    only = set(hf.get("mlp_only_layers") or [])
    sparse = [i not in only and (i + 1) % step == 0 for i in range(n)]
    first = next((i for i, s in enumerate(sparse) if s), n)
    cfg = ModelConfig(num_layers=n, num_experts=1, moe_first_dense_layers=first,
                      moe_layer_freq=step)
    if [cfg.is_moe_layer(i) for i in range(n)] != sparse:
        raise ValueError(f"config.json: mlp_only_layers={sorted(only)} with "
                         f"decoder_sparse_step={step} is not a dense prefix plus every "
                         "step-th layer (model.moe_first_dense_layers, moe_layer_freq)")
    return first, step


def _qwen_read(hf: dict[str, Any]) -> ModelConfig:
    if not hf.get("shared_expert_intermediate_size"):
        raise ValueError("config.json: Qwen2-MoE without a shared expert is not supported")
    first, freq = _qwen_layers(hf)
    return ModelConfig(**(_common_read(hf, QWEN2_MOE) | {"arch": "qwen2"}),
                       ffn_hidden_size=hf["intermediate_size"],
                       qkv_bias=bool(hf.get("qkv_bias", True)), num_experts=hf["num_experts"],
                       moe_ffn_hidden_size=hf["moe_intermediate_size"],
                       moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       moe_layer_freq=freq, moe_first_dense_layers=first,
                       moe_shared_expert_ffn_hidden_size=hf["shared_expert_intermediate_size"],
                       moe_shared_expert_gate=True)


def _common_write(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    out = _llama_write(cfg)
    for k in ("attention_bias", "mlp_bias"):
        out.pop(k)
    return out | {"model_type": model_type, "num_experts_per_tok": cfg.moe_top_k,
                  "output_router_logits": cfg.moe_aux_loss_coeff > 0,
                  "router_aux_loss_coef": cfg.moe_aux_loss_coeff}


def _mixtral_write(cfg: ModelConfig) -> dict[str, Any]:
    _mixtral_check(cfg)
    return _common_write(cfg, "mixtral") | {
        "intermediate_size": cfg.expert_ffn_size, "num_local_experts": cfg.num_experts,
        "sliding_window": None, "router_jitter_noise": 0.0}


def _qwen_write(cfg: ModelConfig) -> dict[str, Any]:
    out = _common_write(cfg, "qwen2_moe") | {
        "intermediate_size": cfg.ffn_size, "moe_intermediate_size": cfg.expert_ffn_size,
        "num_experts": cfg.num_experts, "norm_topk_prob": cfg.moe_norm_topk_prob,
        "shared_expert_intermediate_size": cfg.moe_shared_expert_ffn_hidden_size,
        "decoder_sparse_step": cfg.moe_layer_freq,
        "mlp_only_layers": [i for i in range(cfg.moe_first_dense_layers)
                            if (i + 1) % cfg.moe_layer_freq == 0],
        "qkv_bias": cfg.qkv_bias, "use_sliding_window": False}
    if _qwen_layers(out | {"num_hidden_layers": cfg.num_layers}) != (
            cfg.moe_first_dense_layers, cfg.moe_layer_freq):
        raise ValueError(f"cannot express as qwen2_moe: MoE layers every moe_layer_freq="
                         f"{cfg.moe_layer_freq} after moe_first_dense_layers="
                         f"{cfg.moe_first_dense_layers}; Qwen2-MoE's sparse layers are those "
                         "with (i + 1) % step == 0 (first dense layers = step - 1 + k step)")
    return out


def _qwen3_moe_read(hf: dict[str, Any]) -> ModelConfig:
    qwen3_refuse(hf)
    first, freq = _qwen_layers(hf)
    experts = hf.get("num_experts", hf.get("num_local_experts"))  # Hub's / transformers 5's
    if not experts:
        raise ValueError("config.json: Qwen3-MoE without num_experts (num_local_experts)")
    return ModelConfig(**(_common_read(hf, QWEN3_MOE) | {"arch": "qwen3"}),
                       ffn_hidden_size=hf["intermediate_size"], num_experts=experts,
                       moe_ffn_hidden_size=hf["moe_intermediate_size"],
                       moe_norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       moe_layer_freq=freq, moe_first_dense_layers=first)


def _qwen3_moe_write(cfg: ModelConfig) -> dict[str, Any]:
    qwen3_write_check(cfg, "Qwen3MoeForCausalLM")
    if cfg.moe_shared_expert_ffn_hidden_size:
        raise ValueError("cannot express as Qwen3MoeForCausalLM: "
                         "model.moe_shared_expert_ffn_hidden_size > 0 (Qwen3-MoE has no shared "
                         "expert); set it to 0")
    _check(cfg, QWEN3_MOE)
    out = _qwen_write(cfg)
    for k in ("shared_expert_intermediate_size", "qkv_bias"):
        out.pop(k)
    return out | {"model_type": "qwen3_moe", "attention_bias": False}  # window: hf_window


def _qwen3_moe_refs(cfg: ModelConfig) -> dict[str, HFRef]:
    return (_attention_refs(cfg) | {ours: HFRef(theirs)
                                    for ours, theirs in qwen3_norm_names(cfg).items()}
            | _routed_refs(cfg, "mlp", _SWIGLU))


def _attention_refs(cfg: ModelConfig) -> dict[str, HFRef]:
    """Embedding, norms, attention (+ q/k/v biases with qkv_bias), head and, for dense layers,
    the llama MLP: Llama's names."""
    names = _llama_names(cfg)
    out = {}
    for ours, theirs in names.items():
        moe_mlp = ".mlp." in ours and cfg.is_moe_layer(int(ours.split(".")[1]))
        if not moe_mlp:
            out[ours] = HFRef(theirs)
    if cfg.qkv_bias:
        for i in range(cfg.num_layers):
            for n in "qkv":
                out[f"layers.{i}.attn.{n}.bias"] = HFRef(
                    f"model.layers.{i}.self_attn.{n}_proj.bias")
    return out


def _mixtral_refs(cfg: ModelConfig) -> dict[str, HFRef]:
    return _attention_refs(cfg) | _routed_refs(cfg, "block_sparse_moe", _MIXTRAL_EXPERT)


def _routed_refs(cfg: ModelConfig, block: str,
                 experts: tuple[tuple[str, str], ...]) -> dict[str, HFRef]:
    """Router and stacked routed experts of every MoE layer i, HF module
    ``model.layers.{i}.{block}``: ``gate`` [E, h] and expert j's ``experts.{j}.<name>``
    (``experts``: our matrix -> its HF name)."""
    out = {}
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        ours, theirs = f"layers.{i}.mlp", f"model.layers.{i}.{block}"
        out[f"{ours}.router.weight"] = HFRef(f"{theirs}.gate.weight")
        for o, t in experts:
            out[f"{ours}.experts.{o}"] = HFRef(f"{theirs}.experts.{{j}}.{t}.weight",
                                               experts=cfg.num_experts)
    return out


def _qwen_refs(cfg: ModelConfig) -> dict[str, HFRef]:
    out = _attention_refs(cfg) | _routed_refs(cfg, "mlp", _SWIGLU)
    for i in range(cfg.num_layers):
        if not cfg.is_moe_layer(i):
            continue
        ours, theirs = f"layers.{i}.mlp", f"model.layers.{i}.mlp"
        out[f"{ours}.shared_gate.weight"] = HFRef(f"{theirs}.shared_expert_gate.weight")
        for o, t in _SWIGLU:
            out[f"{ours}.shared.{o}.weight"] = HFRef(f"{theirs}.shared_expert.{t}.weight")
    return out


def _check(cfg: ModelConfig, key: str) -> None:
    """Refuse what the HF class cannot express."""
    problems = []
    if cfg.bias:
        problems.append("model.bias=true (no HF MoE class has biases on every linear)")
    if cfg.moe_router != "softmax":
        problems.append(f"model.moe_router={cfg.moe_router!r} (both HF classes use softmax)")
    if cfg.moe_capacity_factor is not None:
        problems.append("model.moe_capacity_factor (HF MoE classes are dropless)")
    if key == MIXTRAL and cfg.qkv_bias:
        problems.append("model.qkv_bias=true (Mixtral has no attention biases)")
    if problems:
        raise ValueError(f"cannot express as {key}: " + "; ".join(problems))


def _qwen2_moe_check(cfg: ModelConfig) -> None:
    """Refuse what Qwen2MoeForCausalLM cannot express (it needs a gated shared expert)."""
    if not cfg.moe_shared_expert_gate or not cfg.moe_shared_expert_ffn_hidden_size:
        raise ValueError("Qwen2-MoE needs a gated shared expert (model."
                         "moe_shared_expert_ffn_hidden_size > 0, moe_shared_expert_gate)")
    _check(cfg, QWEN2_MOE)


def _qwen2_moe_write(cfg: ModelConfig) -> dict[str, Any]:
    _qwen2_moe_check(cfg)
    return _qwen_write(cfg)


def _mixtral_check(cfg: ModelConfig) -> None:
    """Refuse what MixtralForCausalLM cannot express."""
    if (cfg.moe_first_dense_layers or cfg.moe_layer_freq != 1 or not cfg.moe_norm_topk_prob
            or cfg.moe_shared_expert_ffn_hidden_size):
        raise ValueError("Mixtral needs every layer MoE (moe_first_dense_layers=0, "
                         "moe_layer_freq=1), moe_norm_topk_prob=true and no shared expert "
                         "(a gated shared expert is Qwen2-MoE: model.arch='qwen2')")
    _check(cfg, MIXTRAL)


def moe_format_key(cfg: ModelConfig) -> str:
    """Which HF MoE class a model.arch='llama' MoE model (checkpoints from before arch
    'mistral' and 'qwen2') is: Qwen2-MoE with a gated shared expert (or q/k/v biases), Mixtral
    when every layer is MoE and the top k are renormalised."""
    traits = cfg.traits
    if traits is None or not (traits.rope and traits.gated_mlp):  # RoPE + SwiGLU experts
        raise ValueError(f"model.arch={cfg.arch!r} with experts has no Hugging Face form "
                         "(Mixtral and Qwen2-MoE are llama-like: RoPE, SwiGLU experts)")
    if cfg.moe_shared_expert_ffn_hidden_size or cfg.qkv_bias:
        _qwen2_moe_check(cfg)
        return QWEN2_MOE
    _mixtral_check(cfg)
    return MIXTRAL


MOE_FORMATS: dict[str, HFFormat] = {
    MIXTRAL: HFFormat("MixtralForCausalLM", _mixtral_read, _mixtral_write, _mixtral_refs,
                      lambda cfg, full: refs_to_hf(_mixtral_refs(cfg), full),
                      window=EVERY_LAYER),
    QWEN2_MOE: HFFormat("Qwen2MoeForCausalLM", _qwen_read, _qwen2_moe_write, _qwen_refs,
                        lambda cfg, full: refs_to_hf(_qwen_refs(cfg), full),
                        window=EVEN_BELOW_K),
    QWEN3_MOE: HFFormat("Qwen3MoeForCausalLM", _qwen3_moe_read, _qwen3_moe_write,
                        _qwen3_moe_refs, lambda cfg, full: refs_to_hf(_qwen3_moe_refs(cfg), full),
                        window=EVERY_LAYER_IF_USED),
}
"""The mixture-of-experts HF forms (llama-like, :func:`moe_format_key` picks one)."""

MOE_BY_ARCH: dict[str, str] = {"qwen3": QWEN3_MOE, "mistral": MIXTRAL, "qwen2": QWEN2_MOE}
"""model.arch -> the key in :data:`MOE_FORMATS` of its models with experts (its models without
are :data:`~colonnade.checkpoint.hf_archs.HF_FORMATS`'); arch llama's MoE class is chosen by
:func:`moe_format_key`."""

FAMILY_FORMATS: dict[str, HFFormat] = {"deepseek_v3": DEEPSEEK_V3, "gpt_oss": GPT_OSS}
"""model.arch -> its one HF form, with or without experts (DeepseekV3ForCausalLM's first
layers are dense, the rest MoE; GptOssForCausalLM is MoE in every layer)."""

ALL_FORMATS: dict[str, HFFormat] = {**HF_FORMATS, **MOE_FORMATS, **FAMILY_FORMATS}
"""Every HF form Colonnade reads and writes."""


def format_for(cfg: ModelConfig) -> HFFormat:
    """The HF form of ``cfg``: its architecture's, or the MoE class it matches."""
    if cfg.arch in FAMILY_FORMATS:
        return FAMILY_FORMATS[cfg.arch]
    if cfg.arch in MOE_BY_ARCH:
        return MOE_FORMATS[MOE_BY_ARCH[cfg.arch]] if cfg.moe else HF_FORMATS[cfg.arch]
    if cfg.moe or cfg.qkv_bias:
        return MOE_FORMATS[moe_format_key(cfg)]
    if cfg.arch not in HF_FORMATS:
        raise ValueError(f"model.arch={cfg.arch!r} has no Hugging Face form (one of "
                         f"{list(HF_FORMATS)})")
    return HF_FORMATS[cfg.arch]
