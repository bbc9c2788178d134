"""Precision-aware states through colonnade.optim.chunked: the chunk plan covers every element
once, and Muon's momentum / masters stored in bf16 are the fp32 update rounded to nearest."""

from __future__ import annotations

import torch

from colonnade.config.sections import OptimConfig
from colonnade.optim.chunked import chunk_spans
from colonnade.optim.muon import FlatMuon, LocalOrthogonalizer, MuonHyper, MuonSlot


def test_chunk_spans_tile_each_group_within_the_chunk() -> None:
    """Groups [5, 0, 9] and [4]: batches never mix groups, never exceed 4 elements, and cover
    every element once in order (a tensor longer than a chunk is split)."""
    batches = chunk_spans([[5, 0, 9], [4]], 4)
    assert all(len({g for g, *_ in b}) == 1 for b in batches)
    assert all(sum(hi - lo for _, _, lo, hi in b) <= 4 for b in batches)
    covered = [(g, i, e) for b in batches for g, i, lo, hi in b for e in range(lo, hi)]
    want = [(0, i, e) for i, n in enumerate([5, 0, 9]) for e in range(n)]
    assert covered == want + [(1, 0, e) for e in range(4)]
    assert [sum(hi - lo for *_, lo, hi in b) for b in batches] == [4, 4, 4, 2, 4]


def _muon(momentum_dtype: torch.dtype, master_dtype: torch.dtype, steps: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``steps`` FlatMuon updates of one [6, 4] matrix from fp32 gradients (x 0.5), with
    momentum and master stored in the given dtypes; (W, M) as fp32."""
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(6, 4, generator=gen).to(master_dtype))
    momentum = torch.zeros(24, dtype=momentum_dtype)
    grad = torch.zeros(24)
    hyper = MuonHyper.of(OptimConfig(name="muon"))
    opt = FlatMuon([MuonSlot(w, None, 0, 24)], [w.data.view(-1)], [grad], [momentum],
                   LocalOrthogonalizer(), hyper)
    for _ in range(steps):
        grad.copy_(torch.randn(24, generator=gen))
        opt.update(lr=0.02, weight_decay=0.1, grad_scale=0.5)
    return w.detach().float(), momentum.float()


def test_bf16_muon_states_are_the_fp32_update_rounded() -> None:
    """bf16 momentum and bf16 master: each step equals the fp32 step on the upcast values,
    rounded to nearest bf16 (emulated by an fp32 run that rounds both after every step)."""
    got_w, got_m = _muon(torch.bfloat16, torch.bfloat16, 3)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(6, 4, generator=gen).bfloat16()
    m = torch.zeros(24, dtype=torch.bfloat16)
    for _ in range(3):
        w32 = torch.nn.Parameter(w.float())
        m32, grad = m.float(), torch.randn(24, generator=gen)
        FlatMuon([MuonSlot(w32, None, 0, 24)], [w32.data.view(-1)], [grad], [m32],
                 LocalOrthogonalizer(), MuonHyper.of(OptimConfig(name="muon"))).update(
            lr=0.02, weight_decay=0.1, grad_scale=0.5)
        w, m = w32.detach().bfloat16(), m32.bfloat16()
    assert torch.equal(got_w, w.float()) and torch.equal(got_m, m.float())
    fp32_w, _ = _muon(torch.float32, torch.float32, 3)
    assert 0 < float((got_w - fp32_w).abs().max()) < 0.02  # bf16 rounding, not a new update
