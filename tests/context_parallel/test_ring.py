"""Ring attention on cp 1 / 2 / 3 / 4 gloo ranks against single-process float64 attention.

Every rank draws the same full-sequence q, k, v [b, heads, s, d] and output gradient, runs
``ring_attention`` on its zigzag rows, and returns its rows of out, dq, dk, dv. The parent
concatenates the ranks' rows in rank order, puts them in natural order with
``zigzag_order(s, cp).argsort()`` and compares with ``F.scaled_dot_product_attention`` on the
full sequence (GQA kv expanded there, doc mask & causality as a boolean mask):
rel_err < 1e-10 for the output and all three gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from colonnade.context_parallel import kernels
from colonnade.context_parallel.layout import take_local, zigzag_order
from colonnade.context_parallel.ring import ring_attention
from colonnade.parallel.dims import ParallelDims
from tests.parity import TOL, rank_groups, rel_err

B, HEADS, D = 2, 4, 8
CHUNK = 4
"""Rows per zigzag chunk: s = 2 cp CHUNK."""


def _inputs(cp: int, kv: int, docs: bool) -> dict[str, torch.Tensor]:
    """Full-sequence float64 inputs, the same on every rank (seeded)."""
    s = 2 * cp * CHUNK
    gen = torch.Generator().manual_seed(1234 + 10 * cp + kv)
    x = {name: torch.randn(B, heads, s, D, generator=gen, dtype=torch.float64)
         for name, heads in (("q", HEADS), ("k", kv), ("v", kv), ("dout", HEADS))}
    if docs:  # documents of random lengths, different per batch entry
        cuts = torch.randint(0, 3, (B, s), generator=gen) == 0
        x["doc_ids"] = torch.cumsum(cuts.long(), dim=1)  # [b, s]
    return x


def _reference(x: dict[str, torch.Tensor], causal: bool) -> dict[str, torch.Tensor]:
    """Single-process attention on the full sequence, with autograd."""
    q, k, v = (x[n].clone().requires_grad_(True) for n in ("q", "k", "v"))
    s = q.shape[2]
    allowed = torch.ones(B, 1, s, s, dtype=torch.bool)
    if causal:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).tril()
    if "doc_ids" in x:
        d = x["doc_ids"]
        allowed = allowed & (d[:, :, None] == d[:, None, :]).unsqueeze(1)
    g = HEADS // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                         v.repeat_interleave(g, 1), attn_mask=allowed)
    out.backward(x["dout"])
    assert q.grad is not None and k.grad is not None and v.grad is not None
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _ring_rank(cp: int, kv: int, causal: bool, docs: bool, overlap: bool,
               count: bool = False) -> dict[str, Any]:
    """One rank: ring attention on its zigzag rows; returns its rows, bytes and calls."""
    group = rank_groups(ParallelDims(cp=cp)).cp
    x = _inputs(cp, kv, docs)
    rank = group.rank
    q, k, v = (take_local(x[n], cp, rank, 2).requires_grad_(True) for n in ("q", "k", "v"))
    calls = {"forward": 0, "backward": 0}
    fwd, bwd = kernels.block_forward, kernels.block_backward

    def counted_fwd(*a: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls["forward"] += 1
        return fwd(*a, **kw)

    def counted_bwd(*a: Any, **kw: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        calls["backward"] += 1
        return bwd(*a, **kw)

    with mock.patch.object(kernels, "block_forward", counted_fwd), \
            mock.patch.object(kernels, "block_backward", counted_bwd):
        out = ring_attention(q, k, v, group, causal=causal, doc_ids=x.get("doc_ids"),
                             overlap=overlap)
        out.backward(take_local(x["dout"], cp, rank, 2))
    ops = group.stats.snapshot()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "calls": calls,
            "bytes": {key: op["payload_bytes"] for key, op in ops.items()},
            "kv_bytes": 2 * k.numel() * k.element_size()}


def _gathered(results: list[dict[str, Any]], cp: int) -> dict[str, torch.Tensor]:
    """Ranks' rows concatenated in rank order, then put in natural sequence order."""
    inv = zigzag_order(2 * cp * CHUNK, cp).argsort()
    return {n: torch.cat([r[n] for r in results], dim=2)[:, :, inv]
            for n in ("out", "dq", "dk", "dv")}


def _run(run_ranks: Callable[..., list[Any]], cp: int, kv: int, causal: bool, docs: bool,
         overlap: bool = True) -> list[dict[str, Any]]:
    results = run_ranks(cp, _ring_rank, cp, kv, causal, docs, overlap) if cp > 1 else \
        [_ring_rank(cp, kv, causal, docs, overlap)]
    ref = _reference(_inputs(cp, kv, docs), causal)
    got = _gathered(results, cp)
    for name, want in ref.items():
        err = rel_err(got[name], want)
        assert err < TOL, f"{name}: rel_err {err:.3e} (cp={cp}, kv={kv}, causal={causal})"
    return results


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kv", [4, 2, 1])
def test_ring_causal_gqa_matches_full_attention(run_ranks: Callable[..., list[Any]], cp: int,
                                                kv: int) -> None:
    _run(run_ranks, cp, kv, causal=True, docs=False)


@pytest.mark.parametrize("cp", [1, 3])
def test_ring_cp1_and_cp3(run_ranks: Callable[..., list[Any]], cp: int) -> None:
    _run(run_ranks, cp, 2, causal=True, docs=False)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_non_causal_and_doc_ids(run_ranks: Callable[..., list[Any]], causal: bool) -> None:
    _run(run_ranks, 2, 2, causal=causal, docs=not causal)
    _run(run_ranks, 4, 1, causal=causal, docs=True)


def test_overlap_on_off_bit_identical(run_ranks: Callable[..., list[Any]]) -> None:
    on = _run(run_ranks, 4, 2, causal=True, docs=True, overlap=True)
    off = _run(run_ranks, 4, 2, causal=True, docs=True, overlap=False)
    for a, b in zip(on, off, strict=True):
        for name in ("out", "dq", "dk", "dv"):
            assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("causal", [True, False])
def test_skipped_blocks_and_bytes(run_ranks: Callable[..., list[Any]], causal: bool) -> None:
    """Causal: of the 4 cp^2 chunk pairs only the 2 cp^2 + cp with ck <= cq run (each rank:
    2 cp + 1 forward and backward kernel calls: 3 at step 0, 2 at every other step); bytes per
    rank: forward (cp-1) bytes(k+v), backward (cp-1) bytes(k+v) + cp bytes(dk+dv)."""
    cp = 4
    results = _run(run_ranks, cp, 2, causal=causal, docs=False)
    for r in results:
        want = 2 * cp + 1 if causal else 4 * cp
        assert r["calls"] == {"forward": want, "backward": want}
        kvb = r["kv_bytes"]
        assert r["bytes"]["cp/p2p/cp_ring_kv"] == (cp - 1) * kvb
        assert r["bytes"]["cp/p2p/cp_ring_bwd"] == (cp - 1) * kvb + cp * kvb
        assert set(r["bytes"]) == {"cp/p2p/cp_ring_kv", "cp/p2p/cp_ring_bwd"}


def test_graph_break_under_compile_and_input_checks() -> None:
    """ring_attention is not traced by torch.compile (a graph break; same numbers), and bad
    shapes are refused naming what to change."""
    group = rank_groups(ParallelDims()).cp
    x = _inputs(1, 2, False)
    q = x["q"].clone().requires_grad_(True)

    def loss(q: torch.Tensor) -> torch.Tensor:
        return (ring_attention(q * 2, x["k"], x["v"], group) + 1).pow(2).sum()

    eager = loss(q)
    (g_eager,) = torch.autograd.grad(eager, q)
    compiled = torch.compile(loss, backend="eager")(q)
    (g_comp,) = torch.autograd.grad(compiled, q)
    assert torch.equal(compiled, eager) and torch.equal(g_comp, g_eager)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ring_attention(x["q"], x["k"][:, :1].repeat(1, 3, 1, 1), x["v"][:, :1].repeat(1, 3, 1, 1),
                       group)
    with pytest.raises(ValueError, match=r"doc_ids must be \[b, s\]"):
        ring_attention(x["q"], x["k"], x["v"], group, doc_ids=torch.zeros(B, 3).long())
