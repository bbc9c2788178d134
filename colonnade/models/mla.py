"""Multi-head latent attention (MLA, DeepSeek-V2 / V3): the attention of model.arch
'deepseek_v3'.

Shapes: h hidden, a heads (a/tp on a rank), r_q = ``mla_q_lora_rank``, r = ``mla_kv_lora_rank``,
d_n = ``mla_qk_nope_head_dim``, d_r = ``mla_qk_rope_head_dim``, d_v = ``mla_v_head_dim``,
d = d_n + d_r. For x [.., h] (one token)::

    q      = W_qb RMSNorm(W_qa x)             [a, d]   (W_q x without a q rank)
    c, k_r = split(W_kva x, [r, d_r])          [r], [d_r]: the latent and ONE rotary key head
    k_n, v = split(W_kvb RMSNorm(c), per head) [a, d_n], [a, d_v]
    q      = [q_n | rope(q_r)],  k = [k_n | rope(k_r) for every head]      [a, d] each
    out    = W_o softmax(q k^T * c_s + causal) v                              [h]

with the softmax scale c_s = 1/sqrt(d), times mscale^2 under YaRN rope scaling (transformers'
``yarn_apply_mscale``; applied by scaling q, so every attention kernel keeps its default
1/sqrt(d)). Rotary angles act on the d_r part only; with ``mla_rope_interleave`` (DeepSeek's
checkpoints, transformers' ``rope_interleave``) the pairs are adjacent (x_0, x_1), (x_2, x_3),
.. and the rotated result is laid out half-split ([even | odd] rotated), exactly as
transformers does, which leaves q k^T unchanged.

Tensor parallelism. The heads split: W_qb (or W_q) and W_kvb are column-parallel (a/tp heads
per rank), W_o row-parallel. The down projections W_qa, W_kva and the two latent norms are
replicated and computed on the full sequence after the layer's one tp entry: x enters tp once
(f, the identity with an all-reduce backward; under sp the sequence all-gather with its
reduce-scatter backward), then every rank computes the same latents. Each rank
back-propagates only its own heads into them, so the gradients of W_qa, W_kva, the norms'
weights and x are partial sums over tp: x's is summed by the entry's backward (f's
all-reduce, sp's reduce-scatter), the replicated weights' are declared ``tp_partial_grad`` and
all-reduced across tp by :mod:`colonnade.data_parallel.finalize`, so every tp rank holds the
single-process gradient (Megatron instead all-gathers the sequence-parallel input the same
way and marks the replicated down projections' gradients for the tp all-reduce).

v's width: q, k are [.., d] and v [.., d_v]. v is zero-padded to width d before core
attention and the output's extra columns (zeros) are cut off: exact, at the cost of
(d - d_v) / d_v more P V work. Every kernel then sees one width: the ring kernels pack k and
v in one buffer, the all-to-all exchanges q, k, v together, the blockwise dropout kernel and
SDPA's fused kernels need it (with d_v != d PyTorch's CPU SDPA falls back to its math
kernel, which keeps the s x s probabilities for backward).

KV cache (generation): the expanded per-head k [b, a/tp, S, d] and v [b, a/tp, S, d_v]
(the compressed latent is not what is cached; simpler, more memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from colonnade.config.sections import ModelConfig
from colonnade.models.blocks import Attention, DocContext, KVCache, apply_rope
from colonnade.models.checkpointing import checkpoint
from colonnade.models.norms import RMSNorm
from colonnade.models.rope import yarn_mscale
from colonnade.tensor_parallel import mappings as mp
from colonnade.tensor_parallel.context import ParallelContext
from colonnade.tensor_parallel.float8 import linear
from colonnade.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from colonnade.tensor_parallel.sharding import Sharding, output_std

LATENT_NORM_EPS = 1e-6
"""Epsilon of the two latent RMSNorms: transformers' DeepseekV3 builds them with its default
1e-6 whatever rms_norm_eps says (DeepSeek-V3's rms_norm_eps is 1e-6 too)."""


def mla_softmax_factor(cfg: ModelConfig) -> float:
    """The factor on 1/sqrt(d) of MLA's softmax scale: mscale^2 with rope scaling and
    model.rope_mscale_all_dim set, mscale = 0.1 * rope_mscale_all_dim * ln(rope_factor) + 1
    (transformers' ``yarn_apply_mscale``; DeepSeek-V3: factor 40, mscale_all_dim 1, so
    1.3689^2 = 1.874); 1.0 otherwise."""
    if cfg.rope_scaling == "none" or not cfg.rope_mscale_all_dim:
        return 1.0
    mscale = yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim)
    return mscale * mscale


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> torch.Tensor:
    """Rotate adjacent pairs (x_{2i}, x_{2i+1}) of x [..., d] by angle i (cos/sin broadcastable
    to [..., d/2]); the result is half-split: [x_even cos - x_odd sin | x_odd cos + x_even sin]
    (transformers' ``apply_rotary_pos_emb_interleave``, DeepSeek's layout)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class ReplicatedLinear(nn.Module):
    """y = x W^T with W [out, in] replicated on every tp rank and applied to the full sequence
    after the tp entry; its gradient is a partial sum over tp (each rank back-propagates its
    own heads), all-reduced across tp (``tp_partial_grad``)."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, key: str,
                 std: float) -> None:
        super().__init__()
        self.weight = ctx.param(Sharding(f"{key}.weight", (out_features, in_features),
                                         tp_partial_grad=True), std)
        self.fp8 = ctx.float8(None, "none")
        """Float8 GEMMs (nothing split: the input is the full sequence), or None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [.., in] -> [.., out]."""
        return linear(x, self.weight, None, self.fp8)


class MLAttention(Attention):
    """Multi-head latent attention (module docstring). Parameters under ``{key}``: ``q_a``
    [r_q, h], ``q_a_norm`` [r_q], ``q_b`` [a d, r_q] (or ``q`` [a d, h] without a q rank),
    ``kv_a`` [r + d_r, h], ``kv_a_norm`` [r], ``kv_b`` [a (d_n + d_v), r], ``o`` [h, a d_v]
    (all ``.weight``). Shares :class:`~colonnade.models.blocks.Attention`'s core attention
    (fused, dropout, cp ring / all-to-all) and its rope-angle and layout helpers."""

    direct_children = ("q", "q_b", "kv_b")
    """Column-parallel children whose weights forward reads directly (after its own tp entry)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, key: str, layer: int) -> None:
        nn.Module.__init__(self)
        self.cfg, self.ctx, self.site = cfg, ctx, key
        self.dropout_site = f"{key}.attn_dropout"
        """The attention dropout's site (as :class:`Attention`'s)."""
        h, a, std = cfg.hidden_size, cfg.num_heads, cfg.init_std
        self.heads = self.kv_heads = a // ctx.tp
        self.d_nope, self.d_rope = cfg.mla_qk_nope_head_dim, cfg.mla_qk_rope_head_dim
        self.d_qk, self.d_v = cfg.mla_qk_head_dim, cfg.mla_v_head_dim
        self.rank = cfg.mla_kv_lora_rank
        r_q = cfg.mla_q_lora_rank
        self.q: ColumnParallelLinear | None = None
        self.q_a: ReplicatedLinear | None = None
        self.q_a_norm: RMSNorm | None = None
        self.q_b: ColumnParallelLinear | None = None
        if r_q is None:
            self.q = ColumnParallelLinear(h, a * self.d_qk, ctx, f"{key}.q", bias=False, std=std)
        else:
            self.q_a = ReplicatedLinear(h, r_q, ctx, f"{key}.q_a", std)
            self.q_a_norm = RMSNorm(cfg, ctx, f"{key}.q_a_norm", width=r_q, per_head=True)
            self.q_b = ColumnParallelLinear(r_q, a * self.d_qk, ctx, f"{key}.q_b", bias=False,
                                            std=std)
        self.kv_a = ReplicatedLinear(h, self.rank + self.d_rope, ctx, f"{key}.kv_a", std)
        self.kv_a_norm = RMSNorm(cfg, ctx, f"{key}.kv_a_norm", width=self.rank, per_head=True)
        for norm in (self.q_a_norm, self.kv_a_norm):
            if norm is not None:
                norm.eps = LATENT_NORM_EPS
        self.kv_b = ColumnParallelLinear(self.rank, a * (self.d_nope + self.d_v), ctx,
                                         f"{key}.kv_b", bias=False, std=std)
        self.o = RowParallelLinear(a * self.d_v, h, ctx, f"{key}.o", bias=False,
                                   std=output_std(std, cfg.num_layers))
        self.q_factor = mla_softmax_factor(cfg)
        """mscale^2 under YaRN (q is scaled by it), else 1."""
        self.recompute_core = False
        self.window = cfg.window(layer)
        """Sliding window of this layer (None: full causal; :class:`Attention`'s paths)."""

    def new_cache(self, batch: int, length: int) -> KVCache:
        """An empty KV cache of ``length`` positions: k [b, a/tp, S, d], v [b, a/tp, S, d_v]."""
        w = self.kv_b.weight
        return KVCache(w.new_zeros(batch, self.heads, length, self.d_qk),
                       w.new_zeros(batch, self.heads, length, self.d_v))

    def _enter_tp(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's one tp entry: f (copy, all-reduce backward) or, under sp, the sequence
        all-gather (reduce-scatter backward): [s(/tp), b, h] -> [s, b, h]."""
        ctx = self.ctx
        if ctx.tp == 1:
            return x
        return mp.gather_seq(x, ctx.group) if ctx.sp else mp.copy_to_tp(x, ctx.group)

    def _project(self, x: torch.Tensor, lead: tuple[int, ...]
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [.., h] (full sequence) -> q [.., a/tp, d], k_nope [.., a/tp, d_n], k_rope
        [.., 1, d_r] (before rope), v [.., a/tp, d_v]."""
        if self.q_a is not None:
            assert self.q_a_norm is not None and self.q_b is not None
            q = linear(self.q_a_norm(self.q_a(x)), self.q_b.weight, None,
                       self.q_b.fp8)  # [.., a/tp d]
        else:
            assert self.q is not None
            q = linear(x, self.q.weight, None, self.q.fp8)  # [.., a/tp d]
        latent, k_rope = self.kv_a(x).split([self.rank, self.d_rope], dim=-1)  # [.., r], [.., d_r]
        kv = linear(self.kv_a_norm(latent), self.kv_b.weight, None,
                    self.kv_b.fp8)  # [.., a/tp (d_n + d_v)]
        kv = kv.view(*lead, self.heads, self.d_nope + self.d_v)
        k_nope, v = kv.split([self.d_nope, self.d_v], dim=-1)
        return q.view(*lead, self.heads, self.d_qk), k_nope, k_rope.unsqueeze(-2), v

    def _rotate(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rope part t [.., n, d_r] rotated (interleaved or half-split pairs)."""
        if self.cfg.mla_rope_interleave:
            return apply_rope_interleaved(t, cos, sin)
        return apply_rope(t, cos, sin)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | None = None, doc: DocContext | None = None) -> torch.Tensor:
        """x [b, s, h] -> [b, s, h] when :attr:`batch_first`, else [s(/tp), b, h] ->
        [s(/tp), b, h]; ``rope``: cos, sin [S, d_r/2]; ``doc``: document-boundary resets."""
        x = self._enter_tp(x)  # [b, s, h] or [s, b, h]
        lead = tuple(x.shape[:2])
        s = lead[1] if self.batch_first else lead[0]
        q, k_nope, k_rope, v = self._project(x, lead)
        q_nope, q_rope = q.split([self.d_nope, self.d_rope], dim=-1)
        start = cache.length if cache is not None else 0
        if rope is not None:
            cos, sin = self._rope_angles(rope, start, s, doc)
            q_rope, k_rope = self._rotate(q_rope, cos, sin), self._rotate(k_rope, cos, sin)
        q = torch.cat([q_nope, q_rope], dim=-1)  # [.., a/tp, d]
        k = torch.cat([k_nope, k_rope.expand(*lead, self.heads, self.d_rope)], dim=-1)
        if self.q_factor != 1.0:
            q = q * self.q_factor
        q, k, v = self._heads_first(q), self._heads_first(k), self._heads_first(v)
        if cache is not None:
            k, v = cache.extend(k, v)  # [b, a/tp, start + s, d]
        mask = doc.mask if doc is not None else None
        padded = self.d_v != self.d_qk
        if padded:  # one width for every kernel: the fused ones keep O(s) memory
            v = F.pad(v, (0, self.d_qk - self.d_v))  # [b, a/tp, S, d]
        if self.ctx.cp_size > 1:
            out = self._cp_core(q, k, v, doc)  # [s/cp, b, a/tp d]
        elif self.recompute_core and self.training:
            out = checkpoint(self.core_attention, self.ctx.rng, q, k, v, start, mask)
        else:
            out = self.core_attention(q, k, v, start, mask)  # [.., a/tp d]
        if padded:  # the zero columns cut: [.., a/tp d] -> [.., a/tp d_v]
            out = out.unflatten(-1, (self.heads, self.d_qk))[..., :self.d_v].flatten(-2)
        return self.o(out)
