"""The AdamW update equals torch.optim.AdamW (float64, decay on some ranges only, gradients
scaled), with the foreach form and with the fused kernel."""

from __future__ import annotations

import pytest
import torch

from colonnade.optim.adamw import AdamWGroup, AdamWHyper, FlatAdamW, adamw_update, fused_supported
from colonnade.optim.chunked import ChunkedCompute


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


def _run_flat(fused: bool, master: torch.dtype, state: torch.dtype, chunk: int | None = None,
              steps: int = 10, n: int = 500) -> list[torch.Tensor]:
    """``steps`` FlatAdamW updates of n elements (decayed [0, 3n/5), the rest not) with
    masters of ``master`` and m, v of ``state``, gradients x 0.37; (w, m, v) as float64."""
    gen = torch.Generator().manual_seed(2)
    compute = torch.float64 if master == torch.float64 else torch.float32
    w = torch.randn(n, dtype=torch.float64, generator=gen).to(master)
    grad = torch.zeros(n, dtype=compute)
    m, v = torch.zeros(n, dtype=state), torch.zeros(n, dtype=state)
    k = 3 * n // 5
    groups = [AdamWGroup([w[:k]], [grad[:k]], [m[:k]], [v[:k]], True),
              AdamWGroup([w[k:]], [grad[k:]], [m[k:]], [v[k:]], False)]
    opt = FlatAdamW([w], [grad], [m], [v], [w[:k]], groups, fused=fused, compute=compute)
    assert (opt.chunked is not None) == (master != compute or state != compute)
    if chunk is not None:
        assert opt.chunked is not None
        opt.chunked = ChunkedCompute([[k], [n - k]], [master, compute, state, state], compute,
                                     w.device, chunk)
    hp = AdamWHyper(lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in range(1, steps + 1):
        grad.copy_(torch.randn(n, dtype=torch.float64, generator=gen))
        opt.update(step, hp, grad_scale=0.37)
    return [t.double() for t in (w, m, v)]


DTYPES = [(torch.float64, torch.float64), (torch.float32, torch.float32),
          (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
          (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize(("master", "state"), DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_fused_matches_foreach_per_dtype(master: torch.dtype, state: torch.dtype) -> None:
    """Fused kernel against the foreach form after 10 steps, weights w (measured, torch 2.13
    CPU): fp64 masters differ by <= 4.4e-16 (2 ulp of |w| <= 4: the kernel's own operation
    order), fp32 by <= 2.4e-7 (2 ulp); bf16 masters (fp32 compute in chunks, rounded back)
    are equal bit for bit here; the bound asserted is 8 ulp of the master dtype times
    max |w|, and bit equality for bf16 masters."""
    fused, foreach = _run_flat(True, master, state), _run_flat(False, master, state)
    ulp = torch.finfo(master).eps
    w_f, w_e = fused[0], foreach[0]
    assert float((w_f - w_e).abs().max()) <= 8 * ulp * float(w_e.abs().max())
    if master == torch.bfloat16:
        assert torch.equal(w_f, w_e)
    moved = (w_e != _run_flat(False, master, state, steps=0)[0]).double().mean()
    assert float(moved) > 0.95, "the updates must move the weights"


def test_bf16_storage_is_an_fp32_update_rounded() -> None:
    """bf16 masters and moments, updated through fp32 chunks of 7 elements (many chunks, one
    tensor split across them, the two weight-decay groups apart), equal step by step the fp32
    update of the upcast values rounded to nearest bf16: the chunking changes nothing."""
    got = _run_flat(False, torch.bfloat16, torch.bfloat16, chunk=7, steps=4)
    gen = torch.Generator().manual_seed(2)
    n, k = 500, 300
    w = torch.randn(n, dtype=torch.float64, generator=gen).to(torch.bfloat16)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    hp = AdamWHyper(lr=0.01, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in range(1, 5):
        g = torch.randn(n, dtype=torch.float64, generator=gen).float()
        w32, m32, v32 = w.float(), m.float(), v.float()
        adamw_update([w32], [g], [m32], [v32], [w32[:k]], step, hp, grad_scale=0.37)
        w, m, v = w32.bfloat16(), m32.bfloat16(), v32.bfloat16()
    for a, b in zip(got, (w, m, v), strict=True):
        assert torch.equal(a, b.double())
    space = ChunkedCompute([[k], [n - k]], [torch.bfloat16, torch.float32, torch.bfloat16,
                                            torch.bfloat16], torch.float32,
                           torch.device("cpu"), 7)
    assert space.workspace_bytes == 3 * 7 * 4  # w, m, v upcast; the fp32 gradient is not
