"""The foreach AdamW update equals torch.optim.AdamW (float64, decay on some ranges only,
gradients scaled on the fly)."""

from __future__ import annotations

import pytest
import torch

from colonnade.optim.adamw import AdamWHyper, adamw_update


@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_flat_update_matches_torch_adamw(scale: float) -> None:
    """torch gets grads g * scale; the flat update reads g with grad_scale and leaves g alone."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(50, dtype=torch.float64, generator=gen)  # 0..29 decayed, 30..49 not
    ref_a = torch.nn.Parameter(w[:30].clone())
    ref_b = torch.nn.Parameter(w[30:].clone())
    hp = AdamWHyper(lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    torch_opt = torch.optim.AdamW([{"params": [ref_a], "weight_decay": 0.1},
                                   {"params": [ref_b], "weight_decay": 0.0}],
                                  lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps)
    flat = w.clone()
    # two ranges of the flat vector, as a ZeRO-1 shard split across two buckets would be
    params = [flat[:20], flat[20:]]
    m = [torch.zeros(20, dtype=torch.float64), torch.zeros(30, dtype=torch.float64)]
    v = [torch.zeros(20, dtype=torch.float64), torch.zeros(30, dtype=torch.float64)]
    decayed = [params[0], params[1][:10]]
    for step in range(1, 6):
        g = torch.randn(50, dtype=torch.float64, generator=gen)
        ref_a.grad, ref_b.grad = g[:30] * scale, g[30:] * scale
        torch_opt.step()
        before = g.clone()
        adamw_update(params, [g[:20], g[20:]], m, v, decayed, step, hp, grad_scale=scale)
        assert torch.equal(g, before)
        want = torch.cat([ref_a.detach(), ref_b.detach()])
        torch.testing.assert_close(flat, want, rtol=1e-14, atol=1e-15)
    assert float((flat - w).abs().min()) > 0, "every element moved"
