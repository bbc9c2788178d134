"""The activation-memory model: bytes one layer keeps for backward (the planner's and the tests').

Korthikanti et al. 2022 ("Reducing activation recomputation in large transformer models",
Sec. 4), derived for *this* code's layers and checked against measurement
(:mod:`colonnade.analysis.measure`, tests/recompute/test_memory.py: to the byte).  The layer's
kind comes from its architecture facts (:func:`colonnade.models.counts.arch_facts`): the norm
(LayerNorm with a bias, RMSNorm without), the MLP's matrix count k (3 gated, 2 plain) and the
positions (RoPE or learned).

Notation: E bytes per activation element (8 fp64, 4 fp32, 2 bf16/fp16), A = max(E, 4) (what
16-bit runs keep in fp32: RMSNorm's up-cast input and 1/rms, attention's log-sum-exp),
s sequence, b micro-batch, h hidden, a heads, g kv heads, d head dim (h/a unless
model.head_dim is set), h_kv = g d, f ffn width, t tp, r = s/t with sp else s (rows of the
residual stream a rank holds).  q, the attention output and the out-proj input are a d wide;
the formulas below write h for it (a d = h unless model.head_dim is set).  Per layer:

    norms (x2)     RMSNorm (x32 * rsqrt(mean x32^2) then .to(E) * w): input A r b h (the input
                   itself when E >= 4), 1/rms A r b, normalised x E r b h.
                   LayerNorm (F.layer_norm): input E r b h, mean and 1/std 2 K r b, by kernel
                   path (:data:`KERNEL_PATHS`): the CPU kernel keeps them in the input dtype
                   (K = E), the CUDA kernel in fp32 (K = 4).
    column inputs  2 E s b h: attention's q/k/v and the MLP's gate/up (or fc) each read one
                   [s, b, h] input (``column_parallel``): the replicated norm output, or under
                   sp its all-gathered copy, which F.linear keeps in full (with
                   parallel.tp_comm_chunks = 1; the chunked path is not modelled here).
                   ``sp_regather`` (Megatron-LM's sequence parallelism, Korthikanti et al.
                   Sec. 4.2.2: the [s/t, b, h] shard is kept and all-gathered again in
                   backward): 2 E r b h.
    attention, split over t (heads), by kernel (:class:`ActivationShape` ``attention``):
      'flash' (colonnade's fused SDPA, attention dropout off): q E s b h/t, k and v
                   E s b h_kv/t each and the log-sum-exp A s b a/t; no s^2 scores (flash
                   kernel).  The output follows q's memory order, and q is [s, b, a/t, d]
                   in memory (a view of the projection, or RoPE applied in that order), so
                   the out-proj input below is a view of the output: one storage, counted
                   once.
      'blockwise' (colonnade, attention dropout on, :mod:`colonnade.models.dropout_attention`):
                   q E s b h/t, k and v E s b h_kv/t each and the log-sum-exp A s b a/t; no
                   s^2 term (probabilities and keep-masks are recomputed in backward); its
                   output is written in [s, b, a/t d] order, so the out-proj input is a view.
      'eager' (scores materialised: Megatron 2021, the paper): q E s b h/t, k and v
                   E s b h_kv/t each, the softmax output E a s^2 b/t and, with attention
                   dropout, its 1-byte mask a s^2 b/t and output E a s^2 b/t.
    out-proj input E s b h/t (the [s, b, a/t d] copy of the attention output).
    head norms     (Qwen3's q/k RMSNorm, the facts' ``head_norms``) per head of q and k,
                   (a + g)/t of them: up-cast input A s b d, 1/rms A s b, normalised copy
                   E s b d (recomputed under full recompute only).
    MLP, split over t: 2 (k - 1) E s b f/t: gated (k = 3, SwiGLU silu(gate x) * up x) keeps
                   gate, up, silu(gate) and the product; plain (k = 2, GELU) its input and
                   output.
    hidden dropout (if on): two bool keep-masks 2 r b h bytes.
    selective      core attention is checkpointed: its inputs q E s b h/t, k, v E s b h_kv/t
                   replace the kernel's terms above.
    full           a checkpointed block keeps only its input E r b h; a chunk of L layers holds
                   ceil(L/N) of them (uniform N) or min(N, L) + full layers (block N).

The paper's GPT (4h GELU MLP, LayerNorm, eager attention, dropout, masks of 1 byte) gives at
E = 2: sbh (34 + 5as/h), tp: sbh (10 + 24/t + 5as/(ht)), tp+sp: sbh (34/t + 5as/(ht)),
selective: without the 5as/h terms, full: 2 sbh (/t with sp); :func:`paper_layer_bytes`
scales its 16-bit terms by E/2 and keeps the masks at 1 byte.  This model with the paper's
settings ('eager') differs from it only in (i) LayerNorm statistics 4 K r b and (ii) under sp
the two all-gathered column inputs kept in full (+ 2 E (1 - 1/t) s b h): Megatron keeps the
[s/t, b, h] shard and all-gathers it again in backward, which ``sp_regather`` models (at
t = 8 colonnade's layer keeps 7.75 sbh against the paper's 4.25 sbh under tp + sp + selective,
1.82x: why published sp configurations are planned with it).  Colonnade's own gpt2 layer with
attention dropout ('blockwise') keeps no s^2 term: -5 a s^2 b + 4 a s b against 'eager'.
The llama layer adds RMSNorm's up-cast input and normalised copy (2 (A + E) s b h instead of
2 E s b h), SwiGLU's four s b f tensors (f ~ 8h/3: ~ 10.7 E sbh vs GELU's 8 E sbh at f = 4h),
GQA's smaller k, v, and SDPA's flash kernel that keeps the log-sum-exp instead of s^2 scores.

Context parallelism (cp ranks, ``ActivationShape.cp``): a rank holds s/cp rows of each sample
(the zigzag split, chunks r and 2cp-1-r), so every term above is taken at s_l = s/cp in place of
s: norms, column inputs, out-proj input, MLP and dropout masks are per-row, and so is core
attention (q, k, v, output, log-sum-exp are [b, heads, s_l, d] / [b, heads, s_l]).  No term is
s^2 (the flash rule holds: only the log-sum-exp is kept), so the layer is 1/cp of the cp = 1
layer plus two small terms: the cp attention's own output (E s_l b h/t: the out-proj input is
a copy of it) and RoPE's gathered cos / sin (below).  By cp attention kind:
      'ring' (:mod:`colonnade.context_parallel.ring`): the autograd Function keeps q E s_l b h/t,
                   its local k, v 2 E s_l b h_kv/t, its own output E s_l b h/t (a fresh
                   [b, a/t, s_l, d] tensor; the out-proj input is a copy) and the merged
                   log-sum-exp A s_l b a/t.
      'all_to_all' (:mod:`colonnade.context_parallel.all_to_all_attention`): the kernel runs on
                   the full s with a/(t cp) query heads and k_r = g/(t cp) kv heads (or 1
                   replicated kv head when cp is a multiple of g/t): q E s b h/(t cp) (= the
                   ring's), k and v 2 E s b d k_r, output E s b h/(t cp) (not with
                   attention dropout: the blockwise kernel runs and keeps no output),
                   log-sum-exp A s b a/(t cp).  With k_r = g/(t cp) this equals the ring's
                   bytes.
      'hierarchical' (:mod:`colonnade.context_parallel.hierarchical`): the ring's terms, its
                   kv blocks holding a s_l rows of h_kv = g/(t a) heads (1 replicated head
                   when a is a multiple of g/t): 2 E s_l b d a h_kv (= the ring's k, v when
                   the heads split); the all-to-alls keep nothing.
    RoPE under cp rotates by the rank's global positions: each layer keeps the cos and sin
    rows gathered at them, E s_l b d (at cp = 1 they are views of the model's tables).
    Selective recompute checkpoints the all_to_all core (its inputs q, k, v at s_l are kept)
    but not the ring (colonnade.models.recompute: the ring Function already keeps only
    q, k, v, output and log-sum-exp), so ring + selective keeps the ring's terms.
    Transient buffers of one layer's attention under cp (:func:`cp_buffer_bytes`, counted once
    per rank, not per layer: one layer's attention runs at a time):
      ring         a kv block (k, v packed) has n_kv = 2 s_l b h_kv/t elements; the forward
                   holds 2 in flight (E each: the one attended, the one arriving); the
                   backward also 2 dK/dV accumulators in the log-sum-exp dtype A (the
                   travelling one and the one arriving), this step's block contribution (A)
                   and the dq accumulator A s_l b h/t, and the block kernel's temporaries
                   on one chunk pair (n = s_l/2 rows, a/t heads): its dq, dk, dv and, with
                   GQA (g < a), k and v expanded to the query heads, (3 + 2) E b (a/t) n d:
                   peak 2 E n_kv + 3 A n_kv + A s_l b h/t + (3 + 2 [g < a]) E b h/t s_l/2
                   (measured to ~1% in fp32, ~6% under in bf16: tests/analysis/
                   test_cp_measured.py).
      all_to_all   backward holds the gradients of the kernel's q, k, v and output at full s
                   with heads/cp (dq, dk, dv, dout): E s b (2 h/(t cp) + 2 d k_r).

Kernel paths (``ActivationShape.kernels``, chosen by the device the plan is for:
``Cluster.kernels``).  Colonnade runs the same layer code on both; where the kernels keep
different tensors the path has its own term:
    'cpu'    PyTorch's CPU kernels: flash SDPA (output + fp32 log-sum-exp), LayerNorm's
             statistics in the input dtype.  Validated to the byte against measured peak
             memory per layer on this machine (tests/recompute/test_memory.py,
             tests/analysis/test_cpu_terms.py).
    'cuda'   fused SDPA (flash / cuDNN / memory-efficient: output + fp32 log-sum-exp, no
             s x s scores; the memory-efficient kernel pads the log-sum-exp to a multiple of
             32 positions plus two 8-byte RNG words, a fraction of a percent, not counted),
             LayerNorm's statistics in fp32.  RMSNorm of a 16-bit input and the vocabulary
             cross entropy run the same eager ops as on the CPU (no fused kernel is called),
             so their terms are the CPU's.  Validated against the published formula: the
             paper's GPT with flash attention gives sbh (34 + 5as/h) without its 5as/h term, and
             with ``sp_regather`` sbh (34/t) under tp + sp + selective, to within the
             LayerNorm statistics (tests/analysis/test_published_memory.py), and against the
             H200's measured peak of GPT-3 1.3B (benchmarks/results/gpu_check_h200.json:
             benchmarks/planner.py prints the error).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from colonnade.config.choices import CP_ATTENTIONS
from colonnade.config.sections import ModelConfig
from colonnade.models.counts import ArchFacts, LayerShape, MLAShape

if TYPE_CHECKING:  # the planner imports this module: keep torch out of `colonnade plan`
    import torch

    from colonnade.models.recompute import RecomputePlan

ATTENTION_KERNELS: tuple[str, ...] = ("flash", "blockwise", "eager")
"""How core attention runs and what it keeps for backward (see the module docstring); the
planner's ``Workload.attention`` and ``colonnade plan --attention`` take these too."""

KERNEL_PATHS: tuple[str, ...] = ("cuda", "cpu")
"""Which device's kernels run the layers (see the module docstring): the planner takes it from
the cluster (``Cluster.kernels``), the dry run from ``training.device`` ('cuda', else 'cpu')."""

LLAMA_FACTS = ArchFacts(mlp_matrices=3, norm_has_bias=False, positions="rope")
"""Default facts of an :class:`ActivationShape` (RMSNorm, SwiGLU, RoPE)."""


@dataclass(frozen=True, kw_only=True)
class ActivationShape:
    """Everything the per-layer activation formula depends on."""

    seq: int
    """s, tokens per sample."""
    batch: int
    """b, samples per micro-batch."""
    hidden: int
    """h."""
    heads: int
    """a, query heads (all of them; the formula divides by tp)."""
    kv_heads: int
    """g, key/value heads."""
    ffn: int
    """f, the MLP width."""
    tp: int = 1
    """t, tensor-parallel degree."""
    sp: bool = False
    """Sequence parallelism (the residual stream holds s/t rows)."""
    cp: int = 1
    """Context-parallel degree: the rank holds s/cp rows of every sample (s % cp == 0)."""
    cp_attention: str = "ring"
    """Under cp > 1: 'ring', 'all_to_all' or 'hierarchical' (:data:`CP_ATTENTIONS`)."""
    cp_a2a_size: int | None = None
    """'hierarchical': its inner all-to-all size a (the ring spans cp / a ranks)."""
    elem: int = 2
    """Bytes per activation element E."""
    facts: ArchFacts = LLAMA_FACTS
    """Norm, MLP and position kinds of the layer."""
    head_dim: int | None = None
    """d, the width of one head; None: h / a."""
    hidden_dropout: bool = False
    """Dropout on the residual branches (two keep-masks per layer)."""
    attention_dropout: bool = False
    """Dropout on the attention probabilities."""
    attention: str = "auto"
    """'flash', 'blockwise' or 'eager' (:data:`ATTENTION_KERNELS`); 'auto': what colonnade
    runs, 'blockwise' with attention dropout, else 'flash'."""
    mla: MLAShape | None = None
    """Multi-head latent attention's widths (its attention terms replace the others':
    :func:`_mla_terms`), or None."""
    kernels: str = "cpu"
    """'cpu' or 'cuda' (:data:`KERNEL_PATHS`): whose kernels run the layer (LayerNorm keeps
    its statistics in the input dtype on the CPU, in fp32 on CUDA)."""
    sp_regather: bool = False
    """Under sp: the column-parallel layers keep their input's [s/t, b, h] shard and gather it
    again in backward (Megatron-LM), instead of the gathered [s, b, h] (colonnade)."""

    def __post_init__(self) -> None:
        if self.cp < 1 or self.seq % self.cp or self.cp_attention not in CP_ATTENTIONS:
            raise ValueError(f"cp={self.cp} must be >= 1 and divide seq={self.seq}, and "
                             f"cp_attention='{self.cp_attention}' one of "
                             f"{', '.join(CP_ATTENTIONS)}.")
        if self.attention not in ("auto", *ATTENTION_KERNELS):
            raise ValueError(f"attention='{self.attention}' must be 'auto' or one of "
                             f"{', '.join(ATTENTION_KERNELS)}.")
        if self.kernels not in KERNEL_PATHS:
            raise ValueError(f"kernels='{self.kernels}' must be one of "
                             f"{', '.join(KERNEL_PATHS)}.")

    @property
    def kernel(self) -> str:
        """The attention kernel with 'auto' resolved."""
        if self.attention != "auto":
            return self.attention
        return "blockwise" if self.attention_dropout else "flash"

    @property
    def d(self) -> int:
        """d, one head's width (``head_dim`` with its h / a default)."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """a d, the width of q and of the attention output (h unless head_dim is set)."""
        return self.heads * self.d

    @property
    def local_seq(self) -> int:
        """s_l = s / cp, the rows of each sample this rank holds."""
        return self.seq // self.cp

    @property
    def ring_kv_heads(self) -> float:
        """kv heads of the kv blocks the ring keeps and passes, in units of the rank's s_l
        rows: g/t for the ring; a h_kv for hierarchical (its blocks hold a s_l rows of
        h_kv = g/(t a) heads, or of 1 replicated head)."""
        local = self.kv_heads // self.tp
        if self.cp_attention != "hierarchical":
            return self.kv_heads / self.tp
        a = self.cp_a2a_size or 1
        return float(a * (local // a if local % a == 0 else 1))

    @property
    def a2a_kv_heads(self) -> int:
        """k_r: kv heads one rank attends with under all_to_all (g/(t cp), or 1 replicated
        head when cp is a multiple of g/t)."""
        local = self.kv_heads // self.tp
        return local // self.cp if local % self.cp == 0 else 1

    @classmethod
    def of(cls, m: LayerShape, seq: int, batch: int, *, tp: int = 1, sp: bool = False,
           elem: int = 2, attention: str = "auto", cp: int = 1,
           cp_attention: str = "ring", cp_a2a_size: int | None = None,
           kernels: str = "cpu", sp_regather: bool = False) -> ActivationShape:
        """The shape of ``m``'s layers for micro-batch [b, s] on a tp (+sp) x cp rank."""
        return cls(seq=seq, batch=batch, hidden=m.hidden, heads=m.heads,
                   kv_heads=m.kv_hidden // m.head_dim, ffn=m.ffn, tp=tp, sp=sp,
                   head_dim=m.head_dim,
                   cp=cp, cp_attention=cp_attention, cp_a2a_size=cp_a2a_size, elem=elem,
                   facts=m.facts,
                   hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
                   attention=attention, mla=m.mla, kernels=kernels,
                   sp_regather=sp_regather)

    @classmethod
    def from_model(cls, model: ModelConfig, seq: int, batch: int, *, tp: int = 1,
                   sp: bool = False, dtype: torch.dtype | None = None) -> ActivationShape:
        """The shape of ``model``'s layers, as colonnade runs them, in ``dtype`` (None:
        a 16-bit type, E = 2)."""
        elem = 2 if dtype is None else dtype.itemsize
        return cls.of(LayerShape.of(model), seq, batch, tp=tp, sp=sp, elem=elem)


def _norm_bytes(x: ActivationShape, rows: int) -> float:
    """Both norms of a layer: LayerNorm input + mean, 1/std (input dtype on the CPU, fp32 on
    CUDA); RMSNorm up-cast input, 1/rms and the normalised copy."""
    e, b, h, acc = x.elem, x.batch, x.hidden, max(x.elem, 4)
    if x.facts.norm_has_bias:
        stats = e if x.kernels == "cpu" else 4
        return 2.0 * (e * rows * b * h + 2 * stats * rows * b)
    return 2.0 * (acc * rows * b * h + acc * rows * b + e * rows * b * h)


def _head_norm_bytes(x: ActivationShape) -> float:
    """The per-head RMSNorms of q (a/t heads) and k (g/t heads) of width d (the facts'
    ``head_norms``, Qwen3): RMSNorm's terms per head over the rank's s_l rows, up-cast input
    A s_l b d, 1/rms A s_l b and the normalised copy E s_l b d (the input is the projection's
    output, which RoPE alone would not keep)."""
    if not x.facts.head_norms:
        return 0.0
    e, acc, rows = x.elem, max(x.elem, 4), float(x.local_seq) * x.batch
    heads = (x.heads + x.kv_heads) / x.tp
    return heads * rows * (acc * x.d + acc + e * x.d)


def _core_bytes(x: ActivationShape, q: float, kv: float) -> tuple[str, float]:
    """(term name, bytes) of the core attention without recompute, by kernel (cp > 1: by cp
    attention kind)."""
    s, b, a, t, e = x.local_seq, x.batch, x.heads, x.tp, x.elem
    lse = max(e, 4) * s * b * a / t  # fp32 log-sum-exp [b, a/t, s_l]
    if x.cp > 1:
        out = e * float(s) * b * x.q_width / t  # [b, a/t, s_l, d]: a fresh tensor, kept
        if x.cp_attention == "all_to_all":  # full s, a/(t cp) heads: q, out, lse as the ring's
            kv = 2.0 * e * x.seq * b * x.d * x.a2a_kv_heads
            kept = out if x.kernel == "flash" else 0.0  # blockwise writes [s, b, ...]: a copy
            return "core_all_to_all", q + kv + kept + lse
        if x.cp_attention == "hierarchical":  # the ring's terms on its kv blocks
            ring_kv = 2.0 * e * s * b * x.d * x.ring_kv_heads
            return "core_hierarchical", q + ring_kv + out + lse
        return "core_ring", q + kv + out + lse
    if x.kernel == "eager":
        scores = float(a) * s * s * b / t  # [b, a/t, s, s]
        kept = e * scores + ((1 + e) * scores if x.attention_dropout else 0.0)
        return "core_eager", q + kv + kept
    if x.kernel == "blockwise":
        return "core_blockwise", q + kv + lse
    # SDPA's output takes q's memory order, [s, b, a/t, d] (RoPE is applied in that order):
    # the out-proj input is a view of the output, one storage (counted as out_proj_input)
    return "core_flash", q + kv + lse


def layer_terms(x: ActivationShape, recompute: str = "none") -> dict[str, float]:
    """Bytes one layer keeps for backward, by term (see the module docstring).

    ``recompute`` 'none' | 'selective' | 'full' (one checkpointed layer: its input only).
    """
    s, b, h, t, e = x.local_seq, x.batch, x.hidden, x.tp, x.elem  # s_l = s / cp
    rows = s // t if x.sp else s
    if recompute == "full":
        return {"block_input": float(e * rows * b * h)}
    h_kv = x.kv_heads * x.d
    column_rows = rows if x.sp_regather else s  # the gathered [s, b, h], or Megatron's shard
    terms = {"norms": _norm_bytes(x, rows),
             "column_inputs": 2.0 * e * column_rows * b * h}  # attention's and the MLP's
    if x.facts.head_norms:
        terms["head_norms"] = _head_norm_bytes(x)
    q, kv = e * float(s * b) * x.q_width / t, 2.0 * e * s * b * h_kv / t
    if recompute == "selective" and not (x.cp > 1 and x.cp_attention != "all_to_all"):
        terms["core_inputs"] = q + kv
    else:  # the ring is not checkpointed by selective recompute: it keeps only q k v out lse
        name, value = _core_bytes(x, q, kv)
        terms[name] = value
    if x.cp > 1 and x.facts.rope:  # cos, sin gathered at the rank's positions [s_l, b, 1, d/2]
        terms["rope_tables"] = e * float(s) * b * x.d
    terms["out_proj_input"] = e * float(s * b) * x.q_width / t
    terms["mlp"] = 2.0 * (x.facts.mlp_matrices - 1) * e * s * b * x.ffn / t
    if x.hidden_dropout:
        terms["dropout_masks"] = 2.0 * rows * b * h  # bool
    if x.mla is not None:  # multi-head latent attention: its own attention terms
        terms = {k: v for k, v in terms.items() if k in _NOT_ATTENTION} | _mla_terms(x, recompute)
    return terms


_NOT_ATTENTION = ("norms", "column_inputs", "mlp", "dropout_masks")
"""The terms of :func:`layer_terms` that multi-head latent attention keeps as they are."""


def _mla_terms(x: ActivationShape, recompute: str) -> dict[str, float]:
    """Multi-head latent attention's terms (:mod:`colonnade.models.mla`; r_q, r, d_n, d_r,
    d_v its widths, d = d_n + d_r, a/t heads on the rank, s_l b rows), measured at cp = 1
    with the fused kernel:

    * latents: the q rank's RMSNorm (input A r_q, 1/rms A, normalised E r_q) and q_b's input
      E r_q; the kv latent's RMSNorm, whose input is a view of kv_a's output [.., r + d_r]
      (E (r + d_r) kept; 16-bit: its up-cast copy A r), 1/rms A, normalised E r, and kv_b's
      input E r (q_b's and kv_a's outputs are otherwise free: rope keeps only cos, sin);
    * core: the concatenated q and k 2 E a/t d and v, zero-padded to d when d_v != d (a fresh
      E a/t d) else a view of kv_b's output E a/t (d_n + d_v); then the kernel's output
      (E a/t d when padded: the out-proj input is a copy of its first d_v columns) and
      log-sum-exp A a/t; selective recompute keeps q, k, v only;
    * out_proj_input: the attention output E a/t d_v.

    Under cp (q, k, v padded) the ring and all-to-all kernels keep the same q, k, v, output
    and log-sum-exp bytes on a rank's s_l rows (measured: all-to-all 64 B more per layer),
    RoPE's gathered cos / sin add E d_r per row, and selective recompute does not checkpoint
    the ring."""
    m = x.mla
    assert m is not None
    e, acc, rows, heads = x.elem, max(x.elem, 4), float(x.local_seq) * x.batch, x.heads / x.tp
    d = m.nope + m.rope
    q_path = (acc * m.q_rank + acc + 2 * e * m.q_rank) if m.q_rank else 0.0
    kv_input = e * (m.kv_rank + m.rope) if e >= 4 else acc * m.kv_rank
    kv_path = kv_input + acc + 2 * e * m.kv_rank
    padded = m.v != d
    v = e * heads * (d if padded else m.nope + m.v)
    out = {"latents": rows * (q_path + kv_path)}
    if recompute == "selective" and not (x.cp > 1 and x.cp_attention != "all_to_all"):
        out["core_inputs"] = rows * (2 * e * heads * d + v)
    else:
        kernel_out = e * heads * d if padded else 0.0  # else the out-proj input itself
        out["core_mla"] = rows * (2 * e * heads * d + v + kernel_out + acc * heads)
    if x.cp > 1:  # cos, sin gathered at the rank's positions [s_l, b, 1, d_r/2] each
        out["rope_tables"] = rows * e * m.rope
    out["out_proj_input"] = rows * e * heads * m.v
    return out


def cp_buffer_bytes(x: ActivationShape) -> float:
    """Peak transient bytes of one layer's cp attention (module docstring): ring's backward
    2 E n_kv + 3 A n_kv + A s_l b h/t + (3 + 2 [g < a]) E b h/t s_l/2 (n_kv = 2 s_l b
    h_kv/t); all_to_all the backward's dq, dk, dv, dout at full s with heads/cp; 0 at
    cp = 1."""
    if x.cp == 1:
        return 0.0
    e, b, d, hq = x.elem, x.batch, x.d, x.q_width
    if x.cp_attention == "all_to_all":
        return e * float(x.seq) * b * (2 * hq / (x.tp * x.cp) + 2 * d * x.a2a_kv_heads)
    acc, rows = max(e, 4), float(x.local_seq) * b
    n_kv = 2.0 * rows * x.ring_kv_heads * d  # hierarchical: its ring's blocks
    blocks = (3 + (2 if x.kv_heads < x.heads else 0)) * e * rows / 2 * hq / x.tp
    return 2 * e * n_kv + 3 * acc * n_kv + acc * rows * hq / x.tp + blocks


def layer_bytes(x: ActivationShape, recompute: str = "none") -> float:
    """Sum of :func:`layer_terms`."""
    return sum(layer_terms(x, recompute).values())


def chunk_layer_bytes(x: ActivationShape, plan: RecomputePlan, num_layers: int) -> float:
    """Bytes a chunk of ``num_layers`` layers keeps for one micro-batch under ``plan``."""
    if plan.mode != "full":
        return num_layers * layer_bytes(x, plan.mode)
    stored = plan.checkpointed_blocks(num_layers)
    plain = 0 if plan.method == "uniform" else num_layers - stored
    return stored * layer_bytes(x, "full") + plain * layer_bytes(x, "none")


def paper_layer_bytes(s: int, b: int, h: int, a: int, *, tp: int = 1, sp: bool = False,
                      recompute: str = "none", elem: int = 2) -> float:
    """Korthikanti et al. 2022 per layer (their GPT), 16-bit terms scaled to ``elem`` bytes.

    At elem = 2: sbh (10 + 24/t + 5as/(ht)), with sp sbh (34/t + 5as/(ht)), selective drops
    the 5as/h terms, full 2 sbh (/t with sp).  Dropout masks stay 1 byte per element.
    """
    k, sbh = elem / 2.0, float(s) * b * h
    if recompute == "full":
        return 2.0 * k * sbh / (tp if sp else 1)
    core = 0.0 if recompute == "selective" else (4.0 * k + 1.0) * a * s * s * b
    replicated = (8.0 * k + 2.0) * sbh  # norm, QKV and MLP inputs; two dropout masks
    sharded = 24.0 * k * sbh + core
    return (replicated + sharded) / tp if sp else replicated + sharded / tp
