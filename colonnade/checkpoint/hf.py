"""Hugging Face interop: ``LlamaForCausalLM`` and ``GPT2LMHeadModel`` directories.

An HF directory holds ``config.json``, ``model.safetensors`` (or an index + shards) and
tokenizer files. The mapping to Colonnade's global names is pure renaming, except:

* GPT-2 uses ``Conv1D`` layers whose weights are stored [in, out], the transpose of
  ``nn.Linear``'s [out, in]: every c_attn / c_proj / c_fc weight is transposed, and the fused
  ``c_attn`` [h, 3h] (bias [3h]) is split into q, k, v along its output columns;
* Llama in HF rotates with ``rotate_half`` (pairs (x_i, x_{i+d/2})), the same half-split
  convention as :func:`colonnade.models.blocks.apply_rope`, so q / k need no permutation (the
  interleaved-to-half permutation only applies to Meta's original checkpoints, which HF's own
  conversion script already undid);
* a tied head (``tie_word_embeddings``) is not stored in HF files; Colonnade stores it once as
  ``embedding.word.weight`` too.

Loading an HF directory into any parallel layout: :func:`load_hf_into_chunks` reads, for each
of this rank's parameters, only the box of its tp shard (:class:`HFRef` says where that box
lies in the HF tensor), one slice at a time.
Writing one (config.json, generation config, tokenizer with special tokens, dtype) is
:mod:`colonnade.hf_export`, which uses :func:`hf_config_from_model` and :func:`to_hf_state`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from colonnade.checkpoint.format import CheckpointError
from colonnade.checkpoint.pieces import Box, pad_to_local
from colonnade.config.sections import ModelConfig
from colonnade.models.params import unique_params
from colonnade.parallel.groups import ProcessGroups
from colonnade.tensor_parallel.sharding import tp_coords

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt")


def is_hf_dir(path: str | Path) -> bool:
    """An HF model directory: config.json naming an architecture."""
    cfg = Path(path) / "config.json"
    return cfg.exists() and "architectures" in json.loads(cfg.read_text())


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig of an HF config.json (Llama or GPT-2); rejects what Colonnade cannot run."""
    arch = (hf.get("architectures") or [""])[0]
    if arch == "LlamaForCausalLM":
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"config.json: rope_type={rope.get('rope_type')!r} is not "
                             "supported (only default RoPE)")
        if hf.get("attention_bias", False) != hf.get("mlp_bias", False):
            raise ValueError("config.json: attention_bias != mlp_bias; Colonnade has one "
                             "model.bias switch for every linear layer")
        h, a = hf["hidden_size"], hf["num_attention_heads"]
        if hf.get("head_dim") not in (None, h // a):
            raise ValueError(f"config.json: head_dim={hf['head_dim']} != hidden_size / heads")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r}; llama needs silu")
        return ModelConfig(
            arch="llama", num_layers=hf["num_hidden_layers"], hidden_size=h, num_heads=a,
            num_kv_heads=hf.get("num_key_value_heads") or a,
            ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
            max_seq_len=hf["max_position_embeddings"],
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            norm_eps=hf["rms_norm_eps"], tie_embeddings=bool(hf.get("tie_word_embeddings")),
            bias=bool(hf.get("attention_bias", False)), init_std=hf.get("initializer_range",
                                                                        0.02))
    if arch == "GPT2LMHeadModel":
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
    raise ValueError(f"config.json: architecture {arch!r} is not supported (LlamaForCausalLM "
                     "or GPT2LMHeadModel)")


def hf_config_from_model(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """config.json contents for a ModelConfig; ``dtype`` (e.g. 'bfloat16') is written as
    ``dtype`` and as ``torch_dtype``, the key older transformers releases read."""
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "initializer_range": cfg.init_std, "dtype": dtype, "torch_dtype": dtype}
    if cfg.arch == "llama":
        return {**common, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
                "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
                "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
                "hidden_act": "silu", "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
                "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
                "rope_theta": cfg.rope_theta}
    if not cfg.bias:
        raise ValueError("gpt2 export needs model.bias=true (GPT2LMHeadModel has biases)")
    return {**common, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
            "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
            "n_inner": cfg.ffn_size, "n_positions": cfg.max_seq_len,
            "layer_norm_epsilon": cfg.norm_eps, "activation_function": "gelu_new",
            "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0}


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


@dataclass(frozen=True)
class HFRef:
    """Where a Colonnade tensor lives in an HF file: tensor ``name``, stored transposed
    (GPT-2's Conv1D [in, out]), as block ``block`` of ``blocks`` equal blocks along the stored
    last dim (q, k, v of GPT-2's fused c_attn [h, 3h] and its bias [3h])."""

    name: str
    transpose: bool = False
    block: int = 0
    blocks: int = 1

    def our_shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
        """Our full shape for the HF tensor's shape ``stored``."""
        shape = list(stored)
        shape[-1] //= self.blocks
        return tuple(reversed(shape)) if self.transpose else tuple(shape)


def hf_refs(cfg: ModelConfig) -> dict[str, HFRef]:
    """Colonnade key -> where its values are in the HF checkpoint (see :class:`HFRef`)."""
    if cfg.arch == "llama":
        return {ours: HFRef(theirs) for ours, theirs in _llama_names(cfg).items()}
    out = {"embedding.word.weight": HFRef("transformer.wte.weight"),
           "embedding.position.weight": HFRef("transformer.wpe.weight"),
           "final_norm.weight": HFRef("transformer.ln_f.weight"),
           "final_norm.bias": HFRef("transformer.ln_f.bias")}
    if not cfg.tie_embeddings:
        out["head.weight"] = HFRef("lm_head.weight")
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        for o, t in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[f"{ours}.{o}.weight"] = HFRef(f"{theirs}.{t}.weight")
            out[f"{ours}.{o}.bias"] = HFRef(f"{theirs}.{t}.bias")
        for j, name in enumerate("qkv"):
            out[f"{ours}.attn.{name}.weight"] = HFRef(f"{theirs}.attn.c_attn.weight", True, j, 3)
            out[f"{ours}.attn.{name}.bias"] = HFRef(f"{theirs}.attn.c_attn.bias", False, j, 3)
        for o, t in (("attn.o", "attn.c_proj"), ("mlp.up", "mlp.c_fc"),
                     ("mlp.down", "mlp.c_proj")):
            out[f"{ours}.{o}.weight"] = HFRef(f"{theirs}.{t}.weight", True)
            out[f"{ours}.{o}.bias"] = HFRef(f"{theirs}.{t}.bias")
    return out


def hf_slice(ref: HFRef, box: Box, stored: tuple[int, ...]) -> tuple[slice, ...]:
    """Index into the HF tensor (shape ``stored``) of box ``box`` of our tensor."""
    offsets, shape = box
    if ref.transpose:
        offsets, shape = offsets[::-1], shape[::-1]
    out = [slice(o, o + n) for o, n in zip(offsets, shape, strict=True)]
    shift = ref.block * (stored[-1] // ref.blocks)
    out[-1] = slice(out[-1].start + shift, out[-1].stop + shift)
    return tuple(out)


def take_box(get: Callable[[str, tuple[slice, ...]], torch.Tensor],
             shape_of: Callable[[str], tuple[int, ...]], ref: HFRef, box: Box) -> torch.Tensor:
    """Box ``box`` of our tensor, read as one slice of the HF tensor through ``get``."""
    values = get(ref.name, hf_slice(ref, box, shape_of(ref.name)))
    return values.t().contiguous() if ref.transpose else values


def from_hf_state(cfg: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full Colonnade tensors from an HF state dict."""
    def get(name: str, index: tuple[slice, ...]) -> torch.Tensor:
        return _take(hf, name)[index].clone()

    def shape_of(name: str) -> tuple[int, ...]:
        return tuple(_take(hf, name).shape)

    out = {}
    for ours, ref in hf_refs(cfg).items():
        full = ref.our_shape(shape_of(ref.name))
        out[ours] = take_box(get, shape_of, ref, ((0,) * len(full), full))
    return out


def to_hf_state(cfg: ModelConfig, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF state dict from full Colonnade tensors (inverse of :func:`from_hf_state`)."""
    if cfg.arch == "llama":
        return {theirs: full[ours].contiguous() for ours, theirs in _llama_names(cfg).items()}
    out = {"transformer.wte.weight": full["embedding.word.weight"],
           "transformer.wpe.weight": full["embedding.position.weight"],
           "transformer.ln_f.weight": full["final_norm.weight"],
           "transformer.ln_f.bias": full["final_norm.bias"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = full["head.weight"]
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        for o, t in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            out[f"{theirs}.{t}.weight"] = full[f"{ours}.{o}.weight"]
            out[f"{theirs}.{t}.bias"] = full[f"{ours}.{o}.bias"]
        out[f"{theirs}.attn.c_attn.weight"] = torch.cat(
            [full[f"{ours}.attn.{n}.weight"].t() for n in "qkv"], dim=1)  # [h, 3h]
        out[f"{theirs}.attn.c_attn.bias"] = torch.cat([full[f"{ours}.attn.{n}.bias"]
                                                       for n in "qkv"])
        for o, t in (("attn.o", "attn.c_proj"), ("mlp.up", "mlp.c_fc"),
                     ("mlp.down", "mlp.c_proj")):
            out[f"{theirs}.{t}.weight"] = full[f"{ours}.{o}.weight"].t()
            out[f"{theirs}.{t}.bias"] = full[f"{ours}.{o}.bias"]
    return {k: v.contiguous() for k, v in out.items()}


def _take(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise CheckpointError(f"HF checkpoint has no tensor '{name}'")
    return hf[name]


def _shard_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no model*.safetensors (pickled .bin checkpoints "
                              "are not loaded; re-save with safe_serialization=True)")
    return files


def _hf_config(directory: Path) -> ModelConfig:
    if not is_hf_dir(directory):
        raise CheckpointError(f"{directory}/config.json missing or without 'architectures': "
                              "not a Hugging Face model directory")
    return model_config_from_hf(json.loads((directory / "config.json").read_text()))


def read_hf(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """ModelConfig and full Colonnade tensors of an HF directory (safetensors only); for one
    process that needs the whole model (conversion, ``generate``)."""
    directory = Path(directory)
    cfg = _hf_config(directory)
    hf: dict[str, torch.Tensor] = {}
    for f in _shard_files(directory):
        try:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                    hf[name] = handle.get_tensor(name)
        except Exception as err:
            raise CheckpointError(f"{f}: cannot read ({err}); truncated or corrupted") from err
    return cfg, from_hf_state(cfg, hf)


class HFReader:
    """An HF directory's safetensors shards, read one slice of one tensor at a time.

    Opening reads only each file's header (names, shapes); :meth:`read` takes just the slice
    asked for (``get_slice``). ``bytes_read`` counts the tensor bytes taken.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.config = _hf_config(self.directory)
        self.bytes_read = 0
        self._where: dict[str, tuple[Path, Any]] = {}
        for f in _shard_files(self.directory):
            try:
                handle = safe_open(str(f), framework="pt")
                names = list(handle.keys())
            except Exception as err:
                raise CheckpointError(f"{f}: cannot read ({err}); truncated or "
                                      "corrupted") from err
            for name in names:
                self._where[name] = (f, handle)

    def _locate(self, name: str) -> tuple[Path, Any]:
        if name not in self._where:
            raise CheckpointError(f"HF checkpoint {self.directory} has no tensor '{name}'")
        return self._where[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of HF tensor ``name`` (from the file header)."""
        _, handle = self._locate(name)
        return tuple(handle.get_slice(name).get_shape())

    def read(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """Elements ``index`` of HF tensor ``name``, and nothing else."""
        path, handle = self._locate(name)
        try:
            t = handle.get_slice(name)[index]
        except Exception as err:
            raise CheckpointError(f"{path}: cannot read '{name}' ({err}); truncated or "
                                  "corrupted") from err
        self.bytes_read += t.numel() * t.element_size()
        return t

    def close(self) -> None:
        """Drop the file handles."""
        self._where.clear()


def load_hf_into_chunks(chunks: list[nn.Module], groups: ProcessGroups,
                        directory: str | Path) -> int:
    """Load an HF directory into this rank's chunks (any layout), checking every shape.

    Reads only this rank's parameters (its pipeline stage's layers) and of each only the box of
    its tp shard, one tensor slice at a time: a tp x pp rank reads about 1/(tp pp) of the file.
    Returns the bytes read.
    """
    reader = HFReader(directory)
    refs = hf_refs(reader.config)
    coords = tp_coords(groups.tp.rank, groups.tp.size)
    for p in unique_params(chunks):
        s = p.sharding  # type: ignore[attr-defined]
        key = s.key
        if key not in refs:
            raise CheckpointError(f"{directory}: tensor '{key}' missing")
        ref = refs[key]
        theirs = ref.our_shape(reader.shape(ref.name))
        if theirs != s.full_shape:
            raise CheckpointError(f"{directory}: tensor '{key}' has shape {theirs} but the "
                                  f"model expects {s.full_shape}; the [model] config does not "
                                  "match the checkpoint")
        box = s.box(coords)
        if 0 in box[1]:
            value = torch.zeros(s.local_shape(coords), dtype=p.dtype)
        else:
            value = pad_to_local(take_box(reader.read, reader.shape, ref, box).to(p.dtype), s,
                                 coords)
        with torch.no_grad():
            p.copy_(value.to(p.device))
    reader.close()
    return reader.bytes_read
