"""How each architecture is stored in Hugging Face form: one :class:`HFFormat` per ``model.arch``.

A format names the HF class (``config.json``'s ``architectures``), reads and writes the
config.json fields of that class, and maps every Colonnade key to where its values lie in the
HF tensors (:class:`HFRef`). :mod:`colonnade.checkpoint.hf` dispatches through
:data:`HF_FORMATS` and never looks at the architecture's name; a new architecture with an HF
counterpart adds one entry here.

* Llama: pure renames; HF rotates with ``rotate_half`` (pairs (x_i, x_{i+d/2})), the same
  half-split convention as :func:`colonnade.models.blocks.apply_rope`, so q / k need no
  permutation.
* GPT-2: ``Conv1D`` weights are stored [in, out], the transpose of ``nn.Linear``'s [out, in]:
  every c_attn / c_proj / c_fc weight is transposed, and the fused ``c_attn`` [h, 3h]
  (bias [3h]) is split into q, k, v along its output columns.
* Mistral: Llama's names and config; ``sliding_window`` on every layer. Qwen2: Llama's names
  plus q/k/v biases (``qkv_bias_names``, model.qkv_bias); ``use_sliding_window`` with
  ``max_window_layers`` / ``layer_types``. Their window fields: :mod:`~colonnade.checkpoint.
  hf_window` (``HFFormat.window``); their MoE classes (Mixtral, Qwen2-MoE):
  :mod:`colonnade.checkpoint.hf_moe`.
* Qwen3: Llama's names plus ``self_attn.q_norm`` / ``k_norm`` [head_dim] (our
  ``attn.q_norm`` / ``attn.k_norm``, :mod:`colonnade.models.qk_norm`); no biases; an explicit
  ``head_dim`` (model.head_dim); sliding windows as Qwen2's (``use_sliding_window``,
  ``max_window_layers`` / ``layer_types``). Qwen3-MoE is in :mod:`colonnade.checkpoint.hf_moe`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from colonnade.checkpoint.hf_rope import read_rope, write_rope
from colonnade.checkpoint.hf_window import EVERY_LAYER, FROM_K
from colonnade.config.sections import ModelConfig


@dataclass(frozen=True)
class HFRef:
    """Where a Colonnade tensor lives in an HF file: tensor ``name``, stored transposed (its
    last two dims swapped: GPT-2's Conv1D [in, out], gpt-oss's experts [E, in, out]), as block
    ``block`` of ``blocks`` equal blocks along the stored last dim (q, k, v of GPT-2's fused
    c_attn [h, 3h] and its bias [3h]), contiguous or, with ``interleave``, strided."""

    name: str
    transpose: bool = False
    block: int = 0
    blocks: int = 1
    experts: int = 0
    """Stacked experts: our tensor [E, ...] is ``experts`` HF tensors, expert j's [...] named
    ``name.format(j=j)`` (Mixtral's ``experts.{j}.w1``); 0: one HF tensor."""
    expert: int | None = None
    """This HF tensor holds expert ``expert``'s slice (our dim 0) of a stacked tensor
    (:meth:`per_expert` makes these; the export side)."""
    interleave: bool = False
    """Block ``block`` is the stored last dim's elements block, block + blocks, ... (a stride
    of ``blocks``: gpt-oss's gate_up_proj [E, h, 2f], gate = [..., 0::2], up = [..., 1::2]);
    False: the block-th contiguous run."""

    def tensor_name(self, j: int = 0) -> str:
        """The HF tensor holding (expert ``j`` of) our values."""
        return self.name.format(j=j) if self.experts else self.name

    def our_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """Our full shape for the HF tensor's shape ``stored`` (one expert's when stacked)."""
        shape = list(stored)
        shape[-1] //= self.blocks
        ours = swap_last(tuple(shape)) if self.transpose else tuple(shape)
        return (self.experts, *ours) if self.experts else ours

    def per_expert(self) -> list[HFRef]:
        """One ref per HF tensor: expert j's slice for a stacked ref, else ``[self]``."""
        if not self.experts:
            return [self]
        return [HFRef(self.name.format(j=j), self.transpose, self.block, self.blocks, 0, j,
                      self.interleave) for j in range(self.experts)]


def swap_last(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` (or offsets) with its last two entries swapped: a stored transpose."""
    return (*shape[:-2], shape[-1], shape[-2])


@dataclass(frozen=True)
class HFFormat:
    """One architecture's HF form."""

    hf_class: str
    """``architectures[0]`` of config.json, e.g. 'LlamaForCausalLM'."""
    read_config: Callable[[dict[str, Any]], ModelConfig]
    """config.json -> ModelConfig (rejects what Colonnade cannot run)."""
    write_config: Callable[[ModelConfig], dict[str, Any]]
    """ModelConfig -> the class-specific config.json fields."""
    refs: Callable[[ModelConfig], dict[str, HFRef]]
    """Colonnade key -> where its values are in the HF tensors."""
    to_hf: Callable[[ModelConfig, dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    """Full Colonnade tensors -> the HF state dict (inverse of reading through ``refs``)."""
    fit: Callable[[ModelConfig, set[str]], ModelConfig] | None = None
    """The config read, adjusted to the tensors the folder holds (their names), or None:
    DeepSeek-V3's num_nextn_predict_layers counts modules that transformers never saves."""
    window: str | None = None
    """Which layers the class's sliding window covers, one of the rules of
    :mod:`colonnade.checkpoint.hf_window` (config.json's window fields are read and written
    by :mod:`colonnade.checkpoint.hf` through it); None: the class has no sliding-window
    attention, and a model with model.sliding_window is refused on export."""


def refs_to_hf(refs: dict[str, HFRef], full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state dict of full tensors for refs without blocks or transposes (renames, and a
    stacked tensor's expert j as its own tensor)."""
    out = {}
    for ours, ref in refs.items():
        for sub in ref.per_expert():
            value = full[ours] if sub.expert is None else full[ours][sub.expert]
            out[sub.name] = value.contiguous()
    return out


# ----------------------------------------------------------------------------- llama


def _llama_read(hf: dict[str, Any]) -> ModelConfig:
    rope = read_rope(hf)  # refuses a rope setting it does not understand
    if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
        raise ValueError("config.json: attention_bias != mlp_bias; Colonnade has one "
                         "model.bias switch for every linear layer")
    h, a = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim")
    if head_dim == h // a and h % a == 0:
        head_dim = None  # the default: model.head_dim unset
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r}; llama needs silu")
    return ModelConfig(
        arch="llama", num_layers=hf["num_hidden_layers"], hidden_size=h, num_heads=a,
        num_kv_heads=hf.get("num_key_value_heads") or a, head_dim=head_dim,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        max_seq_len=hf["max_position_embeddings"], **rope,
        norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings")),
        bias=bool(hf.get("attention_bias", False)), init_std=hf.get("initializer_range", 0.02))


def _llama_write(cfg: ModelConfig) -> dict[str, Any]:
    return {"model_type": "llama", "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
            "head_dim": cfg.head_size, "max_position_embeddings": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu", "attention_bias": cfg.bias,
            "mlp_bias": cfg.bias, **write_rope(cfg)}


def _llama_names(cfg: ModelConfig) -> dict[str, str]:
    """Colonnade key -> HF name for Llama (pure renames)."""
    out = {"embedding.word.weight": "model.embed_tokens.weight",
           "final_norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        out["head.weight"] = "lm_head.weight"
    lin = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj",
           "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj",
           "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        out[f"{ours}.attn_norm.weight"] = f"{theirs}.input_layernorm.weight"
        out[f"{ours}.mlp_norm.weight"] = f"{theirs}.post_attention_layernorm.weight"
        for a, b in lin.items():
            out[f"{ours}.{a}.weight"] = f"{theirs}.{b}.weight"
            if cfg.bias:
                out[f"{ours}.{a}.bias"] = f"{theirs}.{b}.bias"
    return out


# ----------------------------------------------------------------------------- qwen3


def qwen3_refuse(hf: dict[str, Any]) -> None:
    """Refuse what Colonnade's qwen3 cannot run of a Qwen3 / Qwen3-MoE config.json (its
    window fields are read through the format's ``window`` rule)."""
    if hf.get("attention_bias"):
        raise ValueError("config.json: attention_bias=true (biases on q, k, v and o only) is "
                         "not supported for Qwen3; the released models have none")


def qwen3_norm_names(cfg: ModelConfig) -> dict[str, str]:
    """Qwen3's per-head q/k RMSNorm weights [d]: Colonnade key -> HF name."""
    return {f"layers.{i}.attn.{n}_norm.weight": f"model.layers.{i}.self_attn.{n}_norm.weight"
            for i in range(cfg.num_layers) for n in "qk"}


def qwen3_write_check(cfg: ModelConfig, hf_class: str) -> None:
    """Refuse a qwen3 model that ``hf_class`` cannot express (biases)."""
    if cfg.bias or cfg.qkv_bias:
        raise ValueError(f"cannot express as {hf_class}: model.bias / model.qkv_bias (Qwen3 "
                         "has no biases); set both false")


def _qwen3_read(hf: dict[str, Any]) -> ModelConfig:
    qwen3_refuse(hf)
    dense = _llama_read(dict(hf, attention_bias=False, mlp_bias=False))
    return dataclasses.replace(dense, arch="qwen3")


def _qwen3_write(cfg: ModelConfig) -> dict[str, Any]:
    qwen3_write_check(cfg, "Qwen3ForCausalLM")
    out = _llama_write(cfg)
    out.pop("mlp_bias")
    return out | {"model_type": "qwen3"}  # use_sliding_window, layer_types...: hf_window


def _qwen3_names(cfg: ModelConfig) -> dict[str, str]:
    """Colonnade key -> HF name for Qwen3: Llama's names and the q/k norms."""
    return _llama_names(cfg) | qwen3_norm_names(cfg)


# ----------------------------------------------------------------------------- mistral, qwen2


def _mistral_read(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("config.json: MistralForCausalLM has no biases (attention_bias / "
                         "mlp_bias set)")
    return dataclasses.replace(_llama_read(hf), arch="mistral")


def _mistral_write(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.bias or cfg.qkv_bias:
        raise ValueError("cannot express as MistralForCausalLM: model.bias / model.qkv_bias "
                         "(Mistral has no biases); set both false, or use arch qwen2 for q/k/v "
                         "biases")
    out = _llama_write(cfg)
    for k in ("attention_bias", "mlp_bias"):
        out.pop(k)
    return out | {"model_type": "mistral"}  # sliding_window: hf_window


def _qwen2_read(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("config.json: Qwen2ForCausalLM has biases on q, k, v only "
                         "(attention_bias / mlp_bias set)")
    return dataclasses.replace(_llama_read(hf), arch="qwen2", qkv_bias=True)


def _qwen2_write(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.bias or not cfg.qkv_bias:
        raise ValueError("cannot express as Qwen2ForCausalLM: it has biases on q, k and v "
                         "only; set model.qkv_bias=true and model.bias=false")
    out = _llama_write(cfg)
    for k in ("attention_bias", "mlp_bias"):
        out.pop(k)
    return out | {"model_type": "qwen2"}  # use_sliding_window, layer_types...: hf_window


def qkv_bias_names(cfg: ModelConfig) -> dict[str, str]:
    """The q, k, v biases of ``cfg.qkv_bias`` (Qwen2, Qwen2-MoE): Colonnade key -> HF name."""
    if not cfg.qkv_bias or cfg.bias:  # model.bias already names them (_llama_names)
        return {}
    return {f"layers.{i}.attn.{n}.bias": f"model.layers.{i}.self_attn.{n}_proj.bias"
            for i in range(cfg.num_layers) for n in "qkv"}


def _qwen2_names(cfg: ModelConfig) -> dict[str, str]:
    """Colonnade key -> HF name for Qwen2: Llama's names and the q/k/v biases."""
    return _llama_names(cfg) | qkv_bias_names(cfg)


# ----------------------------------------------------------------------------- gpt2

_GPT2_NORMS = (("attn_norm", "ln_1"), ("mlp_norm", "ln_2"))
_GPT2_CONV1D = (("attn.o", "attn.c_proj"), ("mlp.up", "mlp.c_fc"), ("mlp.down", "mlp.c_proj"))


def _gpt2_read(hf: dict[str, Any]) -> ModelConfig:
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"config.json: activation_function="
                         f"{hf['activation_function']!r}; Colonnade's gpt2 uses tanh GELU")
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("scale_attn_weights") is False:
        raise ValueError("config.json: non-standard GPT-2 attention scaling")
    h = hf["n_embd"]
    return ModelConfig(
        arch="gpt2", num_layers=hf["n_layer"], hidden_size=h, num_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner") or 4 * h, vocab_size=hf["vocab_size"],
        max_seq_len=hf["n_positions"], norm_eps=hf["layer_norm_epsilon"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), bias=True,
        init_std=hf.get("initializer_range", 0.02))


def _gpt2_write(cfg: ModelConfig) -> dict[str, Any]:
    if not cfg.bias:
        raise ValueError("gpt2 export needs model.bias=true (GPT2LMHeadModel has biases)")
    return {"model_type": "gpt2", "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads, "n_inner": cfg.ffn_size, "n_positions": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
            "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}


def _gpt2_refs(cfg: ModelConfig) -> dict[str, HFRef]:
    out = {"embedding.word.weight": HFRef("transformer.wte.weight"),
           "embedding.position.weight": HFRef("transformer.wpe.weight"),
           "final_norm.weight": HFRef("transformer.ln_f.weight"),
           "final_norm.bias": HFRef("transformer.ln_f.bias")}
    if not cfg.tie_embeddings:
        out["head.weight"] = HFRef("lm_head.weight")
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        for o, t in _GPT2_NORMS:
            out[f"{ours}.{o}.weight"] = HFRef(f"{theirs}.{t}.weight")
            out[f"{ours}.{o}.bias"] = HFRef(f"{theirs}.{t}.bias")
        for j, name in enumerate("qkv"):
            out[f"{ours}.attn.{name}.weight"] = HFRef(f"{theirs}.attn.c_attn.weight", True, j, 3)
            out[f"{ours}.attn.{name}.bias"] = HFRef(f"{theirs}.attn.c_attn.bias", False, j, 3)
        for o, t in _GPT2_CONV1D:
            out[f"{ours}.{o}.weight"] = HFRef(f"{theirs}.{t}.weight", True)
            out[f"{ours}.{o}.bias"] = HFRef(f"{theirs}.{t}.bias")
    return out


def _gpt2_to_hf(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {"transformer.wte.weight": full["embedding.word.weight"],
           "transformer.wpe.weight": full["embedding.position.weight"],
           "transformer.ln_f.weight": full["final_norm.weight"],
           "transformer.ln_f.bias": full["final_norm.bias"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = full["head.weight"]
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        for o, t in _GPT2_NORMS:
            out[f"{theirs}.{t}.weight"] = full[f"{ours}.{o}.weight"]
            out[f"{theirs}.{t}.bias"] = full[f"{ours}.{o}.bias"]
        out[f"{theirs}.attn.c_attn.weight"] = torch.cat(
            [full[f"{ours}.attn.{n}.weight"].t() for n in "qkv"], dim=1)  # [h, 3h]
        out[f"{theirs}.attn.c_attn.bias"] = torch.cat([full[f"{ours}.attn.{n}.bias"]
                                                       for n in "qkv"])  # [3h]
        for o, t in _GPT2_CONV1D:
            out[f"{theirs}.{t}.weight"] = full[f"{ours}.{o}.weight"].t()  # [in, out]
            out[f"{theirs}.{t}.bias"] = full[f"{ours}.{o}.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def _renames(names: Callable[[ModelConfig], dict[str, str]]) -> tuple[
        Callable[[ModelConfig], dict[str, HFRef]],
        Callable[[ModelConfig, dict[str, torch.Tensor]], dict[str, torch.Tensor]]]:
    """``refs`` and ``to_hf`` of a form whose tensors are pure renames (Colonnade key -> HF
    name by ``names``): Llama, Mistral, Qwen2, Qwen3."""
    def refs(cfg: ModelConfig) -> dict[str, HFRef]:
        return {ours: HFRef(theirs) for ours, theirs in names(cfg).items()}

    def to_hf(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return refs_to_hf(refs(cfg), full)

    return refs, to_hf


HF_FORMATS: dict[str, HFFormat] = {
    "llama": HFFormat("LlamaForCausalLM", _llama_read, _llama_write, *_renames(_llama_names)),
    "gpt2": HFFormat("GPT2LMHeadModel", _gpt2_read, _gpt2_write, _gpt2_refs, _gpt2_to_hf),
    "qwen3": HFFormat("Qwen3ForCausalLM", _qwen3_read, _qwen3_write, *_renames(_qwen3_names),
                      window=FROM_K),
    "mistral": HFFormat("MistralForCausalLM", _mistral_read, _mistral_write,
                        *_renames(_llama_names), window=EVERY_LAYER),
    "qwen2": HFFormat("Qwen2ForCausalLM", _qwen2_read, _qwen2_write, *_renames(_qwen2_names),
                      window=FROM_K),
}
"""model.arch -> its HF form (an architecture without one cannot be imported or exported)."""


def hf_format(cfg: ModelConfig) -> HFFormat:
    """The HF form of ``cfg.arch`` (dense models; :func:`colonnade.checkpoint.hf_moe.
    format_for` also knows the mixture-of-experts classes)."""
    if cfg.arch not in HF_FORMATS:
        raise ValueError(f"model.arch={cfg.arch!r} has no Hugging Face form (one of "
                         f"{list(HF_FORMATS)})")
    return HF_FORMATS[cfg.arch]
