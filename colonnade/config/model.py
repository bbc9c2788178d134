"""The model section: the shape of the decoder and the facts about each architecture.

Split from :mod:`colonnade.config.sections` (which re-exports every name here) so each file
holds one concept; the same rules apply: frozen keyword-only dataclasses, a docstring under
every field, no checks here (they live in :mod:`colonnade.config.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchTraits:
    """The facts about an architecture that configuration needs before any model exists
    (validation, the default MLP width). :mod:`colonnade.models.spec` declares each
    architecture's classes and checks at import that its spec agrees with these."""

    rope: bool
    """Rotary positions (the head dim must be even); False: a learned position table."""
    gated_mlp: bool
    """A gated MLP (3 matrices, e.g. SwiGLU): default width round_up(8h/3, 64), else 4h."""
    mla: bool = False
    """Multi-head latent attention (DeepSeek-V3): the model.mla_* widths are required, and
    num_kv_heads / head_dim / biases do not apply."""
    clamped_swiglu: bool = False
    """Its experts use gpt-oss's clamped SwiGLU (model.moe_swiglu_alpha / moe_swiglu_limit
    apply; other architectures refuse them set)."""
    qk_norm: bool = False
    """An RMSNorm on every query and key head after the projections (Qwen3): the logits do
    not depend on the scale of W_q / W_k rows (optim.qk_clip_threshold refuses it)."""


ARCH_TRAITS: dict[str, ArchTraits] = {
    "llama": ArchTraits(rope=True, gated_mlp=True),
    "gpt2": ArchTraits(rope=False, gated_mlp=False),
    "mistral": ArchTraits(rope=True, gated_mlp=True),
    "qwen2": ArchTraits(rope=True, gated_mlp=True),
    "qwen3": ArchTraits(rope=True, gated_mlp=True, qk_norm=True),
    "deepseek_v3": ArchTraits(rope=True, gated_mlp=True, mla=True),
    "gpt_oss": ArchTraits(rope=True, gated_mlp=True, clamped_swiglu=True),
}
"""model.arch -> its traits; keys equal config.choices.ARCHS (checked by models.spec)."""

DEFAULT_VOCAB_SIZE = 2048
"""What an unset model.vocab_size means where no tokenizer is at hand (the size of the BPE
`prepare` trains, the planner, a model built directly)."""
VOCAB_PAD_MULTIPLE = 128
"""Megatron's make-vocab-size-divisible-by default: a model.vocab_size up to the tokenizer's
size rounded up to a multiple of this x tp is deliberate padding, not a mistake."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of the decoder-only transformer."""

    arch: str = "llama"
    """'llama' (RMSNorm, RoPE, SwiGLU, GQA, no biases), 'gpt2' (LayerNorm, learned positions,
    GELU, biases), 'mistral' or 'qwen2' (llama's layers; their Hugging Face classes, with
    model.sliding_window and, for qwen2, model.qkv_bias), 'qwen3' (llama's layers with an
    RMSNorm of width head_dim on every query and key head before RoPE; Qwen3ForCausalLM, with
    experts Qwen3MoeForCausalLM)."""
    num_layers: int = 4
    """Number of transformer layers."""
    hidden_size: int = 64
    """Model width h."""
    num_heads: int = 4
    """Attention (query) heads a; each of width model.head_dim."""
    head_dim: int | None = None
    """Width d of each attention head; None means hidden_size / num_heads. q projects h ->
    a d, k and v h -> kv d, the output a d -> h; a d need not equal h (Llama 3.2 3B, Qwen3,
    gpt-oss set it). Even with RoPE."""
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means num_heads (plain multi-head)."""
    ffn_hidden_size: int | None = None
    """MLP width; None means the SwiGLU rule round_up(8h/3, 64) for a gated MLP (llama), else
    4h (gpt2)."""
    vocab_size: int | None = None
    """Vocabulary size V: rows of the embedding and of the output head. None (the default):
    the tokenizer's size, which `train` takes once the data's tokenizer.json is known (a
    resumed or fine-tuned run: the checkpoint's); where there is no tokenizer yet it means
    2048 (the BPE that `prepare` trains, the planner, a model built directly), except that a
    re-prepare of the same input reuses the BPE data.prepared_dir holds, whatever its size
    (`train --data.input=X` run twice). The model pads the table itself with zero rows to a
    multiple of parallel.tp (masked out of the loss and the logits), so V needs no rounding
    for tp. Set it to leave room for tokens added later or to
    pad for GPU matmuls as Megatron's make-vocab-size-divisible-by does (to a multiple of
    128 x tp): up to the tokenizer's size rounded up to a multiple of 128 x tp is taken as
    such padding; a larger V trains rows no token uses and is warned about, with the numbers;
    a V below the tokenizer's size is refused."""
    max_seq_len: int = 256
    """Length of the position table (gpt2) / the RoPE cache; sequences may not be longer."""
    rope_theta: float = 10000.0
    """RoPE base frequency (llama)."""
    rope_scaling: str = "none"
    """How RoPE's inverse frequencies w_i = rope_theta^(-2i/d), i < d/2, are stretched for a
    context longer than the one pre-trained (colonnade.models.rope; HF's rope_type):
    'none' (HF 'default'); 'linear': w_i / rope_factor (position interpolation); 'llama3'
    (Llama 3.1-3.3): with L = rope_original_max_seq_len and the wavelength 2 pi / w_i, w_i
    kept when shorter than L / rope_high_freq_factor, divided by rope_factor when longer
    than L / rope_low_freq_factor, and in between (1 - t) w_i / rope_factor + t w_i with
    t = (L w_i / (2 pi) - low) / (high - low); 'yarn' (YaRN, gpt-oss, DeepSeek-V3): w_i
    blended from w_i / rope_factor (low frequencies) to w_i (high) over a linear ramp
    between the dims where L w_i / (2 pi) turns rope_beta_slow and rope_beta_fast
    (floor / ceil of them when rope_truncate), and cos, sin multiplied by
    rope_attention_factor; 'dynamic' (HF's dynamic NTK): inside the original context, the
    only range it can be trained in here, it is the unscaled RoPE (HF recomputes the
    frequencies only once a sequence passes the original context; max_seq_len may not
    exceed rope_original_max_seq_len). The tables are computed once, in float64."""
    rope_factor: float = 1.0
    """Context stretch factor s of linear, llama3, yarn and dynamic (1 with 'none')."""
    rope_original_max_seq_len: int | None = None
    """The pre-trained context length L of llama3, yarn and dynamic (HF's
    original_max_position_embeddings; dynamic's is its max_position_embeddings); None means
    max_seq_len."""
    rope_low_freq_factor: float = 1.0
    """llama3: wavelengths longer than L / this are divided by rope_factor in full."""
    rope_high_freq_factor: float = 4.0
    """llama3: wavelengths shorter than L / this are kept (must exceed the low factor)."""
    rope_beta_fast: float = 32.0
    """yarn: rotations over L above which a dim keeps its frequency (HF's beta_fast)."""
    rope_beta_slow: float = 1.0
    """yarn: rotations over L below which a dim is interpolated in full (HF's beta_slow)."""
    rope_truncate: bool = True
    """yarn: round the ramp's ends to whole dims (floor, ceil); gpt-oss sets false."""
    rope_attention_factor: float | None = None
    """yarn: the factor on cos and sin (so on the attention logits, squared). None: from
    rope_factor, 0.1 ln(s) + 1, or with rope_mscale and rope_mscale_all_dim both set
    mscale(s, rope_mscale) / mscale(s, rope_mscale_all_dim), mscale(s, m) = 0.1 m ln(s) + 1
    (colonnade.models.rope.yarn_mscale)."""
    rope_mscale: float = 0.0
    """yarn (DeepSeek): the mscale of rope_attention_factor's default; 0: unset."""
    rope_mscale_all_dim: float = 0.0
    """yarn (DeepSeek): the mscale_all_dim of rope_attention_factor's default (DeepSeek's
    softmax scale also multiplies by yarn_mscale(rope_factor, this)^2); 0: unset."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm / LayerNorm."""
    tie_embeddings: bool = False
    """Share the input embedding and the output head weights (GPT-2 does)."""
    bias: bool = False
    """Biases in linear layers (GPT-2 uses them)."""
    qkv_bias: bool = False
    """Biases on the attention's q, k, v projections only (Qwen2, Qwen2-MoE); model.bias
    already puts them on every linear layer."""
    hidden_dropout: float = 0.0
    """Dropout on the residual branches and embedding output (0 disables)."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (0 disables)."""
    sliding_window: int | None = None
    """Sliding-window attention of W = sliding_window keys: in the layers
    model.sliding_window_layers names, the query at position i attends the keys at positions
    j with i - W < j <= i (W keys, itself included: transformers' convention), in every
    attention path (fused, dropout, ring and all-to-all cp, KV-cache generation). None: full
    causal attention in every layer (Mistral v0.1: 4096; Qwen2 with use_sliding_window)."""
    sliding_window_layers: tuple[int, ...] | None = None
    """Global indices (ascending) of the layers that use model.sliding_window; the others
    attend in full. None: every layer (Mistral v0.1, Mixtral). Qwen2's use_sliding_window
    with max_window_layers K is the layers K .. num_layers - 1; gpt-oss alternates, the even
    layers windowed. Needs model.sliding_window."""
    init_std: float = 0.02
    """Std of the normal initialisation; output projections use init_std / sqrt(2 * num_layers)."""
    num_experts: int = 0
    """Routed experts per mixture-of-experts (MoE) layer; 0 makes a dense model. An MoE
    layer replaces the MLP: a router sends each token to moe_top_k experts (each an MLP of
    the architecture's kind: SwiGLU for llama, GELU for gpt2) and sums their outputs weighted
    by the router's probabilities."""
    moe_top_k: int = 2
    """Experts each token is sent to (k <= num_experts)."""
    moe_ffn_hidden_size: int | None = None
    """Hidden width of each routed expert; None means ffn_hidden_size's resolved value."""
    moe_layer_freq: int = 1
    """Every moe_layer_freq-th layer (counting after moe_first_dense_layers, the first of
    each group) is an MoE layer; 1 makes every such layer MoE."""
    moe_first_dense_layers: int = 0
    """The first this-many layers keep a dense MLP (DeepSeek-V3 keeps 3)."""
    moe_router: str = "softmax"
    """'softmax': probabilities softmax(logits) over all experts, the top k kept (Mixtral,
    Switch); 'sigmoid': scores sigmoid(logits), the top k of scores + a per-expert bias chosen
    (the bias only selects, it never weights), then the kept scores normalised (DeepSeek-V3's
    auxiliary-loss-free balancing)."""
    moe_norm_topk_prob: bool = True
    """Renormalise the k kept weights of a token to sum to 1 (Mixtral, Qwen3-MoE: True;
    Qwen2-MoE: False; DeepSeek-V3's sigmoid router: True)."""
    moe_router_bias_update_rate: float = 1e-3
    """Sigmoid router: after each step every expert's selection bias moves by this rate
    toward balance, b_i += rate * sign(mean load - load_i), loads counted over the global
    batch (0 turns the update off)."""
    moe_shared_expert_ffn_hidden_size: int = 0
    """Width of a dense shared expert every token passes through, added to the routed
    output (Qwen2-MoE, DeepSeek); 0: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by sigmoid(x w_g), w_g [1, h] (Qwen2-MoE)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the Switch/GShard load-balancing loss E * sum_i f_i P_i (f_i the fraction of
    routed token slots sent to expert i, P_i its mean router probability); 0: off."""
    moe_aux_loss_type: str = "global"
    """Over which tokens f_i and P_i of the balancing loss are counted: 'seq' (each sequence
    alone, then averaged over sequences) or 'global' (all tokens of the micro-batch across
    every data-parallel, context-parallel and sequence-parallel rank)."""
    moe_z_loss_coeff: float = 0.0
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); 0: off."""
    moe_capacity_factor: float | None = None
    """None: dropless (every routed token is computed). A number c: each expert takes at most
    ceil(c * s * k / E) tokens of each sequence of length s, the earliest positions first;
    dropped token slots contribute nothing (the token keeps its residual) and are counted."""
    moe_router_bias: bool = False
    """A learned bias [E] added to the router logits (gpt-oss's router is a linear layer with
    a bias); False: logits x W^T only."""
    moe_swiglu_alpha: float = 1.702
    """gpt-oss's experts (model.arch='gpt_oss' only): the sigmoid gain alpha of their clamped
    SwiGLU (u + 1) g sigmoid(alpha g), g = min(gate, limit), u = clamp(up, -limit, limit)."""
    moe_swiglu_limit: float = 7.0
    """gpt-oss's experts (model.arch='gpt_oss' only): the clamp limit of that SwiGLU (> 0)."""
    moe_n_group: int = 1
    """Group-limited routing (DeepSeek-V3: 8): the E experts form this many equal groups; a
    group's score is the sum of its two largest biased scores, and a token may only choose
    experts of its moe_topk_group best groups. 1: no group limit (sigmoid router only)."""
    moe_topk_group: int = 1
    """Groups each token's experts may come from (DeepSeek-V3: 4; <= moe_n_group)."""
    moe_routed_scaling_factor: float = 1.0
    """The routed experts' combine weights are multiplied by this after any renormalisation
    (DeepSeek-V3: 2.5); 1 leaves them as they are."""
    mla_q_lora_rank: int | None = None
    """Multi-head latent attention (model.arch='deepseek_v3'): rank r_q of the query
    compression, q = W_qb RMSNorm(W_qa x) with W_qa [r_q, h] (DeepSeek-V3: 1536); None: one
    projection W_q [a (d_nope + d_rope), h] (DeepSeek-V2-Lite)."""
    mla_kv_lora_rank: int = 0
    """MLA: width r_kv of the compressed key/value latent c = RMSNorm(W_kva x) (DeepSeek-V3:
    512), expanded per head by W_kvb [a (d_nope + d_v), r_kv]; 0 for architectures without
    MLA (only deepseek_v3 sets the mla_* fields)."""
    mla_qk_nope_head_dim: int = 0
    """MLA: per-head width of the query/key part without rotary positions (DeepSeek-V3: 128)."""
    mla_qk_rope_head_dim: int = 0
    """MLA: width of the rotary part of each query head, and of the one rotary key head shared
    by all heads (DeepSeek-V3: 64); q and k are [nope | rope] of d_nope + d_rope."""
    mla_v_head_dim: int = 0
    """MLA: per-head value width d_v (DeepSeek-V3: 128); the output projection is a d_v -> h."""
    mla_rope_interleave: bool = True
    """MLA: the rotary part's pairs are adjacent, (x_0, x_1), (x_2, x_3), ... (transformers'
    ``rope_interleave``, DeepSeek's checkpoints), rotated into the half-split order; False:
    pairs (x_i, x_{i + d/2}) as llama."""
    mtp_layers: int = 0
    """Multi-token prediction depth D (DeepSeek-V3: 1; HF num_nextn_predict_layers): module k
    (k = 0 .. D-1, on the last pipeline stage) predicts token i + 2 + k at position i from
    h' = W_eh [RMSNorm(Emb(t_{i+1+k})) ; RMSNorm(h_i)] through one more transformer layer
    (global index num_layers + k), its own final RMSNorm and output head; h_i is the main
    model's final-normed hidden state (k = 0) or module k-1's final-normed output. 0: none."""
    mtp_loss_weight: float = 0.1
    """lambda: the training objective adds lambda / D x the MTP modules' cross entropy summed
    over their valid tokens, normalised like the main loss (by the main loss's token count);
    the logged loss stays the main model's (DeepSeek-V3: 0.3, then 0.1)."""

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (model.mla_kv_lora_rank > 0)."""
        return self.mla_kv_lora_rank > 0

    @property
    def mla_qk_head_dim(self) -> int:
        """MLA: width of each query / key head, d_nope + d_rope (the softmax's 1/sqrt(d))."""
        return self.mla_qk_nope_head_dim + self.mla_qk_rope_head_dim

    @property
    def rope_dim(self) -> int:
        """Width of the rotated part of each head (the RoPE tables' d): d_rope under MLA, else
        the head width."""
        return self.mla_qk_rope_head_dim if self.mla else self.head_size

    @property
    def vocab(self) -> int:
        """vocab_size with its None default resolved where no tokenizer is at hand (a model
        built directly, the planner, synthetic batches, the BPE `prepare` trains):
        :data:`DEFAULT_VOCAB_SIZE`. `train` sets vocab_size from the tokenizer (or the
        checkpoint) before it builds the model."""
        return self.vocab_size if self.vocab_size is not None else DEFAULT_VOCAB_SIZE

    def window(self, index: int) -> int | None:
        """The sliding window W of global layer ``index``, or None for full attention
        (model.sliding_window, model.sliding_window_layers)."""
        if self.sliding_window is None:
            return None
        layers = self.sliding_window_layers
        return self.sliding_window if layers is None or index in layers else None

    @property
    def kv_heads(self) -> int:
        """Key/value head count with the None default resolved."""
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        """Per-head width d: head_dim with its None default (h / a) resolved."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def q_size(self) -> int:
        """Width of all query heads together, a d (the attention output's width)."""
        return self.num_heads * self.head_size

    @property
    def ffn_size(self) -> int:
        """MLP width with the None default resolved."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        traits = self.traits
        if traits is not None and not traits.gated_mlp:
            return 4 * self.hidden_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64

    @property
    def moe(self) -> bool:
        """Whether any layer is a mixture-of-experts layer."""
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Whether global layer ``index`` is an MoE layer (moe_first_dense_layers and
        moe_layer_freq; always False for a dense model)."""
        k = index - self.moe_first_dense_layers
        return self.moe and k >= 0 and k % self.moe_layer_freq == 0

    @property
    def expert_ffn_size(self) -> int:
        """Routed expert width with the None default resolved."""
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_size

    @property
    def traits(self) -> ArchTraits | None:
        """What configuration knows of ``arch`` (None for a name the validator rejects)."""
        return ARCH_TRAITS.get(self.arch)
