"""Parameter and FLOP counts of the decoder for both architectures, from ModelConfig.

Notation: l layers, h hidden size, a query heads, d = h/a head dim, h_kv = kv_heads * d,
f MLP width, V vocabulary, s sequence length, B samples per step.

Parameters of one layer
    gpt2:  attention 3h^2 + h^2 (QKV, out), MLP 2hf (fc1, fc2), biases 3h + h + f + h when
           ``bias``, two LayerNorms 2 * 2h.  With f = 4h and biases: 12h^2 + 13h.
    llama: attention h^2 + 2 h h_kv + h^2 (Q, K, V, out), SwiGLU 3hf (gate, up, down),
           two RMSNorms 2h.
Outside the layers: token embedding Vh, learned positions max_seq_len * h (gpt2), final norm
(2h gpt2, h llama), output head Vh unless tied.  For gpt2 with f = 4h, biases, tied head and
max_seq_len = s this is Narayanan et al.'s P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh)) plus the
final LayerNorm's 2h.

FLOPs (a multiply-add counts 2) per token of one layer's forward pass:
    matmuls 2 * (weight-matrix parameters of the layer) + core attention 4 s h
    (QK^T: 2 s h, scores x V: 2 s h; the full s x s square, as Megatron computes it).
    Logits 2hV per token.  Backward = 2 x forward.  Full recompute repeats each layer's
    forward once (not the logits); selective recompute repeats the core attention (4 s h).
For gpt2 with f = 4h: per iteration with full recompute
    F = 4 * B s l (24h^2 + 4sh) + 3 * B s 2hV = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)),
exactly Narayanan et al. 2021 eq. (3); without recompute 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
"""

from __future__ import annotations

from dataclasses import dataclass

from colonnade.config.choices import ARCHS
from colonnade.config.sections import ModelConfig


@dataclass(frozen=True)
class LayerShape:
    """The numbers every formula of the planner needs, resolved from a ModelConfig."""

    arch: str
    layers: int
    hidden: int
    heads: int
    kv_hidden: int
    ffn: int
    vocab: int
    max_seq_len: int
    tied: bool
    bias: bool
    hidden_dropout: bool
    attention_dropout: bool

    @classmethod
    def of(cls, model: ModelConfig) -> LayerShape:
        """Resolve defaults (kv heads, ffn width) of ``model``."""
        if model.arch not in ARCHS:
            raise ValueError(f"model.arch='{model.arch}' is unknown to the planner; use one of "
                             f"{', '.join(ARCHS)}.")
        return cls(
            arch=model.arch, layers=model.num_layers, hidden=model.hidden_size,
            heads=model.num_heads, kv_hidden=model.kv_heads * model.head_dim,
            ffn=model.ffn_size, vocab=model.vocab_size, max_seq_len=model.max_seq_len,
            tied=model.tie_embeddings, bias=model.bias,
            hidden_dropout=model.hidden_dropout > 0,
            attention_dropout=model.attention_dropout > 0,
        )

    @property
    def swiglu(self) -> bool:
        """Gated MLP (three matrices) for llama, plain two-matrix MLP for gpt2."""
        return self.arch == "llama"


def layer_matrix_params(m: LayerShape) -> int:
    """Weight-matrix parameters of one layer (the ones that cost 2 FLOPs per token each)."""
    h = m.hidden
    attn = 2 * h * h + 2 * h * m.kv_hidden
    mlp = (3 if m.swiglu else 2) * h * m.ffn
    return attn + mlp


def layer_params(m: LayerShape) -> int:
    """All parameters of one layer: matrices, biases and norms (see module docstring)."""
    h = m.hidden
    norms = 2 * (2 * h if m.arch == "gpt2" else h)
    biases = 0
    if m.bias:
        biases = (h + 2 * m.kv_hidden) + h + (m.ffn * (2 if m.swiglu else 1)) + h
    return layer_matrix_params(m) + biases + norms


def embedding_params(m: LayerShape) -> int:
    """Token embedding (+ positions for gpt2) on the first stage."""
    return m.vocab * m.hidden + (m.max_seq_len * m.hidden if m.arch == "gpt2" else 0)


def head_params(m: LayerShape) -> int:
    """Final norm and (untied) output head on the last stage."""
    norm = 2 * m.hidden if m.arch == "gpt2" else m.hidden
    return norm + (0 if m.tied else m.vocab * m.hidden)


def total_params(m: LayerShape) -> int:
    """All parameters of the model (a tied head counted once)."""
    return m.layers * layer_params(m) + embedding_params(m) + head_params(m)


def layer_forward_flops_per_token(m: LayerShape, seq_len: int) -> float:
    """One layer's forward FLOPs per token: 2 * matrix params + 4 s h (core attention)."""
    return 2.0 * layer_matrix_params(m) + 4.0 * seq_len * m.hidden


def attention_core_flops_per_token(m: LayerShape, seq_len: int) -> float:
    """Core attention forward FLOPs per token: QK^T and scores x V, 4 s h."""
    return 4.0 * seq_len * m.hidden


def logits_forward_flops_per_token(m: LayerShape) -> float:
    """Output head forward FLOPs per token: 2 h V."""
    return 2.0 * m.hidden * m.vocab


def recompute_flops_per_token(m: LayerShape, seq_len: int, recompute: str) -> float:
    """Extra forward FLOPs per token and layer that recomputation adds during backward."""
    if recompute == "full":
        return layer_forward_flops_per_token(m, seq_len)
    if recompute == "selective":
        return attention_core_flops_per_token(m, seq_len)
    return 0.0


def step_flops(m: LayerShape, seq_len: int, global_batch: int, recompute: str) -> float:
    """FLOPs of one optimizer step over all devices, recomputation included ("hardware" FLOPs).

    = B s [ l (3 * fwd_layer + recompute) + 3 * logits ].  ``recompute='none'`` gives the
    model FLOPs used for MFU.
    """
    tokens = float(global_batch) * seq_len
    per_layer = 3.0 * layer_forward_flops_per_token(m, seq_len)
    per_layer += recompute_flops_per_token(m, seq_len, recompute)
    return tokens * (m.layers * per_layer + 3.0 * logits_forward_flops_per_token(m))


def narayanan_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
                    recompute: bool = True) -> float:
    """Narayanan et al. 2021 eq. (3): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full
    recompute, else 72 B s l h^2 (1 + s/(6h) + V/(12 l h))."""
    b, s, l, h, v = float(batch), float(seq_len), float(layers), float(hidden), float(vocab)
    if recompute:
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def narayanan_params(layers: int, hidden: int, vocab: int, seq_len: int) -> float:
    """Narayanan et al. 2021: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))."""
    l, h = float(layers), float(hidden)
    return 12 * l * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * l * h))
