"""Attention sinks (gpt-oss): one learned logit per head in every row's softmax denominator.

The reference is transformers' gpt-oss eager formula written out: the sink logit appended as
an extra score column, a softmax over [scores, sink], the sink's column dropped. Against it,
in float64, values and the gradients of q, k, v and the sinks: the fused path (a kernel that
returns lse, then out sigmoid(lse - s)), with GQA, a document mask, a fully masked row, a
bottom-right prefill after a cached prefix; the eager dropout kernel with the same keep-mask;
and a KV-cache prefill in pieces through the model. Ring and all-to-all attention with sinks
are checked end to end by tests/families/test_gpt_oss.py (cp2 layouts).
"""

from __future__ import annotations

import math

import pytest
import torch

from colonnade.config.sections import Config, ModelConfig
from colonnade.context_parallel.sinks import attention_with_sinks
from colonnade.models.build import build_reference
from colonnade.models.dropout_attention import DropoutSpec, dropout_attention
from colonnade.parallel.rng import RNGTracker

B, A, KV, S, D = 2, 4, 2, 9, 8


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
             allowed: torch.Tensor, keep: torch.Tensor | None = None, p: float = 0.0
             ) -> torch.Tensor:
    """softmax([q k^T / sqrt(d) (masked), s_h]) without its last column, (dropped out) @ v."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed,
                                                                             float("-inf"))
    column = sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    if keep is not None:
        probs = probs * keep / (1 - p)
    return probs @ vv


def _inputs(s: int, total: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    shapes = [(B, A, s, D), (B, KV, total, D), (B, KV, total, D), (A,)]
    return [(torch.randn(shape, generator=gen, dtype=torch.float64) * (2.0 if len(shape) == 1
                                                                        else 1.0)
             ).requires_grad_(True) for shape in shapes]


def _compare(got: torch.Tensor, want: torch.Tensor, inputs: list[torch.Tensor]) -> float:
    """Largest absolute difference of the outputs and of every input's gradient."""
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)
    g_got = torch.autograd.grad(got, inputs, grad)
    g_want = torch.autograd.grad(want, inputs, grad)
    diffs = [float((got - want).detach().abs().max())]
    diffs += [float((a - b).abs().max()) for a, b in zip(g_got, g_want, strict=True)]
    assert all(float(g.abs().max()) > 1e-3 for g in g_want)  # every gradient is exercised
    return max(diffs)


@pytest.mark.parametrize("case", ["causal", "doc-mask", "prefill"])
def test_fused_sinks_equal_the_explicit_softmax(case: str) -> None:
    total = S + 4 if case == "prefill" else S  # prefill: 4 cached keys before the S queries
    q, k, v, sinks = inputs = _inputs(S, total)
    allowed = torch.ones(S, total, dtype=torch.bool).tril(total - S)  # bottom-right causal
    mask = None
    if case == "doc-mask":  # two documents; row 0 of batch 1 sees no key at all
        doc = (torch.arange(S) >= 4).long()
        allowed = ((doc[:, None] == doc[None, :]) & allowed).expand(B, 1, S, S).clone()
        allowed[1, 0, 0] = False
        mask = allowed
    elif case == "prefill":
        mask = allowed
    got = attention_with_sinks(q, k, v, sinks, causal=case == "causal", mask=mask)
    assert _compare(got, explicit(q, k, v, sinks, allowed), inputs) < 1e-13


def test_dropout_kernel_sinks_equal_the_explicit_softmax() -> None:
    q, k, v, sinks = inputs = _inputs(S, S)
    p = 0.3
    spec = DropoutSpec(RNGTracker(11), "layers.0.attn.attn_dropout", p, 2 * A, A)  # heads 4..7
    keep = spec.rng.keep_mask(spec.site, (B, 2 * A, S, S), p, (slice(None), slice(A, 2 * A)),
                              torch.device("cpu"))
    allowed = torch.ones(S, S, dtype=torch.bool).tril()
    want = explicit(q, k, v, sinks, allowed, keep, p)
    got = dropout_attention(q, k, v, spec, None, budget=3 * B * A * S, sinks=sinks)  # 3 rows
    assert _compare(got, want, inputs) < 1e-13


def test_kv_cache_prefill_in_pieces_equals_one_pass() -> None:
    """gpt-oss's attention with sinks and a window of 4: prefill 5 tokens, then 6 at once
    (bottom-right mask after the cache), then 1; the logits of one pass."""
    cfg = ModelConfig(arch="gpt_oss", num_layers=2, hidden_size=32, num_heads=4,
                      num_kv_heads=2, head_dim=8, ffn_hidden_size=24, vocab_size=101,
                      max_seq_len=16, bias=True, num_experts=4, moe_top_k=2,
                      moe_router_bias=True, sliding_window=4, sliding_window_layers=(0,),
                      init_std=0.3)
    model = build_reference(Config(model=cfg), torch.float64).eval()
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = model.full_logits(tokens)  # [b, s, V], no cache
        caches = model.new_caches(2, 16)
        parts = [model.full_logits(tokens[:, lo:hi], caches)
                 for lo, hi in ((0, 5), (5, 11), (11, 12))]
    err = float((torch.cat(parts, dim=1) - whole).abs().max())
    assert err < 1e-12, f"chunked prefill differs from one prefill by {err:.3e}"


def test_bf16_sinks_close_to_float64() -> None:
    """The fused path in bf16 (lse and the sink factor in float32): output and gradients
    within bf16 rounding of the float64 reference."""
    q, k, v, sinks = inputs = _inputs(S, S)
    allowed = torch.ones(S, S, dtype=torch.bool).tril()
    want = explicit(q, k, v, sinks, allowed)
    low = [t.detach().to(torch.bfloat16).requires_grad_(True) for t in inputs]
    got = attention_with_sinks(*low, causal=True)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(1),
                       dtype=torch.float64)
    g_want = torch.autograd.grad(want, inputs, grad)
    g_got = torch.autograd.grad(got, low, grad.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16 and g_got[3].dtype == torch.bfloat16
    for a, b in zip((got, *g_got), (want, *g_want), strict=True):
        err = float((a.detach().double() - b.detach()).norm() / b.detach().norm())
        assert err < 2e-2, err
