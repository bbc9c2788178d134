"""Parameter and FLOP counts of the decoder: the one counter (training's MFU, the planner).

Every count derives from a small set of architecture facts resolved in ONE function,
:func:`arch_facts` (the MLP's weight-matrix count, whether the norm has a bias, the kind of
positions); nothing here or above asks ``cfg.arch`` itself.

Notation: l layers, h hidden size, a query heads, d head dim (model.head_dim, h/a unless
set), h_q = a d (= h unless head_dim is set), h_kv = kv_heads * d, f MLP width, V vocabulary,
s sequence length, B samples per step, k the MLP's h x f weight matrices (3 gated, e.g.
SwiGLU; 2 plain, e.g. GELU).

Parameters of one layer
    attention h h_q + 2 h h_kv + h_q h (Q, K, V, out), MLP k h f, two norms 2h each with a
    bias (LayerNorm), h each without (RMSNorm); with ``bias``: h_q + 2 h_kv (QKV) + h (out) +
    (k - 1) f (the MLP's column matrices) + h (its row matrix).
    gpt2 (k = 2, LayerNorm, biases, f = 4h): 12h^2 + 13h.  llama (k = 3, RMSNorm): 2 h h_q +
    2 h h_kv + 3hf + 2h.  Norms over each head (the attention class's ``head_norms``: Qwen3's
    q and k norms, 2) add head_norms * d; attention sinks (the class's ``has_sinks``:
    gpt-oss) add one logit per query head, a.
Outside the layers: token embedding Vh, learned positions max_seq_len * h (none with RoPE),
final norm (2h or h), output head Vh unless tied.  For gpt2 with f = 4h, biases, tied head and
max_seq_len = s this is Narayanan et al.'s P = 12lh^2 (1 + 13/(12h) + (V+s)/(12lh)) plus the
final LayerNorm's 2h.

FLOPs (a multiply-add counts 2) per token of one layer's forward pass:
    matmuls 2 * (weight-matrix parameters of the layer) + core attention 4 s h_q
    (QK^T: 2 s h_q, scores x V: 2 s h_q; the full s x s square, causal mask not discounted, as
    Megatron counts it; a layer with a sliding window W counts min(s, W) keys per query, the
    band's s x W rectangle).  Logits 2hV per token.  Backward = 2 x forward.  Full recompute
    repeats each layer's forward once (not the logits); selective recompute repeats the core
    attention (4 s h).  Model FLOPs per token (MFU): 3 (l (2 matrix params + 4 s h) + 2 h V).
For gpt2 with f = 4h: per iteration with full recompute
    F = 4 * B s l (24h^2 + 4sh) + 3 * B s 2hV = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)),
exactly Narayanan et al. 2021 eq. (3); without recompute 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).

Mixture of experts (E routed experts of width f_e, k per token, shared expert width f_s, n_moe
MoE layers): an MoE layer's MLP replaces the dense k h f block by
    router E h (+ E: the sigmoid router's selection bias, a parameter without gradient;
    + E: the learned logit bias of model.moe_router_bias, gpt-oss),
    E routed experts of k h f_e (+ (k - 1) f_e + h with biases: gpt2),
    a shared expert k h f_s (+ biases) and its gate h when configured;
the ACTIVE parameters per token count k of the E routed experts. Forward FLOPs per token of
the MoE MLP: 2 (E h + top_k k h f_e + k h f_s (+ h for the gate)), so the model FLOPs per token
(MFU) count only the active experts. :class:`LayerShape` stays the dense shape; the MoE terms
are added by :func:`param_count`, :func:`active_param_count` and :func:`flops_per_token`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from colonnade.config.sections import ModelConfig
from colonnade.models.spec import arch_spec


@dataclass(frozen=True)
class ArchFacts:
    """What the counts and the activation-memory model need to know of an architecture."""

    mlp_matrices: int
    """h x f weight matrices of the MLP: 3 for a gated MLP (SwiGLU), 2 for a plain one
    (GELU)."""
    norm_has_bias: bool
    """The norm has a bias: LayerNorm (weight and bias; keeps mean and 1/std for backward);
    False: RMSNorm (weight only; keeps its fp32 input and 1/rms)."""
    positions: str
    """'rope' (rotary, no parameters) or 'learned' (a max_seq_len x h table)."""
    head_norms: int = 0
    """Norms of width d over each attention head per layer (the attention class's
    ``head_norms``; Qwen3's q and k norms: 2), d weights each, replicated over tp."""
    sinks: bool = False
    """One learned sink logit per query head per layer (the attention class's ``has_sinks``;
    gpt-oss), split over tp with the heads."""

    @property
    def rope(self) -> bool:
        """Rotary positions."""
        return self.positions == "rope"

    @property
    def norm_params(self) -> int:
        """Parameters of one norm per unit of width: 2 (weight, bias) or 1 (weight)."""
        return 2 if self.norm_has_bias else 1


@functools.lru_cache(maxsize=128)
def arch_facts(model: ModelConfig) -> ArchFacts:
    """The facts of ``model``'s architecture, read from its layer spec
    (:func:`colonnade.models.spec.arch_spec`: ``layer(i).mlp.matrices``,
    ``layer(i).norm.has_bias``, ``layer(i).attention.head_norms``, ``positions``); the one
    place they are resolved.

    Every layer must agree: the counts and the activation model assume identical layers.
    Cached per config (the planner asks it for every layout it scores).
    """
    spec = arch_spec(model)
    facts = {ArchFacts(mlp_matrices=int(layer.mlp.matrices),
                       norm_has_bias=bool(layer.norm.has_bias), positions=str(spec.positions),
                       head_norms=int(getattr(layer.attention, "head_norms", 0)),
                       sinks=bool(getattr(layer.attention, "has_sinks", False)))
             for layer in (spec.layer(i) for i in range(model.num_layers))}
    if len(facts) != 1:
        raise ValueError(f"model.arch='{model.arch}': its layers differ ({sorted(map(str, facts))})"
                         "; the parameter/FLOP counts assume identical layers.")
    return facts.pop()


@dataclass(frozen=True)
class LayerShape:
    """The numbers every count (and the planner's formulas) needs, resolved from a ModelConfig."""

    facts: ArchFacts
    """Architecture facts (:func:`arch_facts`)."""
    layers: int
    """l, transformer layers."""
    hidden: int
    """h."""
    heads: int
    """a, query heads."""
    q_hidden: int
    """h_q = a * d, the width of all query heads (h unless model.head_dim is set)."""
    kv_hidden: int
    """h_kv = kv_heads * d."""
    ffn: int
    """f, the MLP width."""
    vocab: int
    """V."""
    max_seq_len: int
    """Length of the learned position table (unused with RoPE)."""
    tied: bool
    """The output head shares the embedding."""
    bias: bool
    """Biases in the linear layers."""
    hidden_dropout: bool
    """Dropout on the residual branches (and embedding output)."""
    attention_dropout: bool
    """Dropout on the attention probabilities."""
    qkv_bias: bool = False
    """Biases on q, k, v only (model.qkv_bias; model.bias already has them)."""
    mtp_layers: int = 0
    """Multi-token-prediction modules on the last stage (model.mtp_layers)."""
    mla: MLAShape | None = None
    """Multi-head latent attention's widths (model.arch='deepseek_v3'), else None. h_q and
    h_kv are then a (d_n + d_r) each (the expanded per-head q and k) for the activation model;
    the parameter and FLOP counts use these widths instead."""
    windows: tuple[int | None, ...] = ()
    """Each layer's sliding window W (model.sliding_window where model.window(i) has it, None
    for full attention); empty: no layer is windowed."""

    @classmethod
    def of(cls, model: ModelConfig) -> LayerShape:
        """Resolve the defaults (kv heads, ffn width) and the facts of ``model``."""
        return cls(
            facts=arch_facts(model), layers=model.num_layers, hidden=model.hidden_size,
            heads=model.num_heads, q_hidden=model.q_size,
            kv_hidden=model.kv_heads * model.head_size,
            ffn=model.ffn_size, vocab=model.vocab, max_seq_len=model.max_seq_len,
            tied=model.tie_embeddings, bias=model.bias,
            hidden_dropout=model.hidden_dropout > 0,
            attention_dropout=model.attention_dropout > 0, qkv_bias=model.qkv_bias,
            windows=_windows(model), mtp_layers=model.mtp_layers,
        ) if not model.mla else cls(
            facts=arch_facts(model), layers=model.num_layers, hidden=model.hidden_size,
            heads=model.num_heads, q_hidden=model.num_heads * model.mla_qk_head_dim,
            kv_hidden=model.num_heads * model.mla_qk_head_dim,
            ffn=model.ffn_size, vocab=model.vocab, max_seq_len=model.max_seq_len,
            tied=model.tie_embeddings, bias=False, hidden_dropout=model.hidden_dropout > 0,
            attention_dropout=model.attention_dropout > 0, mtp_layers=model.mtp_layers,
            mla=MLAShape(model.mla_q_lora_rank or 0, model.mla_kv_lora_rank,
                         model.mla_qk_nope_head_dim, model.mla_qk_rope_head_dim,
                         model.mla_v_head_dim), windows=_windows(model))

    @property
    def head_dim(self) -> int:
        """d, the width of one head (h_q / a)."""
        return self.q_hidden // self.heads

    @property
    def mlp_matrices(self) -> int:
        """k, the MLP's h x f weight matrices."""
        return self.facts.mlp_matrices

    @property
    def rope(self) -> bool:
        """Rotary positions (no position table)."""
        return self.facts.rope


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention's widths (:mod:`colonnade.models.mla`)."""

    q_rank: int
    """r_q, the query compression rank (0: one h -> a d projection)."""
    kv_rank: int
    """r, the key/value latent width."""
    nope: int
    """d_n, the per-head query/key width without rope."""
    rope: int
    """d_r, the rotary width (one shared key head)."""
    v: int
    """d_v, the per-head value width."""

    def matrix_params(self, h: int, a: int) -> int:
        """W_qa h r_q + W_qb r_q a d (or W_q h a d) + W_kva h (r + d_r) + W_kvb r a (d_n +
        d_v) + W_o a d_v h, with d = d_n + d_r."""
        d = self.nope + self.rope
        q = h * self.q_rank + self.q_rank * a * d if self.q_rank else h * a * d
        return (q + h * (self.kv_rank + self.rope) + self.kv_rank * a * (self.nope + self.v)
                + a * self.v * h)

    @property
    def norm_params(self) -> int:
        """The two latent RMSNorms' weights, r_q + r (replicated over tp)."""
        return self.q_rank + self.kv_rank

    def local_matrices(self, h: int, a: int, tp: int) -> list[float]:
        """Elements of each weight matrix one tp rank holds: W_qa h r_q and W_kva h (r + d_r)
        whole, W_qb r_q a d (or W_q h a d), W_kvb r a (d_n + d_v) and W_o a d_v h over tp."""
        d = self.nope + self.rope
        q = [h * self.q_rank, self.q_rank * a * d / tp] if self.q_rank else [h * a * d / tp]
        return [*q, h * (self.kv_rank + self.rope), self.kv_rank * a * (self.nope + self.v) / tp,
                a * self.v * h / tp]

    def replicated_params(self, h: int) -> int:
        """What every tp rank holds whole: W_qa h r_q, W_kva h (r + d_r) and the latent
        norms (the rest splits by heads)."""
        return h * self.q_rank + h * (self.kv_rank + self.rope) + self.norm_params


def attention_matrix_params(m: LayerShape) -> int:
    """Weight-matrix parameters of one layer's attention: 2 h h_q + 2 h h_kv (q, k, v, o), or
    MLA's (:meth:`MLAShape.matrix_params`)."""
    if m.mla is not None:
        return m.mla.matrix_params(m.hidden, m.heads)
    return 2 * m.hidden * m.q_hidden + 2 * m.hidden * m.kv_hidden


def layer_matrix_params(m: LayerShape) -> int:
    """Weight-matrix parameters of one layer (the ones that cost 2 FLOPs per token each)."""
    return attention_matrix_params(m) + m.mlp_matrices * m.hidden * m.ffn


def layer_norm_params(m: LayerShape) -> int:
    """Parameters of one layer's two norms and its per-head norms (replicated on every tp
    rank): 2 h (x 2 with biases) + head_norms d."""
    latent = m.mla.norm_params if m.mla is not None else 0  # MLA's latent norms
    return 2 * m.facts.norm_params * m.hidden + m.facts.head_norms * m.head_dim + latent


def layer_params(m: LayerShape) -> int:
    """All parameters of one layer: matrices, biases and norms (see module docstring)."""
    h = m.hidden
    biases = 0
    if m.bias:
        biases = (m.q_hidden + 2 * m.kv_hidden) + h + (m.mlp_matrices - 1) * m.ffn + h
    elif m.qkv_bias:
        biases = m.q_hidden + 2 * m.kv_hidden
    sinks = m.heads if m.facts.sinks else 0
    return layer_matrix_params(m) + biases + layer_norm_params(m) + sinks


def position_params(m: LayerShape) -> int:
    """Learned position table max_seq_len x h (0 with RoPE)."""
    return 0 if m.rope else m.max_seq_len * m.hidden


def embedding_params(m: LayerShape) -> int:
    """Token embedding (+ learned positions) on the first stage."""
    return m.vocab * m.hidden + position_params(m)


def head_params(m: LayerShape) -> int:
    """Final norm and (untied) output head on the last stage."""
    return m.facts.norm_params * m.hidden + (0 if m.tied else m.vocab * m.hidden)


def total_params(m: LayerShape) -> int:
    """All parameters of the model (a tied head counted once)."""
    return m.layers * layer_params(m) + embedding_params(m) + head_params(m)


def mlp_params(m: LayerShape, width: int) -> int:
    """One MLP of ``width`` f: k h f (+ (k - 1) f + h with biases); 0 when width is 0."""
    if width <= 0:
        return 0
    return m.mlp_matrices * m.hidden * width + (
        (m.mlp_matrices - 1) * width + m.hidden if m.bias else 0)


def moe_layer_count(cfg: ModelConfig) -> int:
    """n_moe, the MoE layers of ``cfg`` (0 for a dense model)."""
    return sum(1 for i in range(cfg.num_layers) if cfg.is_moe_layer(i))


def moe_mlp_params(cfg: ModelConfig) -> dict[str, int]:
    """One MoE layer's MLP parameters: ``router`` (E h, + E selection biases with the sigmoid
    router), ``routed`` (E experts), ``shared`` (shared expert + gate)."""
    m, e, h = LayerShape.of(cfg), cfg.num_experts, cfg.hidden_size
    shared = cfg.moe_shared_expert_ffn_hidden_size
    router_biases = (e if cfg.moe_router == "sigmoid" else 0) + (e if cfg.moe_router_bias else 0)
    return {"router": e * h + router_biases,
            "routed": e * mlp_params(m, cfg.expert_ffn_size),
            "shared": mlp_params(m, shared) + (h if shared > 0 and cfg.moe_shared_expert_gate
                                               else 0)}


def param_count(cfg: ModelConfig) -> dict[str, int]:
    """Parameters of ``cfg``'s model: ``embedding`` (+ positions), ``layers`` (all of them,
    MoE layers with all their experts), ``head`` (final norm + untied head), ``total``."""
    m = LayerShape.of(cfg)
    layers = m.layers * layer_params(m)
    if cfg.moe:
        layers += moe_layer_count(cfg) * (sum(moe_mlp_params(cfg).values())
                                          - mlp_params(m, m.ffn))
    out = {"embedding": embedding_params(m), "layers": layers, "head": head_params(m)}
    if cfg.mtp_layers > 0:
        out["mtp"] = mtp_params(cfg)
    out["total"] = sum(out.values())
    return out


def mtp_params(cfg: ModelConfig) -> int:
    """The multi-token-prediction modules (:mod:`colonnade.models.mtp`): each its three norms
    (enorm, hnorm, final), W_eh 2 h^2, one layer of global index num_layers + k (MoE or
    dense as that index says) and its own embedding and head, 2 V h."""
    m, h = LayerShape.of(cfg), cfg.hidden_size
    moe_extra = sum(moe_mlp_params(cfg).values()) - mlp_params(m, m.ffn) if cfg.moe else 0
    out = 0
    for k in range(cfg.mtp_layers):
        layer = layer_params(m) + (moe_extra if cfg.is_moe_layer(cfg.num_layers + k) else 0)
        out += 3 * m.facts.norm_params * h + 2 * h * h + layer + 2 * m.vocab * h
    return out


def mtp_moe_layers(cfg: ModelConfig) -> int:
    """MoE layers among the multi-token-prediction modules."""
    return sum(1 for k in range(cfg.mtp_layers) if cfg.is_moe_layer(cfg.num_layers + k))


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters a token passes through: the total less the E - k routed experts it skips in
    every MoE layer (the total for a dense model)."""
    total = param_count(cfg)["total"]
    if not cfg.moe:
        return total
    routed = moe_mlp_params(cfg)["routed"]
    skipped = routed * (cfg.num_experts - cfg.moe_top_k) // cfg.num_experts
    return total - (moe_layer_count(cfg) + mtp_moe_layers(cfg)) * skipped


def moe_mlp_forward_flops_per_token(cfg: ModelConfig) -> float:
    """One MoE layer's MLP forward FLOPs per token: 2 (E h + top_k k h f_e + k h f_s (+ h))."""
    m, h = LayerShape.of(cfg), cfg.hidden_size
    shared = cfg.moe_shared_expert_ffn_hidden_size
    return 2.0 * (cfg.num_experts * h + cfg.moe_top_k * m.mlp_matrices * h * cfg.expert_ffn_size
                  + m.mlp_matrices * h * shared
                  + (h if shared > 0 and cfg.moe_shared_expert_gate else 0))


def layer_forward_flops_per_token(m: LayerShape, seq_len: int) -> float:
    """One layer's forward FLOPs per token: 2 * matrix params + 4 s h_q."""
    return 2.0 * layer_matrix_params(m) + attention_core_flops_per_token(m, seq_len)


def attention_core_flops_per_token(m: LayerShape, seq_len: int) -> float:
    """Core attention forward FLOPs per token of a layer: QK^T and scores x V, 4 s h_q (MLA:
    2 s a (d_n + d_r) + 2 s a d_v), s the keys counted per query: the sequence (the full
    square), or min(s, W) in a layer with a sliding window W (the band's rectangle), averaged
    over the layers (:func:`attended_keys`)."""
    s = attended_keys(m, seq_len)
    if m.mla is not None:
        return 2.0 * s * m.heads * (m.mla.nope + m.mla.rope + m.mla.v)
    return 4.0 * s * m.q_hidden


def attended_keys(m: LayerShape, seq_len: int) -> float:
    """Keys counted per query in core attention, the mean over the layers: s, or min(s, W) in a
    layer with a sliding window W (:attr:`LayerShape.windows`)."""
    keys = [seq_len if w is None else min(seq_len, w) for w in m.windows] or [seq_len]
    return sum(keys) / len(keys)


def _windows(model: ModelConfig) -> tuple[int | None, ...]:
    """model.window(i) of every layer; () when none is windowed."""
    if model.sliding_window is None:
        return ()
    return tuple(model.window(i) for i in range(model.num_layers))


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


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward = 3 x forward, no recompute):
    3 (l (2 matrix params + 4 s h_q) + 2 h V); what MFU divides by. Each MoE layer counts its
    active MLP (:func:`moe_mlp_forward_flops_per_token`) instead of the dense one; each
    multi-token-prediction module adds 3 (4 h^2 + one layer + 2 h V)."""
    m = LayerShape.of(cfg)
    per_layer = 3.0 * layer_forward_flops_per_token(m, seq_len)
    total = m.layers * per_layer + 3.0 * logits_forward_flops_per_token(m)
    if cfg.moe:
        dense_mlp = 2.0 * m.mlp_matrices * m.hidden * m.ffn  # the dense MLP's matmuls
        moe_layers = moe_layer_count(cfg) + mtp_moe_layers(cfg)
        total += 3.0 * moe_layers * (moe_mlp_forward_flops_per_token(cfg) - dense_mlp)
    # multi-token prediction: W_eh 2 (2 h^2), one more layer (its MoE term above), the head
    total += 3.0 * cfg.mtp_layers * (4.0 * m.hidden * m.hidden + per_layer / 3.0
                                     + logits_forward_flops_per_token(m))
    return total
