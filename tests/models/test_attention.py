"""Attention paths: the KV-cache prefill mask, and the blockwise dropout kernel (float64).

* A prefill of several tokens after a cached prefix (start > 0) is bottom-right causal:
  chunked prefill gives the logits of one prefill (it was unmasked: ``is_causal`` only at 0).
* Attention with dropout runs query blocks: equal to a dense reference that materialises the
  [b, a, s, S] probabilities and applies the same keep-mask, forward and gradients, for any
  block size, grouped-query heads, a document mask and a cached offset; its peak live memory
  is a fraction of one [b, a, s, s] tensor; masks are drawn per block and redrawn in backward.
* Dropout 0 (or eval) runs the fused SDPA path; dropout > 0 in training the blockwise one.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from colonnade.analysis.measure import PeakTensorBytes
from colonnade.models import blocks
from colonnade.models.build import build_reference
from colonnade.models.dropout_attention import DropoutSpec, block_rows, dropout_attention
from colonnade.parallel.rng import MaskStream, RNGTracker
from tests.models.test_model import tiny

P = 0.3
CPU_DEVICE = torch.device("cpu")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_chunked_prefill_equals_one_prefill(arch: str) -> None:
    """Prefill 5 tokens, then 6 at once (start = 5 > 0), then 1: the logits of one pass."""
    model = build_reference(tiny(arch), torch.float64).eval()
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = model.full_logits(tokens)  # [b, s, V], no cache
        caches = model.new_caches(2, 32)
        parts = [model.full_logits(tokens[:, lo:hi], caches)
                 for lo, hi in ((0, 5), (5, 11), (11, 12))]
    chunked = torch.cat(parts, dim=1)
    assert caches[0].length == 12
    err = float((chunked - whole).abs().max())
    assert err < 1e-12, f"{arch}: chunked prefill differs from one prefill by {err:.3e}"


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: DropoutSpec,
                    mask: torch.Tensor | None) -> torch.Tensor:
    """softmax + the full keep-mask drawn at once, all [b, a, s, S] tensors materialised."""
    b, a, s, d = q.shape
    total, rep = k.shape[2], a // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ kk.transpose(-1, -2) / math.sqrt(d)
    allowed = (torch.ones(s, total, dtype=torch.bool, device=q.device).tril(total - s)
               if mask is None else mask)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    index = (slice(None), slice(spec.head_offset, spec.head_offset + a))
    keep = spec.rng.keep_mask(spec.site, (b, spec.heads_total, s, total), spec.p, index,
                              q.device)
    return (probs * keep / (1 - spec.p)) @ vv


def _inputs(s: int, total: int, kv: int = 2) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, s, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv, total, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv, total, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("case", ["causal", "gqa-offset", "doc-mask"])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_blockwise_equals_dense(case: str, rows: int) -> None:
    s, total = 10, (14 if case == "gqa-offset" else 10)
    q, k, v = _inputs(s, total, kv=2 if case == "gqa-offset" else 4)
    mask = None
    if case == "doc-mask":  # two documents per row: [0, 4) and [4, 10)
        doc = (torch.arange(s) >= 4).long()
        same = doc.unsqueeze(1) == doc.unsqueeze(0)
        mask = (same & torch.ones(s, s, dtype=torch.bool).tril()).expand(2, 1, s, s)
    spec = DropoutSpec(RNGTracker(11), "layers.0.attn.attn_dropout", P, 8, 4)  # heads 4..7
    want = dense_reference(q, k, v, spec, mask)
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got = dropout_attention(q, k, v, spec, mask, budget=rows * 2 * 4 * total)
    assert block_rows(2, 4, s, total, rows * 2 * 4 * total) == min(rows, s)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    assert float((got - want).detach().abs().max()) < 1e-13
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        assert float((g - w).abs().max()) < 1e-12, f"d{name} differs"


def test_blockwise_gradcheck() -> None:
    q, k, v = _inputs(5, 7, kv=2)
    spec = DropoutSpec(RNGTracker(2), "s", 0.5, 4, 0)
    assert torch.autograd.gradcheck(
        lambda q, k, v: dropout_attention(q, k, v, spec, None, budget=2 * 4 * 7 * 2), (q, k, v))


def test_blockwise_memory_and_draws(monkeypatch: pytest.MonkeyPatch) -> None:
    """s = 256 in blocks of 8 rows: peak live bytes of forward + backward stay far below one
    [b, a, s, s] float64 tensor (the dense path holds several), and masks are drawn block by
    block: 32 forward draws of [2, 4, 8, 256] and the same 32 again in backward."""
    s, rows = 256, 8
    q, k, v = _inputs(s, s, kv=4)
    draws: list[tuple[int, ...]] = []
    original = MaskStream.keep

    def counting(self: MaskStream, *args: Any) -> torch.Tensor:
        out = original(self, *args)
        draws.append(tuple(out.shape))
        return out

    monkeypatch.setattr(MaskStream, "keep", counting)
    spec = DropoutSpec(RNGTracker(3), "site", P, 4, 0)
    full_scores = 2 * 4 * s * s * 8
    with PeakTensorBytes() as meter:
        out = dropout_attention(q, k, v, spec, None, budget=rows * 2 * 4 * s)
        out.sum().backward()
    assert draws == [(2, 4, rows, s)] * (2 * s // rows)
    assert meter.peak < 0.4 * full_scores, f"peak {meter.peak} B vs one score tensor {full_scores}"
    with PeakTensorBytes() as dense:
        dense_reference(q, k, v, spec, None).sum().backward()
    assert dense.peak > 3 * full_scores > 6 * meter.peak


def test_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout 0 or eval: SDPA (fused); dropout > 0 in training: blockwise, never SDPA."""
    calls: list[str] = []
    sdpa, blockwise = blocks.F.scaled_dot_product_attention, blocks.dropout_attention

    def fake_sdpa(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("sdpa")
        return sdpa(*args, **kwargs)

    def fake_blockwise(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append("blockwise")
        return blockwise(*args, **kwargs)

    monkeypatch.setattr(blocks.F, "scaled_dot_product_attention", fake_sdpa)
    monkeypatch.setattr(blocks, "dropout_attention", fake_blockwise)
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    for extra, train, want in (([], True, "sdpa"), (["--model.attention_dropout=0.1"], True,
                                                     "blockwise"),
                               (["--model.attention_dropout=0.1"], False, "sdpa")):
        model = build_reference(tiny("llama", *extra), torch.float64).train(train)
        calls.clear()
        model.full_logits(tokens)
        assert calls == [want] * 2, (extra, train, calls)


def test_blockwise_bf16_close_to_fp32() -> None:
    """bf16 inputs (fp32 softmax and accumulation inside): within bf16 rounding of the fp32
    dense reference on the same inputs, output and gradients."""
    q, k, v = (t.detach() for t in _inputs(12, 12, kv=2))
    spec = DropoutSpec(RNGTracker(5), "s", 0.1, 4, 0)
    grad = torch.randn(2, 4, 12, 8, generator=torch.Generator().manual_seed(2))
    ref_in = [t.float().requires_grad_() for t in (q, k, v)]
    want = dense_reference(*ref_in, spec, None)
    want_grads = torch.autograd.grad(want, ref_in, grad)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    got = dropout_attention(*low, spec, None, budget=3 * 2 * 4 * 12)
    got_grads = torch.autograd.grad(got, low, grad.bfloat16())
    assert got.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got_grads)
    for name, g, w in zip(["out", "dq", "dk", "dv"], [got, *got_grads], [want, *want_grads],
                          strict=True):
        err = float((g.float() - w).detach().norm() / w.detach().norm())
        assert err < 2e-2, f"{name}: relative error {err:.3e}"


@pytest.mark.gpu
def test_cuda_masks_equal_cpu_and_blockwise_matches_dense() -> None:
    """On a GPU: the counter-based masks are bit-identical to the CPU's (int64 wrap-around and
    shifts agree; other draw chunk size), and the blockwise kernel matches the dense reference
    (float64) and runs in bf16."""
    cuda = torch.device("cuda")
    tracker = RNGTracker(seed=3)
    full, index = (2, 8, 300, 300), (slice(None), slice(4, 8))
    on_cpu = tracker.keep_mask("layers.1.attn.attn_dropout", full, 0.1, index, CPU_DEVICE)
    on_gpu = tracker.keep_mask("layers.1.attn.attn_dropout", full, 0.1, index, cuda)
    assert torch.equal(on_gpu.cpu(), on_cpu)
    q, k, v = (t.detach().to(cuda).requires_grad_() for t in _inputs(10, 14, kv=2))
    spec = DropoutSpec(tracker, "s", P, 8, 4)
    want = dense_reference(q, k, v, spec, None)
    got = dropout_attention(q, k, v, spec, None, budget=3 * 2 * 4 * 14)
    assert float((got - want).detach().abs().max()) < 1e-12
    low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]
    out = dropout_attention(*low, spec, None)
    out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in low)
