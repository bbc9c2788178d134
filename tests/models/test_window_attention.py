"""Sliding-window attention in the single-process attention paths (float64).

* The KV cache across the window's edge: a prefill of 5 tokens, 6 more at once (a prefill
  after a cached prefix, start > 0) and one decoded token, window 3, give the logits of one
  uncached pass; the window changes them (against the same weights without it).
* The blockwise dropout kernel with the window's mask (what ``Attention.attend`` passes it in
  training with attention dropout, also under all-to-all cp) equals the dense reference that
  materialises softmax(scores + band) and the same keep-mask, forward and gradients, for
  grouped-query heads and a cached offset (S > s).
"""

from __future__ import annotations

import dataclasses

import torch

from colonnade.context_parallel import masks
from colonnade.models.build import build_reference
from colonnade.models.dropout_attention import DropoutSpec, dropout_attention
from colonnade.parallel.rng import RNGTracker
from tests.models.test_attention import _inputs, dense_reference
from tests.models.test_model import tiny


def test_kv_cache_across_the_window_edge() -> None:
    cfg = tiny("llama", "--model.arch=mistral", "--model.sliding_window=3")
    model = build_reference(cfg, torch.float64).eval()
    plain = build_reference(dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, sliding_window=None)), torch.float64).eval()
    plain.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        whole = model.full_logits(tokens)  # [b, s, V], no cache
        caches = model.new_caches(2, 32)
        parts = [model.full_logits(tokens[:, lo:hi], caches)
                 for lo, hi in ((0, 5), (5, 11), (11, 12))]
        unwindowed = plain.full_logits(tokens)
    err = float((torch.cat(parts, dim=1) - whole).abs().max())
    assert err < 1e-12, f"cached windowed logits differ by {err:.3e}"
    assert float((whole[:, :3] - unwindowed[:, :3]).abs().max()) < 1e-12  # within the window
    assert float((whole[:, 3:] - unwindowed[:, 3:]).abs().max()) > 1e-3  # past its edge


def test_dropout_kernel_with_a_window() -> None:
    s, total, window = 10, 14, 4
    q, k, v = _inputs(s, total, kv=2)
    spec = DropoutSpec(RNGTracker(3), "layers.1.attn.attn_dropout", 0.3, 8, 4)
    mask = masks.attention_mask(s, total, window, None, q.device)  # [1, 1, s, S]
    assert mask is not None and int(mask.sum()) == s * window  # every query sees W keys
    want = dense_reference(q, k, v, spec, mask.expand(2, 1, s, total))
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got = dropout_attention(q, k, v, spec, mask, budget=3 * 2 * 4 * total)  # 3-row blocks
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    assert float((got - want).detach().abs().max()) < 1e-13
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        assert float((g - w).abs().max()) < 1e-12, f"d{name} differs"
