"""The AdamW update equals torch.optim.AdamW (float64, decay on some ranges only, gradients
scaled), with the foreach form and with the fused kernel."""

from __future__ import annotations

import pytest
import torch

from colonnade.optim.adamw import AdamWGroup, AdamWHyper, FlatAdamW, adamw_update, fused_supported


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


def test_fused_kernel_is_chosen_on_cpu_for_fp32_and_fp64() -> None:
    """The one choice: torch._fused_adamw_ where it runs (CPU fp32/fp64), foreach elsewhere."""
    assert fused_supported("cpu", torch.float64) and fused_supported("cpu", torch.float32)
    assert not fused_supported("cpu", torch.bfloat16)  # the kernel rejects bf16 on CPU


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_flat_adamw_matches_torch_adamw(fused: bool, scale: float) -> None:
    """FlatAdamW on one flat range cut into decayed [0, 30) and non-decayed [30, 50) pieces
    equals torch.optim.AdamW (decay on the first parameter only) in float64, either kernel."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(50, dtype=torch.float64, generator=gen)
    ref_a, ref_b = torch.nn.Parameter(w[:30].clone()), torch.nn.Parameter(w[30:].clone())
    hp = AdamWHyper(lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    torch_opt = torch.optim.AdamW([{"params": [ref_a], "weight_decay": 0.1},
                                   {"params": [ref_b], "weight_decay": 0.0}],
                                  lr=hp.lr, betas=(hp.beta1, hp.beta2), eps=hp.eps)
    flat, grad = w.clone(), torch.zeros(50, dtype=torch.float64)
    m, v = torch.zeros(50, dtype=torch.float64), torch.zeros(50, dtype=torch.float64)
    groups = [AdamWGroup([flat[:30]], [grad[:30]], [m[:30]], [v[:30]], True)]
    groups.append(AdamWGroup([flat[30:]], [grad[30:]], [m[30:]], [v[30:]], False))
    opt = FlatAdamW([flat], [grad], [m], [v], [flat[:30]], groups, fused=fused)
    assert opt.fused == fused
    for step in range(1, 6):
        g = torch.randn(50, dtype=torch.float64, generator=gen)
        ref_a.grad, ref_b.grad = g[:30] * scale, g[30:] * scale
        torch_opt.step()
        grad.copy_(g)
        opt.update(step, hp, grad_scale=scale)
        # fused: the gradient holds the scaled gradient afterwards; foreach leaves it alone
        assert torch.equal(grad, g * scale if fused else g)
        want = torch.cat([ref_a.detach(), ref_b.detach()])
        torch.testing.assert_close(flat, want, rtol=1e-14, atol=1e-15)
    assert float((flat - w).abs().min()) > 0, "every element moved"
