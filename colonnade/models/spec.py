"""Layer and architecture specs: which classes a decoder is made of.

A :class:`LayerSpec` names the three classes of one transformer layer (norm, attention, MLP);
an :class:`ArchSpec` names an architecture's position encoding, its final norm and the
LayerSpec of every layer (a function of the global layer index, so a mixture-of-experts MLP
can be chosen per layer). :class:`~colonnade.models.layer.TransformerLayer` and
:class:`~colonnade.models.gpt.ModelChunk` are built from these and never look at
``model.arch``: a new architecture or MLP kind is a new class plus a spec, passed to
:func:`~colonnade.models.build.build_chunks` or registered in :data:`ARCH_SPECS`.

Constructor contracts (one each, so any class of a kind drops into a spec):

* norm:      ``(cfg, ctx, key)`` with class attribute ``has_bias`` (a bias [h] next to w [h]);
* attention: ``(cfg, ctx, key, layer)`` with ``forward(x, rope, cache, doc)``;
* mlp:       ``(cfg, ctx, key, layer)`` with class attribute ``matrices`` (h x f matrices).

``key`` is the global parameter prefix (``layers.3.mlp``), ``layer`` the global layer index.
Parameter and FLOP counters read ``has_bias`` and ``matrices`` from the spec, not the name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol, get_args

from torch import nn

from colonnade.config.choices import ARCHS
from colonnade.config.sections import ARCH_TRAITS, ModelConfig
from colonnade.models.blocks import Attention
from colonnade.models.gpt_oss import GptOssMoELayer, SinkAttention
from colonnade.models.mla import MLAttention
from colonnade.models.mlps import GeluMLP, SwiGLUMLP
from colonnade.models.norms import LayerNorm, RMSNorm
from colonnade.models.qk_norm import QKNormAttention
from colonnade.moe.layer import MoELayer
from colonnade.tensor_parallel.context import ParallelContext

Positions = Literal["rope", "learned"]
"""How token positions enter: rotary angles in attention, or a learned [S, h] table added to
the embedding."""


class NormClass(Protocol):
    """A norm class: ``cls(cfg, ctx, key)`` maps [..., h] -> [..., h]."""

    has_bias: bool

    def __call__(self, cfg: ModelConfig, ctx: ParallelContext, key: str) -> nn.Module: ...


class AttentionClass(Protocol):
    """An attention class: ``cls(cfg, ctx, key, layer)``."""

    def __call__(self, cfg: ModelConfig, ctx: ParallelContext, key: str,
                 layer: int) -> nn.Module: ...


class MLPClass(Protocol):
    """An MLP class: ``cls(cfg, ctx, key, layer)`` maps [s(/tp), b, h] -> [s(/tp), b, h]."""

    matrices: int

    def __call__(self, cfg: ModelConfig, ctx: ParallelContext, key: str,
                 layer: int) -> nn.Module: ...


@dataclass(frozen=True)
class LayerSpec:
    """The classes of one pre-norm transformer layer."""

    norm: NormClass
    """Norm before attention and before the MLP (``attn_norm``, ``mlp_norm``)."""
    attention: AttentionClass
    """Self-attention (``attn``)."""
    mlp: MLPClass
    """Feed-forward block (``mlp``)."""


@dataclass(frozen=True)
class ArchSpec:
    """A decoder architecture: positions, final norm, and each layer's classes."""

    name: str
    """Name (the ``model.arch`` value of a registered spec)."""
    positions: Positions
    """'rope' (rotary tables in every chunk, none in the embedding) or 'learned' (an
    ``embedding.position.weight`` [max_seq_len, h] table)."""
    final_norm: NormClass
    """Norm before the output head (``final_norm``)."""
    layers: LayerSpec | Callable[[int], LayerSpec]
    """Every layer's spec, or a function of the global layer index giving it."""

    def __post_init__(self) -> None:
        if self.positions not in get_args(Positions):
            raise ValueError(f"ArchSpec {self.name!r}: positions={self.positions!r} must be one "
                             f"of {get_args(Positions)}")

    def layer(self, index: int) -> LayerSpec:
        """The LayerSpec of global layer ``index``."""
        return self.layers if isinstance(self.layers, LayerSpec) else self.layers(index)

    @property
    def rope(self) -> bool:
        """Whether attention rotates q and k by position (RoPE)."""
        return self.positions == "rope"


ARCH_SPECS: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", "rope", RMSNorm, LayerSpec(RMSNorm, Attention, SwiGLUMLP)),
    "gpt2": ArchSpec("gpt2", "learned", LayerNorm, LayerSpec(LayerNorm, Attention, GeluMLP)),
    "mistral": ArchSpec("mistral", "rope", RMSNorm, LayerSpec(RMSNorm, Attention, SwiGLUMLP)),
    "qwen2": ArchSpec("qwen2", "rope", RMSNorm, LayerSpec(RMSNorm, Attention, SwiGLUMLP)),
    "qwen3": ArchSpec("qwen3", "rope", RMSNorm, LayerSpec(RMSNorm, QKNormAttention, SwiGLUMLP)),
    "deepseek_v3": ArchSpec("deepseek_v3", "rope", RMSNorm,
                            LayerSpec(RMSNorm, MLAttention, SwiGLUMLP)),
    "gpt_oss": ArchSpec("gpt_oss", "rope", RMSNorm, LayerSpec(RMSNorm, SinkAttention, SwiGLUMLP)),
}
"""The registered architectures, keyed by ``model.arch``."""


class SwiGLUMoELayer(MoELayer):
    """llama's mixture-of-experts MLP: SwiGLU experts, a SwiGLU shared expert."""

    matrices: ClassVar[int] = 3
    """h x f weight matrices per expert: gate, up, down."""
    gated: ClassVar[bool] = True
    """SwiGLU experts."""
    shared_class = SwiGLUMLP
    """The shared expert's dense MLP class."""


class GeluMoELayer(MoELayer):
    """gpt2's mixture-of-experts MLP: GELU experts (biases with ``model.bias``), a GELU shared
    expert."""

    matrices: ClassVar[int] = 2
    """h x f weight matrices per expert: up, down."""
    gated: ClassVar[bool] = False
    """GELU experts."""
    shared_class = GeluMLP
    """The shared expert's dense MLP class."""


MOE_MLPS: dict[str, MLPClass] = {"llama": SwiGLUMoELayer, "gpt2": GeluMoELayer,
                                 "mistral": SwiGLUMoELayer, "qwen2": SwiGLUMoELayer,
                                 "qwen3": SwiGLUMoELayer, "deepseek_v3": SwiGLUMoELayer,
                                 "gpt_oss": GptOssMoELayer}
"""The mixture-of-experts MLP class of each registered architecture."""


def moe_spec(dense: ArchSpec, cfg: ModelConfig) -> ArchSpec:
    """``dense`` with the MLP of every MoE layer of ``cfg`` (``cfg.is_moe_layer(i)``)
    replaced by the architecture's MoE layer (:data:`MOE_MLPS`)."""
    if dense.name not in MOE_MLPS:
        raise ValueError(f"model.arch={dense.name!r} has no mixture-of-experts layer; use one "
                         f"of {list(MOE_MLPS)} or set model.num_experts=0")
    moe_mlp = MOE_MLPS[dense.name]

    def layer(index: int) -> LayerSpec:
        base = dense.layer(index)
        if not cfg.is_moe_layer(index):
            return base
        return LayerSpec(base.norm, base.attention, moe_mlp)

    return ArchSpec(dense.name, dense.positions, dense.final_norm, layer)


def arch_spec(cfg: ModelConfig) -> ArchSpec:
    """The spec of ``cfg``: the registered spec of ``cfg.arch``, with the MoE layers of a
    mixture-of-experts model (``cfg.moe``) swapped in (:func:`moe_spec`)."""
    if cfg.arch not in ARCH_SPECS:
        raise ValueError(f"model.arch={cfg.arch!r} has no spec; use one of {list(ARCH_SPECS)}")
    dense = ARCH_SPECS[cfg.arch]
    return moe_spec(dense, cfg) if cfg.moe else dense


def _check_registry() -> None:
    """ARCH_SPECS covers config.choices.ARCHS and agrees with config's ARCH_TRAITS."""
    if set(ARCH_SPECS) != set(ARCHS) or set(ARCH_TRAITS) != set(ARCHS):  # any order
        raise AssertionError(f"models.spec.ARCH_SPECS {list(ARCH_SPECS)} and config.model."
                             f"ARCH_TRAITS {list(ARCH_TRAITS)} must map exactly "
                             f"config.choices.ARCHS {list(ARCHS)}")
    for name, spec in ARCH_SPECS.items():
        traits = ARCH_TRAITS[name]
        attention = spec.layer(0).attention
        mla = isinstance(attention, type) and issubclass(attention, MLAttention)
        clamped = getattr(MOE_MLPS.get(name), "clamped_swiglu", False)
        qk_norm = getattr(attention, "head_norms", 0) > 0
        if (spec.rope != traits.rope or (spec.layer(0).mlp.matrices == 3) != traits.gated_mlp
                or mla != traits.mla or clamped != traits.clamped_swiglu
                or qk_norm != traits.qk_norm):
            raise AssertionError(f"ARCH_SPECS[{name!r}] disagrees with ARCH_TRAITS[{name!r}]")


_check_registry()
